// Store: the byte-level object interface under the generic checkpoint writer and reader.
//
// A backend that implements Store (a directory, memory, an archive, a key-value service) gets
// the whole checkpoint protocol (file layout, checksums, atomic metadata commit, overwrite
// handling) from MakeStoreWriter/MakeStoreReader; see docs and storage/backends/mem_store.cc, the
// tutorial backend. Names are relative ("metadata.dcp", "data-....data"), without "/" prefix.
//
// Thread safety: a Store may be used from several threads at once (different objects). One
// WritableObject or ReadableObject is used by one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dcp/proto/error.h"

namespace dcp {

/// Name of the lock object a Store may keep in its root for TryLock (file://, kv://). It is not
/// a checkpoint object: readers and tools ignore it.
inline constexpr char kLockObjectName[] = ".dcp.lock";

/// An object being written. It becomes visible under its name at Close() at the latest;
/// destroying it without Close() discards it (nothing partial remains under the name).
class WritableObject {
 public:
  virtual ~WritableObject() = default;
  virtual void Append(const void* data, size_t n) = 0;
  /// Make everything appended so far durable.
  virtual void Sync() = 0;
  virtual void Close() = 0;
  virtual uint64_t size() const = 0;
  /// The writer's share of its memory budget for this object's write buffers (bytes), given
  /// before the first Append. A backend that buffers keeps within it where it can: s3:// sizes
  /// its parts and the parts in flight to it, down to S3's floor of one 5 MiB part being filled
  /// and one in flight. Backends with fixed buffers ignore it. (Declared last so that the
  /// virtual functions above keep their places for built plugins.)
  virtual void LimitBuffers(size_t /*bytes*/) noexcept {}
};

/// A byte range of an object: [offset, offset + length).
struct ByteRange {
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t end() const { return offset + length; }
  bool operator==(const ByteRange&) const = default;
};

/// One destination of ReadableObject::ReadManyStreaming: n bytes of the object at offset, into
/// dst (not owned; it must stay valid for the call).
struct ReadTarget {
  uint64_t offset = 0;
  void* dst = nullptr;
  size_t n = 0;
};

class ReadableObject {
 public:
  virtual ~ReadableObject() = default;
  /// Read exactly n bytes at offset into dst; CorruptionError (naming the object) when the
  /// object is shorter, IoError when the device fails.
  virtual void ReadAt(uint64_t offset, void* dst, size_t n) = 0;
  virtual uint64_t size() const = 0;
  /// A hint that [offset, offset + n) will be read soon: a backend may start fetching it in
  /// large requests (file://: a wider kernel readahead window, s3://: ranged GETs ahead), so that
  /// the ReadAt calls that follow in smaller steps find it arriving. Never fails; the default does
  /// nothing.
  virtual void Prefetch(uint64_t /*offset*/, uint64_t /*n*/) noexcept {}

  // (Declared after the functions above so that their virtual slots stay where built plugins
  // expect them.)

  /// ReadAt of n bytes at offset into dst that reports its progress: landed(pos, len) is called on
  /// the calling thread for consecutive pieces [pos, pos + len) of dst, in order, starting at 0
  /// and covering all n bytes, each as soon as its bytes are in dst, so the caller can work on
  /// (e.g. checksum) one piece while the next ones are still arriving. Errors as ReadAt; an
  /// exception from landed propagates (after any transfer into dst has stopped). The default
  /// reads in ReadAt steps of `step` bytes after a Prefetch hint for the whole range; a backend
  /// may land larger pieces (s3://: one per ranged GET, several in flight, straight into dst).
  virtual void ReadAtStreaming(uint64_t offset, void* dst, size_t n, size_t step,
                               const std::function<void(size_t pos, size_t len)>& landed);

