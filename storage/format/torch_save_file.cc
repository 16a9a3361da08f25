// Whole torch.save files (see torch_dcp.h, ReadTorchSaveFile): a state dict's tree walked into
// leaves, its tensors located in the file's storages, without LibTorch.
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "dcp/proto/error.h"
#include "dcp/storage/format/pickle.h"
#include "dcp/storage/format/torch_dcp.h"
#include "dcp/storage/format/torch_internal.h"
#include "dcp/storage/format/torch_zip.h"

namespace dcp {
namespace {

using namespace torch_internal;

// A whole torch.save file (a state dict) holds one storage entry per tensor and a pickle that
// grows with the number of tensors: bounds far above real state dicts, still bounded.
constexpr size_t kMaxFileEntries = size_t{1} << 20;
constexpr uint64_t kMaxFileDirectoryBytes = uint64_t{256} << 20;
constexpr size_t kMaxFilePickleBytes = size_t{256} << 20;

bool AllowStateDictGlobal(std::string_view module, std::string_view name) {
  if (module == "torch._utils" && name == "_rebuild_parameter") return true;
  if (module == "torch.jit._pickle" && name == "restore_type_tag") return true;
  return AllowTensorGlobal(module, name) || AllowBytesGlobal(module, name);
}

// LibTorch's pickler (torch::pickle_save) wraps typed containers in
// torch.jit._pickle.restore_type_tag(value, "Dict[str, Tensor]"), which returns the value.
const ValuePtr& Untagged(const ValuePtr& v) {
  if (v->kind == Kind::kObject && v->global_name() == "torch.jit._pickle.restore_type_tag" &&
      !v->args->items.empty()) {
    return v->args->items[0];
  }
  return v;
}

bool IsDictValue(const Value& v) {
  return v.kind == Kind::kDict ||
         (v.kind == Kind::kObject && v.global_name() == "collections.OrderedDict");
}

bool IsTensorValue(const Value& v) {
  const std::string fn = v.kind == Kind::kObject ? v.global_name() : std::string();
  return fn == "torch._utils._rebuild_tensor_v2" || fn == "torch._utils._rebuild_tensor_v3" ||
         fn == "torch._utils._rebuild_parameter";
}

// True when `v` holds a tensor or a storage anywhere (such a value cannot be kept as a record of
// its own: its storages live in this file).
bool HoldsTensor(const Value& v) {
  if (IsTensorValue(v) || v.kind == Kind::kPersistent) return true;
  for (const auto& item : v.items) {
    if (HoldsTensor(*item)) return true;
  }
  if (v.args && HoldsTensor(*v.args)) return true;
  return v.state && HoldsTensor(*v.state);
}

// Walks the dict tree of a torch.save file into leaves. The pickle bounds the tree
// (DocumentLimits); what the walk makes of it is bounded too: the names it builds (a long key
// above many leaves is copied into each), and the bytes its tensors view, which convert writes
// out whole (a stride-0 view of a small storage, or many tensors viewing one storage, would
// turn a small file into a huge checkpoint).
class StateDictWalker {
 public:
  StateDictWalker(Archive& zip, const std::string& what, uint64_t file_bytes, size_t pkl_bytes)
      : zip_(zip),
        what_(what),
        prefix_(zip.Prefix()),
        file_bytes_(file_bytes),
        name_budget_(16 * static_cast<uint64_t>(pkl_bytes) + (uint64_t{16} << 20)),
        leaf_budget_(pkl_bytes / 8 + 65536),
        tensor_budget_(kTensorBytesPerFileByte * file_bytes) {}

  // Each leaf becomes an entry of the checkpoint (a plain value its own torch.save record, about
  // 800 bytes), so their number is bounded before any is made: one per 8 bytes of pickle + 65536
  // (an honest entry takes more: a key and a value; shared dicts multiply them).
  void CheckLeafCount(const Value& root) const {
    uint64_t leaves = 0;
    CountLeaves(root, leaves);
    if (leaves > leaf_budget_) {
      throw UnsupportedError(what_ + " holds more than " + std::to_string(leaf_budget_) +
                             " entries (one per 8 bytes of its pickle, plus 65536)");
    }
  }

