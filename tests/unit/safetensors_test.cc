// Hugging Face safetensors checkpoints read as a format (storage/format/safetensors.h): the
// numpy-written fixtures (tests/fixtures/safetensors, make_safetensors.py) load bit-exact, whole
// and resharded, from a directory or from a URI naming one file; hostile headers and indexes fail
// with the error, file and tensor named, never a crash. Saves in the format
// (safetensors_writer.cc) round-trip every dtype it names and byte entries, from 1, 2 and 4
// ranks with row and column shards, reshard on load, refuse what the format cannot hold, fail
// every rank at once when one fails mid-exchange, and are read by an independent numpy reader.
#include "dcp/storage/format/safetensors.h"

#include <catch2/catch.hpp>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dcp/proto/schema/codec.h"
#include "dcp/storage/format/layout.h"
#include "dcp/storage/registry.h"
#include "support/test_support.h"

using namespace dcp;
using Catch::Matchers::Contains;
using dcp::testing::ExpectedTensor;
using dcp::testing::MessageOf;
using dcp::testing::ReadSafetensorsExpected;
using dcp::testing::RowRange;
using dcp::testing::RowSlice;
using dcp::testing::RunRanks;
using dcp::testing::TempDir;

namespace {

const std::string kFixtures = DCP_SAFETENSORS_FIXTURES;

std::string Bytes(const TensorView& v) {
  return std::string(static_cast<const char*>(v.data), v.nbytes());
}

// A flat state dict with a whole, zeroed tensor per expected entry (blobs for `blobs`).
struct Whole {
  StateDict sd;
  std::map<std::string, TensorView> views;
};
Whole WholeRequest(const std::map<std::string, ExpectedTensor>& want,
                   const std::set<std::string>& blobs = {}) {
  Whole w;
  for (const auto& [name, t] : want) {
    if (blobs.count(name)) {
      w.sd.Set(name, Blob{});
      continue;
    }
    TensorView v = TensorView::Allocate(t.dtype, t.shape);
    std::memset(v.data, 0x5a, v.nbytes());
    w.views.emplace(name, v);
    w.sd.Set(name, v);
  }
  return w;
}

void CheckWhole(const Whole& w, const std::map<std::string, ExpectedTensor>& want) {
  for (const auto& [name, v] : w.views) {
    INFO(name);
    CHECK(Bytes(v) == want.at(name).bytes);
  }
}

// The entry at dotted `fqn` of a nested state dict (what LoadAll builds).
const StateValue* FindDotted(const StateDict& sd, const std::string& fqn) {
  const StateDict* at = &sd;
  size_t pos = 0;
  for (;;) {
    const size_t dot = fqn.find('.', pos);
    const StateValue* v = at->Find(fqn.substr(pos, dot == std::string::npos ? dot : dot - pos));
    if (!v || dot == std::string::npos) return v;
    const auto* nested = std::get_if<std::shared_ptr<StateDict>>(v);
    if (!nested) return nullptr;
    at = nested->get();
    pos = dot + 1;
  }
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), bytes.size());
}

// A safetensors file: 8-byte length, `header` as given, then `data`.
std::string StFile(const std::string& header, const std::string& data = std::string(64, '\0')) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

}  // namespace

TEST_CASE("safetensors: a sharded Hub directory loads bit-exact", "[safetensors]") {
  const auto want = ReadSafetensorsExpected(kFixtures, "sharded");
  const std::string dir = kFixtures + "/sharded";

  const Metadata md = ReadMetadata(dir);
  CHECK(md.entries.size() == want.size());
  CHECK(md.world_size == 3);  // the number of files
  CHECK(md.library_version == "safetensors");
  for (const auto& [name, t] : want) {
    INFO(name);
    REQUIRE(md.entries.count(name));
    const auto& tm = std::get<TensorMetadata>(md.entries.at(name));
    CHECK(tm.dtype == t.dtype);
    CHECK(tm.shape == t.shape);
    REQUIRE(tm.chunks.size() == 1);
    const StorageInfo& info = md.storage.at(MetadataIndex{name, Shape(t.shape.size(), 0), {}});
    CHECK(info.relative_path == t.file);
    CHECK(info.length == t.bytes.size());
    CHECK_FALSE(info.crc32c);
    CHECK(info.transforms.empty());
  }

  Whole w = WholeRequest(want);
  Load(w.sd, dir);
  CheckWhole(w, want);

  // LoadAll builds the nesting from the dotted names.
  const StateDict all = LoadAll("file://" + dir);
  for (const auto& [name, t] : want) {
    INFO(name);
    const StateValue* v = FindDotted(all, name);
    REQUIRE(v);
    REQUIRE(std::holds_alternative<TensorView>(*v));
    CHECK(Bytes(std::get<TensorView>(*v)) == t.bytes);
  }
}

