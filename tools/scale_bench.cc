// dcp-scale-bench: what the save/load protocol costs the coordinator and a follower as the
// world grows, simulated in one process (no I/O, no transport). For each world size N it runs
// the work of the protocol's phases exactly as dcp::Save / dcp::Load do today:
//
//   save/plan:  every rank builds its state dict, plans it (DefaultSavePlanner) and encodes its
//               local plan (the gathered payload); the coordinator decodes the N plans, merges
//               them (dedup, metadata, validation), names files and encodes N global plans.
//   save/write: every rank encodes its write results; the coordinator decodes them, fills the
//               metadata's storage map, encodes the metadata and sends it to every rank. With
//               --replicate, as one copy per rank (what RunPhase did before replies of one
//               payload for all were broadcast); by default as today: the encoded metadata, its
//               serialized phase reply and one frame shared by every send (MpiCommunicator
//               sends all N messages from that one buffer).
//   load/metadata: the coordinator distributes the metadata file's payload as read (no
//               re-encoding) the same way; every follower decodes all of it.
//   load/plan:  as dcp::Load plans with the default planner: each rank plans alone and sends a
//               summary of its request (read-once), the coordinator decodes the N summaries and
//               schedules shared reads. For a resume in the saved layout and for the worst-case
//               all-to-all reshard (saved row-sharded, loaded column-sharded: each local chunk
//               overlaps every saved chunk of its tensor). A follower's plan is timed; every
//               rank's summary is computed up to --full-load-max ranks, beyond that the
//               coordinator gets N copies of a follower's. What gathering every plan (the protocol
//               before) would have moved is printed beside it.
//   load/read:  what a follower's read phase does before the reader gets a byte: its rule
//               reads found and cut into rounds (when the schedule says rule exchange), its
//               cooperative requests to the owners (when the schedule says cooperative), and the
//               walk of the rest of its plan a bounded part at a time (ForEachExpandedPart), CPU
//               and peak memory of each. With rule exchange, also the CPU of its two copies per
//               piece (as an owner, packing every rank's pieces of its chunks; as a receiver,
//               placing every owner's pieces), on synthetic bytes.
//
// The layout is FSDP/TP-like: --params parameters of mixed sizes (attention and MLP matrices,
// norms, biases) row-sharded over all ranks, Adam's exp_avg and exp_avg_sq sharded the same way,
// and --replicated small entries every rank holds (deduplicated by the coordinator).
//
// Reported per N: coordinator time (wall clock: per-rank decoding and encoding run over --threads
// threads with ParallelFor, as dcp::Save and dcp::Load do) and peak extra resident memory per
// phase, the bytes each phase moves, the encoded metadata size, a follower's time, and how each
// grows from the previous N (the exponent k in cost ~ N^k). Planning never touches tensor bytes:
// every view points into one small dummy buffer.
//
//   dcp-scale-bench [--ranks 64,256,1024] [--params 1000] [--replicated 50] [--full-load-max 64]
//                   [--d-model 4096]
//                   [--max-copies-mib 2048] [--replicate] [--json FILE]
#include <malloc.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "dcp/planner/compact_plan.h"
#include "dcp/planner/coop_reads.h"
#include "dcp/planner/default_planner.h"
#include "dcp/planner/read_sharing.h"
#include "dcp/planner/rule_reads.h"
#include "dcp/proto/checksum.h"
#include "dcp/proto/executor.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/proto/staging.h"
#include "dcp/storage/storage.h"

using namespace dcp;

namespace {

double WallSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

size_t g_threads = 0;       // --threads: ParallelFor's threads for the coordinator (0: all cores)
bool g_full_plans = false;  // --full-plans: every rank sends every item (no compact planning)
uint32_t g_metadata_version = 2;  // --metadata-version: what the write phase commits
volatile uint64_t g_sink = 0;     // what the read phase's walk touched (kept from the optimizer)

double CpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

long StatusKiB(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string k = std::string(key) + ":";
  while (std::getline(f, line)) {
    if (line.rfind(k, 0) == 0) return std::stol(line.substr(k.size()));
  }
  return 0;
}

// Peak resident memory since the last call, in MiB above the resident size at that call. The
// kernel's high-water mark is reset through /proc/self/clear_refs where that is allowed.
class PeakMeter {
 public:
  PeakMeter() { Reset(); }
  void Reset() {
    malloc_trim(0);  // freed heap memory would otherwise hide new allocations from the RSS
    if (std::FILE* c = std::fopen("/proc/self/clear_refs", "w")) {
      std::fputs("5", c);
      std::fclose(c);
    }
    base_kib_ = StatusKiB("VmRSS");
  }
  double PeakMiB() const { return std::max(0L, StatusKiB("VmHWM") - base_kib_) / 1024.0; }

