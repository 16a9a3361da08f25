// torch.save records of PyTorch DCP (see torch_dcp.h): tensor records located and checked,
// byte entries wrapped and unwrapped, tensor records written.
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "dcp/proto/checksum.h"
#include "dcp/proto/device/device.h"
#include "dcp/proto/error.h"
#include "dcp/storage/format/pickle.h"
#include "dcp/storage/format/torch_dcp.h"
#include "dcp/storage/format/torch_internal.h"
#include "dcp/storage/format/torch_zip.h"

namespace dcp {
namespace torch_internal {

// Storage classes of torch.save's typed storages (_rebuild_tensor_v2).
const std::map<std::string, DType, std::less<>>& StorageClasses() {
  static const std::map<std::string, DType, std::less<>> m = {
      {"FloatStorage", DType::kFloat32},
      {"DoubleStorage", DType::kFloat64},
      {"HalfStorage", DType::kFloat16},
      {"BFloat16Storage", DType::kBFloat16},
      {"LongStorage", DType::kInt64},
      {"IntStorage", DType::kInt32},
      {"ShortStorage", DType::kInt16},
      {"CharStorage", DType::kInt8},
      {"ByteStorage", DType::kUInt8},
      {"BoolStorage", DType::kBool},
      {"ComplexFloatStorage", DType::kComplex64},
      {"ComplexDoubleStorage", DType::kComplex128},
  };
  return m;
}

bool IsTorchDType(std::string_view name) { return DTypeFromName(name).has_value(); }

bool AllowTensorGlobal(std::string_view module, std::string_view name) {
  if (module == "torch._utils") return name == "_rebuild_tensor_v2" || name == "_rebuild_tensor_v3";
  if (module == "torch") return StorageClasses().count(name) > 0 || IsTorchDType(name);
  if (module == "torch.storage") return name == "UntypedStorage";
  if (module == "collections") return name == "OrderedDict";
  return false;
}

// Limits for a pickle of `size` bytes from a torch.save archive: besides the input, the tree its
// shared references expand to (pickle::Limits) is bounded by a multiple of the pickle, so what
// walks it (the state dict walk, Dump of a leaf) costs time and memory in proportion to the file.
// An honest pickle takes a byte or more per value; sharing (a memoised string) is modest.
pickle::Limits DocumentLimits(size_t size, size_t max_input_bytes) {
  pickle::Limits limits;
  limits.max_input_bytes = max_input_bytes;
  limits.max_tree_values = 2 * size + (size_t{1} << 16);
  limits.max_tree_bytes = 16 * size + (size_t{16} << 20);
  return limits;
}

// A record written on a big-endian machine cannot be read as is.
void CheckByteOrder(Archive& zip, const std::string& prefix, const std::string& what) {
  if (!zip.Find(prefix + "byteorder")) return;
  const std::string order = zip.ReadSmall(prefix + "byteorder", 16);
  if (order != "little") {
    throw UnsupportedError(what + " was written on a '" + order + "'-endian machine");
  }
}

// The tensor's pickle, _rebuild_tensor_v2 or _v3(storage, storage_offset, size, stride, ...):
// its dtype, offset, sizes and strides into rec; returns the storage it references.
StorageRef ReadRebuildCall(const Reader& r, const Value& root, TorchTensorRecord& rec) {
  const std::string fn = root.global_name();
  if (root.kind != Kind::kObject ||
      (fn != "torch._utils._rebuild_tensor_v2" && fn != "torch._utils._rebuild_tensor_v3")) {
    r.Fail("does not hold a plain tensor (its pickle is a " + root.Describe() + ")");
  }
  const auto& args = root.args->items;
  if (args.size() < 6) r.Fail("has a tensor pickle with too few arguments");
  const Value* pid = args[0].get();
  if (pid->kind != Kind::kPersistent || pid->items[0]->kind != Kind::kTuple ||
      pid->items[0]->items.size() != 5) {
    r.Fail("has a tensor pickle without a storage reference");
  }
  const auto& sref = pid->items[0]->items;  // ('storage', type, key, location, numel)
  if (sref[0]->kind != Kind::kStr || sref[0]->str != "storage" || sref[1]->kind != Kind::kGlobal) {
    r.Fail("has a malformed storage reference");
  }
  StorageRef ref;
  ref.untyped = sref[1]->name() == "UntypedStorage";
  if (fn == "torch._utils._rebuild_tensor_v3") {
    rec.dtype = r.DTypeOf(args.back().get(), "its dtype");
  } else {
    auto it = StorageClasses().find(sref[1]->name());
    if (ref.untyped || it == StorageClasses().end()) {
      r.Fail("has an untyped storage without dtype");
    }
    rec.dtype = it->second;
  }
  ref.key = r.Str(sref[2].get(), "its storage key");
  if (ref.key.empty() || ref.key.size() > 64 || ref.key.find('/') != std::string::npos) {
    r.Fail("has a bad storage key");
  }
  ref.numel = r.Int(sref[4].get(), "its storage size");
  rec.storage_offset = r.Int(args[1].get(), "its storage offset");
  rec.sizes = r.Ints(args[2].get(), "its size");
  rec.strides = r.Ints(args[3].get(), "its stride");
  return ref;
}

// The storage's zip entry: its size and CRC-32 into rec, checked against the pickle's numel.
void ReadStorageEntry(const Reader& r, const Archive& zip, const std::string& entry,
                      const StorageRef& ref, TorchTensorRecord& rec) {
  const ZipEntry* info = zip.Find(entry);
  if (!info) r.Fail("has no storage entry " + entry);
  const uint64_t esize = ElementSize(rec.dtype);
  rec.storage_bytes = info->size;
  rec.zip_crc32 = info->crc;
  const uint64_t numel = static_cast<uint64_t>(ref.numel);
  if (ref.numel < 0 ||
      (ref.untyped ? numel != rec.storage_bytes
                   : numel > rec.storage_bytes / esize || numel * esize != rec.storage_bytes)) {
    r.Fail("storage entry " + entry + " has " + std::to_string(rec.storage_bytes) +
           " bytes, its pickle claims " + std::to_string(ref.numel) +
           (ref.untyped ? " bytes" : " elements"));
  }
}

// Every element must lie inside the storage; sets rec.span_bytes. The numbers come from the
// file: every product and sum is checked, so no crafted size, stride or offset can wrap around
// to a small extent.
void CheckExtent(const Reader& r, TorchTensorRecord& rec) {
  if (rec.sizes.size() != rec.strides.size() || rec.storage_offset < 0) {
    r.Fail("has inconsistent sizes and strides");
  }
  const uint64_t esize = ElementSize(rec.dtype);
  bool empty = false;
  uint64_t last = static_cast<uint64_t>(rec.storage_offset);  // the last element viewed
  for (size_t d = 0; d < rec.sizes.size(); ++d) {
    if (rec.sizes[d] < 0 || rec.strides[d] < 0) r.Fail("has a negative size or stride");
    if (rec.sizes[d] == 0) empty = true;
    const uint64_t step = static_cast<uint64_t>(rec.sizes[d] > 0 ? rec.sizes[d] - 1 : 0);
    uint64_t reach = 0;
    if (__builtin_mul_overflow(step, static_cast<uint64_t>(rec.strides[d]), &reach) ||
        __builtin_add_overflow(last, reach, &last)) {
      r.Fail("has sizes and strides whose extent overflows");
    }
  }
  uint64_t end_bytes = 0;  // of the storage, one past the last element viewed
  if (__builtin_add_overflow(last, uint64_t{1}, &end_bytes) ||
      __builtin_mul_overflow(end_bytes, esize, &end_bytes)) {
    r.Fail("has a storage offset and strides whose extent overflows");
  }
  if (empty) {
    rec.span_bytes = 0;
    if (static_cast<uint64_t>(rec.storage_offset) > rec.storage_bytes / esize) {
      r.Fail("has a storage offset beyond its storage (" + std::to_string(rec.storage_bytes) +
             " bytes)");
    }
  } else {
    if (end_bytes > rec.storage_bytes) {
      r.Fail("views elements beyond its storage (" + std::to_string(rec.storage_bytes) + " bytes)");
    }
    rec.span_bytes = end_bytes - static_cast<uint64_t>(rec.storage_offset) * esize;
  }
}

// How Python pickles a bytes object: BINBYTES from protocol 3 on; protocol 2 (torch.save's)
// has no bytes opcode and writes _codecs.encode(<latin-1 text>, 'latin1'), or bytes() when
// empty.
bool AllowBytesGlobal(std::string_view module, std::string_view name) {
  return (module == "_codecs" && name == "encode") ||
         ((module == "__builtin__" || module == "builtins") && name == "bytes");
}

namespace {

// The Latin-1 bytes of UTF-8 text whose code points are all below 256.
std::optional<std::string> Latin1OfUtf8(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<uint8_t>(text[i]);
    if (c < 0x80) {
      out += static_cast<char>(c);
    } else if ((c == 0xC2 || c == 0xC3) && i + 1 < text.size() &&
               (static_cast<uint8_t>(text[i + 1]) & 0xC0) == 0x80) {
      out += static_cast<char>(((c & 0x03) << 6) | (static_cast<uint8_t>(text[++i]) & 0x3F));
    } else {
      return std::nullopt;  // not Latin-1: not what pickle writes for bytes
    }
  }
  return out;
}

}  // namespace

bool BytesOfPickledValue(const Value& v, std::string* payload) {
  if (v.kind == Kind::kBytes) {
    *payload = v.str;
    return true;
  }
  if (v.kind != Kind::kObject || v.newobj || v.state || !v.args) return false;
  const std::string callable = v.global_name();
  const auto& args = v.args->items;
  if ((callable == "__builtin__.bytes" || callable == "builtins.bytes") && args.empty()) {
    payload->clear();
    return true;
  }
  if (callable != "_codecs.encode" || args.size() != 2 || args[0]->kind != Kind::kStr ||
      args[1]->kind != Kind::kStr || args[1]->str != "latin1") {
    return false;
  }
  std::optional<std::string> bytes = Latin1OfUtf8(args[0]->str);
  if (!bytes) return false;
  *payload = std::move(*bytes);
  return true;
}

}  // namespace torch_internal

