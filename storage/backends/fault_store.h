// FaultInjectionStore: wraps any Store and injects failures, for tests of the failure paths.
//
//   auto faults = std::make_shared<FaultInjectionStore>(MakeFileStore(dir));
//   faults->FailNth(FaultOp::kAppend, 3, FaultKind::kNoSpace);   // the 3rd append fails
//   ... run a save against it (RegisterFaultScheme exposes it by URI) ...
//   faults->Crash();   // power loss: unsynced bytes and unpublished objects are dropped
//
// Operations are counted per kind from construction (or Reset). Injected errors are the errors a
// real device gives (IoError with errno EIO/ENOSPC), so the code under test cannot tell them
// apart. Crash() models a machine losing power: every object keeps only the bytes that were
// Sync()ed, objects never synced are gone, PublishAtomically is durable when it returns, and
// every later operation fails until Reset(). uri, CreateRoot, Size, List and TryLock go to the
// wrapped store without faults (it is a ForwardingStore): faults model data-path failures, and a
// crashed process's lock is the wrapped backend's to recover.
//
// Thread-safe: saves use several threads at once.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "dcp/storage/store.h"

namespace dcp {

/// kPublishSync fails PublishAtomically *after* the object became visible (as a failed
/// directory fsync after the rename would).
enum class FaultOp {
  kCreate,
  kAppend,
  kSync,
  kClose,
  kPublish,
  kOpen,
  kRead,
  kRemove,
  kPublishSync
};
enum class FaultKind {
  kIoError,     // EIO
  kNoSpace,     // ENOSPC
  kShortWrite,  // an append writes half its bytes, then fails with EIO
  kCrash,       // the machine loses power at this operation (see Crash())
};

const char* FaultOpName(FaultOp op);

class FaultInjectionStore : public ForwardingStore,
                            public std::enable_shared_from_this<FaultInjectionStore> {
 public:
  explicit FaultInjectionStore(std::shared_ptr<Store> inner);

  /// Make the `n`-th (1-based) operation of kind `op` fail with `kind`.
  void FailNth(FaultOp op, int n, FaultKind kind = FaultKind::kIoError);
  /// Sleep `delay` in every operation of kind `op`.
  void Delay(FaultOp op, std::chrono::milliseconds delay);
  /// Operations of kind `op` seen so far.
  int Count(FaultOp op) const;
  /// Bytes read through ReadAt so far (all objects, all threads).
  uint64_t BytesRead() const { return bytes_read_.load(); }
  /// Lose power now: drop undurable data; fail every later operation until Reset().
  void Crash();
  /// Clear faults, counters and the crashed state (the data stays as it is).
  void Reset();
  bool crashed() const;

  std::unique_ptr<WritableObject> Create(const std::string& name) override;
  std::unique_ptr<ReadableObject> Open(const std::string& name) override;
  void PublishAtomically(const std::string& name, std::string_view bytes) override;
  /// Through this store's PublishAtomically (Store's default), so that publish faults reach a
  /// new checkpoint's commit too.
  void PublishNew(const std::string& name, std::string_view bytes) override;
  /// The target's PublishReplacing (its condition kept), with the faults of PublishAtomically
  /// (kPublish before it, kPublishSync after it).
  void PublishReplacing(const std::string& name, std::string_view bytes,
                        const std::string& version) override;
  void Remove(const std::string& name) override;

  // Used by the wrapped objects. Throws the injected error; returns true when an append must
  // be cut short (write half, then fail).
  bool Before(FaultOp op, const std::string& name);
  void RecordWrite(const std::string& name, uint64_t size, bool synced, bool closed);
  void RecordRead(uint64_t n) { bytes_read_ += n; }
  std::shared_ptr<Store> inner() const { return target_; }

 private:
  void CrashLocked();
  mutable std::mutex mu_;
  std::map<FaultOp, int> counts_;
  std::map<std::pair<FaultOp, int>, FaultKind> faults_;
  std::map<FaultOp, std::chrono::milliseconds> delays_;
  struct Durability {
    uint64_t synced = 0;  // bytes made durable by Sync
    bool ever_synced = false;
  };
  std::map<std::string, Durability> written_;  // objects written through this store
  bool crashed_ = false;
  std::atomic<uint64_t> bytes_read_{0};
};

/// Expose `store` under "<scheme>://<anything>" (the location is ignored). Replaces an earlier
/// registration of the scheme.
void RegisterFaultScheme(const std::string& scheme, std::shared_ptr<FaultInjectionStore> store);

}  // namespace dcp
