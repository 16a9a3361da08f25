// ForwardingStore and the forwarding objects (storage/store.h): every call reaches the
// target, the optional ones (TryLock, TryLockOver, PublishNew, SizeAndVersion, PublishReplacing,
// Prefetch) included, a subclass changes only what it overrides, and the checkpoint protocol runs
// through one unchanged.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cctype>
#include <optional>
#include <string>
#include <vector>

#include "dcp/dcp.h"
#include "dcp/storage/backends/mem_store.h"
#include "dcp/storage/format/dcp_layout.h"
#include "dcp/storage/registry.h"
#include "dcp/storage/store.h"
#include "support/test_support.h"

using namespace dcp;
using namespace dcp::testing;
using Catch::Matchers::Contains;

namespace {

using Calls = std::vector<std::string>;

// A target that logs every call it gets, objects included, and keeps its bytes in mem://.
// Written on Store itself, not on ForwardingStore, so that it does not depend on what it checks.
class SpyStore : public Store {
 public:
  explicit SpyStore(const std::string& name) : mem_(MakeMemStore(name)) {}
  mutable Calls calls;  // uri() is const and logged too

  std::string uri() const override {
    Log("uri");
    return "spy://" + mem_->uri();
  }
  void CreateRoot() override { Log("CreateRoot"); }
  std::unique_ptr<WritableObject> Create(const std::string& n) override {
    struct W : WritableObject {
      std::unique_ptr<WritableObject> w;
      Calls* calls;
      void Append(const void* d, size_t k) override {
        calls->push_back("Append");
        w->Append(d, k);
      }
      void Sync() override {
        calls->push_back("Sync");
        w->Sync();
      }
      void Close() override {
        calls->push_back("Close");
        w->Close();
      }
      uint64_t size() const override {
        calls->push_back("W.size");
        return w->size();
      }
      void LimitBuffers(size_t bytes) noexcept override {
        calls->push_back("W.LimitBuffers " + std::to_string(bytes));
      }
    };
    Log("Create " + n);
    auto o = std::make_unique<W>();
    o->w = mem_->Create(n);
    o->calls = &calls;
    return o;
  }
  std::unique_ptr<ReadableObject> Open(const std::string& n) override {
    struct R : ReadableObject {
      std::unique_ptr<ReadableObject> r;
      Calls* calls;
      void ReadAt(uint64_t off, void* dst, size_t k) override {
        calls->push_back("ReadAt");
        r->ReadAt(off, dst, k);
      }
      uint64_t size() const override {
        calls->push_back("R.size");
        return r->size();
      }
      void Prefetch(uint64_t, uint64_t) noexcept override { calls->push_back("Prefetch"); }
      void LimitBuffers(size_t bytes) noexcept override {
        calls->push_back("R.LimitBuffers " + std::to_string(bytes));
      }
    };
    Log("Open " + n);
    auto o = std::make_unique<R>();
    o->r = mem_->Open(n);
    o->calls = &calls;
    return o;
  }
  std::optional<uint64_t> Size(const std::string& n) override {
    Log("Size " + n);
    return mem_->Size(n);
  }
  void PublishAtomically(const std::string& n, std::string_view b) override {
    Log("PublishAtomically " + n);
    mem_->PublishAtomically(n, b);
  }
  std::vector<std::string> List() override {
    Log("List");
    return mem_->List();
  }
  void Remove(const std::string& n) override {
    Log("Remove " + n);
    mem_->Remove(n);
  }
  std::unique_ptr<StoreLock> TryLock(const std::string& h) override {
    Log("TryLock " + h);
    return mem_->TryLock(h);
  }
  std::unique_ptr<StoreLock> TryLockOver(const std::string& h, const std::string& gone) override {
    Log("TryLockOver " + h + " " + gone);
    return mem_->TryLockOver(h, gone);
  }
  void PublishNew(const std::string& n, std::string_view b) override {
    Log("PublishNew " + n);
    if (mem_->Size(n)) throw AlreadyExistsError(n + " exists");  // a conditional create
    mem_->PublishAtomically(n, b);
  }
  std::vector<std::string> ListIncomplete() override {
    Log("ListIncomplete");
    return {"upload"};
  }
  void DiscardIncomplete(const std::string& n) override { Log("DiscardIncomplete " + n); }
  std::optional<uint64_t> SizeAndVersion(const std::string& n, std::string* version) override {
    Log("SizeAndVersion " + n);
    auto size = mem_->Size(n);
    *version = size ? "v-" + mem_->ReadAll(n, UINT64_MAX) : "";  // the bytes name the version
    return size;
  }
  void PublishReplacing(const std::string& n, std::string_view b, const std::string& v) override {
    Log("PublishReplacing " + n + " " + v);
    if (!mem_->Size(n) || "v-" + mem_->ReadAll(n, UINT64_MAX) != v) {
      throw AlreadyExistsError(n + " changed");  // a conditional replace
    }
    mem_->PublishAtomically(n, b);
  }

