// One conformance suite, run against every backend in Table(): the built-ins (file://, mem://,
// s3:// where a test server runs) and the example plugin kv:// (examples/kv_store), loaded at run
// time with LoadStoragePlugin from the path CMake passes as DCP_KV_PLUGIN; and, for the
// checkpoint tests, in every format on every backend (Formats(), chosen by the URI's ?format=).
// A new backend joins by adding a row to Table(), a new format by adding it to Formats().
#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include "dcp/storage/backends/file_store.h"
#include "dcp/storage/backends/mem_store.h"
#include "dcp/storage/format/dcp_layout.h"
#include "dcp/storage/format/layout.h"
#include "support/s3_test_support.h"
#include "support/test_support.h"

using namespace dcp;
using Catch::Matchers::Contains;
using dcp::testing::RandomTensor;
using dcp::testing::SameElements;
using dcp::testing::TempDir;

namespace {

// A fresh, empty location of one backend, cleaned up at scope exit.
struct Location {
  std::string uri;
  std::unique_ptr<TempDir> dir;
};

// One row per backend: its scheme and how to make a fresh, empty location of it.
struct BackendCase {
  std::string scheme;
  std::function<Location()> fresh;
};

Location InTempDir(const std::string& prefix) {
  Location loc;
  loc.dir = std::make_unique<TempDir>("conf");
  loc.uri = prefix + loc.dir->path() + "/ckpt";
  return loc;
}

const std::vector<BackendCase>& Table() {
  static const std::vector<BackendCase> table = [] {
    std::vector<BackendCase> t;
    t.push_back({"file", [] { return InTempDir("file://"); }});
    t.push_back({"mem", [] {
                   static int counter = 0;
                   Location loc;
                   loc.uri = "mem://conformance-" + std::to_string(counter++);
                   ClearMemStore(SplitUri(loc.uri).second);
                   return loc;
                 }});
#ifdef DCP_KV_PLUGIN
    LoadStoragePlugin(DCP_KV_PLUGIN);  // registers kv:// through dcp_register_storage()
    t.push_back({"kv", [] { return InTempDir("kv://"); }});
#endif
    // s3:// on the real test server (Ceph RGW), only where one is running: see the test
    // "conformance: s3:// row" for the reason printed when it is absent.
    if (dcp::testing::S3SkipReason().empty()) {
      t.push_back({"s3", [] {
                     Location loc;
                     loc.uri = dcp::testing::S3TestRoot("conformance");
                     return loc;
                   }});
    }
    return t;
  }();
  return table;
}

Location FreshLocation(const std::string& scheme) {
  for (const auto& b : Table()) {
    if (b.scheme == scheme) return b.fresh();
  }
  throw std::logic_error("no backend row for " + scheme);
}

std::vector<std::string> Backends() {
  std::vector<std::string> names;
  for (const auto& b : Table()) names.push_back(b.scheme);
  return names;
}

StateDict MakeState(std::vector<TensorView>& keep) {
  keep = {RandomTensor(DType::kFloat32, {64, 33}, 1), RandomTensor(DType::kBFloat16, {7}, 2),
          RandomTensor(DType::kInt64, {}, 3), RandomTensor(DType::kUInt8, {0, 5}, 4)};
  StateDict sd;
  sd.Nested("model").Set("w", keep[0]).Set("b", keep[1]);
  sd.Set("step", keep[2])
      .Set("empty", keep[3])
      .Set("rng", Blob{std::string("\x00\x01\xff state", 9)});
  return sd;
}

StateDict MakeEmptyLike(std::vector<TensorView>& keep) {
  keep = {TensorView::Allocate(DType::kFloat32, {64, 33}),
          TensorView::Allocate(DType::kBFloat16, {7}), TensorView::Allocate(DType::kInt64, {}),
          TensorView::Allocate(DType::kUInt8, {0, 5})};
  StateDict sd;
  sd.Nested("model").Set("w", keep[0]).Set("b", keep[1]);
  sd.Set("step", keep[2]).Set("empty", keep[3]).Set("rng", Blob{});
  return sd;
}

std::string FirstDataObject(Store& store) {
  for (const auto& n : store.List()) {
    if (IsAnyDataFile(n)) return n;
  }
  return {};
}

const std::vector<CheckpointFormat>& Formats() {
  static const std::vector<CheckpointFormat> formats = {
      CheckpointFormat::kDcp, CheckpointFormat::kTorchDcp, CheckpointFormat::kTorchDcp113,
      CheckpointFormat::kSafetensors};
  return formats;
}

// The formats whose items carry checksums (safetensors stores none: damage is not detected).
const std::vector<CheckpointFormat>& ChecksummedFormats() {
  static const std::vector<CheckpointFormat> formats = {
      CheckpointFormat::kDcp, CheckpointFormat::kTorchDcp, CheckpointFormat::kTorchDcp113};
  return formats;
}

// A fresh location of `scheme` whose URI asks for `format`.
Location FreshLocation(const std::string& scheme, CheckpointFormat format) {
  Location loc = FreshLocation(scheme);
  if (format != CheckpointFormat::kDcp) {
    loc.uri += "?format=" + std::string(CheckpointFormatName(format));
  }
  return loc;
}

const std::string& MetadataName(CheckpointFormat format) {
  return LayoutFor(format).metadata_name();
}

// Overwrite `n` bytes of an object in place through the Store interface.
void Patch(Store& store, const std::string& name, uint64_t offset, const std::string& bytes) {
  std::string all = store.ReadAll(name, UINT64_MAX);
  std::memcpy(all.data() + offset, bytes.data(), bytes.size());
  auto w = store.Create(name);
  w->Append(all.data(), all.size());
  w->Close();
}

void Truncate(Store& store, const std::string& name, uint64_t size) {
  std::string all = store.ReadAll(name, UINT64_MAX);
  auto w = store.Create(name);
  w->Append(all.data(), size);
  w->Close();
}

}  // namespace

