// Cooperative reads on load (read-and-scatter, planner/coop_reads.h, dcp/protocol/coop_read.h):
// the pure planning functions, their messages, and whole loads with N ranks as threads that
// reshard a row-sharded checkpoint into column shards, counting the bytes read from storage;
// and the bulk exchange (Communicator::ExchangeBytes) the pieces travel by.
#include <catch2/catch.hpp>
#include <map>
#include <set>

#include "dcp/planner/coop_reads.h"
#include "dcp/storage/backends/fault_store.h"
#include "dcp/storage/backends/mem_store.h"
#include "dcp/storage/format/layout.h"
#include "support/test_support.h"

using namespace dcp;
using Catch::Matchers::Contains;
using dcp::testing::Clone;
using dcp::testing::RandomTensor;
using dcp::testing::RequireNoErrors;
using dcp::testing::RowRange;
using dcp::testing::RunRanks;
using dcp::testing::SameElements;

// ---------------------------------------------------------------------------------------------
// The planning functions.

TEST_CASE("coop: owners are the writers mapped onto the load's world", "[coop][read-once]") {
  Metadata md;
  md.format_version = 2;
  md.world_size = 4;
  TensorMetadata t{DType::kFloat32, {8, 4}};
  t.regular = RegularLayout{0, kRuleBalanced, 4};
  md.entries["w"] = t;
  for (int world : {4, 2, 1, 8}) {
    CoopOwners owners(md, world);
    for (int k = 0; k < 4; ++k) {
      CHECK(owners.Owner(md, {"w", {2 * k, 0}, std::nullopt}) == k * world / 4);
    }
  }
  CHECK(CoopOwners(md, 4).Owner(md, {"w", {1, 0}, std::nullopt}) == -1);  // no such chunk
  CHECK(CoopOwners(md, 4).Owner(md, {"none", {0, 0}, std::nullopt}) == -1);

  // Listed metadata: whole files, by bytes, in name order.
  Metadata v1;
  v1.entries["a"] = TensorMetadata{DType::kFloat32, {4}, {{{0}, {2}}, {{2}, {2}}}};
  auto put = [&](const Shape& off, const std::string& file, uint64_t n) {
    StorageInfo info;
    info.relative_path = file;
    info.length = n;
    v1.storage[{"a", off, std::nullopt}] = info;
  };
  put({0}, "f0", 100);
  put({2}, "f1", 10);
  CoopOwners o1(v1, 2);
  CHECK(o1.Owner(v1, {"a", {0}, std::nullopt}) == 0);
  CHECK(o1.Owner(v1, {"a", {2}, std::nullopt}) == 1);
}

TEST_CASE("coop: what a partial read costs, and when an item is scattered", "[coop][read-once]") {
  const Shape sizes{64, 1024};  // rows of 4 KiB, 256 KiB
  const uint64_t whole = 64 * 1024 * 4;
  // A column block reads every row: the item once, its CRC on the way.
  CHECK(PartialReadCost(sizes, 4, {0, 256}, {64, 256}, true) == whole);
  CHECK(PartialReadCost(sizes, 4, {0, 256}, {64, 256}, false) == whole);
  // A row range reads its rows, plus the whole item again to verify it.
  CHECK(PartialReadCost(sizes, 4, {16, 0}, {16, 1024}, false) == whole / 4);
  CHECK(PartialReadCost(sizes, 4, {16, 0}, {16, 1024}, true) == whole / 4 + whole);
  CHECK(PartialReadCost(sizes, 4, {0, 0}, sizes, true) == whole);
  CHECK(BlockAlignedPartialReadCost(sizes, 4, {16, 0}, {16, 1024}, true, 0) == whole / 4 + whole);

  CHECK_FALSE(ShouldScatter(whole, {whole}));  // one reader: nothing to share
  CHECK(ShouldScatter(whole, {whole, whole}));
  CHECK_FALSE(ShouldScatter(whole, {whole / 2, whole / 2 + 1000}));  // disjoint row ranges
  CHECK_FALSE(ShouldScatter(0, {0, 0}));

  ReadRequestSummary a, b;
  a.can_share = b.can_share = true;
  a.plan_bytes = b.plan_bytes = 1 << 20;
  CHECK_FALSE(ShouldCooperate({a, b}));
  a.coop_waste = 3 << 20;
  CHECK(ShouldCooperate({a, b}));
  b.can_share = false;
  CHECK_FALSE(ShouldCooperate({a, b}));  // one rank takes part
}

