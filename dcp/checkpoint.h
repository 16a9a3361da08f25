// dcp::Save and dcp::Load: the distributed checkpoint protocol.
//
// Save (every rank calls it with its own state dict; rank 0 coordinates):
//   plan:  local plans -> gather -> global plan (dedup, metadata, validation) -> scatter
//   write: each rank writes its items -> gather results -> rank 0 commits the metadata
// Load:
//   metadata: rank 0 reads and validates it -> broadcast
//   plan:     local plans -> gather -> global plan -> scatter
//   read:     each rank reads into its tensors -> gather outcomes
// Each phase ends with an exchange through rank 0, so a failure on any rank in any phase
// becomes the same CollectiveError on every rank, naming the failed ranks and their messages.
// A rank that does not answer within comm.timeout() is named as timed out; nothing hangs.
// A failed save writes no metadata and removes the data files it wrote, so the location keeps
// whatever checkpoint it held before (if any), loadable.
//
// Ownership: the state dict's tensors must stay alive and unmodified until Save returns, and
// alive until Load returns. After a failed Load the destination tensors may be partly written.
// Not reentrant per Communicator: one save or load at a time on a given communicator.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dcp/communicator.h"
#include "dcp/options.h"
#include "dcp/planner/planner.h"
#include "dcp/proto/plan.h"
#include "dcp/proto/state_dict.h"
#include "dcp/storage/storage.h"

namespace dcp {

/// Reuse of the previous save's global plan when nothing about the plans changed (plan
/// caching). Pass the same cache to every save of one job (one per communicator): each rank
/// hashes its local plan; rank 0 compares every rank's hash, and the id of the plan it was
/// cached with, with the previous save's; when all match, the plan exchange is one small message
/// per rank and a reply naming its data files, instead of every local plan gathered, merged and
/// scattered (and the metadata skeleton is reused). Any difference (a changed structure, a rank
/// whose cache is stale or empty, another planner or world size) makes that save plan in full
/// and refresh every rank's cache. Memory: a rank keeps its central plan; rank 0 also keeps
/// every rank's plan and the metadata skeleton. On a hit the storage writer's PrepareGlobalPlan
/// is given the cached plans as it returned them last time (it must accept its own output: the
/// built-in writers only name files). Not thread-safe: one save at a time, like the
/// communicator.
class SavePlanCache {
 public:
  /// Saves that reused the cached plan / planned in full, as this rank saw them.
  uint64_t hits() const { return hits_; }
  uint64_t misses() const { return misses_; }
  /// Forget everything (the next save plans in full).
  void Clear();

