// MemoryTier: the tier's setup (nodes, partners, the node's directory), its saves and Close.
// Transfers, restores, drains and the step directories have files of their own in dcp/tier/.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dcp/async_checkpointer.h"
#include "dcp/memory_tier.h"
#include "dcp/proto/error.h"
#include "dcp/storage/checkpoint/store_checkpoint.h"
#include "dcp/tier/file_mapping.h"
#include "dcp/tier/replicator.h"
#include "dcp/tier/step_store.h"
#include "dcp/tier/tier_internal.h"

namespace dcp {

namespace fs = std::filesystem;

namespace tier_detail {

// A rank's failure as a vote carries it: "<ErrorCode>:<message>", so that every rank raises
// the category the failing rank met (a refused directory is not an I/O error).
std::string ErrorText(const std::exception& e) {
  const auto* error = dynamic_cast<const Error*>(&e);
  const ErrorCode code = error != nullptr ? error->code() : ErrorCode::kInternal;
  return std::to_string(static_cast<int>(code)) + ":" + e.what();
}
std::string IoText(const std::string& message) {
  return std::to_string(static_cast<int>(ErrorCode::kIo)) + ":" + message;
}
RankFailure DecodeFailure(int rank, const std::string& text) {
  const size_t colon = text.find(':');
  int code = 0;
  if (colon != std::string::npos && colon > 0 && colon <= 2) {
    for (size_t i = 0; i < colon && code >= 0; ++i) {
      code = text[i] >= '0' && text[i] <= '9' ? code * 10 + (text[i] - '0') : -1;
    }
  }
  if (code <= 0 || code > static_cast<int>(ErrorCode::kPreempted)) {
    return {rank, ErrorCode::kIo, text, false};
  }
  return {rank, static_cast<ErrorCode>(code), text.substr(colon + 1), false};
}

void Vote(Communicator& comm, const std::string& my_error, std::string_view phase) {
  auto all = comm.AllGather(my_error, phase);
  std::vector<RankFailure> failures;
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    if (!all[r].empty()) failures.push_back(DecodeFailure(r, all[r]));
  }
  if (failures.empty()) return;
  // Refused by a preemption (MemoryTier::BeginPreemption) on every rank that refused: the same
  // failures, so the same PreemptedError, on every rank.
  const bool preempted = std::all_of(failures.begin(), failures.end(), [](const RankFailure& f) {
    return f.code == ErrorCode::kPreempted;
  });
  CollectiveError error(std::string(phase), std::move(failures));
  if (preempted) throw PreemptedError(error.what());
  throw error;
}

// A rank's partners: the rank at its position (modulo their size) on each of the next
// `replicas` nodes.
std::vector<int> PartnersOf(const std::vector<std::vector<int>>& nodes, int node, int rank,
                            int replicas) {
  const int nn = static_cast<int>(nodes.size());
  const auto& mine = nodes[node];
  const size_t position = std::find(mine.begin(), mine.end(), rank) - mine.begin();
  std::vector<int> partners;
  for (int j = 1; j <= replicas; ++j) {
    const auto& other = nodes[(node + j) % nn];
    partners.push_back(other[position % other.size()]);
  }
  return partners;
}

}  // namespace tier_detail

using namespace tier_detail;

namespace {

std::string HostIdentity() {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "unknown-host");
  std::string id = host;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  if (boot && std::getline(boot, boot_id)) id += "/" + boot_id;
  return id;
}