TEST_CASE("coop: a span's waste, judged chunk by chunk, is its pieces' waste",
          "[coop][read-once]") {
  Metadata md;
  md.format_version = 2;
  md.world_size = 8;
  TensorMetadata w{DType::kFloat32, {64, 4096}};  // 8 chunks of 8 rows (128 KiB each)
  w.regular = RegularLayout{0, kRuleBalanced, 8};
  TensorMetadata c{DType::kBFloat16, {61, 3000}};  // torch.chunk's rule, uneven
  c.regular = RegularLayout{0, kRuleCeil, 8};
  md.entries["w"] = w;
  md.entries["c"] = c;
  auto span = [](const std::string& fqn, int32_t first, uint32_t n, int64_t first_row, Shape off,
                 Shape len) {
    ReadItem item;
    item.dest_index = {fqn, {0, 0}, std::nullopt};
    item.dest_offsets = {0, 0};
    item.storage_index = {fqn, {first_row, 0}, first};
    item.storage_offsets = std::move(off);
    item.lengths = std::move(len);
    item.chunk_span = n;
    return item;
  };
  LoadPlan plan;
  plan.items.push_back(span("w", 0, 8, 0, {0, 100}, {64, 1000}));  // a column block: every chunk
  plan.items.push_back(span("w", 2, 4, 16, {3, 0}, {20, 4096}));   // rows across 4 chunks
  plan.items.push_back(span("c", 1, 6, 8, {5, 7}, {40, 2000}));    // uneven chunks, a box inside
  const LoadPlan pieces = ExpandChunkSpans(plan, md);
  REQUIRE(pieces.items.size() > plan.items.size());
  for (int world : {8, 3}) {
    const CoopOwners owners(md, world);
    for (bool verify : {true, false}) {
      INFO("world " << world << " verify " << verify);
      const uint64_t all = CoopWaste(pieces, md, owners, verify);
      CHECK(all > 0);
      CHECK(CoopWaste(plan, md, owners, verify) == all);
      // Stopping early stops at the same piece.
      CHECK(CoopWaste(plan, md, owners, verify, all / 3) ==
            CoopWaste(pieces, md, owners, verify, all / 3));
    }
  }
  // A span that does not fit is refused as its expansion is.
  LoadPlan bad;
  bad.items.push_back(span("w", 6, 4, 48, {0, 0}, {8, 8}));
  CHECK_THROWS_AS(CoopWaste(bad, md, CoopOwners(md, 8), true), InvalidArgumentError);
}

TEST_CASE("coop: slabs fill rounds of the budget, pieces cover each box", "[coop][read-once]") {
  uint32_t round = 0;
  uint64_t used = 0;
  // 10 rows of 1000 bytes in rounds of 3000: 3 rows a slab, one slab a round.
  auto slabs = CutSlabs(10, 1000, 3000, &round, &used);
  REQUIRE(slabs.size() == 4);
  CHECK(slabs[0] == CoopPiece{0, 0, 3});
  CHECK(slabs[3] == CoopPiece{3, 9, 10});
  // The next item's first slab (2 rows) does not fit round 3's remaining 2000 bytes... it does.
  auto next = CutSlabs(2, 1000, 3000, &round, &used);
  CHECK(next == std::vector<CoopPiece>{{3, 0, 2}});
  // A row larger than a round is a slab of its own.
  auto big = CutSlabs(2, 5000, 3000, &round, &used);
  CHECK(big == std::vector<CoopPiece>{{4, 0, 1}, {5, 1, 2}});
  CHECK(PiecesOf(slabs, 2, 7) == std::vector<CoopPiece>{{0, 2, 3}, {1, 3, 6}, {2, 6, 7}});
  CHECK(CoopPieceBytes({5, 3}, 4, 2) == 24);
  CHECK(CoopRoundBytes(256 << 20) == 32 << 20);
  CHECK(CoopRoundBytes(1000) == 4096);
}

