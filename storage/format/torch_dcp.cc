// PyTorch DCP metadata and torch.save records (see torch_dcp.h).
//
// Reading a record goes through libzip (Debian's libzip-dev 1.7): it parses the archive's
// central directory, zip64 sizes and offsets included (Debian's minizip 1.1 never reads the zip64
// size on 64-bit Linux, so entries of 4 GiB or more failed), and reads the small entries with
// their CRC-32 checked. A stored entry's values are read with dcp's own reader straight into
// their destination, from where libzip finds its data. Writing is done here: libzip's writer
// seeks back to patch each local header, which stores that only append cannot take, whereas a
// stored entry with a data descriptor streams front to back; the few
// structures involved (local header, data descriptor, central directory, zip64 end records) are
// written below and every archive we write is read back by libzip, Python's zipfile and
// torch.load in tests.
#include "dcp/storage/format/torch_dcp.h"

#include <zip.h>  // libzip

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_set>
#include <vector>

#include "dcp/proto/checksum.h"
#include "dcp/proto/device/device.h"
#include "dcp/proto/error.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/storage/format/pickle.h"

namespace dcp {
namespace {

using pickle::Kind;
using pickle::Value;
using pickle::ValuePtr;

constexpr char kMeta2[] = "torch.distributed.checkpoint.metadata";
constexpr char kMeta1[] = "torch.distributed._shard.checkpoint.metadata";
constexpr char kFs2[] = "torch.distributed.checkpoint.filesystem";
constexpr char kFs1[] = "torch.distributed._shard.checkpoint.filesystem";
constexpr char kSharded1[] = "torch.distributed._shard.sharded_tensor.metadata";

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

std::optional<std::string> StorageClassOf(DType dtype) {
  for (const auto& [name, d] : StorageClasses()) {
    if (d == dtype) return name;
  }
  return std::nullopt;
}

bool IsTorchDType(std::string_view name) { return DTypeFromName(name).has_value(); }

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

bool AllowTensorGlobal(std::string_view module, std::string_view name) {
  if (module == "torch._utils") return name == "_rebuild_tensor_v2" || name == "_rebuild_tensor_v3";
  if (module == "torch") return StorageClasses().count(name) > 0 || IsTorchDType(name);
  if (module == "torch.storage") return name == "UntypedStorage";
  if (module == "collections") return name == "OrderedDict";
  return false;
}

// ---------------------------------------------------------------------------------------------
// Interpreting unpickled values

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

// ---------------------------------------------------------------------------------------------
// libzip over a byte range of a ReadableObject

// libzip reads a record a few bytes at a time (header fields, local headers before each entry's
// data) besides one read of the record's tail for its directories: each a ranged GET on s3://.
// Small reads are therefore served from one cached block: the block at the position asked for
// (the tail block when the position lies in it), up to four kept (a record's small entries sit at
// its head and its tail, and verify alternates between them). Other reads of a block or more go
// straight through.
struct Window {
  static constexpr uint64_t kBlock = 64 << 10;
  static constexpr size_t kBlocks = 4;
  struct Block {
    uint64_t at = 0;  // window offset of bytes[0]
    std::vector<char> bytes;
  };
  ReadableObject* in;
  uint64_t base, size, pos = 0;
  uint64_t last_read = 0;    // where libzip's latest read began (see Archive::DataOffset)
  std::exception_ptr error;  // what the ReadableObject threw, rethrown by Archive::Fail
  zip_error_t zerr;          // what the source reports to libzip
  std::vector<Block> cache;  // most recently used last

  Window(ReadableObject* in_, uint64_t base_, uint64_t size_) : in(in_), base(base_), size(size_) {
    zip_error_init(&zerr);
  }
  ~Window() { zip_error_fini(&zerr); }
  Window(const Window&) = delete;
  Window& operator=(const Window&) = delete;

