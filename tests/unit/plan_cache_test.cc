// Plan caching (SavePlanCache, issue 16): a repeated save of an unchanged structure skips the
// plan exchange; any change (structure, one rank's layout, a stale cache) plans in full; every
// checkpoint loads back exactly either way.
#include <catch2/catch.hpp>
#include <set>

#include "dcp/dcp.h"
#include "dcp/storage/backends/mem_store.h"
#include "dcp/storage/format/dcp_layout.h"
#include "support/test_support.h"

namespace dcp {
namespace {

using testing::RandomTensor;
using testing::RequireNoErrors;
using testing::RunRanks;
using testing::SameElements;

constexpr int kRanks = 4;

// Each rank: a row-sharded [rows, 6] tensor (its rows given by `split`), a replicated vector
// and, when `extra`, one more tensor.
struct RankState {
  TensorView shard, replicated, extra;
  StateDict sd;
};

RankState MakeState(int rank, const std::vector<int64_t>& split, uint64_t seed, bool extra) {
  RankState s;
  int64_t begin = 0, rows = 0;
  for (int r = 0; r < kRanks; ++r) {
    if (r < rank) begin += split[static_cast<size_t>(r)];
    rows += split[static_cast<size_t>(r)];
  }
  s.shard = RandomTensor(DType::kFloat32, {split[static_cast<size_t>(rank)], 6}, seed + rank);
  s.replicated = RandomTensor(DType::kInt64, {5}, seed + 100);
  ShardedTensor st{DType::kFloat32, {rows, 6}, {}};
  if (split[static_cast<size_t>(rank)] > 0) st.local_shards.push_back({s.shard, {begin, 0}});
  s.sd.Set("w", st);
  s.sd.Set("r", s.replicated);
  if (extra) {
    s.extra = RandomTensor(DType::kBFloat16, {3}, seed + 200);
    s.sd.Set("extra", s.extra);
  }
  return s;
}

// Save at kRanks ranks with each rank's cache; then check every rank's values load back.
void SaveAndCheck(const std::string& uri, std::vector<std::shared_ptr<SavePlanCache>>& caches,
                  const std::vector<int64_t>& split, uint64_t seed, bool extra) {
  std::vector<RankState> states;
  for (int r = 0; r < kRanks; ++r) states.push_back(MakeState(r, split, seed, extra));
  RequireNoErrors(RunRanks(kRanks, [&](int r, Communicator& comm) {
    SaveOptions so;
    so.storage.overwrite = true;
    so.plan_cache = caches[static_cast<size_t>(r)];
    Save(states[static_cast<size_t>(r)].sd, uri, comm, so);
  }));
  std::vector<RankState> back;
  for (int r = 0; r < kRanks; ++r) back.push_back(MakeState(r, split, seed + 7, extra));
  RequireNoErrors(RunRanks(kRanks, [&](int r, Communicator& comm) {
    Load(back[static_cast<size_t>(r)].sd, uri, comm);
  }));
  for (int r = 0; r < kRanks; ++r) {
    INFO("rank " << r);
    CHECK(SameElements(back[static_cast<size_t>(r)].shard, states[static_cast<size_t>(r)].shard));
    CHECK(SameElements(back[static_cast<size_t>(r)].replicated,
                       states[static_cast<size_t>(r)].replicated));
    if (extra) {
      CHECK(SameElements(back[static_cast<size_t>(r)].extra, states[static_cast<size_t>(r)].extra));
    }
  }
}

void CheckCounts(const std::vector<std::shared_ptr<SavePlanCache>>& caches, uint64_t hits,
                 uint64_t misses) {
  for (const auto& c : caches) {
    CHECK(c->hits() == hits);
    CHECK(c->misses() == misses);
  }
}

TEST_CASE("plan cache: repeated saves reuse the plan, changes plan in full",
          "[plancache][option:SaveOptions::plan_cache]") {
  ClearMemStore("plancache");
  std::vector<std::shared_ptr<SavePlanCache>> caches;
  for (int r = 0; r < kRanks; ++r) caches.push_back(std::make_shared<SavePlanCache>());
  const std::vector<int64_t> split = {3, 2, 2, 1};

  SaveAndCheck("mem://plancache/a", caches, split, 1, false);  // first: plans in full
  CheckCounts(caches, 0, 1);
  SaveAndCheck("mem://plancache/b", caches, split, 2, false);  // same structure, new values
  CheckCounts(caches, 1, 1);
  SaveAndCheck("mem://plancache/b", caches, split, 3, false);  // over itself (overwrite)
  CheckCounts(caches, 2, 1);

  // A structure change (a new entry on every rank) invalidates the cache...
  SaveAndCheck("mem://plancache/c", caches, split, 4, true);
  CheckCounts(caches, 2, 2);
  SaveAndCheck("mem://plancache/c", caches, split, 5, true);  // ...and is cached in turn
  CheckCounts(caches, 3, 2);

  // One rank's layout changes (rank 2 holds one more row, rank 3 one fewer): the others'
  // hashes still match, that rank's does not: every rank plans in full.
  SaveAndCheck("mem://plancache/d", caches, {3, 2, 3, 0}, 6, true);
  CheckCounts(caches, 3, 3);

  // A rank whose cache is gone (a restarted process, say) makes every rank plan in full.
  caches[1]->Clear();
  SaveAndCheck("mem://plancache/e", caches, {3, 2, 3, 0}, 7, true);
  for (int r = 0; r < kRanks; ++r) CHECK(caches[static_cast<size_t>(r)]->misses() >= 1);
  CHECK(caches[0]->misses() == 4);
  SaveAndCheck("mem://plancache/e", caches, {3, 2, 3, 0}, 8, true);
  CHECK(caches[0]->hits() == 4);
  ClearMemStore("plancache");
}

TEST_CASE("plan cache: a hit writes new data files, the replaced checkpoint's are removed",
          "[plancache]") {
  ClearMemStore("plancache2");
  std::vector<std::shared_ptr<SavePlanCache>> caches;
  for (int r = 0; r < kRanks; ++r) caches.push_back(std::make_shared<SavePlanCache>());
  const std::vector<int64_t> split = {2, 2, 2, 2};
  SaveAndCheck("mem://plancache2", caches, split, 1, false);
  auto store = OpenStore("mem://plancache2");
  auto names = [&] {
    std::set<std::string> s;
    for (const auto& n : store->List()) {
      if (IsDataObjectName(n)) s.insert(n);
    }
    return s;
  };
  const auto first = names();
  SaveAndCheck("mem://plancache2", caches, split, 2, false);
  CheckCounts(caches, 1, 1);
  const auto second = names();
  CHECK(second.size() == first.size());
  for (const auto& n : second) CHECK(first.count(n) == 0);  // a new save id, new files
  ClearMemStore("plancache2");
}

}  // namespace
}  // namespace dcp
