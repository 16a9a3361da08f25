// Per-block CRC32Cs (docs/FORMAT.md, block table): a partial read verifies exactly the blocks its
// byte runs touch, reads at most a block more at each end of a run, and checkpoints without
// block CRCs load as before.
#include <catch2/catch.hpp>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "dcp/checkpoint.h"
#include "dcp/proto/checksum.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/storage/backends/mem_store.h"
#include "dcp/storage/checkpoint/store_checkpoint.h"
#include "dcp/storage/format/dcp_index.h"
#include "dcp/storage/format/dcp_layout.h"
#include "dcp/storage/sibling_store.h"
#include "dcp/storage/store.h"
#include "support/test_support.h"

using namespace dcp;
using Catch::Matchers::Contains;
using dcp::testing::RandomTensor;
using dcp::testing::RequireNoErrors;
using dcp::testing::RunRanks;
using dcp::testing::SameElements;

namespace {

// One tensor "w" of 18 rows of 1 KiB: 4.5 blocks of 4 KiB (the last one short).
constexpr int64_t kRows = 18, kCols = 256;
constexpr uint64_t kRow = kCols * 4, kBlock = 4096, kItem = kRows * kRow;

// Counts the bytes read from data files.
class CountingStore : public ForwardingStore {
 public:
  using ForwardingStore::ForwardingStore;
  std::unique_ptr<ReadableObject> Open(const std::string& n) override {
    struct Obj : ForwardingReadableObject {
      Obj(std::unique_ptr<ReadableObject> in, CountingStore* o, bool data)
          : ForwardingReadableObject(std::move(in)), owner(o), data(data) {}
      void ReadAt(uint64_t off, void* dst, size_t n) override {
        if (data) owner->Record(n);
        ForwardingReadableObject::ReadAt(off, dst, n);
      }
      CountingStore* owner;
      bool data;
    };
    return std::make_unique<Obj>(ForwardingStore::Open(n), this, IsDataObjectName(n));
  }
  void Record(size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    data_read += n;
  }
  uint64_t data_read = 0;