int RanksPerNodeFromEnv() {
  const char* v = std::getenv("DCP_TIER_RANKS_PER_NODE");
  if (v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  long n = std::strtol(v, &end, 10);
  if (*end != '\0' || n < 1 || n > (1 << 24)) {
    throw InvalidArgumentError(std::string("DCP_TIER_RANKS_PER_NODE='") + v +
                               "' is not a positive rank count");
  }
  return static_cast<int>(n);
}

// Why `options` are out of range ("" when they are not): the last problem found.
std::string OptionsProblem(const MemoryTierOptions& options) {
  std::string problem;
  if (!IsPlainName(options.name)) problem = "name '" + options.name + "' is not a plain name";
  if (options.replicas < 0) problem = "replicas must be >= 0";
  if (options.keep < 1) problem = "keep must be >= 1";
  if (options.shm_root.empty()) problem = "shm_root is empty";
  if (options.transfer_chunk_bytes < 4096) problem = "transfer_chunk_bytes must be >= 4096";
  if (options.overlap_files < 0 || options.overlap_files > 4096) {
    problem = "overlap_files must be within [0, 4096]";
  }
  return problem;
}

// The job's nodes: the ranks of each (ascending), this rank's node and its directory's label.
struct NodeLayout {
  std::vector<std::vector<int>> nodes;
  int node = 0;
  std::string label;
};

// `per_node` consecutive ranks make a simulated node ("node-<k>"); with 0, the ranks that share
// a host (and boot) share /dev/shm ("local").
NodeLayout FindNodes(Communicator& comm, int per_node) {
  NodeLayout layout;
  const int world = comm.size();
  const int rank = comm.rank();
  if (per_node > 0) {
    for (int r = 0; r < world; ++r) {
      if (r % per_node == 0) layout.nodes.emplace_back();
      layout.nodes.back().push_back(r);
    }
    layout.node = rank / per_node;
    layout.label = "node-" + std::to_string(layout.node);
    return layout;
  }
  auto ids = comm.AllGather(HostIdentity(), "tier/nodes");
  std::map<std::string, int> index;
  for (int r = 0; r < world; ++r) {
    auto [it, added] = index.emplace(ids[r], static_cast<int>(layout.nodes.size()));
    if (added) layout.nodes.emplace_back();
    layout.nodes[it->second].push_back(r);
    if (r == rank) layout.node = it->second;
  }
  layout.label = "local";
  return layout;
}

// The ranks whose partner `rank` is (it keeps their replicas), by the same rule.
std::vector<int> ReplicaSourcesOf(const std::vector<std::vector<int>>& nodes, int rank,
                                  int replicas) {
  const int nn = static_cast<int>(nodes.size());
  std::vector<int> sources;
  for (int n = 0; n < nn; ++n) {
    for (size_t p = 0; p < nodes[n].size(); ++p) {
      for (int j = 1; j <= replicas; ++j) {
        const auto& other = nodes[(n + j) % nn];
        if (other[p % other.size()] == rank) sources.push_back(nodes[n][p]);
      }
    }
  }
  return sources;
}

// This rank's own data files of a save: those it created that the metadata names; their bytes
// are added to `bytes_written`.
std::vector<std::string> OwnFiles(const std::set<std::string>& created, const Metadata& md,
                                  const std::string& dir, uint64_t& bytes_written) {
  const auto referenced = ReferencedFiles(md);
  std::vector<std::string> own;
  for (const auto& name : created) {
    if (referenced.count(name)) own.push_back(name);
  }
  for (const auto& name : own) {
    struct stat st {};
    if (::stat((dir + "/" + name).c_str(), &st) == 0) bytes_written += st.st_size;
  }
  return own;
}

// Every copy of every file exists: each node's first rank commits its copy of the step in `dir`
// (its metadata). Returns the ranks that failed; `committed` tells whether any node committed.
std::vector<RankFailure> CommitStep(Communicator& comm, bool leader, const std::string& dir,
                                    const std::string& encoded, bool& committed) {
  std::string error;
  if (leader) {
    try {
      WriteWholeFile(dir + "/" + TierMetadataName(), encoded);
    } catch (const std::exception& e) {
      error = ErrorText(e);
    }
  }
  auto all =
      comm.AllGather(error.empty() ? std::string(leader ? "W" : "") : "E" + error, "tier/commit");
  std::vector<RankFailure> failures;
  committed = false;
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    if (all[r] == "W") committed = true;
    if (!all[r].empty() && all[r][0] == 'E') {
      failures.push_back(DecodeFailure(r, all[r].substr(1)));
    }
  }
  return failures;
}

}  // namespace