TEST_CASE("safetensors: a single file loads by its directory and by its own name",
          "[safetensors]") {
  const auto want = ReadSafetensorsExpected(kFixtures, "single");
  for (const std::string& uri : {kFixtures + "/single", kFixtures + "/single/model.safetensors",
                                 "file://" + kFixtures + "/single/model.safetensors"}) {
    DYNAMIC_SECTION(uri) {
      Whole w = WholeRequest(want, {"rng"});
      Load(w.sd, uri);
      CheckWhole(w, want);
      // __metadata__["dcp.blobs"] names "rng": a byte entry, as `dcp convert` exports blobs.
      CHECK(std::get<Blob>(*w.sd.Find("rng")).bytes == want.at("rng").bytes);
      CHECK(std::holds_alternative<BytesMetadata>(ReadMetadata(uri).entries.at("rng")));
    }
  }
  // One shard of a sharded directory, by its name: that file's tensors only (the index beside
  // it is not read).
  const auto sharded = ReadSafetensorsExpected(kFixtures, "sharded");
  const std::string file = "model-00002-of-00003.safetensors";
  std::map<std::string, ExpectedTensor> in_file;
  for (const auto& [name, t] : sharded) {
    if (t.file == file) in_file.emplace(name, t);
  }
  const Metadata md = ReadMetadata(kFixtures + "/sharded/" + file);
  CHECK(md.entries.size() == in_file.size());
  Whole w = WholeRequest(in_file);
  Load(w.sd, kFixtures + "/sharded/" + file);
  CheckWhole(w, in_file);
}

TEST_CASE("safetensors: loads reshard into row shards at 2 and 3 ranks", "[safetensors]") {
  const auto want = ReadSafetensorsExpected(kFixtures, "sharded");
  for (int world : {2, 3}) {
    DYNAMIC_SECTION("world " << world) {
      dcp::testing::RequireNoErrors(RunRanks(world, [&](int r, Communicator& comm) {
        StateDict sd;
        std::map<std::string, std::pair<TensorView, std::pair<int64_t, int64_t>>> mine;
        for (const auto& [name, t] : want) {
          if (t.shape.empty()) {
            TensorView v = TensorView::Allocate(t.dtype, t.shape);
            mine.emplace(name, std::make_pair(v, std::make_pair(int64_t{0}, int64_t{1})));
            sd.Set(name, v);
            continue;
          }
          const auto [b, e] = RowRange(t.shape[0], r, world);
          Shape local = t.shape, offsets(t.shape.size(), 0);
          local[0] = e - b;
          offsets[0] = b;
          TensorView v = TensorView::Allocate(t.dtype, local);
          ShardedTensor st{t.dtype, t.shape, {}};
          if (e > b) st.local_shards.push_back({v, offsets});
          sd.Set(name, st);
          mine.emplace(name, std::make_pair(v, std::make_pair(b, e)));
        }
        LoadOptions lo;
        lo.storage.read_threads = 2;
        Load(sd, "file://" + kFixtures + "/sharded", comm, lo);
        for (const auto& [name, got] : mine) {
          const ExpectedTensor& t = want.at(name);
          const std::string expect =
              RowSlice(t.bytes, t.shape, ElementSize(t.dtype), got.second.first, got.second.second);
          dcp::testing::Expect(Bytes(got.first) == expect,
                               "rank " + std::to_string(r) + ": " + name + " differs");
        }
      }));
    }
  }
}

