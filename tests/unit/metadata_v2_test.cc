// Version-2 metadata (docs/FORMAT.md): rules instead of per-rank chunks, a file table, and an
// index at the end of each data file written by the rank that wrote it.
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "dcp/checkpoint.h"
#include "dcp/planner/default_planner.h"
#include "dcp/proto/checksum.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/storage/backends/file_store.h"
#include "dcp/storage/backends/mem_store.h"
#include "dcp/storage/format/dcp_layout.h"
#include "support/test_support.h"

using namespace dcp;
using Catch::Matchers::Contains;
using dcp::testing::RandomTensor;
using dcp::testing::RequireNoErrors;
using dcp::testing::RowRange;
using dcp::testing::RunRanks;
using dcp::testing::SameElements;
using dcp::testing::TempDir;

namespace {

constexpr int kTensors = 12;

// Tensor i: [rows_i, 24] float32, rows_i = 7 + 5 * i (neither rule divides every one evenly).
Shape ShapeOf(int i) { return {7 + 5 * i, 24}; }
const TensorView& Full(int i) {
  static std::vector<TensorView> full = [] {
    std::vector<TensorView> v;
    for (int k = 0; k < kTensors; ++k)
      v.push_back(RandomTensor(DType::kFloat32, ShapeOf(k), 90 + k));
    return v;
  }();
  return full[static_cast<size_t>(i)];
}

// Rank r of `world`: every tensor row-sharded (numpy.array_split), a replicated tensor and a
// blob every rank holds.
StateDict RowSharded(int r, int world) {
  StateDict sd;
  for (int i = 0; i < kTensors; ++i) {
    const Shape shape = ShapeOf(i);
    auto [b, e] = RowRange(shape[0], r, world);
    sd.Set("layer" + std::to_string(i) + ".w",
           ShardedTensor{DType::kFloat32, shape, {{Full(i).Narrow({b, 0}, {e - b, 24}), {b, 0}}}});
  }
  sd.Set("replicated", Full(0));
  sd.Set("tokenizer", Blob{std::string(3000, 'k')});
  return sd;
}

void SaveAt(const std::string& name, int world, uint32_t version) {
  ClearMemStore(name);
  RequireNoErrors(RunRanks(world, [&](int r, Communicator& comm) {
    SaveOptions so;
    so.storage.metadata_version = version;
    Save(RowSharded(r, world), "mem://" + name, comm, so);
  }));
}

// Load at `world` ranks with column shards (every local chunk overlaps every saved one) and
// check every value.
void LoadColumnsAndCheck(const std::string& name, int world) {
  std::vector<std::vector<TensorView>> got(static_cast<size_t>(world));
  std::vector<Blob> blobs(static_cast<size_t>(world));
  RequireNoErrors(RunRanks(world, [&](int r, Communicator& comm) {
    StateDict sd;
    auto& mine = got[static_cast<size_t>(r)];
    for (int i = 0; i < kTensors; ++i) {
      const Shape shape = ShapeOf(i);
      auto [b, e] = RowRange(shape[1], r, world);
      mine.push_back(TensorView::Allocate(DType::kFloat32, {shape[0], e - b}));
      sd.Set("layer" + std::to_string(i) + ".w",
             ShardedTensor{DType::kFloat32, shape, {{mine.back(), {0, b}}}});
    }
    mine.push_back(TensorView::Allocate(DType::kFloat32, ShapeOf(0)));
    sd.Set("replicated", mine.back());
    sd.Set("tokenizer", Blob{});
    Load(sd, "mem://" + name, comm);
    blobs[static_cast<size_t>(r)] = std::get<Blob>(*sd.Find("tokenizer"));
  }));
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r);
    for (int i = 0; i < kTensors; ++i) {
      const Shape shape = ShapeOf(i);
      auto [b, e] = RowRange(shape[1], r, world);
      CHECK(SameElements(got[r][i], Full(i).Narrow({0, b}, {shape[0], e - b})));
    }
    CHECK(SameElements(got[r].back(), Full(0)));
    CHECK(blobs[r].bytes == std::string(3000, 'k'));
  }
}

Metadata RawMetadata(const std::string& name) {
  return DecodeMetadataFile(MakeMemStore(name)->ReadAll(kMetadataName, UINT64_MAX), "test");
}

void Publish(const std::string& name, const Metadata& md) {
  MakeMemStore(name)->PublishAtomically(kMetadataName, EncodeMetadataFile(md));
}

// What a load of the checkpoint at mem://NAME throws (its message), at one rank.
std::string LoadError(const std::string& name) {
  StateDict sd;
  for (int i = 0; i < kTensors; ++i) {
    sd.Set("layer" + std::to_string(i) + ".w", TensorView::Allocate(DType::kFloat32, ShapeOf(i)));
  }
  sd.Set("replicated", TensorView::Allocate(DType::kFloat32, ShapeOf(0)));
  sd.Set("tokenizer", Blob{});
  try {
    Load(sd, "mem://" + name);
  } catch (const Error& e) {
    return e.what();
  }
  return "the load succeeded";
}

}  // namespace

