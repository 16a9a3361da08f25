// Per-item zstd compression (StorageOptions::compression, storage/format/zstd_transform.h): round
// trips of compressible and incompressible data, a mix in one checkpoint, every dtype,
// non-contiguous sources, the 8 MiB probe, empty items, resharded (partial) loads, and damage:
// flipped bytes, frames of the wrong raw length, unknown transforms. Over file:// and mem://.
#include <catch2/catch.hpp>
#include <cstring>
#include <random>

#include "dcp/proto/schema/codec.h"
#include "dcp/storage/backends/mem_store.h"
#include "dcp/storage/format/dcp_layout.h"
#include "dcp/storage/format/zstd_transform.h"
#include "support/test_support.h"

using namespace dcp;
using Catch::Matchers::Contains;
using dcp::testing::Clone;
using dcp::testing::RandomTensor;
using dcp::testing::RequireNoErrors;
using dcp::testing::RowRange;
using dcp::testing::RunRanks;
using dcp::testing::SameElements;
using dcp::testing::TempDir;

namespace {

const char* const kSchemes[] = {"file", "mem"};

struct Location {
  std::string uri;
  std::unique_ptr<TempDir> dir;
};

Location Fresh(const std::string& scheme) {
  static int counter = 0;
  Location loc;
  if (scheme == "mem") {
    loc.uri = "mem://compression-" + std::to_string(counter++);
    ClearMemStore(SplitUri(loc.uri).second);
  } else {
    loc.dir = std::make_unique<TempDir>("zstd");
    loc.uri = "file://" + loc.dir->path() + "/ckpt";
  }
  return loc;
}

// Random bytes with 4 bits of entropy each (bool: 0 or 1): compresses to about half.
TensorView Compressible(DType dtype, const Shape& shape, uint64_t seed) {
  TensorView t = RandomTensor(dtype, shape, seed);
  auto* p = static_cast<uint8_t*>(t.data);
  for (size_t i = 0; i < t.nbytes(); ++i) p[i] &= dtype == DType::kBool ? 0x01 : 0x0F;
  return t;
}

// bf16 weights drawn from N(0, 0.02), the usual initialisation.
TensorView NormalBf16(const Shape& shape, uint64_t seed) {
  TensorView t = TensorView::Allocate(DType::kBFloat16, shape);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  auto* p = static_cast<uint16_t*>(t.data);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float f = normal(rng);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    p[i] = static_cast<uint16_t>(bits >> 16);
  }
  return t;
}

// The transposed view of a contiguous [r, c] tensor: shape [c, r], strides [1, c].
TensorView Transposed(const TensorView& t) {
  TensorView v = t;
  v.shape = {t.shape[1], t.shape[0]};
  v.strides = {1, t.shape[1]};
  return v;
}

SaveOptions Zstd(uint64_t min_bytes = 4096, double max_ratio = 0.9) {
  SaveOptions so;
  so.storage.compression = Compression::kZstd;
  so.storage.compression_min_bytes = min_bytes;
  so.storage.compression_max_ratio = max_ratio;
  return so;
}

const StorageInfo& Item(const Metadata& md, const std::string& fqn, const Shape& offsets = {}) {
  return md.storage.at(MetadataIndex{fqn, offsets, {}});
}

bool IsZstd(const Metadata& md, const std::string& fqn, const Shape& offsets = {}) {
  const StorageInfo& info = Item(md, fqn, offsets);
  if (info.transforms.empty()) {
    CHECK(info.length == info.raw_length);
    return false;
  }
  CHECK(info.transforms == std::vector<std::string>{kZstdTransform});
  CHECK(info.length < info.raw_length);
  CHECK(info.crc32c);
  return true;
}

// Allocate a zeroed destination for every tensor of `src` (same dtype and shape), blobs empty.
StateDict EmptyLike(const std::map<std::string, TensorView>& tensors,
                    const std::vector<std::string>& blobs, std::map<std::string, TensorView>& out) {
  StateDict sd;
  for (const auto& [name, t] : tensors) {
    out[name] = TensorView::Allocate(t.dtype, t.shape);
    sd.Set(name, out[name]);
  }
  for (const auto& b : blobs) sd.Set(b, Blob{});
  return sd;
}