MemoryTier::MemoryTier(Communicator& comm, MemoryTierOptions options,
                       std::unique_ptr<Communicator> background_comm, AsyncOptions async)
    : comm_(comm),
      options_(std::move(options)),
      rank_(comm.rank()),
      pool_(std::make_unique<tier_detail::MappingPool>()) {
  const std::string problem = OptionsProblem(options_);
  if (!problem.empty()) throw InvalidArgumentError("memory tier: " + problem);
  int per_node = options_.ranks_per_node > 0 ? options_.ranks_per_node : RanksPerNodeFromEnv();
  NodeLayout layout = FindNodes(comm, per_node);
  nodes_ = std::move(layout.nodes);
  node_ = layout.node;
  const int nn = static_cast<int>(nodes_.size());
  // Too few nodes for the replicas (a job restarted on the nodes that survived a loss): the
  // steps in memory can still be restored and drained; saves are refused (BeginSave).
  if (options_.replicas > 0 && options_.replicas >= nn) {
    cannot_save_ = "memory tier: " + std::to_string(options_.replicas) + " replica(s) need " +
                   std::to_string(options_.replicas + 1) + " nodes; the job has " +
                   std::to_string(nn) +
                   ". Restore, CompleteSteps and Drain work; to save, set replicas below the "
                   "node count (or set ranks_per_node or DCP_TIER_RANKS_PER_NODE to simulate "
                   "nodes on one machine)";
  }
  if (cannot_save_.empty()) {
    partners_ = PartnersOf(nodes_, node_, rank_, options_.replicas);
    replica_sources_ = ReplicaSourcesOf(nodes_, rank_, options_.replicas);
  }
  if (background_comm &&
      (background_comm->rank() != rank_ || background_comm->size() != comm.size())) {
    throw InvalidArgumentError("memory tier: the background communicator's ranks differ");
  }
  // This job's directory, private to the user, and this node's in it, locked while in use.
  root_ = JobDirectory(options_) + "/" + layout.label;
  std::string error;
  if (leader()) {
    try {
      CheckSharedRoot(options_.shm_root);
      MakeNodeDirectories();
      node_lock_fd_ = LockNodeDirectory(root_, options_.name);
      node_lock_identity_ = NodeLockIdentity(node_lock_fd_);
    } catch (const std::exception& e) {
      error = ErrorText(e);
    }
  }
  try {
    Vote(comm, error, "tier/open");
  } catch (...) {
    ReleaseNodeLock();
    throw;
  }
  // A duplicate of the job's communicator for replicating while writing, where every rank's
  // may be used from two threads (else no rank makes one: Duplicate is collective).
  if (options_.overlap_files > 1 && !partners_.empty()) {
    bool concurrent = true;
    for (const auto& ok :
         comm.AllGather(comm.ConcurrentUseProblem().empty() ? "1" : "0", "tier/overlap")) {
      concurrent = concurrent && ok == "1";
    }
    if (concurrent) replication_comm_ = comm.Duplicate();
  }
  if (background_comm) {
    saver_ = std::make_unique<AsyncCheckpointer>(std::move(background_comm), std::move(async));
  }
}

MemoryTier::~MemoryTier() {
  saver_.reset();  // a save still running ends before the lock goes
  // No transport call from here on: the process may be past MPI_Finalize (Close frees it).
  if (replication_comm_) replication_comm_->Stop("memory tier destroyed");
  ReleaseNodeLock();
}

bool MemoryTier::CanOverlap() const {
  return replication_comm_ && !replication_comm_->poisoned() && !partners_.empty();
}

void MemoryTier::MakeNodeDirectories() const {
  tier_detail::MakeNodeDirectories(JobDirectory(options_), options_.owner, root_);
}

void MemoryTier::ReleaseNodeLock() noexcept {
  if (node_lock_fd_ >= 0) ::close(node_lock_fd_);  // closing the descriptor drops the flock
  node_lock_fd_ = -1;
}

std::string MemoryTier::JobDirectory(const MemoryTierOptions& options) {
  std::string dir =
      options.shm_root + "/dcp-tier-u" + std::to_string(::geteuid()) + "/" + options.name;
  if (!options.owner.empty()) dir += "-" + OwnerHash(options.owner);
  return dir;
}

std::string MemoryTier::StepDirectory(int64_t step) const { return root_ + "/" + StepName(step); }

void MemoryTier::Vote(Communicator& comm, const std::string& my_error, std::string_view phase) {
  tier_detail::Vote(comm, my_error, phase);
}

int64_t MemoryTier::BeginPreemption(std::chrono::steady_clock::time_point commits_until) noexcept {
  commits_until_.store(commits_until.time_since_epoch().count());
  preempting_.store(true);
  std::lock_guard<std::mutex> lock(mu_);
  return metadata_.empty() ? -1 : metadata_.rbegin()->first;
}

void MemoryTier::WaitForCommitAfter(int64_t step, std::chrono::steady_clock::time_point until) {
  std::unique_lock<std::mutex> lock(mu_);
  // A commit records its step before its BusyScope ends, which notifies settled_.
  settled_.wait_until(lock, until,
                      [&] { return !metadata_.empty() && metadata_.rbegin()->first > step; });
  commits_until_.store(0);  // the window closes: the save after that step is refused
}