TEST_CASE("metadata v2: rules and a file table instead of per-rank items, loaded in any layout",
          "[metadata-v2][option:StorageOptions::metadata_version]") {
  SaveAt("v2-rules", 4, 2);
  const Metadata md = RawMetadata("v2-rules");
  CHECK(md.format_version == 2);
  CHECK(md.storage.empty());
  REQUIRE(md.files.size() == 4);
  for (int r = 0; r < 4; ++r) CHECK(md.files[static_cast<size_t>(r)].writer == r);
  for (int i = 0; i < kTensors; ++i) {
    const auto& t = std::get<TensorMetadata>(md.entries.at("layer" + std::to_string(i) + ".w"));
    REQUIRE(t.regular);
    CHECK(t.chunks.empty());
    CHECK(t.regular->world == 4);
    CHECK(ChunkCount(t) == 4);
  }
  CHECK(std::get<BytesMetadata>(md.entries.at("tokenizer")).size == 3000);
  // dcp::ReadMetadata lists every item, from the indexes.
  const Metadata all = ReadMetadata("mem://v2-rules");
  CHECK(all.storage.size() == kTensors * 4 + 2);
  for (int world : {1, 3, 4}) {
    DYNAMIC_SECTION("loaded at " << world << " ranks, column shards") {
      LoadColumnsAndCheck("v2-rules", world);
    }
  }
  ClearMemStore("v2-rules");
}

TEST_CASE("metadata v2: version 1 is still written on request and both load",
          "[metadata-v2][option:StorageOptions::metadata_version]") {
  SaveAt("v2-as-v1", 3, 1);
  const Metadata md = RawMetadata("v2-as-v1");
  CHECK(md.format_version == 1);
  CHECK(md.files.empty());
  CHECK(md.storage.size() == kTensors * 3 + 2);
  for (const auto& [fqn, e] : md.entries) {
    if (const auto* t = std::get_if<TensorMetadata>(&e)) CHECK_FALSE(t->regular);
  }
  LoadColumnsAndCheck("v2-as-v1", 2);
  ClearMemStore("v2-as-v1");
}

TEST_CASE("metadata v2: the metadata does not grow with the world", "[metadata-v2]") {
  // Without the index copies a small checkpoint's metadata carries (bounded by
  // kMetadataIndexCopyBytes at any world size: the next test).
  auto size_at = [](int world, uint32_t version) {
    SaveAt("v2-growth", world, version);
    Metadata md = RawMetadata("v2-growth");
    for (DataFile& f : md.files) f.index_copy.clear();
    ClearMemStore("v2-growth");
    return static_cast<uint64_t>(EncodeMetadataFile(md).size());
  };
  const uint64_t v2_small = size_at(2, 2), v2_large = size_at(8, 2);
  const uint64_t v1_small = size_at(2, 1), v1_large = size_at(8, 1);
  INFO("v1: " << v1_small << " -> " << v1_large << " bytes; v2: " << v2_small << " -> "
              << v2_large);
  // 6 more ranks: v2 adds 6 file-table rows; v1 adds 6 chunks and items per tensor.
  CHECK(v2_large - v2_small < 6 * 120);
  CHECK(v1_large - v1_small > 6 * kTensors * 60);
  CHECK(v2_large < v1_large / 3);
}