  void Read(void* buf, uint64_t k) {
    if (k == 0) return;  // libzip asks for nothing at times (an empty record): no buffer then
    for (size_t i = 0; i < cache.size(); ++i) {
      Block& b = cache[i];
      if (pos >= b.at && pos + k <= b.at + b.bytes.size()) {
        std::memcpy(buf, b.bytes.data() + (pos - b.at), k);
        std::rotate(cache.begin() + static_cast<std::ptrdiff_t>(i),
                    cache.begin() + static_cast<std::ptrdiff_t>(i) + 1, cache.end());
        return;
      }
    }
    // libzip's first read is the record's last 64 KiB + 42 bytes (where the directories are):
    // kept, as later small reads near the tail (local headers of the last entries) fall in it.
    const bool tail_read = pos + k == size && k <= 2 * kBlock;
    if (k >= kBlock && !tail_read) {
      in->ReadAt(base + pos, buf, k);
      return;
    }
    if (cache.size() == kBlocks) cache.erase(cache.begin());
    Block& b = cache.emplace_back();
    const uint64_t tail = size > kBlock ? size - kBlock : 0;
    b.at = k >= kBlock || pos < tail ? pos : tail;
    b.bytes.resize(std::max(k, std::min(kBlock, size - b.at)));
    in->ReadAt(base + b.at, b.bytes.data(), b.bytes.size());
    std::memcpy(buf, b.bytes.data() + (pos - b.at), k);
  }
};

// A read-only, seekable libzip source (zip_source_function_create) over a Window. Exceptions
// must not cross libzip's C frames: the ReadableObject's is kept and reported as a read error.
zip_int64_t WindowSource(void* state, void* data, zip_uint64_t len, zip_source_cmd_t cmd) {
  auto* w = static_cast<Window*>(state);
  switch (cmd) {
    case ZIP_SOURCE_OPEN:
      w->pos = 0;
      return 0;
    case ZIP_SOURCE_READ: {
      const uint64_t k = std::min<uint64_t>(len, w->size - std::min(w->pos, w->size));
      if (k == 0) return 0;
      try {
        w->last_read = w->pos;
        w->Read(data, k);
      } catch (...) {
        w->error = std::current_exception();
        zip_error_set(&w->zerr, ZIP_ER_READ, EIO);
        return -1;
      }
      w->pos += k;
      return static_cast<zip_int64_t>(k);
    }
    case ZIP_SOURCE_CLOSE:
    case ZIP_SOURCE_FREE:  // the Window belongs to its Archive
      return 0;
    case ZIP_SOURCE_STAT: {
      auto* st = ZIP_SOURCE_GET_ARGS(zip_stat_t, data, len, &w->zerr);
      if (!st) return -1;
      zip_stat_init(st);
      st->size = w->size;
      st->valid |= ZIP_STAT_SIZE;
      return sizeof(zip_stat_t);
    }
    case ZIP_SOURCE_ERROR:
      return zip_error_to_data(&w->zerr, data, len);
    case ZIP_SOURCE_SEEK: {
      const zip_int64_t at = zip_source_seek_compute_offset(w->pos, w->size, data, len, &w->zerr);
      if (at < 0) return -1;
      w->pos = static_cast<uint64_t>(at);
      return 0;
    }
    case ZIP_SOURCE_TELL:
      return static_cast<zip_int64_t>(w->pos);
    case ZIP_SOURCE_SUPPORTS:
      return ZIP_SOURCE_SUPPORTS_SEEKABLE;
    default:
      zip_error_set(&w->zerr, ZIP_ER_OPNOTSUPP, 0);
      return -1;
  }
}

constexpr size_t kMaxEntries = 1024;
constexpr uint64_t kMaxDirectoryBytes = uint64_t{4} << 20;  // central directories, per record
constexpr size_t kMaxPickleBytes = size_t{1} << 20;
constexpr uint64_t kMaxInflatedBytes = uint64_t{64} << 20;  // deflated entries, per record

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

// One central directory entry, as libzip read it (zip64 sizes and offsets included).
struct ZipEntry {
  zip_uint64_t index = 0;
  uint64_t size = 0;       // uncompressed
  uint64_t comp_size = 0;  // in the archive
  uint32_t crc = 0;
  uint16_t method = 0;  // 0 stored, 8 deflated
  bool encrypted = false;
};

class Archive {
 public:
  // `max_entries` and `max_directory_bytes` bound what the central directories may claim: a
  // PyTorch DCP record holds one tensor, a whole torch.save file (ReadTorchSaveFile) many.
  Archive(ReadableObject& in, uint64_t offset, uint64_t length, std::string what,
          size_t max_entries = kMaxEntries, uint64_t max_directory_bytes = kMaxDirectoryBytes)
      : window_(&in, offset, length),
        what_(std::move(what)),
        max_entries_(max_entries),
        max_directory_bytes_(max_directory_bytes) {
    CheckDirectoryClaims();
    zip_error_t err;
    zip_error_init(&err);
    zip_source_t* src = zip_source_function_create(WindowSource, &window_, &err);
    if (src) {
      zip_.reset(zip_open_from_source(src, ZIP_RDONLY, &err));
      if (!zip_) zip_source_free(src);  // zip_open_from_source owns it only on success
    }
    if (!zip_) {
      const std::string why = zip_error_strerror(&err);
      zip_error_fini(&err);
      Fail("is not a zip archive (a torch.save record): " + why);
    }
    zip_error_fini(&err);
    const zip_int64_t n = zip_get_num_entries(zip_.get(), 0);
    if (n < 0) Fail("has a damaged central directory");
    if (static_cast<uint64_t>(n) > max_entries_) {
      Fail("has more than " + std::to_string(max_entries_) + " entries");
    }
    for (zip_uint64_t i = 0; i < static_cast<zip_uint64_t>(n); ++i) {
      zip_stat_t st;
      zip_stat_init(&st);
      if (zip_stat_index(zip_.get(), i, ZIP_FL_ENC_RAW, &st) != 0 || !st.name) {
        Fail("has an unreadable central directory entry");
      }
      constexpr zip_uint64_t kNeeded = ZIP_STAT_SIZE | ZIP_STAT_COMP_SIZE | ZIP_STAT_CRC |
                                       ZIP_STAT_COMP_METHOD | ZIP_STAT_ENCRYPTION_METHOD;
      if ((st.valid & kNeeded) != kNeeded) Fail("has an unreadable central directory entry");
      ZipEntry e;
      e.index = i;
      e.size = st.size;
      e.comp_size = st.comp_size;
      e.crc = st.crc;
      e.method = st.comp_method;
      e.encrypted = st.encryption_method != ZIP_EM_NONE;
      entries_.emplace(st.name, e);  // a duplicate name: the first entry, as zip readers do
    }
    // Inflation is bounded: torch.save stores tensor data uncompressed (DataOffset refuses it
    // otherwise), so only small entries may be deflated. Entries sharing one deflate stream (a
    // zip bomb) could otherwise claim far more than deflate's 1032:1 of the record.
    uint64_t inflated = 0;
    for (const auto& [name, e] : entries_) {
      if (e.method != 0) inflated += std::min<uint64_t>(e.size, kMaxInflatedBytes + 1);
    }
    if (inflated > kMaxInflatedBytes || inflated / 1032 > length) {
      Fail("has compressed entries that claim " + std::to_string(inflated) +
           " bytes inflated from a " + std::to_string(length) +
           "-byte record (limit: 1032 times the record, at most 64 MiB)");
    }
  }
  Archive(const Archive&) = delete;
  Archive& operator=(const Archive&) = delete;

