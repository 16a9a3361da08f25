// The default planners.
//
// DefaultSavePlanner: one WriteItem per local tensor, shard or blob. The global plan
//   - deduplicates items that several ranks hold identically (same fqn and chunk): each is
//     written once, by the holder with the fewest bytes so far, largest items first;
//   - checks that all ranks agree on each tensor's dtype and global shape;
//   - validates every tensor's chunks: inside the shape, no two overlapping, together covering
//     it exactly. Errors name the fqn, the chunks and the ranks.
// DefaultLoadPlanner: reads each local tensor, shard or blob from every saved chunk that
//   overlaps it, so any saved layout loads into any requested layout. A requested key absent
//   from the checkpoint is an error naming it unless allow_partial_load is set; a dtype or
//   global-shape mismatch is an error naming the fqn and both sides.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "planner/flatten.h"
#include "planner/planner.h"

namespace dcp {

/// A chunk of one tensor and the rank that holds it, for validation messages.
struct PlacedChunk {
  ChunkMeta chunk;
  int rank = -1;
};

/// Throw InvalidArgumentError unless `chunks` tile `shape` exactly (in bounds, pairwise
/// disjoint, covering every element). Runs a sort-and-sweep along the most discriminating
/// dimension, so row- or column-sharded tensors validate in O(n log n).
void ValidateChunks(const std::string& fqn, const Shape& shape,
                    const std::vector<PlacedChunk>& chunks);

class DefaultSavePlanner : public SavePlanner {
 public:
  void SetUp(const StateDict& state_dict, const PlannerContext& ctx) override;
  SavePlan CreateLocalPlan() override;
  std::pair<std::vector<SavePlan>, Metadata> CreateGlobalPlan(
      std::vector<SavePlan> all_plans) override;
  SavePlan FinishPlan(SavePlan central_plan) override;
  ResolvedData ResolveData(const WriteItem& item) const override;

 private:
  std::map<std::string, FlatEntry> flat_;
  PlannerContext ctx_;
};

struct LoadPlannerOptions {
  /// Skip state dict keys that the checkpoint lacks instead of failing.
  bool allow_partial_load = false;
};

class DefaultLoadPlanner : public LoadPlanner {
 public:
  explicit DefaultLoadPlanner(LoadPlannerOptions options = {}) : options_(options) {}
  void SetUp(StateDict& state_dict, const Metadata& metadata, const PlannerContext& ctx) override;
  LoadPlan CreateLocalPlan() override;
  std::vector<LoadPlan> CreateGlobalPlan(std::vector<LoadPlan> all_plans) override;
  LoadPlan FinishPlan(LoadPlan central_plan) override;
  void LoadBytes(const ReadItem& item, std::string bytes) override;
  TensorView ResolveTensor(const ReadItem& item) override;
  void CommitTensor(const ReadItem& item, const TensorView& tensor) override;

 private:
  LoadPlannerOptions options_;
  std::map<std::string, MutableFlatEntry> flat_;
  const Metadata* metadata_ = nullptr;
  PlannerContext ctx_;
};

}  // namespace dcp