TEST_CASE("safetensors: a save writes the Hub layout and replaces atomically", "[safetensors]") {
  TempDir dir("st-save");
  TensorView v = dcp::testing::RandomTensor(DType::kFloat32, {4}, 1);
  StateDict sd;
  sd.Set("w", v).Set("u", dcp::testing::RandomTensor(DType::kInt32, {3}, 2));
  const std::string uri = "file://" + dir.path() + "/x?format=safetensors";
  SaveOptions two;
  two.storage.files_per_rank = 2;
  const Metadata first = Save(sd, uri, two).metadata;
  auto store = OpenStore("file://" + dir.path() + "/x");
  std::vector<std::string> names = store->List();
  std::sort(names.begin(), names.end());
  REQUIRE(names.size() == 3);
  CHECK(names[2] == kSafetensorsIndexName);
  for (size_t i = 0; i < 2; ++i) {
    CHECK(names[i] ==
          "model-0000" + std::to_string(i + 1) + "-of-00002-" + first.save_id + ".safetensors");
    CHECK(IsSafetensorsDataName(names[i]));
  }
  const auto index = nlohmann::json::parse(store->ReadAll(kSafetensorsIndexName, UINT64_MAX));
  CHECK(index["metadata"]["total_size"] == 4 * 4 + 3 * 4);
  CHECK(index["metadata"]["dcp.save_id"] == first.save_id);
  CHECK(index["weight_map"].size() == 2);
  CHECK(ReadMetadata(uri).save_id == first.save_id);
  CHECK(ReadMetadata(uri).library_version == "safetensors");
  // The SaveResult describes the files as a reader sees them: one chunk per tensor.
  CHECK(std::get<TensorMetadata>(first.entries.at("w")).chunks.size() == 1);

  // Not over an existing one unless asked; then only the new save's files remain, and a Hub
  // download's file names are never dcp's to remove.
  try {
    Save(sd, uri);
    FAIL("the save succeeded");
  } catch (const CollectiveError& e) {
    CHECK(e.failures()[0].code == ErrorCode::kAlreadyExists);
  }
  WriteFile(dir.path() + "/x/model-00001-of-00002.safetensors", "user file");
  CHECK_FALSE(IsSafetensorsDataName("model-00001-of-00002.safetensors"));
  SaveOptions over;
  over.storage.overwrite = true;
  const Metadata second = Save(sd, uri, over).metadata;
  names = store->List();
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"model-00001-of-00001-" + second.save_id + ".safetensors",
                                          "model-00001-of-00002.safetensors",
                                          kSafetensorsIndexName});
  TensorView back = TensorView::Allocate(DType::kFloat32, {4});
  StateDict in;
  in.Set("w", back);
  Load(in, uri, LoadOptions{});
  CHECK(Bytes(back) == Bytes(v));

  CHECK(CheckpointFormatName(CheckpointFormat::kSafetensors) == "safetensors");
  CHECK(ParseCheckpointFormat("safetensors") == CheckpointFormat::kSafetensors);
  // A dcp save refuses to share a location with a safetensors checkpoint, and a safetensors
  // save does not shadow a lone model.safetensors unless asked.
  std::filesystem::create_directories(dir / "hf");
  std::filesystem::copy_file(kFixtures + "/single/model.safetensors", dir / "hf/model.safetensors");
  try {
    Save(sd, dir / "hf");
    FAIL("the save succeeded");
  } catch (const CollectiveError& e) {
    CHECK(e.failures()[0].code == ErrorCode::kAlreadyExists);
    CHECK_THAT(e.what(), Contains("safetensors"));
  }
  try {
    Save(sd, "file://" + dir.path() + "/hf?format=safetensors");
    FAIL("the save succeeded");
  } catch (const CollectiveError& e) {
    CHECK(e.failures()[0].code == ErrorCode::kAlreadyExists);
    CHECK_THAT(e.what(), Contains("model.safetensors"));
  }
}