TEST_CASE("coop: requests and grants round-trip, malformed ones are refused", "[coop][read-once]") {
  const std::vector<CoopRequest> reqs = {{0, {0, 0}, {0, 4}, {8, 4}}, {3, {8}, {2}, {6}}};
  const std::string enc = EncodeCoopRequests(reqs);
  CHECK(DecodeCoopRequests(enc, 1) == reqs);
  CHECK(DecodeCoopRequests("", 1).empty());
  CHECK_THROWS_WITH(DecodeCoopRequests(enc.substr(0, enc.size() - 1), 5),
                    Contains("rank 5") && Contains("truncated"));
  CHECK_THROWS_WITH(DecodeCoopRequests(enc + "x", 5), Contains("trailing"));
  std::string huge = enc;
  huge[0] = '\x7f';
  huge[3] = '\x7f';
  CHECK_THROWS_AS(DecodeCoopRequests(huge, 5), CorruptionError);
  std::string zero_dims = enc;
  zero_dims[8] = 0;
  CHECK_THROWS_AS(DecodeCoopRequests(zero_dims, 5), CorruptionError);

  const std::vector<CoopGrant> grants = {{true, 2, {{0, 0, 3}, {2, 3, 8}}}, {false, 0, {}}};
  const std::string g = EncodeCoopGrants(grants);
  CHECK(DecodeCoopGrants(g, reqs, 2) == grants);
  CHECK(DecodeCoopGrants("", reqs, 2) == std::vector<CoopGrant>(2));  // nothing granted
  CHECK_THROWS_WITH(DecodeCoopGrants(g, {reqs[0]}, 2),
                    Contains("rank 2") && Contains("one answer per request"));
  // Pieces that leave a gap, overlap, or end short of the box.
  for (const auto& bad : std::vector<std::vector<CoopPiece>>{
           {{0, 0, 3}, {1, 4, 8}}, {{0, 0, 3}, {1, 2, 8}}, {{0, 0, 3}}, {{1, 0, 3}, {0, 3, 8}}}) {
    std::vector<CoopGrant> gs = grants;
    gs[0].pieces = bad;
    CHECK_THROWS_AS(DecodeCoopGrants(EncodeCoopGrants(gs), reqs, 2), CorruptionError);
  }
  std::vector<CoopGrant> late = grants;
  late[0].verify_round = 1;  // a piece after the item's verification
  CHECK_THROWS_AS(DecodeCoopGrants(EncodeCoopGrants(late), reqs, 2), CorruptionError);

  // A request must name a chunk and a box within it.
  Metadata md;
  md.entries["a"] = TensorMetadata{DType::kFloat32, {8, 8}, {{{0, 0}, {8, 8}}}};
  md.entries["b"] = BytesMetadata{};
  const auto entries = EntryOrdinals(md);
  CHECK(CheckCoopRequest(md, entries, {0, {0, 0}, {0, 4}, {8, 4}}, 1).chunk.sizes == Shape{8, 8});
  for (const CoopRequest& bad : std::vector<CoopRequest>{{1, {0, 0}, {0, 0}, {1, 1}},
                                                         {2, {0, 0}, {0, 0}, {1, 1}},
                                                         {0, {4, 0}, {0, 0}, {1, 1}},
                                                         {0, {0, 0}, {0, 5}, {8, 4}},
                                                         {0, {0, 0}, {0, 0}, {0, 4}},
                                                         {0, {0, 0}, {0}, {8}}}) {
    CHECK_THROWS_WITH(CheckCoopRequest(md, entries, bad, 3), Contains("rank 3"));
  }

  // The load summary's flag and the schedule's trailing byte.
  ReadRequestSummary s;
  s.can_share = true;
  s.plan_bytes = 7;
  s.coop_waste = 1 << 20;
  s.reads = {true, false};
  const ReadRequestSummary back = DecodeReadRequestSummary(EncodeReadRequestSummary(s), 2, 0);
  CHECK(back.coop_waste == s.coop_waste);
  CHECK(back.reads == s.reads);
  std::string bad_flags = EncodeReadRequestSummary(s);
  bad_flags[0] = 32;
  CHECK_THROWS_AS(DecodeReadRequestSummary(bad_flags, 2, 0), CorruptionError);
  s.rule_hash = 0x1234;
  CHECK(DecodeReadRequestSummary(EncodeReadRequestSummary(s), 2, 0).rule_hash == 0x1234);
  CHECK(DecodeReadRequestSummary(EncodeReadRequestSummary(s), 2, 0).rule_hash_ceil_first == 0);
  s.rule_hash_ceil_first = 0x1234;  // the same: not sent twice
  CHECK(EncodeReadRequestSummary(s).size() == 1 + 8 * 3 + 1);
  CHECK(DecodeReadRequestSummary(EncodeReadRequestSummary(s), 2, 0).rule_hash_ceil_first == 0x1234);
  ShareSchedule sched;
  sched.cooperative = true;
  CHECK(DecodeShareSchedule(EncodeShareSchedule(sched), 0).cooperative);
  CHECK_FALSE(DecodeShareSchedule(EncodeShareSchedule(sched), 0).rule_exchange);
  CHECK_FALSE(DecodeShareSchedule(EncodeShareSchedule(ShareSchedule{}), 0).cooperative);
  sched.rule_exchange = true;
  CHECK(DecodeShareSchedule(EncodeShareSchedule(sched), 0).rule_exchange);
  sched.rule_ceil_first = true;
  CHECK(DecodeShareSchedule(EncodeShareSchedule(sched), 0).rule_ceil_first);
  CHECK_THROWS_AS(DecodeShareSchedule(EncodeShareSchedule(ShareSchedule{}) + "\x05", 0),
                  CorruptionError);  // ceil first without rule exchange
  CHECK_THROWS_AS(DecodeShareSchedule(EncodeShareSchedule(ShareSchedule{}) + "\x04", 0),
                  CorruptionError);
}