 private:
  std::mutex mu_;
};

std::string DataFileOf(const std::string& name) {
  for (const auto& n : MakeMemStore(name)->List()) {
    if (IsDataObjectName(n)) return n;
  }
  FAIL("no data file");
  return {};
}

void Rewrite(const std::string& name, const std::string& file, const std::string& bytes) {
  auto w = MakeMemStore(name)->Create(file);
  w->Append(bytes.data(), bytes.size());
  w->Close();
}

Metadata RawMetadata(const std::string& name) {
  return DecodeMetadataFile(MakeMemStore(name)->ReadAll(kMetadataName, UINT64_MAX), "test");
}

void Publish(const std::string& name, const Metadata& md) {
  MakeMemStore(name)->PublishAtomically(kMetadataName, EncodeMetadataFile(md));
}

TensorView SaveW(const std::string& name, StorageOptions so, bool compressible = false) {
  ClearMemStore(name);
  TensorView ref = RandomTensor(DType::kFloat32, {kRows, kCols}, 9);
  if (compressible) {
    auto* p = static_cast<float*>(ref.data);
    for (int64_t i = 0; i < kRows * kCols; ++i) p[i] = static_cast<float>(i % 13);
  }
  StateDict sd;
  sd.Set("w", ref);
  SaveOptions o;
  o.storage = so;
  Save(sd, "mem://" + name, o);
  return ref;
}

StorageOptions SmallBlocks() {
  StorageOptions so;
  so.checksum_block_bytes = kBlock;
  return so;
}

struct Box {
  int64_t r0, r1, c0, c1;
};

// Load the boxes of "w" from `store` in one load on one read thread; returns the data bytes
// `counted` recorded.
uint64_t LoadBoxesFrom(std::shared_ptr<Store> store, const std::vector<Box>& boxes,
                       std::vector<TensorView>& out, StorageOptions so,
                       const std::function<uint64_t()>& counted) {
  so.read_threads = 1;
  out.clear();
  std::vector<Shard> shards;
  for (const Box& b : boxes) {
    out.push_back(TensorView::Allocate(DType::kFloat32, {b.r1 - b.r0, b.c1 - b.c0}));
    shards.push_back({out.back(), {b.r0, b.c0}});
  }
  StateDict sd;
  sd.Set("w", ShardedTensor{DType::kFloat32, {kRows, kCols}, shards});
  std::exception_ptr error;
  RequireNoErrors(RunRanks(1, [&](int, Communicator& comm) {
    auto reader = MakeStoreReader(store, so);
    LoadOptions lo;
    lo.storage = so;
    try {
      Load(sd, *reader, comm, lo);
    } catch (...) {
      error = std::current_exception();
    }
  }));
  if (error) std::rethrow_exception(error);
  return counted();
}

uint64_t LoadBoxes(const std::string& name, const std::vector<Box>& boxes,
                   std::vector<TensorView>& out, StorageOptions so = {}) {
  auto store = std::make_shared<CountingStore>(MakeMemStore(name));
  return LoadBoxesFrom(store, boxes, out, so, [&] { return store->data_read; });
}

// LoadBoxes from checkpoint "<parent>/<name>" whose data files may lie in its siblings': the
// bytes read from its own data files and its siblings' together.
uint64_t LoadBoxesWithSiblings(const std::string& parent, const std::string& name,
                               const std::vector<Box>& boxes, std::vector<TensorView>& out,
                               StorageOptions so = {}) {
  auto own = std::make_shared<CountingStore>(MakeMemStore(parent + "/" + name));
  std::vector<std::shared_ptr<CountingStore>> siblings;
  auto store = std::make_shared<SiblingStore>(own, [&](const std::string& sibling) {
    siblings.push_back(std::make_shared<CountingStore>(MakeMemStore(parent + "/" + sibling)));
    return siblings.back();
  });
  return LoadBoxesFrom(store, boxes, out, so, [&] {
    uint64_t n = own->data_read;
    for (const auto& s : siblings) n += s->data_read;
    return n;
  });
}

bool Touches(const Box& b, uint64_t block) {
  const uint64_t lo = b.r0 * kRow, hi = b.r1 * kRow;
  const uint64_t blo = block * kBlock, bhi = std::min(kItem, blo + kBlock);
  return lo < bhi && blo < hi;
}

}  // namespace

TEST_CASE("block CRCs: a flipped byte is caught by every partial read that touches its block",
          "[block-crc][reader][option:StorageOptions::checksum_block_bytes]") {
  const std::string name = "blockcrc-flip";
  const TensorView ref = SaveW(name, SmallBlocks());
  const std::string file = DataFileOf(name);
  const std::string good = MakeMemStore(name)->ReadAll(file, UINT64_MAX);
  REQUIRE(RawMetadata(name).files.at(0).block_table_length == kBlockTableHeaderBytes + 4 * 5);
  const std::vector<Box> boxes = {{1, 3, 0, kCols},    // rows within block 0, starting mid-block
                                  {3, 9, 0, kCols},    // blocks 0-2, beginning and ending mid-block
                                  {13, 18, 0, kCols},  // blocks 3-4 (the short last one)
                                  {10, 11, 0, kCols},  // a single row (block 2)
                                  {6, 7, 5, 9},        // a few elements of one row (block 1)
                                  {5, 11, 64, 128},    // a column block of rows 5-10 (blocks 1-2)
                                  {0, kRows, 0, 64},   // a column block of every row
                                  {0, kRows, 0, kCols}};  // the whole chunk
  for (uint64_t block = 0; block < 5; ++block) {
    const uint64_t end = std::min(kItem, (block + 1) * kBlock);
    for (uint64_t at : {block * kBlock, block * kBlock + (end - block * kBlock) / 2, end - 1}) {
      std::string bad = good;
      bad[at] ^= 0x20;  // the item starts the file
      Rewrite(name, file, bad);
      for (const Box& b : boxes) {
        DYNAMIC_SECTION("flip at " << at << " box rows " << b.r0 << "-" << b.r1 << " cols " << b.c0
                                   << "-" << b.c1) {
          std::vector<TensorView> out;
          if (Touches(b, block)) {
            CHECK_THROWS_WITH(LoadBoxes(name, {b}, out),
                              Contains("checksum mismatch") && Contains("w") && Contains(file));
          } else {
            LoadBoxes(name, {b}, out);
            CHECK(SameElements(out[0], ref.Narrow({b.r0, b.c0}, {b.r1 - b.r0, b.c1 - b.c0})));
          }
        }
      }
    }
  }
  // Two partial reads of the item in one load, on one thread: the second checks its own block.
  std::string bad = good;
  bad[3 * kBlock + 7] ^= 1;
  Rewrite(name, file, bad);
  std::vector<TensorView> out;
  CHECK_THROWS_WITH(LoadBoxes(name, {{0, 2, 0, kCols}, {12, 14, 0, kCols}}, out),
                    Contains("checksum mismatch"));
  CHECK_NOTHROW(LoadBoxes(name, {{0, 2, 0, kCols}, {16, 18, 0, kCols}}, out));
  CHECK(SameElements(out[1], ref.Narrow({16, 0}, {2, kCols})));
  ClearMemStore(name);
}

