#include <utility>

#include "dcp/storage/store.h"

namespace dcp {

ForwardingStore::ForwardingStore(std::shared_ptr<Store> target) : target_(std::move(target)) {}
ForwardingStore::~ForwardingStore() = default;

std::string ForwardingStore::uri() const { return target_->uri(); }
void ForwardingStore::CreateRoot() { target_->CreateRoot(); }
std::unique_ptr<WritableObject> ForwardingStore::Create(const std::string& name) {
  return target_->Create(name);
}
std::unique_ptr<ReadableObject> ForwardingStore::Open(const std::string& name) {
  return target_->Open(name);
}
std::optional<uint64_t> ForwardingStore::Size(const std::string& name) {
  return target_->Size(name);
}
void ForwardingStore::PublishAtomically(const std::string& name, std::string_view bytes) {
  target_->PublishAtomically(name, bytes);
}
std::vector<std::string> ForwardingStore::List() { return target_->List(); }
void ForwardingStore::Remove(const std::string& name) { target_->Remove(name); }
std::unique_ptr<StoreLock> ForwardingStore::TryLock(const std::string& holder) {
  return target_->TryLock(holder);
}
void ForwardingStore::PublishNew(const std::string& name, std::string_view bytes) {
  target_->PublishNew(name, bytes);
}

std::vector<std::string> ForwardingStore::ListIncomplete() { return target_->ListIncomplete(); }

void ForwardingStore::DiscardIncomplete(const std::string& name) {
  target_->DiscardIncomplete(name);
}

std::optional<uint64_t> ForwardingStore::SizeAndVersion(const std::string& name,
                                                        std::string* version) {
  return target_->SizeAndVersion(name, version);
}

void ForwardingStore::PublishReplacing(const std::string& name, std::string_view bytes,
                                       const std::string& version) {
  target_->PublishReplacing(name, bytes, version);
}

std::unique_ptr<StoreLock> ForwardingStore::TryLockOver(const std::string& holder,
                                                        const std::string& gone_holder) {
  return target_->TryLockOver(holder, gone_holder);
}

ForwardingWritableObject::ForwardingWritableObject(std::unique_ptr<WritableObject> target)
    : target_(std::move(target)) {}
ForwardingWritableObject::~ForwardingWritableObject() = default;
void ForwardingWritableObject::Append(const void* data, size_t n) { target_->Append(data, n); }
void ForwardingWritableObject::Sync() { target_->Sync(); }
void ForwardingWritableObject::Close() { target_->Close(); }
uint64_t ForwardingWritableObject::size() const { return target_->size(); }
void ForwardingWritableObject::LimitBuffers(size_t bytes) noexcept { target_->LimitBuffers(bytes); }

ForwardingReadableObject::ForwardingReadableObject(std::unique_ptr<ReadableObject> target)
    : target_(std::move(target)) {}
ForwardingReadableObject::~ForwardingReadableObject() = default;
void ForwardingReadableObject::ReadAt(uint64_t offset, void* dst, size_t n) {
  target_->ReadAt(offset, dst, n);
}
uint64_t ForwardingReadableObject::size() const { return target_->size(); }
void ForwardingReadableObject::Prefetch(uint64_t offset, uint64_t n) noexcept {
  target_->Prefetch(offset, n);
}
void ForwardingReadableObject::PrefetchRanges(const std::vector<ByteRange>& ranges) noexcept {
  target_->PrefetchRanges(ranges);
}

void ForwardingReadableObject::LimitBuffers(size_t bytes) noexcept { target_->LimitBuffers(bytes); }

}  // namespace dcp