  void Walk(const Value& dict, const std::string& path, std::vector<TorchSaveLeaf>& out) {
    for (size_t i = 0; i + 1 < dict.items.size(); i += 2) {
      const Value& key = *dict.items[i];
      std::string name;
      if (key.kind == Kind::kStr) {
        name = key.str;
      } else if (key.kind == Kind::kInt) {
        name = std::to_string(key.integer);  // optimizer state: {param index: {...}}
      } else {
        throw UnsupportedError(what_ + ": a key under '" + Shown(path) + "' is a " +
                               key.Describe() + " (only string and int keys are converted)");
      }
      if (path.size() + 1 + name.size() > name_budget_ - name_bytes_) {
        throw CorruptionError(what_ + ": its keys make names of more than " +
                              std::to_string(name_budget_) +
                              " bytes in all (16 times its pickle, plus 16 MiB): a key shared "
                              "by reference, or one above many entries, copied into each name");
      }
      const std::string fqn = path.empty() ? name : path + "." + name;
      name_bytes_ += fqn.size();
      CheckName(fqn);
      const ValuePtr value = Untagged(dict.items[i + 1]);
      const Value& v = *value;
      if (IsDictValue(v)) {
        Walk(v, fqn, out);
        continue;
      }
      TorchSaveLeaf leaf;
      leaf.fqn = fqn;
      if (IsTensorValue(v)) {
        leaf.tensor = Tensor(v, fqn);
      } else if (HoldsTensor(v)) {
        throw UnsupportedError(what_ + ": '" + fqn + "' is a " + v.Describe() +
                               " holding tensors (only dicts of tensors are converted)");
      } else if (!BytesOfPickledValue(v, &leaf.bytes)) {
        leaf.record = TorchSaveOfPickle(pickle::Dump(v));
        leaf.value = value;
      } else {
        leaf.is_bytes = true;
      }
      out.push_back(std::move(leaf));
    }
  }

 private:
  static std::string Shown(const std::string& path) { return path.empty() ? "<root>" : path; }

  // The leaves Walk would make (the tree is bounded by DocumentLimits; stops past the budget).
  void CountLeaves(const Value& dict, uint64_t& leaves) const {
    for (size_t i = 0; i + 1 < dict.items.size() && leaves <= leaf_budget_; i += 2) {
      const Value& v = *Untagged(dict.items[i + 1]);
      if (IsDictValue(v)) {
        CountLeaves(v, leaves);
      } else {
        ++leaves;
      }
    }
  }

  // A name becomes a path of nested dicts at its dots, which what writes the checkpoint walks
  // level by level with the prefix so far: bounded in bytes and in parts (real names have a few
  // hundred bytes and a dozen parts).
  void CheckName(const std::string& fqn) const {
    const size_t parts = static_cast<size_t>(std::count(fqn.begin(), fqn.end(), '.')) + 1;
    if (fqn.size() > kMaxNameBytes || parts > kMaxNameParts) {
      throw UnsupportedError(what_ + ": the name '" + fqn.substr(0, 64) + "...' has " +
                             std::to_string(fqn.size()) + " bytes in " + std::to_string(parts) +
                             " dotted parts (limits: " + std::to_string(kMaxNameBytes) +
                             " bytes, " + std::to_string(kMaxNameParts) + " parts)");
    }
  }