  [[noreturn]] void Fail(const std::string& why) const {
    if (window_.error) std::rethrow_exception(window_.error);
    throw CorruptionError(what_ + " " + why);
  }
  const std::map<std::string, ZipEntry>& entries() const { return entries_; }
  // The folder every torch.save entry lives in ("archive/"), from its data.pkl.
  std::string Prefix() const {
    std::string prefix;
    int found = 0;
    for (const auto& [name, e] : entries_) {
      const size_t n = name.size();
      if (n >= 8 && name.compare(n - 8, 8, "data.pkl") == 0 && name.find('/') == n - 9) {
        prefix = name.substr(0, n - 8);
        ++found;
      }
    }
    if (found != 1) Fail("has no single <name>/data.pkl (not a torch.save archive)");
    return prefix;
  }
  const ZipEntry* Find(const std::string& name) const {
    auto it = entries_.find(name);
    return it == entries_.end() ? nullptr : &it->second;
  }
  // A small entry, whole; libzip checks its CRC-32 and length when a read reaches its end.
  std::string ReadSmall(const std::string& name, size_t limit) {
    const ZipEntry& e = Get(name);
    if (e.size > limit) {
      Fail("entry " + name + " claims " + std::to_string(e.size) + " bytes (limit " +
           std::to_string(limit) + ")");
    }
    File f = Open(name, e);
    std::string out(e.size, '\0');
    const zip_int64_t n = out.empty() ? 0 : zip_fread(f.get(), out.data(), out.size());
    char extra;
    const zip_int64_t tail = n < 0 ? -1 : zip_fread(f.get(), &extra, 1);  // the end: checks
    if (n < 0 || tail < 0) FailRead(name, f.get());
    if (static_cast<uint64_t>(n) != out.size()) Fail("entry " + name + " is truncated");
    if (tail != 0) {
      Fail("entry " + name + " holds more bytes than the " + std::to_string(e.size) + " it claims");
    }
    // libzip checks nothing of an entry of no bytes: its CRC-32 must still be that of nothing.
    if (e.size == 0 && e.crc != 0) Fail("entry " + name + " fails its CRC-32");
    return out;
  }
  // Where a stored (uncompressed) entry's data starts, relative to the archive. libzip 1.7 has no
  // call for it (the local header's name and extra field lengths decide it, and only the central
  // directory says where that header is), so it is observed: the first byte of the entry read
  // through libzip is read by the source at the data's start, which the source records.
  uint64_t DataOffset(const std::string& name) {
    const ZipEntry& e = Get(name);
    if (e.method != 0) {
      throw UnsupportedError(what_ + " entry " + name + " is compressed (method " +
                             std::to_string(e.method) +
                             "); torch.save stores tensor data uncompressed");
    }
    CheckStored(name, e);
    if (e.size == 0) return 0;  // nothing is read from it
    File f = Open(name, e);
    window_.last_read = window_.size;
    char first;
    if (zip_fread(f.get(), &first, 1) != 1) FailRead(name, f.get());
    const uint64_t pos = window_.last_read;
    if (pos > window_.size || e.size > window_.size - pos) {
      Fail("entry " + name + " lies outside the record");
    }
    // The byte read through libzip is the one at pos: libzip read it there (were it ever to read
    // ahead from elsewhere, this refuses the record rather than read the wrong bytes).
    char at;
    window_.pos = pos;
    window_.Read(&at, 1);
    if (at != first) {
      throw UnsupportedError(what_ + " entry " + name + ": cannot locate its data (libzip " +
                             zip_libzip_version() + " read it from an unexpected place)");
    }
    return pos;
  }
  // Read a whole entry of any size (CRC-checked and its length checked at the end).
  void CheckEntry(const std::string& name) {
    const ZipEntry& e = Get(name);
    if (e.method == 0) {
      // A stored entry (all tensor data): its bytes in large reads straight from the record, not
      // through libzip's (each a ranged GET on s3://).
      const uint64_t at = DataOffset(name), n = e.size;
      std::vector<char> buf(std::min<uint64_t>(n, uint64_t{8} << 20));
      uint32_t crc = 0;
      for (uint64_t pos = 0; pos < n;) {
        const uint64_t k = std::min<uint64_t>(buf.size(), n - pos);
        window_.pos = at + pos;
        window_.Read(buf.data(), k);  // small ones from the cached block, large ones directly
        crc = Crc32(crc, buf.data(), k);
        pos += k;
      }
      if (crc != e.crc) {
        Fail("entry " + name + " fails its CRC-32 (the zip records " + Hex32(e.crc) + ", its " +
             std::to_string(n) + " bytes have " + Hex32(crc) + ")");
      }
      return;
    }
    File f = Open(name, e);
    std::vector<char> buf(1 << 20);
    uint64_t total = 0;
    for (;;) {
      // Never more than one byte past the claim: a deflate stream may inflate to far more.
      const uint64_t want = std::min<uint64_t>(buf.size(), e.size - std::min(total, e.size) + 1);
      const zip_int64_t n = zip_fread(f.get(), buf.data(), want);
      if (n < 0) FailRead(name, f.get(), total);
      if (n == 0) break;  // the end, where libzip checked the CRC-32 and the length
      total += static_cast<uint64_t>(n);
      if (total > e.size) {
        Fail("entry " + name + " holds more bytes than the " + std::to_string(e.size) +
             " it claims");
      }
    }
    if (total != e.size) {
      Fail("entry " + name + " holds " + std::to_string(total) + " bytes but claims " +
           std::to_string(e.size));
    }
  }