 private:
  void Log(const std::string& call) const { calls.push_back(call); }
  std::shared_ptr<Store> mem_;
};

std::vector<std::string> Sorted(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  return v;
}

void Put(Store& store, const std::string& name, const std::string& bytes) {
  auto w = store.Create(name);
  w->Append(bytes.data(), bytes.size());
  w->Close();
}

StateDict MakeState(std::vector<TensorView>& keep) {
  keep = {RandomTensor(DType::kFloat32, {64, 33}, 1), RandomTensor(DType::kBFloat16, {7}, 2),
          RandomTensor(DType::kInt64, {}, 3)};
  StateDict sd;
  sd.Nested("model").Set("w", keep[0]).Set("b", keep[1]);
  sd.Set("step", keep[2]).Set("rng", Blob{std::string("\x00\x01\xff state", 9)});
  return sd;
}

StateDict MakeEmptyLike(std::vector<TensorView>& keep) {
  keep = {TensorView::Allocate(DType::kFloat32, {64, 33}),
          TensorView::Allocate(DType::kBFloat16, {7}), TensorView::Allocate(DType::kInt64, {})};
  StateDict sd;
  sd.Nested("model").Set("w", keep[0]).Set("b", keep[1]);
  sd.Set("step", keep[2]).Set("rng", Blob{});
  return sd;
}

// fwdtest://<location>: a plain ForwardingStore over mem://fwdtest/<location>.
void RegisterFwdTest() {
  RegisterBackend(
      "fwdtest",
      [](const std::string& location) -> std::shared_ptr<Store> {
        return std::make_shared<ForwardingStore>(MakeMemStore("fwdtest/" + location));
      },
      /*replace=*/true);
}

}  // namespace

TEST_CASE("forwarding store: every Store call reaches the target", "[storage][forwarding]") {
  ClearMemStore("fwd-spy");
  auto spy = std::make_shared<SpyStore>("fwd-spy");
  ForwardingStore fwd(spy);
  CHECK(fwd.target() == spy);

  CHECK(fwd.uri() == "spy://mem://fwd-spy");
  fwd.CreateRoot();
  CHECK_FALSE(fwd.Size("a"));
  Put(fwd, "a", "hello");
  CHECK(fwd.Size("a") == 5u);
  fwd.PublishAtomically("m", "meta");
  CHECK(Sorted(fwd.List()) == Calls{"a", "m"});
  fwd.Remove("m");
  {
    auto lock = fwd.TryLock("job-a");
    CHECK(lock);
  }
  CHECK(fwd.TryLockOver("job-b", "job-a"));
  fwd.PublishNew("n", "new");
  CHECK(fwd.ListIncomplete() == Calls{"upload"});
  fwd.DiscardIncomplete("upload");
  std::string version;
  CHECK(fwd.SizeAndVersion("n", &version) == 3u);
  CHECK(version == "v-new");
  fwd.PublishReplacing("n", "newer", version);
  CHECK(spy->calls == Calls{"uri", "CreateRoot", "Size a", "Create a", "Append", "Close", "Size a",
                            "PublishAtomically m", "List", "Remove m", "TryLock job-a",
                            "TryLockOver job-b job-a", "PublishNew n", "ListIncomplete",
                            "DiscardIncomplete upload", "SizeAndVersion n",
                            "PublishReplacing n v-new"});

  // The target's own PublishNew (a conditional create) and PublishReplacing (a conditional
  // replace), not Store's defaults (an overwrite).
  CHECK_THROWS_AS(fwd.PublishNew("n", "again"), AlreadyExistsError);
  CHECK_THROWS_AS(fwd.PublishReplacing("n", "again", version), AlreadyExistsError);
  CHECK(fwd.ReadAll("n", UINT64_MAX) == "newer");
  ClearMemStore("fwd-spy");
}

