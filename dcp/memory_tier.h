// MemoryTier: checkpoint every step into node-local shared memory, replicated to other nodes.
//
// A step in the tier is an ordinary dcp checkpoint, spread over the nodes' shared memory:
//   <shm_root>/dcp-tier-u<uid>/<job>/<node>/step-<N>/   metadata.dcp + data files
// where <job> is the tier's name and a hash of its owner (JobDirectory) and <node> is "local" on
// a real node and "node-<k>" for simulated ones (MemoryTierOptions::ranks_per_node).
//
// One job, one owner: a step belongs to the job that wrote it. The job directory records its
// owner (MemoryTierOptions::owner: CheckpointManager's durable root) and is refused to any other;
// restores and retention look only inside it, so one job never restores or frees another's
// steps. Each node's first rank holds the node directory's lock (flock) while the tier object
// lives: a second process of the same job on the node is refused (LockedError naming the
// holder); a crashed one's lock goes with it. The tier's files are the user's alone:
// dcp-tier-u<uid> is created 0700 and refused when it belongs to another user, is a link, or is
// writable by others (InvalidArgumentError saying what to do); directories below are 0700, files
// 0600, nothing is opened through a link, and only regular files are read (a FIFO is refused,
// never waited on). Each rank writes its own data files into its node's
// directory (a tmpfs: the files outlive the process, not the node), then sends them to its
// partner on each of the next `replicas` nodes (the rank with the same position there), which
// writes them into its own node's directory. Partners are always on other nodes, so no file's
// copies share a node.
//
// Commit: a step counts in the tier only where its metadata.dcp exists, and each node's first
// rank writes it there only after every rank reported that its files and all their replicas are
// written (a vote over the communicator). So any node holding a step's metadata proves that all
// copies of every file of that step were complete; a crash before the vote leaves no metadata
// anywhere, and the step does not exist. Steps live in separate directories: never a mixed step.
//
// Recovery (Restore): every node reports the committed steps it holds and their files; the
// ranks agree on the newest step whose every file survives on some node that committed it;
// each copy a node will use is checked against its CRCs; each node fetches the files its
// ranks' load plans read and the replicas it keeps (and the metadata) from the nodes holding
// them intact over the communicator; then it is an ordinary dcp::Load from the node's
// directory, which reshards like any other load. A job restarted at another world size or
// layout loads the same way, as long as a complete step survives.
//
// Durable copies: Drain(step, uri) copies a committed step from the tier to any dcp location
// (file://, s3://, ...), each rank the files it wrote, rank 0 the metadata last after every
// rank's copy succeeded: the durable checkpoint obeys the usual commit rule, and no second
// snapshot of the training state is taken. CheckpointManager drives it for a managed root
// (ManagerOptions::durable_every, dcp/checkpoint_manager.h).
//
// All ranks call every method in the same order (SPMD) over `comm`. Failures are
// CollectiveErrors, alike on every rank; a failed Save leaves no committed step (its files are
// removed) and the previous steps intact. Not thread-safe: one call at a time.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "dcp/async_checkpointer.h"
#include "dcp/checkpoint.h"
#include "dcp/communicator.h"
#include "dcp/options.h"

namespace dcp {

namespace tier_detail {
struct StepReport;
struct Transfer;
struct Pairs;
class MappingPool;
}  // namespace tier_detail

/// What one tier call did on this rank (for metrics and benches).
struct TierStats {
  double write_s = 0;  // Save: the dcp save into shared memory (plan, write)
  // Save: sending and receiving replicas after the write (with MemoryTierOptions::overlap_files,
  // what was left to send when the write ended, and the commit vote)
  double replicate_s = 0;
  double commit_s = 0;          // Save: vote, metadata, retention
  uint64_t bytes_written = 0;   // this rank's own data files
  uint64_t bytes_sent = 0;      // replicas (Save) or fetched files (Restore) this rank sent
  uint64_t bytes_received = 0;  // ... and received
  // Save: of bytes_sent, those sent while this rank's save was still writing (overlap_files)
  uint64_t bytes_sent_while_writing = 0;
  // Save/Restore: bytes of the tier's files this rank mapped anew (0 for a save in the steady
  // state: freed steps' files come back with the mappings this rank kept).
  uint64_t bytes_mapped = 0;
  double recover_s = 0;   // Restore: agreement and fetching
  double load_s = 0;      // Restore: the load itself
  int files_fetched = 0;  // Restore: files this rank received from other nodes
  // Restore: the nodes' copies of files found damaged before the load (every rank alike); the
  // load read another node's copy of each.
  int damaged_copies = 0;
  double drain_s = 0;  // Drain (or SaveAsync's drain): copy to durable storage + commit
};

class MemoryTier {
 public:
  /// Collective over `comm` (which must outlive the tier): finds the nodes and partners, then
  /// each node's first rank opens the node's directory (see the header comment), on every rank
  /// alike: CollectiveError whose failure is kInvalidArgument for a directory that is not the
  /// user's own or belongs to another owner, kAlreadyExists when another process of the job
  /// holds the node.
  /// `background_comm` (another communicator over the same ranks, as AsyncCheckpointer needs)
  /// enables SaveAsync; `async` sets its staging. InvalidArgumentError when an option is out
  /// of range. With fewer than replicas + 1 nodes (a job restarted on the nodes that survived
  /// a loss) the tier restores and drains the steps it holds, and Save/SaveAsync throw
  /// InvalidArgumentError on every rank, saying so.
  MemoryTier(Communicator& comm, MemoryTierOptions options = {},
             std::unique_ptr<Communicator> background_comm = nullptr, AsyncOptions async = {});
  ~MemoryTier();
  MemoryTier(const MemoryTier&) = delete;
  MemoryTier& operator=(const MemoryTier&) = delete;