// ---------------------------------------------------------------------------------------------
// Whole loads.

namespace {

constexpr int kSaved = 4;
// Two row-major matrices (rows of 4 KiB and of 1 KiB) and a vector, all saved row-sharded.
const std::map<std::string, Shape>& Shapes() {
  static const std::map<std::string, Shape> shapes = {
      {"w0", {256, 1024}}, {"w1", {512, 256}}, {"b", {4096}}};
  return shapes;
}
uint64_t Seed(const std::string& name) { return 1000 + name.size() * 31 + name[1]; }
TensorView Full(const std::string& name) {
  return RandomTensor(DType::kFloat32, Shapes().at(name), Seed(name));
}

// Counts the collectives of cooperative reads (phases "load/coop-...") of the rank it wraps.
class CountingCommunicator : public Communicator {
 public:
  explicit CountingCommunicator(Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::vector<std::string> Gather(std::string m, int root, std::string_view w) override {
    Count(w);
    return inner_.Gather(std::move(m), root, w);
  }
  std::string Scatter(std::vector<std::string> m, int root, std::string_view w) override {
    Count(w);
    return inner_.Scatter(std::move(m), root, w);
  }
  std::string Broadcast(std::string m, int root, std::string_view w) override {
    Count(w);
    return inner_.Broadcast(std::move(m), root, w);
  }
  std::vector<std::string> AllGather(std::string m, std::string_view w) override {
    Count(w);
    return inner_.AllGather(std::move(m), w);
  }
  void Barrier(std::string_view w) override {
    Count(w);
    inner_.Barrier(w);
  }
  uint64_t OpenOperation(std::string_view name, std::string_view target) override {
    return inner_.OpenOperation(name, target);
  }
  void EndOperation() noexcept override { inner_.EndOperation(); }
  std::vector<std::string> AllToAll(std::vector<std::string> m, std::string_view w) override {
    Count(w);
    return inner_.AllToAll(std::move(m), w);
  }
  void ExchangeBytes(const std::vector<BulkSend>& s, const std::vector<BulkReceive>& r,
                     std::string_view w) override {
    Count(w);
    if (fail_exchange && (w == "load/coop-data" || w == "load/rule-data")) {  // timed out
      inner_.Poison("injected: the bulk exchange timed out");
      throw CollectiveError(std::string(w), {{rank(), ErrorCode::kTimeout,
                                              "injected: the bulk exchange timed out", false}});
    }
    inner_.ExchangeBytes(s, r, w);
  }
  bool ExchangesDirectly() const override { return direct && inner_.ExchangesDirectly(); }
  int coop = 0;
  int rule = 0;
  bool direct = true;  // false: as NcclCommunicator, no direct AllToAll or ExchangeBytes
  bool fail_exchange = false;

 private:
  void Count(std::string_view w) {
    coop += w.substr(0, 10) == "load/coop-";
    rule += w == "load/rule-data";
  }
  Communicator& inner_;
};

std::shared_ptr<FaultInjectionStore> SaveRows(const std::string& bucket, uint32_t version = 2,
                                              CheckpointFormat format = CheckpointFormat::kDcp) {
  ClearMemStore(bucket);
  auto store = std::make_shared<FaultInjectionStore>(MakeMemStore(bucket));
  RegisterFaultScheme("coop", store);
  RequireNoErrors(RunRanks(kSaved, [&](int r, Communicator& comm) {
    StateDict sd;
    for (const auto& [name, shape] : Shapes()) {
      auto [b, e] = RowRange(shape[0], r, kSaved);
      Shape off(shape.size(), 0), len = shape;
      off[0] = b;
      len[0] = e - b;
      sd.Set(name,
             ShardedTensor{DType::kFloat32, shape, {{Clone(Full(name).Narrow(off, len)), off}}});
    }
    SaveOptions so;
    so.storage.metadata_version = version;
    so.storage.format = format;
    Save(sd, "coop://x", comm, so);
  }));
  return store;
}

// Rank r of `world`: matrices by column blocks, the vector by rows (as saved when world == 4).
struct Loaded {
  std::map<std::string, TensorView> parts;
  std::map<std::string, Shape> offsets;
  StateDict sd;
};
Loaded ColumnState(int r, int world, bool columns = true) {
  Loaded s;
  for (const auto& [name, shape] : Shapes()) {
    const size_t d = columns && shape.size() == 2 ? 1 : 0;
    auto [b, e] = RowRange(shape[d], r, world);
    Shape off(shape.size(), 0), len = shape;
    off[d] = b;
    len[d] = e - b;
    s.parts[name] = TensorView::Allocate(DType::kFloat32, len);
    s.offsets[name] = off;
    s.sd.Set(name, ShardedTensor{DType::kFloat32, shape, {{s.parts[name], off}}});
  }
  return s;
}
void CheckValues(const std::vector<Loaded>& loaded) {
  for (const auto& s : loaded) {
    for (const auto& [name, part] : s.parts) {
      CHECK(SameElements(part, Full(name).Narrow(s.offsets.at(name), part.shape)));
    }
  }
}

struct Run {
  uint64_t bytes = 0;
  std::vector<LoadStats> stats;
  std::vector<int> coop_collectives;
  std::vector<int> rule_collectives;
};
Run LoadColumns(FaultInjectionStore& store, int world, LoadOptions lo, bool columns = true,
                bool direct = true) {
  store.Reset();
  Run run;
  run.stats.resize(world);
  run.coop_collectives.resize(world);
  run.rule_collectives.resize(world);
  std::vector<Loaded> loaded(world);
  RequireNoErrors(RunRanks(world, [&](int r, Communicator& comm) {
    loaded[r] = ColumnState(r, world, columns);
    CountingCommunicator counting(comm);
    counting.direct = direct;
    run.stats[r] = Load(loaded[r].sd, "coop://x", counting, lo).stats;
    run.coop_collectives[r] = counting.coop;
    run.rule_collectives[r] = counting.rule;
  }));
  CheckValues(loaded);
  run.bytes = store.BytesRead();
  return run;
}

uint64_t StoredBytes() {
  uint64_t n = 0;
  for (const auto& [name, shape] : Shapes()) n += NumElements(shape) * 4;
  return n;
}

}  // namespace

TEST_CASE("coop: a 4-rank rows-to-columns reshard reads each stored byte once",
          "[coop][read-once][option:LoadOptions::read_once]") {
  auto store = SaveRows("coop-columns");
  // What a same-layout load reads (every item once, the metadata, any index), the baseline.
  const Run same = LoadColumns(*store, 4, LoadOptions{}, /*columns=*/false);
  CHECK(same.bytes >= StoredBytes());
  for (int r = 0; r < 4; ++r) {  // same layout: no extra collective
    CHECK(same.coop_collectives[r] + same.rule_collectives[r] == 0);
    CHECK(same.stats[r].coop_rounds + same.stats[r].rule_rounds == 0);
  }

  LoadOptions off;
  off.read_once = false;
  const Run alone = LoadColumns(*store, 4, off);
  // Both layouts are rules: the matrices are exchanged by rule (planner/rule_reads.h), with no
  // request or grant; the vector is read as saved.
  const Run ruled = LoadColumns(*store, 4, LoadOptions{});
  INFO("stored " << StoredBytes() << ", same layout " << same.bytes << ", columns alone "
                 << alone.bytes << ", by rule " << ruled.bytes);
  // Alone, every rank streams every row of every matrix.
  CHECK(alone.bytes >= 3 * StoredBytes());
  CHECK(ruled.bytes <= same.bytes + StoredBytes() / 20);
  uint64_t sent = 0, received = 0, items = 0;
  for (int r = 0; r < 4; ++r) {
    CHECK(ruled.stats[r].rule_rounds == 1);
    CHECK(ruled.rule_collectives[r] == 1);
    CHECK(ruled.coop_collectives[r] == 0);
    CHECK(ruled.stats[r].rule_items_fallen_back == 0);
    sent += ruled.stats[r].rule_bytes_sent;
    received += ruled.stats[r].rule_bytes_received;
    items += ruled.stats[r].rule_items;
  }
  // Each matrix chunk: its owner keeps a quarter, three quarters cross the communicator.
  const uint64_t matrices = (256 * 1024 + 512 * 256) * 4;
  CHECK(sent == matrices * 3 / 4);
  CHECK(received == sent);
  CHECK(items == 2 * 4);  // 2 matrices on each of 4 ranks

  SECTION("4 -> 2 ranks") {
    const Run two = LoadColumns(*store, 2, LoadOptions{});
    INFO("4 -> 2: " << two.bytes);
    CHECK(two.bytes <= same.bytes + StoredBytes() / 20);
    CHECK(two.stats[0].rule_bytes_sent + two.stats[1].rule_bytes_sent == matrices / 2);
  }
  SECTION("a budget of two rounds: the same bytes and values") {
    LoadOptions two_rounds;  // rounds of 256 KiB: w0's chunks fill one, w1's the next
    two_rounds.storage.memory_budget_bytes = 2 << 20;
    const Run small = LoadColumns(*store, 4, two_rounds);
    CHECK(small.stats[0].rule_rounds == 2);
    CHECK(small.bytes == ruled.bytes);
  }
  SECTION("a tiny budget: chunks over a round are scattered piece by piece, each byte once") {
    LoadOptions tiny;
    tiny.storage.memory_budget_bytes = 64 << 10;
    const Run small = LoadColumns(*store, 4, tiny);
    CHECK(small.stats[0].rule_rounds == 0);
    CHECK(small.stats[0].coop_rounds > 4);
    CHECK(small.bytes <= same.bytes + StoredBytes() / 20);
  }
  SECTION("a communicator without a direct exchange (NCCL) reads as before") {
    const Run nccl = LoadColumns(*store, 4, LoadOptions{}, true, /*direct=*/false);
    for (int r = 0; r < 4; ++r) CHECK(nccl.coop_collectives[r] + nccl.rule_collectives[r] == 0);
    CHECK(nccl.bytes == alone.bytes);
  }
  SECTION("checksums off: the same single read") {
    LoadOptions unchecked;
    unchecked.storage.verify_checksums = false;
    CHECK(LoadColumns(*store, 4, unchecked).bytes == ruled.bytes);
  }
  SECTION("version 1 (listed chunks, owners by data file): piece by piece") {
    auto v1 = SaveRows("coop-columns-v1", 1);
    const Run same1 = LoadColumns(*v1, 4, LoadOptions{}, false);
    const Run coop1 = LoadColumns(*v1, 4, LoadOptions{});
    CHECK(coop1.bytes <= same1.bytes + StoredBytes() / 20);
    uint64_t sent1 = 0, items1 = 0;
    for (int r = 0; r < 4; ++r) {
      CHECK(coop1.stats[r].rule_rounds == 0);
      CHECK(coop1.stats[r].coop_rounds > 0);
      CHECK(coop1.coop_collectives[r] == 3 + static_cast<int>(coop1.stats[r].coop_rounds));
      sent1 += coop1.stats[r].coop_bytes_sent;
      items1 += coop1.stats[r].coop_items_received;
    }
    CHECK(sent1 == matrices * 3 / 4);
    CHECK(items1 == 2 * 4 * 3);  // 2 matrices x 4 chunks x 3 other ranks
  }
}

namespace {

// Every rank failed with the same CollectiveError, which contains `what`.
void CheckSameFailure(const std::vector<std::exception_ptr>& errors, const std::string& what) {
  std::string first;
  for (size_t r = 0; r < errors.size(); ++r) {
    REQUIRE(errors[r]);
    try {
      std::rethrow_exception(errors[r]);
    } catch (const CollectiveError& e) {
      if (r == 0) first = e.what();
      CHECK(std::string(e.what()) == first);
      CHECK_THAT(e.what(), Contains(what));
    } catch (const std::exception& e) {
      FAIL("rank " << r << " failed with another error: " << e.what());
    }
  }
}

}  // namespace

TEST_CASE("coop: a flipped bit in an owner's item fails every rank, naming the item",
          "[coop][read-once]") {
  auto store = SaveRows("coop-corrupt", 1);  // piece by piece: rule exchange is below
  Metadata md = ReadMetadata("coop://x");
  ReadAllStoredItems(*store->inner(), md);
  const StorageInfo& info = md.storage.at({"w0", {128, 0}, std::nullopt});  // rank 2's chunk
  std::string bytes = store->ReadAll(info.relative_path, UINT64_MAX);
  bytes[info.offset + info.length - 5] ^= 0x10;
  {
    auto out = store->inner()->Create(info.relative_path);
    out->Append(bytes.data(), bytes.size());
    out->Close();
  }
  std::vector<Loaded> loaded(4);
  auto errors = RunRanks(4, [&](int r, Communicator& comm) {
    loaded[r] = ColumnState(r, 4);
    Load(loaded[r].sd, "coop://x", comm);
  });
  CheckSameFailure(errors, "checksum mismatch for 'w0' at [128, 0]");
  // The receivers say whose read failed.
  try {
    std::rethrow_exception(errors[0]);
  } catch (const CollectiveError& e) {
    int naming = 0;
    for (const auto& f : e.failures()) {
      naming += f.message.find("rank 2 could not read the items it reads for this rank") !=
                std::string::npos;
    }
    CHECK(naming == 3);
  }
}

TEST_CASE("coop: an owner that cannot read fails every rank with the same error",
          "[coop][read-once]") {
  auto store = SaveRows("coop-io", 1);
  // The metadata (with the indexes' copies) is read first; the owners' reads follow.
  store->FailNth(FaultOp::kRead, 3);
  std::vector<Loaded> loaded(4);
  auto errors = RunRanks(4, [&](int r, Communicator& comm) {
    loaded[r] = ColumnState(r, 4);
    Load(loaded[r].sd, "coop://x", comm);
  });
  CheckSameFailure(errors, "could not read the items it reads for this rank");
}

TEST_CASE("coop: a bulk exchange that times out on one rank fails every rank, naming it",
          "[coop][read-once][fault]") {
  // The others learn it when their own wait for that rank ends (3 s here), as over MPI.
  SaveRows("coop-exchange");
  constexpr int kFailing = 2;
  std::vector<Loaded> loaded(4);
  auto errors = RunRanks(
      4,
      [&](int r, Communicator& comm) {
        loaded[r] = ColumnState(r, 4);
        CountingCommunicator counting(comm);
        counting.fail_exchange = r == kFailing;
        Load(loaded[r].sd, "coop://x", counting);
      },
      std::chrono::seconds(3));
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    REQUIRE(errors[r]);
    try {
      std::rethrow_exception(errors[r]);
    } catch (const CollectiveError& e) {
      const std::string what = e.what();
      CHECK((what.find("rank " + std::to_string(kFailing)) != std::string::npos ||
             what.find("rank(s) " + std::to_string(kFailing)) != std::string::npos));
    }
  }
}