 private:
  struct Discard {
    void operator()(zip_t* z) const { zip_discard(z); }
  };

  static std::string Hex32(uint32_t v) {
    char buf[16];
    std::snprintf(buf, sizeof(buf), "0x%08x", v);
    return buf;
  }
  static uint64_t Le(const unsigned char* p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
    return v;
  }
  // What libzip would parse, bounded before it does. zip_open tries every end-of-central-
  // directory signature in the record's last 64 KiB + 42 bytes: for each it allocates the
  // entries its (zip64) end record claims, up to one per 46 bytes of the record (a crafted
  // 4 GiB record: gigabytes), and parses every entry of its directory. So each candidate whose
  // directory libzip would read (it lies before the end record and starts with an entry's
  // signature) may claim at most 1024 entries, and together at most 4 MiB of directory.
  // Chance signatures in tensor data almost never pass for one; the bytes read are those
  // libzip reads first (then from the cache), plus 4 or 56 at what a candidate points to.
  void CheckDirectoryClaims() {
    constexpr uint64_t kTail = 65536 + 22 + 20;  // libzip's CDBUFSIZE
    const uint64_t n = std::min(window_.size, kTail), start = window_.size - n;
    std::vector<unsigned char> tail(n);
    auto read = [&](uint64_t at, void* dst, uint64_t k) {
      window_.pos = at;
      try {
        window_.Read(dst, k);
      } catch (...) {
        window_.error = std::current_exception();
        Fail("cannot be read");
      }
    };
    read(start, tail.data(), n);
    uint64_t claimed = 0;
    for (uint64_t i = 0; i + 22 <= n; ++i) {
      const unsigned char* e = tail.data() + i;
      if (std::memcmp(e, "PK\x05\x06", 4) != 0) continue;
      uint64_t entries = Le(e + 10, 2), size = Le(e + 12, 4), offset = Le(e + 16, 4);
      uint64_t end = start + i;  // the directory must end before this
      if (i >= 20 && std::memcmp(e - 20, "PK\x06\x07", 4) == 0) {
        const uint64_t at = Le(e - 20 + 8, 8);  // the zip64 end record
        unsigned char r[56];
        if (at > end - 20 || end - 20 - at < sizeof(r)) continue;  // before the locator
        read(at, r, sizeof(r));
        if (std::memcmp(r, "PK\x06\x06", 4) != 0) continue;
        entries = Le(r + 32, 8), size = Le(r + 40, 8), offset = Le(r + 48, 8);
      }
      if (size == 0 || offset > end || size > end - offset) continue;  // libzip stops there
      unsigned char sig[4];
      read(offset, sig, 4);
      if (std::memcmp(sig, "PK\x01\x02", 4) != 0) continue;
      if (entries > max_entries_ && entries <= size / 46) {
        Fail("claims " + std::to_string(entries) + " entries (limit " +
             std::to_string(max_entries_) + ")");
      }
      claimed += size;
      if (claimed > max_directory_bytes_) {
        Fail("has central directories of more than " + std::to_string(max_directory_bytes_) +
             " bytes");
      }
    }
  }
  struct Close {
    void operator()(zip_file_t* f) const { zip_fclose(f); }
  };
  using File = std::unique_ptr<zip_file_t, Close>;

