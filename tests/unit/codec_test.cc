// CRC32C, the wire encodings of plans and results, and the metadata file: its envelope, its
// round trip, and the validation of untrusted metadata.
#include "dcp/proto/schema/codec.h"

#include <sys/mman.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "dcp/proto/checksum.h"
#include "dcp/proto/error.h"
#include "dcp/proto/plan.h"
#include "support/test_support.h"

using namespace dcp;
using Catch::Matchers::Contains;

namespace {

constexpr char kSource[] = "mem://ckpt/.metadata";

using dcp::testing::MessageOf;

void AddStored(Metadata& md, const std::string& fqn, Shape offset, std::optional<int32_t> index,
               std::string path, uint64_t file_offset, uint64_t raw_length) {
  StorageInfo info;
  info.relative_path = std::move(path);
  info.offset = file_offset;
  info.length = raw_length;
  info.raw_length = raw_length;
  info.crc32c = static_cast<uint32_t>(0x1000 + file_offset);
  md.storage[MetadataIndex{fqn, std::move(offset), index}] = std::move(info);
}

// A consistent Metadata with a multi-chunk tensor, a one-chunk tensor, a 0-d tensor, a
// zero-size tensor, a transformed (compressed) item and a byte entry.
Metadata MakeMetadata() {
  Metadata md;
  md.checkpoint_id = "ckpt-7";
  md.save_id = "save-0123456789abcdef";
  md.world_size = 4;
  md.created_unix_ns = 1700000000123456789;
  md.library_version = "0.1.0-test";
  md.entries["model.w"] = TensorMetadata{
      DType::kFloat32, {4, 6}, {{{0, 0}, {2, 6}}, {{2, 0}, {2, 3}}, {{2, 3}, {2, 3}}}};
  md.entries["model.b"] = TensorMetadata{DType::kBFloat16, {6}, {{{0}, {6}}}};
  md.entries["step"] = TensorMetadata{DType::kInt64, {}, {{{}, {}}}};
  md.entries["empty"] = TensorMetadata{DType::kComplex128, {0, 3}, {{{0, 0}, {0, 3}}}};
  md.entries["rng"] = BytesMetadata{};
  AddStored(md, "model.w", {0, 0}, 0, "__0_0.distcp", 0, 48);
  AddStored(md, "model.w", {2, 0}, 1, "__1_0.distcp", 0, 24);
  AddStored(md, "model.w", {2, 3}, 2, "__2_0.distcp", 64, 24);
  AddStored(md, "model.b", {0}, 0, "__0_0.distcp", 48, 12);
  AddStored(md, "step", {}, 0, "__0_0.distcp", 60, 8);
  AddStored(md, "empty", {0, 0}, std::nullopt, "__3_0.distcp", 0, 0);
  AddStored(md, "rng", {}, std::nullopt, "__3_0.distcp", 0, 5);
  // A compressed item: stored length differs from the raw length.
  auto& w1 = md.storage.at(MetadataIndex{"model.w", {2, 0}, {}});
  w1.transforms = {"zstd", "aes"};
  w1.length = 17;
  w1.crc32c.reset();
  md.key_paths["model.w"] = {"model", "w"};
  md.key_paths["model.b"] = {"model", "b"};
  md.key_paths["step"] = {"step"};
  md.key_paths["empty"] = {"empty"};
  md.key_paths["rng"] = {"rng"};
  md.planner_data["default"] = std::string("a\0b\n", 4);
  md.planner_data["other"] = "";
  return md;
}

void CheckSameStorageInfo(const StorageInfo& a, const StorageInfo& b) {
  CHECK(a.relative_path == b.relative_path);
  CHECK(a.offset == b.offset);
  CHECK(a.length == b.length);
  CHECK(a.crc32c == b.crc32c);
  CHECK(a.transforms == b.transforms);
  CHECK(a.raw_length == b.raw_length);
}

void CheckSameIndex(const MetadataIndex& a, const MetadataIndex& b) {
  CHECK(a.fqn == b.fqn);
  CHECK(a.offset == b.offset);
  CHECK(a.index == b.index);
}

void CheckSameMetadata(const Metadata& a, const Metadata& b) {
  CHECK(a.format_version == b.format_version);
  CHECK(a.checkpoint_id == b.checkpoint_id);
  CHECK(a.save_id == b.save_id);
  CHECK(a.world_size == b.world_size);
  CHECK(a.created_unix_ns == b.created_unix_ns);
  CHECK(a.library_version == b.library_version);
  CHECK(a.key_paths == b.key_paths);
  CHECK(a.planner_data == b.planner_data);
  REQUIRE(a.entries.size() == b.entries.size());
  for (auto ia = a.entries.begin(), ib = b.entries.begin(); ia != a.entries.end(); ++ia, ++ib) {
    INFO("entry " << ia->first);
    CHECK(ia->first == ib->first);
    REQUIRE(ia->second.index() == ib->second.index());
    if (const auto* ta = std::get_if<TensorMetadata>(&ia->second)) {
      const auto& tb = std::get<TensorMetadata>(ib->second);
      CHECK(ta->dtype == tb.dtype);
      CHECK(ta->shape == tb.shape);
      CHECK(ta->chunks == tb.chunks);
    }
  }
  REQUIRE(a.storage.size() == b.storage.size());
  for (auto ia = a.storage.begin(), ib = b.storage.begin(); ia != a.storage.end(); ++ia, ++ib) {
    INFO("stored item " << ia->first.ToString());
    CheckSameIndex(ia->first, ib->first);
    CheckSameStorageInfo(ia->second, ib->second);
  }
}

uint32_t ReadLe32(const std::string& s, size_t at) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) {
    v |= static_cast<uint32_t>(static_cast<unsigned char>(s[at + i])) << (8 * i);
  }
  return v;
}