namespace {

using namespace torch_internal;

std::optional<std::string> StorageClassOf(DType dtype) {
  for (const auto& [name, d] : StorageClasses()) {
    if (d == dtype) return name;
  }
  return std::nullopt;
}

// The small entries torch 2.x writes around the data ("version" 3: storages in data/<key>).
void AddHeaderEntries(ZipWriter& zip, const std::string& data_pkl, bool torch2) {
  zip.AddSmall("archive/data.pkl", data_pkl);
  if (torch2) {
    zip.AddSmall("archive/.format_version", "1");
    zip.AddSmall("archive/.storage_alignment", "64");
    zip.AddSmall("archive/byteorder", "little");
  }
}

ValuePtr IntTuple(const Shape& s) {
  std::vector<ValuePtr> items;
  for (int64_t v : s) items.push_back(pickle::Int(v));
  return pickle::Tuple(std::move(items));
}

TorchTensorRecord ResolveRecord(Archive& zip, uint64_t offset, const std::string& what) {
  const std::string prefix = zip.Prefix();
  CheckByteOrder(zip, prefix, what);
  const std::string pkl = zip.ReadSmall(prefix + "data.pkl", kMaxPickleBytes);
  pickle::Limits limits = DocumentLimits(pkl.size(), kMaxPickleBytes);
  limits.max_values = 1 << 16;
  const ValuePtr root =
      pickle::Load(pkl, AllowTensorGlobal, what + " " + prefix + "data.pkl", limits);
  const Reader r{what, pkl.size()};
  TorchTensorRecord rec;
  const StorageRef ref = ReadRebuildCall(r, *root, rec);
  const std::string entry = prefix + "data/" + ref.key;
  ReadStorageEntry(r, zip, entry, ref, rec);
  CheckExtent(r, rec);
  rec.storage_begin = offset + zip.DataOffset(entry);
  return rec;
}

// `v` with every pickled bytes object (protocol 2's _codecs.encode form) made a kBytes value;
// UnsupportedError for any other object or global.
ValuePtr PlainValue(const ValuePtr& v, const std::string& what) {
  std::string payload;
  switch (v->kind) {
    case Kind::kObject:
    case Kind::kGlobal:
      if (v->kind == Kind::kObject && BytesOfPickledValue(*v, &payload)) {
        return pickle::Bytes(std::move(payload));
      }
      throw UnsupportedError(what + ": holds a Python object of a class (" + v->Describe() +
                             "), not plain data");
    case Kind::kPersistent:
      throw UnsupportedError(what + ": holds a tensor or storage, not plain data");
    case Kind::kTuple:
    case Kind::kList:
    case Kind::kDict: {
      auto out = std::make_shared<Value>(*v);
      for (auto& item : out->items) item = PlainValue(item, what);
      return out;
    }
    default:
      return v;
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Records

bool TorchTensorRecord::row_major() const {
  const Shape want = ContiguousStrides(sizes);
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] > 1 && strides[d] != want[d]) return false;
  }
  return true;
}

