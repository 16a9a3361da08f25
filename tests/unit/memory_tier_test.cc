// The peer-replicated memory tier (issue 26): steps in node-local shared memory, replicas on
// other nodes, a commit only when every copy exists, recovery from the surviving copies.
// Nodes are simulated (MemoryTierOptions::ranks_per_node), each with its own directory under a
// private tier root, so "losing a node" is removing its directory.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <csignal>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <tuple>

#include "dcp/dcp.h"
#include "dcp/storage/backends/mem_store.h"
#include "dcp/storage/format/dcp_layout.h"
#include "dcp/storage/registry.h"
#include "dcp/storage/store.h"
#include "support/fake_device.h"
#include "support/test_support.h"
#include "support/tier_device_case.h"

using namespace dcp;
using namespace dcp::testing;
using Catch::Matchers::Contains;
using Catch::Matchers::EndsWith;
namespace fs = std::filesystem;

namespace {

constexpr int kWorld = 4;
constexpr int64_t kRows = 37, kCols = 6;

// The training state of rank `rank` at `step`: "w" row-sharded over the ranks (uneven), "b"
// replicated, a blob; all values follow from the step.
struct TierState {
  TensorView full_w;  // the whole of "w" (every rank computes it)
  TensorView b;
  StateDict sd;
  TierState(int rank, int world, int64_t step, bool rows = true) {
    full_w = RandomTensor(DType::kFloat32, {kRows, kCols}, 1000 + step);
    b = RandomTensor(DType::kFloat64, {5}, 2000 + step);
    ShardedTensor st{DType::kFloat32, {kRows, kCols}, {}};
    if (rows) {
      auto [r0, r1] = RowRange(kRows, rank, world);
      if (r1 > r0) {
        st.local_shards.push_back({Clone(full_w.Narrow({r0, 0}, {r1 - r0, kCols})), {r0, 0}});
      }
    } else {
      auto [c0, c1] = RowRange(kCols, rank, world);
      if (c1 > c0) {
        st.local_shards.push_back({Clone(full_w.Narrow({0, c0}, {kRows, c1 - c0})), {0, c0}});
      }
    }
    sd.Set("w", st);
    sd.Set("b", Clone(b));
    sd.Set("rng", Blob{"rng-state-" + std::to_string(step)});
  }
  // An empty state of the same structure, to load into.
  static TierState Empty(int rank, int world, bool rows = true) {
    TierState s(rank, world, -1, rows);
    auto& st = std::get<ShardedTensor>(*s.sd.Find("w"));
    for (auto& shard : st.local_shards) std::memset(shard.view.data, 0, shard.view.nbytes());
    std::memset(std::get<TensorView>(*s.sd.Find("b")).data, 0, 5 * 8);
    s.sd.Set("rng", Blob{});
    return s;
  }
  // Whether `sd` holds step `step`'s values.
  static bool Holds(StateDict& sd, int64_t step) {
    TierState want(0, 1, step);
    const auto& st = std::get<ShardedTensor>(*sd.Find("w"));
    for (const auto& shard : st.local_shards) {
      if (!SameElements(want.full_w.Narrow(shard.offsets, shard.view.shape), shard.view)) {
        return false;
      }
    }
    return SameElements(want.b, std::get<TensorView>(*sd.Find("b"))) &&
           std::get<Blob>(*sd.Find("rng")).bytes == "rng-state-" + std::to_string(step);
  }
};

MemoryTierOptions Options(const TempDir& root, int ranks_per_node, int replicas = 1) {
  MemoryTierOptions o;
  o.name = "test";
  o.shm_root = root.path();
  o.ranks_per_node = ranks_per_node;
  o.replicas = replicas;
  o.transfer_chunk_bytes = 4096;  // several rounds even for small files
  return o;
}

// The job's directory under the tier root (what wiping every node's memory removes).
std::string TierDir(const TempDir& root) { return MemoryTier::JobDirectory(Options(root, 1)); }

std::string NodeDir(const TempDir& root, int node) {
  return TierDir(root) + "/node-" + std::to_string(node);
}

// Every job's tier of this user under the root (what losing every node's memory removes).
std::string TierAnchor(const TempDir& root) {
  return root.path() + "/dcp-tier-u" + std::to_string(::geteuid());
}

// The complete checkpoints under a manager's root, read without a manager.
std::vector<int64_t> CompleteCheckpoints(const std::string& root) {
  std::vector<int64_t> steps;
  if (!fs::exists(root)) return steps;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step-", 0) != 0 || !e.is_directory()) continue;
    try {
      ReadMetadata(e.path().string());
      steps.push_back(std::stoll(name.substr(5)));
    } catch (const Error&) {
    }
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::set<std::string> FilesIn(const std::string& dir) {
  std::set<std::string> out;
  if (!fs::exists(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

// A second group's communicators, one per rank, for background saves.
std::vector<std::unique_ptr<Communicator>> BackgroundCommunicators() {
  InProcessGroup group(kWorld);
  std::vector<std::unique_ptr<Communicator>> out(kWorld);
  for (int r = 0; r < kWorld; ++r) out[r] = group.Release(r);
  return out;
}

// Save steps `steps` through a tier on `world` ranks.
void SaveSteps(const MemoryTierOptions& options, std::vector<int64_t> steps, int world = kWorld) {
  RequireNoErrors(RunRanks(world, [&](int rank, Communicator& comm) {
    MemoryTier tier(comm, options);
    for (int64_t s : steps) {
      TierState state(rank, world, s);
      tier.Save(s, state.sd);
    }
  }));
}

}  // namespace

TEST_CASE("memory tier: each node holds its ranks' files and its partners' replicas",
          "[memory-tier][option:MemoryTierOptions::ranks_per_node]"
          "[option:MemoryTierOptions::replicas][option:MemoryTierOptions::shm_root]"
          "[option:MemoryTierOptions::name][option:MemoryTierOptions::transfer_chunk_bytes]") {
  TempDir root("tier");
  auto options = Options(root, 2);
  std::vector<std::vector<int>> partners(kWorld);
  std::vector<TierStats> stats(kWorld);
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    MemoryTier tier(comm, options);
    partners[rank] = tier.partners();
    Expect(tier.node() == rank / 2 && tier.node_count() == 2, "two simulated nodes");
    TierState state(rank, kWorld, 7);
    tier.Save(7, state.sd);
    stats[rank] = tier.last_stats();
  }));
  // Partners sit on the other node, at the same position.
  CHECK(partners == std::vector<std::vector<int>>{{2}, {3}, {0}, {1}});
  const std::string step = "/step-0000000007";
  auto node0 = FilesIn(NodeDir(root, 0) + step), node1 = FilesIn(NodeDir(root, 1) + step);
  // Two nodes, one replica: each node holds the whole step (its own files and the other's).
  CHECK(node0 == node1);
  CHECK(node0.count(kMetadataName) == 1);
  size_t data_files = 0;
  for (const auto& f : node0) data_files += IsDataObjectName(f) ? 1 : 0;
  CHECK(data_files >= 4);
  for (int r = 0; r < kWorld; ++r) {
    CHECK(stats[r].bytes_sent == stats[r].bytes_written);  // one replica of its own files
    CHECK(stats[r].bytes_received > 0);
  }
  // Each node's copy is an ordinary checkpoint: it loads without the tier, into any layout.
  for (int node = 0; node < 2; ++node) {
    RequireNoErrors(RunRanks(3, [&](int rank, Communicator& comm) {
      auto state = TierState::Empty(rank, 3, /*rows=*/false);
      Load(state.sd, NodeDir(root, node) + step, comm);
      Expect(TierState::Holds(state.sd, 7), "node copy loads step 7");
    }));
  }
}

TEST_CASE("memory tier: a lost node's shards come back bit-exact from their replicas",
          "[memory-tier]") {
  TempDir root("tier");
  for (auto [per_node, lost] : {std::pair{2, 1}, {2, 0}, {1, 1}, {1, 0}}) {
    DYNAMIC_SECTION("ranks per node " << per_node << ", node " << lost << " lost") {
      auto options = Options(root, per_node);
      SaveSteps(options, {1, 2});
      const std::string step2 = "/step-0000000002";
      const auto saved = FilesIn(NodeDir(root, lost) + step2);  // what a save leaves there
      // A node dies: its memory is gone. The job restarts (new tier objects) on a new node. (Node
      // 0 holds rank 0, which reads the metadata and checks every data file of the step: those
      // only other nodes hold count as present.)
      fs::remove_all(NodeDir(root, lost));
      std::vector<TierStats> stats(kWorld);
      RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
        MemoryTier tier(comm, options);
        auto state = TierState::Empty(rank, kWorld);
        auto step = tier.Restore(state.sd);
        Expect(step == 2, "the newest step is recovered");
        Expect(TierState::Holds(state.sd, 2), "bit-exact after a node's loss");
        stats[rank] = tier.last_stats();
      }));
      // The new node holds what the lost one held, its ranks' files and their partners'
      // replicas alike (and what its ranks read), not only what its ranks read: the job is
      // redundant again at once, so losing the node that served the recovery, before any
      // save, loses nothing.
      const auto recovered = FilesIn(NodeDir(root, lost) + step2);
      CHECK(std::includes(recovered.begin(), recovered.end(), saved.begin(), saved.end()));
      const int other = (lost + 1) % (kWorld / per_node);
      fs::remove_all(NodeDir(root, other));
      RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
        MemoryTier tier(comm, options);
        auto state = TierState::Empty(rank, kWorld);
        Expect(tier.Restore(state.sd) == 2, "step 2 again, after a second loss");
        Expect(TierState::Holds(state.sd, 2), "bit-exact after a second loss");
        // And the recovered nodes hold committed copies again: the next save goes on.
        TierState next(rank, kWorld, 3);
        tier.Save(3, next.sd);
      }));
      const int lost_leader = per_node * lost;  // first rank of the lost node
      CHECK(stats[lost_leader].files_fetched > 0);
      // With two nodes each holds the whole step: the survivor fetches nothing.
      if (per_node == 2) CHECK(stats[per_node * (1 - lost)].files_fetched == 0);
      CHECK(fs::exists(NodeDir(root, lost) + "/step-0000000002/" + kMetadataName));
      fs::remove_all(TierDir(root));
    }
  }
}

// The data file rank `writer` wrote in the step directory `dir`.
std::string WrittenBy(const std::string& dir, int32_t writer) {
  for (const DataFile& f : ReadMetadata(dir).files) {
    if (f.writer == writer) return dir + "/" + f.name;
  }
  FAIL("no data file of rank " << writer << " in " << dir);
  return "";
}

// Flips every bit of byte `at` of `path` in place.
void FlipByte(const std::string& path, uint64_t at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  REQUIRE(f);
  f.seekg(static_cast<std::streamoff>(at));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(~c);
  f.seekp(static_cast<std::streamoff>(at));
  f.write(&c, 1);
  REQUIRE(f);
}