TEST_CASE("coop: PyTorch DCP and safetensors column loads read each record once",
          "[coop][read-once][torch-dcp][safetensors]") {
  for (CheckpointFormat format : {CheckpointFormat::kTorchDcp, CheckpointFormat::kSafetensors}) {
    DYNAMIC_SECTION(CheckpointFormatName(format)) {
      auto store = SaveRows("coop-format", 2, format);
      const Run same = LoadColumns(*store, 4, LoadOptions{}, /*columns=*/false);
      LoadOptions off;
      off.read_once = false;
      const Run alone = LoadColumns(*store, 4, off);
      const Run coop = LoadColumns(*store, 4, LoadOptions{});
      INFO("same layout " << same.bytes << ", columns alone " << alone.bytes << ", cooperative "
                          << coop.bytes);
      CHECK(alone.bytes >= 2 * StoredBytes());
      CHECK(coop.bytes <= same.bytes + StoredBytes() / 20);
      CHECK(coop.stats[0].coop_rounds > 0);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Bulk bytes between ranks (Communicator::ExchangeBytes): ranks that are threads of one process
// copy straight from the sender's memory; the default goes through AllToAll.

namespace {

// How rank `from` cuts what it sends rank `to` (and `to` what it receives): pieces of awkward
// sizes, empty ones included, different for every pair.
std::vector<size_t> Cut(size_t total, size_t seed) {
  std::vector<size_t> cut;
  size_t left = total;
  for (size_t k = 0; left > 0; ++k) {
    const size_t n = std::min(left, (k * 7919 + seed * 104729) % 70001);
    cut.push_back(n);
    left -= n;
  }
  cut.push_back(0);
  return cut;
}

void ExchangeStreams(int rank, Communicator& comm, bool direct) {
  const int n = comm.size();
  auto bytes_between = [](int from, int to) { return size_t{300000} * (from + 1) + 1000 * to; };
  std::vector<std::string> out(n), in(n);
  std::vector<Communicator::BulkSend> sends;
  std::vector<Communicator::BulkReceive> receives;
  for (int p = 0; p < n; ++p) {
    out[p].resize(bytes_between(rank, p));
    dcp::testing::FillRandom(out[p].data(), out[p].size(), 100 * rank + p);
    size_t at = 0;
    for (size_t piece : Cut(out[p].size(), 1 + 7 * rank + p)) {
      sends.push_back({p, out[p].data() + at, piece});
      at += piece;
    }
    in[p].assign(bytes_between(p, rank), '\0');
    at = 0;
    for (size_t piece : Cut(in[p].size(), 1 + 7 * p + rank)) {
      receives.push_back({p, in[p].data() + at, piece});
      at += piece;
    }
  }
  if (direct) {
    comm.ExchangeBytes(sends, receives, "test/bulk");
  } else {
    comm.Communicator::ExchangeBytes(sends, receives, "test/bulk");
  }
  for (int p = 0; p < n; ++p) {
    std::string want(bytes_between(p, rank), '\0');
    dcp::testing::FillRandom(want.data(), want.size(), 100 * p + rank);
    dcp::testing::Expect(in[p] == want, "the bytes from rank " + std::to_string(p));
  }
}

}  // namespace

TEST_CASE("bulk exchange: every piece arrives exact and in order, empty ones included",
          "[coop][comm]") {
  for (bool direct : {true, false}) {
    DYNAMIC_SECTION((direct ? "in-process, from the sender's memory" : "through AllToAll")) {
      RequireNoErrors(RunRanks(4, [&](int rank, Communicator& comm) {
        ExchangeStreams(rank, comm, direct);
        ExchangeStreams(rank, comm, direct);  // and again: nothing left over from the first
      }));
    }
  }
}

TEST_CASE("bulk exchange: a rank that expects other sizes names the sender and no rank hangs",
          "[coop][comm]") {
  for (bool direct : {true, false}) {
    DYNAMIC_SECTION((direct ? "in-process, from the sender's memory" : "through AllToAll")) {
      const auto errors = RunRanks(
          3,
          [&](int rank, Communicator& comm) {
            std::string out(1000, 'x'), in(2000, '\0');
            std::vector<Communicator::BulkSend> sends;
            std::vector<Communicator::BulkReceive> receives;
            for (int p = 0; p < 3; ++p) {
              // Rank 1 sends rank 2 one byte fewer than rank 2 expects.
              sends.push_back({p, out.data(), rank == 1 && p == 2 ? size_t{99} : size_t{100}});
              receives.push_back({p, in.data() + 100 * p, 100});
            }
            if (direct) {
              comm.ExchangeBytes(sends, receives, "test/bulk");
            } else {
              comm.Communicator::ExchangeBytes(sends, receives, "test/bulk");
            }
          },
          std::chrono::seconds(20));
      CHECK_FALSE(errors[0]);
      CHECK_FALSE(errors[1]);
      REQUIRE(errors[2]);
      try {
        std::rethrow_exception(errors[2]);
      } catch (const CollectiveError& e) {
        CHECK_THAT(e.what(), Contains("rank 1 sent 99 bytes"));
        CHECK(e.failed_ranks() == std::vector<int>{1});
      }
    }
  }
}
