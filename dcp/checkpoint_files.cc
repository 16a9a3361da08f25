#include "dcp/checkpoint_files.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include "dcp/proto/error.h"
#include "dcp/storage/checkpoint/store_checkpoint.h"
#include "dcp/storage/format/layout.h"
#include "dcp/storage/registry.h"

namespace dcp {

bool RemoveCheckpointFiles(const std::string& uri, bool only_if_uncommitted,
                           const std::set<std::string>& keep) {
  std::shared_ptr<Store> store = OpenStore(uri);
  auto [scheme, location] = SplitUri(uri);
  if (!DetectLayout(*store) && store->List().empty() && store->ListIncomplete().empty()) {
    if (scheme == "file") {
      std::error_code ec;
      std::filesystem::remove(location, ec);  // an empty directory at most; absent is fine
    }
    return true;  // nothing to remove
  }
  std::unique_ptr<StoreLock> lock =
      store->TryLock("checkpoint removal pid=" + std::to_string(::getpid()));
  const CheckpointLayout* layout = DetectLayout(*store);
  if (only_if_uncommitted && layout) return false;
  if (layout) store->Remove(layout->metadata_name());
  bool kept = false;
  for (const auto& name : store->List()) {
    if (keep.count(name)) {
      kept = true;
    } else if (name != kLockObjectName) {
      store->Remove(name);
    }
  }
  // A crashed save's unfinished uploads (s3://): their parts stay billed until discarded.
  for (const auto& name : store->ListIncomplete()) store->DiscardIncomplete(name);
  if (lock) lock->Release();
  if (kept) return false;
  if (scheme == "file") {
    std::error_code ec;
    std::filesystem::remove(location, ec);  // the now-empty directory; absent is fine
  }
  // Other backends have no containers to remove (an empty mem:// bucket, kv:// shard folders).
  return true;
}

std::string OnCoordinator(Communicator& comm, const std::string& what,
                          const std::function<std::string()>& fn) {
  std::string out;
  if (comm.rank() == 0) {
    try {
      out = "ok:" + fn();
    } catch (const Error& e) {
      out = "error:" + std::to_string(static_cast<int>(e.code())) + ":" + e.what();
    } catch (const std::exception& e) {
      out = "error:" + std::to_string(static_cast<int>(ErrorCode::kInternal)) + ":" + e.what();
    }
  }
  try {
    out = comm.Broadcast(out, 0, what);
  } catch (const CollectiveError&) {
    // Outside an operation nobody gathers this rank's failure: its peers go on into the next
    // save without it, and rank 0 would wait for it there until its deadline. A rank this
    // failure poisoned (a mismatch: another step; a failure from above) tells them now.
    comm.NotifyPeersOfPoison();
    throw;
  }
  if (out.rfind("error:", 0) == 0) {
    const size_t colon = out.find(':', 6);
    if (colon == std::string::npos) throw InternalError(what + ": malformed reply from rank 0");
    const auto code = static_cast<ErrorCode>(std::atoi(out.substr(6, colon - 6).c_str()));
    throw CollectiveError(what, {{0, code, out.substr(colon + 1), false}});
  }
  if (out.rfind("ok:", 0) != 0) throw InternalError(what + ": malformed reply from rank 0");
  return out.substr(3);
}

}  // namespace dcp
