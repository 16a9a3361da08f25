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
//   global-shape mismatch is an error naming the fqn and both sides. Overlaps are found through
//   a ChunkIndex per tensor, so planning stays fast with many thousands of saved chunks.
#pragma once

#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "dcp/planner/planner.h"

namespace dcp {

/// A chunk of one tensor and the rank that holds it, for validation messages.
struct PlacedChunk {
  ChunkMeta chunk;
  int rank = -1;
};

/// Throw InvalidArgumentError unless `chunks` tile `shape` exactly (in bounds, pairwise
/// disjoint, covering every element). Overlaps are found by FindOverlap (proto/chunks.h), so
/// tensors split along at most two dimensions validate in O(n log n); a layout irregular along
/// three or more whose check would be quadratic beyond its bound is refused too.
void ValidateChunks(const std::string& fqn, const Shape& shape,
                    const std::vector<PlacedChunk>& chunks);
/// The same for chunks[i] held by ranks[i] (`ranks` may be empty: no rank is named).
void ValidateChunks(const std::string& fqn, const Shape& shape,
                    const std::vector<ChunkMeta>& chunks, const std::vector<int>& ranks);

/// A sharded tensor a rank declares without holding any of it, so that its dtype and shape are
/// still checked (DefaultSavePlanner's local planner_data: one line each,
/// "fqn\tdtype\tdim,dim,...\n").
struct SaveDeclaration {
  std::string fqn;
  DType dtype = DType::kFloat32;
  Shape shape;
};
/// One declaration's line. InvalidArgumentError for an fqn with a tab or newline.
std::string EncodeSaveDeclaration(const std::string& fqn, DType dtype, const Shape& shape);
/// The declarations in `planner_data`, in order. CorruptionError for a malformed line.
std::vector<SaveDeclaration> DecodeSaveDeclarations(std::string_view planner_data);

class DefaultSavePlanner : public SavePlanner {
 public:
  void SetUp(const StateDict& state_dict, const PlannerContext& ctx) override;
  SavePlan CreateLocalPlan() override;
  std::pair<std::vector<SavePlan>, Metadata> CreateGlobalPlan(
      std::vector<SavePlan> all_plans) override;
  /// The same, with base_load[r] bytes that rank r writes besides its plan's items (compact
  /// planning's regular shards, planner/compact_plan.h), which the dedup of replicated items
  /// balances against (empty: none), and the entries `planned` already holds (compact
  /// planning's regular tensors; null: none), which no plan's items may name: a rank's
  /// declaration of one is checked against it (as if rank 0 held it) and adds nothing. The
  /// returned metadata does not contain the `planned` entries.
  std::pair<std::vector<SavePlan>, Metadata> CreateGlobalPlan(std::vector<SavePlan> all_plans,
                                                              std::vector<uint64_t> base_load,
                                                              const Metadata* planned = nullptr);
  SavePlan FinishPlan(SavePlan central_plan) override;
  ResolvedData ResolveData(const WriteItem& item) const override;

 private:
  std::map<std::string, FlatEntry> flat_;
  PlannerContext ctx_;
};

/// An index over the chunks of one saved tensor, answering "which chunks overlap this box?"
/// without scanning them all. Chunks are sorted by their start along the dimension with the most
/// distinct starts; a query binary-searches the starts that can reach the box (start in
/// (box_begin - longest_extent, box_end)) and intersects only those candidates. Row-, column- and
/// block-sharded layouts answer in O(log n + k). Results equal OverlappingChunksNaive.
class ChunkIndex {
 public:
  explicit ChunkIndex(const std::vector<ChunkMeta>& chunks);
  /// Indices (into the constructor's vector) of the chunks that overlap `box`, ascending.
  std::vector<size_t> Overlapping(const ChunkMeta& box) const;

 private:
  const std::vector<ChunkMeta>* chunks_;
  size_t dim_ = 0;
  int64_t max_extent_ = 0;
  std::vector<std::pair<int64_t, size_t>> starts_;  // (offset along dim_, chunk index), sorted
};

/// Reference implementation of ChunkIndex::Overlapping: test every chunk.
std::vector<size_t> OverlappingChunksNaive(const std::vector<ChunkMeta>& chunks,
                                           const ChunkMeta& box);

struct LoadPlannerOptions {
  /// Skip state dict keys that the checkpoint lacks instead of failing.
  bool allow_partial_load = false;
  /// Compute overlaps by testing every saved chunk (the reference algorithm; for tests).
  bool naive_overlaps = false;
  /// Load without a model: SetUp replaces the state dict's contents with
  /// StateDictFromMetadata(metadata), so every entry of the checkpoint is allocated and loaded.
  bool load_all = false;
  /// Convert tensors stored in another dtype than the destination's (CanCastDType: bool,
  /// integers, float16, bfloat16, float32, float64) as torch's Tensor.copy_ does; off, such a
  /// tensor is an InvalidArgumentError naming it. Shapes must match either way.
  bool cast_dtypes = false;
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

  /// Checkpoint entries that the state dict does not ask for (sorted), as of the last
  /// CreateLocalPlan.
  const std::vector<std::string>& extra_keys() const { return extra_keys_; }

 private:
  TensorView Destination(const ReadItem& item) const;

  LoadPlannerOptions options_;
  std::vector<std::string> extra_keys_;
  // Items being cast (cast_dtypes): staged memory's address -> (staged view, destination).
  std::mutex casts_mu_;
  std::map<const void*, std::pair<TensorView, TensorView>> casts_;
  std::map<std::string, MutableFlatEntry> flat_;
  const Metadata* metadata_ = nullptr;
  PlannerContext ctx_;
};

/// A state dict holding every entry of `metadata`, for loading a checkpoint without a model
/// (tools, inference): each tensor is a freshly allocated (zeroed) host TensorView of its global
/// shape and dtype, each blob an empty Blob, nested as recorded in metadata.key_paths (entries
/// without a recorded path are nested by splitting the fqn at '.'). Load() into it then fills
/// every entry; every rank that does so gets the whole checkpoint.
StateDict StateDictFromMetadata(const Metadata& metadata);

}  // namespace dcp
