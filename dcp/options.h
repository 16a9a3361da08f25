// Every option of dcp's public API, in one header.
//
//   SaveOptions     dcp::Save, AsyncCheckpointer::Save, CheckpointManager (ManagerOptions::save)
//   LoadOptions     dcp::Load, dcp::LoadAll, CheckpointManager::Restore, CheckpointIO loads
//   StorageOptions  what every backend understands (both of the above carry one); defined with
//                   the storage interfaces (dcp/storage/storage.h), which the storage layer
//                   below dcp/ needs too. A backend's own settings are StorageOptions::backend
//                   entries or a URI's query (dcp/storage/registry.h lists them).
//   AsyncOptions    how the AsyncCheckpointer stages and runs saves
//   ManagerOptions  the CheckpointManager's retention and per-save options
//   MemoryTierOptions  the peer-replicated memory tier (dcp/memory_tier.h)
//
// Every field is honoured by every entry point that takes its struct (tests/unit/options_test.cc
// has a test per field, and tests/options_coverage_check.py keeps that list complete). What a
// call reports back (metadata, statistics, unrequested keys) is its return value
// (dcp/checkpoint.h: SaveResult, LoadResult), never an output pointer in these structs.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "dcp/storage/storage.h"

namespace dcp {

class SavePlanner;
class LoadPlanner;
class SavePlanCache;  // dcp/checkpoint.h
struct SaveMetrics;   // dcp/async_checkpointer.h

struct SaveOptions {
  StorageOptions storage;
  /// Recorded in the metadata; defaults to the storage URI.
  std::string checkpoint_id;
  /// The training step (or any number naming this save's intent) that every rank must agree
  /// on: it is checked when the save opens, so a rank that skipped a save or saves another
  /// step fails the save on every rank instead of pairing with it. Without it only the target
  /// is compared: a job that overwrites one location every time (a "latest" directory) and
  /// passes no step cannot tell a rank that skipped one save from one that did not, and the
  /// checkpoint would mix state of two steps. CheckpointManager always passes its step (and
  /// refuses a `step` set in ManagerOptions::save).
  std::optional<int64_t> step;
  /// Custom planner; nullptr uses DefaultSavePlanner. Not owned; must outlive the save.
  SavePlanner* planner = nullptr;
  /// Plan caching across saves (see SavePlanCache); nullptr plans every save in full.
  std::shared_ptr<SavePlanCache> plan_cache;
};

struct LoadOptions {
  StorageOptions storage;
  /// Read-once (default on): bytes that several ranks ask for in identical form (the same
  /// stored item and box: replicated tensors, blobs every rank loads) are read by one of them
  /// and broadcast to the others over the communicator, in batches of at most
  /// storage.memory_budget_bytes (an item larger than that is read by every rank that wants
  /// it). The reading rank is the least loaded of those that asked. Applies to ranks using the
  /// default planner; a rank with a custom planner reads all of its own items. Off: every rank
  /// reads everything it asked for. Either way every rank gets the same values.
  /// It also turns on cooperative reads (read-and-scatter) where they pay: when ranks read
  /// parts of stored items (a reshard) whose partial reads would fetch far more than their boxes
  /// (a column block of a row-major chunk reads every row), the item's owner (a rank fixed by
  /// the metadata, e.g. its writer) reads it once, verified, and sends each rank its rows in
  /// rounds bounded by storage.memory_budget_bytes. Only on communicators that exchange bytes
  /// directly (MPI, in-process; not NCCL) and readers with an item streamer (every built-in
  /// format; zstd items are read by each rank as before). A load whose ranks read whole items
  /// (same layout) runs no extra collective. When both the saved and the requested layout of a
  /// tensor are rules (each rank's slice along one dimension), the owners send every rank its
  /// pieces with no request at all (rule exchange: one collective per round; docs/PROTOCOL.md).
  /// An owner that cannot read a chunk leaves it to each rank's own read, which names it.
  bool read_once = true;
  /// Skip state dict keys the checkpoint lacks instead of failing (default planner only; a
  /// custom planner with it set is refused). PyTorch DCP's name; Lightning's `strict` is its
  /// negation.
  bool allow_partial_load = false;
  /// Load tensors only: byte blobs of the state dict are left untouched (dcp::LoadAll leaves
  /// them out of the state dict it returns).
  bool weights_only = false;
  /// Convert a tensor stored in another dtype than its destination's (a bf16 checkpoint into
  /// fp32 parameters), as torch's DCP does through Tensor.copy_: floats round to nearest even,
  /// floats to integers truncate and saturate. Between bool, integers, float16, bfloat16,
  /// float32 and float64; float8 and complex tensors must match. Off (the default): a dtype
  /// mismatch is an InvalidArgumentError naming the tensor. Default planner only (a custom
  /// planner with it set is refused). Shapes must match either way.
  bool cast_dtypes = false;
  /// Custom planner; nullptr uses DefaultLoadPlanner. Not owned; must outlive the load.
  LoadPlanner* planner = nullptr;
};

/// How the checkpointer stages and runs saves; what each save writes is its SaveOptions.
struct AsyncOptions {
  /// Threads copying into staging (the caller's thread is one of them; at least 1).
  int copy_threads = 2;
  /// Try to page-lock staging buffers (mlock). Failing to lock is not an error.
  bool lock_staging = true;
  /// How long the destructor waits for an in-flight save before giving up on it.
  std::chrono::milliseconds close_timeout{std::chrono::minutes(10)};
  /// Called on the background thread when a save ends (success or failure). Defaults to a
  /// one-line log on stderr from rank 0 when DCP_LOG is set in the environment.
  std::function<void(const SaveMetrics&)> on_complete;
};

/// The memory tier (dcp/memory_tier.h): steps kept in node-local shared memory, replicated to
/// partner ranks on other nodes.
struct MemoryTierOptions {
  /// Names the tier in shared memory: <shm_root>/dcp-tier-u<uid>/<name>[-<owner hash>]/. A
  /// restart of the job under the same name and owner finds the steps its predecessor kept.
  std::string name = "default";
  /// The job the tier's steps belong to (any text; CheckpointManager sets its durable root when
  /// this is empty). Steps are kept per owner: a tier never restores or frees the steps of
  /// another owner, and a directory recorded for another owner is refused. Empty: the name
  /// alone identifies the job (two jobs on a node then need two names; a second one with the
  /// same name is refused while the first runs).
  std::string owner;
  /// Where node-local shared memory is mounted (a tmpfs: its files live as long as the node
  /// runs, not as long as the process).
  std::string shm_root = "/dev/shm";
  /// Copies of each rank's data on other nodes (0: none; a node's loss then loses the step).
  /// Saves need at least replicas + 1 nodes; with fewer, the tier restores and drains what it
  /// holds and refuses saves (dcp/memory_tier.h).
  int replicas = 1;
  /// Complete steps each node keeps (at least 1); older ones are freed after each commit.
  int keep = 2;
  /// Nodes are the ranks that share a host (their host names and boot ids agree). A value > 0
  /// simulates nodes of this many consecutive ranks instead, each with its own directory under
  /// the tier (tests and single-machine demos); the environment variable DCP_TIER_RANKS_PER_NODE
  /// sets it too (the option wins when both are set).
  int ranks_per_node = 0;
  /// Remove this rank's node directory's steps when the tier is closed cleanly (a failed or
  /// killed process leaves them for the restart to recover from).
  bool free_on_close = false;
  /// Bytes each (sender, receiver) pair moves per round when replicating or recovering. The
  /// bytes go from the sender's mapped file straight into the receiver's (no staging); a round
  /// bounds the size of one transport message and how long a failure goes unnoticed.
  uint64_t transfer_chunk_bytes = 64ull << 20;
  /// Replicate while writing: a save cuts each rank's data into this many files (at least; more
  /// when storage.files_per_rank says so), written one after another, and each goes to the
  /// partners as soon as it is closed, on a duplicate of the job's communicator
  /// (Communicator::Duplicate) on a thread of its own, while the next one is written. 0 or 1:
  /// the replicas are sent after the whole write. Only where the communicator can be
  /// duplicated and used from two threads (MPI with MPI_THREAD_MULTIPLE, in-process groups);
  /// elsewhere the replicas are sent after the write, as with 0.
  int overlap_files = 4;
};

/// Saving on preemption (CheckpointManager::HandlePreemption): a scheduler that preempts a job
/// sends SIGTERM and kills it `grace_period` later.
struct PreemptionOptions {
  /// Install a SIGTERM handler (async-signal-safe; the previous one is put back when the last
  /// manager handling preemption closes). Off: only dcp::NotifyPreemption() starts the drain
  /// (call it from your own handler).
  bool on_sigterm = true;
  /// The window from the notice to SIGKILL (Kubernetes' default terminationGracePeriodSeconds
  /// is 30 s): the handler's agreement and drain must end within it, and say what was left.
  std::chrono::milliseconds grace_period{std::chrono::seconds(30)};
  /// How long after the notice the job's next save may still commit in the memory tier (the
  /// next step boundary), to be drained instead of the newest step committed before the
  /// notice. The handler waits for that commit up to this long, then refuses commits; the
  /// drain then has what is left of grace_period. 0: refuse commits at once. Must be less
  /// than grace_period.
  std::chrono::milliseconds next_step_within{0};
};

struct ManagerOptions {
  int keep_last = 3;   // newest complete checkpoints kept (at least 1)
  int keep_every = 0;  // also keep steps divisible by this (0: none)
  /// Let Save(step) replace a complete (or unreadable) checkpoint of the same step found in the
  /// store (e.g. a job restored from step N that saves step N again). Off: AlreadyExistsError.
  /// A step older than the newest complete one is refused either way.
  bool allow_replacing_steps = false;
  /// Every save's options (storage options, planner, plan cache). The manager sets `step` and
  /// `storage.overwrite` itself (see allow_replacing_steps): setting them here is refused.
  SaveOptions save;
  AsyncOptions async;  // used when the manager has a background communicator
  /// A memory tier in front of the root (dcp/memory_tier.h): Save(step) puts every
  /// `memory_every`-th step in node-local shared memory, replicated to other nodes, and every
  /// `durable_every`-th also under the root, copied from the tier (no second snapshot; in the
  /// background when the manager has a background communicator, which the tier then uses).
  /// A step that is neither is skipped. Restore loads the newest step, from memory when the
  /// tier holds one at least as new as the root's newest, else from the root. The tier's steps
  /// belong to this root (MemoryTierOptions::owner is set to it when empty). Durable steps are
  /// written with `save.storage` (another format or compression: a save of the state rather
  /// than a copy). Where the tier cannot save (too few nodes for its replicas), durable steps go
  /// to the root directly and the others are skipped, said once on stderr.
  std::optional<MemoryTierOptions> memory_tier;
  int memory_every = 1;   // with memory_tier: every n-th step to memory (>= 1)
  int durable_every = 1;  // with memory_tier: every k-th step also to the root (>= 1)
  /// Incremental steps (docs/GUIDE.md, "Incremental checkpoints"): every step records its items'
  /// content hashes (StorageOptions::content_hashes) and is saved with the newest complete step
  /// before it as its StorageOptions::incremental_base, so it writes only the items whose bytes
  /// changed (and does not even hash those under save.storage.frozen_prefixes). Each step still
  /// loads on its own. Retention counts the references: a removed step's data files that a kept
  /// step shares stay (its metadata goes, so it is no longer a checkpoint) until no kept step
  /// shares them. The dcp format, metadata version 2. With memory_tier, the durable steps are
  /// incremental (each a save of the state against the previous durable step, not a copy of
  /// the tier's files); the tier's own steps in memory stay whole. A step a preemption drains
  /// is a copy of the tier's files: whole, and the next durable step shares nothing with it.
  bool incremental = false;
};

}  // namespace dcp
