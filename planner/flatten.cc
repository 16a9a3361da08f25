#include "dcp/planner/planner.h"
#include "dcp/proto/error.h"

namespace dcp {

namespace {

template <typename Dict, typename Entry>
void FlattenInto(Dict& sd, const std::string& prefix, KeyPath& path,
                 std::map<std::string, Entry>& out) {
  for (auto& [key, value] : sd.items()) {
    if (key.empty()) {
      throw InvalidArgumentError("state dict has an empty key under '" + prefix + "'");
    }
    const std::string fqn = prefix.empty() ? key : prefix + "." + key;
    path.push_back(key);
    if (auto* nested = std::get_if<std::shared_ptr<StateDict>>(&value)) {
      if (*nested == nullptr) throw InvalidArgumentError("state dict entry '" + fqn + "' is null");
      if constexpr (std::is_const_v<Dict>) {
        FlattenInto<const StateDict>(**nested, fqn, path, out);
      } else {
        FlattenInto<StateDict>(**nested, fqn, path, out);
      }
    } else {
      auto [it, inserted] = out.emplace(fqn, Entry{path, &value});
      if (!inserted) {
        throw InvalidArgumentError("duplicate FQN '" + fqn +
                                   "': two state dict paths flatten to the same name");
      }
    }
    path.pop_back();
  }
}

}  // namespace

std::map<std::string, FlatEntry> FlattenStateDict(const StateDict& sd) {
  std::map<std::string, FlatEntry> out;
  KeyPath path;
  FlattenInto<const StateDict>(sd, "", path, out);
  return out;
}

std::map<std::string, MutableFlatEntry> FlattenStateDict(StateDict& sd) {
  std::map<std::string, MutableFlatEntry> out;
  KeyPath path;
  FlattenInto<StateDict>(sd, "", path, out);
  return out;
}

void InsertAtPath(StateDict& root, const KeyPath& path, StateValue value) {
  if (path.empty()) throw InvalidArgumentError("empty key path");
  StateDict* d = &root;
  for (size_t i = 0; i + 1 < path.size(); ++i) d = &d->Nested(path[i]);
  d->Set(path.back(), std::move(value));
}

}  // namespace dcp
