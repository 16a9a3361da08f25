#include "tools/cli/cli_common.h"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <string_view>
#include <utility>

#include "dcp/proto/checksum.h"
#include "dcp/proto/error.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/proto/staging.h"
#include "dcp/storage/format/dcp_index.h"
#include "dcp/storage/format/dcp_layout.h"
#include "dcp/storage/format/layout.h"
#include "dcp/storage/format/torch_dcp.h"
#include "dcp/storage/format/zstd_transform.h"
#include "dcp/storage/registry.h"

namespace dcp::cli {

std::string ExitCodeHelp() {
  return "Exit codes:\n"
         "  0  success (verify: complete and valid; diff: no differences)\n"
         "  1  verify found damage, diff found differences, or diff/convert met damaged data\n"
         "     (a missing or truncated data file, a checksum mismatch: the same damage gives the\n"
         "     same code in every command)\n"
         "  2  bad command line, or a scheme with no Store-based backend (see --plugin)\n"
         "  3  not a checkpoint (no metadata.dcp and no data files, or not a dcp metadata file)\n"
         "  4  incomplete checkpoint (data files but no metadata.dcp: the save did not finish)\n"
         "  5  corrupt metadata (checksum, truncation, inconsistent contents)\n"
         "  6  unsupported (newer format version, unknown transform, feature not in this build)\n"
         "  7  I/O error, out of memory (naming the entry, file and size), or other error\n"
         "With --json, an error prints {\"error\": {\"category\", \"exit_code\", \"message\"}} on\n"
         "stdout (categories: damaged_data, usage, not_checkpoint, incomplete_checkpoint,\n"
         "corrupt_metadata, unsupported, io_error) and the message on stderr.\n";
}

const char* ExitCategory(int code) {
  switch (code) {
    case kOk:
      return "ok";
    case kFailed:
      return "damaged_data";
    case kUsage:
      return "usage";
    case kNotCheckpoint:
      return "not_checkpoint";
    case kIncomplete:
      return "incomplete_checkpoint";
    case kCorruptMetadata:
      return "corrupt_metadata";
    case kUnsupported:
      return "unsupported";
    default:
      return "io_error";
  }
}

std::string NameCliFlags(std::string message) {
  // The library's wording stays (its tests match it); a CLI user sets these through flags.
  static constexpr std::pair<std::string_view, std::string_view> kFlags[] = {
      {"pass overwrite to replace it", "use --overwrite to replace it"},
      {"compression_level ", "--compress-level "},
  };
  for (const auto& [field, flag] : kFlags) {
    for (size_t at = 0; (at = message.find(field, at)) != std::string::npos; at += flag.size()) {
      message.replace(at, field.size(), flag);
    }
  }
  return message;
}

int ExitCodeFor(ErrorCode code) {
  switch (code) {
    case ErrorCode::kCorruption:
    case ErrorCode::kNotFound:
      return kFailed;
    case ErrorCode::kUnsupported:
      return kUnsupported;
    case ErrorCode::kAlreadyExists:
    case ErrorCode::kInvalidArgument:
      return kUsage;
    default:
      return kIoError;
  }
}

namespace {

// Metadata damage is diagnosed by OpenCheckpoint; a dcp error that reaches here is damaged or
// missing data, an unknown transform, or an error of the storage or the machine.
CliError FromDcpError(ErrorCode code, const std::string& message) {
  const bool damage = code == ErrorCode::kCorruption || code == ErrorCode::kNotFound;
  return {ExitCodeFor(code), (damage ? "damaged data: " : "") + message};
}

CliError ClassifyUnnamed() {
  try {
    throw;
  } catch (const CliError& e) {
    return e;
  } catch (const CollectiveError& e) {
    // A single-process save or load: report the failure's own kind, and with one failure that
    // left nothing behind, its own message ("rank 0" means nothing to a CLI user).
    const ErrorCode code = e.failures().empty() ? ErrorCode::kIo : e.failures()[0].code;
    if (e.failures().size() == 1 && e.outcome() == Outcome::kFailed) {
      return FromDcpError(code, e.failures()[0].message);
    }
    return {ExitCodeFor(code), e.what()};
  } catch (const Error& e) {
    return FromDcpError(e.code(), e.what());
  } catch (const std::bad_alloc& e) {
    return {kIoError, std::string("out of memory: ") + e.what()};
  } catch (const std::exception& e) {
    return {kIoError, e.what()};
  }
}

}  // namespace

CliError ClassifyCurrentException() {
  CliError e = ClassifyUnnamed();
  e.message = NameCliFlags(std::move(e.message));
  return e;
}

Checkpoint OpenCheckpoint(const std::string& path, std::shared_ptr<Store> store) {
  Checkpoint c;
  c.uri = path;
  try {
    c.store = store ? std::move(store) : OpenStoreForReading(path);
  } catch (const InvalidArgumentError& e) {
    // A registered scheme refusing its location (e.g. s3:// without credentials) says why
    // itself; the plugin hint is for schemes nobody registered.
    const auto schemes = RegisteredSchemes();
    if (std::find(schemes.begin(), schemes.end(), SplitUri(path).first) != schemes.end()) {
      throw CliError{kUsage, e.what()};
    }
    throw CliError{kUsage, std::string(e.what()) +
                               " (load the backend's plugin with --plugin LIB; registered: " +
                               [] {
                                 std::string s;
                                 for (const auto& n : RegisteredSchemes()) s += " " + n + "://";
                                 return s;
                               }() +
                               ")"};
  }
  std::optional<uint64_t> size;
  try {
    size = c.store->Size(kMetadataName);
    if (!size && c.store->Size(kTorchDcpMetadataName)) {
      // A PyTorch DCP directory (storage/format/torch_dcp.h).
      try {
        c.md = LayoutFor(CheckpointFormat::kTorchDcp).ReadMetadata(*c.store);
        c.format = "torchdcp";
      } catch (const CorruptionError& e) {
        throw CliError{kCorruptMetadata, std::string("corrupt metadata: ") + e.what()};
      } catch (const UnsupportedError& e) {
        throw CliError{kUnsupported, std::string("unsupported checkpoint: ") + e.what()};
      }
      return c;
    }
    const CheckpointLayout& st = LayoutFor(CheckpointFormat::kSafetensors);
    if (!size && st.Detect(*c.store)) {
      // A Hugging Face safetensors directory or file (storage/format/safetensors.h).
      try {
        c.md = st.ReadMetadata(*c.store);
        c.format = "safetensors";
      } catch (const NotFoundError& e) {  // a shard the index names is missing
        throw CliError{ExitCodeFor(ErrorCode::kNotFound), std::string("damaged data: ") + e.what()};
      } catch (const CorruptionError& e) {
        throw CliError{kCorruptMetadata, std::string("corrupt metadata: ") + e.what()};
      } catch (const UnsupportedError& e) {
        throw CliError{kUnsupported, std::string("unsupported checkpoint: ") + e.what()};
      }
      return c;
    }
  } catch (const NotFoundError&) {
  }
  if (!size) {
    bool has_data = false;
    try {
      const auto names = c.store->List();
      has_data = std::any_of(names.begin(), names.end(), [](const std::string& n) {
        return IsDataObjectName(n) || IsTorchDcpDataName(n);
      });
    } catch (const Error&) {
    }
    if (has_data) {
      throw CliError{kIncomplete, "incomplete checkpoint at " + c.store->uri() +
                                      ": data files are present but " + kMetadataName +
                                      " is missing (the save did not finish)"};
    }
    throw CliError{kNotCheckpoint,
                   "not a checkpoint: " + c.store->uri() + " has no " + kMetadataName};
  }
  try {
    c.md = LayoutFor(CheckpointFormat::kDcp).ReadMetadata(*c.store);
    c.format = "dcp";
  } catch (const CorruptionError& e) {
    const bool foreign = std::strstr(e.what(), "not a dcp metadata file") != nullptr;
    throw CliError{foreign ? kNotCheckpoint : kCorruptMetadata,
                   std::string(foreign ? "not a checkpoint: " : "corrupt metadata: ") + e.what()};
  } catch (const UnsupportedError& e) {
    throw CliError{kUnsupported, std::string("unsupported checkpoint: ") + e.what()};
  }
  // Version 2: the tools work on every item, so every data file's index is read (the items of
  // a missing or truncated file are then reported one by one, as in version 1), and rules are
  // listed as the chunks they name.
  try {
    FileIndexResolver::ResolveAvailable(*c.store, c.md);
  } catch (const NotFoundError& e) {
    throw CliError{ExitCodeFor(ErrorCode::kNotFound), std::string("damaged data: ") + e.what()};
  } catch (const CorruptionError& e) {
    throw CliError{ExitCodeFor(ErrorCode::kCorruption), std::string("damaged data: ") + e.what()};
  }
  for (auto& [fqn, entry] : c.md.entries) {
    if (auto* t = std::get_if<TensorMetadata>(&entry); t && t->regular) *t = WithListedChunks(*t);
  }
  return c;
}

void CheckDataFiles(const Checkpoint& c) {
  // The furthest byte each file must hold, and an item that needs it (to name in errors).
  std::map<std::string, std::pair<uint64_t, const MetadataIndex*>> need;
  for (const auto& [index, info] : c.md.storage) {
    auto& n = need.try_emplace(info.relative_path, 0, &index).first->second;
    if (info.offset + info.length > n.first) n = {info.offset + info.length, &index};
  }
  for (const auto& [file, n] : need) {
    const std::optional<uint64_t> size = c.store->Size(file);
    if (!size) {
      throw CliError{ExitCodeFor(ErrorCode::kNotFound),
                     "damaged data: missing file '" + file + "': " + n.second->ToString() +
                         " and the other items it holds cannot be read"};
    }
    if (*size < n.first) {
      throw CliError{ExitCodeFor(ErrorCode::kCorruption),
                     "damaged data: truncated file '" + file + "' (" + std::to_string(*size) +
                         " bytes): " + n.second->ToString() + " needs bytes up to " +
                         std::to_string(n.first)};
    }
  }
}

uint64_t StoredBytesOf(const Metadata& md, const std::string& fqn) {
  uint64_t n = 0;
  for (auto it = md.storage.lower_bound(MetadataIndex{fqn, {}, {}});
       it != md.storage.end() && it->first.fqn == fqn; ++it) {
    n += it->second.length;
  }
  return n;
}

const StorageInfo& ItemInfo(const Metadata& md, const std::string& fqn, const Shape& offsets) {
  auto it = md.storage.find(MetadataIndex{fqn, offsets, {}});
  if (it == md.storage.end()) {
    throw CorruptionError("metadata has no stored item for " + fqn + ShapeToString(offsets));
  }
  return it->second;
}

namespace {

bool IsTorchRecord(const StorageInfo& info) {
  return info.transforms.size() == 1 && info.transforms[0] == kTorchSaveTransform;
}

// Items are raw, zstd-compressed (storage/format/zstd_transform.h) or PyTorch DCP records
// (storage/format/torch_dcp.h); anything else is refused.
void CheckTransforms(const std::string& fqn, const StorageInfo& info) {
  if (!info.transforms.empty() && !IsZstdItem(info) && !IsTorchRecord(info)) {
    std::string t;
    for (const auto& x : info.transforms) t += (t.empty() ? "" : "+") + x;
    throw UnsupportedError("item of '" + fqn + "' in '" + info.relative_path +
                           "' uses transform '" + t + "', which this build cannot read");
  }
}

constexpr size_t kZstdInputBytes = size_t{1} << 20;

std::unique_ptr<ZstdItemReader> OpenZstd(Store& store, ReadableObject& obj, const std::string& what,
                                         const StorageInfo& info) {
  return std::make_unique<ZstdItemReader>(
      obj, info, true, kZstdInputBytes,
      what + " in '" + store.uri() + "/" + info.relative_path + "'");
}

[[noreturn]] void ChecksumMismatch(const std::string& what, const std::string& uri,
                                   const StorageInfo& info, uint32_t actual) {
  throw CorruptionError(
      "checksum mismatch for " + what + " in '" + uri + "/" + info.relative_path + "' at offset " +
      std::to_string(info.offset) + " (" + std::to_string(info.length) + " bytes): stored " +
      (info.zip_crc32 ? "zip CRC-32 " : "crc32c ") + std::to_string(StoredCrc(info).value_or(0)) +
      ", computed " + std::to_string(actual));
}

}  // namespace

TensorStream::TensorStream(Store& store, const Metadata& md, const std::string& fqn,
                           size_t budget_bytes)
    : store_(store), fqn_(fqn), entry_(std::get<TensorMetadata>(md.entries.at(fqn))) {
  const size_t esize = ElementSize(entry_.dtype);
  if (NumElements(entry_.shape) == 0) {
    done_ = true;
    return;
  }
  const Shape& shape = entry_.shape;
  if (!shape.empty()) {
    // The outermost dimension whose single index (later dimensions whole) fits the budget.
    split_ = shape.size() - 1;
    for (size_t d = 0; d < shape.size(); ++d) {
      size_t inner = esize;
      for (size_t k = d + 1; k < shape.size(); ++k) inner *= static_cast<size_t>(shape[k]);
      if (inner <= budget_bytes) {
        split_ = d;
        break;
      }
    }
    inner_bytes_ = esize;
    for (size_t k = split_ + 1; k < shape.size(); ++k) {
      inner_bytes_ *= static_cast<size_t>(shape[k]);
    }
    per_piece_ =
        std::clamp<int64_t>(static_cast<int64_t>(budget_bytes / inner_bytes_), 1, shape[split_]);
    prefix_.assign(split_, 0);
  }
  for (const auto& c : entry_.chunks) {
    if (c.numel() == 0) continue;
    const StorageInfo& info = ItemInfo(md, fqn, c.offsets);
    CheckTransforms(fqn, info);
    chunks_.push_back({&c, &info});
    if (IsTorchRecord(info)) ResolveTorchRecord(chunks_.back());
  }
}

void TensorStream::ResolveTorchRecord(ChunkState& cs) {
  const StorageInfo& info = *cs.info;
  ReadableObject& in = Object(info.relative_path);
  const std::string what = "record of '" + fqn_ + "'" + ShapeToString(cs.chunk->offsets) +
                           " at offset " + std::to_string(info.offset) + " of '" + store_.uri() +
                           "/" + info.relative_path + "'";
  const TorchTensorRecord rec = ResolveTorchTensorRecord(in, info.offset, info.length, what);
  if (rec.dtype != entry_.dtype || rec.sizes != cs.chunk->sizes) {
    throw CorruptionError(what + " holds " + std::string(DTypeName(rec.dtype)) +
                          ShapeToString(rec.sizes) + ", the metadata says " +
                          std::string(DTypeName(entry_.dtype)) + ShapeToString(cs.chunk->sizes));
  }
  const uint64_t nbytes = static_cast<uint64_t>(cs.chunk->numel()) * ElementSize(rec.dtype);
  cs.resolved = std::make_shared<StorageInfo>();
  cs.resolved->relative_path = info.relative_path;
  cs.resolved->length = cs.resolved->raw_length = nbytes;
  cs.info = cs.resolved.get();
  if (rec.covers_storage()) {
    // Streamed like a plain item, checked against the zip entry's CRC-32 at its end.
    cs.resolved->offset = rec.values_begin();
    cs.resolved->zip_crc32 = rec.zip_crc32;
    return;
  }
  // Another layout: the whole storage, read once and CRC-checked, copied row-major into memory.
  const std::vector<char> raw = ReadTorchRecordStorage(in, rec, what, /*verify=*/true);
  cs.memory = std::make_shared<std::vector<char>>(
      AllocateOrThrow([&] { return std::vector<char>(nbytes); }, what, nbytes));
  TensorView src;
  src.data = const_cast<char*>(raw.data()) + (rec.values_begin() - rec.storage_begin);
  src.dtype = rec.dtype;
  src.shape = rec.sizes;
  src.strides = rec.strides;
  CopyTensor(TensorView::FromContiguous(cs.memory->data(), rec.dtype, rec.sizes), src);
}

ReadableObject& TensorStream::Object(const std::string& name) {
  auto& obj = objects_[name];
  if (!obj) obj = store_.Open(name);
  return *obj;
}

bool TensorStream::Next(const char*& data, size_t& nbytes) {
  if (done_) return false;
  if (entry_.shape.empty()) {
    ReadScalar();
  } else {
    ReadPiece();
  }
  data = piece_.data();
  nbytes = piece_.size();
  return true;
}

// A scalar: one chunk, one element.
void TensorStream::ReadScalar() {
  const size_t esize = ElementSize(entry_.dtype);
  piece_.resize(esize);
  ChunkState& cs = chunks_.at(0);
  if (IsZstdItem(*cs.info)) {
    OpenZstd(store_, Object(cs.info->relative_path), fqn_ + "[]", *cs.info)
        ->ReadAll(piece_.data());  // checks the stored bytes' CRC32C too
    done_ = true;
    return;
  }
  if (cs.memory) {
    std::memcpy(piece_.data(), cs.memory->data(), esize);
  } else {
    Object(cs.info->relative_path).ReadAt(cs.info->offset, piece_.data(), esize);
  }
  const uint32_t crc = ItemCrc(*cs.info, 0, piece_.data(), esize);
  if (StoredCrc(*cs.info) && crc != *StoredCrc(*cs.info)) {
    ChecksumMismatch(fqn_ + "[]", store_.uri(), *cs.info, crc);
  }
  done_ = true;
}

// The next piece: indices [pos_, pos_ + n) of the split dimension at the current prefix,
// assembled from every chunk that holds part of it.
void TensorStream::ReadPiece() {
  const Shape& shape = entry_.shape;
  const size_t d = split_;
  const int64_t r0 = pos_;
  const int64_t n = std::min(per_piece_, shape[d] - r0);
  Shape piece_shape(shape.begin() + static_cast<std::ptrdiff_t>(d), shape.end());
  piece_shape[0] = n;
  piece_.resize(static_cast<size_t>(n) * inner_bytes_);
  const TensorView piece = TensorView::FromContiguous(piece_.data(), entry_.dtype, piece_shape);
  for (ChunkState& cs : chunks_) CopyFromChunk(cs, r0, n, piece);
  Advance(n);
}

// The part of chunk `cs` inside the piece (indices [r0, r0 + n) of the split dimension), read
// from the chunk's next bytes and copied into `piece`.
void TensorStream::CopyFromChunk(ChunkState& cs, int64_t r0, int64_t n, const TensorView& piece) {
  const size_t d = split_;
  const Shape& shape = entry_.shape;
  const ChunkMeta& c = *cs.chunk;
  // The chunk must hold the current prefix; `lin` is its row-major index inside the chunk.
  int64_t lin = 0;
  bool inside = true;
  for (size_t k = 0; k < d && inside; ++k) {
    const int64_t li = prefix_[k] - c.offsets[k];
    inside = li >= 0 && li < c.sizes[k];
    lin = lin * c.sizes[k] + li;
  }
  if (!inside) return;
  const int64_t a = std::max(r0, c.offsets[d]);
  const int64_t b = std::min(r0 + n, c.offsets[d] + c.sizes[d]);
  if (a >= b) return;
  size_t chunk_inner = ElementSize(entry_.dtype);
  for (size_t k = d + 1; k < shape.size(); ++k) chunk_inner *= static_cast<size_t>(c.sizes[k]);
  const uint64_t begin = static_cast<uint64_t>(lin * c.sizes[d] + (a - c.offsets[d])) * chunk_inner;
  const size_t len = static_cast<size_t>(b - a) * chunk_inner;
  if (begin != cs.consumed) throw InternalError("chunk of " + fqn_ + " read out of order");
  ReadChunkBytes(cs, begin, len);
  Shape src_shape(c.sizes.begin() + static_cast<std::ptrdiff_t>(d), c.sizes.end());
  Shape dst_off(c.offsets.begin() + static_cast<std::ptrdiff_t>(d), c.offsets.end());
  src_shape[0] = b - a;
  dst_off[0] = a - r0;
  CopyTensor(piece.Narrow(dst_off, src_shape),
             TensorView::FromContiguous(scratch_.data(), entry_.dtype, src_shape));
}

// Bytes [begin, begin + len) of chunk `cs`'s raw bytes into scratch_; the chunk's checks run
// when its last byte has been read.
void TensorStream::ReadChunkBytes(ChunkState& cs, uint64_t begin, size_t len) {
  const ChunkMeta& c = *cs.chunk;
  scratch_.resize(len);
  if (IsZstdItem(*cs.info)) {
    // Compressed chunks are decompressed front to back as they are consumed; one decoder is
    // open per chunk in progress, closed (after its checks) at the chunk's end.
    if (!cs.zstd) {
      cs.zstd = OpenZstd(store_, Object(cs.info->relative_path), fqn_ + ShapeToString(c.offsets),
                         *cs.info);
    }
    cs.zstd->Read(scratch_.data(), len);
    cs.consumed += len;
    if (cs.consumed == cs.info->raw_length) {
      HostBuffer tail;
      cs.zstd->Finish(tail, 64);
      cs.zstd.reset();
    }
    return;
  }
  if (cs.memory) {
    std::memcpy(scratch_.data(), cs.memory->data() + begin, len);
  } else {
    Object(cs.info->relative_path).ReadAt(cs.info->offset + begin, scratch_.data(), len);
  }
  cs.crc = ItemCrc(*cs.info, cs.crc, scratch_.data(), len);
  cs.consumed += len;
  if (cs.consumed == cs.info->length && StoredCrc(*cs.info) && cs.crc != *StoredCrc(*cs.info)) {
    ChecksumMismatch(fqn_ + ShapeToString(c.offsets), store_.uri(), *cs.info, cs.crc);
  }
}

// Advance: along the split dimension by `n`, then the prefix in row-major order.
void TensorStream::Advance(int64_t n) {
  const Shape& shape = entry_.shape;
  const size_t d = split_;
  pos_ += n;
  if (pos_ != shape[d]) return;
  pos_ = 0;
  size_t k = d;
  while (k > 0) {
    --k;
    if (++prefix_[k] < shape[k]) break;
    prefix_[k] = 0;
    if (k == 0) done_ = true;
  }
  if (d == 0) done_ = true;
}

std::string ReadBlob(Store& store, const Metadata& md, const std::string& fqn) {
  const StorageInfo info = ItemInfo(md, fqn, {});  // a copy: {} is a temporary
  CheckTransforms(fqn, info);
  const std::string what =
      "entry '" + fqn + "' from '" + store.uri() + "/" + info.relative_path + "'";
  if (IsTorchRecord(info)) {
    // torch.save bytes of a Python object; a pickled bytes object is unwrapped (as load does).
    std::string bytes =
        AllocateOrThrow([&] { return std::string(info.length, '\0'); }, what, info.length);
    store.Open(info.relative_path)->ReadAt(info.offset, bytes.data(), bytes.size());
    std::string payload;
    if (TorchSaveBytesPayload(bytes, &payload)) return payload;
    return bytes;
  }
  if (IsZstdItem(info)) {
    auto obj = store.Open(info.relative_path);
    auto z = OpenZstd(store, *obj, fqn, info);
    z->CheckFrameHeader();  // before raw_length sizes the buffer
    std::string bytes =
        AllocateOrThrow([&] { return std::string(info.raw_length, '\0'); }, what, info.raw_length);
    z->ReadAll(bytes.data());  // checks the CRC32C too
    return bytes;
  }
  std::string bytes =
      AllocateOrThrow([&] { return std::string(info.length, '\0'); }, what, info.length);
  store.Open(info.relative_path)->ReadAt(info.offset, bytes.data(), bytes.size());
  const uint32_t crc = Crc32c(0, bytes.data(), bytes.size());
  if (info.crc32c && crc != *info.crc32c) ChecksumMismatch(fqn, store.uri(), info, crc);
  return bytes;
}

namespace {

template <typename T>
T Load(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

double HalfToDouble(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  double v;
  if (exp == 0) {
    v = std::ldexp(mant, -24);
  } else if (exp == 31) {
    v = mant ? NAN : INFINITY;
  } else {
    v = std::ldexp(1024 + mant, exp - 25);
  }
  return sign ? -v : v;
}

double E4M3FnToDouble(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 0xf, mant = b & 7;
  double v;
  if (exp == 15 && mant == 7) {
    v = NAN;
  } else if (exp == 0) {
    v = std::ldexp(mant, -9);
  } else {
    v = std::ldexp(8 + mant, exp - 10);
  }
  return sign ? -v : v;
}

}  // namespace

bool IsIntegral(DType d) {
  switch (d) {
    case DType::kBool:
    case DType::kUInt8:
    case DType::kInt8:
    case DType::kInt16:
    case DType::kInt32:
    case DType::kInt64:
    case DType::kUInt16:
    case DType::kUInt32:
    case DType::kUInt64:
      return true;
    default:
      return false;
  }
}

int ComponentsPerElement(DType d) {
  return d == DType::kComplex32 || d == DType::kComplex64 || d == DType::kComplex128 ? 2 : 1;
}

bool ElementAsDouble(DType d, const char* data, size_t i, double& out) {
  switch (d) {
    case DType::kBool:
    case DType::kUInt8:
      out = static_cast<uint8_t>(data[i]);
      return true;
    case DType::kInt8:
      out = static_cast<int8_t>(data[i]);
      return true;
    case DType::kInt16:
      out = Load<int16_t>(data + 2 * i);
      return true;
    case DType::kUInt16:
      out = Load<uint16_t>(data + 2 * i);
      return true;
    case DType::kInt32:
      out = Load<int32_t>(data + 4 * i);
      return true;
    case DType::kUInt32:
      out = Load<uint32_t>(data + 4 * i);
      return true;
    case DType::kInt64:
      out = static_cast<double>(Load<int64_t>(data + 8 * i));
      return true;
    case DType::kUInt64:
      out = static_cast<double>(Load<uint64_t>(data + 8 * i));
      return true;
    case DType::kFloat16:
    case DType::kComplex32:
      out = HalfToDouble(Load<uint16_t>(data + 2 * i));
      return true;
    case DType::kBFloat16:
      out = static_cast<double>(std::bit_cast<float>(uint32_t{Load<uint16_t>(data + 2 * i)} << 16));
      return true;
    case DType::kFloat32:
    case DType::kComplex64:
      out = Load<float>(data + 4 * i);
      return true;
    case DType::kFloat64:
    case DType::kComplex128:
      out = Load<double>(data + 8 * i);
      return true;
    case DType::kFloat8_e5m2:
      out = HalfToDouble(static_cast<uint16_t>(static_cast<uint8_t>(data[i]) << 8));
      return true;
    case DType::kFloat8_e4m3fn:
      out = E4M3FnToDouble(static_cast<uint8_t>(data[i]));
      return true;
    default:
      return false;
  }
}

namespace {

// The length of the valid UTF-8 sequence at the start of `s` and its code point; 0 when the
// first byte does not begin one (a stray continuation byte, an overlong form, a surrogate,
// past U+10FFFF, cut short).
size_t Utf8Sequence(std::string_view s, uint32_t* cp) {
  const auto b = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char c = b(0);
  size_t n;
  uint32_t v;
  uint32_t min;
  if (c < 0x80) {
    *cp = c;
    return 1;
  } else if (c >= 0xc2 && c <= 0xdf) {
    n = 2, v = c & 0x1f, min = 0x80;
  } else if (c >= 0xe0 && c <= 0xef) {
    n = 3, v = c & 0x0f, min = 0x800;
  } else if (c >= 0xf0 && c <= 0xf4) {
    n = 4, v = c & 0x07, min = 0x10000;
  } else {
    return 0;
  }
  if (s.size() < n) return 0;
  for (size_t i = 1; i < n; ++i) {
    if ((b(i) & 0xc0) != 0x80) return 0;
    v = (v << 6) | (b(i) & 0x3f);
  }
  if (v < min || v > 0x10ffff || (v >= 0xd800 && v <= 0xdfff)) return 0;
  *cp = v;
  return n;
}

}  // namespace

std::string Printable(std::string_view s, bool keep_newlines) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    uint32_t cp = 0;
    const size_t n = Utf8Sequence(s.substr(i), &cp);
    if (n == 0 || (cp < 0x20 && !(keep_newlines && cp == '\n')) || cp == 0x7f) {
      const auto c = static_cast<unsigned char>(s[i]);
      out += {'\\', 'x', kHex[c >> 4], kHex[c & 15]};
      ++i;
    } else if (cp >= 0x80 && cp <= 0x9f) {
      out += {'\\', 'u', '0', '0', kHex[cp >> 4], kHex[cp & 15]};
      i += n;
    } else {
      out.append(s.substr(i, n));
      i += n;
    }
  }
  return out;
}