TEST_CASE("forwarding store: the forwarding objects pass every call on", "[storage][forwarding]") {
  ClearMemStore("fwd-objects");
  auto spy = std::make_shared<SpyStore>("fwd-objects");
  {
    ForwardingWritableObject w(spy->Create("a"));
    w.LimitBuffers(1000);
    w.Append("hello ", 6);
    w.Append("world", 5);
    CHECK(w.size() == 11);
    w.Sync();
    w.Close();
  }
  {
    ForwardingReadableObject r(spy->Open("a"));
    r.LimitBuffers(2000);
    CHECK(r.size() == 11);
    r.Prefetch(0, 11);
    char buf[5];
    r.ReadAt(6, buf, 5);
    CHECK(std::string(buf, 5) == "world");
    CHECK_THROWS_AS(r.ReadAt(8, buf, 5), CorruptionError);  // the target's error, unchanged
  }
  CHECK(spy->calls == Calls{"Create a", "W.LimitBuffers 1000", "Append", "Append", "W.size", "Sync",
                            "Close", "Open a", "R.LimitBuffers 2000", "R.size", "Prefetch",
                            "ReadAt", "ReadAt"});
  ClearMemStore("fwd-objects");
}

TEST_CASE("forwarding store: objects and locks are the target's both ways",
          "[storage][forwarding][lock]") {
  ClearMemStore("fwd-mem");
  auto mem = MakeMemStore("fwd-mem");
  auto fwd = std::make_shared<ForwardingStore>(mem);
  CHECK(fwd->uri() == mem->uri());
  fwd->CreateRoot();

  // Written through the wrapper, seen in the target, and the other way round.
  Put(*fwd, "a", "through the wrapper");
  CHECK(mem->ReadAll("a", UINT64_MAX) == "through the wrapper");
  Put(*mem, "b", "in the target");
  CHECK(fwd->ReadAll("b", UINT64_MAX) == "in the target");
  CHECK(fwd->Size("b") == mem->Size("b"));
  CHECK_FALSE(fwd->Size("missing"));
  CHECK_THROWS_AS(fwd->Open("missing"), NotFoundError);
  {
    auto abandoned = fwd->Create("abandoned");  // never closed: nothing under its name
    abandoned->Append("x", 1);
  }
  CHECK_FALSE(mem->Size("abandoned"));

  fwd->PublishAtomically("m", "first");
  fwd->PublishAtomically("m", "second");
  CHECK(mem->ReadAll("m", UINT64_MAX) == "second");
  fwd->PublishNew("n", "new");  // mem:// keeps Store's default: a plain publish
  CHECK(mem->ReadAll("n", UINT64_MAX) == "new");
  std::string version = "unset";
  CHECK(fwd->SizeAndVersion("n", &version) == 3u);
  CHECK(version.empty());                      // mem:// has no versions: Store's default
  fwd->PublishReplacing("n", "any", "stale");  // ... so the default publishes unconditionally
  CHECK(mem->ReadAll("n", UINT64_MAX) == "any");
  fwd->PublishReplacing("n", "new", "");
  CHECK(mem->ReadAll("n", UINT64_MAX) == "new");
  CHECK(Sorted(fwd->List()) == Sorted(mem->List()));
  CHECK(Sorted(fwd->List()) == Calls{"a", "b", "m", "n"});
  fwd->Remove("a");
  fwd->Remove("a");  // absent: not an error, as in the target
  CHECK_FALSE(mem->Size("a"));

  // One lock, whichever side takes it.
  auto held = fwd->TryLock("job-a");
  REQUIRE(held);
  CHECK(held->holder() == "job-a");
  CHECK_THROWS_AS(mem->TryLock("job-b"), LockedError);
  CHECK_THAT(MessageOf<LockedError>([&] { fwd->TryLock("job-b"); }), Contains("job-a"));
  held->Release();
  auto again = mem->TryLock("job-b");
  REQUIRE(again);
  CHECK_THROWS_AS(fwd->TryLock("job-c"), LockedError);
  again.reset();
  CHECK(fwd->TryLock("job-c"));
  ClearMemStore("fwd-mem");
}

