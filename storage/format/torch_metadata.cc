// PyTorch DCP's `.metadata` pickle (see torch_dcp.h): decoded into dcp's Metadata through the
// restricted unpickler, and encoded from it as torch 2.x or 1.13 writes it.
#include <algorithm>
#include <charconv>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "dcp/proto/error.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/storage/format/pickle.h"
#include "dcp/storage/format/torch_dcp.h"
#include "dcp/storage/format/torch_internal.h"

namespace dcp {
namespace {

using namespace torch_internal;

constexpr char kMeta2[] = "torch.distributed.checkpoint.metadata";
constexpr char kMeta1[] = "torch.distributed._shard.checkpoint.metadata";
constexpr char kFs2[] = "torch.distributed.checkpoint.filesystem";
constexpr char kFs1[] = "torch.distributed._shard.checkpoint.filesystem";
constexpr char kSharded1[] = "torch.distributed._shard.sharded_tensor.metadata";

bool AllowMetadataGlobal(std::string_view module, std::string_view name) {
  if (module == kMeta2 || module == kMeta1) {
    static const std::set<std::string, std::less<>> names = {
        "Metadata",      "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
        "MetadataIndex", "TensorProperties",      "_MEM_FORMAT_ENCODING", "MEM_FORMAT_ENCODING",
        "StorageMeta"};
    return names.count(name) > 0;
  }
  if (module == kSharded1) {
    return name == "TensorProperties" || name == "MEM_FORMAT_ENCODING";
  }
  if (module == kFs2 || module == kFs1) return name == "_StorageInfo";
  if (module == "torch") return name == "Size" || IsTorchDType(name);
  if (module == "torch.serialization") return name == "_get_layout";
  if (module == "builtins") return name == "getattr";
  if (module == "pathlib") return name == "PosixPath" || name == "PurePosixPath";
  if (module == "collections") return name == "OrderedDict";
  return false;
}

ValuePtr SizeValue(const Shape& s) {
  std::vector<ValuePtr> items;
  for (int64_t v : s) items.push_back(pickle::Int(v));
  return pickle::Object(pickle::Global("torch", "Size"), {pickle::Tuple(std::move(items))});
}

// The bytes of each chunk of each tensor entry: fqn -> chunk offsets -> bytes.
using ChunkBytes = std::map<std::string, std::map<Shape, int64_t>>;

// The dtype in a TensorStorageMetadata's TensorProperties (a tuple of fields, or a dict).
DType PropertiesDType(const Reader& r, const Value& ts, const std::string& what) {
  const Value* props = ts.Get("properties");
  if (!props || props->kind != Kind::kObject ||
      Reader::Leaf(props->global_name()) != "TensorProperties" || !props->state) {
    r.Fail(what + " has no TensorProperties");
  }
  const Value* dtype = props->state->kind == Kind::kTuple && !props->state->items.empty()
                           ? props->state->items[0].get()
                           : props->state->Get("dtype");
  return r.DTypeOf(dtype, what + " dtype");
}

// The bytes a chunk of `dtype` holds, refused when absurd.
int64_t CheckedChunkBytes(const Reader& r, DType dtype, const ChunkMeta& chunk,
                          const std::string& what) {
  uint64_t n = ElementSize(dtype);
  for (int64_t s : chunk.sizes) {
    if (s < 0 || (s > 0 && n > (uint64_t{1} << 62) / static_cast<uint64_t>(s))) {
      r.Fail(what + " chunk " + chunk.ToString() + " has an absurd size");
    }
    n *= static_cast<uint64_t>(s);
  }
  return static_cast<int64_t>(n);
}

// A TensorStorageMetadata; the bytes of each of its chunks go to `chunk_bytes`, by offsets.
TensorMetadata ReadTensorEntry(const Reader& r, const Value* v, const std::string& what,
                               std::map<Shape, int64_t>& chunk_bytes) {
  const Value& ts = r.State(v, "TensorStorageMetadata", what);
  TensorMetadata tm;
  tm.dtype = PropertiesDType(r, ts, what);
  tm.shape = r.Ints(ts.Get("size"), what + " size");
  const Value* chunks = ts.Get("chunks");
  if (!chunks || chunks->kind != Kind::kList) r.Fail(what + " has no chunk list");
  for (const auto& c : chunks->items) {
    const Value& cs = r.State(c.get(), "ChunkStorageMetadata", what + " chunk");
    ChunkMeta chunk{r.Ints(cs.Get("offsets"), what + " chunk offsets"),
                    r.Ints(cs.Get("sizes"), what + " chunk sizes")};
    chunk_bytes[chunk.offsets] = CheckedChunkBytes(r, tm.dtype, chunk, what);
    tm.chunks.push_back(std::move(chunk));
  }
  return tm;
}

// state_dict_metadata: every entry, tensor or bytes.
void ReadStateDictMetadata(const Reader& r, const Value& st, Metadata& md,
                           ChunkBytes& chunk_bytes) {
  const Value* sdm = st.Get("state_dict_metadata");
  if (!sdm || sdm->kind != Kind::kDict) r.Fail("state_dict_metadata is missing or not a dict");
  for (size_t i = 0; i + 1 < sdm->items.size(); i += 2) {
    const std::string& fqn = r.Str(sdm->items[i].get(), "a state_dict_metadata key");
    const Value* v = sdm->items[i + 1].get();
    const std::string what = "entry '" + fqn + "'";
    if (v->kind == Kind::kObject && Reader::Leaf(v->global_name()) == "BytesStorageMetadata") {
      md.entries[fqn] = BytesMetadata{};
      continue;
    }
    md.entries[fqn] = ReadTensorEntry(r, v, what, chunk_bytes[fqn]);
  }
}

// A storage_data key: a MetadataIndex (fqn, and chunk offset for a tensor).
MetadataIndex ReadMetadataIndex(const Reader& r, const Value* key) {
  const Value& is = r.State(key, "MetadataIndex", "a storage_data key");
  MetadataIndex index;
  index.fqn = r.Str(is.Get("fqn"), "a MetadataIndex fqn");
  const Value* off = is.Get("offset");
  if (off && off->kind != Kind::kNone) index.offset = r.Ints(off, "MetadataIndex offset");
  return index;
}

// A _StorageInfo: where a record lies. Any field but those three, when set, is a transform
// dcp cannot read.
StorageInfo ReadStorageInfo(const Reader& r, const Value& ss, const std::string& what,
                            std::string_view source) {
  for (size_t k = 0; k + 1 < ss.items.size(); k += 2) {
    const std::string& key = r.Str(ss.items[k].get(), what + " field");
    const Value* val = ss.items[k + 1].get();
    const bool empty =
        val->kind == Kind::kNone ||
        ((val->kind == Kind::kList || val->kind == Kind::kTuple) && val->items.empty());
    if (key != "relative_path" && key != "offset" && key != "length" && !empty) {
      throw UnsupportedError(std::string(source) + ": " + what + " has '" + key +
                             "' (a storage transform such as compression), which dcp cannot "
                             "read yet");
    }
  }
  StorageInfo info;
  info.relative_path = r.Str(ss.Get("relative_path"), what + " relative_path");
  const int64_t offset = r.Int(ss.Get("offset"), what + " offset");
  const int64_t length = r.Int(ss.Get("length"), what + " length");
  if (offset < 0 || length < 0) r.Fail(what + " has a negative offset or length");
  info.offset = static_cast<uint64_t>(offset);
  info.length = static_cast<uint64_t>(length);
  return info;
}

// storage_data: every stored item, a torch.save record of its entry.
void ReadStorageData(const Reader& r, const Value& st, std::string_view source,
                     ChunkBytes& chunk_bytes, Metadata& md) {
  const Value* sd = st.Get("storage_data");
  if (!sd || sd->kind != Kind::kDict) r.Fail("storage_data is missing or not a dict");
  for (size_t i = 0; i + 1 < sd->items.size(); i += 2) {
    const MetadataIndex index = ReadMetadataIndex(r, sd->items[i].get());
    const std::string what = "stored item " + index.ToString();
    StorageInfo info =
        ReadStorageInfo(r, r.State(sd->items[i + 1].get(), "_StorageInfo", what), what, source);
    auto entry = md.entries.find(index.fqn);
    if (entry == md.entries.end()) r.Fail(what + " belongs to no entry of state_dict_metadata");
    info.transforms = {kTorchSaveTransform};
    if (std::holds_alternative<TensorMetadata>(entry->second)) {
      auto c = chunk_bytes[index.fqn].find(index.offset);
      if (c == chunk_bytes[index.fqn].end()) r.Fail(what + " matches no chunk of its tensor");
      info.raw_length = static_cast<uint64_t>(c->second);
    } else {
      info.raw_length = info.length;  // at most: the payload a record may unwrap to
    }
    if (!md.storage.emplace(index, std::move(info)).second) r.Fail(what + " is listed twice");
  }
}

// planner_data: the key path of each entry, where DefaultSavePlanner recorded one.
void ReadPlannerData(const Reader& r, const Value& st, Metadata& md) {
  const Value* pd = st.Get("planner_data");
  if (!pd || pd->kind != Kind::kDict) return;
  for (size_t i = 0; i + 1 < pd->items.size(); i += 2) {
    const Value* key = pd->items[i].get();
    const Value* path = pd->items[i + 1].get();
    if (key->kind != Kind::kStr || !md.entries.count(key->str) ||
        (path->kind != Kind::kTuple && path->kind != Kind::kList)) {
      continue;  // planner data of another planner: not ours to judge
    }
    // Every key copied out is charged: one memoised long string referenced by many paths
    // must not cost gigabytes (nor name itself in full in an error message).
    KeyPath kp;
    for (const auto& p : path->items) {
      if (p->kind == Kind::kStr) {
        kp.push_back(r.Str(p.get(), "a planner_data key path"));
      } else if (p->kind == Kind::kInt) {
        r.Charge(sizeof(int64_t), "a planner_data key path");
        kp.push_back(std::to_string(p->integer));
      } else {
        r.Fail("planner_data of '" + key->str.substr(0, 256) + "' holds a " + p->Describe());
      }
    }
    if (kp.size() > 1) md.key_paths[key->str] = std::move(kp);
  }
}

// The number of data files (at least 1), which stands for the world size.
// torch records no world size; its writer names data files "__<rank>_<n>.distcp", so the
// highest rank named plus one is what the files show (a rank that wrote nothing leaves no
// trace). Files named otherwise count one rank each.
int32_t WorldSizeFromFileNames(const Metadata& md) {
  std::set<std::string> files;
  for (const auto& [index, info] : md.storage) files.insert(info.relative_path);
  int64_t ranks = 0;
  for (const std::string& name : files) {
    int64_t rank = -1;
    if (name.rfind("__", 0) == 0) {
      const char* begin = name.data() + 2;
      const char* end = name.data() + name.size();
      auto [next, ec] = std::from_chars(begin, end, rank);
      if (ec != std::errc() || next == end || *next != '_' || rank < 0 || rank >= (1 << 24)) {
        rank = -1;
      }
    }
    if (rank < 0) return static_cast<int32_t>(std::max<size_t>(files.size(), 1));
    ranks = std::max(ranks, rank + 1);
  }
  return static_cast<int32_t>(std::max<int64_t>(ranks, 1));
}

// storage_meta: the save and checkpoint ids, when present.
void ReadStorageMeta(const Reader& r, const Value& st, Metadata& md) {
  const Value* meta = st.Get("storage_meta");
  if (!meta || meta->kind != Kind::kObject) return;
  const Value& ms = r.State(meta, "StorageMeta", "storage_meta");
  if (const Value* id = ms.Get("save_id"); id && id->kind == Kind::kStr) md.save_id = id->str;
  if (const Value* id = ms.Get("checkpoint_id"); id && id->kind == Kind::kStr) {
    md.checkpoint_id = id->str;
  }
}

// Which torch wrote the metadata: its module, and the version field of torch 2.
std::string LibraryVersion(const Value& root, const Value& st) {
  const Value* version = st.Get("version");
  return root.global_name().rfind(kMeta1, 0) == 0
             ? "torch.distributed._shard.checkpoint (torch 1.13)"
             : "torch.distributed.checkpoint " +
                   (version && version->kind == Kind::kStr ? version->str : std::string("?"));
}

}  // namespace

Metadata DecodeTorchDcpMetadata(std::string_view bytes, std::string_view source) {
  const Reader r{std::string(source), bytes.size()};
  pickle::Limits limits;
  limits.max_input_bytes = size_t{2} << 30;
  // The decoder charges what it copies out of shared values (Reader::Charge, naming the field).
  limits.max_tree_values = limits.max_tree_bytes = SIZE_MAX;
  const ValuePtr root = pickle::Load(bytes, AllowMetadataGlobal, source, limits);
  const Value& st = r.State(root.get(), "Metadata", "the metadata");
  Metadata md;
  md.format_version = 1;  // items listed in `storage`, as in version 1
  ChunkBytes chunk_bytes;
  ReadStateDictMetadata(r, st, md, chunk_bytes);
  ReadStorageData(r, st, source, chunk_bytes, md);
  ReadPlannerData(r, st, md);
  md.world_size = WorldSizeFromFileNames(md);
  ReadStorageMeta(r, st, md);
  md.library_version = LibraryVersion(*root, st);
  ValidateMetadata(md, source);
  return md;
}

namespace {

// torch's flatten_state_dict records list positions (param_groups' 0, 1...) as ints and
// dcp's key paths are strings: a canonical decimal element goes out as the int torch wrote
// (so dcp_to_torch_save rebuilds a list, not a dict keyed '0'). A dict key that is a string of
// digits therefore becomes an int too.
ValuePtr KeyPathElement(const std::string& element) {
  const bool canonical = !element.empty() && element.size() <= 18 &&
                         element.find_first_not_of("0123456789") == std::string::npos &&
                         (element.size() == 1 || element[0] != '0');
  return canonical ? pickle::Int(std::stoll(element)) : pickle::Str(element);
}

}  // namespace

std::string EncodeTorchDcpMetadata(const Metadata& md, TorchDcpFlavor flavor,
                                   const std::string& checkpoint_id) {
  using namespace pickle;
  const bool t2 = flavor == TorchDcpFlavor::kTorch2;
  const std::string meta_mod = t2 ? kMeta2 : kMeta1;
  const std::string props_mod = t2 ? kMeta2 : kSharded1;
  auto dataclass = [&](const std::string& mod, const std::string& cls, ValuePtr state) {
    return Object(Global(mod, cls), {}, std::move(state), /*newobj=*/true);
  };
  auto str = [](const std::string& s) { return Str(s); };
  std::vector<std::pair<ValuePtr, ValuePtr>> sdm;
  for (const auto& [fqn, entry] : md.entries) {
    if (std::holds_alternative<BytesMetadata>(entry)) {
      sdm.emplace_back(str(fqn), dataclass(meta_mod, "BytesStorageMetadata", nullptr));
      continue;
    }
    const TensorMetadata tm = WithListedChunks(std::get<TensorMetadata>(entry));
    ValuePtr mem_format =
        t2 ? Object(Global(meta_mod, "_MEM_FORMAT_ENCODING"), {Int(0)})
           : Object(Global("builtins", "getattr"),
                    {Global(kSharded1, "MEM_FORMAT_ENCODING"), Str("TORCH_CONTIGUOUS_FORMAT")});
    ValuePtr props = dataclass(
        props_mod, "TensorProperties",
        Tuple({Global("torch", std::string(DTypeName(tm.dtype))),
               Object(Global("torch.serialization", "_get_layout"), {Str("torch.strided")}),
               Bool(false), mem_format, Bool(false)}));
    std::vector<ValuePtr> chunks;
    for (const auto& c : tm.chunks) {
      chunks.push_back(dataclass(
          meta_mod, "ChunkStorageMetadata",
          Dict({{str("offsets"), SizeValue(c.offsets)}, {str("sizes"), SizeValue(c.sizes)}})));
    }
    sdm.emplace_back(str(fqn), dataclass(meta_mod, "TensorStorageMetadata",
                                         Dict({{str("properties"), props},
                                               {str("size"), SizeValue(tm.shape)},
                                               {str("chunks"), List(std::move(chunks))}})));
  }
  std::vector<std::pair<ValuePtr, ValuePtr>> storage;
  for (const auto& [index, info] : md.storage) {
    const bool tensor =
        !index.offset.empty() || std::holds_alternative<TensorMetadata>(md.entries.at(index.fqn));
    int64_t chunk_index = 0;
    if (tensor) {
      const auto& t = std::get<TensorMetadata>(md.entries.at(index.fqn));
      if (auto k = ChunkOrdinal(t, index.offset, index.index))
        chunk_index = static_cast<int64_t>(*k);
    }
    ValuePtr key = dataclass(meta_mod, "MetadataIndex",
                             Dict({{str("fqn"), str(index.fqn)},
                                   {str("offset"), tensor ? SizeValue(index.offset) : None()},
                                   {str("index"), tensor ? Int(chunk_index) : None()}}));
    ValuePtr value = dataclass(t2 ? kFs2 : kFs1, "_StorageInfo",
                               Dict({{str("relative_path"), str(info.relative_path)},
                                     {str("offset"), Int(static_cast<int64_t>(info.offset))},
                                     {str("length"), Int(static_cast<int64_t>(info.length))}}));
    storage.emplace_back(std::move(key), std::move(value));
  }
  std::vector<std::pair<ValuePtr, ValuePtr>> fields;
  fields.emplace_back(str("state_dict_metadata"), Dict(std::move(sdm)));
  if (t2) {
    // DefaultSavePlanner's planner_data: every fqn's key path (its own name when flat).
    std::vector<std::pair<ValuePtr, ValuePtr>> pd;
    for (const auto& [fqn, entry] : md.entries) {
      (void)entry;
      std::vector<ValuePtr> path;
      auto kp = md.key_paths.find(fqn);
      if (kp != md.key_paths.end()) {
        for (const auto& p : kp->second) path.push_back(KeyPathElement(p));
      } else {
        path.push_back(str(fqn));
      }
      pd.emplace_back(str(fqn), Tuple(std::move(path)));
    }
    fields.emplace_back(str("planner_data"), Dict(std::move(pd)));
  } else {
    fields.emplace_back(str("planner_data"), None());
  }
  fields.emplace_back(str("storage_data"), Dict(std::move(storage)));
  if (t2) {
    fields.emplace_back(str("storage_meta"),
                        dataclass(meta_mod, "StorageMeta",
                                  Dict({{str("checkpoint_id"), str(checkpoint_id)},
                                        {str("save_id"), str(md.save_id)},
                                        {str("load_id"), None()},
                                        {str("modules"), List({})}})));
    fields.emplace_back(str("version"), str("1.0.0"));
  }
  return Dump(*dataclass(meta_mod, "Metadata", Dict(std::move(fields))));
}

}  // namespace dcp