TEST_CASE(
    "memory tier: a copy with a flipped byte is found before the restore uses it and another "
    "node's copy is read, or the step is refused when no copy is intact",
    "[memory-tier]") {
  TempDir root("tier");
  auto options = Options(root, 2);
  SaveSteps(options, {1, 2});
  // Node 0's copy of rank 0's file (its ranks read it) has one byte flipped: in its first item
  // (items start at the file's first byte, docs/FORMAT.md). Node 1 holds an intact replica.
  const std::string damaged = WrittenBy(NodeDir(root, 0) + "/step-0000000002", 0);
  const std::string replica = WrittenBy(NodeDir(root, 1) + "/step-0000000002", 0);
  FlipByte(damaged, 0);
  REQUIRE(ReadFileBytes(damaged) != ReadFileBytes(replica));
  std::vector<TierStats> stats(kWorld);
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    MemoryTier tier(comm, options);
    auto state = TierState::Empty(rank, kWorld);
    Expect(tier.Restore(state.sd) == 2, "the newest step is restored");
    Expect(TierState::Holds(state.sd, 2), "bit-exact, from the intact copy");
    stats[rank] = tier.last_stats();
  }));
  for (int r = 0; r < kWorld; ++r) CHECK(stats[r].damaged_copies == 1);
  CHECK(stats[0].files_fetched + stats[1].files_fetched == 1);  // the intact copy, to node 0
  // The fetched copy replaced the damaged one: node 0 is whole again.
  CHECK(ReadFileBytes(damaged) == ReadFileBytes(replica));

  // Both copies damaged: no rank loads anything of step 2, and every rank is told which file
  // and what is wrong with each copy.
  FlipByte(damaged, 0);
  FlipByte(replica, 0);
  auto errors = RunRanks(kWorld, [&](int rank, Communicator& comm) {
    MemoryTier tier(comm, options);
    auto state = TierState::Empty(rank, kWorld);
    tier.Restore(state.sd);
  });
  const std::string file = fs::path(damaged).filename().string();
  for (int r = 0; r < kWorld; ++r) {
    REQUIRE(errors[r]);
    try {
      std::rethrow_exception(errors[r]);
    } catch (const CollectiveError& e) {
      REQUIRE(e.failures().size() == 1);
      CHECK(e.failures()[0].code == ErrorCode::kCorruption);
      CHECK_THAT(e.what(), Contains("step 2 has no intact copy of " + file) &&
                               Contains("node 0: item 'w' at [0, 0]") &&
                               Contains("node 1: item 'w' at [0, 0]") &&
                               Contains("does not match its CRC32C"));
    }
  }
}

// A restart that loads part of the state ("w" only, at 2 ranks as 2 nodes) reads each file on
// one node but may drain it from another (FilesToDrain spreads the copying over the nodes
// holding each file), whose copy the restore never read. Node 0's replica of rank 2's file has a
// flipped byte in rank 2's rows of "w", which node 0's rank does not read: the drain checks that
// copy before it copies it, drops it, and copies node 1's intact one, so the durable step loads
// bit-exact (before, it held the damaged file).
TEST_CASE(
    "memory tier: a drain of a restored step checks the copies the restore did not read and "
    "copies an intact one",
    "[memory-tier][preempt]") {
  TempDir root("tier"), durable("durable");
  SaveSteps(Options(root, 2), {2});
  const std::string victim = WrittenBy(NodeDir(root, 0) + "/step-0000000002", 2);
  const auto [first, end] = RowRange(kRows, 2, kWorld);
  REQUIRE(RowRange(kRows, 0, 2).second <= first);  // node 0's rank reads none of them
  const TensorView rows = Clone(TierState(0, 1, 2).full_w.Narrow({first, 0}, {end - first, kCols}));
  const auto at = ReadFileBytes(victim).find(
      std::string(static_cast<const char*>(rows.data), static_cast<size_t>(rows.nbytes())));
  REQUIRE(at != std::string::npos);
  FlipByte(victim, at + 5);
  const std::string target = durable / "step-2";
  std::vector<TierStats> stats(2);
  RequireNoErrors(RunRanks(2, [&](int rank, Communicator& comm) {
    MemoryTier tier(comm, Options(root, 1));  // 2 ranks as 2 nodes, on the same directories
    auto state = TierState::Empty(rank, 2);
    StateDict weights;
    weights.Set("w", *state.sd.Find("w"));
    Expect(tier.Restore(weights) == 2, "step 2 restores");
    Expect(TierState::Holds(state.sd.Set("b", TierState(0, 1, 2).b).Set("rng", Blob{"rng-state-2"}),
                            2),
           "bit-exact");
    stats[rank] = tier.last_stats();
    tier.Drain(2, target);
  }));
  CHECK(stats[0].damaged_copies == 0);  // the restore never read the damaged copy
  RequireNoErrors(RunRanks(2, [&](int rank, Communicator& comm) {
    auto state = TierState::Empty(rank, 2);
    Load(state.sd, target, comm);
    Expect(TierState::Holds(state.sd, 2), "the drained step loads bit-exact");
  }));
  CHECK(ReadFileBytes(target + "/" + fs::path(victim).filename().string()) ==
        ReadFileBytes(WrittenBy(NodeDir(root, 1) + "/step-0000000002", 2)));
}

TEST_CASE(
    "memory tier: a step without its commit record or with a file lost everywhere is "
    "never recovered",
    "[memory-tier]") {
  TempDir root("tier");
  auto options = Options(root, 2);
  options.keep = 3;
  SaveSteps(options, {1, 2, 3});
  // Step 3: its data everywhere but no metadata (a crash before the commit vote's outcome was
  // written): not a step. Step 2: one data file lost on both nodes (a torn step): not
  // complete. Step 1 is what survives.
  for (int node = 0; node < 2; ++node) {
    fs::remove(NodeDir(root, node) + "/step-0000000003/" + kMetadataName);
  }
  std::string victim;
  for (const auto& f : FilesIn(NodeDir(root, 0) + "/step-0000000002")) {
    if (IsDataObjectName(f)) victim = f;
  }
  REQUIRE(!victim.empty());
  fs::remove(NodeDir(root, 0) + "/step-0000000002/" + victim);
  // The other node's copy is cut short: present but torn.
  fs::resize_file(NodeDir(root, 1) + "/step-0000000002/" + victim, 3);
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    MemoryTier tier(comm, options);
    Expect(tier.CompleteSteps() == std::vector<int64_t>{1}, "only step 1 is complete");
    auto state = TierState::Empty(rank, kWorld);
    auto step = tier.Restore(state.sd);
    Expect(step == 1, "step 1 recovered");
    Expect(TierState::Holds(state.sd, 1), "step 1's values");
  }));
  // Nothing survives: Restore says so on every rank.
  fs::remove_all(TierDir(root));
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    MemoryTier tier(comm, options);
    auto state = TierState::Empty(rank, kWorld);
    Expect(!tier.Restore(state.sd).has_value(), "no step in an empty tier");
  }));
}

TEST_CASE("memory tier: retention keeps the newest steps per node",
          "[memory-tier][option:MemoryTierOptions::keep]"
          "[option:MemoryTierOptions::free_on_close]") {
  TempDir root("tier");
  auto options = Options(root, 2);
  options.keep = 2;
  options.free_on_close = true;
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    MemoryTier tier(comm, options);
    for (int64_t s : {1, 2, 3, 4}) {
      TierState state(rank, kWorld, s);
      tier.Save(s, state.sd);
    }
    Expect(tier.CompleteSteps() == std::vector<int64_t>{3, 4}, "steps 3 and 4 kept");
    bool refused = false;
    try {
      TierState state(rank, kWorld, 4);
      tier.Save(4, state.sd);
    } catch (const InvalidArgumentError&) {
      refused = true;
    }
    Expect(refused, "a step that does not follow is refused");
    comm.Barrier("listed");
    tier.Close();
  }));
  CHECK(!fs::exists(NodeDir(root, 0)));
  CHECK(!fs::exists(NodeDir(root, 1)));
}

TEST_CASE(
    "memory tier: on fewer nodes than replicas + 1 saves are refused and a surviving node's "
    "step still restores at the new world size",
    "[memory-tier][option:MemoryTierOptions::replicas]") {
  TempDir root("tier");
  SaveSteps(Options(root, 2), {3, 4});  // 2 nodes, 1 replica: each node holds every file
  // Node 1 is gone for good; the job restarts on node 0 alone, with 2 ranks and the same
  // options: one node cannot hold a replica.
  fs::remove_all(NodeDir(root, 1));
  constexpr int kSurvivors = 2;
  std::vector<int64_t> restored(kSurvivors, -1);
  auto errors = RunRanks(kSurvivors, [&](int rank, Communicator& comm) {
    MemoryTier tier(comm, Options(root, 2));
    Expect(tier.node_count() == 1 && tier.partners().empty(), "one node, no partners");
    auto back = TierState::Empty(rank, kSurvivors);
    restored[rank] = tier.Restore(back.sd).value_or(-1);
    Expect(TierState::Holds(back.sd, 4), "step 4's values, resharded from 4 ranks to 2");
    TierState next(rank, kSurvivors, 5);
    tier.Save(5, next.sd);  // refused
  });
  for (int r = 0; r < kSurvivors; ++r) {
    CHECK(restored[r] == 4);
    REQUIRE(errors[r]);
    try {
      std::rethrow_exception(errors[r]);
    } catch (const InvalidArgumentError& err) {
      CHECK_THAT(err.what(), Contains("need 2 nodes") && Contains("has 1") &&
                                 Contains("Restore, CompleteSteps and Drain work"));
    }
  }
}

TEST_CASE("memory tier: a drained step is an ordinary durable checkpoint", "[memory-tier]") {
  TempDir root("tier"), durable("durable");
  auto options = Options(root, 2);
  const std::string target = durable / "step-5";
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    MemoryTier tier(comm, options);
    TierState state(rank, kWorld, 5);
    tier.Save(5, state.sd);
    tier.Drain(5, target);
    bool refused = false;
    try {
      tier.Drain(5, target);  // a checkpoint is there now
    } catch (const CollectiveError& e) {
      refused = std::string(e.what()).find("already holds") != std::string::npos;
    }
    Expect(refused, "draining over a checkpoint is refused");
  }));
  // Loads with no tier at all, at another world size.
  RequireNoErrors(RunRanks(2, [&](int rank, Communicator& comm) {
    auto state = TierState::Empty(rank, 2);
    Load(state.sd, target, comm);
    Expect(TierState::Holds(state.sd, 5), "drained step 5 loads");
  }));
}