void Patch(Store& store, const std::string& name, uint64_t offset, char x) {
  std::string all = store.ReadAll(name, UINT64_MAX);
  all[offset] ^= x;
  auto w = store.Create(name);
  w->Append(all.data(), all.size());
  w->Close();
}

// The message of the CollectiveError a load fails with, after checking its code.
std::string LoadFailure(StateDict& sd, const std::string& uri, ErrorCode code,
                        const LoadOptions& lo = {}) {
  try {
    Load(sd, uri, lo);
  } catch (const CollectiveError& e) {
    REQUIRE(e.failures().size() == 1);
    CHECK(e.failures()[0].code == code);
    return e.what();
  }
  FAIL("the load succeeded");
  return {};
}

}  // namespace

TEST_CASE("compression: a checkpoint holds a mix, and every item loads back",
          "[compression][option:StorageOptions::compression]") {
  for (const char* scheme : kSchemes) {
    for (int files : {1, 2}) {
      DYNAMIC_SECTION(scheme << " files_per_rank=" << files) {
        Location loc = Fresh(scheme);
        std::map<std::string, TensorView> src = {
            {"model.w", Compressible(DType::kFloat32, {256, 300}, 1)},
            {"model.noise", RandomTensor(DType::kUInt8, {512, 1024}, 2)},
            {"model.bias", Compressible(DType::kFloat32, {16}, 3)},  // below the minimum
            {"model.bf16", NormalBf16({128, 256}, 4)},
            {"empty", TensorView::Allocate(DType::kFloat32, {0, 7})},
            {"step", RandomTensor(DType::kInt64, {}, 5)},
        };
        std::string text;
        while (text.size() < 100000) text += "layer " + std::to_string(text.size() % 977) + ";";
        std::string noise(65536, '\0');
        dcp::testing::FillRandom(noise.data(), noise.size(), 6);
        const std::map<std::string, std::string> blobs = {
            {"config", text}, {"rng", "\x01\x02small"}, {"noise_blob", noise}};
        StateDict sd;
        for (const auto& [n, t] : src) sd.Set(n, t);
        for (const auto& [n, b] : blobs) sd.Set(n, Blob{b});
        SaveOptions so = Zstd();
        so.storage.files_per_rank = files;
        Metadata md = Save(sd, loc.uri, so).metadata;
        ReadStoredItems(loc.uri, md);

        CHECK(IsZstd(md, "model.w", {0, 0}));
        CHECK_FALSE(IsZstd(md, "model.noise", {0, 0}));  // random: not worth it
        CHECK_FALSE(IsZstd(md, "model.bias", {0}));      // tiny
        CHECK_FALSE(IsZstd(md, "empty", {0, 0}));
        CHECK_FALSE(IsZstd(md, "step", {}));
        CHECK(IsZstd(md, "config"));
        CHECK_FALSE(IsZstd(md, "rng"));
        CHECK_FALSE(IsZstd(md, "noise_blob"));
        IsZstd(md, "model.bf16", {0, 0});  // either way; its checks hold
        const StorageInfo w = Item(md, "model.w", {0, 0});
        CHECK(w.raw_length == 256u * 300 * 4);
        CHECK(w.length < w.raw_length * 6 / 10);
        uint64_t raw_total = 0;
        for (const auto& [i, info] : md.storage) raw_total += info.raw_length;
        CHECK(md.TotalStoredBytes() < raw_total);
        // The metadata survives a trip through its file.
        const Metadata read = ReadMetadata(loc.uri);
        CHECK(read.storage.at(MetadataIndex{"model.w", {0, 0}, {}}).transforms ==
              std::vector<std::string>{"zstd"});

        for (size_t scratch : {size_t{32} << 20, size_t{64}}) {
          for (bool verify : {true, false}) {
            INFO("scratch " << scratch << " verify " << verify);
            std::map<std::string, TensorView> dst;
            std::vector<std::string> names;
            for (const auto& [n, b] : blobs) names.push_back(n);
            StateDict back = EmptyLike(src, names, dst);
            LoadOptions lo;  // no compression settings needed to read
            lo.storage.max_scratch_bytes = scratch;
            lo.storage.verify_checksums = verify;
            Load(back, loc.uri, lo);
            for (const auto& [n, t] : src) {
              INFO(n);
              CHECK(SameElements(dst[n], t));
            }
            for (const auto& [n, b] : blobs) CHECK(std::get<Blob>(*back.Find(n)).bytes == b);
          }
        }
      }
    }
  }
}

