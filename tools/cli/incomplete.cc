// `dcp incomplete`: writes left unfinished at a location, the s3:// multipart uploads of a save
// that crashed (or whose writer could not abort them). They are not objects, so neither `dcp
// verify` nor a listing shows them, yet their parts stay stored and billed. The next save there
// discards them after its commit; this command lists them, and with --abort discards them at
// once under the location's writer lock (so never while a save holds it).
#include <unistd.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "dcp/storage/registry.h"
#include "tools/cli/cli_common.h"
#include "tools/cli/commands.h"

namespace dcp::cli {

int Incomplete(const std::string& path, bool abort, bool json) {
  std::shared_ptr<Store> store = OpenStore(path);
  const std::vector<std::string> names = store->ListIncomplete();
  std::unique_ptr<StoreLock> lock;
  if (abort && !names.empty()) {
    // A running save holds the lock: its own uploads are in progress, not abandoned.
    // LockedError (exit 2, naming the holder) when it is taken.
    lock = store->TryLock("dcp incomplete --abort pid=" + std::to_string(::getpid()));
    if (lock) lock->CheckHeld();
    for (const auto& name : names) store->DiscardIncomplete(name);
    if (lock) lock->Release();
  }
  if (json) {
    nlohmann::ordered_json out;
    out["location"] = store->uri();
    out["incomplete"] = names;
    out["aborted"] = abort ? names : std::vector<std::string>{};
    std::printf("%s\n", DumpJson(out).c_str());
    return kOk;
  }
  if (names.empty()) {
    std::printf("%s: no unfinished writes\n", Printable(store->uri()).c_str());
    return kOk;
  }
  for (const auto& name : names) {
    std::printf("%s %s\n", abort ? "aborted" : "unfinished", Printable(name).c_str());
  }
  if (!abort) {
    std::printf("%zu unfinished write(s) at %s; `dcp incomplete --abort` discards them\n",
                names.size(), Printable(store->uri()).c_str());
  }
  return kOk;
}

}  // namespace dcp::cli