TEST_CASE(
    "metadata v2: a small checkpoint's metadata carries its files' indexes so a load reads none "
    "and past its share of the budget a rank's are read from its files",
    "[metadata-v2]") {
  SaveAt("v2-copies", 4, 2);
  const Metadata md = RawMetadata("v2-copies");
  auto store = MakeMemStore("v2-copies");
  REQUIRE(md.files.size() == 4);
  for (const DataFile& f : md.files) {
    INFO(f.name);
    CHECK(f.index_copy ==
          store->ReadAll(f.name, UINT64_MAX).substr(f.index_offset, f.index_length));
  }
  // Every file's own index damaged: a load takes the metadata's copies and reads none (before,
  // it read each one and failed its checksum); every value still checks out.
  for (const DataFile& f : md.files) {
    std::string bytes = store->ReadAll(f.name, UINT64_MAX);
    bytes[f.index_offset + 20] ^= 0x01;
    auto w = store->Create(f.name);
    w->Append(bytes.data(), bytes.size());
    w->Close();
  }
  LoadColumnsAndCheck("v2-copies", 3);
  // What inspects and verifies a checkpoint reads every file's own index, so the damage shows.
  CHECK_THROWS_WITH(ReadMetadata("mem://v2-copies"), Contains(".data") && Contains("checksum"));
  ClearMemStore("v2-copies");

  // Rank r's index copies ride along only within 1/world of the budget: 1,700 one-element
  // tensors index to 69,716 bytes, within a world of 1's share (256 KiB), over a world of 4's
  // (64 KiB), where the metadata then carries none.
  constexpr int kSmall = 1700;
  REQUIRE(kFileIndexHeaderBytes + kSmall * kFileIndexItemBytes > kMetadataIndexCopyBytes / 4);
  for (int world : {1, 4}) {
    DYNAMIC_SECTION("world " << world) {
      ClearMemStore("v2-copies");
      std::vector<std::vector<TensorView>> mine(static_cast<size_t>(world));
      RequireNoErrors(RunRanks(world, [&](int r, Communicator& comm) {
        StateDict sd;
        for (int i = 0; i < kSmall; ++i) {
          mine[static_cast<size_t>(r)].push_back(
              RandomTensor(DType::kFloat32, {1}, static_cast<uint64_t>(r * kSmall + i)));
          sd.Set("r" + std::to_string(r) + ".t" + std::to_string(i),
                 mine[static_cast<size_t>(r)].back());
        }
        Save(sd, "mem://v2-copies", comm);
      }));
      const Metadata many = RawMetadata("v2-copies");
      uint64_t copies = 0;
      for (const DataFile& f : many.files) copies += f.index_copy.size();
      if (world == 1) {
        CHECK(copies == kFileIndexHeaderBytes + kSmall * kFileIndexItemBytes);
      } else {
        CHECK(copies == 0);
      }
      // Either way the load finds every item (checked after the ranks' threads: Catch's
      // assertions are not thread-safe).
      std::vector<std::vector<TensorView>> back(static_cast<size_t>(world));
      RequireNoErrors(RunRanks(world, [&](int r, Communicator& comm) {
        StateDict sd;
        for (int i = 0; i < kSmall; ++i) {
          back[static_cast<size_t>(r)].push_back(TensorView::Allocate(DType::kFloat32, {1}));
          sd.Set("r" + std::to_string(r) + ".t" + std::to_string(i),
                 back[static_cast<size_t>(r)].back());
        }
        Load(sd, "mem://v2-copies", comm);
      }));
      for (size_t r = 0; r < back.size(); ++r) {
        REQUIRE(back[r].size() == mine[r].size());
        for (size_t i = 0; i < back[r].size(); ++i) {
          INFO("rank " << r << " item " << i);
          REQUIRE(SameElements(back[r][i], mine[r][i]));
        }
      }
    }
  }
  ClearMemStore("v2-copies");
}

TEST_CASE("metadata v2: a rule's chunks, overlaps and ordinals match its listed chunks",
          "[metadata-v2]") {
  for (RegularRule rule : {kRuleBalanced, kRuleCeil}) {
    for (int64_t n : {1, 3, 7, 64, 1000}) {
      for (int world : {1, 2, 3, 8, 64}) {
        if (rule == kRuleCeil && n >= world && (world - 1) * ((n + world - 1) / world) >= n)
          continue;  // not a valid ceil rule (some rank empty)
        TensorMetadata t(DType::kInt8, {n, 3});
        t.regular = RegularLayout{0, rule, world};
        const TensorMetadata listed = WithListedChunks(t);
        INFO("rule " << int(rule) << " n " << n << " world " << world);
        REQUIRE(listed.chunks.size() == ChunkCount(t));
        for (size_t k = 0; k < listed.chunks.size(); ++k) {
          CHECK(listed.chunks[k].numel() > 0);
          CHECK(ChunkOrdinal(t, listed.chunks[k].offsets) == k);
          CHECK(ChunkWriter(t, k) == static_cast<int32_t>(k));
        }
        CHECK_FALSE(ChunkOrdinal(t, {0, 1}));
        // The overlap range of every row window equals the brute-force answer.
        for (int64_t b = 0; b < n; ++b) {
          for (int64_t e = b + 1; e <= n; e += std::max<int64_t>(1, n / 7)) {
            auto [first, last] = RegularChunkRange(t, b, e);
            size_t lo = listed.chunks.size(), hi = 0;
            for (size_t k = 0; k < listed.chunks.size(); ++k) {
              const int64_t cb = listed.chunks[k].offsets[0];
              const int64_t ce = cb + listed.chunks[k].sizes[0];
              if (cb < e && b < ce) lo = std::min(lo, k), hi = k + 1;
            }
            CHECK(first == lo);
            CHECK(last == hi);
          }
        }
      }
    }
  }
}

