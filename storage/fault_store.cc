#include "dcp/storage/fault_store.h"

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

class FaultWritable : public WritableObject {
 public:
  FaultWritable(std::shared_ptr<FaultInjectionStore> store, std::string name,
                std::unique_ptr<WritableObject> inner)
      : store_(std::move(store)), name_(std::move(name)), inner_(std::move(inner)) {}
  void Append(const void* data, size_t n) override {
    if (store_->Before(FaultOp::kAppend, name_)) {  // a short write: half the bytes land
      inner_->Append(data, n / 2);
      store_->RecordWrite(name_, inner_->size(), false, false);
      throw MakeIoError("injected short write", store_->uri() + "/" + name_, EIO);
    }
    inner_->Append(data, n);
    store_->RecordWrite(name_, inner_->size(), false, false);
  }
  void Sync() override {
    store_->Before(FaultOp::kSync, name_);
    inner_->Sync();
    store_->RecordWrite(name_, inner_->size(), true, false);
  }
  void Close() override {
    store_->Before(FaultOp::kClose, name_);
    inner_->Close();
    store_->RecordWrite(name_, inner_->size(), false, true);
  }
  uint64_t size() const override { return inner_->size(); }

 private:
  std::shared_ptr<FaultInjectionStore> store_;
  std::string name_;
  std::unique_ptr<WritableObject> inner_;
};

class FaultReadable : public ReadableObject {
 public:
  FaultReadable(std::shared_ptr<FaultInjectionStore> store, std::string name,
                std::unique_ptr<ReadableObject> inner)
      : store_(std::move(store)), name_(std::move(name)), inner_(std::move(inner)) {}
  void Prefetch(uint64_t offset, uint64_t n) noexcept override { inner_->Prefetch(offset, n); }
  void ReadAt(uint64_t offset, void* dst, size_t n) override {
    store_->Before(FaultOp::kRead, name_);
    inner_->ReadAt(offset, dst, n);
    store_->RecordRead(n);
  }
  uint64_t size() const override { return inner_->size(); }

 private:
  std::shared_ptr<FaultInjectionStore> store_;
  std::string name_;
  std::unique_ptr<ReadableObject> inner_;
};

}  // namespace

FaultInjectionStore::FaultInjectionStore(std::shared_ptr<Store> inner) : inner_(std::move(inner)) {}

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
    if (!inner_->Size(name)) continue;
    if (!d.ever_synced || d.synced == 0) {
      inner_->Remove(name);
      continue;
    }
    std::string keep(d.synced, '\0');
    inner_->Open(name)->ReadAt(0, keep.data(), keep.size());
    auto w = inner_->Create(name);
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
                        inner_->uri() + "/" + name, EIO);
    const int n = ++counts_[op];
    auto it = faults_.find({op, n});
    if (it != faults_.end()) fault = it->second;
    auto d = delays_.find(op);
    if (d != delays_.end()) delay = d->second;
    if (fault == FaultKind::kCrash) CrashLocked();
  }
  if (delay.count() > 0) std::this_thread::sleep_for(delay);
  if (!fault) return false;
  const std::string where = inner_->uri() + "/" + name;
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

std::string FaultInjectionStore::uri() const { return inner_->uri(); }
void FaultInjectionStore::CreateRoot() { inner_->CreateRoot(); }

std::unique_ptr<WritableObject> FaultInjectionStore::Create(const std::string& name) {
  Before(FaultOp::kCreate, name);
  {
    std::lock_guard<std::mutex> lock(mu_);
    written_[name] = Durability{};
  }
  return std::make_unique<FaultWritable>(shared_from_this(), name, inner_->Create(name));
}

std::unique_ptr<ReadableObject> FaultInjectionStore::Open(const std::string& name) {
  Before(FaultOp::kOpen, name);
  return std::make_unique<FaultReadable>(shared_from_this(), name, inner_->Open(name));
}

std::optional<uint64_t> FaultInjectionStore::Size(const std::string& name) {
  return inner_->Size(name);
}

void FaultInjectionStore::PublishAtomically(const std::string& name, std::string_view bytes) {
  Before(FaultOp::kPublish, name);
  inner_->PublishAtomically(name, bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    written_.erase(name);  // durable once published
  }
  Before(FaultOp::kPublishSync, name);  // visible now; a failure here is one after the rename
}

std::vector<std::string> FaultInjectionStore::List() { return inner_->List(); }

void FaultInjectionStore::Remove(const std::string& name) {
  Before(FaultOp::kRemove, name);
  inner_->Remove(name);
}

// The lock is the inner store's: faults model data-path failures, and a crashed process's lock
// is the inner backend's to recover.
std::unique_ptr<StoreLock> FaultInjectionStore::TryLock(const std::string& holder) {
  return inner_->TryLock(holder);
}

void RegisterFaultScheme(const std::string& scheme, std::shared_ptr<FaultInjectionStore> store) {
  RegisterStoreBackend(
      scheme, [store](const std::string&) -> std::shared_ptr<Store> { return store; },
      /*replace=*/true);
}

}  // namespace dcp