uint64_t TorchTensorRecord::values_begin() const {
  return storage_begin + static_cast<uint64_t>(storage_offset) * ElementSize(dtype);
}

bool TorchTensorRecord::covers_storage() const {
  uint64_t numel = 1;
  for (int64_t n : sizes) numel *= static_cast<uint64_t>(n);  // checked inside the storage
  return row_major() && storage_offset == 0 && numel * ElementSize(dtype) == storage_bytes;
}

std::vector<char> ReadTorchRecordStorage(ReadableObject& in, const TorchTensorRecord& rec,
                                         const std::string& what, bool verify) {
  const uint64_t n = rec.storage_bytes;
  std::vector<char> buf = AllocateOrThrow([&] { return std::vector<char>(n); }, what, n);
  if (n > 0) in.ReadAt(rec.storage_begin, buf.data(), n);
  if (verify) {
    const uint32_t crc = Crc32(0, buf.data(), n);
    if (crc != rec.zip_crc32) {
      throw CorruptionError("checksum mismatch in the storage of " + what + " (" +
                            std::to_string(n) + " bytes): its zip entry says CRC-32 " +
                            std::to_string(rec.zip_crc32) + ", computed " + std::to_string(crc));
    }
  }
  return buf;
}

TorchTensorRecord ResolveTorchTensorRecord(ReadableObject& in, uint64_t offset, uint64_t length,
                                           const std::string& what) {
  Archive zip(in, offset, length, what);
  return ResolveRecord(zip, offset, what);
}