TEST_CASE("metadata v2: a load plan of a rule touches only the chunks it overlaps",
          "[metadata-v2]") {
  // 1,000,000 ranks' chunks described by one rule: a load of 2 rows plans 2 reads at once.
  Metadata md;
  md.format_version = 2;
  md.world_size = 1000000;
  TensorMetadata t(DType::kFloat32, {3000000, 2});
  t.regular = RegularLayout{0, kRuleBalanced, 1000000};
  md.entries["w"] = t;
  StateDict sd;
  TensorView mine = TensorView::Allocate(DType::kFloat32, {2, 2});
  sd.Set("w", ShardedTensor{DType::kFloat32, {3000000, 2}, {{mine, {3, 0}}}});
  DefaultLoadPlanner planner;
  const auto start = std::chrono::steady_clock::now();
  planner.SetUp(sd, md, PlannerContext{0, 1, true});
  const LoadPlan plan = planner.CreateLocalPlan();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  REQUIRE(plan.items.size() == 1);  // rows 3-4 lie in rank 1's slice [3, 6)
  CHECK(plan.items[0].storage_index.index == 1);
  CHECK(s < 1.0);
}

TEST_CASE("metadata v2: hostile file tables, indexes and rules are refused, naming the file",
          "[metadata-v2][hostile]") {
  SaveAt("v2-hostile", 2, 2);
  const Metadata good = RawMetadata("v2-hostile");
  REQUIRE_FALSE(good.files.at(0).index_copy.empty());
  // The same table without the index copies: a load then reads each file's own index.
  Metadata bare = good;
  for (DataFile& f : bare.files) f.index_copy.clear();
  auto store = MakeMemStore("v2-hostile");
  const DataFile f0 = good.files.at(0);
  const std::string data0 = store->ReadAll(f0.name, UINT64_MAX);
  auto rewrite = [&](const std::string& bytes) {
    auto w = store->Create(f0.name);
    w->Append(bytes.data(), bytes.size());
    w->Close();
  };
  auto restore = [&] {
    rewrite(data0);
    Publish("v2-hostile", good);
  };
  REQUIRE(LoadError("v2-hostile") == "the load succeeded");

  SECTION("a damaged index fails its checksum") {
    std::string bad = data0;
    bad[f0.index_offset + 20] ^= 0x01;
    rewrite(bad);
    Publish("v2-hostile", bare);
    CHECK_THAT(LoadError("v2-hostile"), Contains(f0.name) && Contains("checksum"));
  }
  SECTION("a damaged copy of an index in the metadata fails its checksum") {
    Metadata md = good;
    md.files[0].index_copy[20] ^= 0x01;
    Publish("v2-hostile", md);
    CHECK_THAT(LoadError("v2-hostile"), Contains(f0.name) && Contains("copy of its index"));
    md.files[0].index_copy.pop_back();
    Publish("v2-hostile", md);
    CHECK_THAT(LoadError("v2-hostile"), Contains(f0.name) && Contains("copy of its index"));
  }
  SECTION("a copy of an index that differs from the file's own, with a forged checksum") {
    // Item 0's checksum flag cleared (a load would no longer check it) and the 4 bytes of its
    // now unused checksum field set so that the whole copy keeps the file table's CRC32C: a
    // CRC is no proof. Verify (ReadMetadata reads every file's own index) must refuse what a
    // load would resolve differently.
    std::string forged = good.files[0].index_copy;
    const size_t item0 = kFileIndexHeaderBytes, field = item0 + 36;
    REQUIRE(forged.size() >= item0 + kFileIndexItemBytes);
    REQUIRE((forged[item0 + 40] & 1) == 1);
    forged[item0 + 40] = static_cast<char>(forged[item0 + 40] & ~1);
    const uint32_t want = f0.index_crc32c;
    // CRC32C is affine over GF(2): solve for the 32 bits of the free field.
    auto crc_with = [&](uint32_t v) {
      std::string b = forged;
      for (int k = 0; k < 4; ++k) b[field + k] = static_cast<char>(v >> (8 * k));
      return Crc32c(0, b.data(), b.size());
    };
    const uint32_t base = crc_with(0);
    std::vector<std::pair<uint32_t, uint32_t>> rows;  // (crc delta, bits that make it)
    for (int bit = 0; bit < 32; ++bit) rows.push_back({crc_with(1u << bit) ^ base, 1u << bit});
    uint32_t need = base ^ want, value = 0;
    for (int bit = 31; bit >= 0; --bit) {  // Gaussian elimination on the deltas
      auto pivot = std::find_if(rows.begin(), rows.end(),
                                [&](const auto& r) { return (r.first >> bit) & 1; });
      if (pivot == rows.end()) continue;
      const auto p = *pivot;
      rows.erase(pivot);
      for (auto& r : rows) {
        if ((r.first >> bit) & 1) r.first ^= p.first, r.second ^= p.second;
      }
      if ((need >> bit) & 1) need ^= p.first, value ^= p.second;
    }
    REQUIRE(need == 0);
    for (int k = 0; k < 4; ++k) forged[field + k] = static_cast<char>(value >> (8 * k));
    REQUIRE(Crc32c(0, forged.data(), forged.size()) == want);
    REQUIRE(forged != good.files[0].index_copy);
    Metadata md = good;
    md.files[0].index_copy = forged;
    Publish("v2-hostile", md);
    CHECK_THROWS_WITH(ReadMetadata("mem://v2-hostile"),
                      Contains(f0.name) && Contains("differs from the file's own index"));
  }
  SECTION("an index that lists nothing (with a matching checksum) leaves items unfound") {
    const std::string empty = EncodeFileIndex({});
    Metadata md = bare;
    md.files[0].index_length = empty.size();
    md.files[0].index_crc32c = Crc32c(0, empty.data(), empty.size());
    md.files[0].size = f0.index_offset + empty.size();
    rewrite(data0.substr(0, f0.index_offset) + empty);
    Publish("v2-hostile", md);
    CHECK_THAT(LoadError("v2-hostile"), Contains("holds no item") && Contains(f0.name));
    // One item short of what the metadata attributes to rank 0: refused from the counts,
    // before any index is read.
    auto items =
        DecodeFileIndex(data0.substr(f0.index_offset, f0.index_length), f0.index_offset, "x");
    items.pop_back();
    const std::string shorter = EncodeFileIndex(items);
    md.files[0].index_length = shorter.size();
    md.files[0].index_crc32c = Crc32c(0, shorter.data(), shorter.size());
    md.files[0].size = f0.index_offset + shorter.size();
    rewrite(data0.substr(0, f0.index_offset) + shorter);
    Publish("v2-hostile", md);
    CHECK_THAT(LoadError("v2-hostile"),
               Contains("rank 0") && Contains(f0.name) && Contains("attributes"));
  }
  SECTION("an index may claim no more items than the metadata attributes to its writer") {
    // A sparse file with a 1 GiB "index": refused from the counts, before it is read (or its
    // length allocated), by every tool.
    Metadata md = bare;
    const uint64_t items = (uint64_t{1} << 30) / kFileIndexItemBytes;
    md.files[0].index_length = kFileIndexHeaderBytes + items * kFileIndexItemBytes;
    md.files[0].size = md.files[0].index_offset + md.files[0].index_length;
    REQUIRE_THROWS_WITH(ValidateMetadata(md, "test"),
                        Contains(f0.name) && Contains(std::to_string(items) + " items") &&
                            Contains("rank 0") && Contains("attributes"));
    Publish("v2-hostile", md);
    CHECK_THAT(LoadError("v2-hostile"), Contains(f0.name) && Contains("attributes"));
  }
  SECTION("a rule's chunks may not exceed the data files stored (no span expanded first)") {
    // 189 bytes of metadata once claimed 2^31 chunks; a full load made a read item per chunk
    // before checking any. Every chunk k of a rule is rank k's, so it needs rank k's files.
    // Zero bytes of elements: the stored bytes bound nothing here.
    Metadata md = good;
    md.world_size = int32_t{1} << 30;
    for (auto& [fqn, e] : md.entries) {
      auto* t = std::get_if<TensorMetadata>(&e);
      if (t != nullptr && t->regular) t->regular->world = md.world_size;
    }
    std::get<TensorMetadata>(md.entries.at("layer3.w")).shape = {int64_t{1} << 30, 0};
    const auto start = std::chrono::steady_clock::now();
    REQUIRE_THROWS_WITH(ValidateMetadata(md, "test"),
                        Contains("layer3.w") &&
                            Contains(std::to_string(1 << 30) + " stored chunks") &&
                            Contains("exceed what is stored"));
    Publish("v2-hostile", md);
    CHECK_THAT(LoadError("v2-hostile"), Contains("layer3.w") && Contains("exceed what is stored"));
    CHECK_THROWS_WITH(ReadMetadata("mem://v2-hostile"), Contains("exceed what is stored"));
    CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < 2.0);
  }
  SECTION("an index whose items run into the index or overlap is refused") {
    auto items =
        DecodeFileIndex(data0.substr(f0.index_offset, f0.index_length), f0.index_offset, "x");
    REQUIRE(items.size() >= 2);
    for (int variant = 0; variant < 2; ++variant) {
      auto edited = items;
      if (variant == 0) edited[0].offset = f0.index_offset - edited[0].length + 1;
      if (variant == 1) edited[1].offset = edited[0].offset, edited[1].length = edited[0].length;
      for (auto& it : edited) it.raw_length = it.zstd ? it.raw_length : it.length;
      const std::string idx = EncodeFileIndex(edited);
      Metadata md = bare;
      md.files[0].index_crc32c = Crc32c(0, idx.data(), idx.size());
      rewrite(data0.substr(0, f0.index_offset) + idx);
      Publish("v2-hostile", md);
      CHECK_THAT(LoadError("v2-hostile"),
                 Contains(f0.name) && (Contains("runs past") || Contains("overlap")));
      // The same index as the metadata's copy (its checksum recorded too) passes the same
      // checks, whatever the file holds.
      rewrite(data0);
      md.files[0].index_copy = idx;
      Publish("v2-hostile", md);
      CHECK_THAT(LoadError("v2-hostile"),
                 Contains(f0.name) && (Contains("runs past") || Contains("overlap")));
    }
  }
  SECTION("two files whose indexes list the same item") {
    // Rank 1's file replaced by a copy of rank 0's (its own table row kept consistent).
    const DataFile f1 = good.files.at(1);
    const std::string data1 = store->ReadAll(f1.name, UINT64_MAX);
    auto put1 = [&](const std::string& bytes) {
      auto w = store->Create(f1.name);
      w->Append(bytes.data(), bytes.size());
      w->Close();
    };
    put1(data0);
    Metadata md = good;
    md.files[1] = f0;
    md.files[1].name = f1.name;
    md.files[1].writer = 1;
    Publish("v2-hostile", md);
    CHECK_THAT(LoadError("v2-hostile"), Contains("listed by the indexes of both"));
    put1(data1);
  }
  SECTION("file table rows outside their file, repeated or of unknown writers") {
    Metadata md = good;
    md.files[0].index_offset = md.files[0].size;
    Publish("v2-hostile", md);
    CHECK_THAT(LoadError("v2-hostile"), Contains(f0.name) && Contains("outside"));
    md = good;
    md.files[0].index_length += 5;
    Publish("v2-hostile", md);
    CHECK_THAT(LoadError("v2-hostile"), Contains(f0.name));
    md = good;
    md.files[1].name = md.files[0].name;
    Publish("v2-hostile", md);
    CHECK_THAT(LoadError("v2-hostile"), Contains("listed twice"));
    md = good;
    md.files[1].writer = 7;
    Publish("v2-hostile", md);
    CHECK_THAT(LoadError("v2-hostile"), Contains("writer rank 7"));
  }
  SECTION("rules that claim 10^12 shards cost nothing and are refused") {
    Metadata md = good;
    auto& t = std::get<TensorMetadata>(md.entries.at("layer3.w"));
    t.shape = {1000000000000, 24};
    t.regular->world = 1000000000;
    const auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH(ValidateMetadata(md, "test"), Contains("layer3.w") && Contains("split over"));
    // A valid rule over a shape the data files cannot back: refused before anything is
    // allocated or read.
    md = good;
    std::get<TensorMetadata>(md.entries.at("layer3.w")).shape = {2000000000, 24};
    Publish("v2-hostile", md);
    CHECK_THAT(LoadError("v2-hostile"), Contains("more bytes"));
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CHECK(s < 2.0);
    md = good;
    std::get<TensorMetadata>(md.entries.at("layer3.w")).regular->dim = 5;
    CHECK_THROWS_WITH(ValidateMetadata(md, "test"), Contains("dimension 5"));
    md = good;
    std::get<TensorMetadata>(md.entries.at("layer3.w")).regular->rule = static_cast<RegularRule>(7);
    CHECK_THROWS_WITH(ValidateMetadata(md, "test"), Contains("unknown sharding rule"));
  }
  SECTION("a version-2 document that lists items, or a version-1 one with a file table") {
    Metadata md = ReadMetadata("mem://v2-hostile");  // with its items
    CHECK_FALSE(md.storage.empty());
    CHECK(DecodeMetadata(EncodeMetadata(md), "test").storage.empty());  // kept in the indexes
    md.format_version = 1;
    Metadata v1 = md;
    v1.files = good.files;
    CHECK_THROWS_WITH(ValidateMetadata(v1, "test"), Contains("file table"));
  }
  restore();
  CHECK(LoadError("v2-hostile") == "the load succeeded");
  ClearMemStore("v2-hostile");
}