TEST_CASE("compression: every dtype round-trips", "[compression]") {
  Location loc = Fresh("mem");
  std::map<std::string, TensorView> src;
  StateDict sd;
  for (DType d : AllDTypes()) {
    const std::string name = "t_" + std::string(DTypeName(d));
    src[name] = Compressible(d, {33, 17}, static_cast<uint64_t>(d));
    sd.Set(name, src[name]);
  }
  Metadata md = Save(sd, loc.uri, Zstd(0, 1.0)).metadata;
  ReadStoredItems(loc.uri, md);
  size_t compressed = 0;
  for (const auto& [n, t] : src) compressed += IsZstd(md, n, {0, 0});
  CHECK(compressed >= src.size() * 3 / 4);
  std::map<std::string, TensorView> dst;
  StateDict back = EmptyLike(src, {}, dst);
  Load(back, loc.uri);
  for (const auto& [n, t] : src) {
    INFO(n);
    CHECK(SameElements(dst[n], t));
  }
}

TEST_CASE("compression: non-contiguous sources, large items and the 8 MiB probe", "[compression]") {
  for (const char* scheme : kSchemes) {
    DYNAMIC_SECTION(scheme) {
      Location loc = Fresh(scheme);
      const int64_t mib = 1 << 20;
      // Compressible first 8 MiB then random (stays compressed: judged on its prefix), and the
      // reverse (stored raw).
      TensorView head = Compressible(DType::kUInt8, {12 * mib}, 10);
      dcp::testing::FillRandom(static_cast<char*>(head.data) + 8 * mib, 4 * mib, 11);
      TensorView tail = RandomTensor(DType::kUInt8, {12 * mib}, 12);
      std::memset(static_cast<char*>(tail.data) + 8 * mib, 0, 4 * mib);
      std::map<std::string, TensorView> src = {
          {"small_t", Transposed(Compressible(DType::kFloat32, {300, 200}, 1))},
          {"big_t", Transposed(Compressible(DType::kFloat32, {1536, 1536}, 2))},  // 9 MiB
          {"big_random", RandomTensor(DType::kUInt8, {9 * mib}, 3)},
          {"big_random_t", Transposed(RandomTensor(DType::kUInt8, {3072, 3072}, 4))},
          {"head", head},
          {"tail", tail},
      };
      StateDict sd;
      for (const auto& [n, t] : src) sd.Set(n, t);
      Metadata md = Save(sd, loc.uri, Zstd()).metadata;
      ReadStoredItems(loc.uri, md);
      CHECK(IsZstd(md, "small_t", {0, 0}));
      CHECK(IsZstd(md, "big_t", {0, 0}));
      CHECK_FALSE(IsZstd(md, "big_random", {0}));
      CHECK_FALSE(IsZstd(md, "big_random_t", {0, 0}));
      CHECK(IsZstd(md, "head", {0}));
      CHECK_FALSE(IsZstd(md, "tail", {0}));
      std::map<std::string, TensorView> dst;
      StateDict back = EmptyLike(src, {}, dst);
      Load(back, loc.uri);
      for (const auto& [n, t] : src) {
        INFO(n);
        CHECK(SameElements(dst[n], Clone(t)));
      }
    }
  }
}

TEST_CASE("compression: zstd worker threads", "[compression]") {
  Location loc = Fresh("mem");
  TensorView big = Compressible(DType::kBFloat16, {3000, 2000}, 7);  // 11.4 MiB
  TensorView noise = RandomTensor(DType::kFloat32, {3000, 1000}, 8);
  StateDict sd;
  sd.Set("big", big).Set("noise", noise);
  SaveOptions so = Zstd();
  so.storage.compression_threads = 2;
  Metadata md = Save(sd, loc.uri, so).metadata;
  ReadStoredItems(loc.uri, md);
  CHECK(IsZstd(md, "big", {0, 0}));
  CHECK_FALSE(IsZstd(md, "noise", {0, 0}));
  std::map<std::string, TensorView> dst;
  StateDict back = EmptyLike({{"big", big}, {"noise", noise}}, {}, dst);
  Load(back, loc.uri);
  CHECK(SameElements(dst["big"], big));
  CHECK(SameElements(dst["noise"], noise));
}

