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
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dcp/storage/store.h"

namespace dcp {

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