TEST_CASE("safetensors: hostile headers are refused with the file and tensor named",
          "[safetensors][hostile]") {
  TempDir dir("st-hostile");
  const std::string file = dir / "model.safetensors";
  const std::string good =
      R"({"w":{"dtype":"F32","shape":[2,4],"data_offsets":[0,32]},"__metadata__":{"a":"b"}})";
  WriteFile(file, StFile(good));
  CHECK(ReadMetadata(dir.path()).entries.size() == 1);

  struct Case {
    const char* what;
    std::string bytes;
    std::string message;
    ErrorCode code = ErrorCode::kCorruption;
  };
  std::string huge_len(8, '\0');
  huge_len[5] = 1;  // 2^40
  std::string deep(200, '[');
  std::string long_shape = "[";
  for (int i = 0; i < 5000; ++i) long_shape += (i ? ",1" : "1");
  long_shape += "]";
  const std::vector<Case> cases = {
      {"shorter than 8 bytes", "\x05\0\0", "truncated"},
      {"header length over the limit", huge_len + "{}", "exceeds the limit"},
      {"header length past the end", std::string("\x40\0\0\0\0\0\0\0{}", 10), "truncated"},
      {"not JSON", StFile("{\"w\": nope"), "not valid JSON"},
      {"not an object", StFile("[1,2]"), "not a JSON object"},
      {"nested deep", StFile("{\"w\":" + deep), "nesting deeper"},
      {"a huge shape list",
       StFile(R"({"w":{"dtype":"F32","shape":)" + long_shape + R"(,"data_offsets":[0,4]}})"),
       "array longer"},
      {"unknown dtype", StFile(R"({"w":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})"),
       "dtype 'F33'", ErrorCode::kUnsupported},
      {"no dtype", StFile(R"({"w":{"shape":[2],"data_offsets":[0,8]}})"), "no \"dtype\""},
      {"offsets past the file",
       StFile(R"({"w":{"dtype":"F32","shape":[32],"data_offsets":[0,128]}})"), "reach past"},
      {"offsets reversed", StFile(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})"),
       "not a range"},
      {"negative offset", StFile(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})"),
       "not a range"},
      {"size mismatch", StFile(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})"),
       "need 12"},
      {"shape overflow",
       StFile(
           R"({"w":{"dtype":"F32","shape":[4611686018427387904,4611686018427387904],"data_offsets":[0,8]}})"),
       "more elements than int64"},
      {"shape overflow in bytes",
       StFile(R"({"w":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}})"),
       "too large"},
      {"negative dimension", StFile(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})"),
       "not a non-negative"},
      {"overlap",
       StFile(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
              R"("v":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})"),
       "overlap"},
      {"metadata not strings", StFile(R"({"__metadata__":{"a":1}})"), "is not a string"},
      {"bad blob list", StFile(R"({"__metadata__":{"dcp.blobs":"[1"}})"), "not valid JSON"},
      // The format: a header begins with '{' and is padded with spaces (0x20) only. nlohmann's
      // parser stops at a NUL (anything after it went unread) and skips a byte order mark.
      {"NUL padding", StFile(good + std::string(6, '\0')), "NUL byte at offset 82"},
      {"a NUL, then anything", StFile(good + std::string("\0{\"x\": nope", 12)), "NUL byte"},
      {"a byte order mark", StFile("\xEF\xBB\xBF" + good), "byte order mark"},
      {"leading spaces", StFile("  " + good), "must begin with '{'"},
      {"an empty header", StFile(""), "must begin with '{'"},
      // One name, one meaning: a key twice is refused (a DOM kept the last one silently).
      {"a tensor twice",
       StFile(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
              R"("w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})"),
       "appears twice in the header"},
      {"a field twice",
       StFile(R"({"w":{"dtype":"F32","dtype":"F64","shape":[2],"data_offsets":[0,8]}})"),
       "has \"dtype\" twice"},
      {"__metadata__ twice", StFile(R"({"__metadata__":{},"__metadata__":{}})"),
       "__metadata__ appears twice"},
      {"a tensor that is not an object", StFile(R"({"w":[1,2]})"), "not a JSON object"},
      {"a container for a dimension",
       StFile(R"({"w":{"dtype":"F32","shape":[[2]],"data_offsets":[0,8]}})"), "not a non-negative"},
      {"three offsets", StFile(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}})"),
       "no \"data_offsets\" pair"},
  };
  for (const Case& c : cases) {
    DYNAMIC_SECTION(c.what) {
      WriteFile(file, c.bytes);
      try {
        ReadMetadata(dir.path());
        FAIL("accepted");
      } catch (const Error& e) {
        CHECK(e.code() == c.code);
        CHECK_THAT(e.what(), Contains(c.message));
        CHECK_THAT(e.what(), Contains("model.safetensors"));
        // Errors about one tensor name it (not those about the whole header's text).
        const bool whole = c.message == "array longer" || c.message.find("NUL byte") == 0 ||
                           c.message == "byte order mark" || c.message == "must begin with '{'";
        if (!whole && c.bytes.find("\"w\":{") != std::string::npos) {
          CHECK_THAT(e.what(), Contains("tensor 'w'"));
        }
      }
      // A load fails the same way, on every rank, and `dcp inspect`'s reader too.
      StateDict sd;
      sd.Set("w", TensorView::Allocate(DType::kFloat32, {2, 4}));
      try {
        Load(sd, dir.path());
        FAIL("loaded");
      } catch (const CollectiveError& e) {
        CHECK(e.failures()[0].code == c.code);
      }
    }
  }
}