TEST_CASE("block CRCs: a partial read reads its runs and at most a block of slack at each end",
          "[block-crc][reader]") {
  const std::string name = "blockcrc-bytes";
  const TensorView ref = SaveW(name, SmallBlocks());
  const uint64_t table = RawMetadata(name).files.at(0).block_table_length;
  for (const Box& b : std::vector<Box>{{1, 3, 0, kCols},
                                       {3, 9, 0, kCols},
                                       {10, 11, 0, kCols},
                                       {5, 11, 64, 128},
                                       {13, 18, 0, kCols}}) {
    std::vector<TensorView> out;
    const uint64_t read = LoadBoxes(name, {b}, out);
    CHECK(SameElements(out[0], ref.Narrow({b.r0, b.c0}, {b.r1 - b.r0, b.c1 - b.c0})));
    const uint64_t runs = (b.r1 - b.r0) * kRow;  // whole rows (ReadBox's slabs)
    CHECK(read <= runs + 2 * kBlock + table);
    CHECK(read < kItem);
    // Without verification: the runs only (no table, no slack).
    StorageOptions off;
    off.verify_checksums = false;
    CHECK(LoadBoxes(name, {b}, out, off) == runs);
  }
  ClearMemStore(name);
}

TEST_CASE("block CRCs: the block size must be 0 or a power of two from 4 KiB to 1 GiB",
          "[block-crc][option:StorageOptions::checksum_block_bytes]") {
  const std::string name = "blockcrc-option";
  for (uint64_t bad : {uint64_t{3000}, uint64_t{2048}, uint64_t{6144}, uint64_t{1} << 31}) {
    StorageOptions so;
    so.checksum_block_bytes = bad;
    CHECK_THROWS_WITH(SaveW(name, so), Contains("checksum_block_bytes"));
  }
  StorageOptions none;
  none.checksum_block_bytes = 0;
  SaveW(name, none);
  CHECK(RawMetadata(name).files.at(0).block_table_length == 0);
  SaveW(name, StorageOptions{});  // 1 MiB: the 18 KiB item is one block, listed by no entry
  CHECK(RawMetadata(name).files.at(0).block_table_length == kBlockTableHeaderBytes);
  ClearMemStore(name);
}

