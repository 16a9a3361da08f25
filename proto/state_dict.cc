#include "dcp/proto/state_dict.h"

#include "dcp/proto/error.h"

namespace dcp {

StateDict& StateDict::Set(const std::string& key, StateValue value) {
  items_[key] = std::move(value);
  return *this;
}

StateDict& StateDict::Nested(const std::string& key) {
  auto it = items_.find(key);
  if (it == items_.end()) {
    auto child = std::make_shared<StateDict>();
    StateDict& ref = *child;
    items_.emplace(key, std::move(child));
    return ref;
  }
  auto* nested = std::get_if<std::shared_ptr<StateDict>>(&it->second);
  if (nested == nullptr || *nested == nullptr) {
    throw InvalidArgumentError("state dict key '" + key + "' holds a leaf, not a nested dict");
  }
  return **nested;
}

StateValue* StateDict::Find(const std::string& key) {
  auto it = items_.find(key);
  return it == items_.end() ? nullptr : &it->second;
}

const StateValue* StateDict::Find(const std::string& key) const {
  auto it = items_.find(key);
  return it == items_.end() ? nullptr : &it->second;
}

}  // namespace dcp