TEST_CASE("conformance: s3:// row", "[storage][conformance][s3]") {
  const std::string reason = dcp::testing::S3SkipReason();
  if (!reason.empty()) {
    dcp::testing::SkipTestCase("the s3:// conformance row: " + reason);
    return;
  }
  const auto names = Backends();
  CHECK(std::find(names.begin(), names.end(), "s3") != names.end());
}

TEST_CASE("conformance: Store objects", "[storage][conformance]") {
  for (const auto& scheme : Backends()) {
    DYNAMIC_SECTION(scheme) {
      Location loc = FreshLocation(scheme);
      auto store = OpenStore(loc.uri);
      store->CreateRoot();
      CHECK_FALSE(store->Size("a"));
      {
        auto w = store->Create("a");
        w->Append("hello ", 6);
        w->Append("world", 5);
        CHECK(w->size() == 11);
        w->Sync();
        w->Close();
      }
      REQUIRE(store->Size("a") == 11u);
      CHECK(store->ReadAll("a", UINT64_MAX) == "hello world");
      auto r = store->Open("a");
      char buf[5];
      r->ReadAt(6, buf, 5);
      CHECK(std::string(buf, 5) == "world");
      CHECK_THROWS_AS(r->ReadAt(8, buf, 5), CorruptionError);  // past the end
      CHECK_THROWS_AS(store->Open("missing"), NotFoundError);

      // An abandoned object leaves nothing under its name.
      {
        auto w = store->Create("abandoned");
        w->Append("x", 1);
      }
      CHECK_FALSE(store->Size("abandoned"));

      // Atomic publish replaces whole objects.
      store->PublishAtomically("m", "first");
      store->PublishAtomically("m", "second!");
      CHECK(store->ReadAll("m", UINT64_MAX) == "second!");
      auto names = store->List();
      std::sort(names.begin(), names.end());
      CHECK(names == std::vector<std::string>{"a", "m"});  // no temporaries left behind

      store->Remove("a");
      store->Remove("a");  // idempotent
      CHECK_FALSE(store->Size("a"));
    }
  }
}