 private:
  long base_kib_ = 0;
};

std::vector<char>& Buffer() {
  static std::vector<char> b(1 << 16);
  return b;
}

TensorView View(const Shape& sizes) {
  return TensorView::FromContiguous(Buffer().data(), DType::kBFloat16, sizes);
}

std::pair<int64_t, int64_t> Range(int64_t n, int r, int w) {
  const int64_t base = n / w, extra = n % w;
  const int64_t b = r * base + std::min<int64_t>(r, extra);
  return {b, b + base + (r < extra ? 1 : 0)};
}

// The shapes of the model's parameters: a transformer of d_model d (4096), ten tensors a layer;
// the key and value projections have d / 4 rows, fewer than the ranks beyond d / 4.
std::vector<std::pair<std::string, Shape>> Parameters(int count, int64_t d) {
  const std::vector<std::pair<std::string, Shape>> layer = {
      {"attn.q.weight", {d, d}},       {"attn.k.weight", {d / 4, d}},
      {"attn.v.weight", {d / 4, d}},   {"attn.o.weight", {d, d}},
      {"mlp.up.weight", {4 * d, d}},   {"mlp.gate.weight", {4 * d, d}},
      {"mlp.down.weight", {d, 4 * d}}, {"norm1.weight", {d}},
      {"norm2.weight", {d}},           {"mlp.up.bias", {4 * d}}};
  std::vector<std::pair<std::string, Shape>> out;
  for (int i = 0; static_cast<int>(out.size()) < count; ++i) {
    const auto& [name, shape] = layer[i % layer.size()];
    out.push_back({"layers." + std::to_string(i / layer.size()) + "." + name, shape});
  }
  return out;
}

// Rank r's state dict: every parameter and its two Adam moments row-sharded (rows_sharded) or
// column-sharded (the reshard target; 1-D tensors stay row-sharded), plus replicated entries.
StateDict RankState(const std::vector<std::pair<std::string, Shape>>& params, int replicated, int r,
                    int n, bool rows_sharded) {
  StateDict sd;
  for (const auto& [name, shape] : params) {
    for (const char* prefix : {"model.", "optim.exp_avg.", "optim.exp_avg_sq."}) {
      ShardedTensor st{DType::kBFloat16, shape, {}};
      const bool by_cols = !rows_sharded && shape.size() == 2;
      const int dim = by_cols ? 1 : 0;
      auto [b, e] = Range(shape[dim], r, n);
      if (e > b) {
        Shape local = shape, off(shape.size(), 0);
        local[dim] = e - b;
        off[dim] = b;
        st.local_shards.push_back({View(local), off});
      }
      sd.Set(prefix + name, st);
    }
  }
  for (int i = 0; i < replicated; ++i) {
    sd.Set("replicated.buffer" + std::to_string(i), View({64}));
  }
  return sd;
}

// One load's planning (dcp::Load: rank-local plans, a request summary per rank).
struct LoadSide {
  double follower_s = 0;  // a follower's CPU: its local plan and summary
  double plan_items = 0;  // the items of its plan (a span reads many chunks in one)
  double pieces = 0;      // the plain items its read phase expands them into
  double expand_s = 0;    // CPU of expanding them all at once (into one plan)
  // load/read before the reader gets a byte (dcp::Load's Read): cooperative requests, then the
  // walk of the plan a bounded part at a time.
  double walk_s = 0;              // CPU of ForEachExpandedPart over the plan (kMaxExpandedItems)
  double walk_mib = 0;            // its peak extra memory
  double read_parts = 0;          // the parts it hands to the reader
  double coop_asks = 0;           // the follower's cooperative requests (CoopAsks)
  double coop_request_bytes = 0;  // encoded, to all owners
  double coop_ask_s = 0;          // CPU of building and encoding them
  double coop_ask_mib = 0;        // its peak extra memory
  double coop_waste_s = 0;        // CPU of its coop_waste for the summary (part of follower_s)
  bool cooperative = false;       // the schedule says the load reads cooperatively
  double read_phase_s = 0;        // walk_s, plus coop_ask_s when cooperative
  double read_phase_mib = 0;      // walk_mib, or coop_ask_mib when cooperative and larger
  double read_data_bytes = 0;     // the bytes of its pieces' boxes (what it loads)
  double read_index_bytes = 0;    // the indexes of the data files they lie in (not in metadata)
  // Rule exchange (planner/rule_reads.h), when the schedule says so.
  bool rule_exchange = false;
  double rule_reads = 0;  // the follower's reads it serves
  double rule_rounds = 0;
  double rule_plan_s = 0;  // CPU of FindRuleReads and RuleRounds
  double rest_walk_s = 0;  // the walk of the rest of the plan (ForEachExpandedPart)
  double rest_walk_mib = 0;
  double rule_pieces_in = 0;    // pieces it receives (from every owner)
  double rule_pieces_out = 0;   // pieces it sends as an owner
  double rule_place_s = 0;      // receiver: sizing every owner's message, placing its pieces
  double rule_pack_s = 0;       // owner: sizing every rank's message, packing its pieces
  double rule_data_mib = 0;     // its messages of one round, in and out, at most (pooled)
  double rule_index_bytes = 0;  // indexes it reads: its rest's files and those it owns (not timed)
  double gathered_bytes = 0;    // the N summaries the coordinator gathers
  double coordinator_s = 0;     // decoding them and scheduling read-once (wall)
  double coordinator_mib = 0;   // its peak extra memory doing so
  double schedule_bytes = 0;    // the one reply every rank receives
  double full_gather_mib_est = 0;  // what gathering every plan (the protocol before) would move
  bool exact = false;              // every rank's summary computed (else N copies of one)
};

struct Row {
  int n = 0;
  double plan_s = 0, write_s = 0, load_md_s = 0;  // coordinator CPU per phase
  double plan_mib = 0, write_mib = 0, load_md_mib = 0;
  double gathered_mib = 0, scattered_mib = 0, md_mib = 0, md_out_mib = 0;
  double follower_plan_s = 0, follower_md_s = 0;
  LoadSide resume, reshard;
  bool copies_counted = false;  // the N metadata copies were counted, not allocated
  double plan_decode_s = 0, plan_merge_s = 0;
  double write_decode_s = 0, write_fill_s = 0;  // parts of write_s (the rest: encoding)  // parts
                                                // of plan_s (the rest: encoding replies)
  double cached_plan_s = 0, cached_plan_mib = 0, follower_cached_s = 0, cache_mib = 0;
};

double MiB(double bytes) { return bytes / (1024.0 * 1024.0); }

// `run()` in a forked child; its Row comes back through a pipe. Exits when the child fails.
template <typename Run>
Row Isolated(Run run) {
  static_assert(std::is_trivially_copyable_v<Row>);
  int fds[2];
  if (::pipe(fds) != 0) {
    std::perror("pipe");
    std::exit(1);
  }
  std::fflush(stdout);
  const pid_t pid = ::fork();
  if (pid < 0) {
    std::perror("fork");
    std::exit(1);
  }
  if (pid == 0) {
    ::close(fds[0]);
    const Row row = run();
    const char* p = reinterpret_cast<const char*>(&row);
    for (size_t left = sizeof row; left > 0;) {
      const ssize_t n = ::write(fds[1], p, left);
      if (n <= 0) ::_exit(1);
      p += n;
      left -= static_cast<size_t>(n);
    }
    std::fflush(stdout);
    ::_exit(0);
  }
  ::close(fds[1]);
  Row row;
  char* p = reinterpret_cast<char*>(&row);
  size_t got = 0;
  while (got < sizeof row) {
    const ssize_t n = ::read(fds[0], p + got, sizeof row - got);
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (got != sizeof row || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "dcp-scale-bench: the run for one world size failed (status %d)\n",
                 status);
    std::exit(1);
  }
  return row;
}

// What a follower's read phase then reads (not timed): its pieces' bytes, and the indexes of the
// data files they lie in, which a reader that resolves its own items reads whole (a load that
// reads cooperatively reads the indexes of the files it owns instead), unless the metadata holds
// copies of them.
void ReadVolume(const LoadPlan& plan, const Metadata& md, int world, LoadSide& side) {
  std::vector<char> writers(static_cast<size_t>(world), 0);
  double data = 0;
  const std::string* last = nullptr;
  const TensorMetadata* t = nullptr;
  ForEachExpandedPart(plan, md, kMaxExpandedItems, [&](const LoadPlan& part) {
    for (const ReadItem& item : part.items) {
      if (last == nullptr || *last != item.storage_index.fqn) {
        last = &item.storage_index.fqn;
        t = std::get_if<TensorMetadata>(&md.entries.at(*last));
      }
      if (t == nullptr || !item.storage_index.index) continue;
      data += static_cast<double>(NumElements(item.lengths) * ElementSize(t->dtype));
      const int32_t w = ChunkWriter(*t, static_cast<size_t>(*item.storage_index.index));
      if (w >= 0 && w < world) writers[static_cast<size_t>(w)] = 1;
    }
  });
  side.read_data_bytes = data;
  side.read_index_bytes = 0;
  for (const DataFile& f : md.files) {
    if (f.index_copy.empty() && f.writer >= 0 && f.writer < world && writers[f.writer]) {
      side.read_index_bytes += static_cast<double>(f.index_length);
    }
  }
}

// Rule exchange as dcp::Load runs it (dcp/protocol/rule_exchange.cc) for rank `rank` of `world`:
// its table and rounds (planning), the rest of its plan walked as the load reads it, then per
// round the two copies every piece costs, on synthetic bytes: as a receiver, every owner's
// message sized and its pieces placed into the rank's slices; as an owner, every rank's message
// sized and packed from its chunks. The slices (the state dict's) and one chunk buffer (the
// streamer's slab) exist before the timing, as do the messages' pooled buffers after a first load.
void RulePhase(const LoadPlan& plan, const Metadata& md, int rank, int world, PeakMeter& meter,
               LoadSide& side) {
  const uint64_t round_bytes = CoopRoundBytes(StorageOptions{}.memory_budget_bytes);
  meter.Reset();
  double c0 = CpuSeconds();
  const RuleReadTable table = FindRuleReads(plan, md, rank, world, round_bytes);
  const std::vector<size_t> rounds = RuleRounds(table.reads, md.world_size, world, round_bytes);
  side.rule_plan_s = CpuSeconds() - c0;
  side.rule_reads = static_cast<double>(table.reads.size());
  side.rule_rounds = static_cast<double>(rounds.size());
  std::vector<char> ruled(plan.items.size(), 0);
  for (const RuleRead& r : table.reads) ruled[r.item] = 1;
  meter.Reset();
  c0 = CpuSeconds();
  size_t items = 0;
  ForEachExpandedPart(WithoutItems(plan, ruled), md, kMaxExpandedItems,
                      [&](const LoadPlan& part) { items += part.items.size(); });
  side.rest_walk_s = CpuSeconds() - c0;
  side.rest_walk_mib = meter.PeakMiB();
  g_sink = items;
  if (table.reads.empty()) return;
  // The indexes it then reads: those of the rest's files, and of the files whose chunks it owns.
  {
    LoadSide rest;
    ReadVolume(WithoutItems(plan, ruled), md, world, rest);
    side.rule_index_bytes = rest.read_index_bytes;
    const RuleOwnerMap owners(md.world_size, world);
    const auto [w0, w1] = owners.WritersOf(rank, md.world_size);
    for (const DataFile& f : md.files) {
      if (f.index_copy.empty() && f.writer >= w0 && f.writer < w1) {
        side.rule_index_bytes += static_cast<double>(f.index_length);
      }
    }
  }

  const RuleOwnerMap owners(md.world_size, world);
  std::vector<std::vector<char>> slices(table.reads.size());
  uint64_t largest_chunk = 0;
  for (size_t i = 0; i < table.reads.size(); ++i) {
    const RuleRead& read = table.reads[i];
    slices[i].resize(NumElements(plan.items[read.item].lengths) * read.esize);
    const auto [w0, w1] = owners.WritersOf(rank, read.chunks);
    for (int64_t w = w0; w < w1; ++w) {
      largest_chunk = std::max<uint64_t>(
          largest_chunk,
          NumElements(ChunkAt(*read.saved, static_cast<size_t>(w)).sizes) * read.esize);
    }
  }
  std::vector<char> chunk(largest_chunk, 1);
  HostBuffer in(round_bytes), out(round_bytes);
  double place = 0, pack = 0, messages = 0;
  for (size_t r = 0; r < rounds.size(); ++r) {
    const size_t b = rounds[r], e = r + 1 < rounds.size() ? rounds[r + 1] : table.reads.size();
    c0 = CpuSeconds();
    std::vector<uint64_t> at(world + 1, 0);
    const std::vector<uint64_t> in_sizes =
        RuleMessageBytes(table.reads, b, e, owners, -1, rank, world);
    std::copy(in_sizes.begin(), in_sizes.end(), at.begin() + 1);
    for (int o = 0; o < world; ++o) at[o + 1] += at[o];
    const double in_bytes = static_cast<double>(at[world]);
    in.Reserve(at[world]);
    for (size_t i = b; i < e; ++i) {
      for (int o = 0; o < world; ++o) {
        ForEachRulePiece(table.reads[i], owners, o, rank, [&](const RulePiece& p) {
          CopyRulePiece(table.reads[i], p, slices[i].data(), false, in.data() + at[o], false);
          at[o] += p.bytes;
          side.rule_pieces_in += 1;
        });
      }
    }
    place += CpuSeconds() - c0;
    c0 = CpuSeconds();
    std::fill(at.begin(), at.end(), 0);
    const std::vector<uint64_t> out_sizes =
        RuleMessageBytes(table.reads, b, e, owners, rank, -1, world);
    std::copy(out_sizes.begin(), out_sizes.end(), at.begin() + 1);
    for (int f = 0; f < world; ++f) at[f + 1] += at[f];
    messages = std::max(messages, in_bytes + static_cast<double>(at[world]));
    out.Reserve(at[world]);
    for (size_t i = b; i < e; ++i) {
      const RuleRead& read = table.reads[i];
      const auto [w0, w1] = owners.WritersOf(rank, read.chunks);
      for (int64_t w = w0; w < w1; ++w) {
        ForEachPieceOfChunk(read, w, [&](const RulePiece& p) {
          CopyRulePiece(read, p, chunk.data(), true, out.data() + at[p.f], true);
          at[p.f] += p.bytes;
          side.rule_pieces_out += 1;
        });
      }
    }
    pack += CpuSeconds() - c0;
  }
  side.rule_place_s = place;
  side.rule_pack_s = pack;
  side.rule_data_mib = MiB(messages);
}

// What a follower's load/read costs before it reads a byte, as dcp::Load's Read runs it on its
// plan `plan` (rank `rank` of `world`): with cooperative reads (CoopRead::Ask), its requests to
// the owners, built and encoded (not sent); then its plan walked a bounded part at a time
// (ForEachExpandedPart with the load's kMaxExpandedItems), each part's items touched as a reader
// at least does (no reader runs). Not modelled: the owners' side (their requests decoded and
// granted) and the served set a follower keeps from the grants, nor its per-item lookup there.
void ReadPhase(const LoadPlan& plan, const Metadata& md, int rank, int world, PeakMeter& meter,
               LoadSide& side) {
  {  // every span expanded at once (into one plan), as a load did before bounded parts
    LoadPlan copy = plan;
    const double e0 = CpuSeconds();
    const LoadPlan pieces = ExpandChunkSpans(std::move(copy), md);
    side.expand_s = CpuSeconds() - e0;
    side.pieces = static_cast<double>(pieces.items.size());
  }
  meter.Reset();
  double c0 = CpuSeconds();
  {
    // As CoopRead::Ask with a reader that streams items (own_reads) and verified checksums (the
    // default): the asks, grouped by owner, one encoded message per owner.
    const std::vector<CoopAsk> asks =
        CoopAsks(plan, md, CoopOwners(md, world), rank, /*verify=*/true, /*own_reads=*/true);
    std::vector<std::vector<CoopRequest>> mine(world);
    std::vector<std::vector<size_t>> by_owner(world);
    for (size_t i = 0; i < asks.size(); ++i) {
      const int o = asks[i].owner;
      if (o < 0 || o >= world) continue;
      by_owner[o].push_back(i);
      mine[o].push_back(asks[i].request);
    }
    std::vector<std::string> out(world);
    for (int o = 0; o < world; ++o) {
      if (!mine[o].empty()) out[o] = EncodeCoopRequests(mine[o]);
      side.coop_request_bytes += static_cast<double>(out[o].size());
    }
    side.coop_asks = static_cast<double>(asks.size());
  }
  side.coop_ask_s = CpuSeconds() - c0;  // freeing them included: the load does that too
  side.coop_ask_mib = meter.PeakMiB();
  meter.Reset();
  c0 = CpuSeconds();
  uint64_t elements = 0;
  size_t parts = 0;
  ForEachExpandedPart(plan, md, kMaxExpandedItems, [&](const LoadPlan& part) {
    ++parts;
    for (const ReadItem& item : part.items) {  // each item's box, as a reader sizes its read
      uint64_t count = 1;
      for (int64_t len : item.lengths) count *= static_cast<uint64_t>(len);
      elements += count + item.storage_index.fqn.size();
    }
  });
  side.walk_s = CpuSeconds() - c0;
  side.walk_mib = meter.PeakMiB();
  side.read_parts = static_cast<double>(parts);
  g_sink = elements;
  ReadVolume(plan, md, world, side);
}

Row RunOne(int n, const std::vector<std::pair<std::string, Shape>>& params, int replicated,
           int full_load_max, double max_copies_mib, bool replicate) {
  Row row;
  row.n = n;
  // save/plan, follower side: every rank plans and encodes; the coordinator will hold them all.
  // Compact planning (what dcp::Save does with the default planner and a file-naming writer):
  // each rank sends the hash of its regular shards, a rule byte per shard and its residual
  // items; with --full-plans, every item (what Save did before, and still does when the ranks'
  // regular shards differ).
  std::vector<std::string> gathered(n);
  SavePlan local0, local1;  // rank 0's (the coordinator's own) and a follower's
  PlanSplit split0, split1;
  for (int r = 0; r < n; ++r) {
    StateDict sd = RankState(params, replicated, r, n, true);
    const double t0 = CpuSeconds();
    DefaultSavePlanner p;
    p.SetUp(sd, {r, n, r == 0});
    SavePlan local = p.CreateLocalPlan();
    PlanSplit split;
    if (g_full_plans) {
      gathered[r] = "P" + EncodeSavePlan(local);
    } else {
      split = SplitRegularShards(local, r, n);
      gathered[r] = "C" + EncodeCompactSavePlan(split);
    }
    const double dt = CpuSeconds() - t0;
    if (r == std::min(1, n - 1)) row.follower_plan_s = dt;
    row.gathered_mib += MiB(gathered[r].size());
    if (r == 0) {
      local0 = local;
      split0 = split;
    }
    if (r == std::min(1, n - 1)) {
      local1 = std::move(local);
      split1 = std::move(split);
    }
  }

  // save/plan, coordinator side.
  PeakMeter meter;
  double t0 = WallSeconds();
  DefaultSavePlanner coordinator;
  std::vector<SavePlan> locals;      // full plans
  std::vector<CompactSavePlan> got;  // compact plans
  if (g_full_plans) {
    locals.resize(n);
    ParallelFor(
        n,
        [&](size_t r) {
          locals[r] = DecodeSavePlan(std::string_view(gathered[r]).substr(1));
          std::string().swap(gathered[r]);
        },
        g_threads);
  } else {
    got.resize(n);
    ParallelFor(
        n,
        [&](size_t r) {
          got[r] =
              DecodeCompactSavePlan(std::string_view(gathered[r]).substr(1), static_cast<int>(r));
          std::string().swap(gathered[r]);
        },
        g_threads);
  }
  row.plan_decode_s = WallSeconds() - t0;
  const double merge0 = WallSeconds();
  std::vector<RegularRule> rules;
  std::vector<SavePlan> globals;
  Metadata md;
  if (g_full_plans) {
    std::tie(globals, md) = coordinator.CreateGlobalPlan(std::move(locals));
  } else {
    CompactMerge merged = MergeCompactPlans(coordinator, local0, split0, std::move(got));
    if (merged.outcome != RegularAgreement::kAgreed) {
      std::fprintf(stderr, "the ranks' regular shards or declarations differ from rank 0's\n");
      std::exit(1);
    }
    rules = std::move(merged.rules);
    globals = std::move(merged.plans);
    md = std::move(merged.md);
  }
  row.plan_merge_s = WallSeconds() - merge0;
  std::vector<std::string> scattered(n);
  ParallelFor(
      n,
      [&](size_t r) {
        globals[r].storage_data = "data-0123456789abcdef-r" + std::to_string(r);
        scattered[r] = (g_full_plans ? "P" : "C") + EncodeSavePlan(globals[r]);
        globals[r] = SavePlan();  // dcp::Save frees each plan once encoded
      },
      g_threads);
  row.plan_s = WallSeconds() - t0;
  for (const auto& m : scattered) row.scattered_mib += MiB(m.size());
  row.plan_mib = meter.PeakMiB();
  if (!g_full_plans) {  // the follower rebuilds its plan from its local plan and the reply
    const int f = std::min(1, n - 1);
    const double f0 = CpuSeconds();
    SavePlan central = RebuildGlobalPlan(
        local1, split1, DecodeSavePlan(std::string_view(scattered[f]).substr(1)), f);
    row.follower_plan_s += CpuSeconds() - f0;
    if (central.items.size() == 0 && !local1.items.empty()) std::exit(1);
  }
  // Rank r's plan, as it writes it: the reply's items, plus its regular shards when compact.
  auto rank_plan = [&](int r) {
    SavePlan mine = DecodeSavePlan(std::string_view(scattered[r]).substr(1));
    for (size_t k = 0; k < split0.regular.size(); ++k) {
      WriteItem item = local0.items[split0.regular[k].item];
      const int dim = split0.regular[k].dim;
      auto [b, e] = RegularSlice(item.global_shape[dim], r, n, rules[k]);
      if (e == b) continue;  // ranks beyond a short tensor's extent hold none of it
      item.chunk.offsets[dim] = b;
      item.chunk.sizes[dim] = e - b;
      item.index.offset = item.chunk.offsets;
      item.index.index = r;
      item.size_bytes =
          static_cast<uint64_t>(NumElements(item.chunk.sizes)) * ElementSize(item.dtype);
      mine.items.push_back(std::move(item));
    }
    return mine;
  };

  // save/plan with a plan cache hit (SavePlanCache): a follower plans, encodes and hashes its
  // local plan and sends 17 bytes; the coordinator compares N hashes with the cached ones, has
  // the writer name the cached plans' files and replies with the names (what Save does).
  {
    StateDict sd1 = RankState(params, replicated, std::min(1, n - 1), n, true);
    double f0 = CpuSeconds();
    DefaultSavePlanner p;
    p.SetUp(sd1, {std::min(1, n - 1), n, n == 1});
    const std::string enc = EncodeSavePlan(p.CreateLocalPlan());
    const uint64_t hash = (uint64_t{Crc32c(0, enc.data(), enc.size())} << 32) |
                          Crc32c(0x9E3779B9u, enc.data(), enc.size());
    row.follower_cached_s = CpuSeconds() - f0;
    std::vector<uint64_t> cached(n, hash), probes(n, hash);
    std::vector<SavePlan> cached_plans(n);  // what rank 0's cache holds (not timed)
    for (int r = 0; r < n; ++r) {
      cached_plans[r] = DecodeSavePlan(std::string_view(scattered[r]).substr(1));
    }
    meter.Reset();
    t0 = WallSeconds();
    bool hit = true;
    for (int r = 0; r < n; ++r) hit = hit && probes[r] == cached[r];
    std::vector<std::string> replies(n);
    if (hit) {  // the writer names the files of the cached plans (moved through it, as Save does)
      for (int r = 0; r < n; ++r) {
        cached_plans[r].storage_data = "data-fedcba9876543210-r" + std::to_string(r);
        replies[r] = "H" + cached_plans[r].storage_data;
      }
    }
    row.cached_plan_s = WallSeconds() - t0;
    row.cached_plan_mib = meter.PeakMiB();
    double cache_bytes = 0;
    for (const auto& g : cached_plans) cache_bytes += EncodeSavePlan(g).size();
    row.cache_mib = MiB(cache_bytes);
  }

  // save/write: write results from every rank, metadata filled and replicated. Version 2: each
  // rank reports its data file (its index, 41 bytes an item, stays in the file).
  std::vector<std::string> results(n);
  const bool v2 = g_metadata_version >= 2;
  for (int r = 0; r < n; ++r) {
    SavePlan mine = rank_plan(r);
    if (v2) {
      uint64_t data = 0;
      for (const auto& item : mine.items) data += item.size_bytes;
      DataFile f;
      f.name = mine.storage_data + "-b0.data";
      f.writer = r;
      f.index_offset = data;
      f.index_length = kFileIndexHeaderBytes + kFileIndexItemBytes * mine.items.size();
      f.size = data + f.index_length;
      f.index_crc32c = static_cast<uint32_t>(data * 2654435761u);
      results[r] = EncodeDataFiles({f});
      continue;
    }
    std::vector<WriteResult> wr;
    uint64_t offset = 0;
    for (const auto& item : mine.items) {
      WriteResult w;
      w.index = item.index;
      w.storage.relative_path = mine.storage_data + "-b0.data";
      w.storage.offset = offset;
      w.storage.length = item.size_bytes;
      w.storage.raw_length = item.size_bytes;
      w.storage.crc32c = static_cast<uint32_t>(offset * 2654435761u);
      offset += item.size_bytes;
      w.size_in_bytes = item.size_bytes;
      wr.push_back(std::move(w));
    }
    // StoreWriter returns its results in stored-item order.
    std::sort(wr.begin(), wr.end(),
              [](const WriteResult& a, const WriteResult& b) { return a.index < b.index; });
    results[r] = EncodeWriteResults(wr);
  }
  scattered.clear();
  meter.Reset();
  md.world_size = n;
  t0 = WallSeconds();
  {
    // What dcp::Save does with a StoreWriter: every rank's results merged from their payloads
    // into the storage map (never all decoded at once); then what StoreWriter::Finish does
    // before it writes: validate it all.
    if (v2) {
      md.format_version = 2;
      for (int r = 0; r < n; ++r) {
        for (DataFile& f : DecodeDataFiles(results[r], r)) md.files.push_back(std::move(f));
        std::string().swap(results[r]);
      }
    } else {
      md.format_version = 1;
      FillStorageFromEncoded(md, results);
    }
    results.clear();
    row.write_decode_s = WallSeconds() - t0;
    const double fill0 = WallSeconds();
    ValidateMetadata(md, "scale-bench");
    row.write_fill_s = WallSeconds() - fill0;
  }
  std::string md_bytes = EncodeMetadata(md);
  // Save frees its metadata once encoded (every rank decodes the reply, rank 0 too); it is
  // rebuilt below, unmetered, for the load phases.
  md = Metadata();

  row.md_mib = MiB(md_bytes.size());
  row.md_out_mib = row.md_mib * n;
  // --replicate: one copy of the metadata per rank; past --max-copies-mib the copies are
  // counted, not made (256 ranks of a 3,000-entry model would need ~22 GiB). Otherwise the
  // reply and one shared frame, as RunPhase and PointToPointCommunicator::Broadcast hold them.
  if (!replicate) row.md_out_mib = row.md_mib * 2;
  const bool materialize = !replicate || row.md_out_mib <= max_copies_mib;
  std::vector<std::string> replies;
  if (replicate && materialize) replies.assign(n, md_bytes);
  if (!replicate) {
    replies.push_back(md_bytes);                                // the serialized reply
    replies.push_back(std::string(19 + 10, 'h') + replies[0]);  // the frame, one shared buffer
  }
  row.write_s = WallSeconds() - t0;
  row.write_mib = meter.PeakMiB() + (materialize ? 0 : row.md_mib * (n - 1));
  row.copies_counted = !materialize;
  replies.clear();
  md = Metadata();

  // load/metadata: the coordinator has read and decoded the file (not timed here) and
  // broadcasts its payload as read (dcp::Load sends the file's bytes, not a re-encoding);
  // a follower decodes all of it.
  meter.Reset();
  t0 = WallSeconds();
  std::vector<std::string> bcast;
  if (replicate && materialize) bcast.assign(n, md_bytes);
  if (!replicate) {
    bcast.push_back(md_bytes);
    bcast.push_back(std::string(19 + 13, 'h') + bcast[0]);
  }
  row.load_md_s = WallSeconds() - t0;
  row.load_md_mib = meter.PeakMiB() + (materialize ? 0 : row.md_mib * (n - 1));
  bcast.clear();
  t0 = CpuSeconds();
  Metadata follower_md = DecodeMetadata(md_bytes, "scale-bench");
  row.follower_md_s = CpuSeconds() - t0;
  std::string().swap(md_bytes);

  // load/plan, as dcp::Load plans: every rank alone (its local plan, then a summary of its
  // request for read-once), the coordinator gathers the N summaries and broadcasts one
  // schedule. Twice: resuming in the saved layout, and the worst-case all-to-all reshard
  // (saved row-sharded, loaded column-sharded: each local chunk overlaps every saved chunk).
  for (const bool reshard : {false, true}) {
    LoadSide& side = reshard ? row.reshard : row.resume;
    const auto candidates = ShareCandidates(follower_md);
    auto summary = [&](int r, double* plan_s, double* plan_mib) {
      StateDict sd = RankState(params, replicated, r, n, !reshard);
      const double c0 = CpuSeconds();
      DefaultLoadPlanner lp;
      lp.SetUp(sd, follower_md, {r, n, r == 0});
      LoadPlan plan = lp.CreateLocalPlan();
      const auto items = CandidateItems(plan, candidates, follower_md);
      ReadRequestSummary mine = SummarizeRequest(plan, items, follower_md, true);
      // As dcp::Load with a reader that streams items and a communicator that exchanges
      // directly: how much partial reads would waste, enough of it for ShouldCooperate.
      // Its rule reads (planner/rule_reads.h) leave what cooperative reads weigh.
      const double w0 = CpuSeconds();
      const RuleReadTable table = FindRuleReads(
          plan, follower_md, r, n, CoopRoundBytes(StorageOptions{}.memory_budget_bytes));
      mine.rule_hash = table.hash;
      mine.rule_hash_ceil_first =
          FindRuleReads(plan, follower_md, r, n,
                        CoopRoundBytes(StorageOptions{}.memory_budget_bytes), kRuleCeil)
              .hash;
      std::vector<char> ruled(plan.items.size(), 0);
      for (const RuleRead& rr : table.reads) ruled[rr.item] = 1;
      mine.coop_waste = CoopWaste(table.reads.empty() ? plan : WithoutItems(plan, ruled),
                                  follower_md, CoopOwners(follower_md, n), /*verify=*/true,
                                  std::max(kCoopMinWaste, mine.plan_bytes / 16));
      const double waste_s = CpuSeconds() - w0;
      std::string msg = EncodeReadRequestSummary(mine);
      if (plan_s) {
        *plan_s = CpuSeconds() - c0;
        side.coop_waste_s = waste_s;
        side.plan_items = static_cast<double>(plan.items.size());
        *plan_mib = MiB(EncodeLoadPlan(plan).size());
        ReadPhase(plan, follower_md, r, n, meter, side);
        RulePhase(plan, follower_md, r, n, meter, side);
      }
      return msg;
    };
    double one_plan_mib = 0;
    const std::string one = summary(std::min(1, n - 1), &side.follower_s, &one_plan_mib);
    side.full_gather_mib_est = one_plan_mib * n;
    // The coordinator's input: every rank's own summary up to --full-load-max ranks; beyond,
    // N copies of a follower's (every rank reads the same replicated entries here).
    std::vector<std::string> gathered(n);
    side.exact = n <= full_load_max;
    for (int r = 0; r < n; ++r) gathered[r] = side.exact ? summary(r, nullptr, nullptr) : one;
    // N copies of one summary agree by construction: check the rule tables of a few other ranks
    // against it, as the coordinator would.
    bool same_rule_tables = true;
    if (!side.exact) {
      const uint64_t h = DecodeReadRequestSummary(one, candidates.size(), 1).rule_hash;
      for (int r : {0, n / 2, n - 1}) {
        same_rule_tables =
            same_rule_tables &&
            DecodeReadRequestSummary(summary(r, nullptr, nullptr), candidates.size(), r)
                    .rule_hash == h;
      }
    }
    for (const auto& g : gathered) side.gathered_bytes += static_cast<double>(g.size());
    meter.Reset();
    t0 = WallSeconds();
    std::vector<ReadRequestSummary> got(n);
    for (int r = 0; r < n; ++r) {
      got[r] = DecodeReadRequestSummary(gathered[r], candidates.size(), r);
      std::string().swap(gathered[r]);
    }
    ShareSchedule scheduled =
        ScheduleCandidates(got, CandidateBytes(candidates, follower_md), 256 << 20);
    scheduled.cooperative = ShouldCooperate(got);
    scheduled.rule_exchange = RuleExchangeOrder(got).has_value() && same_rule_tables;
    const std::string schedule = EncodeShareSchedule(scheduled);
    side.coordinator_s = WallSeconds() - t0;
    side.coordinator_mib = meter.PeakMiB();
    side.schedule_bytes = static_cast<double>(schedule.size());
    // The follower's read phase asks owners only when the load reads cooperatively.
    side.cooperative = scheduled.cooperative;
    // With rule exchange: its planning and the walk of the rest (the cooperative requests, if
    // any, counted for the whole plan: an upper bound).
    side.rule_exchange = scheduled.rule_exchange;
    const double walk_s = side.rule_exchange ? side.rule_plan_s + side.rest_walk_s : side.walk_s;
    const double walk_mib = side.rule_exchange ? side.rest_walk_mib : side.walk_mib;
    side.read_phase_s = walk_s + (side.cooperative ? side.coop_ask_s : 0);
    side.read_phase_mib = std::max(walk_mib, side.cooperative ? side.coop_ask_mib : 0);
  }
  return row;
}

double Growth(double prev, double cur, int prev_n, int cur_n) {
  if (prev <= 0 || cur <= 0) return 0;
  return std::log(cur / prev) / std::log(static_cast<double>(cur_n) / prev_n);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dcp-scale-bench: coordinator and follower cost of the protocol vs world size"};
  std::vector<int> ranks = {64, 256, 1024};
  int params = 1000, replicated = 50, full_load_max = 64;
  double max_copies_mib = 2048;
  bool replicate = false;
  std::string json_path;
  app.add_option("--json", json_path, "also write every figure to this file, as JSON");
  app.add_option("--ranks", ranks, "world sizes to simulate")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--params", params, "model parameters (x3 entries with Adam)")
      ->capture_default_str();
  app.add_option("--replicated", replicated, "replicated entries")->capture_default_str();
  int64_t d_model = 4096;
  app.add_option("--d-model", d_model,
                 "the model's width (the key/value projections have a quarter of it in rows)")
      ->check(CLI::Range(int64_t{4}, int64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--full-load-max", full_load_max,
                 "largest N whose all-to-all load gather is simulated in full")
      ->capture_default_str();
  app.add_option("--max-copies-mib", max_copies_mib,
                 "largest total of metadata copies actually allocated (beyond: counted)")
      ->capture_default_str();
  app.add_option("--threads", g_threads,
                 "coordinator threads for per-rank decoding/encoding (0: all cores, as dcp::Save)")
      ->capture_default_str();
  app.add_option("--metadata-version", g_metadata_version,
                 "metadata version the write phase commits (1: every item listed; 2: rules, a "
                 "file table and per-file indexes)")
      ->capture_default_str();
  app.add_flag("--full-plans", g_full_plans,
               "plan in full: every rank sends every item (before compact planning)");
  app.add_flag("--replicate", replicate,
               "model the old metadata distribution: one copy per rank (the 'before')");
  CLI11_PARSE(app, argc, argv);
  // Large buffers come from mmap and go back to the OS when freed, so the peak meter sees them.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  const auto shapes = Parameters(params, d_model);
  std::printf(
      "dcp-scale-bench: %d parameters x3 (model, exp_avg, exp_avg_sq) sharded over all "
      "ranks + %d replicated entries; %s plans; coordinator: wall seconds (%zu threads), "
      "follower: CPU seconds; peak extra MiB\n",
      params, replicated, g_full_plans ? "full" : "compact",
      g_threads ? g_threads : std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 16));
  std::printf("%6s | %8s %8s %8s | %8s %8s %9s %9s | %8s %9s | %9s %9s\n", "N", "plan s", "write s",
              "ldmeta s", "plan MiB", "wr MiB", "gather", "scatter", "md MiB", "md out", "f.plan s",
              "f.md s");
  std::vector<Row> rows;
  for (int n : ranks) {
    // Each N runs in a child process of its own: peak memory is then that N's alone (in one
    // process, the heap an earlier N left fragmented showed up as 5.9x the metadata at 1,024
    // ranks after 64 and 256, against 3.8x when 1,024 ran alone).
    Row r = Isolated(
        [&] { return RunOne(n, shapes, replicated, full_load_max, max_copies_mib, replicate); });
    std::printf(
        "%6d | %8.2f %8.2f %8.2f | %8.0f %8.0f %8.1fM %8.1fM | %8.2f %8.0fM | %9.4f %9.4f\n", r.n,
        r.plan_s, r.write_s, r.load_md_s, r.plan_mib, r.write_mib, r.gathered_mib, r.scattered_mib,
        r.md_mib, r.md_out_mib, r.follower_plan_s, r.follower_md_s);
    if (r.copies_counted) {
      std::printf(
          "%6s   (the %d metadata copies of the replies were counted in the MiB columns, "
          "not allocated)\n",
          "", r.n);
    }
    std::fflush(stdout);
    rows.push_back(r);
  }
  // Plan caching: a repeated save of the same structure (targets at 4,096 simulated ranks:
  // the first save plans in < 10 s, a repeated one in < 1 s).
  std::printf(
      "\nsave planning, first save (full) vs repeated save (plan cache hit), seconds:\n"
      "%6s | %10s %8s %8s %8s | %10s %9s | %10s %10s %10s\n",
      "N", "first: co.", "decode", "merge", "encode", "repeat: co", "co. MiB", "follower",
      "cache MiB", "speed-up");
  for (const Row& r : rows) {
    const double first = r.plan_s + r.follower_plan_s,
                 repeat = r.cached_plan_s + r.follower_cached_s;
    std::printf("%6d | %10.3f %8.3f %8.3f %8.3f | %10.4f %9.1f | %10.4f %10.1f %9.0fx\n", r.n,
                r.plan_s, r.plan_decode_s, r.plan_merge_s,
                r.plan_s - r.plan_decode_s - r.plan_merge_s, r.cached_plan_s, r.cached_plan_mib,
                r.follower_cached_s, r.cache_mib, first / std::max(repeat, 1e-9));
  }
  std::printf(
      "\nsave/write at the coordinator (results merged from the ranks' payloads into the storage "
      "map; the metadata validated, as StoreWriter::Finish does; encoded), seconds:\n%6s | %9s "
      "%9s %9s %9s\n",
      "N", "write s", "merge", "validate", "encode");
  for (const Row& r : rows) {
    std::printf("%6d | %9.3f %9.3f %9.3f %9.3f\n", r.n, r.write_s, r.write_decode_s, r.write_fill_s,
                r.write_s - r.write_decode_s - r.write_fill_s);
  }
  std::printf(
      "\nload/plan (rank-local: each rank plans alone and sends a summary of its request; the "
      "coordinator schedules read-once from the summaries). f.items: the items of a follower's "
      "plan; pieces / expand s: the plain items load/read expands them into before reading, and "
      "its CPU:\n%6s %8s | %10s %10s %10s %10s %10s | %10s %10s %9s | %14s\n",
      "N", "load", "f.plan s", "gathered", "co. s", "co. MiB", "reply", "f.items", "pieces",
      "expand s", "full gather");
  for (const Row& r : rows) {
    for (const auto& [name, side] :
         {std::pair{"resume", r.resume}, std::pair{"reshard", r.reshard}}) {
      std::printf(
          "%6d %8s | %10.4f %9.1fK %10.4f %10.1f %9.0fB | %10.0f %10.0f %9.3f | %13.1fM%s\n", r.n,
          name, side.follower_s, side.gathered_bytes / 1024, side.coordinator_s,
          side.coordinator_mib, side.schedule_bytes, side.plan_items, side.pieces, side.expand_s,
          side.full_gather_mib_est, side.exact ? "" : " (summaries: N copies of one)");
    }
  }
  std::printf(
      "\nload/read before the reader gets a byte, a follower (target at 4,096 ranks, all-to-all "
      "reshard: < 256 MiB and < 0.2 s of CPU). coop: its cooperative requests built and encoded "
      "(asks, bytes to all owners); walk: its plan expanded a part of <= %zu items at a time, "
      "each item touched; read: the walk, and the requests when the load reads cooperatively "
      "(coop? y). Then (not timed) it reads its pieces' bytes (data MiB) and, reading alone, the "
      "indexes of the files they lie in (index MiB):\n%6s %8s | %10s %6s %8s %8s | %10s %9s %8s "
      "%8s %5s | %8s %8s | %9s %9s\n",
      kMaxExpandedItems, "N", "load", "pieces", "parts", "walk s", "walk MiB", "coop asks",
      "requests", "coop s", "coop MiB", "coop?", "read s", "read MiB", "data MiB", "index MiB");
  for (const Row& r : rows) {
    for (const auto& [name, side] :
         {std::pair{"resume", r.resume}, std::pair{"reshard", r.reshard}}) {
      std::printf(
          "%6d %8s | %10.0f %6.0f %8.3f %8.1f | %10.0f %8.1fK %8.3f %8.1f %5s | %8.3f %8.1f | "
          "%9.1f %9.1f\n",
          r.n, name, side.pieces, side.read_parts, side.walk_s, side.walk_mib, side.coop_asks,
          side.coop_request_bytes / 1024, side.coop_ask_s, side.coop_ask_mib,
          side.cooperative ? "y" : "n", side.read_phase_s, side.read_phase_mib,
          MiB(side.read_data_bytes), MiB(side.read_index_bytes));
    }
  }
  std::printf(
      "\nrule exchange (rule?: the schedule exchanges the follower's rule reads; read s above is "
      "then its planning and the rest of its walk): reads and rounds, their planning, the walk of "
      "the rest of the plan, then the copies per piece on synthetic bytes: as a receiver placing "
      "every owner's pieces, as an owner packing every rank's, and their messages of one round "
      "at most (in and out, pooled buffers):\n%6s %8s | %5s %7s %6s | %8s %8s | %10s %10s %8s %8s "
      "%8s\n",
      "N", "load", "rule?", "reads", "rounds", "plan s", "rest s", "pieces in", "pieces out",
      "place s", "pack s", "msg MiB");
  for (const Row& r : rows) {
    for (const auto& [name, side] :
         {std::pair{"resume", r.resume}, std::pair{"reshard", r.reshard}}) {
      std::printf(
          "%6d %8s | %5s %7.0f %6.0f | %8.4f %8.4f | %10.0f %10.0f %8.3f %8.3f %8.1f | %9.1f\n",
          r.n, name, side.rule_exchange ? "y" : "n", side.rule_reads, side.rule_rounds,
          side.rule_plan_s, side.rest_walk_s, side.rule_pieces_in, side.rule_pieces_out,
          side.rule_place_s, side.rule_pack_s, side.rule_data_mib, MiB(side.rule_index_bytes));
    }
  }
  std::printf("\ngrowth exponent k (cost ~ N^k) between consecutive N:\n");
  std::printf("%6s %6s | %7s %7s %8s %8s %7s %9s %9s %9s\n", "from", "to", "plan s", "write s",
              "plan MiB", "md out", "md MiB", "f.md s", "f.resume", "f.reshard");
  for (size_t i = 1; i < rows.size(); ++i) {
    const Row &a = rows[i - 1], &b = rows[i];
    std::printf("%6d %6d | %7.2f %7.2f %8.2f %8.2f %7.2f %9.2f %9.2f %9.2f\n", a.n, b.n,
                Growth(a.plan_s, b.plan_s, a.n, b.n), Growth(a.write_s, b.write_s, a.n, b.n),
                Growth(a.plan_mib, b.plan_mib, a.n, b.n),
                Growth(a.md_out_mib, b.md_out_mib, a.n, b.n), Growth(a.md_mib, b.md_mib, a.n, b.n),
                Growth(a.follower_md_s, b.follower_md_s, a.n, b.n),
                Growth(a.resume.follower_s, b.resume.follower_s, a.n, b.n),
                Growth(a.reshard.follower_s, b.reshard.follower_s, a.n, b.n));
  }
  if (!json_path.empty()) {
    nlohmann::json out = nlohmann::json::array();
    for (const Row& r : rows) {
      auto side = [](const LoadSide& l) {
        return nlohmann::json{{"follower_plan_s", l.follower_s},
                              {"gathered_bytes", l.gathered_bytes},
                              {"coordinator_s", l.coordinator_s},
                              {"coordinator_peak_mib", l.coordinator_mib},
                              {"reply_bytes", l.schedule_bytes},
                              {"full_gather_mib_est", l.full_gather_mib_est},
                              {"summaries_exact", l.exact},
                              {"follower_plan_items", l.plan_items},
                              {"read_pieces", l.pieces},
                              {"read_expand_s", l.expand_s},
                              {"read_parts", l.read_parts},
                              {"read_walk_s", l.walk_s},
                              {"read_walk_peak_mib", l.walk_mib},
                              {"coop_asks", l.coop_asks},
                              {"coop_request_bytes", l.coop_request_bytes},
                              {"coop_ask_s", l.coop_ask_s},
                              {"coop_ask_mib", l.coop_ask_mib},
                              {"coop_waste_s", l.coop_waste_s},
                              {"cooperative", l.cooperative},
                              {"read_phase_cpu_s", l.read_phase_s},
                              {"read_phase_peak_mib", l.read_phase_mib},
                              {"read_data_mib", MiB(l.read_data_bytes)},
                              {"read_index_mib", MiB(l.read_index_bytes)},
                              {"rule_exchange", l.rule_exchange},
                              {"rule_reads", l.rule_reads},
                              {"rule_rounds", l.rule_rounds},
                              {"rule_plan_s", l.rule_plan_s},
                              {"rule_rest_walk_s", l.rest_walk_s},
                              {"rule_pieces_in", l.rule_pieces_in},
                              {"rule_pieces_out", l.rule_pieces_out},
                              {"rule_place_s", l.rule_place_s},
                              {"rule_pack_s", l.rule_pack_s},
                              {"rule_message_mib", l.rule_data_mib},
                              {"rule_index_mib", MiB(l.rule_index_bytes)}};
      };
      out.push_back({{"ranks", r.n},
                     {"metadata_version", g_metadata_version},
                     {"metadata_mib", r.md_mib},
                     {"save_plan_s", r.plan_s},
                     {"save_plan_peak_mib", r.plan_mib},
                     {"save_write_s", r.write_s},
                     {"save_write_peak_mib", r.write_mib},
                     {"save_gathered_mib", r.gathered_mib},
                     {"follower_save_plan_s", r.follower_plan_s},
                     {"load_metadata_s", r.load_md_s},
                     {"follower_metadata_decode_s", r.follower_md_s},
                     {"load_resume", side(r.resume)},
                     {"load_reshard", side(r.reshard)}});
    }
    std::ofstream(json_path) << out.dump(2) << "\n";
  }
  const Row& last = rows.back();
  std::printf(
      "\nCoordinator peak extra memory (target < 2 GiB): %.0f MiB at N=%d, %.1fx one encoded "
      "metadata\n",
      std::max(last.plan_mib, last.write_mib), last.n,
      std::max(last.plan_mib, last.write_mib) / std::max(last.md_mib, 1e-9));
  return 0;
}