void WriteLe32(std::string& s, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) s[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// CRC32C

TEST_CASE("codec: Crc32c known answers", "[codec][crc]") {
  CHECK(Crc32c(0, "123456789", 9) == 0xE3069283u);
  CHECK(Crc32c(0, "", 0) == 0u);
  CHECK(Crc32c(0x12345678u, "", 0) == 0x12345678u);  // extending by nothing changes nothing
  // RFC 3720 (iSCSI) B.4 test vectors.
  std::vector<unsigned char> buf(32, 0);
  CHECK(Crc32c(0, buf.data(), buf.size()) == 0x8A9136AAu);
  std::fill(buf.begin(), buf.end(), 0xff);
  CHECK(Crc32c(0, buf.data(), buf.size()) == 0x62A8AB43u);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<unsigned char>(i);
  CHECK(Crc32c(0, buf.data(), buf.size()) == 0x46DD794Eu);
}

TEST_CASE("codec: Crc32c incremental equals one-shot", "[codec][crc]") {
  const char* digits = "123456789";
  for (size_t split = 0; split <= 9; ++split) {
    INFO("split " << split);
    CHECK(Crc32c(Crc32c(0, digits, split), digits + split, 9 - split) == 0xE3069283u);
  }
  std::vector<char> data(100003);
  dcp::testing::FillRandom(data.data(), data.size(), 42);
  const uint32_t whole = Crc32c(0, data.data(), data.size());
  for (size_t split : {size_t{1}, size_t{7}, size_t{4096}, size_t{65537}, data.size() - 1}) {
    INFO("split " << split);
    CHECK(Crc32c(Crc32c(0, data.data(), split), data.data() + split, data.size() - split) == whole);
  }
  // Three pieces.
  CHECK(Crc32c(Crc32c(Crc32c(0, data.data(), 10), data.data() + 10, 50000), data.data() + 50010,
               data.size() - 50010) == whole);
  // And it does depend on the data.
  data[500] ^= 1;
  CHECK(Crc32c(0, data.data(), data.size()) != whole);
}

TEST_CASE("codec: Crc32c handles buffers longer than 2 GiB", "[codec][crc]") {
  // ISA-L takes an int length; a stored item can be larger. Zero pages are mapped lazily (and,
  // with transparent huge pages, as the shared huge zero page): this costs address space only.
  const size_t len = (size_t{1} << 31) + 4096;
  void* p = mmap(nullptr, len, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    WARN("cannot map " << len << " bytes; skipping");
    return;
  }
  madvise(p, len, MADV_HUGEPAGE);
  const char* data = static_cast<const char*>(p);
  uint32_t pieces = 0, head = 0;
  for (size_t at = 0; at < len; at += size_t{1} << 30) {
    head = pieces;
    pieces = Crc32c(pieces, data + at, std::min(len - at, size_t{1} << 30));
  }
  const uint32_t whole = Crc32c(0, data, len);
  munmap(p, len);
  CHECK(whole == pieces);
  CHECK(whole != head);  // the last 4096 bytes count
}

// ---------------------------------------------------------------------------------------------
// Plans and results

TEST_CASE("codec: SavePlan round trip", "[codec][plan]") {
  SavePlan plan;
  WriteItem t;
  t.index = {"model.w", {0, 0}, 3};
  t.type = WriteItemType::kTensor;
  t.dtype = DType::kBFloat16;
  t.global_shape = {4, 6};
  t.chunk = {{0, 0}, {4, 6}};
  t.size_bytes = 48;
  WriteItem s;
  s.index = {"model.emb", {128, 0}, std::nullopt};
  s.type = WriteItemType::kShard;
  s.dtype = DType::kFloat8_e5m2;
  s.global_shape = {512, 64};
  s.chunk = {{128, 0}, {128, 64}};
  s.size_bytes = uint64_t{1} << 40;  // large values survive
  WriteItem b;
  b.index = {"rng", {}, 0};
  b.type = WriteItemType::kBytes;
  b.size_bytes = 5;
  WriteItem scalar;
  scalar.index = {"step", {}, std::nullopt};
  scalar.dtype = DType::kInt64;
  scalar.size_bytes = 8;
  plan.items = {t, s, b, scalar};
  plan.storage_data = std::string("\0\x01\xff storage", 11);
  plan.planner_data = "fqn\tfloat32\t4,6\n";
  plan.key_paths["model.w"] = {"model", "w"};
  plan.key_paths["a.b"] = {"a.b"};

  const SavePlan back = DecodeSavePlan(EncodeSavePlan(plan));
  REQUIRE(back.items.size() == plan.items.size());
  for (size_t i = 0; i < plan.items.size(); ++i) {
    INFO("item " << i);
    const WriteItem& x = plan.items[i];
    const WriteItem& y = back.items[i];
    CheckSameIndex(x.index, y.index);
    CHECK(x.type == y.type);
    CHECK(x.dtype == y.dtype);
    CHECK(x.global_shape == y.global_shape);
    CHECK(x.chunk == y.chunk);
    CHECK(x.size_bytes == y.size_bytes);
  }
  CHECK(back.storage_data == plan.storage_data);
  CHECK(back.planner_data == plan.planner_data);
  CHECK(back.key_paths == plan.key_paths);

  const SavePlan empty = DecodeSavePlan(EncodeSavePlan(SavePlan{}));
  CHECK(empty.items.empty());
  CHECK(empty.key_paths.empty());
}

TEST_CASE("codec: LoadPlan round trip", "[codec][plan]") {
  LoadPlan plan;
  ReadItem t;
  t.type = ReadItemType::kTensor;
  t.dest_index = {"model.w", {0, 3}, std::nullopt};
  t.dest_offsets = {2, 0};
  t.storage_index = {"model.w", {2, 0}, 1};
  t.storage_offsets = {0, 3};
  t.lengths = {2, 3};
  ReadItem b;
  b.type = ReadItemType::kBytes;
  b.dest_index = {"rng", {}, std::nullopt};
  b.storage_index = {"rng", {}, 0};
  plan.items = {t, b};
  plan.storage_data = std::string("x\0y", 3);
  plan.planner_data = "pd";

  const LoadPlan back = DecodeLoadPlan(EncodeLoadPlan(plan));
  REQUIRE(back.items.size() == 2);
  for (size_t i = 0; i < 2; ++i) {
    INFO("item " << i);
    const ReadItem& x = plan.items[i];
    const ReadItem& y = back.items[i];
    CHECK(x.type == y.type);
    CheckSameIndex(x.dest_index, y.dest_index);
    CHECK(x.dest_offsets == y.dest_offsets);
    CheckSameIndex(x.storage_index, y.storage_index);
    CHECK(x.storage_offsets == y.storage_offsets);
    CHECK(x.lengths == y.lengths);
  }
  CHECK(back.storage_data == plan.storage_data);
  CHECK(back.planner_data == plan.planner_data);
}

TEST_CASE("codec: WriteResults round trip", "[codec][plan]") {
  std::vector<WriteResult> results(3);
  results[0].index = {"model.w", {2, 3}, 2};
  results[0].size_in_bytes = 24;
  results[0].storage = {"sub/__2_0.distcp", 4096, 24, 0u, {}, 24,
                        std::nullopt,       {},   {}};  // a CRC of 0 is a value
  results[1].index = {"rng", {}, std::nullopt};
  results[1].size_in_bytes = 5;
  results[1].storage = {"__0_0.distcp", 0, 5, std::nullopt, {}, 5, std::nullopt, {}, {}};
  results[2].index = {"big", {0}, 0};
  results[2].size_in_bytes = uint64_t{3} << 33;
  results[2].storage = {"__1_0.distcp",    uint64_t{1} << 35, 1234, 0xDEADBEEFu, {"zstd"},
                        uint64_t{3} << 33, std::nullopt,      {},   {}};

  const auto back = DecodeWriteResults(EncodeWriteResults(results));
  REQUIRE(back.size() == results.size());
  for (size_t i = 0; i < results.size(); ++i) {
    INFO("result " << i);
    CheckSameIndex(results[i].index, back[i].index);
    CHECK(results[i].size_in_bytes == back[i].size_in_bytes);
    CheckSameStorageInfo(results[i].storage, back[i].storage);
  }
  CHECK(back[0].storage.crc32c.has_value());
  CHECK_FALSE(back[1].storage.crc32c.has_value());
  CHECK(DecodeWriteResults(EncodeWriteResults({})).empty());
}

TEST_CASE("codec: Undecodable plans are CorruptionError", "[codec][plan]") {
  const std::string garbage("\xff\xff\xff\xff", 4);
  CHECK_THROWS_AS(DecodeSavePlan(garbage), CorruptionError);
  CHECK_THROWS_AS(DecodeLoadPlan(garbage), CorruptionError);
  CHECK_THROWS_AS(DecodeWriteResults(garbage), CorruptionError);
}

// ---------------------------------------------------------------------------------------------
// The metadata file

TEST_CASE("codec: Metadata round trips through the metadata file", "[codec][metadata]") {
  const Metadata md = MakeMetadata();
  REQUIRE_NOTHROW(ValidateMetadata(md, kSource));
  const std::string file = EncodeMetadataFile(md);

  // The envelope: magic, version, CRC of the payload, payload length.
  REQUIRE(file.size() > kMetadataHeaderSize);
  CHECK(file.substr(0, 8) == "DCPMETA1");
  CHECK(ReadLe32(file, 8) == md.format_version);
  const std::string payload = file.substr(kMetadataHeaderSize);
  CHECK(ReadLe32(file, 12) == Crc32c(0, payload.data(), payload.size()));
  CHECK(ReadLe32(file, 16) == payload.size());
  CHECK(ReadLe32(file, 20) == 0u);
  CHECK(payload == EncodeMetadata(md));

  const Metadata back = DecodeMetadataFile(file, kSource);
  CheckSameMetadata(md, back);
  CHECK(back.TotalStoredBytes() == md.TotalStoredBytes());
  CHECK(md.TotalStoredBytes() == 48 + 17 + 24 + 12 + 8 + 0 + 5);
  // Deterministic: equal metadata gives equal bytes.
  CHECK(EncodeMetadataFile(back) == file);
  // The plain wire encoding round trips too.
  CheckSameMetadata(md, DecodeMetadata(EncodeMetadata(md), kSource));
}

TEST_CASE("codec: stored items decode in any order and a duplicate is refused",
          "[codec][metadata]") {
  // Protobuf messages concatenate: the tail's items come after the head's.
  const Metadata md = MakeMetadata();
  REQUIRE(md.storage.size() > 2);
  Metadata tail = md;
  tail.entries.clear();
  tail.key_paths.clear();
  tail.planner_data.clear();
  tail.storage = {*md.storage.begin()};
  Metadata head = md;
  head.storage.erase(head.storage.begin());
  // The first item last: out of key order, the same metadata.
  CheckSameMetadata(md, DecodeMetadata(EncodeMetadata(head) + EncodeMetadata(tail), kSource));
  // Sent twice: refused, whether it comes last in order or out of it.
  CHECK_THROWS_WITH(DecodeMetadata(EncodeMetadata(md) + EncodeMetadata(tail), kSource),
                    Contains("duplicate stored item"));
  Metadata last = tail;
  last.storage = {*md.storage.rbegin()};
  CHECK_THROWS_WITH(DecodeMetadata(EncodeMetadata(md) + EncodeMetadata(last), kSource),
                    Contains("duplicate stored item"));
}

TEST_CASE("codec: DecodeMetadataFile rejects damaged files", "[codec][metadata]") {
  const std::string good = EncodeMetadataFile(MakeMetadata());
  auto decode = [](const std::string& bytes) { return DecodeMetadataFile(bytes, kSource); };

  SECTION("bad magic") {
    std::string f = good;
    f.replace(0, 8, "PK\x03\x04zip!");
    const std::string msg = MessageOf<CorruptionError>([&] { decode(f); });
    CHECK_THAT(msg, Contains(kSource));
    CHECK_THAT(msg, Contains("magic"));
  }
  SECTION("too short for a header") {
    CHECK_THROWS_AS(decode(""), CorruptionError);
    CHECK_THROWS_AS(decode(good.substr(0, 8)), CorruptionError);
    CHECK_THROWS_AS(decode(good.substr(0, kMetadataHeaderSize - 1)), CorruptionError);
  }
  SECTION("truncated payload") {
    for (size_t cut : {size_t{1}, size_t{7}, good.size() - kMetadataHeaderSize}) {
      INFO("cut " << cut);
      const std::string msg =
          MessageOf<CorruptionError>([&] { decode(good.substr(0, good.size() - cut)); });
      CHECK_THAT(msg, Contains(kSource));
      CHECK_THAT(msg, Contains("truncated"));
    }
  }
  SECTION("trailing bytes") { CHECK_THROWS_AS(decode(good + "x"), CorruptionError); }
  SECTION("flipped payload byte") {
    for (size_t at : {kMetadataHeaderSize, good.size() / 2, good.size() - 1}) {
      INFO("byte " << at);
      std::string f = good;
      f[at] = static_cast<char>(f[at] ^ 0x10);
      const std::string msg = MessageOf<CorruptionError>([&] { decode(f); });
      CHECK_THAT(msg, Contains("checksum"));
      CHECK_THAT(msg, Contains(kSource));
    }
  }
  SECTION("flipped checksum in the header") {
    std::string f = good;
    f[13] = static_cast<char>(f[13] ^ 0x01);
    CHECK_THROWS_WITH(decode(f), Contains("checksum"));
    CHECK_THROWS_AS(decode(f), CorruptionError);
  }
  SECTION("wrong payload length in the header") {
    std::string f = good;
    f[16] = static_cast<char>(f[16] + 1);
    CHECK_THROWS_AS(decode(f), CorruptionError);
  }
  SECTION("newer format version in the header") {
    for (uint32_t v : {kFormatVersion + 1, 0xFFFFFFFFu}) {
      std::string f = good;
      WriteLe32(f, 8, v);
      const std::string msg = MessageOf<UnsupportedError>([&] { decode(f); });
      CHECK_THAT(msg, Contains("version " + std::to_string(v)));
      CHECK_THAT(msg, Contains(kSource));
    }
  }
  SECTION("newer format version in the payload only") {
    Metadata md = MakeMetadata();
    md.format_version = kFormatVersion + 1;
    std::string f = EncodeMetadataFile(md);
    WriteLe32(f, 8, kFormatVersion);  // the header claims a readable version
    CHECK_THROWS_AS(decode(f), UnsupportedError);
  }
  SECTION("no format version") {
    Metadata md = MakeMetadata();
    md.format_version = 0;
    CHECK_THROWS_AS(decode(EncodeMetadataFile(md)), CorruptionError);
  }
  SECTION("a payload that is not protobuf, with a valid envelope") {
    const std::string payload("\xff\xff\xff\xff", 4);
    std::string f = good.substr(0, kMetadataHeaderSize);
    WriteLe32(f, 12, Crc32c(0, payload.data(), payload.size()));
    WriteLe32(f, 16, static_cast<uint32_t>(payload.size()));
    WriteLe32(f, 20, 0);
    const std::string msg = MessageOf<CorruptionError>([&] { decode(f + payload); });
    CHECK_THAT(msg, Contains(kSource));
  }
  SECTION("an unknown dtype value") {
    Metadata md = MakeMetadata();
    std::get<TensorMetadata>(md.entries.at("model.b")).dtype = static_cast<DType>(99);
    CHECK_THROWS_WITH(decode(EncodeMetadataFile(md)), Contains("99"));
    CHECK_THROWS_AS(decode(EncodeMetadataFile(md)), CorruptionError);
  }
  SECTION("a well-formed file with inconsistent metadata is validated") {
    Metadata md = MakeMetadata();
    md.storage.at(MetadataIndex{"step", {}, {}}).relative_path = "../../etc/passwd";
    const std::string msg = MessageOf<CorruptionError>([&] { decode(EncodeMetadataFile(md)); });
    CHECK_THAT(msg, Contains("../../etc/passwd"));
  }
}

TEST_CASE("codec: ValidateMetadata rejects inconsistent metadata", "[codec][metadata]") {
  Metadata md = MakeMetadata();
  auto& w = std::get<TensorMetadata>(md.entries.at("model.w"));
  auto stored = [&](const std::string& fqn, Shape offset) -> StorageInfo& {
    return md.storage.at(MetadataIndex{fqn, std::move(offset), {}});
  };
  auto message = [&] {
    std::string msg = MessageOf<CorruptionError>([&] { ValidateMetadata(md, kSource); });
    CHECK_THAT(msg, Contains(kSource));
    return msg;
  };

  SECTION("a stored item at offsets that match no chunk") {
    md.storage.emplace(MetadataIndex{"model.w", {1, 1}, {}}, stored("model.b", {0}));
    CHECK_THAT(message(), Contains("matches no chunk") && Contains("model.w"));
  }
  SECTION("a byte entry's stored item with chunk offsets") {
    StorageInfo info = md.storage.at(MetadataIndex{"rng", {}, {}});
    md.storage.erase(MetadataIndex{"rng", {}, {}});
    md.storage.emplace(MetadataIndex{"rng", {0}, {}}, info);
    CHECK_THROWS_AS(ValidateMetadata(md, kSource), CorruptionError);
  }
  SECTION("'..' in a path") {
    stored("model.w", {2, 3}).relative_path = "../escape.distcp";
    const std::string msg = message();
    CHECK_THAT(msg, Contains("../escape.distcp"));
    CHECK_THAT(msg, Contains("model.w"));
  }
  SECTION("'..' inside a path") {
    stored("model.b", {0}).relative_path = "sub/../../x.distcp";
    CHECK_THAT(message(), Contains("sub/../../x.distcp"));
  }
  SECTION("'.' and empty components") {
    stored("model.b", {0}).relative_path = "./x.distcp";
    CHECK_THAT(message(), Contains("./x.distcp"));
    stored("model.b", {0}).relative_path = "sub//x.distcp";
    CHECK_THAT(message(), Contains("sub//x.distcp"));
    stored("model.b", {0}).relative_path = "sub/";
    CHECK_THAT(message(), Contains("sub/"));
  }
  SECTION("absolute path") {
    stored("rng", {}).relative_path = "/etc/passwd";
    const std::string msg = message();
    CHECK_THAT(msg, Contains("/etc/passwd"));
    CHECK_THAT(msg, Contains("rng"));
  }
  SECTION("empty path") {
    stored("model.b", {0}).relative_path = "";
    CHECK_THAT(message(), Contains("model.b"));
  }
  SECTION("path with a NUL byte") {
    stored("model.b", {0}).relative_path = std::string("a\0b", 3);
    CHECK_THAT(message(), Contains("model.b"));
  }
  SECTION("chunk outside the shape") {
    w.chunks[2].sizes = {2, 4};  // columns 3..7 of a 6-column tensor
    const std::string msg = message();
    CHECK_THAT(msg, Contains("model.w"));
    CHECK_THAT(msg, Contains("outside"));
  }
  SECTION("negative chunk offset") {
    w.chunks[0].offsets = {-1, 0};
    md.storage.erase(MetadataIndex{"model.w", {0, 0}, {}});
    AddStored(md, "model.w", {-1, 0}, 0, "__0_0.distcp", 0, 48);
    CHECK_THAT(message(), Contains("model.w"));
  }
  SECTION("chunk of the wrong rank") {
    w.chunks[2] = {{2, 3, 0}, {2, 3, 1}};
    CHECK_THAT(message(), Contains("model.w"));
  }
  SECTION("chunks that do not cover the tensor") {
    w.chunks.pop_back();
    md.storage.erase(MetadataIndex{"model.w", {2, 3}, {}});
    const std::string msg = message();
    CHECK_THAT(msg, Contains("model.w"));
    CHECK_THAT(msg, Contains("cover"));
  }
  SECTION("overlapping chunks whose sizes add up to the volume") {
    // Rows [0, 2) and [1, 3): 24 elements in all, like the [4, 6] tensor, yet row 3 is missing.
    w.chunks = {{{0, 0}, {2, 6}}, {{1, 0}, {2, 6}}};
    md.storage.erase(MetadataIndex{"model.w", {2, 0}, {}});
    md.storage.erase(MetadataIndex{"model.w", {2, 3}, {}});
    AddStored(md, "model.w", {1, 0}, 1, "__1_0.distcp", 0, 48);
    CHECK_THAT(message(), Contains("model.w"));
  }
  SECTION("a chunk listed twice") {
    // Rows [0, 2) twice and rows [2, 4) not at all: again 24 elements.
    w.chunks = {{{0, 0}, {2, 6}}, {{0, 0}, {2, 6}}};
    md.storage.erase(MetadataIndex{"model.w", {2, 0}, {}});
    md.storage.erase(MetadataIndex{"model.w", {2, 3}, {}});
    CHECK_THAT(message(), Contains("model.w"));
  }
  SECTION("missing stored item for a chunk") {
    md.storage.erase(MetadataIndex{"model.w", {2, 3}, {}});
    const std::string msg = message();
    CHECK_THAT(msg, Contains("model.w"));
    CHECK_THAT(msg, Contains("no stored item"));
  }
  SECTION("missing stored item for a byte entry") {
    md.storage.erase(MetadataIndex{"rng", {}, {}});
    CHECK_THAT(message(), Contains("rng"));
  }
  SECTION("wrong raw length") {
    stored("model.w", {2, 0}).raw_length = 23;
    const std::string msg = message();
    CHECK_THAT(msg, Contains("model.w"));
    CHECK_THAT(msg, Contains("23"));
  }
  SECTION("wrong stored length of an untransformed item") {
    stored("model.b", {0}).length = 13;
    const std::string msg = message();
    CHECK_THAT(msg, Contains("model.b"));
    CHECK_THAT(msg, Contains("13"));
  }
  SECTION("absurd shape") {
    const int64_t big = int64_t{1} << 40;
    md.entries["huge"] = TensorMetadata{DType::kUInt8, {big, big}, {{{0, 0}, {big, big}}}};
    AddStored(md, "huge", {0, 0}, 0, "__0_0.distcp", 0, 0);
    CHECK_THAT(message(), Contains("huge"));
  }
  SECTION("negative dimension") {
    md.entries["neg"] = TensorMetadata{DType::kUInt8, {-4}, {}};
    CHECK_THAT(message(), Contains("neg"));
  }
  SECTION("stored item whose fqn has no entry") {
    AddStored(md, "ghost.weight", {0}, 0, "__0_0.distcp", 0, 4);
    const std::string msg = message();
    CHECK_THAT(msg, Contains("ghost.weight"));
    CHECK_THAT(msg, Contains("no entry"));
  }
  SECTION("overflowing offset and length") {
    auto& s = stored("model.b", {0});
    s.offset = std::numeric_limits<uint64_t>::max() - 3;
    CHECK_THAT(message(), Contains("model.b"));
  }
  SECTION("entry with an empty fqn") {
    md.entries[""] = BytesMetadata{};
    AddStored(md, "", {}, std::nullopt, "__0_0.distcp", 0, 1);
    CHECK_THROWS_AS(ValidateMetadata(md, kSource), CorruptionError);
  }
}

TEST_CASE("codec: ValidateMetadata accepts legitimate corner cases", "[codec][metadata]") {
  Metadata md;
  CHECK_NOTHROW(ValidateMetadata(md, kSource));  // an empty checkpoint
  // A tensor with no elements and no chunks at all.
  md.entries["none"] = TensorMetadata{DType::kFloat32, {3, 0}, {}};
  // Names with leading dots (still plain names in the root).
  md.entries["x"] = TensorMetadata{DType::kInt8, {2}, {{{0}, {1}}, {{1}, {1}}}};
  AddStored(md, "x", {0}, 0, "..data", 0, 1);
  AddStored(md, "x", {1}, 1, ".hidden", 1, 1);
  CHECK_NOTHROW(ValidateMetadata(md, kSource));
}

TEST_CASE("codec: Crc32cCombine equals the CRC of the concatenation", "[codec][crc]") {
  std::vector<char> buf(1 << 20);
  dcp::testing::FillRandom(buf.data(), buf.size(), 77);
  const uint32_t whole = Crc32c(0, buf.data(), buf.size());
  for (size_t split : {size_t{0}, size_t{1}, size_t{7}, size_t{4096}, size_t{333333},
                       buf.size() - 1, buf.size()}) {
    INFO("split " << split);
    const uint32_t a = Crc32c(0, buf.data(), split);
    const uint32_t b = Crc32c(0, buf.data() + split, buf.size() - split);
    CHECK(Crc32cCombine(a, b, buf.size() - split) == whole);
  }
  // Three pieces, combined left to right.
  const uint32_t p1 = Crc32c(0, buf.data(), 1000), p2 = Crc32c(0, buf.data() + 1000, 5000),
                 p3 = Crc32c(0, buf.data() + 6000, buf.size() - 6000);
  CHECK(Crc32cCombine(Crc32cCombine(p1, p2, 5000), p3, buf.size() - 6000) == whole);
  CHECK(Crc32cCombine(0xE3069283u, 0, 0) == 0xE3069283u);
}

TEST_CASE("codec: CRC combination holds for pieces of 512 MiB and more", "[codec][crc]") {
  // Appending n bytes multiplies by x^(8n): at n >= 2^29 that power needed x^(2^32) and more,
  // which a table of x^(2^k) for k < 32 used cyclically got wrong for CRC32C (a load that
  // verified an item read in 1.2 GB pieces reported a checksum mismatch). B is n zero bytes,
  // its CRC computed a MiB at a time.
  const std::vector<char> zeros(1 << 20, 0);
  const std::string a = "123456789";
  for (uint64_t mib : {uint64_t{511}, uint64_t{512}, uint64_t{1229}, uint64_t{4097}}) {
    INFO(mib << " MiB");
    uint32_t b = 0, ab = Crc32c(0, a.data(), a.size());
    uint32_t b_zip = 0, ab_zip = Crc32(0, a.data(), a.size());
    for (uint64_t i = 0; i < mib; ++i) {
      b = Crc32c(b, zeros.data(), zeros.size());
      ab = Crc32c(ab, zeros.data(), zeros.size());
      b_zip = Crc32(b_zip, zeros.data(), zeros.size());
      ab_zip = Crc32(ab_zip, zeros.data(), zeros.size());
    }
    CHECK(Crc32cCombine(Crc32c(0, a.data(), a.size()), b, mib << 20) == ab);
    CHECK(Crc32Combine(Crc32(0, a.data(), a.size()), b_zip, mib << 20) == ab_zip);
  }
}

TEST_CASE("codec: Crc32Combine (zip's CRC-32) equals the CRC of the concatenation",
          "[codec][crc]") {
  CHECK(Crc32(0, "123456789", 9) == 0xCBF43926u);
  std::vector<char> buf(1 << 20);
  dcp::testing::FillRandom(buf.data(), buf.size(), 78);
  const uint32_t whole = Crc32(0, buf.data(), buf.size());
  for (size_t split : {size_t{0}, size_t{1}, size_t{4096}, size_t{333333}, buf.size()}) {
    INFO("split " << split);
    const uint32_t a = Crc32(0, buf.data(), split);
    const uint32_t b = Crc32(0, buf.data() + split, buf.size() - split);
    CHECK(Crc32Combine(a, b, buf.size() - split) == whole);
    if (split > 0 && split < buf.size()) {
      CHECK(Crc32cCombine(a, b, buf.size() - split) != whole);  // the polynomials differ
    }
  }
}