  const ZipEntry& Get(const std::string& name) const {
    const ZipEntry* e = Find(name);
    if (!e) Fail("has no entry " + name);
    return *e;
  }
  // A stored entry is read directly: its two sizes must agree.
  void CheckStored(const std::string& name, const ZipEntry& e) const {
    if (e.encrypted) {
      throw UnsupportedError(what_ + " entry " + name + " is encrypted");
    }
    if (e.comp_size != e.size) {
      Fail("entry " + name + " is stored in " + std::to_string(e.comp_size) + " bytes but claims " +
           std::to_string(e.size));
    }
  }
  File Open(const std::string& name, const ZipEntry& e) {
    if (e.encrypted) throw UnsupportedError(what_ + " entry " + name + " is encrypted");
    if (e.method != 0 && e.method != 8) {
      throw UnsupportedError(what_ + " entry " + name + " is compressed with zip method " +
                             std::to_string(e.method) + " (torch.save stores or deflates)");
    }
    if (e.method == 0) CheckStored(name, e);
    File f(zip_fopen_index(zip_.get(), e.index, 0));
    if (!f) {
      Fail("entry " + name + " cannot be opened (" + zip_error_strerror(zip_get_error(zip_.get())) +
           ")");
    }
    return f;
  }
  [[noreturn]] void FailRead(const std::string& name, zip_file_t* f, uint64_t total = 0) const {
    zip_error_t* err = zip_file_get_error(f);
    switch (zip_error_code_zip(err)) {
      case ZIP_ER_CRC:
        Fail("entry " + name + " fails its CRC-32");
      case ZIP_ER_INCONS:
      case ZIP_ER_EOF:
        Fail("entry " + name + " is truncated (" +
             (total ? "holds " + std::to_string(total) + " bytes, " : std::string()) +
             "fewer than it claims)");
      default:
        Fail("entry " + name + " cannot be read (libzip: " + zip_error_strerror(err) + ")");
    }
  }