  /// Save `state` as `step` into the tier and commit it once every replica is written; then
  /// free this node's steps beyond `keep`. Steps must increase within one tier object
  /// (InvalidArgumentError otherwise). A leftover uncommitted directory of the same step (a
  /// crashed attempt) is replaced. Throws CollectiveError on failure, on every rank.
  SaveResult Save(int64_t step, const StateDict& state, const SaveOptions& options = {});

  /// Snapshot `state` (the caller blocks only for the copy into staging, as with
  /// AsyncCheckpointer) and save it as `step` in the background, on the background
  /// communicator, with the same commit as Save. With `drain_to` set, the background then
  /// writes the committed step there before the save counts as done: a copy of the tier's
  /// files (Drain, with drain_options.storage) when DrainCopies(drain_options.storage), else a
  /// dcp::Save of the snapshot with `drain_options` (another format, compression). Waits for
  /// the previous save first and raises its error. InvalidArgumentError without a background
  /// communicator. The handle's Wait() gives the step's metadata.
  std::shared_ptr<AsyncSave> SaveAsync(int64_t step, const StateDict& state,
                                       const SaveOptions& options = {},
                                       const std::string& drain_to = "",
                                       const SaveOptions& drain_options = {});
  /// Wait for the background save, if any; raises its error (once).
  void Wait();
  /// Whether the tier has a background communicator (SaveAsync works).
  bool saves_in_background() const { return saver_ != nullptr; }

  /// Load the newest step complete across the surviving copies into `state` and return it;
  /// nullopt (on every rank) when no complete step survives. Files a node lacks are fetched
  /// from other nodes first: those its ranks read and, for a step saved at this world size
  /// when the job has nodes enough for its replicas, those a save leaves on it (its ranks' and
  /// their partners' files), so the job is fully redundant again before its next save. With
  /// options.storage.verify_checksums (the default), every copy of a file the load reads is checked
  /// against its items' CRC32Cs before it is used (by the ranks of the node holding it): a damaged
  /// copy is reported on stderr and counted (TierStats::damaged_copies), and another node's intact
  /// copy is fetched over it. Throws CollectiveError when a load fails, or (kCorruption, naming
  /// each file and what is wrong with each copy) when a file the load reads has no intact copy on
  /// any node: the step is then not restored (CheckpointManager falls back to the durable root).
  /// A restored step may be drained like a saved one (Drain, the preemption handler).
  std::optional<int64_t> Restore(StateDict& state, const LoadOptions& options = {});

  /// Committed steps any node holds whose every file survives somewhere, ascending (collective).
  std::vector<int64_t> CompleteSteps();

  /// Copy committed `step` from the tier to the dcp location `uri` (collective): rank 0 takes
  /// the location's writer lock, each rank copies the files it wrote, then rank 0 publishes the
  /// metadata, only after every copy succeeded. With options.overwrite a checkpoint there is
  /// replaced (it stays loadable until the new metadata is in place; its files go after);
  /// without it, a checkpoint there fails the drain (kAlreadyExists). Only steps saved or
  /// restored by this tier object (it knows which files each rank copies: after a restore, each
  /// file's writer if its node holds it, else a rank of a node that does) and options the copy
  /// honours (DrainCopies); InvalidArgumentError otherwise. CollectiveError on failure, with
  /// nothing committed at `uri` and the files copied removed again.
  void Drain(int64_t step, const std::string& uri, const StorageOptions& options = {});
  /// Whether a copy of the tier's files is a checkpoint written with `options`: the dcp format,
  /// uncompressed (the tier writes no other). Other options need a save of the state.
  static bool DrainCopies(const StorageOptions& options);
  /// Why Save and SaveAsync are refused on this job (too few nodes for the replicas), or "".
  const std::string& save_refusal() const { return cannot_save_; }
  /// The background saver (SaveAsync's), or nullptr: CheckpointManager saves a durable step
  /// through it when the tier cannot save.
  AsyncCheckpointer* background_saver() const { return saver_.get(); }