TEST_CASE("communicator: all-to-all delivers each rank's message for every other rank",
          "[memory-tier][communicator]") {
  std::vector<std::vector<std::string>> got(kWorld);
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    for (int round = 0; round < 3; ++round) {
      std::vector<std::string> out(kWorld);
      for (int d = 0; d < kWorld; ++d) {
        if ((rank + d + round) % 3 != 0) {
          out[d] = std::to_string(rank) + ">" + std::to_string(d) + "#" + std::to_string(round);
        }
      }
      got[rank] = comm.AllToAll(std::move(out), "test/all-to-all");
      for (int s = 0; s < kWorld; ++s) {
        const std::string want =
            (s + rank + round) % 3 != 0
                ? std::to_string(s) + ">" + std::to_string(rank) + "#" + std::to_string(round)
                : "";
        Expect(got[rank][s] == want, "message from " + std::to_string(s));
      }
    }
    bool refused = false;
    try {
      comm.AllToAll({"x"}, "test/short");
    } catch (const InvalidArgumentError&) {
      refused = true;
    }
    Expect(refused, "a short message list is refused");
  }));
  // The default (one Scatter per root) agrees, on a group of one.
  LocalCommunicator one;
  CHECK(one.AllToAll({"self"}, "test") == std::vector<std::string>{"self"});
}

TEST_CASE(
    "memory tier: background saves block only for the snapshot and drain without a second "
    "one",
    "[memory-tier][async]") {
  TempDir root("tier"), durable("durable");
  auto options = Options(root, 2);
  auto bg = BackgroundCommunicators();
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    MemoryTier tier(comm, options, std::move(bg[rank]));
    for (int64_t s : {1, 2, 3}) {
      TierState state(rank, kWorld, s);
      auto handle = tier.SaveAsync(s, state.sd, {}, s == 2 ? durable / "step-2" : "");
      // The state may change at once: the step holds the values at the call.
      auto& w = std::get<ShardedTensor>(*state.sd.Find("w"));
      for (auto& shard : w.local_shards) std::memset(shard.view.data, 0xff, shard.view.nbytes());
      state.sd.Set("rng", Blob{"changed"});
      if (s == 3) handle->Wait();
    }
    auto back = TierState::Empty(rank, kWorld);
    Expect(tier.Restore(back.sd) == 3, "step 3 restored");
    Expect(TierState::Holds(back.sd, 3), "step 3 holds the values at its call");
    tier.Close();
  }));
  // The drained step is a durable checkpoint with step 2's values.
  RequireNoErrors(RunRanks(2, [&](int rank, Communicator& comm) {
    auto state = TierState::Empty(rank, 2);
    Load(state.sd, durable / "step-2", comm);
    Expect(TierState::Holds(state.sd, 2), "drained step 2 loads");
  }));
}

TEST_CASE("memory tier: a background save's failure is raised by the next call on every rank",
          "[memory-tier][async]") {
  TempDir root("tier"), durable("durable");
  auto options = Options(root, 2);
  auto bg = BackgroundCommunicators();
  // A checkpoint already sits where step 1 drains: the drain fails, after the tier committed.
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    TierState state(rank, kWorld, 0);
    Save(state.sd, durable / "taken", comm);
  }));
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    MemoryTier tier(comm, options, std::move(bg[rank]));
    TierState state(rank, kWorld, 1);
    tier.SaveAsync(1, state.sd, {}, durable / "taken");
    bool raised = false;
    try {
      tier.SaveAsync(2, state.sd);
    } catch (const CollectiveError& e) {
      raised = std::string(e.what()).find("already holds") != std::string::npos;
    }
    Expect(raised, "the drain's failure is raised by the next save");
    // Step 1 is committed in the tier all the same.
    Expect(tier.CompleteSteps() == std::vector<int64_t>{1}, "step 1 is in the tier");
    tier.Close();
  }));
}

TEST_CASE(
    "checkpoint manager with a memory tier: every step to memory, every k-th drained to "
    "the root, restore from the newest",
    "[memory-tier][manager][option:ManagerOptions::memory_tier]"
    "[option:ManagerOptions::memory_every][option:ManagerOptions::durable_every]") {
  TempDir root("tier"), durable("durable");
  for (bool background : {true, false}) {
    DYNAMIC_SECTION((background ? "background" : "synchronous")) {
      ManagerOptions mo;
      mo.memory_tier = Options(root, 2);
      mo.memory_every = 2;   // even steps to memory
      mo.durable_every = 3;  // multiples of 3 also to the root
      const std::string where = durable / (background ? "bg" : "sync");
      auto bg = BackgroundCommunicators();
      std::vector<std::vector<int64_t>> durable_steps(kWorld), memory_steps(kWorld);
      std::set<std::string> step8_copies;  // the nodes' directories of step 8
      std::mutex copies_mu;
      RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
        CheckpointManager manager(where, comm, background ? std::move(bg[rank]) : nullptr, mo);
        {
          std::lock_guard<std::mutex> lock(copies_mu);
          step8_copies.insert(manager.memory_tier()->StepDirectory(8));
        }
        for (int64_t s = 1; s <= 8; ++s) {
          TierState state(rank, kWorld, s);
          manager.Save(s, state.sd);
        }
        manager.Wait();
        durable_steps[rank] = CompleteCheckpoints(where);
        memory_steps[rank] = manager.memory_tier()->CompleteSteps();
        Expect(manager.CompleteSteps() == std::vector<int64_t>{3, 6, 8},
               "the manager's steps: the root's and the tier's");
        Expect(manager.LatestStep() == 8, "the newest step is the tier's");
        auto back = TierState::Empty(rank, kWorld);
        Expect(manager.Restore(back.sd) == 8, "the newest step (8) is in memory");
        Expect(manager.restore_source() == "memory", "restored from memory");
        Expect(TierState::Holds(back.sd, 8), "step 8's values");
        manager.Close();
      }));
      // Steps 3 and 6 went to the root (1, 5 and 7 nowhere); the tier keeps 2 steps: 6 and 8.
      CHECK(durable_steps[0] == std::vector<int64_t>{3, 6});
      CHECK(memory_steps[0] == std::vector<int64_t>{6, 8});
      REQUIRE(step8_copies.size() == 2);
      // Rank 0's file of step 8 damaged on both nodes: the tier refuses step 8 and the manager
      // restores the root's newest step instead, saying why.
      // A restart whose manager restores step 6 from the root; each rank's fallbacks.
      auto restart_restores_6 = [&] {
        std::vector<std::vector<std::string>> fallbacks(kWorld);
        RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
          CheckpointManager manager(where, comm, nullptr, mo);
          auto back = TierState::Empty(rank, kWorld);
          Expect(manager.Restore(back.sd) == 6, "step 6 from the root");
          Expect(manager.restore_source() == "durable", "restored from the root");
          Expect(TierState::Holds(back.sd, 6), "step 6's values");
          fallbacks[rank] = manager.restore_fallbacks();
        }));
        return fallbacks;
      };
      for (const std::string& copy : step8_copies) FlipByte(WrittenBy(copy, 0), 0);
      const auto fallbacks = restart_restores_6();
      for (int r = 0; r < kWorld; ++r) {
        REQUIRE(fallbacks[r].size() == 1);
        CHECK_THAT(fallbacks[r][0],
                   Contains("memory tier") && Contains("step 8 has no intact copy of data-"));
      }
      // Every node lost: the restart restores the newest durable step.
      fs::remove_all(TierAnchor(root));
      restart_restores_6();
    }
  }
}

TEST_CASE("memory tier: freed steps' files are written over by the next steps, truncated to size",
          "[memory-tier]") {
  TempDir root("tier");
  auto options = Options(root, 2);
  options.keep = 1;
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    MemoryTier tier(comm, options);
    for (int64_t s = 1; s <= 4; ++s) {
      // A blob that shrinks every step: a reused file is longer than what goes in it.
      TierState state(rank, kWorld, s);
      state.sd.Set("big", Blob{std::string(4000 - 900 * s, static_cast<char>('a' + s))});
      tier.Save(s, state.sd);
      comm.Barrier("saved");
      if (rank == 0) {
        const std::string dir = tier.StepDirectory(s);
        const Metadata md = ReadMetadata(dir);
        std::map<std::string, uint64_t> extent;
        for (const auto& [index, info] : md.storage) {
          extent[info.relative_path] =
              std::max(extent[info.relative_path], info.offset + info.length);
        }
        for (const DataFile& f : md.files) extent[f.name] = f.size;  // version 2: + its index
        for (const auto& [file, end] : extent) {
          Expect(fs::file_size(dir + "/" + file) == end, file + " is exactly as long as its items");
        }
      }
      comm.Barrier("checked");
      auto back = TierState::Empty(rank, kWorld);
      back.sd.Set("big", Blob{});
      Expect(tier.Restore(back.sd) == s, "restored");
      Expect(TierState::Holds(back.sd, s), "values of the step");
      Expect(std::get<Blob>(*back.sd.Find("big")).bytes ==
                 std::string(4000 - 900 * s, static_cast<char>('a' + s)),
             "the shrinking blob");
    }
  }));
  // Only the newest step and the files of the one before it, waiting to be reused, remain.
  CHECK(FilesIn(NodeDir(root, 0)) == std::set<std::string>{"LOCK", "recycle", "step-0000000004"});
  CHECK(!FilesIn(NodeDir(root, 0) + "/recycle").empty());
}

// Forwards to a communicator (borrowed or owned). Its duplicates are forwarders too, owning
// the inner one's duplicate; on rank `fail_rank` the `fail_at`-th bulk exchange of a duplicate
// poisons it and throws (-1: never).
class ForwardingCommunicator : public Communicator {
 public:
  explicit ForwardingCommunicator(Communicator& inner, int fail_rank = -1, int fail_at = -1,
                                  bool duplicate = false)
      : inner_(inner), fail_rank_(fail_rank), fail_at_(fail_at), duplicate_(duplicate) {
    set_timeout(std::chrono::seconds(5));
  }
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::vector<std::string> Gather(std::string m, int root, std::string_view what) override {
    return inner_.Gather(std::move(m), root, what);
  }
  std::string Scatter(std::vector<std::string> m, int root, std::string_view what) override {
    return inner_.Scatter(std::move(m), root, what);
  }
  std::string Broadcast(std::string m, int root, std::string_view what) override {
    return inner_.Broadcast(std::move(m), root, what);
  }
  std::vector<std::string> AllGather(std::string m, std::string_view what) override {
    return inner_.AllGather(std::move(m), what);
  }
  void Barrier(std::string_view what) override { inner_.Barrier(what); }
  std::vector<std::string> AllToAll(std::vector<std::string> m, std::string_view what) override {
    return inner_.AllToAll(std::move(m), what);
  }
  void ExchangeBytes(const std::vector<BulkSend>& sends, const std::vector<BulkReceive>& receives,
                     std::string_view what) override {
    if (duplicate_ && rank() == fail_rank_ && ++exchanges_ == fail_at_) {
      Poison("injected: the replication's transport broke");
      inner_.Poison("injected: the replication's transport broke");
      throw IoError("injected: the replication's transport broke on rank " + std::to_string(rank()),
                    /*retryable=*/false);
    }
    inner_.ExchangeBytes(sends, receives, what);
  }
  std::unique_ptr<Communicator> Duplicate() override {
    auto copy = inner_.Duplicate();
    copy->set_timeout(std::chrono::seconds(5));
    auto out = std::make_unique<ForwardingCommunicator>(*copy, fail_rank_, fail_at_, true);
    out->owned_ = std::move(copy);
    return out;
  }