TEST_CASE("conformance: save and load round trip", "[storage][conformance]") {
  for (const auto& scheme : Backends()) {
    for (CheckpointFormat format : Formats()) {
      for (int files : {1, 3}) {
        DYNAMIC_SECTION(scheme << " " << CheckpointFormatName(format)
                               << " files_per_rank=" << files) {
          Location loc = FreshLocation(scheme, format);
          std::vector<TensorView> src, dst;
          StateDict sd = MakeState(src);
          SaveOptions so;
          so.storage.files_per_rank = files;
          Metadata md = Save(sd, loc.uri, so).metadata;
          ReadStoredItems(loc.uri, md);
          CHECK(md.entries.size() == 5);
          CHECK(md.world_size == 1);
          CHECK(md.library_version == LibraryVersion());

          StateDict back = MakeEmptyLike(dst);
          Load(back, loc.uri);
          for (size_t i = 0; i < src.size(); ++i) CHECK(SameElements(src[i], dst[i]));
          CHECK(std::get<Blob>(*back.Find("rng")).bytes == std::get<Blob>(*sd.Find("rng")).bytes);

          Metadata read = ReadMetadata(loc.uri);
          // torch 1.13's metadata has no field for it (docs/TORCH_DCP.md).
          if (format != CheckpointFormat::kTorchDcp113) CHECK(read.save_id == md.save_id);
          CHECK(read.TotalStoredBytes() == md.TotalStoredBytes());
          auto store = OpenStore(loc.uri);
          CHECK(DetectLayout(*store) != nullptr);
          CHECK(DetectLayout(*store)->metadata_name() == MetadataName(format));
          size_t data_files = 0;
          for (const auto& n : store->List()) data_files += LayoutFor(format).IsDataFile(n);
          CHECK(data_files == static_cast<size_t>(files));
        }
      }
    }
  }
}

TEST_CASE("conformance: overwrite is refused unless asked, and replaces atomically",
          "[storage][conformance][option:StorageOptions::overwrite][option:SaveOptions::storage]") {
  for (const auto& scheme : Backends()) {
    for (CheckpointFormat format : Formats()) {
      DYNAMIC_SECTION(scheme << " " << CheckpointFormatName(format)) {
        Location loc = FreshLocation(scheme, format);
        std::vector<TensorView> a, b, out;
        StateDict first = MakeState(a);
        Save(first, loc.uri);
        StateDict second = MakeState(b);
        dcp::testing::FillRandom(b[0].data, b[0].nbytes(), 99);  // different values
        try {
          Save(second, loc.uri);
          FAIL("second save should have been refused");
        } catch (const CollectiveError& e) {
          REQUIRE(e.failures().size() == 1);
          CHECK(e.failures()[0].code == ErrorCode::kAlreadyExists);
          CHECK_THAT(e.what(), Contains("already exists"));
        }
        // The refused save left the first checkpoint intact.
        StateDict back = MakeEmptyLike(out);
        Load(back, loc.uri);
        CHECK(SameElements(out[0], a[0]));

        SaveOptions so;
        so.storage.overwrite = true;
        Save(second, loc.uri, so);
        Load(back, loc.uri);
        CHECK(SameElements(out[0], b[0]));
        // Only the new save's data files remain.
        auto store = OpenStore(loc.uri);
        const Metadata md = ReadMetadata(loc.uri);
        size_t data_files = 0;
        for (const auto& n : store->List()) {
          if (!IsAnyDataFile(n)) continue;
          CHECK_THAT(n, Contains(md.save_id));
          ++data_files;
        }
        CHECK(data_files == 1);
      }
    }
  }
}

TEST_CASE("conformance: the writer lock excludes a second writer and is released",
          "[storage][conformance][lock]") {
  for (const auto& scheme : Backends()) {
    DYNAMIC_SECTION(scheme) {
      Location loc = FreshLocation(scheme);
      auto store = OpenStore(loc.uri);
      store->CreateRoot();
      // Every backend of this suite has the primitive (nullptr would mean "none").
      std::unique_ptr<StoreLock> held = store->TryLock("job-a host=h pid=1");
      REQUIRE(held);
      CHECK_THAT(held->holder(), Contains("job-a"));
      // A second contender, through another Store of the same location, is refused at once,
      // with the location and the holder named.
      try {
        OpenStore(loc.uri)->TryLock("job-b");
        FAIL("the lock was granted twice");
      } catch (const LockedError& e) {
        CHECK(e.code() == ErrorCode::kAlreadyExists);
        CHECK_THAT(e.what(), Contains(store->uri()));
        CHECK_THAT(e.what(), Contains("job-a"));
      }
      // A save meanwhile is refused in its plan phase and writes nothing.
      std::vector<TensorView> a;
      StateDict sd = MakeState(a);
      try {
        Save(sd, loc.uri);
        FAIL("a save under someone else's lock succeeded");
      } catch (const CollectiveError& e) {
        CHECK_THAT(e.what(), Contains("locked"));
        CHECK_THAT(e.what(), Contains("job-a"));
      }
      CHECK(FirstDataObject(*store).empty());
      CHECK_FALSE(store->Size(kMetadataName));

      held->Release();
      held->Release();  // idempotent
      {
        auto again = OpenStore(loc.uri)->TryLock("job-b");
        REQUIRE(again);
      }  // destroying a lock releases it
      Save(sd, loc.uri);
      // The save released its lock, and no lock object is left among the checkpoint's objects.
      CHECK(store->TryLock("job-c"));
      for (const auto& n : store->List()) CHECK(n != kLockObjectName);
    }
  }
}

