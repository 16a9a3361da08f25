// Hugging Face safetensors as a readable layout (storage/format/safetensors.h): the index and
// the file headers become dcp Metadata whose items are plain byte ranges, so the generic reader
// does every load, reshard and device copy. The layout's write side is the index (the commit
// marker); the data path is safetensors_writer.cc's, which replaces the per-rank item encoders.
#include <algorithm>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "dcp/proto/error.h"
#include "dcp/proto/executor.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/storage/format/layout.h"
#include "dcp/storage/format/safetensors.h"
#include "dcp/storage/forwarding_store.h"

namespace dcp {
namespace {

using Json = nlohmann::json;

// The blobs a `dcp convert` export or a safetensors save lists in __metadata__.
constexpr const char* kBlobsKey = kSafetensorsBlobsKey;
// Where the index of a dcp save records its save id (the Hub's "metadata" object holds
// "total_size" and whatever else a writer adds).
constexpr char kSaveIdKey[] = "dcp.save_id";
// Real headers nest three deep (root, tensor, shape) and shapes have a handful of dimensions;
// the bounds only keep a hostile header from costing the parser's memory or stack.
constexpr int kMaxJsonDepth = 8;
constexpr size_t kMaxArrayLength = 1024;

[[noreturn]] void Bad(const std::string& where, const std::string& what) {
  throw CorruptionError("safetensors file '" + where + "': " + what);
}

// Parse untrusted JSON: nlohmann's parser is iterative, but a DOM of deep nesting or of huge
// arrays is not what any header holds, so both are refused while parsing.
Json ParseBounded(std::string_view text, const std::string& where, const char* what) {
  struct Refused {
    std::string why;
  };
  std::vector<std::pair<bool, size_t>> open;  // (is array, elements so far)
  auto count = [&] {
    if (!open.empty() && open.back().first && ++open.back().second > kMaxArrayLength) {
      throw Refused{"an array longer than " + std::to_string(kMaxArrayLength) + " elements"};
    }
  };
  Json::parser_callback_t cb = [&](int depth, Json::parse_event_t ev, Json&) {
    if (depth > kMaxJsonDepth) {
      throw Refused{"nesting deeper than " + std::to_string(kMaxJsonDepth) + " levels"};
    }
    switch (ev) {
      case Json::parse_event_t::object_start:
        open.emplace_back(false, 0);
        break;
      case Json::parse_event_t::array_start:
        open.emplace_back(true, 0);
        break;
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        if (!open.empty()) open.pop_back();
        count();
        break;
      case Json::parse_event_t::value:
        count();
        break;
      case Json::parse_event_t::key:
        break;
    }
    return true;
  };
  try {
    return Json::parse(text.begin(), text.end(), cb);
  } catch (const Refused& r) {
    throw CorruptionError("'" + where + "': " + what + " has " + r.why);
  } catch (const Json::exception& e) {
    throw CorruptionError("'" + where + "': " + what + " is not valid JSON: " + e.what());
  }
}

// A JSON number that is a non-negative integer, as uint64.
std::optional<uint64_t> Unsigned(const Json& j) {
  if (j.is_number_unsigned()) return j.get<uint64_t>();
  if (j.is_number_integer() && j.get<int64_t>() >= 0)
    return static_cast<uint64_t>(j.get<int64_t>());
  return std::nullopt;
}

// The header length the first 8 bytes of a `file_size`-byte file claim, checked.
uint64_t HeaderLength(std::string_view head, uint64_t file_size, const std::string& where) {
  if (file_size < 8 || head.size() < 8) {
    Bad(where, "truncated: " + std::to_string(file_size) +
                   " bytes, shorter than the 8-byte header length");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(head[i]);
  if (n > kMaxSafetensorsHeaderBytes) {
    Bad(where, "header length " + std::to_string(n) + " exceeds the limit of " +
                   std::to_string(kMaxSafetensorsHeaderBytes) + " bytes");
  }
  if (n > file_size - 8) {
    Bad(where, "truncated: header length " + std::to_string(n) + " exceeds the " +
                   std::to_string(file_size - 8) + " bytes after it");
  }
  return n;
}

// The names __metadata__["dcp.blobs"] lists (a JSON list in a string), or none.
std::set<std::string> BlobNames(const Json& meta, const std::string& where) {
  std::set<std::string> names;
  auto it = meta.find(kBlobsKey);
  if (it == meta.end()) return names;
  const Json list =
      ParseBounded(it->get_ref<const std::string&>(), where, "__metadata__[\"dcp.blobs\"]");
  if (!list.is_array()) Bad(where, "__metadata__[\"dcp.blobs\"] is not a JSON list");
  for (const auto& n : list) {
    if (!n.is_string()) Bad(where, "__metadata__[\"dcp.blobs\"] lists a non-string");
    names.insert(n.get<std::string>());
  }
  return names;
}

class SafetensorsFileViewImpl : public ForwardingStore {
 public:
  SafetensorsFileViewImpl(std::shared_ptr<Store> dir, std::string name)
      : ForwardingStore(std::move(dir)), name_(std::move(name)) {}

  const std::string& name() const { return name_; }

  void CreateRoot() override {}
  std::unique_ptr<WritableObject> Create(const std::string& name) override { Refuse(name); }
  std::unique_ptr<ReadableObject> Open(const std::string& name) override {
    if (name != name_) {
      throw NotFoundError("'" + uri() + "/" + name + "' does not exist (the URI names " + name_ +
                          " only)");
    }
    return target_->Open(name);
  }
  std::optional<uint64_t> Size(const std::string& name) override {
    if (name != name_) return std::nullopt;
    return target_->Size(name);
  }
  void PublishAtomically(const std::string& name, std::string_view) override { Refuse(name); }
  std::vector<std::string> List() override {
    if (target_->Size(name_)) return {name_};
    return {};
  }
  void Remove(const std::string& name) override { Refuse(name); }
  std::unique_ptr<StoreLock> TryLock(const std::string&) override { return nullptr; }
  void PublishNew(const std::string& name, std::string_view) override { Refuse(name); }
  std::optional<uint64_t> SizeAndVersion(const std::string& name, std::string* version) override {
    if (version != nullptr) version->clear();
    if (name != name_) return std::nullopt;
    return target_->SizeAndVersion(name, version);
  }
  void PublishReplacing(const std::string& name, std::string_view, const std::string&) override {
    Refuse(name);
  }

 private:
  [[noreturn]] void Refuse(const std::string& name) const {
    throw UnsupportedError("cannot write '" + name + "' through '" + uri() + "/" + name_ +
                           "': a URI naming a safetensors file is read-only");
  }
  std::string name_;
};

// The header of `file` in `store`: its first 8 + N bytes (bounded before anything is allocated).
std::string ReadHead(Store& store, const std::string& file, uint64_t* file_size) {
  const std::string where = store.uri() + "/" + file;
  auto in = store.Open(file);
  *file_size = in->size();
  std::string head(std::min<uint64_t>(*file_size, 8), '\0');
  in->ReadAt(0, head.data(), head.size());
  const uint64_t n = HeaderLength(head, *file_size, where);
  head.resize(8 + n);
  in->ReadAt(8, head.data() + 8, n);
  return head;
}

void AddFile(Store& store, const std::string& file, Metadata& md) {
  uint64_t size = 0;
  const std::string head = ReadHead(store, file, &size);
  AddSafetensorsFile(head, size, file, store.uri() + "/" + file, md);
}

// The file names an index's weight_map maps tensors to, checked, and the map itself.
std::map<std::string, std::string> ReadIndex(Store& store, const std::string& where,
                                             std::string* save_id) {
  const std::optional<uint64_t> size = store.Size(kSafetensorsIndexName);
  if (!size) throw NotFoundError("'" + where + "' does not exist");
  if (*size > kMaxSafetensorsHeaderBytes) {
    throw CorruptionError("safetensors index '" + where + "' has " + std::to_string(*size) +
                          " bytes, over the limit of " +
                          std::to_string(kMaxSafetensorsHeaderBytes));
  }
  const Json index = ParseBounded(store.ReadAll(kSafetensorsIndexName), where, "the index");
  auto bad = [&](const std::string& what) -> CorruptionError {
    return CorruptionError("safetensors index '" + where + "': " + what);
  };
  if (!index.is_object()) throw bad("not a JSON object");
  if (auto meta = index.find("metadata"); meta != index.end() && meta->is_object()) {
    auto id = meta->find(kSaveIdKey);
    if (id != meta->end() && id->is_string() && id->get_ref<const std::string&>().size() <= 64) {
      *save_id = id->get<std::string>();
    }
  }
  auto wm = index.find("weight_map");
  if (wm == index.end() || !wm->is_object()) throw bad("no \"weight_map\" object");
  std::map<std::string, std::string> map;
  for (const auto& [name, file] : wm->items()) {
    if (!file.is_string()) throw bad("tensor " + ClippedName(name) + " maps to a non-string");
    const std::string& f = file.get_ref<const std::string&>();
    // Names relative to the checkpoint, never outside it (the index is untrusted).
    if (f.empty() || f == "." || f.find('/') != std::string::npos ||
        f.find('\\') != std::string::npos || f.find("..") != std::string::npos ||
        f.find('\0') != std::string::npos) {
      throw bad("tensor " + ClippedName(name) + " maps to " + ClippedName(f) +
                ", which is not a plain file name in the checkpoint");
    }
    map.emplace(name, f);
  }
  return map;
}

const SafetensorsFileViewImpl* AsFileView(Store& store) {
  return dynamic_cast<const SafetensorsFileViewImpl*>(&store);
}

class SafetensorsLayoutImpl : public CheckpointLayout {
 public:
  CheckpointFormat format() const override { return CheckpointFormat::kSafetensors; }
  std::string_view display_name() const override { return "safetensors"; }
  const std::string& metadata_name() const override { return name_; }
  bool Detect(Store& store) const override {
    if (AsFileView(store) != nullptr) return true;
    // Both commit markers asked together: on an object store each question is a round trip.
    const std::string names[2] = {kSafetensorsIndexName, kSafetensorsSingleName};
    char found[2] = {0, 0};
    ParallelFor(
        2, [&](size_t i) { found[i] = store.Size(names[i]).has_value(); }, 2);
    return found[0] || found[1];
  }
  // Checked by the protocol's constructor (store_writer.cc), before anything is written.
  void CheckWriteOptions(const StorageOptions& options, const std::string& uri) const override {
    if (options.compression != Compression::kNone) {
      throw InvalidArgumentError("compression cannot be used for a safetensors checkpoint at " +
                                 uri + " (the format stores raw tensors only)");
    }
  }
  // The data path is safetensors_writer.cc's (whole tensors assembled across ranks): the
  // protocol's per-rank files and item encoders are never used for this layout.
  std::string FilePrefix(const std::string&, size_t) const override { Unreachable(); }
  std::string DataFileName(const std::string&, size_t) const override { Unreachable(); }
  // Only names a dcp save creates (they carry its save id): a Hub download's
  // model-00001-of-00002.safetensors is never dcp's to remove.
  bool IsDataFile(const std::string& name) const override { return IsSafetensorsDataName(name); }
  // The index: the Hub's {"metadata": {"total_size"}, "weight_map"}, plus the save id.
  std::string EncodeMetadata(const Metadata& md, const std::string&) const override {
    Json weight_map = Json::object();
    uint64_t total = 0;
    for (const auto& [index, info] : md.storage) {
      weight_map[index.fqn] = info.relative_path;
      total += info.length;
    }
    Json index = {{"metadata", {{"total_size", total}, {kSaveIdKey, md.save_id}}},
                  {"weight_map", weight_map}};
    return index.dump(2) + "\n";
  }
  Metadata ReadMetadata(Store& store, std::string* encoded) const override {
    if (encoded) encoded->clear();
    return ReadSafetensorsMetadata(store);
  }
  std::unique_ptr<ItemEncoder> NewItemEncoder(const StorageOptions&) const override {
    Unreachable();
  }

 private:
  [[noreturn]] static void Unreachable() {
    throw InternalError(
        "the safetensors layout has no per-rank data files (its writer is "
        "safetensors_writer.cc)");
  }
  const std::string name_ = kSafetensorsIndexName;
};

}  // namespace

std::optional<std::string> SafetensorsDTypeName(DType d) {
  switch (d) {
    case DType::kBool:
      return "BOOL";
    case DType::kUInt8:
      return "U8";
    case DType::kInt8:
      return "I8";
    case DType::kInt16:
      return "I16";
    case DType::kUInt16:
      return "U16";
    case DType::kInt32:
      return "I32";
    case DType::kUInt32:
      return "U32";
    case DType::kInt64:
      return "I64";
    case DType::kUInt64:
      return "U64";
    case DType::kFloat16:
      return "F16";
    case DType::kBFloat16:
      return "BF16";
    case DType::kFloat32:
      return "F32";
    case DType::kFloat64:
      return "F64";
    case DType::kComplex64:
      return "C64";
    case DType::kFloat8_e4m3fn:
      return "F8_E4M3";
    case DType::kFloat8_e5m2:
      return "F8_E5M2";
    case DType::kFloat8_e8m0fnu:
      return "F8_E8M0";
    default:
      return std::nullopt;
  }
}

std::optional<DType> DTypeFromSafetensorsName(std::string_view name) {
  for (DType d : AllDTypes()) {
    if (SafetensorsDTypeName(d) == name) return d;
  }
  return std::nullopt;
}

bool IsSafetensorsName(std::string_view name) {
  constexpr std::string_view ext = ".safetensors";
  return name.size() > ext.size() && name.substr(name.size() - ext.size()) == ext;
}

void AddSafetensorsFile(std::string_view head, uint64_t file_size, const std::string& file,
                        const std::string& where, Metadata& md) {
  const uint64_t n = HeaderLength(head, file_size, where);
  if (head.size() < 8 + n) Bad(where, "truncated header");
  const uint64_t data_begin = 8 + n, data_size = file_size - data_begin;
  const Json header = ParseBounded(head.substr(8, n), where, "the header");
  if (!header.is_object()) Bad(where, "the header is not a JSON object");
  std::set<std::string> blobs;
  if (auto meta = header.find("__metadata__"); meta != header.end()) {
    if (!meta->is_object()) Bad(where, "__metadata__ is not a JSON object");
    for (const auto& [key, value] : meta->items()) {
      if (!value.is_string()) {
        Bad(where, "__metadata__ entry " + ClippedName(key) + " is not a string");
      }
    }
    blobs = BlobNames(*meta, where);
  }
  std::vector<std::pair<std::pair<uint64_t, uint64_t>, const std::string*>> ranges;
  for (const auto& [name, spec] : header.items()) {
    if (name == "__metadata__") continue;
    const std::string what = "tensor " + ClippedName(name);
    auto fail = [&](const std::string& why) { Bad(where, what + ": " + why); };
    if (!spec.is_object()) fail("not a JSON object");
    auto dt = spec.find("dtype");
    auto sh = spec.find("shape");
    auto off = spec.find("data_offsets");
    if (dt == spec.end() || !dt->is_string()) fail("no \"dtype\" string");
    if (sh == spec.end() || !sh->is_array()) fail("no \"shape\" list");
    if (off == spec.end() || !off->is_array() || off->size() != 2) {
      fail("no \"data_offsets\" pair");
    }
    const std::string& dtype_name = dt->get_ref<const std::string&>();
    const std::optional<DType> dtype = DTypeFromSafetensorsName(dtype_name);
    if (!dtype) {
      throw UnsupportedError("safetensors file '" + where + "': " + what + " has dtype " +
                             ClippedName(dtype_name) + ", which dcp does not support");
    }
    Shape shape;
    for (const auto& d : *sh) {
      const std::optional<uint64_t> v = Unsigned(d);
      if (!v || *v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        fail("shape " + sh->dump() + " has a dimension that is not a non-negative int64");
      }
      shape.push_back(static_cast<int64_t>(*v));
    }
    int64_t numel = 0;
    try {
      numel = NumElements(shape);
    } catch (const InvalidArgumentError&) {
      fail("shape " + ShapeToString(shape) + " has more elements than int64 holds");
    }
    const uint64_t esize = ElementSize(*dtype);
    if (static_cast<uint64_t>(numel) > std::numeric_limits<uint64_t>::max() / esize) {
      fail("shape " + ShapeToString(shape) + " is too large");
    }
    const uint64_t bytes = static_cast<uint64_t>(numel) * esize;
    const std::optional<uint64_t> begin = Unsigned((*off)[0]), end = Unsigned((*off)[1]);
    if (!begin || !end || *begin > *end) fail("data_offsets " + off->dump() + " are not a range");
    if (*end > data_size) {
      fail("data_offsets " + off->dump() + " reach past the file's " + std::to_string(data_size) +
           " data bytes");
    }
    if (*end - *begin != bytes) {
      fail("data_offsets " + off->dump() + " hold " + std::to_string(*end - *begin) +
           " bytes, its dtype " + dtype_name + " and shape " + ShapeToString(shape) + " need " +
           std::to_string(bytes));
    }
    if (auto it = md.entries.find(name); it != md.entries.end()) {
      auto s = md.storage.lower_bound(MetadataIndex{name, {}, {}});
      fail("is also in '" +
           (s != md.storage.end() && s->first.fqn == name ? s->second.relative_path : "?") + "'");
    }
    StorageInfo info;
    info.relative_path = file;
    info.offset = data_begin + *begin;
    info.length = bytes;
    info.raw_length = bytes;
    if (blobs.count(name) && *dtype == DType::kUInt8 && shape.size() == 1) {
      md.entries.emplace(name, BytesMetadata{});
      md.storage.emplace(MetadataIndex{name, {}, {}}, std::move(info));
    } else {
      const Shape zeros(shape.size(), 0);
      md.entries.emplace(name, TensorMetadata{*dtype, shape, {ChunkMeta{zeros, shape}}});
      md.storage.emplace(MetadataIndex{name, zeros, 0}, std::move(info));
    }
    if (bytes > 0) ranges.push_back({{*begin, *end}, &name});
  }
  // The format forbids overlapping tensors; a reader would only read the same bytes twice, but
  // a header that claims it is not one a safetensors writer made.
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first.first < ranges[i - 1].first.second) {
      Bad(where, "tensor " + ClippedName(*ranges[i - 1].second) + " overlaps tensor " +
                     ClippedName(*ranges[i].second));
    }
  }
}

