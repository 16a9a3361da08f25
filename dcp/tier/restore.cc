// MemoryTier::Restore and CompleteSteps: finding the newest step that survives complete across
// the nodes, fetching what this node's ranks read of it, and loading it.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "dcp/memory_tier.h"
#include "dcp/planner/default_planner.h"
#include "dcp/proto/error.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/storage/checkpoint/store_checkpoint.h"
#include "dcp/tier/file_mapping.h"
#include "dcp/tier/step_store.h"
#include "dcp/tier/tier_internal.h"

namespace dcp {

using namespace tier_detail;

namespace {

// The newest step complete across the surviving copies, or null.
const Candidate* Newest(const std::vector<Candidate>& candidates) {
  for (const auto& c : candidates) {
    if (c.complete()) return &c;
  }
  return nullptr;
}

// The metadata of the step in `dir`, read on rank `md_root` (one of a node that committed it)
// and broadcast.
std::string FetchMetadata(Communicator& comm, int md_root, const std::string& dir) {
  std::string encoded;
  std::string error;
  if (comm.rank() == md_root) {
    try {
      encoded = ReadTierFile(dir + "/" + TierMetadataName(), kMaxTierMetadataBytes);
    } catch (const std::exception& e) {
      error = ErrorText(e);
    }
  }
  Vote(comm, error, "tier/recover-metadata");
  return comm.Broadcast(std::move(encoded), md_root, "tier/recover-metadata");
}

// The files (of `names`, sorted) this rank's load reads: its plan's, from the metadata and its
// own request (a custom planner's reads are not known in advance: every file).
// *planned: whether the files are known (false when planning failed: the load then fails alike).
std::vector<bool> FilesToRead(StateDict& state, const Metadata& md,
                              const std::vector<std::string>& names, const LoadOptions& options,
                              int rank, int world, bool* planned) {
  std::vector<bool> need(names.size(), options.planner != nullptr);
  *planned = true;
  if (options.planner != nullptr) return need;
  try {
    LoadPlannerOptions po;
    po.allow_partial_load = options.allow_partial_load;
    po.cast_dtypes = options.cast_dtypes;
    DefaultLoadPlanner planner(po);
    planner.SetUp(state, md, PlannerContext{rank, world, rank == 0});
    auto mark = [&](const std::string& file) {
      auto pos = std::lower_bound(names.begin(), names.end(), file);
      if (pos != names.end() && *pos == file) need[pos - names.begin()] = true;
    };
    std::set<int32_t> writers;  // version 2: the ranks whose files hold the planned items
    for (const auto& item : planner.CreateLocalPlan().items) {
      if (md.format_version >= 2) {
        auto e = md.entries.find(item.storage_index.fqn);
        if (e == md.entries.end()) continue;
        if (const auto* t = std::get_if<TensorMetadata>(&e->second)) {
          if (auto k = ChunkOrdinal(*t, item.storage_index.offset, item.storage_index.index)) {
            for (size_t c = *k; c < *k + item.chunk_span; ++c) writers.insert(ChunkWriter(*t, c));
          }
        } else {
          writers.insert(std::get<BytesMetadata>(e->second).writer);
        }
        continue;
      }
      auto it = md.storage.find(item.storage_index);
      if (it != md.storage.end()) mark(it->second.relative_path);
    }
    for (const DataFile& f : md.files) {
      if (writers.count(f.writer)) mark(f.name);
    }
  } catch (const Error&) {
    // The load fails the same way, on every rank, with the planner's message.
    *planned = false;
  }
  return need;
}

// Which of the step's files (indexes into `names`) the ranks of each node read, from every
// rank's list (`all_wanted`); CorruptionError for an index out of range.
std::vector<std::vector<bool>> WantedByNode(const std::vector<std::string>& all_wanted,
                                            size_t file_count,
                                            const std::vector<std::vector<int>>& nodes) {
  std::vector<std::vector<bool>> wanted(nodes.size(), std::vector<bool>(file_count));
  for (size_t n = 0; n < nodes.size(); ++n) {
    for (int r : nodes[n]) {
      MessageReader in(all_wanted[r], "rank " + std::to_string(r));
      while (!in.done()) {
        const uint64_t i = in.U64();
        if (i >= file_count) {
          throw CorruptionError("memory tier: rank " + std::to_string(r) + " needs file " +
                                std::to_string(i) + " of " + std::to_string(file_count));
        }
        wanted[n][i] = true;
      }
    }
  }
  return wanted;
}

// After CheckCopies: when a file some rank reads has no intact copy left, fails on every rank
// (kCorruption, naming each such file and what is wrong with each of its copies); else says on
// stderr (rank 0) which copies were damaged, their files being read from other nodes.
void ReportDamage(Communicator& comm, int64_t step, const std::vector<std::string>& names,
                  const std::vector<std::vector<bool>>& wanted,
                  std::map<std::string, std::vector<int>>& holders,
                  const std::map<std::pair<int, size_t>, std::string>& damaged) {
  std::string lost;
  for (size_t i = 0; i < names.size(); ++i) {
    const bool read =
        std::any_of(wanted.begin(), wanted.end(), [&](const std::vector<bool>& w) { return w[i]; });
    if (!read || !holders[names[i]].empty()) continue;
    lost += (lost.empty() ? "" : "; ") + names[i] + " (";
    bool first = true;
    for (const auto& [copy, why] : damaged) {
      if (copy.second != i) continue;
      lost += (first ? "" : ", ") + std::string("node ") + std::to_string(copy.first) + ": " + why;
      first = false;
    }
    lost += ")";
  }
  if (comm.rank() == 0 && lost.empty()) {
    for (const auto& [copy, why] : damaged) {
      std::fprintf(stderr,
                   "dcp: memory tier: step %lld: node %d's copy of %s is damaged (%s); the "
                   "restore uses another node's intact copy\n",
                   static_cast<long long>(step), copy.first, names[copy.second].c_str(),
                   why.c_str());
    }
  }
  std::string error;
  if (comm.rank() == 0 && !lost.empty()) {
    error = ErrorText(CorruptionError("memory tier: step " + std::to_string(step) +
                                      " has no intact copy of " + lost));
  }
  Vote(comm, error, "tier/recover-check");
}

// Which of the step's files (indexes into `names`) each node keeps when the job is whole: the
// files of its ranks and its ranks' replicas of their partners' files, as a save leaves them
// (PartnersOf). A restore fetches them too, so that the job is as redundant as after a save
// before its next save. Only for a step saved at this world size in version 2 (the file table
// names each file's writer) and with `replicas` > 0; else nothing is kept beyond what is read.
std::vector<std::vector<bool>> KeptByNode(const Metadata& md, const std::vector<std::string>& names,
                                          const std::vector<std::vector<int>>& nodes,
                                          int replicas) {
  std::vector<std::vector<bool>> kept(nodes.size(), std::vector<bool>(names.size()));
  int world = 0;
  for (const auto& ranks : nodes) world += static_cast<int>(ranks.size());
  if (replicas <= 0 || md.format_version < 2 || md.world_size != world) return kept;
  std::vector<int> node_of(world, -1);
  for (size_t n = 0; n < nodes.size(); ++n) {
    for (int r : nodes[n]) node_of[r] = static_cast<int>(n);
  }
  for (const DataFile& f : md.files) {
    auto pos = std::lower_bound(names.begin(), names.end(), f.name);
    if (pos == names.end() || *pos != f.name || f.writer < 0 || f.writer >= world) continue;
    const size_t i = static_cast<size_t>(pos - names.begin());
    const int writer_node = node_of[f.writer];
    kept[writer_node][i] = true;
    for (int p : PartnersOf(nodes, writer_node, f.writer, replicas)) kept[node_of[p]][i] = true;
  }
  return kept;
}

// A copy of one of the step's files that a rank found damaged: its node, the file (an index into
// the step's sorted names) and what is wrong.
struct DamagedCopy {
  int node = 0;
  size_t file = 0;
  std::string why;
};

// Every rank's damaged copies (`mine`: PutU64 of the file's index, PutString of why, per copy),
// gathered under `phase`, alike on every rank. CorruptionError for a report of a file that is
// not among the step's `files`, or from a rank of no node (`node_of`: each rank's node).
std::vector<DamagedCopy> GatherDamage(Communicator& comm, std::string mine, std::string_view phase,
                                      size_t files, const std::vector<int>& node_of) {
  std::vector<DamagedCopy> out;
  const auto all = comm.AllGather(std::move(mine), phase);
  for (int r = 0; r < comm.size(); ++r) {
    MessageReader in(all[r], "rank " + std::to_string(r));
    while (!in.done()) {
      const uint64_t i = in.U64();
      std::string why = in.String();
      if (i >= files || node_of[r] < 0) {
        throw CorruptionError("memory tier: rank " + std::to_string(r) +
                              " reports damage in file " + std::to_string(i) + " of " +
                              std::to_string(files));
      }
      out.push_back({node_of[r], static_cast<size_t>(i), std::move(why)});
    }
  }
  return out;
}

// The copies of the step's files a restore may use, checked before it uses them (DamageIn):
// starts from the nodes that hold each file (`holders`, by name) and returns them less the
// damaged copies, whose damage goes into `damaged` ((node, file index) -> what is wrong), alike
// on every rank, as the copies it checked go into `checked`. A node's copy is checked when its
// ranks read it (`wanted`), or when a node that reads the file or keeps a replica of it (`kept`)
// lacks it (that copy may be sent); each node's ranks share its checks in turns. Dropping a damaged
// copy can make a node lack a file, so the checks go in rounds until no copy that may be used is
// unchecked.
std::map<std::string, std::vector<int>> CheckCopies(
    Communicator& comm, const Metadata& md, const std::string& dir,
    const std::vector<std::string>& names, const std::vector<std::vector<bool>>& wanted,
    const std::vector<std::vector<bool>>& kept, std::map<std::string, std::vector<int>> holders,
    const std::vector<std::vector<int>>& nodes, int node, int rank,
    std::map<std::pair<int, size_t>, std::string>& damaged,
    std::set<std::pair<int, size_t>>& checked) {
  std::vector<int> node_of(comm.size(), -1);
  for (size_t n = 0; n < nodes.size(); ++n) {
    for (int r : nodes[n]) node_of[r] = static_cast<int>(n);
  }
  auto holds = [&](int n, size_t i) {
    const auto& h = holders[names[i]];
    return std::find(h.begin(), h.end(), n) != h.end();
  };
  for (;;) {
    std::vector<std::pair<int, size_t>> to_check;  // (node, file), in one order on every rank
    for (size_t i = 0; i < names.size(); ++i) {
      bool lacking = false;
      for (size_t n = 0; n < nodes.size(); ++n) {
        if (wanted[n][i] || kept[n][i]) lacking = lacking || !holds(static_cast<int>(n), i);
      }
      for (int h : holders[names[i]]) {
        if (!checked.count({h, i}) && (wanted[h][i] || lacking)) to_check.emplace_back(h, i);
      }
    }
    if (to_check.empty()) break;
    std::string mine;
    size_t turn = 0;
    for (const auto& copy : to_check) {
      checked.insert(copy);
      if (copy.first != node || nodes[node][turn++ % nodes[node].size()] != rank) continue;
      const std::string why = DamageIn(dir, md, names[copy.second]);
      if (!why.empty()) {
        PutU64(mine, copy.second);
        PutString(mine, why);
      }
    }
    for (auto& d :
         GatherDamage(comm, std::move(mine), "tier/recover-check", names.size(), node_of)) {
      auto& h = holders[names[d.file]];
      h.erase(std::remove(h.begin(), h.end(), d.node), h.end());
      damaged[{d.node, d.file}] = std::move(d.why);
    }
  }
  return holders;
}

// Who moves which file of the step to whom; every rank computes the same plan, so both sides
// of each transfer know it.
struct FetchPlan {
  std::vector<Transfer> outgoing;  // the files this rank sends
  int expected = 0;                // how many this rank receives
  std::set<int> receivers, senders;
};

// What each node lacks of what it needs (`need`, by node: the files its ranks read and those
// it keeps replicas of), and who moves it: the least loaded node holding the file intact sends
// it, its ranks taking turns, and the lacking node's ranks take turns receiving, so that a
// node's loss spreads its recovery over every rank of the survivors and of the new node. A file
// no node holds intact is not moved (CheckCopies' caller refuses the restore when a rank reads
// one).
FetchPlan PlanFetches(const std::vector<std::vector<bool>>& need,
                      const std::vector<std::string>& names,
                      const std::map<std::string, uint64_t>& referenced, const Candidate& chosen,
                      const std::map<int, const StepReport*>& report_of,
                      const std::vector<std::vector<int>>& nodes, int rank) {
  const int node_count = static_cast<int>(nodes.size());
  std::vector<uint64_t> sent_by_node(node_count, 0);
  std::vector<size_t> turns_of_node(node_count, 0);
  FetchPlan plan;
  for (int n = 0; n < node_count; ++n) {
    std::set<size_t> lacking;
    auto rep = report_of.find(n);
    for (size_t i = 0; i < names.size(); ++i) {
      if (!need[n][i]) continue;
      if (rep != report_of.end() && rep->second->present.count(names[i])) continue;
      auto h = chosen.holders.find(names[i]);
      if (h != chosen.holders.end() && !h->second.empty()) lacking.insert(i);
    }
    size_t k = 0;
    for (size_t i : lacking) {
      const auto& holders = chosen.holders.at(names[i]);
      int best = holders.front();
      for (int h : holders) {
        if (sent_by_node[h] < sent_by_node[best]) best = h;
      }
      sent_by_node[best] += referenced.at(names[i]);
      const int sender = nodes[best][turns_of_node[best]++ % nodes[best].size()];
      const int receiver = nodes[n][k++ % nodes[n].size()];
      if (sender == rank) {
        plan.outgoing.push_back({receiver, names[i]});
        plan.receivers.insert(receiver);
      }
      if (receiver == rank) {
        ++plan.expected;
        plan.senders.insert(sender);
      }
    }
  }
  return plan;
}

// Which of a restored step's files this rank copies when the step is drained (Drain, or the
// preemption handler's), now that each node holds what it fetched (`need`) besides its intact
// copies (`holders`): each file once, by its writer when the writer's node holds it (as after a
// save; version 2 names writers, at the world size the step was saved at), else by a rank of the
// holding node with the fewest bytes to copy so far, its ranks in turns. Alike on every rank.
// nullopt when a file has no copy left (the step cannot be drained whole).
std::optional<std::vector<std::string>> FilesToDrain(
    const Metadata& md, const std::vector<std::string>& names,
    const std::map<std::string, uint64_t>& referenced,
    const std::map<std::string, std::vector<int>>& holders,
    const std::vector<std::vector<bool>>& need, const std::vector<std::vector<int>>& nodes,
    int rank) {
  int world = 0;
  for (const auto& ranks : nodes) world += static_cast<int>(ranks.size());
  std::vector<int> node_of(world, -1);
  for (size_t n = 0; n < nodes.size(); ++n) {
    for (int r : nodes[n]) node_of[r] = static_cast<int>(n);
  }
  std::map<std::string, int> writer;
  if (md.world_size == world) {
    for (const DataFile& f : md.files) {
      if (f.writer >= 0 && f.writer < world) writer[f.name] = f.writer;
    }
  }
  std::vector<uint64_t> to_copy(nodes.size(), 0);
  std::vector<size_t> turn(nodes.size(), 0);
  std::vector<std::string> mine;
  for (size_t i = 0; i < names.size(); ++i) {
    auto h = holders.find(names[i]);
    if (h == holders.end() || h->second.empty()) return std::nullopt;
    auto holds = [&](int n) {
      return need[n][i] || std::find(h->second.begin(), h->second.end(), n) != h->second.end();
    };
    int drainer = -1;
    if (auto w = writer.find(names[i]); w != writer.end() && holds(node_of[w->second])) {
      drainer = w->second;
    } else {
      int best = -1;
      for (int n = 0; n < static_cast<int>(nodes.size()); ++n) {
        if (holds(n) && (best < 0 || to_copy[n] < to_copy[best])) best = n;
      }
      drainer = nodes[best][turn[best]++ % nodes[best].size()];
    }
    to_copy[node_of[drainer]] += referenced.at(names[i]);
    if (drainer == rank) mine.push_back(names[i]);
  }
  return mine;
}

// Which of the step's files this rank drains (FilesToDrain), each from a copy known intact. A
// copy in `intact` ((node, file index): checked, or fetched from a checked copy) is trusted; any
// other copy assigned is checked by the rank that would drain it (DamageIn), the ranks exchange
// what is damaged, and a damaged copy is dropped (from `holders` and `need`) and the files
// assigned again, until every assigned copy is known intact. Each round drops a copy, so the
// rounds end. Alike on every rank; nullopt when some file has no intact copy left.
std::optional<std::vector<std::string>> IntactFilesToDrain(
    Communicator& comm, int64_t step, const Metadata& md, const std::string& dir,
    const std::vector<std::string>& names, const std::map<std::string, uint64_t>& referenced,
    std::map<std::string, std::vector<int>> holders, std::vector<std::vector<bool>> need,
    std::set<std::pair<int, size_t>> intact, const std::vector<std::vector<int>>& nodes, int node,
    int rank) {
  std::vector<int> node_of(comm.size(), -1);
  for (size_t n = 0; n < nodes.size(); ++n) {
    for (int r : nodes[n]) node_of[r] = static_cast<int>(n);
  }
  for (;;) {
    auto files = FilesToDrain(md, names, referenced, holders, need, nodes, rank);
    std::string damaged;  // this rank's damaged copies, as indexes into `names`
    for (const auto& name : files ? *files : std::vector<std::string>()) {
      const size_t i =
          static_cast<size_t>(std::lower_bound(names.begin(), names.end(), name) - names.begin());
      if (!intact.insert({node, i}).second) continue;
      const std::string why = DamageIn(dir, md, name);
      if (why.empty()) continue;
      std::fprintf(stderr,
                   "dcp: memory tier: step %lld: node %d's copy of %s is damaged (%s); a drain "
                   "of the step copies another node's copy if one is intact\n",
                   static_cast<long long>(step), node, name.c_str(), why.c_str());
      PutU64(damaged, i);
      PutString(damaged, why);
    }
    const auto found =
        GatherDamage(comm, std::move(damaged), "tier/drain-check", names.size(), node_of);
    for (const auto& d : found) {
      auto& h = holders[names[d.file]];
      h.erase(std::remove(h.begin(), h.end(), d.node), h.end());
      need[d.node][d.file] = false;
      intact.erase({d.node, d.file});
    }
    if (!files || found.empty()) return files;  // alike on every rank
  }
}

// The files of a restored step this rank drains. With checks on, the copies the restore checked
// intact (`intact`) and those its nodes fetched (from checked copies: a file a node needs and
// its report, `report_of`, lacks) are trusted, and any other is checked before it is assigned
// (IntactFilesToDrain). With checks off (LoadOptions::storage.verify_checksums), the restore
// checked nothing and neither does this.
std::optional<std::vector<std::string>> DrainableFiles(
    Communicator& comm, int64_t step, const Metadata& md, const std::string& dir,
    const std::vector<std::string>& names, const std::map<std::string, uint64_t>& referenced,
    const std::map<std::string, std::vector<int>>& holders,
    const std::vector<std::vector<bool>>& need, bool check, std::set<std::pair<int, size_t>> intact,
    const std::map<int, const StepReport*>& report_of, const std::vector<std::vector<int>>& nodes,
    int node, int rank) {
  if (!check) return FilesToDrain(md, names, referenced, holders, need, nodes, rank);
  for (size_t n = 0; n < need.size(); ++n) {
    const auto rep = report_of.find(static_cast<int>(n));
    for (size_t i = 0; i < names.size(); ++i) {
      if (need[n][i] && (rep == report_of.end() || !rep->second->present.count(names[i]))) {
        intact.insert({static_cast<int>(n), i});
      }
    }
  }
  return IntactFilesToDrain(comm, step, md, dir, names, referenced, holders, need,
                            std::move(intact), nodes, node, rank);
}

// Every file is in: a node that did not hold the step commits its copy (its first rank).
void CommitLocalCopy(Communicator& comm, bool commit, const std::string& dir,
                     const std::string& encoded) {
  std::string error;
  if (commit) {
    try {
      WriteWholeFile(dir + "/" + TierMetadataName(), encoded);
    } catch (const std::exception& e) {
      error = ErrorText(e);
    }
  }
  Vote(comm, error, "tier/recover-commit");
}

// Loads the step from this node's directory `dir`, as an ordinary dcp location (`uri`) whose
// files that only other nodes hold (`report_of`) count as present.
void LoadLocal(StateDict& state, const LoadOptions& options, Communicator& comm, MappingPool& pool,
               const std::string& dir, const std::string& recycle, const std::string& uri,
               const std::map<int, const StepReport*>& report_of) {
  std::map<std::string, uint64_t> elsewhere;
  for (const auto& [node, rep] : report_of) {
    for (const auto& [name, size] : rep->present) elsewhere.emplace(name, size);
  }
  auto store = std::make_shared<TierStepStore>(StepStore(dir), pool, dir, recycle, uri,
                                               std::move(elsewhere));
  auto reader = MakeStoreReader(store, options.storage);
  dcp::Load(state, *reader, comm, options);
}

}  // namespace

// A restored step becomes one the tier may drain, as if this process had saved it: a job
// restarted from memory and preempted before its next commit drains the step it restored, which
// may be newer than any durable one. Registered on every rank or on none, so that every
// handler reports the same newest step: a rank whose preemption handler settled before its
// restore began says so, and then no rank registers; a handler that settles later waits for
// the restore's BusyScope to end, after this.
void MemoryTier::KeepForDrain(int64_t step, const std::string& encoded,
                              std::optional<std::vector<std::string>> files) {
  bool can = files.has_value();
  {
    std::lock_guard<std::mutex> lock(mu_);
    can = can && !settled_for_preemption_;
  }
  for (const auto& said : comm_.AllGather(can ? "1" : "0", "tier/recover-drainable")) {
    if (said != "1") return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  written_[step] = std::move(*files);
  metadata_[step] = encoded;
}

// The handler of a notice that came before the job's restore (or before a restore that began
// after the handler settled, which then records nothing) finds the step itself: the newest
// complete one, which a restart would restore. Nothing is fetched; each file is drained from a
// node holding it. The copies were written by an earlier process, so each is checked before it
// is drained (IntactFilesToDrain).
MemoryTier::SettledStep MemoryTier::AdoptNewestHeld(Communicator& comm) {
  SettledStep out;
  out.settled = true;
  const auto candidates = Candidates(GatherReports(comm));
  const Candidate* chosen = Newest(candidates);
  if (chosen == nullptr) return out;
  const int64_t step = chosen->step;
  const std::string dir = StepDirectory(step);
  const std::string encoded = FetchMetadata(comm, nodes_[chosen->nodes.front()].front(), dir);
  const Metadata md = DecodeMetadataFile(encoded, "tier://" + options_.name + "/" + StepName(step));
  const auto referenced = ReferencedFiles(md);
  std::vector<std::string> names;
  for (const auto& [name, extent] : referenced) names.push_back(name);
  const std::vector<std::vector<bool>> fetched(nodes_.size(), std::vector<bool>(names.size()));
  auto files = IntactFilesToDrain(comm, step, md, dir, names, referenced, chosen->holders, fetched,
                                  {}, nodes_, node_, rank_);
  if (!files) return out;  // a file with no intact copy left: alike on every rank
  std::lock_guard<std::mutex> lock(mu_);
  written_[step] = std::move(*files);
  metadata_[step] = encoded;
  out.step = step;
  return out;
}

std::vector<int64_t> MemoryTier::CompleteSteps() {
  Wait();
  std::set<int64_t> steps;
  for (const auto& c : Candidates(GatherReports(comm_))) {
    if (c.complete()) steps.insert(c.step);
  }
  return {steps.begin(), steps.end()};
}

std::optional<int64_t> MemoryTier::Restore(StateDict& state, const LoadOptions& options) {
  if (closed_) throw InvalidArgumentError("memory tier: Restore after Close");
  Wait();
  // A preemption handler that settles during the restore waits until the restored step is
  // recorded for a drain (KeepForDrain), so a notice during a restart's restore drains it.
  auto restoring = std::make_unique<BusyScope>(*this);
  restoring->Enter();
  stats_ = {};
  const uint64_t mapped_before = pool_->bytes_mapped();
  auto t0 = std::chrono::steady_clock::now();
  // Agree on the step: every rank sees every node's report.
  const auto reports = GatherReports(comm_);
  const auto candidates = Candidates(reports);
  const Candidate* chosen = Newest(candidates);
  if (chosen == nullptr) return std::nullopt;
  const int64_t step = chosen->step;
  const std::string dir = StepDirectory(step);
  const bool committed_here =
      std::find(chosen->nodes.begin(), chosen->nodes.end(), node_) != chosen->nodes.end();

  // The metadata, from the first node that committed the step.
  const std::string encoded = FetchMetadata(comm_, nodes_[chosen->nodes.front()].front(), dir);
  const Metadata md = DecodeMetadataFile(encoded, "tier://" + options_.name + "/" + StepName(step));
  const auto referenced = ReferencedFiles(md);
  std::vector<std::string> names;
  for (const auto& [name, extent] : referenced) names.push_back(name);

  bool planned = true;
  const auto reads = FilesToRead(state, md, names, options, rank_, comm_.size(), &planned);
  std::string mine;
  for (size_t i = 0; i < names.size(); ++i) {
    if (reads[i]) PutU64(mine, i);
  }
  const auto wanted =
      WantedByNode(comm_.AllGather(std::move(mine), "tier/recover-needs"), names.size(), nodes_);
  const auto kept = KeptByNode(md, names, nodes_, cannot_save_.empty() ? options_.replicas : 0);
  std::vector<std::vector<bool>> need = wanted;
  for (size_t n = 0; n < need.size(); ++n) {
    for (size_t i = 0; i < names.size(); ++i) need[n][i] = need[n][i] || kept[n][i];
  }
  // The nodes' copies of the step; with checksums on, each copy a load would use is checked
  // first, and a damaged one is dropped: the file then comes from a node whose copy is intact.
  std::vector<StepReport> copies;
  for (const auto& rep : reports) {
    if (rep.step == step && rep.metadata_hash == chosen->hash) copies.push_back(rep);
  }
  Candidate source = *chosen;
  const bool check = options.storage.verify_checksums;
  std::set<std::pair<int, size_t>> checked;  // (node, file): copies checked, intact or not
  if (check) {
    std::map<std::pair<int, size_t>, std::string> damaged;
    source.holders = CheckCopies(comm_, md, dir, names, wanted, kept, chosen->holders, nodes_,
                                 node_, rank_, damaged, checked);
    for (const auto& [copy, why] : damaged) checked.erase(copy);
    stats_.damaged_copies = static_cast<int>(damaged.size());
    for (auto& rep : copies) {
      for (const auto& [copy, why] : damaged) {
        if (copy.first == rep.node) rep.present.erase(names[copy.second]);
      }
    }
    ReportDamage(comm_, step, names, wanted, source.holders, damaged);
  }
  std::map<int, const StepReport*> report_of;
  for (const auto& rep : copies) report_of[rep.node] = &rep;
  const FetchPlan plan = PlanFetches(need, names, referenced, source, report_of, nodes_, rank_);

  // Whatever this node holds of the step is not committed here: start it afresh.
  std::string error;
  if (leader() && !committed_here) {
    error = FreshStepDirectory(dir, JobDirectory(options_), options_.owner, root_);
  }
  Vote(comm_, error, "tier/recover-prepare");
  std::vector<std::string> received;
  const Pairs pairs{{plan.receivers.begin(), plan.receivers.end()},
                    {plan.senders.begin(), plan.senders.end()}};
  TransferFiles(comm_, step, plan.outgoing, "tier/recover", &received, &pairs);
  stats_.files_fetched = static_cast<int>(received.size());
  stats_.bytes_mapped += pool_->bytes_mapped() - mapped_before;
  error.clear();
  if (static_cast<int>(received.size()) != plan.expected) {
    error = IoText("memory tier: rank " + std::to_string(rank_) + " received " +
                   std::to_string(received.size()) + " of the " + std::to_string(plan.expected) +
                   " files it fetches for node " + std::to_string(node_));
  }
  Vote(comm_, error, "tier/recover-received");
  CommitLocalCopy(comm_, leader() && !committed_here, dir, encoded);
  KeepForDrain(step, encoded,
               DrainableFiles(comm_, step, md, dir, names, referenced, source.holders, need, check,
                              std::move(checked), report_of, nodes_, node_, rank_));
  restoring.reset();
  stats_.recover_s = SecondsSince(t0);

  auto t1 = std::chrono::steady_clock::now();
  // Every copy the load reads was checked above (when the files it reads are known): the load
  // need not compute the same CRCs again.
  LoadOptions load_options = options;
  if (check && planned) load_options.storage.verify_checksums = false;
  LoadLocal(state, load_options, comm_, *pool_, dir, root_ + "/" + kRecycleDir,
            "tier://" + options_.name + "/" + StepName(step), report_of);
  stats_.load_s = SecondsSince(t1);
  next_step_ = std::max(next_step_, step + 1);
  return step;
}

}  // namespace dcp