#ifdef DCP_KV_PLUGIN
TEST_CASE("conformance: kv:// lock lease lets a crashed holder's lock expire",
          "[storage][conformance][lock]") {
  Location loc = FreshLocation("kv");
  auto store = OpenStore(loc.uri);
  store->CreateRoot();
  ::setenv("DCP_KV_LOCK_LEASE_MS", "50", 1);
  auto crashed = store->TryLock("crashed-job");  // never released in time: a crashed holder
  CHECK_THROWS_AS(store->TryLock("next-job"), LockedError);
  std::this_thread::sleep_for(std::chrono::milliseconds(120));
  ::setenv("DCP_KV_LOCK_LEASE_MS", "600000", 1);
  auto next = store->TryLock("next-job");  // the lease expired: taken over
  REQUIRE(next);
  // The old holder's late release must not free the new holder's lock.
  crashed->Release();
  CHECK_THROWS_AS(store->TryLock("third-job"), LockedError);
  next->Release();
  CHECK(store->TryLock("third-job"));
  ::unsetenv("DCP_KV_LOCK_LEASE_MS");
}
#endif

TEST_CASE("conformance: missing, incomplete and garbage checkpoints", "[storage][conformance]") {
  for (const auto& scheme : Backends()) {
    for (CheckpointFormat format : Formats()) {
      DYNAMIC_SECTION(scheme << " " << CheckpointFormatName(format)) {
        Location loc = FreshLocation(scheme, format);
        const std::string& metadata_name = MetadataName(format);
        std::vector<TensorView> keep;
        StateDict sd = MakeEmptyLike(keep);
        CHECK_THROWS_WITH(ReadMetadata(loc.uri), Contains("no checkpoint"));
        try {
          Load(sd, loc.uri);
          FAIL("load of a missing checkpoint succeeded");
        } catch (const CollectiveError& e) {
          CHECK(e.failures()[0].code == ErrorCode::kNotFound);
          CHECK_THAT(e.what(), Contains("no checkpoint"));
        }

        std::vector<TensorView> src;
        StateDict full = MakeState(src);
        Save(full, loc.uri);
        auto store = OpenStore(loc.uri);
        const std::string good = store->ReadAll(metadata_name, UINT64_MAX);

        store->Remove(metadata_name);  // data without metadata: an unfinished save
        CHECK_THROWS_WITH(ReadMetadata(loc.uri), Contains("incomplete checkpoint"));

        store->PublishAtomically(metadata_name, "this is not a checkpoint at all");
        CHECK_THROWS_AS(ReadMetadata(loc.uri), CorruptionError);
        CHECK_THROWS_WITH(ReadMetadata(loc.uri), Contains(metadata_name));

        store->PublishAtomically(metadata_name, good.substr(0, good.size() - 3));
        CHECK_THROWS_AS(ReadMetadata(loc.uri), CorruptionError);
        if (format == CheckpointFormat::kDcp) {
          CHECK_THROWS_WITH(ReadMetadata(loc.uri), Contains("truncated"));
          // torch's pickle has no checksum; dcp's envelope does.
          std::string flipped = good;
          flipped[flipped.size() / 2] ^= 0x20;
          store->PublishAtomically(metadata_name, flipped);
          CHECK_THROWS_WITH(ReadMetadata(loc.uri), Contains("checksum"));
        }
      }
    }
  }
}