  Window window_;
  std::string what_;
  size_t max_entries_;
  uint64_t max_directory_bytes_;
  std::unique_ptr<zip_t, Discard> zip_;  // closed before window_ goes
  std::map<std::string, ZipEntry> entries_;
};

class StringObject : public ReadableObject {
 public:
  explicit StringObject(std::string_view s) : s_(s) {}
  void ReadAt(uint64_t offset, void* dst, size_t n) override {
    if (offset > s_.size() || n > s_.size() - offset) {
      throw CorruptionError("read past the end of an in-memory record");
    }
    std::memcpy(dst, s_.data() + offset, n);
  }
  uint64_t size() const override { return s_.size(); }

 private:
  std::string_view s_;
};

// ---------------------------------------------------------------------------------------------
// Writing zip archives (stored entries only)

class ZipWriter {
 public:
  ZipWriter(WritableObject& out) : out_(out), base_(out.size()) {}

  void AddSmall(const std::string& name, std::string_view content) {
    Entry e{name, Crc32(0, content.data(), content.size()), content.size(), Pos(), false};
    LocalHeader(e, 0);
    out_.Append(content.data(), content.size());
    Written(e);
  }
  // An entry whose bytes `write` appends (`size` of them, CRC-32 returned); its data starts at
  // a multiple of 64 from the archive's start, as torch aligns storages.
  void AddStreamed(const std::string& name, uint64_t size, const std::function<uint32_t()>& write) {
    Entry e{name, 0, size, Pos(), true};
    const uint64_t data_at = Pos() + 30 + name.size();
    uint64_t pad = (64 - (data_at + 4) % 64) % 64;
    LocalHeader(e, pad + 4);
    e.crc = write();
    std::string d;
    Put32(d, 0x08074b50);
    Put32(d, e.crc);
    if (size >= 0xffffffffu) {
      Put64(d, size);
      Put64(d, size);
    } else {
      Put32(d, static_cast<uint32_t>(size));
      Put32(d, static_cast<uint32_t>(size));
    }
    out_.Append(d.data(), d.size());
    Written(e);
  }
  // The entry torch 2.x's writer adds last, ".data/serialization_id": 20 decimal digits of a
  // hash over the record names, then 20 of a hash over the entries' CRC-32s, combined as
  // PyTorchStreamWriter does (c10::hash_combine over std::hash of each name, visited in an
  // unordered_set's order, and over the CRCs in write order), so dcp's records carry the id
  // torch would give the same entries (checked against the torch 2.11 fixtures).
  void AddSerializationId() {
    std::unordered_set<std::string> names;
    for (const Entry& e : entries_) names.insert(e.name.substr(e.name.find('/') + 1));
    size_t name_hash = 0;
    for (const std::string& name : names) {
      name_hash = HashCombine(name_hash, std::hash<std::string>{}(name));
    }
    char id[41];
    std::snprintf(id, sizeof(id), "%020zu%020zu", name_hash, crc_hash_);
    AddSmall("archive/.data/serialization_id", std::string_view(id, 40));
  }
  uint64_t Finish() {
    const uint64_t cd_at = Pos();
    std::string cd;
    bool zip64 = false;
    for (const Entry& e : entries_) {
      const bool big_size = e.size >= 0xffffffffu;
      const bool big_off = e.offset >= 0xffffffffu;
      std::string extra;
      if (big_size || big_off) {
        zip64 = true;
        std::string body;
        if (big_size) {
          Put64(body, e.size);
          Put64(body, e.size);
        }
        if (big_off) Put64(body, e.offset);
        Put16(extra, 0x0001);
        Put16(extra, static_cast<uint16_t>(body.size()));
        extra += body;
      }
      Put32(cd, 0x02014b50);
      Put16(cd, big_size || big_off ? 45 : 20);  // made by
      Put16(cd, big_size || big_off ? 45 : 20);  // needed
      Put16(cd, e.descriptor ? 0x0008 : 0);
      Put16(cd, 0);     // stored
      Put16(cd, 0);     // time
      Put16(cd, 0x21);  // date: 1980-01-01
      Put32(cd, e.crc);
      Put32(cd, big_size ? 0xffffffffu : static_cast<uint32_t>(e.size));
      Put32(cd, big_size ? 0xffffffffu : static_cast<uint32_t>(e.size));
      Put16(cd, static_cast<uint16_t>(e.name.size()));
      Put16(cd, static_cast<uint16_t>(extra.size()));
      Put16(cd, 0);  // comment
      Put16(cd, 0);  // disk
      Put16(cd, 0);  // internal attributes
      Put32(cd, 0);  // external attributes
      Put32(cd, big_off ? 0xffffffffu : static_cast<uint32_t>(e.offset));
      cd += e.name;
      cd += extra;
    }
    const uint64_t cd_size = cd.size();
    if (cd_at >= 0xffffffffu) zip64 = true;
    std::string end;
    if (zip64) {
      const uint64_t rec_at = cd_at + cd_size;
      Put32(end, 0x06064b50);
      Put64(end, 44);
      Put16(end, 45);
      Put16(end, 45);
      Put32(end, 0);
      Put32(end, 0);
      Put64(end, entries_.size());
      Put64(end, entries_.size());
      Put64(end, cd_size);
      Put64(end, cd_at);
      Put32(end, 0x07064b50);  // locator
      Put32(end, 0);
      Put64(end, rec_at);
      Put32(end, 1);
    }
    Put32(end, 0x06054b50);
    Put16(end, 0);
    Put16(end, 0);
    Put16(end, static_cast<uint16_t>(entries_.size()));
    Put16(end, static_cast<uint16_t>(entries_.size()));
    Put32(end, cd_size >= 0xffffffffu ? 0xffffffffu : static_cast<uint32_t>(cd_size));
    Put32(end, zip64 ? 0xffffffffu : static_cast<uint32_t>(cd_at));
    Put16(end, 0);
    cd += end;
    out_.Append(cd.data(), cd.size());
    return Pos();
  }