TEST_CASE("metadata v2: a rule plans the same reads as its listed chunks", "[metadata-v2]") {
  for (RegularRule rule : {kRuleBalanced, kRuleCeil}) {
    for (int world : {1, 3, 5, 16}) {
      Metadata ruled;
      ruled.world_size = world;
      TensorMetadata t(DType::kFloat32, {37, 6, 4});
      t.regular = RegularLayout{0, rule, world};
      ruled.entries["w"] = t;
      Metadata listed = ruled;
      listed.entries["w"] = WithListedChunks(t);
      // Wanted: a 3 x 2 grid of boxes over dims 0 and 1 (a reshard into another layout).
      for (int part = 0; part < 6; ++part) {
        auto [r0, r1] = RowRange(37, part / 2, 3);
        auto [c0, c1] = RowRange(6, part % 2, 2);
        TensorView mine = TensorView::Allocate(DType::kFloat32, {r1 - r0, c1 - c0, 4});
        StateDict sd;
        sd.Set("w", ShardedTensor{DType::kFloat32, {37, 6, 4}, {{mine, {r0, c0, 0}}}});
        auto plan_of = [&](const Metadata& md) {
          DefaultLoadPlanner planner;
          planner.SetUp(sd, md, PlannerContext{0, 1, true});
          return planner.CreateLocalPlan();
        };
        // The rule's plan reads each wanted box in one item (a span over the chunks it
        // reaches); expanded, it is the listed chunks' plan item for item.
        const LoadPlan spans = plan_of(ruled);
        INFO("rule " << int(rule) << " world " << world << " part " << part);
        CHECK(spans.items.size() == 1);
        const auto a = ExpandChunkSpans(spans, ruled).items, b = plan_of(listed).items;
        CHECK(spans.items[0].chunk_span == std::max<size_t>(a.size(), 1));
        REQUIRE(a.size() == b.size());
        for (size_t i = 0; i < a.size(); ++i) {
          CHECK(a[i].storage_index == b[i].storage_index);
          CHECK(a[i].storage_index.index == b[i].storage_index.index);
          CHECK(a[i].dest_index == b[i].dest_index);
          CHECK(a[i].dest_offsets == b[i].dest_offsets);
          CHECK(a[i].storage_offsets == b[i].storage_offsets);
          CHECK(a[i].lengths == b[i].lengths);
          CHECK(a[i].chunk_span == 1);
          CHECK(b[i].chunk_span == 1);
        }
      }
    }
  }
}