TEST_CASE("conformance: damaged data is detected and named",
          "[storage][conformance][option:StorageOptions::verify_checksums]"
          "[option:LoadOptions::storage]") {
  for (const auto& scheme : Backends()) {
    for (CheckpointFormat format : ChecksummedFormats()) {
      DYNAMIC_SECTION(scheme << " " << CheckpointFormatName(format)) {
        Location loc = FreshLocation(scheme, format);
        std::vector<TensorView> src, dst;
        StateDict sd = MakeState(src);
        Metadata md = Save(sd, loc.uri).metadata;
        ReadStoredItems(loc.uri, md);
        auto store = OpenStore(loc.uri);
        const std::string data = FirstDataObject(*store);
        REQUIRE_FALSE(data.empty());
        const StorageInfo w = md.storage.at(MetadataIndex{"model.w", {0, 0}, {}});

        // The middle of the item: its values in every format (a torch record's zip headers and
        // pickle take its first few hundred of these 8.4 KB).
        std::string original = store->ReadAll(data, UINT64_MAX);
        const uint64_t at = w.offset + w.length / 2;
        Patch(*store, data, at, std::string(1, static_cast<char>(original[at] ^ 1)));
        StateDict back = MakeEmptyLike(dst);
        try {
          Load(back, loc.uri);
          FAIL("flipped byte not detected");
        } catch (const CollectiveError& e) {
          CHECK(e.failures()[0].code == ErrorCode::kCorruption);
          CHECK_THAT(e.what(), Contains("model.w") && Contains(data) && Contains("checksum"));
        }
        // With verification off the (damaged) bytes load: the switch really switches.
        LoadOptions lo;
        lo.storage.verify_checksums = false;
        CHECK_NOTHROW(Load(back, loc.uri, lo));

        Truncate(*store, data, original.size() / 2);
        try {
          Load(back, loc.uri);
          FAIL("truncated file not detected");
        } catch (const CollectiveError& e) {
          CHECK(e.failures()[0].code == ErrorCode::kCorruption);
          CHECK_THAT(e.what(), Contains("truncated"));
        }
        store->Remove(data);
        CHECK_THROWS_AS(Load(back, loc.uri), CollectiveError);
      }
    }
  }
}

TEST_CASE("registry: unknown schemes, custom backends, plain paths", "[storage]") {
  CHECK_THROWS_WITH(OpenStorageWriter("nope://x"), Contains("nope://x") && Contains("mem://"));
  CHECK(SplitUri("/a/b") == std::pair<std::string, std::string>{"file", "/a/b"});
  CHECK(SplitUri("MEM://x") == std::pair<std::string, std::string>{"mem", "x"});
  auto schemes = RegisteredSchemes();
  CHECK(std::find(schemes.begin(), schemes.end(), "file") != schemes.end());

  // A user-registered Store backend: here a prefix inside a mem:// bucket.
  RegisterBackend(
      "prefixed", [](const std::string& loc) { return MakeMemStore("pfx/" + loc); }, true);
  CHECK_THROWS_AS(RegisterBackend("prefixed", [](const std::string&) { return MakeMemStore("x"); }),
                  AlreadyExistsError);
  std::vector<TensorView> src, dst;
  StateDict sd = MakeState(src);
  Save(sd, "prefixed://one");
  StateDict back = MakeEmptyLike(dst);
  Load(back, "prefixed://one");
  CHECK(SameElements(src[0], dst[0]));
  CHECK(MakeMemStore("pfx/one")->Size(kMetadataName));

  // A plain relative path is a directory.
  TempDir dir("plain");
  Save(sd, dir.path() + "/rel");
  CHECK(std::filesystem::exists(dir.path() + "/rel/" + kMetadataName));
}