 private:
  struct Entry {
    std::string name;
    uint32_t crc;
    uint64_t size;
    uint64_t offset;
    bool descriptor;
  };
  static void Put16(std::string& s, uint16_t v) {
    s += static_cast<char>(v & 0xff);
    s += static_cast<char>(v >> 8);
  }
  static void Put32(std::string& s, uint32_t v) {
    for (int i = 0; i < 4; ++i) s += static_cast<char>((v >> (8 * i)) & 0xff);
  }
  static void Put64(std::string& s, uint64_t v) {
    for (int i = 0; i < 8; ++i) s += static_cast<char>((v >> (8 * i)) & 0xff);
  }
  uint64_t Pos() const { return out_.size() - base_; }
  // `extra_len` bytes of padding extra field ("FB", as torch writes) when non-zero.
  void LocalHeader(const Entry& e, uint64_t extra_len) {
    std::string h;
    Put32(h, 0x04034b50);
    Put16(h, e.descriptor && e.size >= 0xffffffffu ? 45 : 20);
    Put16(h, e.descriptor ? 0x0008 : 0);
    Put16(h, 0);
    Put16(h, 0);
    Put16(h, 0x21);
    // With a data descriptor the CRC and sizes follow the data (APPNOTE 4.4.4).
    Put32(h, e.descriptor ? 0 : e.crc);
    Put32(h, e.descriptor ? 0 : static_cast<uint32_t>(e.size));
    Put32(h, e.descriptor ? 0 : static_cast<uint32_t>(e.size));
    Put16(h, static_cast<uint16_t>(e.name.size()));
    Put16(h, static_cast<uint16_t>(extra_len));
    h += e.name;
    if (extra_len) {
      Put16(h, 0x4246);  // "FB"
      Put16(h, static_cast<uint16_t>(extra_len - 4));
      h.append(extra_len - 4, 'Z');
    }
    out_.Append(h.data(), h.size());
  }