  TorchTensorRecord Tensor(const Value& v, const std::string& fqn) {
    const Value* t = &v;
    if (v.global_name() == "torch._utils._rebuild_parameter") {  // nn.Parameter(data, ...)
      if (v.args->items.empty() || !IsTensorValue(*v.args->items[0]) ||
          v.args->items[0]->global_name() == "torch._utils._rebuild_parameter") {
        throw CorruptionError(what_ + ": parameter '" + fqn + "' holds no tensor");
      }
      t = v.args->items[0].get();
    }
    const Reader r{what_ + " tensor '" + fqn + "'"};
    TorchTensorRecord rec;
    const StorageRef ref = ReadRebuildCall(r, *t, rec);
    const std::string entry = prefix_ + "data/" + ref.key;
    ReadStorageEntry(r, zip_, entry, ref, rec);
    CheckExtent(r, rec);
    CheckViewedBytes(rec, fqn);
    auto known = storage_begin_.find(entry);
    if (known == storage_begin_.end()) {
      // Once per storage, however many tensors view it: where its data lies, and its CRC-32
      // (torch.load never checks it; a damaged value must not pass into a checkpoint that then
      // verifies).
      const uint64_t at = zip_.DataOffset(entry);
      zip_.CheckEntry(entry);
      known = storage_begin_.emplace(entry, at).first;
    }
    rec.storage_begin = known->second;
    return rec;
  }

  // A tensor is written out whole (numel x element size): it may not view more bytes than its
  // storage holds, and the file's tensors together no more than kTensorBytesPerFileByte times the
  // file (tied weights and views of one storage are honest, and rare).
  void CheckViewedBytes(const TorchTensorRecord& rec, const std::string& fqn) {
    uint64_t bytes = ElementSize(rec.dtype);
    for (int64_t n : rec.sizes) {
      if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(n), &bytes)) {
        bytes = UINT64_MAX;
        break;
      }
    }
    if (bytes > rec.storage_bytes) {
      throw UnsupportedError(
          what_ + ": tensor '" + fqn + "' views " + std::to_string(bytes) +
          " bytes of a storage of " + std::to_string(rec.storage_bytes) +
          " (stride 0 or overlapping strides: an expanded tensor); it would be written out "
          "whole, so a tensor may view at most the bytes its storage holds (save it with "
          ".contiguous() or .clone())");
    }
    if (bytes > tensor_budget_ - tensor_bytes_) {
      throw UnsupportedError(
          what_ + ": its tensors view more than " + std::to_string(tensor_budget_) +
          " bytes in all, " + std::to_string(kTensorBytesPerFileByte) + " times the file's " +
          std::to_string(file_bytes_) + " (reached at tensor '" + fqn +
          "'): so many tensors share storages that the checkpoint would be far larger than the "
          "file");
    }
    tensor_bytes_ += bytes;
  }

  static constexpr uint64_t kTensorBytesPerFileByte = 8;
  static constexpr size_t kMaxNameBytes = size_t{64} << 10, kMaxNameParts = 256;
  Archive& zip_;
  const std::string& what_;
  std::string prefix_;
  uint64_t file_bytes_;
  uint64_t name_budget_, name_bytes_ = 0;
  uint64_t leaf_budget_;
  uint64_t tensor_budget_, tensor_bytes_ = 0;
  std::map<std::string, uint64_t> storage_begin_;  // tensors may share a storage
};

}  // namespace

std::vector<TorchSaveLeaf> ReadTorchSaveFile(ReadableObject& in, uint64_t length,
                                             const std::string& what) {
  Archive zip(in, 0, length, what, kMaxFileEntries, kMaxFileDirectoryBytes);
  const std::string prefix = zip.Prefix();
  CheckByteOrder(zip, prefix, what);
  const std::string pkl = zip.ReadSmall(prefix + "data.pkl", kMaxFilePickleBytes);
  const pickle::Limits limits = DocumentLimits(pkl.size(), kMaxFilePickleBytes);
  const ValuePtr loaded =
      pickle::Load(pkl, AllowStateDictGlobal, what + " " + prefix + "data.pkl", limits);
  const ValuePtr root = Untagged(loaded);
  if (!IsDictValue(*root)) {
    throw UnsupportedError(what + " holds a " + root->Describe() +
                           ", not a dict (only dicts of tensors, as torch.save(state_dict) "
                           "writes, are converted)");
  }
  std::vector<TorchSaveLeaf> leaves;
  StateDictWalker walker(zip, what, length, pkl.size());
  walker.CheckLeafCount(*root);
  walker.Walk(*root, "", leaves);
  return leaves;
}

}  // namespace dcp