 private:
  Communicator& inner_;
  std::unique_ptr<Communicator> owned_;
  const int fail_rank_, fail_at_;
  const bool duplicate_;
  int exchanges_ = 0;
};

// Counts the AllToAlls the memory tier asks for.
class CountingCommunicator : public ForwardingCommunicator {
 public:
  explicit CountingCommunicator(Communicator& inner) : ForwardingCommunicator(inner) {}
  std::vector<std::string> AllToAll(std::vector<std::string> m, std::string_view what) override {
    if (what.substr(0, 5) == "tier/") ++tier_all_to_alls;
    return ForwardingCommunicator::AllToAll(std::move(m), what);
  }
  int tier_all_to_alls = 0;
};

TEST_CASE(
    "memory tier: saves and restores exchange file headers between the ranks that move files only",
    "[memory-tier][communicator]") {
  TempDir root("tier");
  std::vector<int> all_to_alls(kWorld, -1);
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    CountingCommunicator counting(comm);
    MemoryTier tier(counting, Options(root, 2));
    for (int64_t s = 1; s <= 3; ++s) {
      TierState state(rank, kWorld, s);
      tier.Save(s, state.sd);
    }
    // A restore that fetches node 1's lost files from node 0.
    comm.Barrier("saved");
    if (rank == 0) fs::remove_all(NodeDir(root, 1));
    comm.Barrier("lost");
    auto back = TierState::Empty(rank, kWorld);
    Expect(tier.Restore(back.sd) == 3 && TierState::Holds(back.sd, 3), "step 3 restored");
    Expect(rank != 2 || tier.last_stats().files_fetched > 0, "node 1 fetched its files");
    all_to_alls[rank] = counting.tier_all_to_alls;
  }));
  for (int r = 0; r < kWorld; ++r) {
    INFO("rank " << r);
    CHECK(all_to_alls[r] == 0);
  }
}

// Lines of /proc/self/maps that map a file under `dir`.
int MappingsUnder(const std::string& dir) {
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.find(dir + "/") != std::string::npos) ++n;
  }
  return n;
}

TEST_CASE("memory tier: saves in the steady state map nothing anew and Close unmaps every file",
          "[memory-tier][option:MemoryTierOptions::keep]") {
  TempDir root("tier");
  auto options = Options(root, 2);
  options.keep = 1;
  std::vector<std::vector<uint64_t>> mapped(kWorld);
  std::atomic<int> mapped_before_close{0};
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    MemoryTier tier(comm, options);
    for (int64_t s = 1; s <= 5; ++s) {
      TierState state(rank, kWorld, s);
      tier.Save(s, state.sd);
      mapped[rank].push_back(tier.last_stats().bytes_mapped);
    }
    comm.Barrier("saved");
    if (rank == 0) mapped_before_close = MappingsUnder(root.path());
    comm.Barrier("counted");
    tier.Close();
  }));
  for (int r = 0; r < kWorld; ++r) {
    INFO("rank " << r);
    // Steps 1 and 2 find no freed files (keep = 1 frees step 1 only once step 2 is committed);
    // from step 3 on each rank writes over, and sends from, the files it mapped before.
    CHECK(mapped[r][0] > 0);
    CHECK(mapped[r][2] == 0);
    CHECK(mapped[r][3] == 0);
    CHECK(mapped[r][4] == 0);
  }
  CHECK(mapped_before_close > 0);
  CHECK(MappingsUnder(root.path()) == 0);
}

// ---------------------------------------------------------------------------------------------
// One job, one owner (issue 43): the tier's steps belong to the job that wrote them, and its
// directories to the user who runs it.

namespace {

// A manager job of `world` ranks (one node each: every rank keeps a replica of its partner's
// files) on the durable root `where`, saving steps [first, last] to memory (every 4th also to
// the root); then it restores and reports the step and whether the values are that step's.
struct JobOutcome {
  std::vector<std::vector<int64_t>> tier_steps;
  int64_t restored = -1;
  std::string source;
  bool exact = false;
};

ManagerOptions TierManagerOptions(const TempDir& root, int ranks_per_node) {
  ManagerOptions mo;
  mo.memory_tier = Options(root, ranks_per_node);
  mo.memory_tier->keep = 3;
  mo.durable_every = 4;
  return mo;
}

}  // namespace

TEST_CASE(
    "memory tier: two jobs on one node with the default name never free or restore each "
    "other's steps, and a new job restores nothing of a stranger's",
    "[memory-tier][manager][owner][option:MemoryTierOptions::owner]") {
  TempDir root("tier"), durable("durable");
  constexpr int kJobWorld = 2;
  auto run_job = [&](const std::string& where, int64_t first, int64_t last, JobOutcome& out) {
    out.tier_steps.assign(kJobWorld, {});
    auto errors = RunRanks(kJobWorld, [&](int rank, Communicator& comm) {
      auto mo = TierManagerOptions(root, 1);
      mo.memory_tier->name = "default";
      CheckpointManager manager(where, comm, nullptr, mo);
      for (int64_t s = first; s <= last; ++s) {
        TierState state(rank, kJobWorld, s);
        manager.Save(s, state.sd);
      }
      out.tier_steps[rank] = manager.memory_tier()->CompleteSteps();
      manager.Close();
    });
    RequireNoErrors(errors);
  };
  // Two jobs at once on the same nodes, the same tier name, their own roots.
  JobOutcome a, b;
  std::thread job_a([&] { run_job(durable / "a", 1, 40, a); });
  std::thread job_b([&] { run_job(durable / "b", 1001, 1040, b); });
  job_a.join();
  job_b.join();
  for (int r = 0; r < kJobWorld; ++r) {
    CHECK(a.tier_steps[r] == std::vector<int64_t>{38, 39, 40});
    CHECK(b.tier_steps[r] == std::vector<int64_t>{1038, 1039, 1040});
  }
  // Each job restarted on its own root restores its own newest step from memory, bit-exact; a
  // new job on an empty root restores nothing (it finds no step of its own anywhere).
  auto restore = [&](const std::string& where) {
    JobOutcome out;
    std::vector<int64_t> got(kJobWorld, -1);
    std::vector<std::string> source(kJobWorld);
    std::vector<int> exact(kJobWorld, 0);
    RequireNoErrors(RunRanks(kJobWorld, [&](int rank, Communicator& comm) {
      auto mo = TierManagerOptions(root, 1);
      mo.memory_tier->name = "default";
      CheckpointManager manager(where, comm, nullptr, mo);
      auto back = TierState::Empty(rank, kJobWorld);
      auto step = manager.Restore(back.sd);
      got[rank] = step.value_or(-1);
      source[rank] = manager.restore_source();
      exact[rank] = step && TierState::Holds(back.sd, *step);
    }));
    for (int r = 1; r < kJobWorld; ++r) {
      CHECK(got[r] == got[0]);
      CHECK(source[r] == source[0]);
    }
    out.restored = got[0];
    out.source = source[0];
    out.exact = exact[0] && exact[1];
    return out;
  };
  const JobOutcome again_a = restore(durable / "a");
  CHECK(again_a.restored == 40);
  CHECK(again_a.source == "memory");
  CHECK(again_a.exact);
  const JobOutcome again_b = restore(durable / "b");
  CHECK(again_b.restored == 1040);
  CHECK(again_b.source == "memory");
  CHECK(again_b.exact);
  const JobOutcome stranger = restore(durable / "new-job");
  CHECK(stranger.restored == -1);
  CHECK(stranger.source == "");
}

TEST_CASE(
    "memory tier: a second process of one job on a node is refused naming the holder, and a "
    "directory recorded for another owner is refused",
    "[memory-tier][owner][option:MemoryTierOptions::owner]") {
  TempDir root("tier");
  auto options = Options(root, 2);
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    MemoryTier first(comm, options);
    TierState state(rank, kWorld, 1);
    first.Save(1, state.sd);
    const std::string message = MessageOf<Error>([&] { MemoryTier second(comm, options); });
    Expect(message.find("locked") != std::string::npos &&
               message.find("pid=" + std::to_string(::getpid())) != std::string::npos,
           "the second tier on the node is refused, naming the holder: " + message);
  }));
  // The lock went with the first tier: the job restarts and restores its step.
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    MemoryTier tier(comm, options);
    auto back = TierState::Empty(rank, kWorld);
    Expect(tier.Restore(back.sd) == 1 && TierState::Holds(back.sd, 1), "step 1 restored");
  }));
  // A job directory whose record names another owner is not this job's.
  auto owned = options;
  owned.owner = "file:///jobs/a";
  fs::create_directories(MemoryTier::JobDirectory(owned));
  ::chmod(MemoryTier::JobDirectory(owned).c_str(), 0700);
  std::ofstream(MemoryTier::JobDirectory(owned) + "/JOB") << "owner=file:///jobs/b\n";
  auto errors = RunRanks(kWorld, [&](int, Communicator& comm) { MemoryTier tier(comm, owned); });
  for (const auto& e : errors) {
    REQUIRE(e);
    try {
      std::rethrow_exception(e);
    } catch (const CollectiveError& err) {
      CHECK(err.failures().front().code == ErrorCode::kInvalidArgument);
      CHECK_THAT(err.what(),
                 Contains("holds the steps of another job") && Contains("owner=file:///jobs/b"));
    }
  }
}

TEST_CASE(
    "memory tier: its directories and files are the user's alone, and a directory that is "
    "another's, a link or writable by others is refused saying what to do",
    "[memory-tier][owner][security]") {
  TempDir root("tier");
  auto options = Options(root, 2);
  SaveSteps(options, {1});
  auto mode = [](const std::string& path) {
    struct stat sb {};
    REQUIRE(::lstat(path.c_str(), &sb) == 0);
    return sb.st_mode & 07777;
  };
  const std::string anchor = TierAnchor(root);
  CHECK(mode(anchor) == 0700);
  CHECK(mode(TierDir(root)) == 0700);
  CHECK(mode(NodeDir(root, 0)) == 0700);
  const std::string step = NodeDir(root, 1) + "/step-0000000001";
  CHECK(mode(step) == 0700);
  for (const auto& name : FilesIn(step)) {
    INFO(name);
    CHECK(mode(step + "/" + name) == 0600);
  }
  auto refused = [&](const MemoryTierOptions& o) {
    auto errors = RunRanks(kWorld, [&](int, Communicator& comm) { MemoryTier tier(comm, o); });
    std::string message;
    for (const auto& e : errors) {
      if (!e) return std::string("(not refused)");
      try {
        std::rethrow_exception(e);
      } catch (const CollectiveError& err) {
        if (err.failures().front().code != ErrorCode::kInvalidArgument) return std::string("code");
        message = err.what();
      }
    }
    return message;
  };
  // Writable by others: a step may have been planted.
  ::chmod(anchor.c_str(), 0777);
  CHECK_THAT(refused(options), Contains("writable by other users") && Contains("shm_root"));
  ::chmod(anchor.c_str(), 0700);
  // Another user's (root may hand it over; the tier refuses it).
  if (::geteuid() == 0) {
    REQUIRE(::chown(anchor.c_str(), 4242, 4242) == 0);
    CHECK_THAT(refused(options), Contains("belongs to uid 4242"));
    REQUIRE(::chown(anchor.c_str(), 0, 0) == 0);
  }
  // A link in the anchor's place (to a directory the planter controls) is never followed.
  TempDir elsewhere("elsewhere");
  fs::rename(anchor, elsewhere / "moved");
  fs::create_directory_symlink(elsewhere / "moved", anchor);
  CHECK_THAT(refused(options), Contains("symbolic link"));
  fs::remove(anchor);
  fs::rename(elsewhere / "moved", anchor);
  // A shm_root others may write without the sticky bit.
  TempDir open_root("open");
  ::chmod(open_root.path().c_str(), 0777);
  auto in_open = options;
  in_open.shm_root = open_root.path();
  CHECK_THAT(refused(in_open), Contains("without the sticky bit"));
  ::chmod(open_root.path().c_str(), 01777);
  CHECK(refused(in_open) == "(not refused)");
  // Back as it was: the job's step restores.
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    MemoryTier tier(comm, options);
    auto back = TierState::Empty(rank, kWorld);
    Expect(tier.Restore(back.sd) == 1 && TierState::Holds(back.sd, 1), "step 1 restored");
  }));
}