  /// Wait for the background save, then free this node's tier directory when
  /// options.free_on_close (first rank of each node); collective. Raises the background save's
  /// unreported error after freeing. Idempotent; the destructor does not free (a crash must
  /// leave the steps) and waits for a save in flight as AsyncCheckpointer's does.
  void Close();

  /// This rank's node (0-based, in order of the nodes' first ranks) and partners.
  int node() const { return node_; }
  int node_count() const { return static_cast<int>(nodes_.size()); }
  const std::vector<int>& partners() const { return partners_; }
  /// The directory holding this node's copy of `step`.
  std::string StepDirectory(int64_t step) const;
  /// This node's directory: JobDirectory(options)/<node> ("local", or "node-<k>" simulated).
  const std::string& NodeDirectory() const { return root_; }
  /// The directory of the tier's job on any node (computes a path; creates nothing):
  /// <shm_root>/dcp-tier-u<uid>/<name>, with "-<16 hex digits of a hash of owner>" appended
  /// when MemoryTierOptions::owner is set.
  static std::string JobDirectory(const MemoryTierOptions& options);
  /// The last call's figures on this rank.
  const TierStats& last_stats() const { return stats_; }

  // Preemption (CheckpointManager::HandlePreemption drives these from its own thread, while the
  // job's thread and the background saver go on; these three are thread-safe).
  /// From `commits_until` on (at once by default), on this rank: a save not yet committed is
  /// refused at its commit vote (PreemptedError, on every rank alike: the step does not exist
  /// anywhere), and a drain other than DrainForPreemption at its next vote (the same error).
  /// From now on retention frees nothing. Irreversible for this tier object. Returns the
  /// newest step committed so far (-1: none).
  int64_t BeginPreemption(std::chrono::steady_clock::time_point commits_until = {}) noexcept;
  /// Waits until this rank committed a step newer than `step`, or until `until`; then closes
  /// BeginPreemption's window (commits are refused from now on).
  void WaitForCommitAfter(int64_t step, std::chrono::steady_clock::time_point until);
  bool preempting() const noexcept { return preempting_.load(); }
  /// After BeginPreemption: waits until no commit, drain or restore (up to the point where it
  /// recorded its step) is under way on this rank (at most until `deadline`; `settled` says
  /// whether it got there), then returns the newest step this tier object committed or restored
  /// and, when a drain of it succeeded, where to. No commit can start after BeginPreemption's
  /// commits_until, so once settled after it the answer is final.
  struct SettledStep {
    bool settled = false;
    int64_t step = -1;  // -1: this tier object committed or restored no step it still keeps
    std::string drained_to;
  };
  SettledStep SettleForPreemption(std::chrono::steady_clock::time_point deadline);
  /// After every rank's SettleForPreemption found no step (a notice before the job's restore, or
  /// one whose restore began after it settled): the newest step complete across the nodes'
  /// copies, as Restore would choose it, recorded for DrainForPreemption as a restore records its
  /// step. Collective on `comm` (the handler's). Each rank checks the copies it would drain
  /// (CRC32C) first; a damaged one is dropped and another node's copy drains that file. Returns
  /// step -1 when no step is complete, or when some file has no intact copy (the same on every
  /// rank). Throws what the collectives throw, and CorruptionError for unreadable metadata.
  SettledStep AdoptNewestHeld(Communicator& comm);
  /// Drain over `comm` (the preemption handler's communicator), never refused by the preemption;
  /// its figures go to `stats`. Same contract as Drain otherwise.
  void DrainForPreemption(Communicator& comm, int64_t step, const std::string& uri,
                          const StorageOptions& options, TierStats& stats);