  static size_t HashCombine(size_t seed, size_t value) {
    return seed ^ (value + 0x9e3779b9 + (seed << 6) + (seed >> 2));
  }
  void Written(const Entry& e) {
    entries_.push_back(e);
    crc_hash_ = HashCombine(crc_hash_, e.crc);
  }

  WritableObject& out_;
  uint64_t base_;
  std::vector<Entry> entries_;
  size_t crc_hash_ = 0;
};

class StringSink : public WritableObject {
 public:
  void Append(const void* data, size_t n) override { s.append(static_cast<const char*>(data), n); }
  void Sync() override {}
  void Close() override {}
  uint64_t size() const override { return s.size(); }
  std::string s;
};

// The small entries torch 2.x writes around the data ("version" 3: storages in data/<key>).
void AddHeaderEntries(ZipWriter& zip, const std::string& data_pkl, bool torch2) {
  zip.AddSmall("archive/data.pkl", data_pkl);
  if (torch2) {
    zip.AddSmall("archive/.format_version", "1");
    zip.AddSmall("archive/.storage_alignment", "64");
    zip.AddSmall("archive/byteorder", "little");
  }
}

ValuePtr SizeValue(const Shape& s) {
  std::vector<ValuePtr> items;
  for (int64_t v : s) items.push_back(pickle::Int(v));
  return pickle::Object(pickle::Global("torch", "Size"), {pickle::Tuple(std::move(items))});
}

ValuePtr IntTuple(const Shape& s) {
  std::vector<ValuePtr> items;
  for (int64_t v : s) items.push_back(pickle::Int(v));
  return pickle::Tuple(std::move(items));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Metadata

namespace {

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

namespace {

// A record written on a big-endian machine cannot be read as is.
void CheckByteOrder(Archive& zip, const std::string& prefix, const std::string& what) {
  if (!zip.Find(prefix + "byteorder")) return;
  const std::string order = zip.ReadSmall(prefix + "byteorder", 16);
  if (order != "little") {
    throw UnsupportedError(what + " was written on a '" + order + "'-endian machine");
  }
}

// The storage a tensor's pickle references: ('storage', type, key, location, numel).
struct StorageRef {
  bool untyped = false;  // an UntypedStorage: numel counts bytes
  std::string key;       // its entry is data/<key>
  int64_t numel = 0;
};

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

}  // namespace

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

namespace {

// How Python pickles a bytes object: BINBYTES from protocol 3 on; protocol 2 (torch.save's)
// has no bytes opcode and writes _codecs.encode(<latin-1 text>, 'latin1'), or bytes() when
// empty.
bool AllowBytesGlobal(std::string_view module, std::string_view name) {
  return (module == "_codecs" && name == "encode") ||
         ((module == "__builtin__" || module == "builtins") && name == "bytes");
}

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

}  // namespace

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

namespace {

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

namespace {

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

bool IsTorchDcpDataName(const std::string& name) {
  return name.size() > 9 && name.rfind("__", 0) == 0 &&
         name.compare(name.size() - 7, 7, ".distcp") == 0;
}

}  // namespace dcp