TEST_CASE("compression: empty tensors and byte blobs", "[compression]") {
  for (const char* scheme : kSchemes) {
    DYNAMIC_SECTION(scheme) {
      Location loc = Fresh(scheme);
      std::map<std::string, TensorView> src = {
          {"e1", TensorView::Allocate(DType::kFloat32, {0})},
          {"e3", TensorView::Allocate(DType::kInt16, {3, 0, 2})},
          {"scalar", Compressible(DType::kFloat64, {}, 1)},
      };
      const std::map<std::string, std::string> blobs = {
          {"b_empty", ""}, {"b_one", "x"}, {"b_big", std::string(1 << 20, 'a') + "end"}};
      StateDict sd;
      for (const auto& [n, t] : src) sd.Set(n, t);
      for (const auto& [n, b] : blobs) sd.Set(n, Blob{b});
      Metadata md = Save(sd, loc.uri, Zstd(0, 1.0)).metadata;  // try every item
      ReadStoredItems(loc.uri, md);
      CHECK_FALSE(IsZstd(md, "e1", {0}));
      CHECK_FALSE(IsZstd(md, "e3", {0, 0, 0}));
      CHECK_FALSE(IsZstd(md, "b_empty"));
      CHECK_FALSE(IsZstd(md, "b_one"));  // a frame is larger than one byte
      CHECK(IsZstd(md, "b_big"));
      CHECK(Item(md, "b_big").length < 1000);
      std::map<std::string, TensorView> dst;
      std::vector<std::string> names;
      for (const auto& [n, b] : blobs) names.push_back(n);
      StateDict back = EmptyLike(src, names, dst);
      Load(back, loc.uri);
      CHECK(SameElements(dst["scalar"], src["scalar"]));
      for (const auto& [n, b] : blobs) CHECK(std::get<Blob>(*back.Find(n)).bytes == b);
    }
  }
}

namespace {

// Chunks of `shape` for `rank` of `world`: 0 = rows, 1 = columns, 2 = a 2 x 2 grid round-robin.
std::vector<ChunkMeta> Layout(int layout, const Shape& shape, int rank, int world) {
  std::vector<ChunkMeta> out;
  if (layout < 2) {
    auto [b, e] = RowRange(shape[layout], rank, world);
    ChunkMeta c{Shape(shape.size(), 0), shape};
    c.offsets[layout] = b;
    c.sizes[layout] = e - b;
    if (e > b) out.push_back(c);
    return out;
  }
  for (int block = 0; block < 4; ++block) {
    if (block % world != rank) continue;
    auto [r0, r1] = RowRange(shape[0], block / 2, 2);
    auto [c0, c1] = RowRange(shape[1], block % 2, 2);
    ChunkMeta c{Shape(shape.size(), 0), shape};
    c.offsets[0] = r0, c.sizes[0] = r1 - r0, c.offsets[1] = c0, c.sizes[1] = c1 - c0;
    out.push_back(c);
  }
  return out;
}

struct Spec {
  std::string fqn;
  DType dtype;
  Shape shape;
};
const Spec kSpecs[] = {{"w", DType::kFloat32, {37, 50}},
                       {"emb", DType::kInt16, {40, 9, 3}},
                       {"m", DType::kFloat64, {6, 160}}};

TensorView Reference(const Spec& s) {
  return Compressible(s.dtype, s.shape, s.shape[0] * 7 + s.shape[1]);
}

}  // namespace