TEST_CASE("registry: URI queries choose the format and set backend options",
          "[storage][option:StorageOptions::format]") {
  const ParsedUri p = ParseUri("S3://bkt/a/b?part_size_mib=16&format=torchdcp&x=%2Fy%26");
  CHECK(p.scheme == "s3");
  CHECK(p.location == "bkt/a/b");
  CHECK(p.query == BackendOptionMap{{"part_size_mib", "16"}, {"format", "torchdcp"}, {"x", "/y&"}});
  CHECK(ParseUri("/plain/path?x=1").location == "/plain/path");  // as file:// (uri_query_test)
  CHECK_THROWS_AS(ParseUri("mem://a?novalue"), InvalidArgumentError);
  CHECK_THROWS_AS(ParseUri("mem://a?k=1&k=2"), InvalidArgumentError);
  CHECK_THROWS_AS(ParseUri("mem://a?k=%zz"), InvalidArgumentError);
  CHECK(JoinUri("s3://b/x?a=1", "step-3") == "s3://b/x/step-3?a=1");
  CHECK(JoinUri("/d/x", "step-3") == "/d/x/step-3");

  std::vector<TensorView> src, dst;
  StateDict sd = MakeState(src);
  // An option the backend does not know fails loudly, naming the key and the known ones.
  ClearMemStore("query-opts");
  CHECK_THROWS_WITH(OpenStorageWriter("mem://query-opts?colour=blue"),
                    Contains("colour") && Contains("mem://"));
  TempDir dir("query");
  CHECK_THROWS_WITH(OpenStorageWriter("file://" + dir.path() + "/c?direct_io=maybe"),
                    Contains("direct_io") && Contains("maybe"));
  CHECK_THROWS_WITH(OpenStorageWriter("file://" + dir.path() + "/c?dirct_io=0"),
                    Contains("dirct_io") && Contains("direct_io"));
  SaveOptions typo;
  typo.storage.backend["colour"] = "blue";
  CHECK_THROWS_WITH(OpenStorageWriter("mem://query-opts", typo.storage), Contains("colour"));
  CHECK_THROWS_WITH(OpenStorageWriter("mem://query-opts?format=hdf5"), Contains("hdf5"));
  CHECK_THROWS_AS(OpenStorageWriter("torchdcp://" + dir.path() + "/c?format=dcp"),
                  InvalidArgumentError);
  // A backend registered without options refuses any.
  RegisterBackend(
      "plainopts", [](const std::string& loc) { return MakeMemStore("plainopts/" + loc); }, true);
  CHECK_THROWS_WITH(OpenStore("plainopts://x?a=1"), Contains("takes none"));

  // A valid option reaches the backend: buffered writes where direct I/O would be used.
  Save(sd, "file://" + dir.path() + "/buffered?direct_io=0");
  StateDict back = MakeEmptyLike(dst);
  Load(back, "file://" + dir.path() + "/buffered?direct_io=0");
  CHECK(SameElements(src[0], dst[0]));

  // The format from the options, on mem://: PyTorch DCP's layout, read back by detection.
  SaveOptions torch_opts;
  torch_opts.storage.format = CheckpointFormat::kTorchDcp;
  ClearMemStore("query-torch");
  Save(sd, "mem://query-torch", torch_opts);
  CHECK(MakeMemStore("query-torch")->Size(".metadata"));
  CHECK_FALSE(MakeMemStore("query-torch")->Size(kMetadataName));
  Load(back, "mem://query-torch");
  CHECK(SameElements(src[0], dst[0]));
  // ... and a dcp save over it is refused, naming what is there.
  CHECK_THROWS_WITH(Save(sd, "mem://query-torch",
                         [] {
                           SaveOptions o;
                           o.storage.overwrite = true;
                           return o;
                         }()),
                    Contains("PyTorch DCP checkpoint"));
  // The old alias still writes torch's layout to a directory.
  Save(sd, "torchdcp://" + dir.path() + "/alias");
  CHECK(std::filesystem::exists(dir.path() + "/alias/.metadata"));
}

