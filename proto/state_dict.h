// The state dict a job saves and loads: nested string-keyed containers whose leaves are
// tensors (TensorView), sharded tensors (local shards plus the global shape) or byte blobs.
//
// A StateDict does not own tensor memory unless a view's `owner` is set: the caller keeps the
// tensors alive across save()/load(). Loading writes into the views in place and replaces the
// contents of blobs. Not thread-safe for concurrent mutation.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "dcp/proto/tensor.h"

namespace dcp {

/// One local piece of a sharded tensor: `view` holds the box starting at `offsets` of the
/// global shape.
struct Shard {
  TensorView view;
  Shape offsets;
};

/// A tensor of `global_shape` of which this rank holds `local_shards` (possibly none).
struct ShardedTensor {
  DType dtype = DType::kFloat32;
  Shape global_shape;
  std::vector<Shard> local_shards;
};

class BlobBinding;

/// Opaque bytes (RNG state, a dataloader position, a config...). Saved as is.
struct Blob {
  std::string bytes;
  /// When set, Save and Load take the bytes from binding->Bytes() at their start, and a load
  /// hands what it read to binding->Loaded() (see BlobBinding); `bytes` is then what it gave
  /// when the blob was made.
  std::shared_ptr<const BlobBinding> binding = nullptr;
};

/// Late binding of a blob to a value kept elsewhere (an optimizer's parameter-group option,
/// serialised as the caller likes): the blob counterpart of ViewBinding, called at the same
/// points and from the same thread.
class BlobBinding {
 public:
  virtual ~BlobBinding() = default;
  /// The bytes to save now.
  virtual std::string Bytes() const = 0;
  /// A load read `bytes` for this blob: e.g. parse them and set the value they came from.
  /// Exceptions propagate out of Load. The default does nothing.
  virtual void Loaded(const std::string& bytes) const;
};

/// A plain Python value (what PyTorch DCP stores for a non-tensor entry: None, bool, int, float,
/// str, bytes, and tuples, lists and dicts of those), as dcp::PythonValue reads it from a blob.
/// Immutable once made; sub-values may be shared (a pickle's memo), never cyclic.
struct PyValue {
  enum class Kind : uint8_t { kNone, kBool, kInt, kFloat, kStr, kBytes, kTuple, kList, kDict };
  Kind kind = Kind::kNone;
  bool boolean = false;
  int64_t integer = 0;
  double real = 0;
  std::string str;  // kStr (UTF-8), kBytes
  /// kTuple, kList: the elements; kDict: key, value, key, value...
  std::vector<std::shared_ptr<const PyValue>> items;

  // Typed reads as Python would convert: nullopt when the kind does not fit (never throws).
  /// kFloat, kInt (as float(x)); not kBool.
  std::optional<double> AsFloat() const;
  /// kInt; not kBool.
  std::optional<int64_t> AsInt() const;
  /// kBool only.
  std::optional<bool> AsBool() const;
  /// kStr.
  std::optional<std::string> AsStr() const;
  bool IsNone() const { return kind == Kind::kNone; }
  /// For kDict: the value under the string key `key`, or null.
  const PyValue* Get(std::string_view key) const;
};
using PyValuePtr = std::shared_ptr<const PyValue>;

class StateDict;
using StateValue = std::variant<TensorView, ShardedTensor, Blob, std::shared_ptr<StateDict>>;

class StateDict {
 public:
  StateDict() = default;

  /// Insert or replace `key`. Returns *this for chaining.
  StateDict& Set(const std::string& key, StateValue value);
  /// The nested dict at `key`, created if absent. Throws InvalidArgumentError if `key` holds a
  /// leaf.
  StateDict& Nested(const std::string& key);
  /// Entry at `key` in this dict (not a dotted path), or nullptr.
  StateValue* Find(const std::string& key);
  const StateValue* Find(const std::string& key) const;
  bool empty() const { return items_.empty(); }
  size_t size() const { return items_.size(); }

  std::map<std::string, StateValue>& items() { return items_; }
  const std::map<std::string, StateValue>& items() const { return items_; }

 private:
  std::map<std::string, StateValue> items_;
};

/// True when a view of `sd` (a tensor or a shard of a sharded tensor, at any depth) has a
/// binding (TensorView::binding), or a blob has one (Blob::binding).
bool HasBindings(const StateDict& sd);

/// A copy of `sd` in which every bound view is replaced by what its binding resolves to now
/// (the copy keeps each resolved view's binding pointer in `binding` so FinishBoundLoad can
/// find it; Save and Load ignore a binding on a resolved copy). Nested dicts are copied, leaves
/// are copied as values (views share memory). Exceptions from a binding propagate.
StateDict ResolveBindings(const StateDict& sd);

/// A number that changes at every ResolveBindings call and stays the same during one: lets the
/// bindings of one object (e.g. every parameter of a module) share work done once per
/// resolution (listing the module's parameters). Thread-safe.
uint64_t ResolveEpoch();

/// After a load into `resolved` (made by ResolveBindings(original)): give each bound view's
/// loaded contents to its binding (ViewBinding::Loaded, BlobBinding::Loaded) and copy the loaded
/// blobs' bytes back into `original`.
void FinishBoundLoad(StateDict& original, const StateDict& resolved);

}  // namespace dcp