TEST_CASE(
    "memory tier: links and FIFOs in its directory are never followed or waited on: retention "
    "and saves leave files outside the tier alone",
    "[memory-tier][owner][security]") {
  TempDir root("tier"), victim("victim");
  auto options = Options(root, 2);
  options.keep = 1;
  // The victim: a durable checkpoint and a file outside the tier.
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    TierState state(rank, kWorld, 7);
    Save(state.sd, victim / "ckpt", comm);
  }));
  const std::string secret = victim / "secret.txt";
  std::ofstream(secret) << "not the tier's";
  SaveSteps(options, {1, 2});
  // A step directory that is a link to the victim's checkpoint (retention would free it), a
  // recycled data file that is a link to the victim's file (the next save would write through
  // it), and a committed step whose metadata is a FIFO.
  fs::create_directory_symlink(victim / "ckpt", NodeDir(root, 0) + "/step-0000000000");
  const std::string recycle = NodeDir(root, 1) + "/recycle";
  REQUIRE(fs::exists(recycle));
  std::string recycled;
  for (const auto& name : FilesIn(recycle)) recycled = name;
  REQUIRE(!recycled.empty());
  for (const auto& name : FilesIn(recycle)) fs::remove(recycle + "/" + name);
  fs::create_symlink(secret, recycle + "/" + recycled);
  const std::string fifo_step = NodeDir(root, 0) + "/step-0000000009";
  fs::create_directory(fifo_step);
  REQUIRE(::mkfifo((fifo_step + "/" + kMetadataName).c_str(), 0600) == 0);
  // A watchdog: opening the FIFO for writing frees a reader that waits on it, and says so.
  std::atomic<bool> done{false}, waited{false};
  std::thread watchdog([&] {
    for (int i = 0; i < 100 && !done; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (done) return;
    waited = true;
    int fd = ::open((fifo_step + "/" + kMetadataName).c_str(), O_WRONLY | O_NONBLOCK);
    if (fd >= 0) ::close(fd);
  });
  std::vector<int64_t> restored(kWorld, -1);
  auto errors = RunRanks(kWorld, [&](int rank, Communicator& comm) {
    MemoryTier tier(comm, options);
    auto back = TierState::Empty(rank, kWorld);
    restored[rank] = tier.Restore(back.sd).value_or(-1);
    Expect(TierState::Holds(back.sd, 2), "step 2 restored");
    TierState state(rank, kWorld, 3);
    tier.Save(3, state.sd);
  });
  done = true;
  watchdog.join();
  RequireNoErrors(errors);
  CHECK_FALSE(waited);
  for (int r = 0; r < kWorld; ++r) CHECK(restored[r] == 2);
  // The victim's files are as they were; the links are gone or left, never followed.
  std::ifstream in(secret);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(text == "not the tier's");
  CHECK(fs::exists(victim / "ckpt/" + kMetadataName));
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    auto back = TierState::Empty(rank, kWorld);
    Load(back.sd, victim / "ckpt", comm);
    Expect(TierState::Holds(back.sd, 7), "the victim's checkpoint loads as it was");
  }));
}

TEST_CASE(
    "checkpoint manager with a memory tier: durable steps honour the root's format and "
    "compression, replace a step when allowed, count in LatestStep, and go on where the tier "
    "cannot save",
    "[memory-tier][manager]") {
  TempDir root("tier"), durable("durable");
  auto compressible = [](int rank, int world, int64_t step) {
    TierState state(rank, world, step);
    TensorView z = TensorView::Allocate(DType::kFloat32, {4096});
    std::memset(z.data, 0, z.nbytes());
    static_cast<float*>(z.data)[0] = static_cast<float>(step);
    state.sd.Set("z", z);
    return state;
  };
  SECTION("compression and format") {
    for (bool background : {false, true}) {
      auto mo = TierManagerOptions(root, 2);
      mo.memory_tier->name = background ? "bg" : "sync";
      mo.durable_every = 2;
      mo.save.storage.compression = Compression::kZstd;
      const std::string where = durable / (background ? "zbg" : "zsync");
      auto bg = BackgroundCommunicators();
      RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
        CheckpointManager manager(where, comm, background ? std::move(bg[rank]) : nullptr, mo);
        for (int64_t s = 1; s <= 2; ++s) {
          auto state = compressible(rank, kWorld, s);
          manager.Save(s, state.sd);
        }
        manager.Close();
      }));
      const Metadata md = ReadMetadata(where + "/step-0000000002");
      const auto& z = md.storage.at(MetadataIndex{"z", {0}, {}});
      INFO((background ? "background" : "synchronous"));
      CHECK(z.transforms == std::vector<std::string>{"zstd"});
      RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
        auto back = compressible(rank, kWorld, -1);
        Load(back.sd, where + "/step-0000000002", comm);
        Expect(TierState::Holds(back.sd, 2), "the durable step loads");
      }));
    }
    auto mo = TierManagerOptions(root, 2);
    mo.memory_tier->name = "st";
    mo.durable_every = 1;
    mo.save.storage.format = CheckpointFormat::kSafetensors;
    const std::string where = durable / "st";
    RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
      CheckpointManager manager(where, comm, nullptr, mo);
      auto state = compressible(rank, kWorld, 1);
      state.sd.items().erase("rng");  // safetensors holds tensors only
      manager.Save(1, state.sd);
    }));
    int safetensors_files = 0;
    for (const auto& name : FilesIn(where + "/step-0000000001")) {
      safetensors_files += name.size() > 12 && name.substr(name.size() - 12) == ".safetensors";
    }
    CHECK(safetensors_files > 0);
    CHECK_FALSE(fs::exists(where + "/step-0000000001/" + std::string(kMetadataName)));
  }
  SECTION("allow_replacing_steps") {
    auto mo = TierManagerOptions(root, 2);
    mo.durable_every = 1;
    const std::string where = durable / "replace";
    RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
      CheckpointManager manager(where, comm, nullptr, mo);
      for (int64_t s = 1; s <= 3; ++s) {
        TierState state(rank, kWorld, s);
        manager.Save(s, state.sd);
      }
    }));
    mo.allow_replacing_steps = true;
    mo.memory_tier->name = "replace-again";
    RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
      CheckpointManager manager(where, comm, nullptr, mo);
      TierState other(rank, kWorld, 33);  // step 3 again, with other values
      manager.Save(3, other.sd);
      auto back = TierState::Empty(rank, kWorld);
      Expect(manager.Restore(back.sd) == 3 && TierState::Holds(back.sd, 33),
             "memory holds the replacement");
    }));
    const std::string step3 = where + "/step-0000000003";
    std::set<std::string> data_files;
    for (const auto& name : FilesIn(step3)) {
      if (name != kMetadataName) data_files.insert(name);
    }
    CHECK(data_files == ReadMetadata(step3).DataFileNames());  // no stray file
    RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
      auto back = TierState::Empty(rank, kWorld);
      Load(back.sd, step3, comm);
      Expect(TierState::Holds(back.sd, 33), "the root holds the replacement too");
    }));
  }
  SECTION("one node with a replica to keep: durable saves go on") {
    for (bool background : {false, true}) {
      auto mo = TierManagerOptions(root, 2);  // 2 ranks, one node: the replica has nowhere to go
      mo.durable_every = 2;
      const std::string where = durable / (background ? "one-bg" : "one-sync");
      InProcessGroup group(2);
      std::vector<std::unique_ptr<Communicator>> bg;
      for (int r = 0; r < 2; ++r) bg.push_back(group.Release(r));
      std::vector<std::vector<int64_t>> steps(2);
      RequireNoErrors(RunRanks(2, [&](int rank, Communicator& comm) {
        CheckpointManager manager(where, comm, background ? std::move(bg[rank]) : nullptr, mo);
        for (int64_t s = 1; s <= 4; ++s) {
          TierState state(rank, 2, s);
          manager.Save(s, state.sd);
        }
        manager.Wait();
        steps[rank] = manager.CompleteSteps();
        auto back = TierState::Empty(rank, 2);
        Expect(manager.Restore(back.sd) == 4 && TierState::Holds(back.sd, 4), "step 4 restores");
        manager.Close();
      }));
      INFO((background ? "background" : "synchronous"));
      CHECK(steps[0] == std::vector<int64_t>{2, 4});
      CHECK(steps[1] == steps[0]);
    }
  }
}

// Steps 1 to `last` saved through a manager of kWorld ranks at `where`, then closed.
void SaveManagedSteps(const std::string& where, const ManagerOptions& mo, int64_t last) {
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    CheckpointManager manager(where, comm, nullptr, mo);
    for (int64_t s = 1; s <= last; ++s) {
      TierState state(rank, kWorld, s);
      manager.Save(s, state.sd);
    }
    manager.Close();
  }));
}

// The preemption handler of a program whose own signal handler calls NotifyPreemption (SIGTERM
// keeps its disposition), with a 20 s window.
void HandleNotices(CheckpointManager& manager, std::unique_ptr<Communicator> comm) {
  PreemptionOptions po;
  po.on_sigterm = false;
  po.grace_period = std::chrono::seconds(20);
  manager.HandlePreemption(std::move(comm), po);
}

// The nodes are gone with their memory: a restart at `world` ranks restores `step` from the
// root, bit-exact.
void ExpectRestartFromRoot(const TempDir& root, const std::string& where, const ManagerOptions& mo,
                           int64_t step, int world = kWorld) {
  fs::remove_all(TierAnchor(root));
  RequireNoErrors(RunRanks(world, [&](int rank, Communicator& comm) {
    CheckpointManager manager(where, comm, nullptr, mo);
    auto back = TierState::Empty(rank, world);
    Expect(manager.Restore(back.sd) == step, "the step drained on preemption");
    Expect(manager.restore_source() == "durable", "from the root");
    Expect(TierState::Holds(back.sd, step), "its values, from the root");
    manager.Close();
  }));
  fs::remove_all(TierAnchor(root));
}