// safetensors written elsewhere: the numpy-written fixture files (tests/fixtures/safetensors) are
// put into each backend through the Store interface, then every backend must load them
// bit-exact, whole and resharded, from the directory and from a URI naming one file. (dcp's own
// safetensors saves go through the suites above: Formats().)
TEST_CASE("conformance: safetensors checkpoints are read on every backend",
          "[storage][conformance][safetensors]") {
  const std::string fixtures = DCP_SAFETENSORS_FIXTURES;
  for (const auto& scheme : Backends()) {
    for (const std::string which : {"sharded", "single"}) {
      DYNAMIC_SECTION(scheme << " " << which) {
        const auto want = dcp::testing::ReadSafetensorsExpected(fixtures, which);
        Location loc = FreshLocation(scheme);
        auto store = OpenStore(loc.uri);
        store->CreateRoot();
        for (const auto& e : std::filesystem::directory_iterator(fixtures + "/" + which)) {
          const std::string bytes = dcp::testing::ReadFileBytes(e.path().string());
          auto w = store->Create(e.path().filename().string());
          w->Append(bytes.data(), bytes.size());
          w->Close();
        }
        REQUIRE(DetectLayout(*store) != nullptr);
        CHECK(DetectLayout(*store)->format() == CheckpointFormat::kSafetensors);

        // Whole, at one rank, every entry.
        const Metadata md = ReadMetadata(loc.uri);
        CHECK(md.entries.size() == want.size());
        StateDict sd;
        std::map<std::string, TensorView> views;
        for (const auto& [name, t] : want) {
          if (name == "rng") {
            sd.Set(name, Blob{});
            continue;
          }
          views.emplace(name, TensorView::Allocate(t.dtype, t.shape));
          sd.Set(name, views.at(name));
        }
        Load(sd, loc.uri);
        for (const auto& [name, v] : views) {
          INFO(name);
          CHECK(std::string(static_cast<const char*>(v.data), v.nbytes()) == want.at(name).bytes);
        }
        if (which == "single") {
          CHECK(std::get<Blob>(*sd.Find("rng")).bytes == want.at("rng").bytes);
        }

        // Resharded: rows split over 2 ranks.
        dcp::testing::RequireNoErrors(dcp::testing::RunRanks(2, [&](int r, Communicator& comm) {
          StateDict part;
          std::map<std::string, std::pair<TensorView, std::pair<int64_t, int64_t>>> mine;
          for (const auto& [name, t] : want) {
            if (name == "rng") {
              part.Set(name, Blob{});
              continue;
            }
            if (t.shape.empty()) {
              TensorView v = TensorView::Allocate(t.dtype, t.shape);
              part.Set(name, v);
              mine.emplace(name, std::make_pair(v, std::make_pair(int64_t{0}, int64_t{1})));
              continue;
            }
            const auto [b, e] = dcp::testing::RowRange(t.shape[0], r, 2);
            Shape local = t.shape, offsets(t.shape.size(), 0);
            local[0] = e - b;
            offsets[0] = b;
            TensorView v = TensorView::Allocate(t.dtype, local);
            ShardedTensor st{t.dtype, t.shape, {}};
            if (e > b) st.local_shards.push_back({v, offsets});
            part.Set(name, st);
            mine.emplace(name, std::make_pair(v, std::make_pair(b, e)));
          }
          Load(part, loc.uri, comm);
          for (const auto& [name, got] : mine) {
            const auto& t = want.at(name);
            dcp::testing::Expect(
                std::string(static_cast<const char*>(got.first.data), got.first.nbytes()) ==
                    dcp::testing::RowSlice(t.bytes, t.shape, ElementSize(t.dtype), got.second.first,
                                           got.second.second),
                name + " differs at rank " + std::to_string(r));
          }
        }));

        // A URI naming one file loads that file alone.
        const std::string first = want.begin()->second.file;
        const Metadata one = ReadMetadata(JoinUri(loc.uri, first));
        size_t in_first = 0;
        for (const auto& [name, t] : want) in_first += t.file == first;
        CHECK(one.entries.size() == in_first);
        CHECK(one.world_size == 1);

        // A safetensors save does not replace it unless asked, and a dcp save does not mix in.
        try {
          Save(sd, loc.uri + "?format=safetensors");
          FAIL("a safetensors save over a safetensors checkpoint succeeded");
        } catch (const CollectiveError& e) {
          CHECK(e.failures()[0].code == ErrorCode::kAlreadyExists);
        }
        try {
          Save(sd, loc.uri);
          FAIL("a dcp save over a safetensors checkpoint succeeded");
        } catch (const CollectiveError& e) {
          CHECK(e.failures()[0].code == ErrorCode::kAlreadyExists);
        }

        // A shard the index names, missing: NotFoundError naming it.
        if (which == "sharded") {
          store->Remove(first);
          try {
            ReadMetadata(loc.uri);
            FAIL("read metadata with a shard missing");
          } catch (const NotFoundError& e) {
            CHECK_THAT(e.what(), Contains(first));
          }
        }
      }
    }
  }
}