  // The cached state (used by Save; not part of the stable API).
  struct Entry {
    bool valid = false;
    uint64_t hash = 0;     // this rank's local plan
    uint64_t plan_id = 0;  // the global plan it belongs to
    int world_size = 0;
    std::string planner;  // the planner's type
    SavePlan central;     // this rank's central plan (storage_data replaced at each save)
    // Rank 0 only:
    std::vector<uint64_t> hashes;
    std::vector<SavePlan> global_plans;  // before the writer named their files
    Metadata skeleton;
  };
  Entry entry;
  uint64_t hits_ = 0, misses_ = 0;
};

/// How one rank's save planned (for tests and tools).
struct SaveStats {
  /// The plan came from compact planning (regularly sharded tensors described once; see
  /// planner/compact_plan.h), not from a full exchange of every item, nor from the plan cache.
  bool compact_plan = false;
  /// Items of this rank's local plan described compactly (0 when not compact).
  uint64_t regular_items = 0;
  /// The plan came from the plan cache.
  bool cached_plan = false;
  /// Bytes of the plan messages this rank sent to the coordinator.
  uint64_t plan_bytes_sent = 0;
  /// Plan exchanges this save took: 1, or 2 when compact planning was retried with every
  /// declaration in full or fell back to full planning, 3 when both (0 on a plan-cache hit).
  int plan_rounds = 0;
};

/// How one rank's load planned, and what it exchanged with the others instead of reading
/// (LoadOptions::read_once).
struct LoadStats {
  uint64_t shared_batches = 0;  // broadcasts of shared reads this load made (every rank joins all)
  uint64_t bytes_sent = 0;      // bytes this rank read for other ranks and broadcast
  uint64_t bytes_received = 0;  // bytes this rank received instead of reading them
  uint64_t items_received = 0;
  /// The load planned on every rank alone (the default planner and a reader whose global step
  /// changes nothing): each rank sent a summary of its request, not its plan.
  bool rank_local_plan = false;
  /// Bytes of the planning messages this rank sent to the coordinator.
  uint64_t plan_bytes_sent = 0;
  /// Plan exchanges: 1, or 2 when the coordinator's planner or reader needed every plan.
  int plan_rounds = 0;
  /// Cooperative reads (LoadOptions::read_once): rounds of bulk exchange this load ran (0: it
  /// read cooperatively not at all), bytes this rank sent as an owner of stored items and
  /// received from owners, and the read items those bytes completed here.
  uint64_t coop_rounds = 0;
  uint64_t coop_bytes_sent = 0;
  uint64_t coop_bytes_received = 0;
  uint64_t coop_items_received = 0;
  /// Rule exchange (a reshard between two rules, planner/rule_reads.h): its rounds (0: none),
  /// the bytes this rank sent as an owner and received, the reads it completed, and those it
  /// read itself instead because an owner could not serve them.
  uint64_t rule_rounds = 0;
  uint64_t rule_bytes_sent = 0;
  uint64_t rule_bytes_received = 0;
  uint64_t rule_items = 0;
  uint64_t rule_items_fallen_back = 0;
};

/// What a save returns (the same metadata on every rank; stats are this rank's).
struct SaveResult {
  Metadata metadata;  // the committed metadata
  SaveStats stats;
};

/// What a load returns.
struct LoadResult {
  Metadata metadata;  // the checkpoint's metadata
  LoadStats stats;    // this rank's read-once figures
  /// Checkpoint entries the state dict did not ask for, sorted (default planner only).
  std::vector<std::string> unrequested_keys;
};

/// Save `state_dict` to `uri` (file path, file://, mem:// or a registered scheme).
/// Returns the committed Metadata (the same on every rank) and this rank's planning figures. Throws
/// CollectiveError on failure (on every rank alike); failures()[i].code tells what went wrong where
/// (e.g. kAlreadyExists when a checkpoint is present and overwrite is off).
SaveResult Save(const StateDict& state_dict, const std::string& uri, Communicator& comm,
                const SaveOptions& options = {});
/// Through a StorageWriter of the caller's (a backend that is not a Store).
SaveResult Save(const StateDict& state_dict, StorageWriter& writer, Communicator& comm,
                const SaveOptions& options = {});
/// Single-process convenience (a group of one).
SaveResult Save(const StateDict& state_dict, const std::string& uri,
                const SaveOptions& options = {});

/// Load into the tensors and blobs of `state_dict`, in place, from `uri`. Any saved layout and
/// world size loads into any requested layout. A key the checkpoint lacks fails the load on
/// every rank (naming it) unless options.allow_partial_load.
LoadResult Load(StateDict& state_dict, const std::string& uri, Communicator& comm,
                const LoadOptions& options = {});
/// Through a StorageReader of the caller's (a backend that is not a Store).
LoadResult Load(StateDict& state_dict, StorageReader& reader, Communicator& comm,
                const LoadOptions& options = {});
/// Single-process convenience (a group of one).
LoadResult Load(StateDict& state_dict, const std::string& uri, const LoadOptions& options = {});

/// Load without a model: every entry of the checkpoint, allocated in host memory from its
/// metadata (StateDictFromMetadata), nested as it was saved. Works at any world size; every
/// rank gets the whole checkpoint. With options.weights_only, blobs are left out. Default
/// planner only (InvalidArgumentError for options.planner).
StateDict LoadAll(const std::string& uri, Communicator& comm, const LoadOptions& options = {});
StateDict LoadAll(StorageReader& reader, Communicator& comm, const LoadOptions& options = {});
/// Single-process convenience (a group of one).
StateDict LoadAll(const std::string& uri, const LoadOptions& options = {});

/// The Python object a byte entry holds, as dcp's restricted unpickler reads it (no code runs):
/// what torch.distributed.checkpoint wrote for a non-tensor value (an int, a float, a bool, a
/// str, None, or a list/tuple/dict of those: an optimizer's param_groups.<i>.lr, .betas,
/// .params, ...), loaded into `blob` by Load or LoadAll. Read the PyValue (proto/state_dict.h)
/// with AsFloat(), AsInt(), AsBool(), AsStr(), IsNone(), or its kind and items (a tuple's or
/// list's elements; a dict's keys and values alternating). Accepts a torch.save archive (what
/// torch writes) or a bare pickle. A byte entry that was a Python bytes object is loaded as
/// those bytes, not as a pickle: it fails here unless they happen to be a pickle. Throws
/// InvalidArgumentError when the bytes are neither an archive nor a pickle, CorruptionError
/// when they are malformed, UnsupportedError for an object of a class (any pickled global
/// beyond those of a bytes value); `what` names the entry in the message.
PyValuePtr PythonValue(const Blob& blob, const std::string& what = "blob");

/// Read and validate a checkpoint's metadata (no collectives), with every stored item: for a
/// version-2 checkpoint that reads every data file's index too (ReadStoredItems). Throws
/// NotFoundError, CorruptionError or UnsupportedError.
Metadata ReadMetadata(const std::string& uri, const StorageOptions& options = {});

/// Version-2 checkpoints (docs/FORMAT.md) keep where each item lies in their data files'
/// indexes, so their decoded metadata has an empty `storage`: this fills `md` (read from `uri`)
/// with every item, reading every index (O(checkpoint); loads read only the indexes they need).
/// Version 1: nothing to do. Throws NotFoundError for a missing data file, CorruptionError for a
/// damaged index or an item no index holds.
void ReadStoredItems(const std::string& uri, Metadata& md, const StorageOptions& options = {});

/// Version of this library ("major.minor.patch").
const char* LibraryVersion();

}  // namespace dcp