TEST_CASE("compression: resharded (partial) loads from a compressed checkpoint",
          "[compression][reshard]") {
  for (int save_world : {1, 3}) {
    for (int save_layout = 0; save_layout < 3; ++save_layout) {
      const std::string uri = "mem://compression-reshard";
      ClearMemStore("compression-reshard");
      RequireNoErrors(RunRanks(save_world, [&](int r, Communicator& comm) {
        StateDict sd;
        for (const auto& s : kSpecs) {
          ShardedTensor st{s.dtype, s.shape, {}};
          for (const auto& c : Layout(save_layout, s.shape, r, save_world)) {
            st.local_shards.push_back({Clone(Reference(s).Narrow(c.offsets, c.sizes)), c.offsets});
          }
          sd.Set(s.fqn, st);
        }
        Save(sd, uri, comm, Zstd(0));
      }));
      const Metadata md = ReadMetadata(uri);
      size_t zstd = 0;
      for (const auto& [i, info] : md.storage) zstd += IsZstdItem(info);
      CHECK(zstd > 0);
      for (int load_world = 1; load_world <= 4; ++load_world) {
        for (int load_layout = 0; load_layout < 3; ++load_layout) {
          for (size_t scratch : {size_t{64}, size_t{1000}, size_t{32} << 20}) {
            INFO("saved layout " << save_layout << " at " << save_world << ", loaded layout "
                                 << load_layout << " at " << load_world << ", scratch " << scratch);
            std::vector<std::vector<std::pair<TensorView, ChunkMeta>>> dests(load_world);
            RequireNoErrors(RunRanks(load_world, [&](int r, Communicator& comm) {
              StateDict sd;
              for (const auto& s : kSpecs) {
                ShardedTensor st{s.dtype, s.shape, {}};
                for (const auto& c : Layout(load_layout, s.shape, r, load_world)) {
                  // Odd ranks read into transposed (strided) destinations.
                  TensorView v = TensorView::Allocate(s.dtype, c.sizes);
                  if (r % 2 == 1 && c.sizes.size() == 2) {
                    v = Transposed(TensorView::Allocate(s.dtype, {c.sizes[1], c.sizes[0]}));
                  }
                  dests[r].push_back({v, c});
                  st.local_shards.push_back({v, c.offsets});
                }
                sd.Set(s.fqn, st);
              }
              LoadOptions lo;
              lo.storage.max_scratch_bytes = scratch;
              lo.storage.verify_partial_reads = scratch != 1000;
              Load(sd, uri, comm, lo);
            }));
            for (const auto& rank_dests : dests) {
              for (const auto& [view, c] : rank_dests) {
                const Spec* spec = nullptr;
                for (const auto& s : kSpecs) {
                  if (s.dtype == view.dtype) spec = &s;
                }
                CHECK(SameElements(view, Reference(*spec).Narrow(c.offsets, c.sizes)));
              }
            }
          }
        }
      }
    }
  }
  ClearMemStore("compression-reshard");
}

TEST_CASE("compression: damaged compressed data is detected and named", "[compression]") {
  for (const char* scheme : kSchemes) {
    DYNAMIC_SECTION(scheme) {
      Location loc = Fresh(scheme);
      const TensorView w = Compressible(DType::kFloat32, {256, 300}, 1);
      std::string text(200000, 'z');
      for (size_t i = 0; i < text.size(); i += 7) text[i] = static_cast<char>('a' + i % 13);
      StateDict sd;
      sd.Set("model.w", w).Set("config", Blob{text});
      Metadata md = Save(sd, loc.uri, Zstd()).metadata;
      ReadStoredItems(loc.uri, md);
      const StorageInfo wi = Item(md, "model.w", {0, 0});
      const StorageInfo ci = Item(md, "config");
      REQUIRE(IsZstd(md, "model.w", {0, 0}));
      REQUIRE(IsZstd(md, "config"));
      auto store = OpenStore(loc.uri);
      std::map<std::string, TensorView> dst;
      StateDict back = EmptyLike({{"model.w", w}}, {"config"}, dst);
      LoadOptions no_verify;
      no_verify.storage.verify_checksums = false;

      SECTION("a flipped byte in a tensor chunk") {
        Patch(*store, wi.relative_path, wi.offset + wi.length / 2, 0x10);
        const std::string msg = LoadFailure(back, loc.uri, ErrorCode::kCorruption);
        CHECK_THAT(msg, Contains("model.w") && Contains(wi.relative_path) &&
                            Contains("offset " + std::to_string(wi.offset)));
        // zstd's own checks still catch it without the CRC32C.
        const std::string msg2 = LoadFailure(back, loc.uri, ErrorCode::kCorruption, no_verify);
        CHECK_THAT(msg2, Contains("model.w") && Contains(wi.relative_path) &&
                             Contains("corrupt compressed item"));
      }
      SECTION("a flipped byte in a blob") {
        Patch(*store, ci.relative_path, ci.offset + ci.length / 3, 0x01);
        CHECK_THAT(LoadFailure(back, loc.uri, ErrorCode::kCorruption),
                   Contains("config") && Contains(ci.relative_path));
        CHECK_THAT(LoadFailure(back, loc.uri, ErrorCode::kCorruption, no_verify),
                   Contains("config"));
      }
      SECTION("the CRC32C covers the stored bytes, the zstd checksum the raw bytes") {
        // Flipping the last byte (inside zstd's content checksum) fails both checks.
        Patch(*store, wi.relative_path, wi.offset + wi.length - 1, 0x01);
        CHECK_THAT(LoadFailure(back, loc.uri, ErrorCode::kCorruption), Contains("checksum"));
        CHECK_THAT(LoadFailure(back, loc.uri, ErrorCode::kCorruption, no_verify),
                   Contains("model.w") && Contains("checksum"));
        // A partial read of the first rows is verified through to the end only when asked.
        StateDict part;
        ShardedTensor st{DType::kFloat32, {256, 300}, {}};
        TensorView rows = TensorView::Allocate(DType::kFloat32, {10, 300});
        st.local_shards.push_back({rows, {0, 0}});
        part.Set("model.w", st);
        LoadOptions lo;
        lo.allow_partial_load = true;
        CHECK_THAT(LoadFailure(part, loc.uri, ErrorCode::kCorruption, lo), Contains("model.w"));
        lo.storage.verify_partial_reads = false;
        Load(part, loc.uri, lo);
        CHECK(SameElements(rows, w.Narrow({0, 0}, {10, 300})));
      }
      SECTION("a truncated data file") {
        const std::string all = store->ReadAll(wi.relative_path, UINT64_MAX);
        auto out = store->Create(wi.relative_path);
        out->Append(all.data(), wi.offset + wi.length - 10);
        out->Close();
        CHECK_THAT(LoadFailure(back, loc.uri, ErrorCode::kCorruption), Contains("truncated"));
      }
    }
  }
}

