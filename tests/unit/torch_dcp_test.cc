// PyTorch DCP interop: the restricted unpickler, the fixtures torch 2.11 wrote (bit-exact against
// their expected safetensors), and dcp writing torch's layout and reading it back.
#include "dcp/storage/format/torch_dcp.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "dcp/checkpoint.h"
#include "dcp/planner/planner.h"
#include "dcp/proto/dtype_cast.h"
#include "dcp/storage/backends/mem_store.h"
#include "dcp/storage/checkpoint/store_checkpoint.h"
#include "dcp/storage/format/pickle.h"
#include "dcp/storage/registry.h"
#include "support/test_support.h"

namespace dcp {
namespace {

namespace pk = pickle;
using Json = nlohmann::json;
using testing::ReadFileBytes;
using testing::ReadSafetensors;
using testing::TempDir;
using namespace std::string_literals;

const std::string kFixtures = DCP_TORCH_DCP_FIXTURES;

pk::AllowGlobal AllowAll() {
  return [](std::string_view, std::string_view) { return true; };
}
pk::AllowGlobal AllowNone() {
  return [](std::string_view, std::string_view) { return false; };
}

std::string ErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST_CASE("pickle: values round-trip through Dump and Load", "[torchdcp]") {
  using namespace pk;
  ValuePtr v = Object(Global("m", "C"),
                      {Int(-5), Int(70000), Int(int64_t{1} << 40), Int(INT64_MIN), Float(0.25),
                       Str("héllo"), Bytes(std::string(300, 'x')), None(), Bool(true),
                       List({Int(1), Tuple({Str("a"), Str("a")})}), Dict({{Str("k"), Tuple({})}})},
                      Dict({{Str("s"), Persistent(Str("id"))}}), true);
  const std::string bytes = Dump(*v);
  ValuePtr back = Load(bytes, AllowAll(), "test");
  REQUIRE(back->kind == Kind::kObject);
  CHECK(back->newobj);
  CHECK(back->global_name() == "m.C");
  const auto& a = back->args->items;
  REQUIRE(a.size() == 11);
  CHECK(a[0]->integer == -5);
  CHECK(a[1]->integer == 70000);
  CHECK(a[2]->integer == int64_t{1} << 40);
  CHECK(a[3]->integer == INT64_MIN);
  CHECK(a[4]->real == 0.25);
  CHECK(a[5]->str == "héllo");
  CHECK(a[6]->kind == Kind::kBytes);
  CHECK(a[6]->str == std::string(300, 'x'));
  CHECK(a[7]->kind == Kind::kNone);
  CHECK(a[8]->boolean);
  CHECK(a[9]->items[1]->items[1]->str == "a");
  CHECK(back->state->Get("s")->kind == Kind::kPersistent);
  CHECK(back->state->Get("s")->items[0]->str == "id");
  // Deterministic output.
  CHECK(Dump(*back) == bytes);
}

TEST_CASE("pickle: the reader refuses what is not data", "[torchdcp]") {
  // A global off the allow-list is named (the classic os.system payload).
  const std::string evil =
      std::string("\x80\x02") + "cos\nsystem\n" + "X\x02\x00\x00\x00id" + "\x85R.";
  const std::string err = ErrorOf([&] { pk::Load(evil, AllowNone(), "evil.pkl"); });
  CHECK_THAT(err, Catch::Contains("os.system") && Catch::Contains("evil.pkl") &&
                      Catch::Contains("allow-list"));
  // Code-running opcodes are refused by name.
  CHECK_THAT(ErrorOf([] { pk::Load("(cos\nsystem\nS'id'\ni.", AllowNone(), "x"); }),
             Catch::Contains("pickle"));
  CHECK_THAT(ErrorOf([] {
               pk::Load(std::string("\x80\x02(\x8c\x01\x61\x8c\x01\x62\x92."), AllowAll(), "x");
             }),
             Catch::Contains("NEWOBJ_EX"));
  // A list that contains itself.
  CHECK_THAT(ErrorOf([] { pk::Load("\x80\x02]q\x00h\x00\x61."s, AllowAll(), "x"); }),
             Catch::Contains("contains itself"));
  // A container changed after nesting (the only way to build a cycle through two lists).
  CHECK_THAT(ErrorOf([] {
               pk::Load(
                   "\x80\x02]q\x00]q\x01h\x00\x61"
                   "0h\x01\x61."s,
                   AllowAll(), "x");
             }),
             Catch::Contains("changed after being nested"));
  // Deep nesting, truncation, memo abuse, trailing bytes, an oversized integer.
  CHECK_THAT(ErrorOf([] {
               pk::Load(
                   std::string("\x80\x02") + std::string(200, ']') + std::string(199, 'a') + ".",
                   AllowAll(), "x");
             }),
             Catch::Contains("nested deeper"));
  CHECK_THAT(ErrorOf([] {
               pk::Load(
                   "\x80\x02X\xff\xff\xff\x00"
                   "ab"s,
                   AllowAll(), "x");
             }),
             Catch::Contains("truncated"));
  CHECK_THAT(ErrorOf([] { pk::Load(std::string("\x80\x02Nr\xff\xff\xff\x7f."), AllowAll(), "x"); }),
             Catch::Contains("memo index"));
  CHECK_THAT(ErrorOf([] { pk::Load(std::string("\x80\x02h\x05."), AllowAll(), "x"); }),
             Catch::Contains("never stored"));
  CHECK_THAT(ErrorOf([] { pk::Load(std::string("\x80\x02N.N"), AllowAll(), "x"); }),
             Catch::Contains("after STOP"));
  CHECK_THAT(ErrorOf([] {
               pk::Load(std::string("\x80\x02\x8a\x09") + std::string(9, '\1') + ".", AllowAll(),
                        "x");
             }),
             Catch::Contains("64 bits"));
  pk::Limits small;
  small.max_values = 10;
  CHECK_THAT(ErrorOf([&] {
               pk::Load(std::string("\x80\x02(") + std::string(20, 'N') + "l.", AllowAll(), "x",
                        small);
             }),
             Catch::Contains("more than 10 values"));
}

// A torch 2.x `.metadata` of one float32 tensor `fqn` of `n` 1-element chunks, every reference
// to `fqn` being the same string, which the pickle memoises: a small file can name a long
// string many times.
// `path_keys` > 0 adds planner_data giving `fqn` a key path of that many references to one
// memoised 1 MiB key.
std::string SharedValueMetadata(const std::string& fqn, int64_t n, int path_keys = 0) {
  using namespace pk;
  const std::string meta = "torch.distributed.checkpoint.metadata";
  auto dataclass = [&](const std::string& mod, const std::string& cls, ValuePtr state) {
    return Object(Global(mod, cls), {}, std::move(state), /*newobj=*/true);
  };
  auto size = [](std::vector<int64_t> v) {
    std::vector<ValuePtr> items;
    for (int64_t x : v) items.push_back(Int(x));
    return Object(Global("torch", "Size"), {Tuple(std::move(items))});
  };
  ValuePtr name = Str(fqn);
  std::vector<ValuePtr> chunks;
  std::vector<std::pair<ValuePtr, ValuePtr>> storage;
  for (int64_t i = 0; i < n; ++i) {
    ValuePtr offsets = size({i});
    chunks.push_back(dataclass(meta, "ChunkStorageMetadata",
                               Dict({{Str("offsets"), offsets}, {Str("sizes"), size({1})}})));
    storage.emplace_back(
        dataclass(meta, "MetadataIndex",
                  Dict({{Str("fqn"), name}, {Str("offset"), offsets}, {Str("index"), Int(i)}})),
        dataclass("torch.distributed.checkpoint.filesystem", "_StorageInfo",
                  Dict({{Str("relative_path"), Str("__0_0.distcp")},
                        {Str("offset"), Int(i * 4)},
                        {Str("length"), Int(4)}})));
  }
  ValuePtr props = dataclass(meta, "TensorProperties", Tuple({Global("torch", "float32")}));
  ValuePtr tensor = dataclass(meta, "TensorStorageMetadata",
                              Dict({{Str("properties"), props},
                                    {Str("size"), size({n})},
                                    {Str("chunks"), List(std::move(chunks))}}));
  std::vector<std::pair<ValuePtr, ValuePtr>> fields = {
      {Str("state_dict_metadata"), Dict({{name, tensor}})},
      {Str("storage_data"), Dict(std::move(storage))}};
  if (path_keys > 0) {
    ValuePtr key = Str(std::string(1 << 20, 'k'));
    fields.emplace_back(Str("planner_data"),
                        Dict({{name, Tuple(std::vector<ValuePtr>(path_keys, key))}}));
  }
  return Dump(*dataclass(meta, "Metadata", Dict(std::move(fields))));
}

TEST_CASE("torch DCP metadata: shared values cannot make the reader copy gigabytes",
          "[torchdcp][scale]") {
  // Well-formed, small: decodes.
  const Metadata ok = DecodeTorchDcpMetadata(SharedValueMetadata("w", 3), "small");
  REQUIRE(ok.entries.count("w") == 1);
  CHECK(std::get<TensorMetadata>(ok.entries.at("w")).chunks.size() == 3);
  CHECK(ok.storage.size() == 3);
  // A 64 KiB fqn named by 8192 stored items: a ~0.6 MB file that used to make the reader copy
  // the name 8192 times (512 MiB) before anything was checked; 8192 times that fqn would be
  // 4 GiB from a 5 MB file. (A memoised tuple shared by every chunk's offsets is bounded alike.)
  const std::string amplified = SharedValueMetadata(std::string(64 << 10, 'f'), 8192);
  CHECK(amplified.size() < (size_t{1} << 20));
  CHECK_THAT(ErrorOf([&] { DecodeTorchDcpMetadata(amplified, "amplified"); }),
             Catch::Contains("amplified") && Catch::Contains("expands to far more"));
  // planner_data: one memoised 1 MiB key referenced 4096 times as an entry's key path, a ~1 MB
  // file whose key path would be 4 GiB (and its error message 1 GiB).
  const std::string paths = SharedValueMetadata("w", 3, 4096);
  CHECK(paths.size() < (size_t{2} << 20));
  const std::string error = ErrorOf([&] { DecodeTorchDcpMetadata(paths, "paths"); });
  CHECK_THAT(error, Catch::Contains("planner_data") && Catch::Contains("expands to far more"));
  CHECK(error.size() < 4096);
}

struct Fixture {
  std::string name;
  std::string dir;
  Json json;
  std::map<std::string, std::string> expected;
};

Fixture LoadFixture(const std::string& name) {
  Fixture f;
  f.name = name;
  f.dir = kFixtures + "/" + name;
  f.json = Json::parse(ReadFileBytes(kFixtures + "/" + name + ".json"));
  f.expected = ReadSafetensors(kFixtures + "/" + name + ".expected.safetensors");
  return f;
}

const char* kCases[] = {"single_dtypes", "model_adamw", "dist4_dtensor"};

// The metadata of a torch checkpoint as the fixture's json describes it.
void CheckMetadataAgainstJson(const Metadata& md, const Fixture& f) {
  const Json& entries = f.json["entries"];
  REQUIRE(md.entries.size() == entries.size());
  for (const auto& [fqn, e] : entries.items()) {
    INFO(f.name << ": " << fqn);
    auto it = md.entries.find(fqn);
    REQUIRE(it != md.entries.end());
    if (e["kind"] == "bytes") {
      CHECK(std::holds_alternative<BytesMetadata>(it->second));
      continue;
    }
    const auto& tm = std::get<TensorMetadata>(it->second);
    CHECK("torch." + std::string(DTypeName(tm.dtype)) == e["dtype"].get<std::string>());
    CHECK(tm.shape == e["shape"].get<Shape>());
    const Json& chunks = f.json["metadata"][fqn]["chunks"];
    REQUIRE(tm.chunks.size() == chunks.size());
    for (size_t k = 0; k < chunks.size(); ++k) {
      CHECK(tm.chunks[k].offsets == chunks[k][0].get<Shape>());
      CHECK(tm.chunks[k].sizes == chunks[k][1].get<Shape>());
    }
  }
}

// Load every entry of `uri` (load_all) and compare with the fixture's expected values.
void CheckLoadAll(const std::string& uri, const Fixture& f) {
  StateDict sd = LoadAll(uri);
  auto flat = FlattenStateDict(sd);
  size_t tensors = 0;
  for (const auto& [fqn, e] : f.json["entries"].items()) {
    INFO(f.name << ": " << fqn);
    auto it = flat.find(fqn);
    REQUIRE(it != flat.end());
    if (e["kind"] == "bytes") {
      REQUIRE(std::holds_alternative<Blob>(*it->second.value));
      continue;
    }
    ++tensors;
    const auto* view = std::get_if<TensorView>(it->second.value);
    REQUIRE(view);
    REQUIRE(f.expected.count(fqn));
    const std::string& want = f.expected.at(fqn);
    REQUIRE(view->nbytes() == want.size());
    CHECK(std::memcmp(view->data, want.data(), want.size()) == 0);
  }
  CHECK(tensors == f.expected.size());
}

TEST_CASE("torch DCP fixtures: metadata matches what torch 2.11 recorded", "[torchdcp]") {
  for (const char* name : kCases) {
    const Fixture f = LoadFixture(name);
    const Metadata md = ReadMetadata(f.dir);
    CheckMetadataAgainstJson(md, f);
    CHECK_THAT(md.library_version, Catch::Contains("torch.distributed.checkpoint 1.0.0"));
  }
}

TEST_CASE("torch DCP fixtures: every tensor loads bit-exact, from a plain path", "[torchdcp]") {
  for (const char* name : kCases) CheckLoadAll(kFixtures + "/" + name, LoadFixture(name));
}

TEST_CASE("torch DCP fixtures: byte entries are torch.save pickles of their objects",
          "[torchdcp]") {
  const Fixture f = LoadFixture("single_dtypes");
  StateDict sd;
  sd.Set("step", Blob{});
  sd.Nested("note").Set("lr", Blob{});
  Load(sd, f.dir);
  const auto& step = std::get<Blob>(*sd.Find("step")).bytes;
  CHECK(IsTorchSaveArchive(step));
  CHECK(f.json["entries"]["step"]["python_repr"] == "1234");
  // Stored as dcp writes them into a torch checkpoint, they come back unchanged.
  TempDir dir("tdcp");
  Save(sd, "torchdcp://" + dir.path() + "/out");
  StateDict back;
  back.Set("step", Blob{});
  back.Nested("note").Set("lr", Blob{});
  Load(back, dir.path() + "/out");
  CHECK(std::get<Blob>(*back.Find("step")).bytes == step);
  CHECK(std::get<Blob>(*back.Nested("note").Find("lr")).bytes ==
        std::get<Blob>(*sd.Nested("note").Find("lr")).bytes);
}

TEST_CASE("torch DCP: dcp writes torch's layout and reads it back exactly", "[torchdcp]") {
  for (const char* name : kCases) {
    const Fixture f = LoadFixture(name);
    StateDict sd = LoadAll(f.dir);
    const Metadata src = ReadMetadata(f.dir);
    for (const char* scheme : {"torchdcp", "torchdcp113"}) {
      if (std::string(scheme) == "torchdcp113" && std::string(name) == "single_dtypes") {
        // fp8 and unsigned dtypes do not exist in torch 1.13: refused, naming the tensor.
        TempDir dir("tdcp");
        CHECK_THAT(ErrorOf([&] { Save(sd, std::string(scheme) + "://" + dir.path() + "/o"); }),
                   Catch::Contains("1.13"));
        continue;
      }
      INFO(name << " via " << scheme);
      TempDir dir("tdcp");
      const std::string out = dir.path() + "/out";
      Save(sd, std::string(scheme) + "://" + out);
      const std::string pickled = ReadFileBytes(out + "/.metadata");
      CHECK(pickled.find(std::string(scheme) == "torchdcp"
                             ? "torch.distributed.checkpoint.metadata"
                             : "torch.distributed._shard.checkpoint.metadata") !=
            std::string::npos);
      const Metadata md = ReadMetadata(out);
      CHECK(md.entries.size() == src.entries.size());
      CheckLoadAll(out, f);
      // Same classes and fields as torch's own metadata: every global of the fixture's
      // .metadata is in ours (2.x).
      if (std::string(scheme) == "torchdcp") {
        auto globals = [](const std::string& bytes) {
          std::set<std::string> g;
          std::function<void(const pk::Value&)> walk = [&](const pk::Value& v) {
            if (v.kind == pk::Kind::kGlobal) g.insert(v.global_name());
            for (const auto& p : {v.callable, v.args, v.state}) {
              if (p) walk(*p);
            }
            for (const auto& i : v.items) walk(*i);
          };
          walk(*pk::Load(bytes, AllowAll(), "x"));
          return g;
        };
        std::set<std::string> want = globals(ReadFileBytes(f.dir + "/.metadata"));
        want.erase("pathlib.PosixPath");  // torch records the checkpoint_id as a path object
        std::set<std::string> have = globals(pickled);
        for (const auto& g : want) CHECK(have.count(g) == 1);
      }
    }
  }
}

TEST_CASE("torch DCP: a transposed tensor is stored with its strides and resharded", "[torchdcp]") {
  // single_dtypes' "transposed" record keeps torch's strides: load it in pieces.
  const Fixture f = LoadFixture("single_dtypes");
  const std::string& want = f.expected.at("transposed");  // float32 [4, 6]
  std::vector<float> top(2 * 6), bottom(2 * 6);
  StateDict sd;
  ShardedTensor st;
  st.dtype = DType::kFloat32;
  st.global_shape = {4, 6};
  st.local_shards.push_back(
      {TensorView::FromContiguous(top.data(), DType::kFloat32, {2, 6}), {0, 0}});
  st.local_shards.push_back(
      {TensorView::FromContiguous(bottom.data(), DType::kFloat32, {2, 6}), {2, 0}});
  sd.Set("transposed", st);
  LoadOptions lo;
  lo.allow_partial_load = true;
  Load(sd, f.dir, lo);
  CHECK(std::memcmp(top.data(), want.data(), 48) == 0);
  CHECK(std::memcmp(bottom.data(), want.data() + 48, 48) == 0);
}

// A copy of fixture `name` with one bit flipped in the storage of `fqn`'s record (its first
// chunk), located through the record's own zip directory.
std::string FlipStorageBit(const std::string& name, const std::string& fqn, const TempDir& dir) {
  const std::string out = dir.path() + "/" + name;
  std::filesystem::copy(kFixtures + "/" + name, out);
  const Metadata md = ReadMetadata(out);
  const auto& tm = std::get<TensorMetadata>(md.entries.at(fqn));
  const StorageInfo& info = md.storage.at(MetadataIndex{fqn, tm.chunks[0].offsets, 0});
  auto store = OpenStore("file://" + out);
  auto in = store->Open(info.relative_path);
  const TorchTensorRecord rec = ResolveTorchTensorRecord(*in, info.offset, info.length, fqn);
  REQUIRE(rec.storage_bytes > 0);
  const std::string file = out + "/" + info.relative_path;
  std::string bytes = ReadFileBytes(file);
  bytes[rec.storage_begin + rec.storage_bytes / 2] ^= 0x10;
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  return out;
}

TEST_CASE("torch DCP: a flipped bit in a record's storage fails every load path (as verify does)",
          "[torchdcp][hostile]") {
  TempDir dir("tdcp-crc");
  SECTION("row-major, whole (load_all and a destination of the stored shape)") {
    const std::string ck = FlipStorageBit("single_dtypes", "dtypes.float32", dir);
    CHECK_THAT(ErrorOf([&] { LoadAll(ck); }), Catch::Contains("checksum mismatch") &&
                                                  Catch::Contains("dtypes.float32") &&
                                                  Catch::Contains("zip CRC-32"));
    std::vector<float> w(15);
    StateDict one;
    one.Nested("dtypes").Set("float32",
                             TensorView::FromContiguous(w.data(), DType::kFloat32, {5, 3}));
    LoadOptions partial;
    partial.allow_partial_load = true;
    CHECK_THAT(ErrorOf([&] { Load(one, ck, partial); }), Catch::Contains("checksum mismatch"));
  }
  SECTION("row-major, resharded (a box of the stored chunk, verified once per rank)") {
    const std::string ck = FlipStorageBit("dist4_dtensor", "rows", dir);
    std::vector<float> part(2 * 7);
    StateDict sd;
    ShardedTensor st;
    st.dtype = DType::kFloat32;
    st.global_shape = {13, 7};
    st.local_shards.push_back(
        {TensorView::FromContiguous(part.data(), DType::kFloat32, {2, 7}), {1, 0}});
    sd.Set("rows", st);
    LoadOptions lo;
    lo.allow_partial_load = true;
    CHECK_THAT(ErrorOf([&] { Load(sd, ck, lo); }), Catch::Contains("checksum mismatch"));
  }
  SECTION("strided (a transposed record, read through its strides)") {
    const std::string ck = FlipStorageBit("single_dtypes", "transposed", dir);
    std::vector<float> t(24);
    StateDict sd;
    sd.Set("transposed", TensorView::FromContiguous(t.data(), DType::kFloat32, {4, 6}));
    LoadOptions lo;
    lo.allow_partial_load = true;
    CHECK_THAT(ErrorOf([&] { Load(sd, ck, lo); }),
               Catch::Contains("checksum mismatch") && Catch::Contains("transposed"));
  }
}

TEST_CASE("torch DCP: damaged records fail naming the record", "[torchdcp]") {
  TempDir dir("tdcp");
  const std::string out = dir.path() + "/ck";
  std::vector<float> w(64, 1.5f);
  StateDict sd;
  sd.Set("w", TensorView::FromContiguous(w.data(), DType::kFloat32, {8, 8}));
  Save(sd, "torchdcp://" + out);
  std::string data_file;
  for (const auto& e : std::filesystem::directory_iterator(out)) {
    if (e.path().extension() == ".distcp") data_file = e.path();
  }
  REQUIRE(!data_file.empty());
  // Truncate the archive's end (central directory): the zip reader cannot open it.
  std::string bytes = ReadFileBytes(data_file);
  std::filesystem::permissions(data_file, std::filesystem::perms::owner_all);
  {
    std::ofstream o(data_file, std::ios::binary | std::ios::trunc);
    std::string cut = bytes;
    cut[cut.size() - 22] = 'X';  // the end-of-central-directory signature
    o << cut;
  }
  std::vector<float> r(64);
  StateDict rd;
  rd.Set("w", TensorView::FromContiguous(r.data(), DType::kFloat32, {8, 8}));
  const std::string err = ErrorOf([&] { Load(rd, out); });
  CHECK_THAT(err, Catch::Contains("record of 'w'") && Catch::Contains(".distcp"));
}

struct ZipEntry {
  std::string name;
  uint32_t crc;
  std::string content;  // stored entries under 1 KiB
};

// The entries of every archive in a .distcp file, each archive's in central-directory order.
std::vector<std::vector<ZipEntry>> DistcpArchives(const std::string& bytes) {
  auto u16 = [&](size_t at) {
    return static_cast<uint32_t>(static_cast<uint8_t>(bytes[at])) |
           static_cast<uint32_t>(static_cast<uint8_t>(bytes[at + 1])) << 8;
  };
  auto u32 = [&](size_t at) { return u16(at) | u16(at + 2) << 16; };
  std::vector<std::vector<ZipEntry>> archives;
  size_t archive_start = 0;
  for (size_t at = bytes.find("PK\x01\x02"); at != std::string::npos;
       at = bytes.find("PK\x01\x02", at + 4)) {
    const size_t name_len = u16(at + 28);
    ZipEntry e{bytes.substr(at + 46, name_len), u32(at + 16), {}};
    if (e.name == "archive/data.pkl") {
      // Local header offsets count from each archive's start: data.pkl's header is there
      // (its offset is 0), the nearest one before this directory.
      archives.emplace_back();
      archive_start = bytes.rfind("PK\x03\x04", bytes.rfind("archive/data.pkl", at));
    }
    const size_t local = archive_start + u32(at + 42);
    const size_t size = u32(at + 24);
    if (size < 1024) {
      const size_t data = local + 30 + u16(local + 26) + u16(local + 28);
      e.content = bytes.substr(data, size);
    }
    archives.back().push_back(std::move(e));
  }
  return archives;
}

TEST_CASE("torch DCP: tensor records are protocol-2 pickles with torch's serialization id",
          "[torchdcp]") {
  TempDir dir("sid");
  StateDict sd;
  sd.Set("w", testing::RandomTensor(DType::kFloat32, {4, 4}, 3));
  Save(sd, "torchdcp://" + dir.path() + "/out");
  std::string data_file;
  for (const auto& f : std::filesystem::directory_iterator(dir.path() + "/out")) {
    if (f.path().extension() == ".distcp") data_file = f.path();
  }
  const auto ours = DistcpArchives(ReadFileBytes(data_file));
  REQUIRE(ours.size() == 1);
  const auto& record = ours[0];
  std::vector<std::string> names;
  for (const auto& e : record) names.push_back(e.name);
  // The entries torch 2.11 writes, in its order (the fixtures' tensor records).
  CHECK(names == std::vector<std::string>{"archive/data.pkl", "archive/.format_version",
                                          "archive/.storage_alignment", "archive/byteorder",
                                          "archive/data/0", "archive/version",
                                          "archive/.data/serialization_id"});
  CHECK(record[0].content.substr(0, 2) == "\x80\x02");  // protocol 2, as torch.save writes
  const std::string id = record.back().content;
  REQUIRE(id.size() == 40);

  // The id's first half hashes the entry names: the same names give torch's own value.
  const auto theirs = DistcpArchives(ReadFileBytes(kFixtures + "/model_adamw/__0_0.distcp"));
  bool compared = false;
  for (const auto& archive : theirs) {
    if (archive.size() != record.size() || archive[4].name != "archive/data/0") continue;
    CHECK(archive.back().content.substr(0, 20) == id.substr(0, 20));
    compared = true;
    break;
  }
  CHECK(compared);
  // The second half combines the CRC-32s of the entries before it, as torch combines them.
  size_t crcs = 0;
  for (size_t i = 0; i + 1 < record.size(); ++i) {
    crcs ^= size_t{record[i].crc} + 0x9e3779b9 + (crcs << 6) + (crcs >> 2);
  }
  char want[21];
  std::snprintf(want, sizeof(want), "%020zu", crcs);
  CHECK(id.substr(20) == want);
}

TEST_CASE("torch DCP: bytes that torch.save pickled (protocol 2) come back as the bytes",
          "[torchdcp]") {
  const std::string dir = kFixtures + "/../torch-save-bytes/";
  std::string payload = "unchanged";
  CHECK(TorchSaveBytesPayload(ReadFileBytes(dir + "hello_ff_00.pt"), &payload));
  CHECK(payload == "hello\xff\x00"s);
  CHECK(TorchSaveBytesPayload(ReadFileBytes(dir + "empty.pt"), &payload));
  CHECK(payload.empty());
  // dcp's own wrapping (protocol 3, BINBYTES) too; a pickled int is not bytes.
  CHECK(TorchSaveBytesPayload(TorchSaveOfBytes("\x01\x02"s), &payload));
  CHECK(payload == "\x01\x02"s);
  const Fixture f = LoadFixture("single_dtypes");
  StateDict sd;
  sd.Set("step", Blob{});
  Load(sd, f.dir);
  CHECK_FALSE(TorchSaveBytesPayload(std::get<Blob>(*sd.Find("step")).bytes, &payload));
}

TEST_CASE("torch DCP: planner_data key paths keep torch's int list positions", "[torchdcp]") {
  // model_adamw's optimizer state: torch records optim.param_groups.0.lr's path with the int 0.
  const std::string src = kFixtures + "/model_adamw";
  TempDir dir("pd");
  Save(LoadAll(src), "torchdcp://" + dir.path() + "/out");
  auto planner_data = [](const std::string& file) {
    const pk::ValuePtr root = pk::Load(
        ReadFileBytes(file), [](std::string_view, std::string_view) { return true; }, file);
    const pk::Value* state = root->state.get();
    REQUIRE(state != nullptr);
    const pk::Value* pd = state->Get("planner_data");
    REQUIRE(pd != nullptr);
    std::map<std::string, std::vector<std::string>> paths;  // element kind + value
    for (size_t i = 0; i + 1 < pd->items.size(); i += 2) {
      for (const auto& e : pd->items[i + 1]->items) {
        paths[pd->items[i]->str].push_back(
            e->kind == pk::Kind::kInt ? "int " + std::to_string(e->integer) : "str " + e->str);
      }
    }
    return paths;
  };
  const auto theirs = planner_data(src + "/.metadata");
  const auto ours = planner_data(dir.path() + "/out/.metadata");
  CHECK(ours == theirs);
  bool saw_int = false;
  for (const auto& [fqn, path] : theirs) {
    for (const auto& e : path) saw_int = saw_int || e.rfind("int ", 0) == 0;
  }
  CHECK(saw_int);
}

// torch.save files read without LibTorch (ReadTorchSaveFile), written by torch 1.13
// (tests/fixtures/torch-save-files/make_files.py).
struct SaveFile {
  std::shared_ptr<Store> store = OpenStore("file://" + kFixtures + "/../torch-save-files");
  std::unique_ptr<ReadableObject> in;
  std::map<std::string, TorchSaveLeaf> leaves;
  explicit SaveFile(const std::string& name) : in(store->Open(name)) {
    for (auto& leaf : ReadTorchSaveFile(*in, in->size(), name)) {
      const std::string fqn = leaf.fqn;
      CHECK(leaves.emplace(fqn, std::move(leaf)).second);
    }
  }
  // The tensor's values, row-major, as floats.
  std::vector<double> Values(const std::string& fqn) {
    const TorchTensorRecord& rec = *leaves.at(fqn).tensor;
    const std::vector<char> storage = ReadTorchRecordStorage(*in, rec, fqn, true);
    TensorView src;
    src.data = const_cast<char*>(storage.data()) + (rec.values_begin() - rec.storage_begin);
    src.dtype = rec.dtype;
    src.shape = rec.sizes;
    src.strides = rec.strides;
    TensorView dst = TensorView::Allocate(DType::kFloat64, rec.sizes);
    CastTensor(dst, src);
    const auto* d = static_cast<const double*>(dst.data);
    return std::vector<double>(d, d + NumElements(rec.sizes));
  }
};

std::vector<double> Iota(int n, double scale, int skip = 0) {
  std::vector<double> v;
  for (int i = skip; i < skip + n; ++i) v.push_back(i * scale);
  return v;
}

TEST_CASE("torch.save files: a model's state_dict reads without LibTorch", "[torchdcp]") {
  SaveFile f("state_dict.pt");  // an OrderedDict with _metadata, filled by SETITEMS
  CHECK(f.leaves.size() == 4);
  CHECK(f.Values("0.weight") == Iota(12, 0.25));
  CHECK(f.Values("0.bias") == Iota(3, 0.5));
  CHECK(f.Values("2.weight") == Iota(6, 0.75));
  CHECK(f.Values("2.bias") == Iota(2, 1.0));
  CHECK(f.leaves.at("2.weight").tensor->sizes == Shape{2, 3});
  SaveFile one("one_entry.pt");  // SETITEM: LibTorch 1.13's unpickler refuses it
  REQUIRE(one.leaves.count("w"));
  CHECK(one.leaves.at("w").tensor->dtype == DType::kInt64);
  CHECK(one.Values("w") == Iota(6, 1));
}

TEST_CASE("torch.save files: nested dicts, shared storages, views and plain values", "[torchdcp]") {
  SaveFile f("mixed.pt");
  const auto& emb = *f.leaves.at("model.emb").tensor;
  const auto& tied = *f.leaves.at("model.tied").tensor;
  CHECK(emb.storage_begin == tied.storage_begin);  // one storage, listed once
  CHECK(f.Values("model.emb") == Iota(24, 1));
  CHECK(f.Values("model.tied") == Iota(24, 1));
  CHECK(f.Values("model.rows") == Iota(12, 1, 6));  // base[1:3]: storage offset 6
  CHECK(f.leaves.at("model.t").tensor->strides == Shape{1, 6});
  CHECK_FALSE(f.leaves.at("model.t").tensor->row_major());
  const std::vector<double> t = f.Values("model.t");  // base.t()
  REQUIRE(t.size() == 24);
  CHECK(t[1] == 6);
  CHECK(t[4] == 1);
  CHECK(f.Values("model.p") == std::vector<double>(4, 1.5));  // an nn.Parameter
  CHECK(f.leaves.at("model.h").tensor->dtype == DType::kBFloat16);
  CHECK(f.Values("model.h") == std::vector<double>{-2, -1, 0, 1, 2});
  CHECK(f.Values("optim.state.0.buf") == std::vector<double>{1, 1, 1});  // an int key
  // Values that are not tensors: bytes as bytes, others as torch.save records of their own.
  CHECK(f.leaves.at("rng").is_bytes);
  CHECK(f.leaves.at("rng").bytes == "\x00\x01\xff"s);
  REQUIRE(f.leaves.at("epoch").value);
  CHECK(f.leaves.at("epoch").value->integer == 3);
  CHECK(f.leaves.at("name").value->str == "run-1");
  CHECK(f.leaves.at("optim.state.0.step").value->integer == 7);
  const TorchSaveLeaf& groups = f.leaves.at("optim.param_groups");
  REQUIRE(groups.value);
  CHECK(groups.value->kind == pk::Kind::kList);
  CHECK(IsTorchSaveArchive(groups.record));
  CheckTorchArchiveCrcs(groups.record, "param_groups");
  std::string payload;
  CHECK_FALSE(TorchSaveBytesPayload(groups.record, &payload));
}

TEST_CASE("torch.save files: a list of tensors or a bare tensor is refused by name", "[torchdcp]") {
  CHECK_THROWS_AS(SaveFile("tensor_list.pt"), UnsupportedError);
  CHECK_THROWS_WITH(SaveFile("tensor_list.pt"), Catch::Matchers::Contains("'layers'"));
  CHECK_THROWS_AS(SaveFile("bare_tensor.pt"), UnsupportedError);
  CHECK_THROWS_WITH(SaveFile("bare_tensor.pt"), Catch::Matchers::Contains("not a dict"));
  // A truncated file is corrupt, named.
  const std::string bytes = ReadFileBytes(kFixtures + "/../torch-save-files/state_dict.pt");
  TempDir dir("tsf");
  {
    std::ofstream out(dir / "cut.pt", std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size() - 30));
  }
  auto in = OpenStore("file://" + dir.path())->Open("cut.pt");
  CHECK_THROWS_AS(ReadTorchSaveFile(*in, in->size(), "cut.pt"), CorruptionError);
  CHECK_THROWS_WITH(ReadTorchSaveFile(*in, in->size(), "cut.pt"),
                    Catch::Matchers::Contains("cut.pt"));
}

}  // namespace
}  // namespace dcp

