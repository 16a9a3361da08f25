#include "dcp/storage/backends/fault_store.h"

#include <cerrno>
#include <thread>

#include "dcp/proto/error.h"
#include "dcp/storage/registry.h"

namespace dcp {

const char* FaultOpName(FaultOp op) {
  switch (op) {
    case FaultOp::kCreate:
      return "create";
    case FaultOp::kAppend:
      return "append";
    case FaultOp::kSync:
      return "sync";
    case FaultOp::kClose:
      return "close";
    case FaultOp::kPublish:
      return "publish";
    case FaultOp::kPublishSync:
      return "publish-sync";
    case FaultOp::kOpen:
      return "open";
    case FaultOp::kRead:
      return "read";
    case FaultOp::kRemove:
      return "remove";
  }
  return "?";
}

namespace {

class FaultWritable : public ForwardingWritableObject {
 public:
  FaultWritable(std::shared_ptr<FaultInjectionStore> store, std::string name,
                std::unique_ptr<WritableObject> inner)
      : ForwardingWritableObject(std::move(inner)),
        store_(std::move(store)),
        name_(std::move(name)) {}
  // The wrapped object goes first, while store_ still keeps the stores under it alive.
  ~FaultWritable() override { target_.reset(); }
  void Append(const void* data, size_t n) override {
    if (store_->Before(FaultOp::kAppend, name_)) {  // a short write: half the bytes land
      target_->Append(data, n / 2);
      store_->RecordWrite(name_, target_->size(), false, false);
      throw MakeIoError("injected short write", store_->uri() + "/" + name_, EIO);
    }
    target_->Append(data, n);
    store_->RecordWrite(name_, target_->size(), false, false);
  }
  void Sync() override {
    store_->Before(FaultOp::kSync, name_);
    target_->Sync();
    store_->RecordWrite(name_, target_->size(), true, false);
  }
  void Close() override {
    store_->Before(FaultOp::kClose, name_);
    target_->Close();
    store_->RecordWrite(name_, target_->size(), false, true);
  }

 private:
  std::shared_ptr<FaultInjectionStore> store_;
  std::string name_;
};

class FaultReadable : public ForwardingReadableObject {
 public:
  FaultReadable(std::shared_ptr<FaultInjectionStore> store, std::string name,
                std::unique_ptr<ReadableObject> inner)
      : ForwardingReadableObject(std::move(inner)),
        store_(std::move(store)),
        name_(std::move(name)) {}
  // The wrapped object goes first, as in FaultWritable.
  ~FaultReadable() override { target_.reset(); }
  void ReadAt(uint64_t offset, void* dst, size_t n) override {
    store_->Before(FaultOp::kRead, name_);
    target_->ReadAt(offset, dst, n);
    store_->RecordRead(n);
  }

 private:
  std::shared_ptr<FaultInjectionStore> store_;
  std::string name_;
};

}  // namespace

FaultInjectionStore::FaultInjectionStore(std::shared_ptr<Store> inner)
    : ForwardingStore(std::move(inner)) {}

void FaultInjectionStore::FailNth(FaultOp op, int n, FaultKind kind) {
  std::lock_guard<std::mutex> lock(mu_);
  faults_[{op, n}] = kind;
}

void FaultInjectionStore::Delay(FaultOp op, std::chrono::milliseconds delay) {
  std::lock_guard<std::mutex> lock(mu_);
  delays_[op] = delay;
}

int FaultInjectionStore::Count(FaultOp op) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = counts_.find(op);
  return it == counts_.end() ? 0 : it->second;
}

bool FaultInjectionStore::crashed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return crashed_;
}

void FaultInjectionStore::Reset() {
  std::lock_guard<std::mutex> lock(mu_);
  counts_.clear();
  faults_.clear();
  delays_.clear();
  written_.clear();
  crashed_ = false;
  bytes_read_ = 0;
}

void FaultInjectionStore::Crash() {
  std::lock_guard<std::mutex> lock(mu_);
  CrashLocked();
}