void CheckTorchArchiveCrcs(ReadableObject& in, uint64_t offset, uint64_t length,
                           const std::string& what, TorchTensorRecord* record) {
  Archive zip(in, offset, length, what);
  for (const auto& [name, info] : zip.entries()) {
    (void)info;
    zip.CheckEntry(name);
  }
  if (record) *record = ResolveRecord(zip, offset, what);
}

void CheckTorchArchiveCrcs(std::string_view archive, const std::string& what) {
  StringObject in(archive);
  CheckTorchArchiveCrcs(in, 0, archive.size(), what);
}

bool IsTorchSaveArchive(std::string_view bytes) {
  return bytes.size() >= 30 && bytes.compare(0, 4, "PK\x03\x04", 4) == 0;
}

std::string TorchSaveOfPickle(std::string_view pickle) {
  StringSink sink;
  ZipWriter zip(sink);
  AddHeaderEntries(zip, std::string(pickle), true);
  zip.AddSmall("archive/version", "3\n");
  zip.AddSerializationId();
  zip.Finish();
  return std::move(sink.s);
}

std::string TorchSaveOfBytes(std::string_view payload) {
  return TorchSaveOfPickle(pickle::Dump(*pickle::Bytes(std::string(payload))));
}

bool TorchSaveBytesPayload(std::string_view record, std::string* payload) {
  if (!IsTorchSaveArchive(record)) return false;
  try {
    StringObject in(record);
    Archive zip(in, 0, record.size(), "record");
    const std::string pkl = zip.ReadSmall(zip.Prefix() + "data.pkl", record.size());
    const ValuePtr v = pickle::Load(pkl, AllowBytesGlobal, "record");
    return BytesOfPickledValue(*v, payload);
  } catch (const Error&) {
    return false;  // some other object: the record is the blob
  }
}