Metadata ReadSafetensorsMetadata(Store& store) {
  Metadata md;
  md.format_version = 1;  // items listed in `storage`, as in version 1
  md.library_version = "safetensors";
  std::string source;
  std::set<std::string> files;
  if (const SafetensorsFileViewImpl* view = AsFileView(store)) {
    source = store.uri() + "/" + view->name();
    AddFile(store, view->name(), md);
    files.insert(view->name());
  } else if (store.Size(kSafetensorsIndexName)) {
    source = store.uri() + "/" + kSafetensorsIndexName;
    const std::map<std::string, std::string> map = ReadIndex(store, source, &md.save_id);
    for (const auto& [name, file] : map) files.insert(file);
    for (const std::string& file : files) {
      if (!store.Size(file)) {
        throw NotFoundError("data file '" + store.uri() + "/" + file + "' is missing: " + source +
                            " maps tensors to it");
      }
      AddFile(store, file, md);
    }
    for (const auto& [name, file] : map) {
      auto it = md.storage.lower_bound(MetadataIndex{name, {}, {}});
      if (it == md.storage.end() || it->first.fqn != name) {
        throw CorruptionError("safetensors index '" + source + "' maps tensor " +
                              ClippedName(name) + " to '" + file +
                              "', whose header does not have it");
      }
      if (it->second.relative_path != file) {
        throw CorruptionError("safetensors index '" + source + "' maps tensor " +
                              ClippedName(name) + " to '" + file + "', but it is in '" +
                              it->second.relative_path + "'");
      }
    }
  } else if (store.Size(kSafetensorsSingleName)) {
    source = store.uri() + "/" + kSafetensorsSingleName;
    AddFile(store, kSafetensorsSingleName, md);
    files.insert(kSafetensorsSingleName);
  } else {
    throw NotFoundError("no safetensors checkpoint at " + store.uri() + " (neither " +
                        kSafetensorsIndexName + " nor " + kSafetensorsSingleName + ")");
  }
  md.world_size = static_cast<int32_t>(std::max<size_t>(files.size(), 1));
  ValidateMetadata(md, source);
  return md;
}

std::shared_ptr<Store> SafetensorsFileView(std::shared_ptr<Store> dir, const std::string& name) {
  return std::make_shared<SafetensorsFileViewImpl>(std::move(dir), name);
}

const CheckpointLayout& SafetensorsLayout() {
  static const SafetensorsLayoutImpl layout;
  return layout;
}

}  // namespace dcp