// A restart at `world` ranks whose handlers get the notice before the job restores anything;
// then `after` runs on each rank (the job's thread) before the manager closes. Returns each
// rank's report.
std::vector<PreemptionReport> NoticeBeforeRestore(
    const std::string& where, const ManagerOptions& mo, int world,
    const std::function<void(int, CheckpointManager&)>& after = {}) {
  InProcessGroup handlers(world);
  std::vector<std::unique_ptr<Communicator>> handler_comms;
  for (int r = 0; r < world; ++r) handler_comms.push_back(handlers.Release(r));
  std::vector<PreemptionReport> reports(world);
  RequireNoErrors(RunRanks(world, [&](int rank, Communicator& comm) {
    CheckpointManager manager(where, comm, nullptr, mo);
    HandleNotices(manager, std::move(handler_comms[rank]));
    comm.Barrier("test/handlers-installed");
    if (rank == 0) NotifyPreemption();
    reports[rank] = manager.WaitForPreemption(std::chrono::seconds(30));
    if (after) after(rank, manager);
    manager.Close();
  }));
  return reports;
}

// Every rank's handler ended without an error, reporting `step` (-1: none) and whether it
// drained it.
void ExpectReports(const std::vector<PreemptionReport>& reports, int64_t step, bool drained) {
  for (size_t r = 0; r < reports.size(); ++r) {
    INFO("rank " << r << ": " << reports[r].error);
    CHECK(reports[r].done);
    CHECK(reports[r].error.empty());
    CHECK(reports[r].step == step);
    CHECK(reports[r].drained == drained);
  }
}

// Preemption (issue 48, part 1). SIGTERM, raised on one rank's thread, reaches every rank's
// handler (one process here, as under a scheduler every process gets it); each agrees on the
// tier's newest committed step and drains it to the root, on its own communicator, while one
// rank's job thread sits inside a collective the others have not joined: the drain must not
// need it. Saves after the notice are refused on every rank. A restart whose nodes' memory is
// gone restores the drained step from the root, bit-exact.
TEST_CASE(
    "preempt: on SIGTERM the ranks agree on the tier's newest committed step and drain it to "
    "the root while a rank is inside a collective, later saves are refused, a restart without "
    "the tier restores it",
    "[memory-tier][manager][preempt][sigterm][option:PreemptionOptions::grace_period]") {
  TempDir root("tier"), durable("durable");
  struct sigaction before {};  // Catch2's own handler, here
  ::sigaction(SIGTERM, nullptr, &before);
  for (bool background : {true, false}) {
    DYNAMIC_SECTION((background ? "background" : "synchronous")) {
      ManagerOptions mo;
      mo.memory_tier = Options(root, 2);
      mo.durable_every = 4;  // step 4 goes to the root as usual; 5 and 6 only to memory
      const std::string where = durable / (background ? "bg" : "sync");
      auto bg = BackgroundCommunicators();
      auto handler_comms = BackgroundCommunicators();
      std::vector<PreemptionReport> reports(kWorld);
      RequireNoErrors(RunRanks(
          kWorld,
          [&](int rank, Communicator& comm) {
            CheckpointManager manager(where, comm, background ? std::move(bg[rank]) : nullptr, mo);
            PreemptionOptions po;
            po.grace_period = std::chrono::seconds(20);
            manager.HandlePreemption(std::move(handler_comms[rank]), po);
            for (int64_t s = 1; s <= 6; ++s) {
              TierState state(rank, kWorld, s);
              manager.Save(s, state.sd);
            }
            manager.Wait();
            Expect(!manager.preempted(), "no notice yet");
            comm.Barrier("test/before-sigterm");
            if (rank == 3) {
              // Inside a collective the others join only after their drains ended.
              comm.Barrier("test/rank-3-waits");
            } else {
              if (rank == 0) ::raise(SIGTERM);
              reports[rank] = manager.WaitForPreemption(std::chrono::seconds(30));
              comm.Barrier("test/rank-3-waits");
            }
            if (rank == 3) reports[rank] = manager.WaitForPreemption(std::chrono::seconds(30));
            Expect(manager.preempted(), "the notice reached every rank");
            // A save after the notice: refused on every rank, at once or at Wait.
            bool refused = false;
            try {
              TierState state(rank, kWorld, 7);
              manager.Save(7, state.sd);
              manager.Wait();
            } catch (const PreemptedError& e) {
              refused = std::string(e.what()).find("being preempted") != std::string::npos;
              Expect(refused, e.what());
            }
            Expect(refused, "a save after the notice is refused");
            manager.Close();
          },
          std::chrono::seconds(90)));
      for (int r = 0; r < kWorld; ++r) {
        INFO("rank " << r << ": " << reports[r].error);
        CHECK(reports[r].done);
        CHECK(reports[r].error.empty());
        CHECK(reports[r].step == 6);
        CHECK(reports[r].drained);
        CHECK(reports[r].bytes > 0);
        CHECK(reports[r].window_left_s > 0);
        CHECK(reports[r].window_left_s < 20);
      }
      struct sigaction after {};
      ::sigaction(SIGTERM, nullptr, &after);
      CHECK(after.sa_handler == before.sa_handler);  // put back when the last handler closed
      CHECK(CompleteCheckpoints(where) == std::vector<int64_t>{4, 6});
      std::string latest;
      std::getline(std::ifstream(where + "/latest"), latest);
      CHECK(latest == "6");
      ExpectRestartFromRoot(root, where, mo, 6);
    }
  }
}

// A notice before any commit drains nothing and says so; a step already durable is not copied
// again; NotifyPreemption does what SIGTERM does; the handler's preconditions are checked.
TEST_CASE(
    "preempt: with next_step_within the job's next save still commits after the notice and is "
    "the step drained, the one after is refused on every rank",
    "[memory-tier][manager][preempt][option:PreemptionOptions::next_step_within]") {
  TempDir root("tier"), durable("durable");
  ManagerOptions mo;
  mo.memory_tier = Options(root, 2);
  mo.durable_every = 1000;  // steps to memory only: the drain is what reaches the root
  const std::string where = durable / "next";
  auto handler_comms = BackgroundCommunicators();
  std::vector<PreemptionReport> reports(kWorld);
  std::vector<int> refused(kWorld, 0);
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    CheckpointManager manager(where, comm, nullptr, mo);
    PreemptionOptions po;
    po.on_sigterm = false;
    po.grace_period = std::chrono::seconds(60);
    po.next_step_within = std::chrono::seconds(30);
    manager.HandlePreemption(std::move(handler_comms[rank]), po);
    for (int64_t s = 1; s <= 2; ++s) {
      TierState state(rank, kWorld, s);
      manager.Save(s, state.sd);
    }
    comm.Barrier("test/before-notice");
    if (rank == 0) NotifyPreemption();  // every rank's handler: one process
    comm.Barrier("test/after-notice");
    TierState third(rank, kWorld, 3);
    manager.Save(3, third.sd);  // the next step boundary: still commits
    reports[rank] = manager.WaitForPreemption(std::chrono::seconds(60));
    try {
      TierState fourth(rank, kWorld, 4);
      manager.Save(4, fourth.sd);
    } catch (const PreemptedError&) {
      refused[rank] = 1;
    } catch (const CollectiveError& e) {
      refused[rank] = e.failures().front().code == ErrorCode::kPreempted ? 1 : 2;
    }
    manager.Close();
  }));
  for (int r = 0; r < kWorld; ++r) {
    INFO("rank " << r << ": " << reports[r].error);
    CHECK(reports[r].done);
    CHECK(reports[r].error.empty());
    CHECK(reports[r].step == 3);
    CHECK(reports[r].drained);
    CHECK(refused[r] == 1);
  }
  CHECK(CompleteCheckpoints(where) == std::vector<int64_t>{3});
  // The drained step holds step 3's state.
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    TierState back = TierState::Empty(rank, kWorld);
    CheckpointManager plain(where, comm);
    Expect(plain.Restore(back.sd) == std::optional<int64_t>(3), "the root's newest step is 3");
    Expect(TierState::Holds(back.sd, 3), "step 3 as saved");
    plain.Close();
  }));
  SECTION("an option out of range is refused") {
    auto comms = BackgroundCommunicators();
    RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
      CheckpointManager manager(durable / "range", comm, nullptr, mo);
      PreemptionOptions po;
      po.grace_period = std::chrono::seconds(5);
      po.next_step_within = std::chrono::seconds(5);
      try {
        manager.HandlePreemption(std::move(comms[rank]), po);
        Expect(false, "next_step_within >= grace_period is refused");
      } catch (const InvalidArgumentError& e) {
        Expect(std::string(e.what()).find("next_step_within") != std::string::npos, e.what());
      }
      manager.Close();
    }));
  }
}

// A job restarted from memory and preempted before its next commit drains the newest step memory
// holds, which is newer than any durable one (it used to report nothing to drain, and a restart
// after the nodes' loss went back to the older durable step): after its restore, the step it
// restored; before it, the step the handler finds in the tier itself (nothing else recorded it).
// At the world size the step was saved at, each writer copies its file; at 2 ranks (one node,
// holding every file) the node's ranks take turns. A second restart finds the step durable and
// copies nothing.
TEST_CASE(
    "preempt: a step restored from memory and not yet durable is drained on the next notice "
    "before or after the restore at the world size it was saved at and at another",
    "[memory-tier][manager][preempt]") {
  TempDir root("tier"), durable("durable");
  ManagerOptions mo;
  mo.memory_tier = Options(root, 2);
  mo.durable_every = 2;  // step 2 goes to the root, step 3 only to memory
  for (int world : {kWorld, 2}) {
    for (const std::string notice : {"before", "racing", "after"}) {
      const bool notice_first = notice == "before";
      DYNAMIC_SECTION("restarted at " << world << " ranks, the notice " << notice
                                      << " the restore") {
        const std::string where = durable / ("at" + std::to_string(world));
        SaveManagedSteps(where, mo, 3);
        REQUIRE(CompleteCheckpoints(where) == std::vector<int64_t>{2});
        for (bool again : {false, true}) {
          InProcessGroup handlers(world);
          std::vector<std::unique_ptr<Communicator>> handler_comms;
          for (int r = 0; r < world; ++r) handler_comms.push_back(handlers.Release(r));
          std::vector<PreemptionReport> reports(world);
          RequireNoErrors(RunRanks(world, [&](int rank, Communicator& comm) {
            CheckpointManager manager(where, comm, nullptr, mo);
            HandleNotices(manager, std::move(handler_comms[rank]));
            comm.Barrier("test/handlers-installed");
            if (notice_first) {
              if (rank == 0) NotifyPreemption();
              reports[rank] = manager.WaitForPreemption(std::chrono::seconds(30));
            }
            // Racing: the handlers settle before, during or after the ranks' restores begin,
            // and drain step 3 alike (found in the tier, or recorded by the restore).
            if (notice == "racing" && rank == 0) NotifyPreemption();
            auto back = TierState::Empty(rank, world);
            Expect(manager.Restore(back.sd) == 3, "step 3 restores");
            Expect(manager.restore_source() == "memory", "from memory");
            Expect(TierState::Holds(back.sd, 3), "step 3's values");
            if (notice == "racing") {
              reports[rank] = manager.WaitForPreemption(std::chrono::seconds(30));
            } else if (!notice_first) {
              comm.Barrier("test/before-notice");
              if (rank == 0) NotifyPreemption();
              reports[rank] = manager.WaitForPreemption(std::chrono::seconds(30));
            }
            manager.Close();
          }));
          INFO((again ? "the second restart" : "the first restart"));
          ExpectReports(reports, 3, !again);
          CHECK(CompleteCheckpoints(where) == std::vector<int64_t>{2, 3});
        }
        ExpectRestartFromRoot(root, where, mo, 3, world);
        fs::remove_all(where);
      }
    }
  }
}