TEST_CASE("compression: frames of the wrong raw length, unknown transforms", "[compression]") {
  for (const char* scheme : kSchemes) {
    DYNAMIC_SECTION(scheme) {
      // Frames of 63 and 65 rows from other checkpoints, spliced in for the 64-row chunk.
      auto frame_of = [&](int64_t rows, StorageInfo& info) {
        Location other = Fresh(scheme);
        StateDict sd;
        sd.Set("model.w", Compressible(DType::kFloat32, {rows, 256}, 5));
        Metadata md = Save(sd, other.uri, Zstd()).metadata;
        ReadStoredItems(other.uri, md);
        info = Item(md, "model.w", {0, 0});
        REQUIRE(IsZstdItem(info));
        return OpenStore(other.uri)
            ->ReadAll(info.relative_path, UINT64_MAX)
            .substr(info.offset, info.length);
      };
      StorageInfo short_info, long_info;
      const std::string short_frame = frame_of(63, short_info);
      const std::string long_frame = frame_of(65, long_info);

      Location loc = Fresh(scheme);
      const TensorView w = Compressible(DType::kFloat32, {64, 256}, 5);
      std::string text(300000, 'q');
      StateDict sd;
      sd.Set("model.w", w).Set("config", Blob{text});
      SaveOptions v1 = Zstd();
      v1.storage.metadata_version = 1;  // the edits below are of the items version 1 lists
      Metadata saved = Save(sd, loc.uri, v1).metadata;
      REQUIRE(IsZstd(saved, "model.w", {0, 0}));
      REQUIRE(IsZstd(saved, "config"));
      auto store = OpenStore(loc.uri);
      {
        auto out = store->Create("data-patch.data");
        out->Append(short_frame.data(), short_frame.size());
        out->Append(long_frame.data(), long_frame.size());
        out->Close();
      }
      auto republish = [&](const std::function<void(Metadata&)>& edit) {
        Metadata md = saved;
        edit(md);
        store->PublishAtomically(kMetadataName, EncodeMetadataFile(md));
      };
      std::map<std::string, TensorView> dst;
      StateDict back = EmptyLike({{"model.w", w}}, {"config"}, dst);
      LoadOptions no_verify;
      no_verify.storage.verify_checksums = false;
      auto wi = [](Metadata& md) -> StorageInfo& {
        return md.storage.at(MetadataIndex{"model.w", {0, 0}, {}});
      };

      republish([&](Metadata& md) {
        StorageInfo& i = wi(md);
        i.relative_path = "data-patch.data";
        i.offset = 0;
        i.length = short_frame.size();
        i.crc32c = short_info.crc32c;
      });
      for (const LoadOptions& lo : {LoadOptions{}, no_verify}) {
        CHECK_THAT(
            LoadFailure(back, loc.uri, ErrorCode::kCorruption, lo),
            Contains("model.w") && Contains("data-patch.data") && Contains("decompresses to only"));
      }
      republish([&](Metadata& md) {
        StorageInfo& i = wi(md);
        i.relative_path = "data-patch.data";
        i.offset = short_frame.size();
        i.length = long_frame.size();
        i.crc32c = long_info.crc32c;
      });
      for (const LoadOptions& lo : {LoadOptions{}, no_verify}) {
        CHECK_THAT(LoadFailure(back, loc.uri, ErrorCode::kCorruption, lo),
                   Contains("model.w") && Contains("more than"));
      }
      // A blob's raw_length is not implied by a shape: too large and too small.
      republish([&](Metadata& md) {
        md.storage.at(MetadataIndex{"config", {}, {}}).raw_length += 5;
      });
      CHECK_THAT(LoadFailure(back, loc.uri, ErrorCode::kCorruption, no_verify),
                 Contains("config") && Contains("decompresses to only"));
      republish([&](Metadata& md) {
        md.storage.at(MetadataIndex{"config", {}, {}}).raw_length -= 5;
      });
      CHECK_THAT(LoadFailure(back, loc.uri, ErrorCode::kCorruption, no_verify),
                 Contains("config") && Contains("more than"));
      // Two frames back to back: bytes after the frame.
      republish([&](Metadata& md) {
        StorageInfo& i = wi(md);
        i.relative_path = "data-patch.data";
        i.offset = 0;
        i.length = short_frame.size() + long_frame.size();
        i.crc32c.reset();
        i.raw_length = short_info.raw_length;
        md.entries["model.w"] = TensorMetadata{DType::kFloat32, {63, 256}, {{{0, 0}, {63, 256}}}};
      });
      {
        TensorView t = TensorView::Allocate(DType::kFloat32, {63, 256});
        StateDict one;
        one.Set("model.w", t).Set("config", Blob{});
        CHECK_THAT(LoadFailure(one, loc.uri, ErrorCode::kCorruption),
                   Contains("follow the zstd frame"));
      }
      // Transforms this build does not know are refused, never returned as data.
      republish([&](Metadata& md) { wi(md).transforms = {"lz4"}; });
      CHECK_THAT(LoadFailure(back, loc.uri, ErrorCode::kUnsupported), Contains("'lz4'"));
      republish([&](Metadata& md) { wi(md).transforms = {"zstd", "shuffle"}; });
      CHECK_THAT(LoadFailure(back, loc.uri, ErrorCode::kUnsupported), Contains("zstd+shuffle"));
      // The original metadata loads.
      republish([](Metadata&) {});
      Load(back, loc.uri);
      CHECK(SameElements(dst["model.w"], w));
    }
  }
}