std::string DumpJson(const nlohmann::ordered_json& j) {
  const std::string text = j.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  // nlohmann escapes C0 controls but writes C1 controls (U+0080..U+009F, C2 80..C2 9F: in valid
  // UTF-8, which the dump is, a C2 byte always leads one) as they are; \u escapes are JSON too.
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    const auto next = i + 1 < text.size() ? static_cast<unsigned char>(text[i + 1]) : 0;
    if (c == 0xc2 && next >= 0x80 && next <= 0x9f) {
      out += {'\\', 'u', '0', '0', kHex[next >> 4], kHex[next & 15]};
      ++i;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

std::string FormatTime(int64_t unix_ns) {
  const std::time_t t = static_cast<std::time_t>(unix_ns / 1000000000);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

std::string FormatBytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  if (u == 0) {
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  }
  return buf;
}

Progress::Progress(std::string label, uint64_t total)
    : label_(std::move(label)), total_(total), enabled_(::isatty(STDERR_FILENO) == 1) {
  if (enabled_) Draw(false);
}

Progress::~Progress() {
  if (enabled_) Draw(true);
}

void Progress::Add(uint64_t n) {
  done_ += n;
  if (enabled_) Draw(false);
}

void Progress::Draw(bool final) {
  const int permille =
      total_ == 0 ? 1000 : static_cast<int>(std::min<uint64_t>(1000, done_ * 1000 / total_));
  if (!final && permille == last_permille_) return;
  last_permille_ = permille;
  constexpr int kWidth = 30;
  const int fill = permille * kWidth / 1000;
  std::string bar(fill, '=');
  bar += std::string(kWidth - fill, ' ');
  std::fprintf(stderr, "\r%s [%s] %3d%% %s / %s", label_.c_str(), bar.c_str(), permille / 10,
               FormatBytes(done_).c_str(), FormatBytes(total_).c_str());
  if (final) std::fputc('\n', stderr);
  std::fflush(stderr);
}

void InsertDotted(StateDict& root, const std::string& fqn, StateValue value) {
  StateDict* d = &root;
  size_t start = 0;
  for (size_t dot; (dot = fqn.find('.', start)) != std::string::npos; start = dot + 1) {
    d = &d->Nested(fqn.substr(start, dot - start));
  }
  const std::string leaf = fqn.substr(start);
  if (d->Find(leaf)) throw InvalidArgumentError("duplicate key '" + fqn + "'");
  d->Set(leaf, std::move(value));
}

}  // namespace dcp::cli