std::string MemoryTier::PreemptionVeto(std::string_view what) const {
  if (!preempting_.load()) return {};
  // Until commits_until the job's next step may still commit (its BusyScope was entered
  // before this check, so a handler settling after commits_until waits for it).
  if (std::chrono::steady_clock::now().time_since_epoch().count() < commits_until_.load())
    return {};
  return std::to_string(static_cast<int>(ErrorCode::kPreempted)) +
         ":memory tier: " + std::string(what) +
         " refused: the job is being preempted (the preemption handler drains the newest "
         "committed step)";
}

MemoryTier::SettledStep MemoryTier::SettleForPreemption(
    std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  SettledStep out;
  out.settled = settled_.wait_until(lock, deadline, [&] { return busy_ == 0; });
  settled_for_preemption_ = true;
  if (!metadata_.empty()) {
    out.step = metadata_.rbegin()->first;
    auto d = drained_.find(out.step);
    if (d != drained_.end()) out.drained_to = d->second;
  }
  return out;
}

namespace {

// The prepare vote of a save (`error`: this rank's failure to prepare, as ErrorText), which
// also says whether every rank can replicate while writing: a rank whose duplicate
// communicator failed an earlier save cannot, and then no rank does.
bool AgreeOnPrepare(Communicator& comm, const std::string& error, bool can_overlap) {
  auto all = comm.AllGather(std::string(can_overlap ? "1" : "0") + error, "tier/prepare");
  bool overlap = true;
  std::vector<RankFailure> failures;
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    overlap = overlap && !all[r].empty() && all[r][0] == '1';
    if (all[r].size() > 1) failures.push_back(DecodeFailure(r, all[r].substr(1)));
  }
  if (!failures.empty()) throw CollectiveError("tier/prepare", std::move(failures));
  return overlap;
}

}  // namespace