  /// A hint that the byte ranges `ranges` (ascending offsets; they may overlap or touch) will be
  /// read next, in that order, by ReadAt calls: a backend may fetch them in a few large requests
  /// (s3://: ranges whose gaps are small merged into one ranged GET, split into requests of its
  /// request size, several in flight), so the small reads that follow find their bytes arrived.
  /// Never fails; the default does nothing.
  virtual void PrefetchRanges(const std::vector<ByteRange>& /*ranges*/) noexcept {}
  /// The reader's share of its memory budget for this object's read-ahead buffers (bytes),
  /// given before the first read: s3:// keeps its prefetch window within it (fewer and smaller
  /// ranged GETs ahead, at least one of 1 MiB). Reads straight into the destination need no
  /// buffer and are not limited. The default ignores it.
  virtual void LimitBuffers(size_t /*bytes*/) noexcept {}
  /// ReadAtStreaming of several targets, in order, as one stream: landed(t, pos, len) reports
  /// consecutive pieces of target t (in the order of the targets, each covered from 0 to its n),
  /// each as soon as its bytes are in place (a target of 0 bytes gets no call). A backend may keep
  /// its transfers going from one target into the next (s3://: the next target's ranged GETs start
  /// while this one's last are in flight, so reading many items of a file one after the other keeps
  /// as many requests busy as one large item would). Errors as ReadAt; an exception from landed
  /// propagates after every transfer into a target has stopped. The default calls ReadAtStreaming
  /// for each target in turn. (Declared last: the slots above stay where built plugins expect
  /// them.)
  virtual void ReadManyStreaming(
      const std::vector<ReadTarget>& targets, size_t step,
      const std::function<void(size_t target, size_t pos, size_t len)>& landed);
};

/// Exclusive ownership of a store location (one writer per checkpoint location), held until the
/// object is destroyed or Release() is called. See Store::TryLock.
class StoreLock {
 public:
  /// Releases the lock (errors are swallowed here: a lock that cannot be released cleanly is
  /// released by the backend's own recovery, e.g. the kernel or a lease; call Release() to see
  /// them).
  virtual ~StoreLock() = default;
  /// Give the lock up now. Idempotent. IoError when the backend failed to record the release
  /// (the lock is then freed by the backend's recovery rule, never kept forever).
  virtual void Release() = 0;
  /// Who holds it, as written for other contenders (e.g. "host=n1 pid=42 save=ab12").
  virtual std::string holder() const = 0;
  /// Confirm, right before a step that only the holder may take (the commit of a checkpoint,
  /// the removal of dead files), that the lock is still this holder's and stays so for a while.
  /// Returns only when it is confirmed; LeaseLostError when it was lost or cannot be confirmed
  /// in time (a leased lock whose lease ran out and was taken over). The default does nothing:
  /// a lock the kernel or the process holds (file://, mem://) cannot be lost while its holder
  /// lives. Thread-safe. (Declared last so that the existing virtual functions keep their places
  /// for built plugins.)
  virtual void CheckHeld() {}
};

class Store {
 public:
  virtual ~Store() = default;
  /// The store's URI, e.g. "file:///ckpt/step100" or "mem://test", for messages.
  virtual std::string uri() const = 0;
  /// Make sure the container exists (idempotent).
  virtual void CreateRoot() = 0;
  /// Start a new object, replacing any previous one of that name when closed.
  virtual std::unique_ptr<WritableObject> Create(const std::string& name) = 0;
  /// Open an existing object; NotFoundError when absent.
  virtual std::unique_ptr<ReadableObject> Open(const std::string& name) = 0;
  /// Size of an object, or nullopt when it does not exist.
  virtual std::optional<uint64_t> Size(const std::string& name) = 0;
  /// Write `bytes` under `name` so that readers see either the previous object or all of the new
  /// one, never a mix, and the result is durable when this returns (for a directory: write a
  /// temporary file, fsync, rename, fsync the directory).
  virtual void PublishAtomically(const std::string& name, std::string_view bytes) = 0;
  /// Names of all objects (no particular order).
  virtual std::vector<std::string> List() = 0;
  /// Remove an object; removing an absent one is not an error.
  virtual void Remove(const std::string& name) = 0;

