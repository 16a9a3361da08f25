#include "dcp/storage/sibling_store.h"

#include "dcp/proto/error.h"
#include "dcp/proto/schema/codec.h"

namespace dcp {

namespace {

// "../<checkpoint>/<file>" -> (checkpoint, file); nullopt for any other name.
std::optional<std::pair<std::string, std::string>> SplitReference(const std::string& name) {
  if (!IsSiblingReference(name)) return std::nullopt;
  const size_t slash = name.find('/', 3);
  return std::make_pair(name.substr(3, slash - 3), name.substr(slash + 1));
}

}  // namespace

SiblingStore::SiblingStore(std::shared_ptr<Store> target,
                           std::function<std::shared_ptr<Store>(const std::string&)> open_sibling)
    : ForwardingStore(std::move(target)), open_sibling_(std::move(open_sibling)) {}

std::shared_ptr<Store> SiblingStore::Sibling(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = siblings_.find(name);
  if (it != siblings_.end()) return it->second;
  std::shared_ptr<Store> store = open_sibling_(name);
  siblings_.emplace(name, store);
  return store;
}

std::unique_ptr<ReadableObject> SiblingStore::Open(const std::string& name) {
  if (auto ref = SplitReference(name)) return Sibling(ref->first)->Open(ref->second);
  return target_->Open(name);
}

std::unique_ptr<ReadableObject> SiblingStore::OpenKnownSize(const std::string& name,
                                                            uint64_t size) {
  if (auto ref = SplitReference(name)) {
    return Sibling(ref->first)->OpenKnownSize(ref->second, size);
  }
  return target_->OpenKnownSize(name, size);
}

std::optional<uint64_t> SiblingStore::Size(const std::string& name) {
  if (auto ref = SplitReference(name)) return Sibling(ref->first)->Size(ref->second);
  return target_->Size(name);
}

std::string SiblingStore::ReadPrefix(const std::string& name, uint64_t max_bytes, uint64_t* size) {
  if (auto ref = SplitReference(name)) {
    return Sibling(ref->first)->ReadPrefix(ref->second, max_bytes, size);
  }
  return target_->ReadPrefix(name, max_bytes, size);
}

std::optional<std::vector<std::pair<std::string, uint64_t>>> SiblingStore::ListSizes(
    size_t max_names) {
  return target_->ListSizes(max_names);
}

void SiblingStore::RemoveMany(const std::vector<std::string>& names) { target_->RemoveMany(names); }

std::shared_ptr<Store> SiblingOf(Store& store, const std::string& name) {
  if (auto* s = dynamic_cast<SiblingStore*>(&store)) {
    // The sibling's own references ("../<checkpoint>/<file>") name children of the same parent:
    // it reaches them through the same opener.
    return std::make_shared<SiblingStore>(s->Sibling(name), s->open_sibling_);
  }
  throw InvalidArgumentError("the store of " + store.uri() +
                             " reaches no checkpoint beside it (open it through the registry)");
}

std::string SiblingLocation(const std::string& location, const std::string& name) {
  std::string parent = location;
  while (parent.size() > 1 && parent.back() == '/') parent.pop_back();
  const size_t slash = parent.rfind('/');
  if (slash == std::string::npos || slash + 1 == parent.size()) {
    throw InvalidArgumentError("location '" + location +
                               "' has no parent, so no checkpoint beside it ('" + name + "')");
  }
  return parent.substr(0, slash + 1) + name;
}

}  // namespace dcp