TEST_CASE("block CRCs: checkpoints without them load as before", "[block-crc][reader]") {
  const std::string name = "blockcrc-compat";
  const Box b{3, 9, 0, kCols};
  auto check = [&](StorageOptions so, bool strip) {
    const TensorView ref = SaveW(name, so, so.compression == Compression::kZstd);
    if (strip) {  // as a reader that does not know the table's fields sees the checkpoint
      Metadata md = RawMetadata(name);
      REQUIRE(md.files.at(0).block_table_length > 0);
      md.files[0].block_table_offset = md.files[0].block_table_length = 0;
      md.files[0].block_table_crc32c = 0;
      Publish(name, md);
    }
    std::vector<TensorView> out;
    LoadBoxes(name, {b}, out);
    CHECK(SameElements(out[0], ref.Narrow({b.r0, 0}, {b.r1 - b.r0, kCols})));
    std::vector<TensorView> whole;
    LoadBoxes(name, {{0, kRows, 0, kCols}}, whole);
    CHECK(SameElements(whole[0], ref));
  };
  SECTION("no table") {
    StorageOptions so;
    so.checksum_block_bytes = 0;
    check(so, false);
    // A partial read still verifies, by streaming the whole item: a flip far from the box is
    // caught.
    const std::string file = DataFileOf(name);
    std::string bytes = MakeMemStore(name)->ReadAll(file, UINT64_MAX);
    bytes[kItem - 1] ^= 1;
    Rewrite(name, file, bytes);
    std::vector<TensorView> out;
    CHECK_THROWS_WITH(LoadBoxes(name, {b}, out), Contains("checksum mismatch"));
  }
  SECTION("metadata version 1") {
    StorageOptions so = SmallBlocks();
    so.metadata_version = 1;
    check(so, false);
  }
  SECTION("zstd") {
    StorageOptions so = SmallBlocks();
    so.compression = Compression::kZstd;
    check(so, false);
    const Metadata md = ReadMetadata("mem://" + name);
    CHECK(md.storage.begin()->second.transforms == std::vector<std::string>{"zstd"});
    CHECK(md.files.at(0).block_table_length == kBlockTableHeaderBytes);  // lists no zstd item
  }
  SECTION("table fields stripped from the metadata") { check(SmallBlocks(), true); }
  ClearMemStore(name);
}

TEST_CASE("block CRCs: a damaged or forged block table is corruption naming the file",
          "[block-crc][reader][hostile]") {
  const std::string name = "blockcrc-hostile";
  SaveW(name, SmallBlocks());
  const std::string file = DataFileOf(name);
  const std::string good = MakeMemStore(name)->ReadAll(file, UINT64_MAX);
  const Metadata md0 = RawMetadata(name);
  const DataFile f0 = md0.files.at(0);
  const Box b{3, 9, 0, kCols};
  // Rewrite the table's bytes (and, when `fix_crc`, the metadata's CRC of them).
  auto with_table = [&](const std::function<void(std::string&)>& edit, bool fix_crc) {
    std::string bytes = good;
    std::string table = bytes.substr(f0.block_table_offset, f0.block_table_length);
    edit(table);
    bytes.replace(f0.block_table_offset, f0.block_table_length, table);
    Rewrite(name, file, bytes);
    Metadata md = md0;
    if (fix_crc) md.files[0].block_table_crc32c = Crc32c(0, table.data(), table.size());
    Publish(name, md);
  };
  auto fails = [&](const std::string& what) {
    std::vector<TensorView> out;
    CHECK_THROWS_WITH(LoadBoxes(name, {b}, out), Contains(what) && Contains(file));
  };
  SECTION("not adjacent to the index") {
    Metadata md = md0;
    md.files[0].block_table_offset -= 4;
    Publish(name, md);
    fails("block table");
  }
  SECTION("overlapping the item") {
    Metadata md = md0;
    md.files[0].block_table_offset -= 8;
    md.files[0].block_table_length += 8;
    Publish(name, md);
    fails("runs past the data");
  }
  SECTION("bad magic") {
    with_table([](std::string& t) { t[0] = 'X'; }, true);
    fails("bad magic");
  }
  SECTION("block size out of range") {
    with_table([](std::string& t) { t[8] = 11; }, true);
    fails("out of range");
  }
  SECTION("count inconsistent with the index") {
    with_table([](std::string& t) { t[8] = 13; }, true);  // 8 KiB blocks: 3, not 5
    fails("lists 5 blocks");
  }
  SECTION("table checksum mismatch") {
    with_table([](std::string& t) { t[20] ^= 1; }, false);
    fails("does not match its checksum");
  }
  SECTION("blocks that disagree with the item's crc32c") {
    // A forged table (its CRC recomputed) that passes a corrupted block 1.
    std::string bytes = good;
    bytes[kBlock + 5] ^= 1;
    Rewrite(name, file, bytes);
    std::string table = good.substr(f0.block_table_offset, f0.block_table_length);
    const uint32_t forged = Crc32c(0, bytes.data() + kBlock, kBlock);
    std::memcpy(table.data() + kBlockTableHeaderBytes + 4, &forged, 4);  // little-endian host
    bytes.replace(f0.block_table_offset, f0.block_table_length, table);
    Rewrite(name, file, bytes);
    Metadata md = md0;
    md.files[0].block_table_crc32c = Crc32c(0, table.data(), table.size());
    Publish(name, md);
    fails("disagrees with the crc32c");
    // What dcp verify, inspect and dcp::ReadMetadata read checks every table.
    CHECK_THROWS_WITH(ReadMetadata("mem://" + name), Contains("disagrees with the crc32c"));
  }
  ClearMemStore(name);
}