namespace dcp {
namespace {

// Python's repr() of a plain value, as far as the fixtures' byte entries need it (floats in the
// shortest round-trip form, as Python prints them).
std::string PyRepr(const PyValue& v) {
  switch (v.kind) {
    case PyValue::Kind::kNone:
      return "None";
    case PyValue::Kind::kBool:
      return v.boolean ? "True" : "False";
    case PyValue::Kind::kInt:
      return std::to_string(v.integer);
    case PyValue::Kind::kFloat: {
      char buf[64];
      auto r = std::to_chars(buf, buf + sizeof(buf), v.real, std::chars_format::scientific);
      const std::string sci(buf, r.ptr);  // d[.ddd]e±XX
      const size_t e_at = sci.find('e');
      std::string digits = sci.substr(0, e_at);
      const int exp = std::stoi(sci.substr(e_at + 1));
      const bool negative = digits[0] == '-';
      if (negative) digits.erase(0, 1);
      digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
      std::string out;
      if (exp >= -4 && exp < 16) {
        if (exp < 0) {
          out = "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
        } else if (static_cast<size_t>(exp) + 1 >= digits.size()) {
          out = digits + std::string(static_cast<size_t>(exp) + 1 - digits.size(), '0') + ".0";
        } else {
          out = digits.substr(0, static_cast<size_t>(exp) + 1) + "." +
                digits.substr(static_cast<size_t>(exp) + 1);
        }
      } else {
        out = digits.substr(0, 1) + (digits.size() > 1 ? "." + digits.substr(1) : "") + "e" +
              (exp < 0 ? "-" : "+") + (std::abs(exp) < 10 ? "0" : "") +
              std::to_string(std::abs(exp));
      }
      return (negative ? "-" : "") + out;
    }
    case PyValue::Kind::kStr:
      return "'" + v.str + "'";
    case PyValue::Kind::kTuple:
    case PyValue::Kind::kList: {
      const bool tuple = v.kind == PyValue::Kind::kTuple;
      std::string out = tuple ? "(" : "[";
      for (size_t i = 0; i < v.items.size(); ++i) out += (i ? ", " : "") + PyRepr(*v.items[i]);
      if (tuple && v.items.size() == 1) out += ",";
      return out + (tuple ? ")" : "]");
    }
    case PyValue::Kind::kDict: {
      std::string out = "{";
      for (size_t i = 0; i + 1 < v.items.size(); i += 2) {
        out += (i ? ", " : "") + PyRepr(*v.items[i]) + ": " + PyRepr(*v.items[i + 1]);
      }
      return out + "}";
    }
    case PyValue::Kind::kBytes:
      return "b<" + std::to_string(v.str.size()) + " bytes>";
  }
  return "<unknown kind>";
}

TEST_CASE("PythonValue: the byte entries torch 2.11 wrote read as their Python values",
          "[torchdcp]") {
  size_t checked = 0;
  for (const char* name : {"model_adamw", "single_dtypes", "dist4_dtensor"}) {
    const std::string dir = kFixtures + "/" + name;
    if (!std::filesystem::exists(dir + "/.metadata")) {
      WARN("no fixture " << dir << "; not checked");
      continue;
    }
    const Json json = Json::parse(ReadFileBytes(kFixtures + "/" + name + ".json"));
    const StateDict all = LoadAll("torchdcp://" + dir);
    const auto flat = FlattenStateDict(all);
    for (const auto& [fqn, e] : json["entries"].items()) {
      if (e["kind"] != "bytes") continue;
      INFO(name << " " << fqn);
      const Blob& blob = std::get<Blob>(*flat.at(fqn).value);
      CHECK(PyRepr(*PythonValue(blob, fqn)) == e["python_repr"].get<std::string>());
      ++checked;
    }
  }
  CHECK(checked >= 12);
  // The typed reads, on the optimizer's group options.
  const std::string dir = kFixtures + "/model_adamw";
  if (!std::filesystem::exists(dir + "/.metadata")) return;
  const StateDict all = LoadAll("torchdcp://" + dir);
  const auto flat = FlattenStateDict(all);
  auto value = [&](const std::string& key) {
    const std::string fqn = "optim.param_groups.0." + key;
    return PythonValue(std::get<Blob>(*flat.at(fqn).value), fqn);
  };
  CHECK(value("lr")->AsFloat() == 0.001);
  CHECK(value("eps")->AsFloat() == 1e-8);
  CHECK(value("weight_decay")->AsFloat() == 0.01);
  CHECK_FALSE(value("lr")->AsInt().has_value());
  CHECK_FALSE(value("lr")->AsBool().has_value());
  const auto betas = value("betas");
  REQUIRE(betas->kind == PyValue::Kind::kTuple);
  REQUIRE(betas->items.size() == 2);
  CHECK(betas->items[0]->AsFloat() == 0.9);
  CHECK(betas->items[1]->AsFloat() == 0.999);
  CHECK(value("amsgrad")->AsBool() == false);
  CHECK(value("decoupled_weight_decay")->AsBool() == true);
  CHECK_FALSE(value("amsgrad")->AsFloat().has_value());  // a bool is not a float here
  CHECK(value("foreach")->IsNone());
  CHECK(value("fused")->IsNone());
  const auto params = value("params");
  REQUIRE(params->kind == PyValue::Kind::kList);
  REQUIRE(params->items.size() == 7);
  CHECK(params->items[0]->AsStr() == "0.weight");
  CHECK(params->items[6]->AsStr() == "4.bias");
  // An int reads as a float too, as Python's float() takes it.
  CHECK(pk::Int(3)->AsFloat() == 3.0);
}

TEST_CASE("PythonValue: what is not a plain pickled value fails with its category", "[torchdcp]") {
  // Neither an archive nor a pickle.
  CHECK_THROWS_AS(PythonValue(Blob{"plain text"}, "x"), InvalidArgumentError);
  CHECK_THAT(ErrorOf([] { PythonValue(Blob{"plain text"}, "my.entry"); }),
             Catch::Contains("my.entry"));
  // A bare pickle, and the archive of one, read alike.
  const std::string pkl = pk::Dump(*pk::Tuple({pk::Float(0.5), pk::None()}));
  CHECK(PythonValue(Blob{pkl})->items.at(0)->AsFloat() == 0.5);
  CHECK(PythonValue(Blob{TorchSaveOfPickle(pkl)})->items.at(1)->IsNone());
  // A class instance: refused, naming the entry.
  const std::string obj = pk::Dump(*pk::Object(pk::Global("collections", "OrderedDict"), {}));
  CHECK_THROWS_AS(PythonValue(Blob{TorchSaveOfPickle(obj)}, "x"), UnsupportedError);
  // A truncated pickle, and a damaged archive.
  CHECK_THROWS_AS(PythonValue(Blob{pkl.substr(0, pkl.size() - 3)}, "x"), CorruptionError);
  std::string archive = TorchSaveOfPickle(pkl);
  archive.resize(archive.size() - 30);
  CHECK_THROWS_AS(PythonValue(Blob{archive}, "x"), CorruptionError);
  // Python bytes (protocol 2's _codecs.encode form) come back as kBytes.
  const auto bytes = PythonValue(Blob{TorchSaveOfBytes("ab\xff"s)}, "x");
  CHECK(bytes->kind == PyValue::Kind::kBytes);
  CHECK(bytes->str == "ab\xff"s);
}

}  // namespace
}  // namespace dcp