// A notice before the restart's restore: the handler drains the tier's newest step from copies
// an earlier process wrote, so it checks each copy it drains. A writer's copy with a flipped byte
// is dropped and the replica on the other node is drained instead (the root then holds step 3
// intact); with both copies damaged, nothing is drained and the root keeps step 2.
TEST_CASE(
    "preempt: a notice before the restore drains the replica of a damaged copy and nothing when "
    "no copy is intact",
    "[memory-tier][manager][preempt]") {
  TempDir root("tier"), durable("durable");
  ManagerOptions mo;
  mo.memory_tier = Options(root, 2);
  mo.durable_every = 2;  // step 2 goes to the root, step 3 only to memory
  for (bool replica_intact : {true, false}) {
    DYNAMIC_SECTION((replica_intact ? "the replica is intact" : "both copies are damaged")) {
      const std::string where = durable / "damaged";
      SaveManagedSteps(where, mo, 3);
      // The manager's tier directory: the job's name with a hash of its root appended.
      std::vector<fs::path> jobs;
      for (const auto& e : fs::directory_iterator(TierAnchor(root))) jobs.push_back(e.path());
      REQUIRE(jobs.size() == 1);
      const std::string step3 = "/step-0000000003";
      FlipByte(WrittenBy((jobs[0] / "node-0").string() + step3, 0), 0);
      if (!replica_intact) FlipByte(WrittenBy((jobs[0] / "node-1").string() + step3, 0), 0);
      ExpectReports(NoticeBeforeRestore(where, mo, kWorld), replica_intact ? 3 : -1,
                    replica_intact);
      ExpectRestartFromRoot(root, where, mo, replica_intact ? 3 : 2);
      fs::remove_all(where);
    }
  }
}

// Memory's newest step is older than the root's (the job went on saving without the tier): a
// notice before the restore finds step 3 in memory, copies nothing and reports the root's step 5,
// the one a restart restores.
TEST_CASE(
    "preempt: a notice before the restore reports the root's newest step when it is newer than "
    "memory's",
    "[memory-tier][manager][preempt]") {
  TempDir root("tier"), durable("durable");
  ManagerOptions mo;
  mo.memory_tier = Options(root, 2);
  mo.durable_every = 1;
  const std::string where = durable / "newer";
  SaveManagedSteps(where, mo, 3);
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    CheckpointManager plain(where, comm);
    for (int64_t s = 4; s <= 5; ++s) {
      TierState state(rank, kWorld, s);
      plain.Save(s, state.sd);
    }
    plain.Close();
  }));
  const auto reports = NoticeBeforeRestore(where, mo, kWorld, [](int rank, CheckpointManager& m) {
    auto back = TierState::Empty(rank, kWorld);
    Expect(m.Restore(back.sd) == 5, "the root's step 5 restores");
    Expect(m.restore_source() == "durable", "from the root");
  });
  ExpectReports(reports, 5, false);
  for (const auto& r : reports) CHECK_THAT(r.where, EndsWith("step-0000000005"));
  fs::remove_all(TierAnchor(root));
}

// An object store's writer lock, as a lease that outlives a killed holder: the mem:// store of
// `lease://<name>`, whose lock stays when its holder is gone without releasing it (while
// g_leases_linger is set: a killed process) until TryLockOver names that holder. Writes fail
// while g_lease_writes_fail is set.
std::mutex g_leases_mu;
std::map<std::string, std::string> g_leases;  // location -> holder
std::atomic<bool> g_leases_linger{false}, g_lease_writes_fail{false};

class LeaseLock : public StoreLock {
 public:
  LeaseLock(std::string location, std::string holder)
      : location_(std::move(location)), holder_(std::move(holder)) {}
  ~LeaseLock() override { Release(); }
  void Release() override {
    if (released_ || g_leases_linger) return;
    released_ = true;
    std::lock_guard<std::mutex> lock(g_leases_mu);
    auto it = g_leases.find(location_);
    if (it != g_leases.end() && it->second == holder_) g_leases.erase(it);
  }
  std::string holder() const override { return holder_; }

 private:
  std::string location_, holder_;
  bool released_ = false;
};

class LeaseStore : public ForwardingStore {
 public:
  explicit LeaseStore(const std::string& location)
      : ForwardingStore(MakeMemStore("lease/" + location)), location_(location) {}
  std::unique_ptr<StoreLock> TryLock(const std::string& holder) override {
    return TryLockOver(holder, {});
  }
  std::unique_ptr<StoreLock> TryLockOver(const std::string& holder,
                                         const std::string& gone) override {
    std::lock_guard<std::mutex> lock(g_leases_mu);
    auto it = g_leases.find(location_);
    if (it != g_leases.end() && (gone.empty() || it->second != gone)) {
      throw LockedError(uri(), it->second);
    }
    g_leases[location_] = holder;
    return std::make_unique<LeaseLock>(location_, holder);
  }
  std::unique_ptr<WritableObject> Create(const std::string& name) override {
    if (g_lease_writes_fail) throw IoError("injected write failure on " + name, false, EIO);
    return ForwardingStore::Create(name);
  }

 private:
  std::string location_;
};

void RegisterLeaseStore() {
  static bool done = [] {
    RegisterBackend("lease", [](const std::string& location) -> std::shared_ptr<Store> {
      return std::make_shared<LeaseStore>(location);
    });
    return true;
  }();
  (void)done;
}

// A job killed while it drained step 3 to an object store leaves the step's location locked for
// the lease's length. Its restart restores step 3 from memory and is preempted at once: the
// handler takes the dead drain's lock over (its process held this node's tier lock, which the
// restart holds now) and drains step 3. A lock held by another job's drain (no proof it is
// gone) is not taken: the handler reports it, naming the holder, and the root keeps step 2.
TEST_CASE(
    "preempt: a drain killed midway on an object store leaves its lease and the restart's "
    "handler takes it over but never another job's",
    "[memory-tier][manager][preempt]") {
  RegisterLeaseStore();
  TempDir root("tier");
  ManagerOptions mo;
  mo.memory_tier = Options(root, 2);
  mo.durable_every = 2;  // step 2 goes to the root, step 3 only to memory
  for (bool ours : {true, false}) {
    DYNAMIC_SECTION(
        (ours ? "the lease of this job's killed drain" : "the lease of another job's drain")) {
      const std::string where = std::string("lease://lease-") + (ours ? "ours" : "theirs");
      const std::string step3 = where + "/step-0000000003";
      SaveManagedSteps(where, mo, 3);
      if (ours) {
        // The killed drain: it locked step 3's location, its writes failed, its lease stays.
        RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
          CheckpointManager manager(where, comm, nullptr, mo);
          auto back = TierState::Empty(rank, kWorld);
          Expect(manager.Restore(back.sd) == 3, "step 3 restores");
          comm.Barrier("test/before-drain");
          if (rank == 0) g_leases_linger = g_lease_writes_fail = true;
          comm.Barrier("test/faults-on");
          try {
            manager.memory_tier()->Drain(3, step3, {});
            Expect(false, "the drain fails");
          } catch (const Error&) {
          }
          comm.Barrier("test/drain-failed");
          if (rank == 0) g_leases_linger = g_lease_writes_fail = false;
          manager.Close();
        }));
      } else {
        g_leases_linger = true;
        OpenStore(step3)->TryLock("host=elsewhere pid=1 memory-tier-drain step=3");
        g_leases_linger = false;
      }
      {
        std::lock_guard<std::mutex> lock(g_leases_mu);
        REQUIRE(g_leases.count(step3.substr(std::string("lease://").size())) == 1);
      }
      const auto reports = NoticeBeforeRestore(where, mo, kWorld);
      if (ours) {
        ExpectReports(reports, 3, true);
        ExpectRestartFromRoot(root, where, mo, 3);
      } else {
        for (const auto& r : reports) {
          CHECK(r.done);
          CHECK_THAT(r.error, Contains("locked by another save") && Contains("host=elsewhere"));
          CHECK_FALSE(r.drained);
        }
        ExpectRestartFromRoot(root, where, mo, 2);
      }
      std::lock_guard<std::mutex> lock(g_leases_mu);
      g_leases.clear();
    }
  }
}

// The job's ranks as threads over shared mailboxes (the real collectives of
// PointToPointCommunicator), whose rank 0 raises the preemption notice when it reaches the
// restore's collective `notice_at`: by then every rank is inside the restore.
class NoticeInRestoreComm : public PointToPointCommunicator {
 public:
  struct Mail {
    std::mutex mu;
    std::map<std::tuple<int, int, int>, std::deque<std::string>> boxes;
  };
  NoticeInRestoreComm(std::shared_ptr<Mail> mail, int rank, int size, std::string notice_at)
      : mail_(std::move(mail)), rank_(rank), size_(size), notice_at_(std::move(notice_at)) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::vector<std::string> AllGather(std::string message, std::string_view what) override {
    if (rank_ == 0 && what == notice_at_) {
      NotifyPreemption();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the handlers wake first
    }
    return PointToPointCommunicator::AllGather(std::move(message), what);
  }

 protected:
  void Send(int dest, int tag, std::string payload) override {
    std::lock_guard<std::mutex> lock(mail_->mu);
    mail_->boxes[{rank_, dest, tag}].push_back(std::move(payload));
  }
  std::optional<std::string> TryReceive(int source, int tag) override {
    std::lock_guard<std::mutex> lock(mail_->mu);
    auto it = mail_->boxes.find({source, rank_, tag});
    if (it == mail_->boxes.end() || it->second.empty()) return std::nullopt;
    std::string s = std::move(it->second.front());
    it->second.pop_front();
    return s;
  }

 private:
  std::shared_ptr<Mail> mail_;
  int rank_, size_;
  std::string notice_at_;
};