SaveResult MemoryTier::SaveOn(Communicator& comm, int64_t step, const StateDict& state,
                              const SaveOptions& options) {
  stats_ = {};
  auto t0 = std::chrono::steady_clock::now();
  const std::string dir = StepDirectory(step);
  std::string error;
  if (leader()) {
    // A directory of this step left by a crashed attempt (or a step being saved again after a
    // restore from an older one) is replaced.
    error = FreshStepDirectory(dir, JobDirectory(options_), options_.owner, root_);
  }
  const bool overlap = AgreeOnPrepare(comm, error, CanOverlap());
  pool_->Prune();  // the files the previous saves' retention removed
  const uint64_t mapped_before = pool_->bytes_mapped();
  auto store =
      std::make_shared<TierStepStore>(StepStore(dir), *pool_, dir, root_ + "/" + kRecycleDir,
                                      "tier://" + options_.name + "/" + StepName(step));
  SaveOptions o = options;
  o.step = step;
  std::unique_ptr<Replicator> replicator;
  if (overlap) {
    // The files are written one after another (one writer), so each closes, and goes to the
    // partners, while the next is written.
    o.storage.files_per_rank = std::max(o.storage.files_per_rank, options_.overlap_files);
    o.storage.memory_budget_bytes = std::min(o.storage.memory_budget_bytes, kWriterStagingBytes);
    replicator = std::make_unique<Replicator>(*this, *replication_comm_, step);
    store->NotifyClosed(replicator->Notifier());
  }
  auto writer = MakeStoreWriter(store, o.storage);
  SaveResult result = dcp::Save(state, *writer, comm, o);  // a failure: ~Replicator joins
  stats_.write_s = SecondsSince(t0);

  const auto own = OwnFiles(store->created(), result.metadata, dir, stats_.bytes_written);
  auto t1 = std::chrono::steady_clock::now();
  std::set<std::string> sent;
  std::string replication_error;
  if (replicator) {
    replicator->Finish();
    sent = replicator->sent();
    replication_error = replicator->error();
    const TierStats& r = replicator->stats();
    stats_.bytes_sent += r.bytes_sent;
    stats_.bytes_received += r.bytes_received;
    stats_.bytes_mapped += r.bytes_mapped;
    stats_.bytes_sent_while_writing = r.bytes_sent_while_writing;
  }
  // What the overlapped rounds did not send (all of it without them), then the commit vote.
  std::vector<Transfer> outgoing;
  for (int partner : partners_) {
    for (const auto& name : own) {
      if (replication_error.empty() && !sent.count(name)) outgoing.push_back({partner, name});
    }
  }
  BusyScope commit(*this);
  try {
    const Pairs pairs{partners_, replica_sources_};
    TransferFiles(comm, step, outgoing, "tier/replicate", nullptr, &pairs, &commit, nullptr,
                  replication_error);
  } catch (const Error&) {
    // Not committed anywhere: no node wrote the metadata. Free the step's copies.
    if (leader()) {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
    throw;
  }
  stats_.replicate_s = SecondsSince(t1);
  stats_.bytes_mapped += pool_->bytes_mapped() - mapped_before;

  auto t2 = std::chrono::steady_clock::now();
  const std::string encoded =
      comm.Broadcast(rank_ == 0 ? store->held_metadata() : std::string(), 0, "tier/metadata");
  bool committed = false;
  auto failures = CommitStep(comm, leader(), dir, encoded, committed);
  if (committed) {  // on some node: the step exists (what a drain may copy)
    std::lock_guard<std::mutex> lock(mu_);
    written_[step] = own;
    metadata_[step] = encoded;
  }
  if (!failures.empty()) {
    throw CollectiveError("tier/commit", std::move(failures),
                          committed ? Outcome::kCommitted : Outcome::kFailed);
  }
  Retain(step);
  stats_.commit_s = SecondsSince(t2);
  return result;
}

void MemoryTier::BeginSave(int64_t step, const SaveOptions& options) {
  if (closed_) throw InvalidArgumentError("memory tier: Save after Close");
  if (!cannot_save_.empty()) throw InvalidArgumentError(cannot_save_);
  if (step < next_step_) {
    throw InvalidArgumentError("memory tier: step " + std::to_string(step) +
                               " does not follow step " + std::to_string(next_step_ - 1));
  }
  if (options.step && *options.step != step) {
    throw InvalidArgumentError("memory tier: SaveOptions::step is set by the tier");
  }
  Wait();
  next_step_ = step + 1;
}

SaveResult MemoryTier::Save(int64_t step, const StateDict& state, const SaveOptions& options) {
  BeginSave(step, options);
  return SaveOn(comm_, step, state, options);
}

std::shared_ptr<AsyncSave> MemoryTier::SaveAsync(int64_t step, const StateDict& state,
                                                 const SaveOptions& options,
                                                 const std::string& drain_to,
                                                 const SaveOptions& drain_options) {
  if (!saver_) {
    throw InvalidArgumentError("memory tier: SaveAsync needs a background communicator");
  }
  BeginSave(step, options);
  in_flight_ =
      saver_->SaveWith(state, "tier://" + options_.name + "/" + StepName(step), options,
                       [this, step, drain_to, drain_options](
                           const StateDict& snapshot, Communicator& comm, const SaveOptions& so) {
                         SaveResult result = SaveOn(comm, step, snapshot, so);
                         if (drain_to.empty()) return std::move(result.metadata);
                         if (DrainCopies(drain_options.storage)) {
                           DrainOn(comm, step, drain_to, drain_options.storage, stats_,
                                   /*vetoed=*/true);
                         } else {
                           // Another format or compression: the snapshot is saved there
                           // (already taken: no second copy of the training state).
                           SaveOptions durable = drain_options;
                           durable.step = step;
                           dcp::Save(snapshot, drain_to, comm, durable);
                         }
                         return std::move(result.metadata);
                       });
  return in_flight_;
}

void MemoryTier::Wait() {
  if (!in_flight_) return;
  auto s = std::move(in_flight_);
  in_flight_.reset();
  saver_->Wait();  // raises the background error, once
}

void MemoryTier::Close() {
  if (closed_) return;
  closed_ = true;
  std::exception_ptr pending;
  try {
    Wait();
  } catch (...) {
    pending = std::current_exception();
  }
  if (saver_) saver_->Close();
  replication_comm_.reset();
  pool_->Clear();  // every rank's mappings, so that freed files' pages go
  std::string error;
  if (options_.free_on_close && leader()) {
    std::error_code ec;
    fs::remove_all(root_, ec);
    if (ec) error = IoText("memory tier: cannot free " + root_ + ": " + ec.message());
  }
  Vote(comm_, error, "tier/close");
  ReleaseNodeLock();
  if (pending) std::rethrow_exception(pending);
}

}  // namespace dcp
