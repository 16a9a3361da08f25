// What the PyTorch DCP format's files (storage/format/torch_*.cc) share: a bounded reader of
// unpickled values, the globals their pickles may name, and how a tensor's pickle in a
// torch.save archive is read. Internal to storage/format: not installed.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "dcp/proto/error.h"
#include "dcp/proto/tensor.h"
#include "dcp/storage/format/pickle.h"
#include "dcp/storage/format/torch_dcp.h"
#include "dcp/storage/format/torch_zip.h"

namespace dcp::torch_internal {

using pickle::Kind;
using pickle::Value;
using pickle::ValuePtr;

/// The largest data.pkl read from a PyTorch DCP record or byte entry.
constexpr size_t kMaxPickleBytes = size_t{1} << 20;

/// Storage classes of torch.save's typed storages (_rebuild_tensor_v2), by name.
const std::map<std::string, DType, std::less<>>& StorageClasses();
/// True for the name of a torch dtype ("float32"...).
bool IsTorchDType(std::string_view name);
/// The globals a tensor record's pickle may name.
bool AllowTensorGlobal(std::string_view module, std::string_view name);
/// The globals a pickled Python bytes object names (protocol 2: _codecs.encode, bytes).
bool AllowBytesGlobal(std::string_view module, std::string_view name);
/// Limits for a pickle of `size` bytes (at most `max_input_bytes`) from a torch.save archive.
pickle::Limits DocumentLimits(size_t size, size_t max_input_bytes);
/// If `v` is a pickled Python bytes object (any protocol's form), its payload.
bool BytesOfPickledValue(const Value& v, std::string* payload);

// A pickle may reference one value (through the memo) any number of times, so what is read
// out of it is charged against a budget proportional to the input: a small file whose long
// string or long tuple is shared by many entries must not make the reader copy gigabytes.
// Real metadata stays far below it (each reference to a memoised fqn costs tens of bytes of
// input for its own record).
class Reader {
 public:
  explicit Reader(std::string source, size_t input_bytes = 0)
      : source_(std::move(source)), budget_((size_t{64} << 20) + 64 * input_bytes) {}
  [[noreturn]] void Fail(const std::string& why) const {
    throw CorruptionError(source_ + ": " + why);
  }
  const std::string& source() const { return source_; }

  int64_t Int(const Value* v, const std::string& what) const {
    if (!v || v->kind != Kind::kInt) Fail(what + " is not an integer");
    return v->integer;
  }
  const std::string& Str(const Value* v, const std::string& what) const {
    if (!v || v->kind != Kind::kStr) Fail(what + " is not a string");
    Charge(v->str.size(), what);
    return v->str;
  }
  // A torch.Size(...) or a plain tuple/list of integers.
  Shape Ints(const Value* v, const std::string& what) const {
    if (v && v->kind == Kind::kObject && v->global_name() == "torch.Size") {
      if (v->args->items.size() != 1) Fail(what + ": torch.Size takes one tuple");
      v = v->args->items[0].get();
    }
    if (!v || (v->kind != Kind::kTuple && v->kind != Kind::kList)) {
      Fail(what + " is not a tuple of integers");
    }
    Charge(v->items.size() * sizeof(int64_t), what);
    Shape s;
    for (const auto& item : v->items) s.push_back(Int(item.get(), what));
    return s;
  }
  // The object's dataclass state as a dict: BUILD with a dict, or (None, slots-dict).
  const Value& State(const Value* obj, const std::string& cls, const std::string& what) const {
    if (!obj || obj->kind != Kind::kObject || Leaf(obj->global_name()) != cls) {
      Fail(what + " is a " + (obj ? obj->Describe() : std::string("nothing")) + ", expected " +
           cls);
    }
    static const Value kEmpty = [] {
      Value v;
      v.kind = Kind::kDict;
      return v;
    }();
    const Value* st = obj->state.get();
    if (!st) return kEmpty;
    if (st->kind == Kind::kTuple && st->items.size() == 2 && st->items[1]->kind == Kind::kDict) {
      st = st->items[1].get();
    }
    if (st->kind != Kind::kDict) Fail(what + ": " + cls + " state is not a dict");
    return *st;
  }
  static std::string Leaf(const std::string& dotted) {
    return dotted.substr(dotted.rfind('.') + 1);
  }
  DType DTypeOf(const Value* v, const std::string& what) const {
    if (!v || v->kind != Kind::kGlobal || v->module() != "torch") Fail(what + " is not a dtype");
    auto d = DTypeFromName(v->name());
    if (!d) Fail(what + ": unknown dtype torch." + v->name());
    return *d;
  }
  /// Take `bytes` of what is copied out of the pickle from the budget (CorruptionError past it).
  void Charge(size_t bytes, const std::string& what) const {
    if (bytes > budget_) {
      Fail(what +
           ": the pickle expands to far more than its size (a value shared by too many "
           "references)");
    }
    budget_ -= bytes;
  }

 private:
  std::string source_;
  mutable size_t budget_;
};

/// UnsupportedError naming `what` for an archive written on a big-endian machine.
void CheckByteOrder(Archive& zip, const std::string& prefix, const std::string& what);

/// The storage a tensor's pickle references: ('storage', type, key, location, numel).
struct StorageRef {
  bool untyped = false;  // an UntypedStorage: numel counts bytes
  std::string key;       // its entry is data/<key>
  int64_t numel = 0;
};

/// The tensor's pickle, _rebuild_tensor_v2 or _v3(storage, storage_offset, size, stride, ...):
/// its dtype, offset, sizes and strides into rec; returns the storage it references.
StorageRef ReadRebuildCall(const Reader& r, const Value& root, TorchTensorRecord& rec);
/// The storage's zip entry: its size and CRC-32 into rec, checked against the pickle's numel.
void ReadStorageEntry(const Reader& r, const Archive& zip, const std::string& entry,
                      const StorageRef& ref, TorchTensorRecord& rec);
/// Every element must lie inside the storage; sets rec.span_bytes (CorruptionError otherwise).
void CheckExtent(const Reader& r, TorchTensorRecord& rec);

}  // namespace dcp::torch_internal