 private:
  using StepReport = tier_detail::StepReport;
  using Transfer = tier_detail::Transfer;
  using Pairs = tier_detail::Pairs;
  // Collectives on `comm`: the job's (comm_) or, for SaveAsync, the background one.
  std::vector<StepReport> GatherReports(Communicator& comm);
  // Marks a commit, drain or restore under way on this rank for SettleForPreemption, from Enter()
  // to its destruction.
  class BusyScope;
  // `pairs`: the ranks this one sends to and receives from, when both sides know them (a
  // save's partners); null: any rank may send any other (an AllToAll of the file headers).
  // `commit`: a save's replication, whose final vote decides the commit: it is entered (before
  // the vote, so that a preemption noticed after the vote waits for the commit) and the vote
  // carries the preemption's refusal.
  // `stats`: where its figures go (null: stats_). `carried_error`: a failure of this rank met
  // before (the overlapped replication's), voted as this transfer's own.
  void TransferFiles(Communicator& comm, int64_t step, const std::vector<Transfer>& outgoing,
                     std::string_view what, std::vector<std::string>* received, const Pairs* pairs,
                     BusyScope* commit = nullptr, TierStats* stats = nullptr,
                     const std::string& carried_error = {});
  // Sends a save's files to the partners as they are closed, on replication_comm_ and a thread
  // of its own (MemoryTierOptions::overlap_files; dcp/tier/replicate.cc).
  class Replicator;
  // Whether every rank may overlap this save's replication (agreed in the prepare vote).
  bool CanOverlap() const;
  // The preemption's refusal of `what` as a vote's error text, or "" when not preempting.
  std::string PreemptionVeto(std::string_view what) const;
  void Vote(Communicator& comm, const std::string& my_error, std::string_view phase);
  SaveResult SaveOn(Communicator& comm, int64_t step, const StateDict& state,
                    const SaveOptions& options);
  // `vetoed`: a drain the preemption refuses (every drain but the preemption handler's).
  void DrainOn(Communicator& comm, int64_t step, const std::string& uri,
               const StorageOptions& options, TierStats& stats, bool vetoed);
  void BeginSave(int64_t step, const SaveOptions& options);
  void Retain(int64_t newest);
  // After a restore: records `step` (its metadata, and `files`, those this rank copies in a
  // drain) as the tier's own step, on every rank or none (collective); nullopt: on none.
  void KeepForDrain(int64_t step, const std::string& encoded,
                    std::optional<std::vector<std::string>> files);
  bool leader() const { return rank_ == nodes_[node_].front(); }
  void ReleaseNodeLock() noexcept;
  // The user's tier directory, the job's and this node's (created, or checked: see the header
  // comment); the node's first rank only.
  void MakeNodeDirectories() const;

  Communicator& comm_;
  MemoryTierOptions options_;
  int rank_ = 0;
  int node_ = 0;
  std::vector<std::vector<int>> nodes_;  // ranks of each node, ascending
  std::vector<int> partners_;
  std::vector<int> replica_sources_;  // the ranks whose partner this one is
  std::string root_;                  // this node's directory
  int node_lock_fd_ = -1;  // node leader: holds the flock of root_/LOCK while the tier lives
  // NodeLockIdentity of node_lock_fd_ (node leaders; set before any drain, then constant): put
  // in a drain's lock holder, it lets a later process of this node take over that lock when
  // the drain's process is gone.
  std::string node_lock_identity_;
  int64_t next_step_ = 0;  // the least step the next save may have
  // Guards written_, metadata_, drained_, busy_ and settled_for_preemption_ (the preemption
  // handler's thread reads them).
  mutable std::mutex mu_;
  std::condition_variable settled_;
  // step -> the files this rank copies in a drain: those it wrote, or after a restore those
  // assigned to it (KeepForDrain)
  std::map<int64_t, std::vector<std::string>> written_;
  std::map<int64_t, std::string> metadata_;  // step -> encoded metadata.dcp
  std::map<int64_t, std::string> drained_;   // step -> where a drain committed it
  int busy_ = 0;  // commits, drains and restores under way on this rank (BusyScope)
  bool settled_for_preemption_ = false;  // SettleForPreemption returned: its answer is given
  std::atomic<bool> preempting_{false};
  // BeginPreemption's commits_until (steady_clock ticks since its epoch).
  std::atomic<int64_t> commits_until_{0};
  bool closed_ = false;
  std::string cannot_save_;  // why saves are refused (too few nodes for the replicas), if so
  TierStats stats_;
  std::shared_ptr<AsyncSave> in_flight_;
  // A duplicate of comm_ for the overlapped replication (Replicator), or null. Used by one save
  // at a time (saves are serialised by BeginSave); stopped by Close and the destructor.
  std::unique_ptr<Communicator> replication_comm_;
  // This rank's mappings of the tier's files, kept across saves (dcp/tier/file_mapping.h).
  std::unique_ptr<tier_detail::MappingPool> pool_;
  // Last: destroyed first, so a save still running ends before the members it uses go.
  std::unique_ptr<AsyncCheckpointer> saver_;
};

}  // namespace dcp