TEST_CASE("metadata v2: a box across every rank's chunk plans as one span and expands exactly",
          "[metadata-v2][scale]") {
  // An all-to-all reshard: a column slice of a tensor row-sharded over 100,000 ranks reaches
  // every chunk. It plans as one item; the read expands it into one item per chunk.
  constexpr int kWorld = 100000;
  Metadata md;
  md.format_version = 2;
  md.world_size = kWorld;
  TensorMetadata t(DType::kFloat32, {300007, 8});
  t.regular = RegularLayout{0, kRuleCeil, kWorld};
  md.entries["w"] = t;
  md.entries["listed"] = TensorMetadata(DType::kFloat32, {4, 8}, {{{0, 0}, {4, 8}}});
  StateDict sd;
  TensorView mine = TensorView::Allocate(DType::kFloat32, {300007, 3});
  sd.Set("w", ShardedTensor{DType::kFloat32, {300007, 8}, {{mine, {0, 5}}}});
  DefaultLoadPlanner planner;
  planner.SetUp(sd, md, PlannerContext{0, 1, true});
  const LoadPlan plan = planner.CreateLocalPlan();
  REQUIRE(plan.items.size() == 1);
  const ReadItem& span = plan.items[0];
  // Under the ceil rule the last ranks' slices are empty: 75,002 chunks hold rows.
  size_t chunks = 0;
  while (chunks < ChunkCount(t) && ChunkAt(t, chunks).sizes[0] > 0) ++chunks;
  CHECK(chunks == 75002);
  CHECK(span.chunk_span == chunks);
  CHECK(DecodeLoadPlan(EncodeLoadPlan(plan)).items.at(0).chunk_span == span.chunk_span);

  const LoadPlan pieces = ExpandChunkSpans(plan, md);
  REQUIRE(pieces.items.size() == chunks);
  int64_t rows = 0;
  for (size_t k = 0; k < chunks; ++k) {
    const ReadItem& p = pieces.items[k];
    const ChunkMeta c = ChunkAt(t, k);
    REQUIRE(p.storage_index.index == static_cast<int32_t>(k));
    REQUIRE(p.storage_index.offset == c.offsets);
    REQUIRE(p.dest_offsets == Shape{rows, 0});
    REQUIRE(p.storage_offsets == Shape{0, 5});
    REQUIRE(p.lengths == Shape{c.sizes[0], 3});
    rows += c.sizes[0];
  }
  CHECK(rows == 300007);

  // A load expands a bounded part at a time: the parts, in order, are the expansion, every field
  // of every item (a part's items are written over the last part's: nothing of them may stay).
  LoadPlan three = plan;
  ReadItem plain = pieces.items[7];  // a plain item of other offsets and lengths, between spans
  plain.lengths[1] = 1;
  plain.storage_offsets[1] = 2;
  plain.dest_index.fqn = "another";
  three.items.push_back(plain);
  three.items.push_back(plan.items[0]);
  three.items.push_back(plan.items[0]);
  three.planner_data = "p";
  auto same = [](const ReadItem& a, const ReadItem& b) {
    return a.type == b.type && a.dest_index == b.dest_index && a.dest_offsets == b.dest_offsets &&
           a.storage_index == b.storage_index && a.storage_index.index == b.storage_index.index &&
           a.storage_offsets == b.storage_offsets && a.lengths == b.lengths &&
           a.chunk_span == b.chunk_span;
  };
  for (size_t max_items : {size_t{1}, size_t{1000}, size_t{75002}, kMaxExpandedItems}) {
    INFO("parts of " << max_items);
    std::vector<size_t> sizes;
    size_t at = 0;
    const LoadPlan all = ExpandChunkSpans(three, md);
    ForEachExpandedPart(three, md, max_items, [&](const LoadPlan& part) {
      CHECK(part.planner_data == "p");
      sizes.push_back(part.items.size());
      for (const ReadItem& p : part.items) {
        REQUIRE(at < all.items.size());
        REQUIRE(same(p, all.items[at++]));
      }
    });
    CHECK(at == all.items.size());
    CHECK(all.items.size() == 3 * chunks + 1);
    // One span adds at most its chunks past the bound.
    for (size_t n : sizes) CHECK(n < std::max<size_t>(max_items, 1) + chunks);
    CHECK(sizes.size() == (max_items == 1 ? 4 : max_items > 3 * chunks ? 1 : 3));
  }
  size_t calls = 0;
  ForEachExpandedPart(LoadPlan{}, md, 10, [&](const LoadPlan& part) {
    CHECK(part.items.empty());
    ++calls;
  });
  CHECK(calls == 1);  // a load with nothing to read still reads once

  // Spans that do not fit what the metadata stores are refused, naming the tensor.
  auto expand = [&](ReadItem item) {
    LoadPlan p;
    p.items.push_back(std::move(item));
    return ExpandChunkSpans(std::move(p), md);
  };
  ReadItem bad = span;
  bad.chunk_span = kWorld + 1;
  CHECK_THROWS_WITH(expand(bad), Contains("'w'") && Contains("chunks 0 to"));
  bad.chunk_span = 4000000000u;  // refused before anything is reserved for its pieces
  CHECK_THROWS_WITH(expand(bad), Contains("'w'") && Contains("chunks 0 to"));
  bad = span;
  bad.storage_index.index = kWorld - 1;
  CHECK_THROWS_WITH(expand(bad), Contains("'w'") && Contains("of 100000"));
  bad = span;
  bad.storage_offsets[1] = 6;
  CHECK_THROWS_WITH(expand(bad), Contains("'w'") && Contains("outside"));
  bad = span;
  bad.chunk_span = 2;  // the column slice's rows do not fit in the first two chunks
  CHECK_THROWS_WITH(expand(bad), Contains("outside"));
  bad = span;
  bad.storage_index.fqn = "listed";
  CHECK_THROWS_WITH(expand(bad), Contains("'listed'") && Contains("not stored by a rule"));
  bad.storage_index.fqn = "absent";
  CHECK_THROWS_WITH(expand(bad), Contains("'absent'") && Contains("no such tensor"));
  bad = span;
  bad.lengths.pop_back();
  CHECK_THROWS_WITH(expand(bad), Contains("wrong rank"));
}