  /// Take the location's writer lock without waiting, recording `holder` (a short description
  /// of the job: host, pid, save id) for contenders' error messages.
  ///  * Returns the held lock; it must be held from the "already exists" decision of a save to
  ///    its commit and clean-up, and guarantees that no other holder exists meanwhile.
  ///  * LockedError (a dcp::AlreadyExistsError) naming the location and, where known, the
  ///    holder, when someone else holds it. Never blocks.
  ///  * nullptr when the backend has no locking primitive (the default). Writers then run
  ///    without mutual exclusion: see docs/STORAGE_BACKENDS.md for what they give up.
  /// A lock must not outlive its holder forever: a crashed process's lock is freed by the
  /// kernel (file://), by the process's death (mem://) or by a lease expiring (object stores).
  /// The lock is advisory: it excludes other writers that take it, not plain object writes.
  /// Thread-safe; two TryLock calls on one location from one process also exclude each other.
  virtual std::unique_ptr<StoreLock> TryLock(const std::string& holder);

  /// PublishAtomically for an object that must not exist yet. A backend with a conditional
  /// create (s3://: PUT with If-None-Match: *) refuses atomically with AlreadyExistsError when
  /// it exists. The default is PublishAtomically: the writer lock (TryLock) is then the only
  /// exclusion. The checkpoint protocol commits a new checkpoint's metadata with it. (Declared
  /// last so that the existing virtual functions keep their places for built plugins.)
  virtual void PublishNew(const std::string& name, std::string_view bytes);

  /// Names with a write in progress that List() does not show and that holds storage: on
  /// s3://, multipart uploads started and neither completed nor aborted (their parts stay
  /// stored, and billed, until aborted). A writer's own Create that is still open is one; so is
  /// a crashed process's. The default is none (file:// and mem:// objects under construction
  /// are temporaries that List() shows or that die with their process). Thread-safe. IoError
  /// when the listing fails.
  virtual std::vector<std::string> ListIncomplete();
  /// Discard every write in progress under `name` (see ListIncomplete), whoever started it: a
  /// live writer of that name then fails at its Close. Call it only under the location's lock
  /// (TryLock) when no write of the caller's own job is open, so that what is discarded can
  /// only be a dead (or lock-less) writer's. Discarding nothing is not an error. The default
  /// does nothing. Thread-safe. IoError when the backend refuses. (ListIncomplete and this are
  /// declared last so that the existing virtual functions keep their places for built plugins.)
  virtual void DiscardIncomplete(const std::string& name);
  /// Open an object whose size the caller knows from records of its own (a checkpoint's file
  /// table), so that a backend may skip its size query: on s3:// the HEAD that Open makes, one
  /// round trip per file before its first byte. Where it is skipped, size() is `size`, and a
  /// read past the object's real end fails as ReadAt does on a short object; NotFoundError (at
  /// the latest at the first read) when it is absent. The default is Open(name), which a
  /// ForwardingStore keeps, so that a wrapper's own Open still sees every open. (Declared last
  /// so that the existing virtual functions keep their places for built plugins.)
  virtual std::unique_ptr<ReadableObject> OpenKnownSize(const std::string& name, uint64_t size);

