// Version-3 checkpoints (docs/FORMAT.md, section 5b) may keep items in data files of sibling
// checkpoints, named "../<checkpoint>/<file>". A SiblingStore is the store of one checkpoint
// location that also answers Open, OpenKnownSize and Size for such names, from the store of
// the sibling location (opened on first use, then kept), so that every reader of data files
// (the load, the tools) reaches them without knowing. Every other call goes to the location's
// own store. The registry hands out Store-based locations wrapped in one (registry.cc).
// Internal (not installed). Thread-safe as its target.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "dcp/storage/store.h"

namespace dcp {

class SiblingStore : public ForwardingStore {
 public:
  /// `open_sibling(name)` opens the store of the location `name` beside this one (same parent);
  /// it may throw (NotFoundError, InvalidArgumentError for a location without a parent).
  SiblingStore(std::shared_ptr<Store> target,
               std::function<std::shared_ptr<Store>(const std::string&)> open_sibling);

  std::unique_ptr<ReadableObject> Open(const std::string& name) override;
  std::unique_ptr<ReadableObject> OpenKnownSize(const std::string& name, uint64_t size) override;
  std::optional<uint64_t> Size(const std::string& name) override;
  // The target's own (batched, one-request) versions: this wrapper changes no plain name's
  // behaviour.
  std::string ReadPrefix(const std::string& name, uint64_t max_bytes, uint64_t* size) override;
  std::optional<std::vector<std::pair<std::string, uint64_t>>> ListSizes(size_t max_names) override;
  void RemoveMany(const std::vector<std::string>& names) override;

  /// The store of sibling checkpoint `name` (a plain name).
  std::shared_ptr<Store> Sibling(const std::string& name);

 private:
  friend std::shared_ptr<Store> SiblingOf(Store& store, const std::string& name);
  std::function<std::shared_ptr<Store>(const std::string&)> open_sibling_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<Store>> siblings_;
};

/// The store of checkpoint `name` beside `store`'s location, itself a SiblingStore (so that the
/// references of that checkpoint resolve too; its own siblings are opened anew on first use)
/// when `store` is one, else InvalidArgumentError naming `store`'s URI (a store made without the
/// registry reaches no sibling).
std::shared_ptr<Store> SiblingOf(Store& store, const std::string& name);

/// `location` (a backend's location: a path, bucket/prefix) with its last component replaced
/// by `name`; InvalidArgumentError when it has no parent.
std::string SiblingLocation(const std::string& location, const std::string& name);

}  // namespace dcp