#ifdef DCP_CLI
TEST_CASE(
    "metadata v2: verify refuses a checkpoint whose file table lists a missing file, as a "
    "load does",
    "[metadata-v2][hostile]") {
  TempDir dir("v2-missing-file");
  TensorView w = RandomTensor(DType::kFloat32, {16}, 3);
  StateDict sd;
  sd.Set("w", w);
  Save(sd, dir.path());
  auto store = MakeFileStore(dir.path());
  Metadata md = DecodeMetadataFile(store->ReadAll(kMetadataName, UINT64_MAX), "test");
  REQUIRE(md.format_version >= 2);
  // A row for a file that is not there, whose index claims an item more than the metadata
  // attributes to its writer: refused from the counts alone, naming it, by both.
  DataFile extra = md.files.at(0);
  extra.name = "data-00000000000000aa-r0-b9.data";
  extra.index_copy.clear();
  md.files.push_back(extra);
  store->PublishAtomically(kMetadataName, EncodeMetadataFile(md));
  StateDict back;
  TensorView into = TensorView::Allocate(DType::kFloat32, {16});
  back.Set("w", into);
  CHECK_THROWS_WITH(Load(back, dir.path()), Contains(extra.name));
  const std::string log = dir.path() + "/verify.log";
  const int status =
      std::system((std::string(DCP_CLI) + " verify " + dir.path() + " > " + log + " 2>&1").c_str());
  std::stringstream out;
  out << std::ifstream(log).rdbuf();
  INFO(out.str());
  CHECK(WEXITSTATUS(status) != 0);  // before: 0, "OK"
  CHECK_THAT(out.str(), Contains("'" + extra.name + "'") && Contains("attributes 1"));
}
#endif