TEST_CASE(
    "block CRCs: a partial read of an item kept in an earlier checkpoint verifies only its blocks",
    "[block-crc][reader][incremental]") {
  const std::string parent = "blockcrc-incremental";
  StorageOptions first = SmallBlocks();
  first.content_hashes = true;
  const TensorView ref = SaveW(parent + "/s1", first);
  StorageOptions next = SmallBlocks();
  next.incremental_base = "s1";
  SaveW(parent + "/s2", next);  // the same bytes: "w" is kept in s1's file
  const std::string s1_file = DataFileOf(parent + "/s1");
  const DataFile f1 = RawMetadata(parent + "/s1").files.at(0);
  const Metadata md2 = RawMetadata(parent + "/s2");
  REQUIRE(md2.files.size() == 1);
  REQUIRE(md2.files[0].references.size() == 1);
  const DataFileReference& r = md2.files[0].references[0];
  CHECK(r.name == "../s1/" + s1_file);
  CHECK(r.size == f1.size);
  CHECK(r.index_offset == f1.index_offset);
  CHECK(r.index_length == f1.index_length);
  CHECK(r.index_crc32c == f1.index_crc32c);
  CHECK(r.block_table_offset == f1.block_table_offset);
  CHECK(r.block_table_length == f1.block_table_length);
  CHECK(r.block_table_crc32c == f1.block_table_crc32c);
  const std::vector<Box> boxes = {{1, 3, 0, kCols},   {3, 9, 0, kCols},    {13, 18, 0, kCols},
                                  {6, 7, 5, 9},       {5, 11, 64, 128},    {0, kRows, 0, 64},
                                  {10, 11, 0, kCols}, {0, kRows, 0, kCols}};
  // A partial read reads its runs, at most a block of slack at each end, and s1's table and
  // index (read with the known size, not counted here).
  for (const Box& b : boxes) {
    std::vector<TensorView> out;
    const uint64_t read = LoadBoxesWithSiblings(parent, "s2", {b}, out);
    CHECK(SameElements(out[0], ref.Narrow({b.r0, b.c0}, {b.r1 - b.r0, b.c1 - b.c0})));
    if (b.c1 - b.c0 == kCols && b.r1 - b.r0 < kRows) {
      CHECK(read <= (b.r1 - b.r0) * kRow + 2 * kBlock);
      CHECK(read < kItem);
    }
  }
  // A flipped byte in s1's file fails exactly the partial reads of s2 that touch its block.
  const std::string good = MakeMemStore(parent + "/s1")->ReadAll(s1_file, UINT64_MAX);
  for (uint64_t block = 0; block < 5; ++block) {
    std::string bad = good;
    bad[block * kBlock + 100] ^= 0x20;  // the item starts the file
    Rewrite(parent + "/s1", s1_file, bad);
    for (const Box& b : boxes) {
      DYNAMIC_SECTION("flip in block " << block << " box rows " << b.r0 << "-" << b.r1 << " cols "
                                       << b.c0 << "-" << b.c1) {
        std::vector<TensorView> out;
        if (Touches(b, block)) {
          CHECK_THROWS_WITH(LoadBoxesWithSiblings(parent, "s2", {b}, out),
                            Contains("checksum mismatch") && Contains("w") && Contains(s1_file));
        } else {
          LoadBoxesWithSiblings(parent, "s2", {b}, out);
          CHECK(SameElements(out[0], ref.Narrow({b.r0, b.c0}, {b.r1 - b.r0, b.c1 - b.c0})));
        }
      }
    }
  }
  std::string bad = good;
  bad[kItem - 1] ^= 1;  // block 4
  Rewrite(parent + "/s1", s1_file, bad);
  const Box far{1, 3, 0, kCols};
  SECTION("a reference written before it recorded the sibling's table: verified whole") {
    Metadata md = md2;
    DataFileReference& old = md.files[0].references[0];
    DataFileReference plain;
    plain.name = old.name;
    plain.size = old.size;
    old = plain;
    Publish(parent + "/s2", md);
    std::vector<TensorView> out;
    CHECK_THROWS_WITH(LoadBoxesWithSiblings(parent, "s2", {far}, out),
                      Contains("checksum mismatch"));
    Rewrite(parent + "/s1", s1_file, good);
    CHECK(LoadBoxesWithSiblings(parent, "s2", {far}, out) >= kItem);
    CHECK(SameElements(out[0], ref.Narrow({far.r0, 0}, {far.r1 - far.r0, kCols})));
  }
  SECTION("the sibling's table fails its recorded checksum") {
    Metadata md = md2;
    md.files[0].references[0].block_table_crc32c ^= 1;
    Publish(parent + "/s2", md);
    std::vector<TensorView> out;
    CHECK_THROWS_WITH(
        LoadBoxesWithSiblings(parent, "s2", {far}, out),
        Contains("block table") && Contains("does not match its checksum") && Contains(s1_file));
  }
  SECTION("the sibling's index fails its recorded checksum") {
    Metadata md = md2;
    md.files[0].references[0].index_crc32c ^= 1;
    Publish(parent + "/s2", md);
    std::vector<TensorView> out;
    CHECK_THROWS_WITH(LoadBoxesWithSiblings(parent, "s2", {far}, out),
                      Contains("index of data file") && Contains(s1_file));
  }
  SECTION("a recorded table that does not end at the recorded index is refused") {
    Metadata md = md2;
    md.files[0].references[0].block_table_offset -= 4;
    Publish(parent + "/s2", md);
    std::vector<TensorView> out;
    CHECK_THROWS_WITH(LoadBoxesWithSiblings(parent, "s2", {far}, out),
                      Contains("reference '../s1/" + s1_file + "'") && Contains("block table"));
  }
  SECTION("a sibling index that holds the item elsewhere is corruption naming it") {
    // s2's index says the item lies 4 bytes further on in s1's file (its own index rewritten,
    // with the metadata's CRC of it): s1's index, and its table, disagree.
    Rewrite(parent + "/s1", s1_file, good);
    Metadata md = md2;
    DataFile& f2 = md.files[0];
    const std::string s2_file = f2.name;
    std::string bytes = MakeMemStore(parent + "/s2")->ReadAll(s2_file, UINT64_MAX);
    std::string index = bytes.substr(f2.index_offset, f2.index_length);
    std::vector<FileIndexItem> items =
        DecodeFileIndex(index, f2.index_offset, s2_file, 3, ReferenceSizes(f2));
    REQUIRE(items.size() == 1);
    items[0].offset += 4;
    index = EncodeFileIndex(items, 3);
    REQUIRE(index.size() == f2.index_length);
    bytes.replace(f2.index_offset, f2.index_length, index);
    Rewrite(parent + "/s2", s2_file, bytes);
    f2.index_crc32c = Crc32c(0, index.data(), index.size());
    f2.index_copy.clear();
    Publish(parent + "/s2", md);
    std::vector<TensorView> out;
    CHECK_THROWS_WITH(LoadBoxesWithSiblings(parent, "s2", {far}, out),
                      Contains("does not hold 'w'") && Contains(s1_file));
  }
  ClearMemStore(parent + "/s1");
  ClearMemStore(parent + "/s2");
}