// SIGTERM while a restarted job restores from memory: the handlers wait for the restore and drain
// the step it restores, not older than the memory's newest (before, they reported nothing
// committed at once, and a restart after the nodes' loss went back to the durable step).
TEST_CASE("preempt: a notice during a restart's restore waits for it and drains the restored step",
          "[memory-tier][manager][preempt]") {
  TempDir root("tier"), durable("durable");
  ManagerOptions mo;
  mo.memory_tier = Options(root, 2);
  mo.durable_every = 2;  // step 2 goes to the root, step 3 only to memory
  const std::string where = durable / "restart";
  SaveManagedSteps(where, mo, 3);
  auto mail = std::make_shared<NoticeInRestoreComm::Mail>();
  auto handler_comms = BackgroundCommunicators();
  std::vector<PreemptionReport> reports(kWorld);
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& barrier) {
    NoticeInRestoreComm comm(mail, rank, kWorld, "tier/recover-needs");
    CheckpointManager manager(where, comm, nullptr, mo);
    HandleNotices(manager, std::move(handler_comms[rank]));
    barrier.Barrier("test/handlers-installed");
    auto back = TierState::Empty(rank, kWorld);
    Expect(manager.Restore(back.sd) == 3, "step 3 restores");
    Expect(manager.preempted(), "the notice came during the restore");
    Expect(TierState::Holds(back.sd, 3), "step 3's values");
    reports[rank] = manager.WaitForPreemption(std::chrono::seconds(30));
    manager.Close();
  }));
  for (const auto& r : reports) {
    INFO(r.error);
    CHECK(r.done);
    CHECK(r.error.empty());
    CHECK(r.step == 3);
    CHECK(r.drained);
  }
  CHECK(CompleteCheckpoints(where) == std::vector<int64_t>{2, 3});
  fs::remove_all(TierAnchor(root));
}

TEST_CASE(
    "preempt: nothing committed drains nothing, a durable step is not copied again, and the "
    "handler needs a tier and a root the tier's files can be copied to",
    "[memory-tier][manager][preempt][option:PreemptionOptions::on_sigterm]") {
  TempDir root("tier"), durable("durable");
  struct sigaction before {};
  ::sigaction(SIGTERM, nullptr, &before);
  ManagerOptions mo;
  mo.memory_tier = Options(root, 2);
  mo.durable_every = 2;
  for (int64_t last : {int64_t{0}, int64_t{2}}) {
    DYNAMIC_SECTION("saved up to step " << last) {
      const std::string where = durable / ("upto" + std::to_string(last));
      auto handler_comms = BackgroundCommunicators();
      std::vector<PreemptionReport> reports(kWorld);
      RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
        CheckpointManager manager(where, comm, nullptr, mo);
        HandleNotices(manager, std::move(handler_comms[rank]));
        struct sigaction now {};
        ::sigaction(SIGTERM, nullptr, &now);
        Expect(now.sa_handler == before.sa_handler,
               "without on_sigterm, SIGTERM keeps its disposition");
        for (int64_t s = 1; s <= last; ++s) {
          TierState state(rank, kWorld, s);
          manager.Save(s, state.sd);
        }
        comm.Barrier("test/before-notice");
        if (rank == 0) NotifyPreemption();
        reports[rank] = manager.WaitForPreemption(std::chrono::seconds(30));
        manager.Close();
      }));
      for (const auto& r : reports) {
        INFO(r.error);
        CHECK(r.done);
        CHECK(r.error.empty());
        CHECK(r.step == (last == 0 ? -1 : 2));
        CHECK_FALSE(r.drained);  // nothing, or step 2 drained by its save already
      }
      CHECK(CompleteCheckpoints(where) ==
            (last == 0 ? std::vector<int64_t>{} : std::vector<int64_t>{2}));
    }
  }
  SECTION("preconditions") {
    auto handler_comms = BackgroundCommunicators();
    RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
      {
        CheckpointManager plain(durable / "plain", comm);
        try {
          plain.HandlePreemption(std::move(handler_comms[rank]));
          Expect(false, "a manager without a tier is refused");
        } catch (const InvalidArgumentError& e) {
          Expect(std::string(e.what()).find("memory_tier") != std::string::npos, e.what());
        }
      }
      ManagerOptions zstd = mo;
      zstd.save.storage.compression = Compression::kZstd;
      CheckpointManager compressed(durable / "zstd", comm, nullptr, zstd);
      try {
        compressed.HandlePreemption(nullptr);
        Expect(false, "a compressed root is refused");
      } catch (const InvalidArgumentError& e) {
        Expect(std::string(e.what()).find("uncompressed") != std::string::npos, e.what());
      }
      compressed.Close();
    }));
  }
}

namespace {

// A rank's state of `tensors` tensors of `rows` x 1024 floats (4 KiB a row), from `step`.
StateDict ManyTensors(int rank, int tensors, int64_t rows, int64_t step) {
  StateDict sd;
  for (int t = 0; t < tensors; ++t) {
    sd.Set("r" + std::to_string(rank) + "/t" + std::to_string(t),
           RandomTensor(DType::kFloat32, {rows, 1024}, 100 * step + 10 * rank + t));
  }
  return sd;
}

}  // namespace

TEST_CASE(
    "memory tier: a save sends each data file to the partners while writing the next and the "
    "replicas restore bit-exact",
    "[memory-tier][option:MemoryTierOptions::overlap_files]") {
  TempDir root("tier");
  auto options = Options(root, 2);
  options.transfer_chunk_bytes = 1 << 20;
  constexpr int kTensors = 8;
  constexpr int64_t kRowsEach = 256;  // 1 MiB a tensor
  std::vector<uint64_t> while_writing(kWorld, 0), sent(kWorld, 0), written(kWorld, 0);
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    MemoryTier tier(comm, options);
    // A round waits for every rank's next file: on a loaded machine one save may end before a
    // round starts, so a few saves are made.
    for (int64_t s = 1; s <= 4; ++s) {
      StateDict sd = ManyTensors(rank, kTensors, kRowsEach, s);
      tier.Save(s, sd);
      while_writing[rank] += tier.last_stats().bytes_sent_while_writing;
      sent[rank] = tier.last_stats().bytes_sent;
      written[rank] = tier.last_stats().bytes_written;
    }
    comm.Barrier("saved");
    if (rank == 0) fs::remove_all(NodeDir(root, 1));  // node 1 lost: its files come back
    comm.Barrier("lost");
    StateDict back = ManyTensors(rank, kTensors, kRowsEach, 0);
    Expect(tier.Restore(back) == 4, "step 4 restored");
    StateDict want = ManyTensors(rank, kTensors, kRowsEach, 4);
    for (int t = 0; t < kTensors; ++t) {
      const std::string name = "r" + std::to_string(rank) + "/t" + std::to_string(t);
      Expect(SameElements(std::get<TensorView>(*want.Find(name)),
                          std::get<TensorView>(*back.Find(name))),
             name + " is bit-exact");
    }
  }));
  uint64_t overlapped = 0;
  for (int r = 0; r < kWorld; ++r) {
    INFO("rank " << r);
    CHECK(sent[r] == written[r]);  // one replica of every file, sent once
    overlapped += while_writing[r];
  }
  CHECK(overlapped > 0);
  // Each rank's data went as overlap_files files, on both nodes.
  size_t data_files = 0;
  for (const auto& f : FilesIn(NodeDir(root, 0) + "/step-0000000004")) {
    data_files += IsDataObjectName(f) ? 1 : 0;
  }
  CHECK(data_files == kWorld * 4);
  CHECK(FilesIn(NodeDir(root, 0) + "/step-0000000004") ==
        FilesIn(NodeDir(root, 1) + "/step-0000000004"));
}

TEST_CASE("memory tier: with overlap_files 0 the replicas are sent after the write",
          "[memory-tier][option:MemoryTierOptions::overlap_files]") {
  TempDir root("tier");
  auto options = Options(root, 2);
  options.overlap_files = 0;
  std::vector<TierStats> stats(kWorld);
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    MemoryTier tier(comm, options);
    StateDict sd = ManyTensors(rank, 8, 64, 1);
    tier.Save(1, sd);
    stats[rank] = tier.last_stats();
  }));
  size_t data_files = 0;
  for (const auto& f : FilesIn(NodeDir(root, 0) + "/step-0000000001")) {
    data_files += IsDataObjectName(f) ? 1 : 0;
  }
  CHECK(data_files == kWorld);  // files_per_rank's one file per rank
  for (int r = 0; r < kWorld; ++r) {
    INFO("rank " << r);
    CHECK(stats[r].bytes_sent_while_writing == 0);
    CHECK(stats[r].bytes_sent == stats[r].bytes_written);
  }
}

TEST_CASE(
    "memory tier: a replication that fails while the save writes fails the save on every rank "
    "and the next save replicates after its write",
    "[memory-tier][option:MemoryTierOptions::overlap_files]") {
  TempDir root("tier");
  auto options = Options(root, 2);
  std::vector<std::string> errors(kWorld);
  std::vector<TierStats> stats(kWorld);
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    ForwardingCommunicator failing(comm, /*fail_rank=*/1, /*fail_at=*/2);
    MemoryTier tier(failing, options);
    StateDict one = ManyTensors(rank, 8, 64, 1);
    try {
      tier.Save(1, one);
    } catch (const CollectiveError& e) {
      errors[rank] = e.what();
    }
    StateDict two = ManyTensors(rank, 8, 64, 2);
    tier.Save(2, two);
    stats[rank] = tier.last_stats();
    Expect(tier.CompleteSteps() == std::vector<int64_t>{2}, "only step 2 is in the tier");
    StateDict back = ManyTensors(rank, 8, 64, 0);
    Expect(tier.Restore(back) == 2, "step 2 restores");
    StateDict want = ManyTensors(rank, 8, 64, 2);
    for (int t = 0; t < 8; ++t) {
      const std::string name = "r" + std::to_string(rank) + "/t" + std::to_string(t);
      Expect(SameElements(std::get<TensorView>(*want.Find(name)),
                          std::get<TensorView>(*back.Find(name))),
             name + " is bit-exact");
    }
  }));
  for (int r = 0; r < kWorld; ++r) {
    INFO("rank " << r << ": " << errors[r]);
    CHECK_THAT(errors[r], Contains("tier/replicate") && Contains("rank 1"));
    CHECK(stats[r].bytes_sent_while_writing == 0);
    CHECK(stats[r].bytes_sent == stats[r].bytes_written);
  }
  // Step 1 was committed nowhere; its directories are gone.
  CHECK(!fs::exists(NodeDir(root, 0) + "/step-0000000001"));
  CHECK(!fs::exists(NodeDir(root, 1) + "/step-0000000001"));
}

TEST_CASE(
    "memory tier: device tensors are saved in the foreground and the background and restored "
    "bit-exact after a node's loss and at another world size",
    "[memory-tier][device]") {
  ScopedFakeDevice device;
  TempDir root("tier");
  CheckTierWithDeviceTensors(device.get(), root.path());
  // The tier's files came from the device and went back into it.
  CHECK(device->d2h_bytes_ >= 2 * 64 * (1 << 16) * 4);
  CHECK(device->h2d_bytes_ >= 2 * 64 * (1 << 16) * 4);
}