  /// The first bytes of an object, at most `max_bytes` from its start, and its whole size in
  /// *size, in one request where the backend can: on s3:// one ranged GET, whose answer states
  /// the object's size (Open would first ask for it, a round trip of its own). NotFoundError
  /// when it is absent. The default is Open(name), then ReadAt; a ForwardingStore keeps it, so
  /// that a wrapper's own Open sees the read. (Declared last so that the existing virtual
  /// functions keep their places for built plugins.)
  virtual std::string ReadPrefix(const std::string& name, uint64_t max_bytes, uint64_t* size);
  /// The sizes of the objects at the location, name -> size, where one listing states them
  /// (s3://: ListObjectsV2 gives each key's size, up to 1,000 per page); as List() names them.
  /// nullopt where the backend has no such listing (the default: a size query per object is
  /// then as cheap) or when the location holds more than `max_names` objects. A listing may be
  /// older than a write that just finished: a caller confirms what it finds missing or short
  /// with Size(). Thread-safe. IoError when the listing fails. (Declared last.)
  virtual std::optional<std::vector<std::pair<std::string, uint64_t>>> ListSizes(size_t max_names);
  /// Remove every object of `names` (an absent one is no error), in as few requests as the
  /// backend allows: s3:// one multi-object delete per 1,000 names, all in flight together. The
  /// default removes them one by one (Remove), 16 at a time; a ForwardingStore keeps it, so that
  /// a wrapper's own Remove sees each. Every name is tried; then the first failure is thrown
  /// (naming its object; IoError on s3:// naming how many failed). Thread-safe. (Declared last.)
  virtual void RemoveMany(const std::vector<std::string>& names);

  /// Size(name), and in *version a token naming the version of the object seen (s3://: its
  /// ETag), in the one request Size makes. The token is opaque, meant for PublishReplacing; ""
  /// when the object is absent or the backend has no versions (the default: Size, no token).
  /// The checkpoint writer asks it, under its lock, for the metadata a save is to replace.
  /// Thread-safe. (Declared last.)
  virtual std::optional<uint64_t> SizeAndVersion(const std::string& name, std::string* version);
  /// PublishAtomically that replaces `name` only if it is still the version `version` (a token
  /// from SizeAndVersion). A backend with a conditional write (s3://: PUT with If-Match: <ETag>)
  /// decides it atomically and throws AlreadyExistsError, publishing nothing, when the object
  /// was replaced or removed since. With an empty `version`, and by default, it is
  /// PublishAtomically: the writer lock (TryLock) is then the only exclusion, as for PublishNew.
  /// The checkpoint protocol commits an overwrite's metadata with it, so a writer whose lock was
  /// lost (its lease ran out while it was paused) cannot replace the checkpoint another job
  /// committed meanwhile. (Declared last.)
  virtual void PublishReplacing(const std::string& name, std::string_view bytes,
                                const std::string& version);
  /// TryLock, except that a lock held by exactly `gone_holder` (a LockedError's holder()) is
  /// taken over even while its lease runs: the caller has proved that holder dead (the memory
  /// tier's drain does, by holding the node lock its process held; see docs/MEMORY_TIER.md).
  /// Any other holder is refused with LockedError as by TryLock. The default is TryLock: a
  /// backend whose locks die with their holders (file://, mem://) has nothing to take over.
  /// s3:// takes the lease over with the conditional write that takes an expired one over, so
  /// a contender who took it first wins. Thread-safe. (Declared last.)
  virtual std::unique_ptr<StoreLock> TryLockOver(const std::string& holder,
                                                 const std::string& gone_holder);