TEST_CASE("safetensors: hostile indexes are refused with the file and tensor named",
          "[safetensors][hostile]") {
  TempDir dir("st-index");
  const std::string index = dir / kSafetensorsIndexName;
  WriteFile(dir / "a.safetensors",
            StFile(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})"));
  WriteFile(dir / "b.safetensors",
            StFile(R"({"v":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                   R"("w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})"));
  WriteFile(index, R"({"weight_map":{"w":"a.safetensors"}})");
  CHECK(ReadMetadata(dir.path()).entries.size() == 1);

  struct Case {
    const char* what;
    std::string index;
    std::string message;
    ErrorCode code = ErrorCode::kCorruption;
  };
  const std::vector<Case> cases = {
      {"not JSON", "{\"weight_map\":", "not valid JSON"},
      {"no weight_map", R"({"metadata":{}})", "no \"weight_map\""},
      {"a parent directory", R"({"weight_map":{"w":"../a.safetensors"}})", "not a plain file name"},
      {"an absolute path", R"({"weight_map":{"w":"/etc/passwd"}})", "not a plain file name"},
      {"a sub-directory", R"({"weight_map":{"w":"sub/a.safetensors"}})", "not a plain file name"},
      {"dot dot", R"({"weight_map":{"w":".."}})", "not a plain file name"},
      {"a non-string file", R"({"weight_map":{"w":3}})", "non-string"},
      {"a missing file", R"({"weight_map":{"w":"c.safetensors"}})", "c.safetensors",
       ErrorCode::kNotFound},
      {"a tensor its file lacks", R"({"weight_map":{"x":"a.safetensors"}})", "does not have it"},
      {"a tensor in two files", R"({"weight_map":{"w":"a.safetensors","v":"b.safetensors"}})",
       "is also in"},
      {"an empty weight_map", R"({"metadata":{},"weight_map":{}})", "\"weight_map\" is empty"},
      {"a byte order mark",
       "\xEF\xBB\xBF"
       R"({"weight_map":{"w":"a.safetensors"}})",
       "byte order mark"},
      {"NUL padding", std::string(R"({"weight_map":{"w":"a.safetensors"}})") + std::string(4, '\0'),
       "NUL byte at offset 36"},
      {"a tensor mapped twice", R"({"weight_map":{"w":"a.safetensors","w":"b.safetensors"}})",
       "mapped twice"},
      {"weight_map twice", R"({"weight_map":{"w":"a.safetensors"},"weight_map":{}})",
       "appears twice"},
      {"not an object", R"(["weight_map"])", "not a JSON object"},
  };
  for (const Case& c : cases) {
    DYNAMIC_SECTION(c.what) {
      WriteFile(index, c.index);
      try {
        ReadMetadata(dir.path());
        FAIL("accepted");
      } catch (const Error& e) {
        CHECK(e.code() == c.code);
        CHECK_THAT(e.what(), Contains(c.message));
        // Naming the file at fault: the index, or the data file that repeats a tensor.
        CHECK_THAT(e.what(), Contains(c.message == "is also in"        ? "b.safetensors"
                                      : c.code == ErrorCode::kNotFound ? "c.safetensors"
                                                                       : kSafetensorsIndexName));
      }
    }
  }
}

TEST_CASE("safetensors: headers padded as the format allows are read", "[safetensors]") {
  TempDir dir("st-padding");
  const std::string good = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  // Spaces (what every writer pads with), and JSON's other whitespace, which JSON parsers (the
  // reference implementation's serde_json among them) take too.
  for (const std::string pad : {"", "      ", " \n", "\t\r\n "}) {
    INFO(pad.size());
    WriteFile(dir / "model.safetensors", StFile(good + pad));
    CHECK(ReadMetadata(dir.path()).entries.size() == 1);
  }
}

// A header of 200,000 tensors (17 MB): parsed in one linear pass. nlohmann's callback parser,
// which read headers before, rescanned the root's members each time a tensor's object ended:
// 12,500 tensors took 8 s, 50,000 took 161 s, so these would take about 40 minutes, far past
// CTest's 300 s for this test. (Not a timing: a quadratic parser cannot finish in time.)
TEST_CASE("safetensors: a header of 200,000 tensors is read in one pass",
          "[safetensors][scale]") {
  constexpr int kTensors = 200000;
  std::string header = "{";
  for (int i = 0; i < kTensors; ++i) {
    const std::string b = std::to_string(uint64_t{4} * i), e = std::to_string(uint64_t{4} * i + 4);
    header += "\"model.layers." + std::to_string(i) +
              ".mlp.w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[" + b + "," + e + "]},";
  }
  header += R"("__metadata__":{"format":"pt"}})";
  REQUIRE(header.size() > (size_t{16} << 20));
  std::string head(8, '\0');
  for (int i = 0; i < 8; ++i) head[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  head += header;
  Metadata md;
  AddSafetensorsFile(head, head.size() + uint64_t{4} * kTensors, "model.safetensors", "big", md);
  REQUIRE(md.entries.size() == kTensors);
  const StorageInfo& last = md.storage.at(MetadataIndex{"model.layers.199999.mlp.w", Shape{0}, {}});
  CHECK(last.offset == head.size() + uint64_t{4} * (kTensors - 1));
  CHECK(last.length == 4);
  ValidateMetadata(md, "big");
}

// "dcp.blobs" may name any number of tensors (the list is not held to the 1,024 elements of a
// header's arrays: it is read name by name, nothing of it kept).
TEST_CASE("safetensors: a file with 1,500 byte entries loads them as blobs", "[safetensors]") {
  TempDir dir("st-blobs");
  nlohmann::json header = nlohmann::json::object(), names = nlohmann::json::array();
  std::string data;
  for (int i = 0; i < 1500; ++i) {
    const std::string name = "b" + std::to_string(i);
    header[name] = {{"dtype", "U8"}, {"shape", {2}}, {"data_offsets", {2 * i, 2 * i + 2}}};
    names.push_back(name);
    data += static_cast<char>(i & 0xff);
    data += static_cast<char>(i >> 8);
  }
  names.push_back("not a tensor");  // ignored
  header["__metadata__"] = {{"dcp.blobs", names.dump()}};
  WriteFile(dir / "model.safetensors", StFile(header.dump(), data));
  const Metadata md = ReadMetadata(dir.path());
  REQUIRE(md.entries.size() == 1500);
  for (const auto& [name, e] : md.entries) {
    INFO(name);
    CHECK(std::holds_alternative<BytesMetadata>(e));
  }
  const StateDict all = LoadAll(dir.path());
  const StateValue* v = all.Find("b1499");
  REQUIRE(v);
  CHECK(std::get<Blob>(*v).bytes == std::string("\xdb\x05", 2));
}

TEST_CASE("safetensors: detection comes after dcp and PyTorch DCP", "[safetensors]") {
  TempDir dir("st-detect");
  TensorView v = dcp::testing::RandomTensor(DType::kFloat32, {4}, 1);
  StateDict sd;
  sd.Set("w", v);
  Save(sd, dir / "ckpt");
  // A model.safetensors beside a dcp checkpoint changes nothing: the dcp checkpoint loads.
  std::filesystem::copy_file(kFixtures + "/single/model.safetensors",
                             dir / "ckpt/model.safetensors");
  const Metadata md = ReadMetadata(dir / "ckpt");
  CHECK(md.entries.size() == 1);
  CHECK(md.library_version != "safetensors");
  // A directory with safetensors files under other names is no checkpoint (name the file).
  std::filesystem::create_directories(dir / "other");
  std::filesystem::copy_file(kFixtures + "/single/model.safetensors",
                             dir / "other/adapter.safetensors");
  CHECK_THROWS_AS(ReadMetadata(dir / "other"), NotFoundError);
  CHECK(ReadMetadata(dir / "other/adapter.safetensors").entries.size() == 5);
  // A URI naming a file that does not exist is no checkpoint either.
  CHECK_THROWS_AS(ReadMetadata(dir / "other/missing.safetensors"), NotFoundError);
}