void FaultInjectionStore::CrashLocked() {
  if (crashed_) return;
  crashed_ = true;
  // Keep only what was made durable: the synced prefix of each object written through us.
  for (const auto& [name, d] : written_) {
    if (!target_->Size(name)) continue;
    if (!d.ever_synced || d.synced == 0) {
      target_->Remove(name);
      continue;
    }
    std::string keep(d.synced, '\0');
    target_->Open(name)->ReadAt(0, keep.data(), keep.size());
    auto w = target_->Create(name);
    w->Append(keep.data(), keep.size());
    w->Sync();
    w->Close();
  }
}

bool FaultInjectionStore::Before(FaultOp op, const std::string& name) {
  std::chrono::milliseconds delay{0};
  std::optional<FaultKind> fault;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (crashed_)
      throw MakeIoError(std::string(FaultOpName(op)) + " after power loss",
                        target_->uri() + "/" + name, EIO);
    const int n = ++counts_[op];
    auto it = faults_.find({op, n});
    if (it != faults_.end()) fault = it->second;
    auto d = delays_.find(op);
    if (d != delays_.end()) delay = d->second;
    if (fault == FaultKind::kCrash) CrashLocked();
  }
  if (delay.count() > 0) std::this_thread::sleep_for(delay);
  if (!fault) return false;
  const std::string where = target_->uri() + "/" + name;
  const std::string what = std::string("injected ") + FaultOpName(op);
  switch (*fault) {
    case FaultKind::kIoError:
      throw MakeIoError(what, where, EIO);
    case FaultKind::kNoSpace:
      throw MakeIoError(what, where, ENOSPC);
    case FaultKind::kShortWrite:
      if (op == FaultOp::kAppend) return true;
      throw MakeIoError(what, where, EIO);
    case FaultKind::kCrash:
      throw MakeIoError(what + " (power lost)", where, EIO);
  }
  return false;
}

void FaultInjectionStore::RecordWrite(const std::string& name, uint64_t size, bool synced, bool) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& d = written_[name];
  if (synced) {
    d.synced = size;
    d.ever_synced = true;
  }
}

std::unique_ptr<WritableObject> FaultInjectionStore::Create(const std::string& name) {
  Before(FaultOp::kCreate, name);
  {
    std::lock_guard<std::mutex> lock(mu_);
    written_[name] = Durability{};
  }
  return std::make_unique<FaultWritable>(shared_from_this(), name, target_->Create(name));
}

std::unique_ptr<ReadableObject> FaultInjectionStore::Open(const std::string& name) {
  Before(FaultOp::kOpen, name);
  return std::make_unique<FaultReadable>(shared_from_this(), name, target_->Open(name));
}

void FaultInjectionStore::PublishAtomically(const std::string& name, std::string_view bytes) {
  Before(FaultOp::kPublish, name);
  target_->PublishAtomically(name, bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    written_.erase(name);  // durable once published
  }
  Before(FaultOp::kPublishSync, name);  // visible now; a failure here is one after the rename
}

void FaultInjectionStore::PublishNew(const std::string& name, std::string_view bytes) {
  Store::PublishNew(name, bytes);
}

void FaultInjectionStore::PublishReplacing(const std::string& name, std::string_view bytes,
                                           const std::string& version) {
  Before(FaultOp::kPublish, name);
  target_->PublishReplacing(name, bytes, version);
  {
    std::lock_guard<std::mutex> lock(mu_);
    written_.erase(name);  // durable once published
  }
  Before(FaultOp::kPublishSync, name);
}

void FaultInjectionStore::Remove(const std::string& name) {
  Before(FaultOp::kRemove, name);
  target_->Remove(name);
}

void RegisterFaultScheme(const std::string& scheme, std::shared_ptr<FaultInjectionStore> store) {
  RegisterBackend(
      scheme, [store](const std::string&) -> std::shared_ptr<Store> { return store; },
      /*replace=*/true);
}

}  // namespace dcp