  /// Reads a whole object whose size a file (or a server) states, so it may lie: its first
  /// bytes (up to 1 MiB, one request: ReadPrefix) go to `check_head` with the stated size,
  /// which throws when they are not what the caller expects (a file that is not a metadata file
  /// costs one small read); an object over `max_bytes` is then refused with CorruptionError
  /// naming it, before anything more is read; the rest is read in pieces into a buffer that grows
  /// with what arrives, so memory follows the bytes delivered, not the size claimed. NotFoundError
  /// when absent. Thread-safe as ReadPrefix is.
  std::string ReadAll(
      const std::string& name, uint64_t max_bytes,
      const std::function<void(std::string_view head, uint64_t size)>& check_head = nullptr);
};

// ---------------------------------------------------------------------------------------------
// ForwardingStore: a Store that passes every call on to another Store, the base for decorators
// (fault injection, counting, delays, a changed uri), as LevelDB's EnvWrapper is for Env.
//
//   class SlowStore : public ForwardingStore {
//    public:
//     using ForwardingStore::ForwardingStore;
//     std::unique_ptr<WritableObject> Create(const std::string& name) override {
//       std::this_thread::sleep_for(std::chrono::milliseconds(10));
//       return ForwardingStore::Create(name);
//     }
//   };
//
// Contract:
//  * Every virtual of Store is forwarded, the optional ones too: a decorator keeps the target's
//    own TryLock, PublishNew, SizeAndVersion and PublishReplacing instead of falling back to
//    Store's defaults (no lock, no versions, and PublishAtomically). ReadAll is not virtual; it
//    reads through Open, the subclass's if it overrides it.
//  * A subclass overrides only what it changes. PublishNew and PublishReplacing go to the
//    target's, not to the subclass's PublishAtomically: a subclass that changes publishing
//    overrides all three. Likewise SizeAndVersion goes to the target's, not to the subclass's
//    Size: a subclass that changes Size overrides both.
//  * Ownership: it shares the target (shared_ptr); the target lives as long as the wrapper.
//  * Thread safety: that of the target; ForwardingStore keeps no state of its own.
//
// ForwardingWritableObject and ForwardingReadableObject do the same for the objects a decorator
// returns from Create and Open. They own the wrapped object, which outlives the subclass's
// members: a subclass whose members keep the wrapped object's store alive resets target_ in its
// destructor.

class ForwardingStore : public Store {
 public:
  explicit ForwardingStore(std::shared_ptr<Store> target);
  ~ForwardingStore() override;

  const std::shared_ptr<Store>& target() const { return target_; }

  std::string uri() const override;
  void CreateRoot() override;
  std::unique_ptr<WritableObject> Create(const std::string& name) override;
  /// OpenKnownSize is not forwarded: its default calls Open, this class's or a subclass's.
  std::unique_ptr<ReadableObject> Open(const std::string& name) override;
  std::optional<uint64_t> Size(const std::string& name) override;
  void PublishAtomically(const std::string& name, std::string_view bytes) override;
  std::vector<std::string> List() override;
  void Remove(const std::string& name) override;
  std::unique_ptr<StoreLock> TryLock(const std::string& holder) override;
  void PublishNew(const std::string& name, std::string_view bytes) override;
  std::vector<std::string> ListIncomplete() override;
  void DiscardIncomplete(const std::string& name) override;
  std::optional<uint64_t> SizeAndVersion(const std::string& name, std::string* version) override;
  void PublishReplacing(const std::string& name, std::string_view bytes,
                        const std::string& version) override;
  std::unique_ptr<StoreLock> TryLockOver(const std::string& holder,
                                         const std::string& gone_holder) override;

 protected:
  std::shared_ptr<Store> target_;
};

class ForwardingWritableObject : public WritableObject {
 public:
  explicit ForwardingWritableObject(std::unique_ptr<WritableObject> target);
  ~ForwardingWritableObject() override;

  WritableObject& target() const { return *target_; }

  void Append(const void* data, size_t n) override;
  void Sync() override;
  void Close() override;
  uint64_t size() const override;
  void LimitBuffers(size_t bytes) noexcept override;

 protected:
  std::unique_ptr<WritableObject> target_;
};

class ForwardingReadableObject : public ReadableObject {
 public:
  explicit ForwardingReadableObject(std::unique_ptr<ReadableObject> target);
  ~ForwardingReadableObject() override;

  ReadableObject& target() const { return *target_; }

  void ReadAt(uint64_t offset, void* dst, size_t n) override;
  uint64_t size() const override;
  void Prefetch(uint64_t offset, uint64_t n) noexcept override;
  // ReadAtStreaming and ReadManyStreaming are not forwarded: the defaults read through ReadAt,
  // so a subclass that changes ReadAt sees every byte of a streamed read too.
  void PrefetchRanges(const std::vector<ByteRange>& ranges) noexcept override;
  void LimitBuffers(size_t bytes) noexcept override;

 protected:
  std::unique_ptr<ReadableObject> target_;
};

}  // namespace dcp