TEST_CASE("compression: options are validated", "[compression]") {
  Location loc = Fresh("mem");
  StateDict sd;
  sd.Set("w", Compressible(DType::kFloat32, {100}, 1));
  auto refused = [&](const std::function<void(StorageOptions&)>& set, const std::string& what) {
    SaveOptions so = Zstd();
    set(so.storage);
    try {
      Save(sd, loc.uri, so);
      FAIL("saved with bad " << what);
    } catch (const CollectiveError& e) {
      CHECK(e.failures()[0].code == ErrorCode::kInvalidArgument);
      CHECK_THAT(e.what(), Contains(what));
    }
  };
  refused([](StorageOptions& o) { o.compression_level = 99; }, "compression_level");
  refused([](StorageOptions& o) { o.compression_max_ratio = 0; }, "compression_max_ratio");
  refused([](StorageOptions& o) { o.compression_max_ratio = 1.5; }, "compression_max_ratio");
  refused([](StorageOptions& o) { o.compression_threads = -1; }, "compression_threads");
  refused([](StorageOptions& o) { o.compression = static_cast<Compression>(7); }, "compression");
  SaveOptions fast = Zstd(0);
  fast.storage.compression_level = -5;  // zstd's fast modes are levels too
  CHECK_NOTHROW(Save(sd, loc.uri, fast));
}