TEST_CASE("forwarding store: a subclass overriding one method changes only that",
          "[storage][forwarding]") {
  // Reports every object one byte larger than it is.
  class OffByOne : public ForwardingStore {
   public:
    using ForwardingStore::ForwardingStore;
    std::optional<uint64_t> Size(const std::string& n) override {
      auto s = ForwardingStore::Size(n);
      return s ? std::optional<uint64_t>(*s + 1) : std::nullopt;
    }
  };
  // Publishes upper-cased bytes; PublishNew is not overridden and goes to the target as it is.
  class Shouting : public ForwardingStore {
   public:
    using ForwardingStore::ForwardingStore;
    void PublishAtomically(const std::string& n, std::string_view b) override {
      std::string up(b);
      for (char& c : up) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      ForwardingStore::PublishAtomically(n, up);
    }
  };

  ClearMemStore("fwd-sub");
  auto mem = MakeMemStore("fwd-sub");
  Put(*mem, "a", "abc");

  OffByOne off(mem);
  CHECK(off.Size("a") == 4u);
  CHECK_FALSE(off.Size("missing"));
  CHECK(mem->Size("a") == 3u);                   // the target is untouched
  CHECK(off.ReadAll("a", UINT64_MAX) == "abc");  // ReadAll reads through Open, not Size
  CHECK(off.Open("a")->size() == 3);
  CHECK(off.uri() == mem->uri());
  CHECK(off.List() == Calls{"a"});
  CHECK(off.TryLock("job"));

  Shouting loud(mem);
  loud.PublishAtomically("p", "quiet");
  CHECK(mem->ReadAll("p", UINT64_MAX) == "QUIET");
  loud.PublishNew("q", "quiet");
  CHECK(mem->ReadAll("q", UINT64_MAX) == "quiet");
  loud.PublishReplacing("q", "still quiet", "");  // not overridden either: the target's
  CHECK(mem->ReadAll("q", UINT64_MAX) == "still quiet");
  Put(loud, "c", "quiet");  // objects are not published: unchanged
  CHECK(mem->ReadAll("c", UINT64_MAX) == "quiet");
  ClearMemStore("fwd-sub");
}

TEST_CASE("forwarding store: Save and Load run through a registered ForwardingStore",
          "[storage][forwarding][checkpoint]") {
  RegisterFwdTest();
  ClearMemStore("fwdtest/ckpt");
  const std::string uri = "fwdtest://ckpt";
  auto target = MakeMemStore("fwdtest/ckpt");
  CHECK(std::dynamic_pointer_cast<ForwardingStore>(OpenStore(uri)));

  std::vector<TensorView> src, dst, other;
  StateDict sd = MakeState(src);
  SaveOptions so;
  so.storage.files_per_rank = 2;
  const Metadata md = Save(sd, uri, so).metadata;
  CHECK(md.entries.size() == 4);

  // The checkpoint is the target's: a plain mem:// reader loads it, and so does fwdtest://.
  CHECK(target->Size(kMetadataName));
  size_t data_files = 0;
  for (const auto& n : target->List()) data_files += IsDataObjectName(n);
  CHECK(data_files == 2);
  CHECK(ReadMetadata("mem://fwdtest/ckpt").save_id == md.save_id);
  StateDict back = MakeEmptyLike(dst);
  Load(back, uri);
  for (size_t i = 0; i < src.size(); ++i) CHECK(SameElements(src[i], dst[i]));
  CHECK(std::get<Blob>(*back.Find("rng")).bytes == std::get<Blob>(*sd.Find("rng")).bytes);

  // The target's lock and commit rules hold through the wrapper: a second save is refused while
  // someone holds the target's lock, and without overwrite once a checkpoint is there.
  StateDict second = MakeState(other);
  FillRandom(other[0].data, other[0].nbytes(), 99);
  {
    auto held = target->TryLock("job-a");
    REQUIRE(held);
    SaveOptions ow;
    ow.storage.overwrite = true;
    try {
      Save(second, uri, ow);
      FAIL("a save under someone else's lock succeeded");
    } catch (const CollectiveError& e) {
      CHECK_THAT(e.what(), Contains("locked") && Contains("job-a"));
    }
  }
  try {
    Save(second, uri);
    FAIL("the second save should have been refused");
  } catch (const CollectiveError& e) {
    REQUIRE(e.failures().size() == 1);
    CHECK(e.failures()[0].code == ErrorCode::kAlreadyExists);
  }
  CHECK(ReadMetadata(uri).save_id == md.save_id);

  // Several ranks (threads) at once through the wrapper.
  ClearMemStore("fwdtest/ranks");
  RequireNoErrors(RunRanks(3, [&](int, Communicator& comm) {
    std::vector<TensorView> mine, got;
    StateDict state = MakeState(mine);
    Save(state, "fwdtest://ranks", comm);
    StateDict loaded = MakeEmptyLike(got);
    Load(loaded, "fwdtest://ranks", comm);
    for (size_t i = 0; i < mine.size(); ++i) Expect(SameElements(mine[i], got[i]), "same values");
  }));
  CHECK(ReadMetadata("mem://fwdtest/ranks").world_size == 3);
  ClearMemStore("fwdtest/ckpt");
  ClearMemStore("fwdtest/ranks");
}