ValuePtr TorchSaveObject(std::string_view bytes, const std::string& what) {
  std::string pkl;
  if (IsTorchSaveArchive(bytes)) {
    StringObject in(bytes);
    Archive zip(in, 0, bytes.size(), what);
    pkl = zip.ReadSmall(zip.Prefix() + "data.pkl", kMaxPickleBytes);
  } else if (!bytes.empty() && static_cast<uint8_t>(bytes[0]) == 0x80) {  // PROTO
    pkl.assign(bytes);
  } else {
    throw InvalidArgumentError(what + ": its " + std::to_string(bytes.size()) +
                               " bytes are neither a torch.save archive nor a pickle");
  }
  const pickle::Limits limits = DocumentLimits(pkl.size(), kMaxPickleBytes);
  return PlainValue(pickle::Load(pkl, AllowBytesGlobal, what, limits), what);
}

uint64_t AppendTorchTensorRecord(WritableObject& out, const TensorView& view, bool torch2) {
  using namespace pickle;
  const uint64_t begin = out.size();
  const uint64_t nbytes = view.nbytes();
  const auto storage_class = StorageClassOf(view.dtype);
  if (!storage_class && !torch2) {
    throw UnsupportedError(std::string("dtype ") + std::string(DTypeName(view.dtype)) +
                           " cannot be written for torch 1.13 (it has no such dtype)");
  }
  const bool v3 = !storage_class.has_value();
  std::vector<ValuePtr> args = {
      Persistent(
          Tuple({Str("storage"),
                 v3 ? Global("torch.storage", "UntypedStorage") : Global("torch", *storage_class),
                 Str("0"), Str("cpu"), Int(v3 ? static_cast<int64_t>(nbytes) : view.numel())})),
      Int(0),
      IntTuple(view.shape),
      IntTuple(ContiguousStrides(view.shape)),
      Bool(false),
      Object(Global("collections", "OrderedDict"), {})};
  if (v3) args.push_back(Global("torch", std::string(DTypeName(view.dtype))));
  const ValuePtr pkl = Object(
      Global("torch._utils", v3 ? "_rebuild_tensor_v3" : "_rebuild_tensor_v2"), std::move(args));
  ZipWriter zip(out);
  AddHeaderEntries(zip, Dump(*pkl), torch2);
  zip.AddStreamed("archive/data/0", nbytes, [&] {
    uint32_t crc = 0;
    StreamToHost(view, kDevicePieceBytes, [&](const void* data, size_t n) {
      out.Append(data, n);
      crc = Crc32(crc, data, n);
    });
    return crc;
  });
  zip.AddSmall("archive/version", "3\n");
  if (torch2) zip.AddSerializationId();
  zip.Finish();
  return out.size() - begin;
}

}  // namespace dcp
