// Planner interfaces: a planner decides *what* is saved or loaded.
//
// Save, on every rank (C = coordinator, rank 0):
//   SetUp(state_dict) -> CreateLocalPlan() -> [gather to C] -> C: CreateGlobalPlan(all plans)
//   -> [scatter] -> FinishPlan(my plan) -> storage calls ResolveData(item) for each item.
// Load: SetUp(state_dict, metadata) -> CreateLocalPlan() -> [gather] -> C: CreateGlobalPlan
//   -> [scatter] -> FinishPlan -> storage calls ResolveTensor / CommitTensor / LoadBytes.
//
// A planner object serves one save or load at a time. ResolveData, ResolveTensor, CommitTensor
// and LoadBytes may be called concurrently from storage threads (for distinct items) and must be
// thread-safe. Errors are thrown as dcp::Error; the orchestrator turns an error on any rank into
// the same CollectiveError on every rank.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dcp/proto/plan.h"
#include "dcp/proto/state_dict.h"

namespace dcp {

struct PlannerContext {
  int rank = 0;
  int world_size = 1;
  bool is_coordinator = true;
};

/// The bytes of one WriteItem, as ResolveData returns them: a host tensor view for tensor items
/// (possibly non-contiguous; storage copies or streams it) or a byte span for blobs. The memory
/// stays valid until the save returns.
struct ResolvedData {
  TensorView tensor;
  std::string_view bytes;
  /// Blobs: `bytes` is a torch.save archive that a format storing such records (PyTorch DCP)
  /// keeps unchanged, whatever Python object it holds (what torch.distributed.checkpoint's own
  /// planner resolves a byte entry to: dcp.torch.Writer). Otherwise a blob is raw bytes, which
  /// such a format stores as a Python bytes object.
  bool bytes_are_torch_record = false;
};

class SavePlanner {
 public:
  virtual ~SavePlanner() = default;
  virtual void SetUp(const StateDict& state_dict, const PlannerContext& ctx) = 0;
  virtual SavePlan CreateLocalPlan() = 0;
  /// Coordinator only: merge every rank's plan (index = rank) into final per-rank plans and the
  /// checkpoint's Metadata (entries and key paths; storage fields are filled by the writer).
  virtual std::pair<std::vector<SavePlan>, Metadata> CreateGlobalPlan(
      std::vector<SavePlan> all_plans) = 0;
  virtual SavePlan FinishPlan(SavePlan central_plan) = 0;
  virtual ResolvedData ResolveData(const WriteItem& item) const = 0;
};

class LoadPlanner {
 public:
  virtual ~LoadPlanner() = default;
  virtual void SetUp(StateDict& state_dict, const Metadata& metadata,
                     const PlannerContext& ctx) = 0;
  virtual LoadPlan CreateLocalPlan() = 0;
  /// Coordinator only.
  virtual std::vector<LoadPlan> CreateGlobalPlan(std::vector<LoadPlan> all_plans) = 0;
  virtual LoadPlan FinishPlan(LoadPlan central_plan) = 0;
  /// Receive the full bytes of a blob item.
  virtual void LoadBytes(const ReadItem& item, std::string bytes) = 0;
  /// The host destination for a tensor item: a view of shape item.lengths. Storage writes the
  /// item's elements into it, then calls CommitTensor with the same view.
  virtual TensorView ResolveTensor(const ReadItem& item) = 0;
  virtual void CommitTensor(const ReadItem& item, const TensorView& tensor) = 0;
};

// ---------------------------------------------------------------------------------------------
// Flattening of nested state dicts into dotted fully-qualified names ("model.layer1.weight").

template <typename ValuePtr>
struct FlatEntryT {
  KeyPath path;    // keys from the root, e.g. {"model", "layer1", "weight"}
  ValuePtr value;  // points into the state dict; valid while the dict is not modified
};
using FlatEntry = FlatEntryT<const StateValue*>;
using MutableFlatEntry = FlatEntryT<StateValue*>;

/// Flatten `sd` by joining nested keys with '.'. Nested dicts that are empty vanish.
/// Throws InvalidArgumentError naming the FQN when two paths flatten to the same name
/// (e.g. {"a": {"b": x}} and {"a.b": y}), or when a key is empty or a nested pointer is null.
std::map<std::string, FlatEntry> FlattenStateDict(const StateDict& sd);
std::map<std::string, MutableFlatEntry> FlattenStateDict(StateDict& sd);

/// Rebuild a nested StateDict from flat entries and their key paths (inverse of flattening).
void InsertAtPath(StateDict& root, const KeyPath& path, StateValue value);

}  // namespace dcp
