#include "dcp/storage/format/zstd_transform.h"

// For ZSTD_d_stableOutBuffer (zstd >= 1.4.4; its value has not changed since). When the library
// refuses it, reading falls back to zstd's buffered mode.
#define ZSTD_STATIC_LINKING_ONLY
#include <zstd.h>
#include <zstd_errors.h>

#include <algorithm>
#include <cmath>

#include "dcp/proto/checksum.h"
#include "dcp/proto/error.h"
#include "dcp/proto/slab_copy.h"
#include "dcp/storage/format/layout.h"

namespace dcp {

namespace {

// Compressed output is handed to the data file in pieces of about this size once an item is
// committed to compression (it is buffered whole while the probe decides).
constexpr size_t kDrainBytes = size_t{1} << 20;
// Upper bound on the input buffer of a reader (stored bytes read per ReadAt).
constexpr size_t kMaxInputBytes = size_t{1} << 20;

// Thrown through the caller's write function when the probe decides an item is not worth
// compressing; Compress catches it. Not a dcp::Error: it never leaves this file.
struct Declined {};

}  // namespace

bool IsZstdItem(const StorageInfo& info) {
  return info.transforms.size() == 1 && info.transforms[0] == kZstdTransform;
}

void ValidateCompressionOptions(const StorageOptions& o) {
  if (o.compression != Compression::kNone && o.compression != Compression::kZstd) {
    throw InvalidArgumentError("unknown compression " +
                               std::to_string(static_cast<int>(o.compression)));
  }
  if (o.compression == Compression::kNone) return;
  if (o.compression_level < ZSTD_minCLevel() || o.compression_level > ZSTD_maxCLevel()) {
    throw InvalidArgumentError("compression_level " + std::to_string(o.compression_level) +
                               " is outside zstd's range [" + std::to_string(ZSTD_minCLevel()) +
                               ", " + std::to_string(ZSTD_maxCLevel()) + "]");
  }
  const ZSTD_bounds workers = ZSTD_cParam_getBounds(ZSTD_c_nbWorkers);
  if (o.compression_threads < 0 ||
      (o.compression_threads > 0 &&
       (ZSTD_isError(workers.error) || o.compression_threads > workers.upperBound))) {
    throw InvalidArgumentError(
        "compression_threads " + std::to_string(o.compression_threads) +
        " is not supported by this libzstd (at most " +
        std::to_string(ZSTD_isError(workers.error) ? 0 : workers.upperBound) + ")");
  }
  if (!(o.compression_max_ratio > 0 && o.compression_max_ratio <= 1)) {
    throw InvalidArgumentError("compression_max_ratio must be in (0, 1], got " +
                               std::to_string(o.compression_max_ratio));
  }
}

// ---- writing ----

// A WritableObject that compresses what is appended into one zstd frame per item. Output is
// held in `buf_` until the probe accepts the item, then drained to the data file in ~1 MiB
// pieces, CRC-ing exactly the bytes that reach it.
class ZstdItemCompressor::Sink : public WritableObject {
 public:
  explicit Sink(const StorageOptions& o)
      : cctx_(ZSTD_createCCtx()), max_ratio_(o.compression_max_ratio) {
    if (cctx_ == nullptr) throw std::bad_alloc();
    Check(ZSTD_CCtx_setParameter(cctx_, ZSTD_c_compressionLevel, o.compression_level), "level");
    // zstd's own checksum of the raw content: a reader detects damage even with
    // verify_checksums off, and a decompressor bug could not go unnoticed.
    Check(ZSTD_CCtx_setParameter(cctx_, ZSTD_c_checksumFlag, 1), "checksum flag");
    if (o.compression_threads > 0) {
      Check(ZSTD_CCtx_setParameter(cctx_, ZSTD_c_nbWorkers, o.compression_threads), "threads");
      // Jobs smaller than zstd's default (4 windows, 8 MiB at level 3) so that the workers
      // share even the probe's 8 MiB and items of a few MiB.
      Check(ZSTD_CCtx_setParameter(cctx_, ZSTD_c_jobSize, 1 << 20), "job size");
    }
  }
  ~Sink() override { ZSTD_freeCCtx(cctx_); }

  void Begin(WritableObject& out, uint64_t raw, const std::string& what) {
    out_ = &out;
    what_ = &what;
    raw_ = raw;
    consumed_ = 0;
    used_ = 0;
    crc_ = 0;
    committed_ = false;
    Check(ZSTD_CCtx_reset(cctx_, ZSTD_reset_session_only), "reset");
    // Recorded in the frame header, and lets zstd size its window to the item.
    Check(ZSTD_CCtx_setPledgedSrcSize(cctx_, raw), "pledged size");
    // Room for everything the probe may hold back, so the buffer never grows past that.
    const size_t room = ZSTD_compressBound(static_cast<size_t>(std::min(raw, kZstdProbeBytes))) +
                        ZSTD_CStreamOutSize();
    if (buf_.size() < room) buf_.resize(room);
  }

  void Append(const void* data, size_t n) override {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      size_t take = n;
      const bool probing = !committed_ && raw_ > kZstdProbeBytes;
      if (probing) take = static_cast<size_t>(std::min<uint64_t>(n, kZstdProbeBytes - consumed_));
      Feed(p, take, ZSTD_e_continue);
      consumed_ += take;
      p += take;
      n -= take;
      if (probing && consumed_ == kZstdProbeBytes) {
        Feed(nullptr, 0, ZSTD_e_flush);  // all output for the probe's input, to measure it
        if (!Pays(used_, consumed_)) throw Declined{};
        committed_ = true;
        Drain();
      }
    }
  }
  // The frame is ended by Finish; the data file is synced and closed by its owner.
  void Sync() override {}
  void Close() override {}
  uint64_t size() const override { return consumed_; }

  // End the frame. The CRC32C of the frame's bytes, all appended to the data file, or nullopt
  // when the item (judged whole: it never reached the probe's end) does not pay off.
  std::optional<uint32_t> Finish() {
    if (consumed_ != raw_) {
      throw InternalError("item " + *what_ + " produced " + std::to_string(consumed_) +
                          " bytes for compression, expected " + std::to_string(raw_));
    }
    Feed(nullptr, 0, ZSTD_e_end);
    if (!committed_ && !Pays(used_, raw_)) return std::nullopt;
    committed_ = true;
    Drain();
    return crc_;
  }

 private:
  void Check(size_t r, const char* what) const {
    if (ZSTD_isError(r)) {
      throw InternalError(std::string("zstd compression (") + what +
                          (what_ ? ") of item " + *what_ : std::string(")")) +
                          " failed: " + ZSTD_getErrorName(r));
    }
  }

  bool Pays(uint64_t stored, uint64_t raw) const {
    return stored < raw && static_cast<double>(stored) <= max_ratio_ * static_cast<double>(raw);
  }

  // Compress [p, p+n) with `mode`; for flush and end, until zstd has nothing left to emit.
  void Feed(const char* p, size_t n, ZSTD_EndDirective mode) {
    ZSTD_inBuffer in{p, n, 0};
    for (;;) {
      if (buf_.size() - used_ < ZSTD_CStreamOutSize()) {
        buf_.resize(std::max(buf_.size() * 2, used_ + ZSTD_CStreamOutSize()));
      }
      ZSTD_outBuffer out{buf_.data(), buf_.size(), used_};
      const size_t remaining = ZSTD_compressStream2(cctx_, &out, &in, mode);
      Check(remaining, "stream");
      used_ = out.pos;
      if (committed_ && used_ >= kDrainBytes) Drain();
      if (mode == ZSTD_e_continue ? in.pos == in.size : remaining == 0) return;
    }
  }

  void Drain() {
    if (used_ == 0) return;
    out_->Append(buf_.data(), used_);
    crc_ = Crc32c(crc_, buf_.data(), used_);
    used_ = 0;
  }

  ZSTD_CCtx* cctx_;
  double max_ratio_;
  WritableObject* out_ = nullptr;
  const std::string* what_ = nullptr;
  uint64_t raw_ = 0, consumed_ = 0;
  std::vector<char> buf_;  // compressed bytes not yet in the data file: [0, used_)
  size_t used_ = 0;
  uint32_t crc_ = 0;
  bool committed_ = false;
};

ZstdItemCompressor::ZstdItemCompressor(const StorageOptions& options) : options_(options) {
  ValidateCompressionOptions(options_);
}

ZstdItemCompressor::~ZstdItemCompressor() = default;

std::optional<uint32_t> ZstdItemCompressor::Compress(
    WritableObject& out, uint64_t raw_bytes, const std::function<void(WritableObject&)>& write,
    const std::string& what) {
  if (options_.compression != Compression::kZstd || raw_bytes == 0 ||
      raw_bytes < options_.compression_min_bytes) {
    return std::nullopt;
  }
  if (!sink_) sink_ = std::make_unique<Sink>(options_);
  sink_->Begin(out, raw_bytes, what);
  try {
    write(*sink_);
  } catch (const Declined&) {
    return std::nullopt;  // nothing reached `out`; the next Begin resets the zstd session
  }
  return sink_->Finish();
}

// ---- reading ----

// A decompression context and its input buffer. Contexts are kept per thread for reuse (a
// load reads many items on few threads); each reader holds its own while it lives, so several
// readers may be open on one thread (the CLI streams the chunks of a tensor side by side).
struct ZstdItemReader::Context {
  ZSTD_DCtx* dctx = nullptr;
  std::vector<char> in;
  size_t in_pos = 0, in_size = 0;
  Context() : dctx(ZSTD_createDCtx()) {
    if (dctx == nullptr) throw std::bad_alloc();
  }
  ~Context() { ZSTD_freeDCtx(dctx); }
};

namespace {
constexpr size_t kPooledContexts = 4;
}  // namespace

std::vector<std::unique_ptr<ZstdItemReader::Context>>& ZstdItemReader::Pool() {
  static thread_local std::vector<std::unique_ptr<Context>> pool;
  return pool;
}

ZstdItemReader::ZstdItemReader(ReadableObject& in, const StorageInfo& info, bool verify_crc,
                               size_t max_input_bytes, std::string what)
    : in_(in),
      info_(info),
      verify_crc_(verify_crc && info.crc32c.has_value()),
      what_(std::move(what)) {
  auto& pool = Pool();
  if (pool.empty()) {
    ctx_ = std::make_unique<Context>();
  } else {
    ctx_ = std::move(pool.back());
    pool.pop_back();
  }
  ZSTD_DCtx_reset(ctx_->dctx, ZSTD_reset_session_and_parameters);
  const size_t cap = std::clamp<size_t>(max_input_bytes, 64, kMaxInputBytes);
  ctx_->in.resize(static_cast<size_t>(std::min<uint64_t>(cap, std::max<uint64_t>(info.length, 1))));
  ctx_->in_pos = ctx_->in_size = 0;
}

void ZstdItemReader::CheckFrameHeader() {
  // A hostile raw_length would otherwise size the caller's buffer; the frame header says what
  // the frame really holds (dcp always records it).
  char head[ZSTD_FRAMEHEADERSIZE_MAX];
  const size_t n = static_cast<size_t>(std::min<uint64_t>(sizeof head, info_.length));
  in_.ReadAt(info_.offset, head, n);
  const unsigned long long declared = ZSTD_getFrameContentSize(head, n);
  if (declared == ZSTD_CONTENTSIZE_ERROR) Fail("not a zstd frame");
  if (declared != ZSTD_CONTENTSIZE_UNKNOWN && declared != info_.raw_length) {
    Fail("the frame declares " + std::to_string(declared) + " raw bytes: it " +
         (declared < info_.raw_length ? "decompresses to only " + std::to_string(declared)
                                      : "holds more than the recorded") +
         " of raw_length " + std::to_string(info_.raw_length));
  }
}

ZstdItemReader::~ZstdItemReader() {
  auto& pool = Pool();
  if (pool.size() < kPooledContexts) pool.push_back(std::move(ctx_));
}

void ZstdItemReader::Fail(const std::string& why) const {
  throw CorruptionError("corrupt compressed item " + what_ + " at offset " +
                        std::to_string(info_.offset) + " (" + std::to_string(info_.length) +
                        " bytes, zstd, raw_length " + std::to_string(info_.raw_length) +
                        "): " + why);
}

bool ZstdItemReader::Refill() {
  if (read_ == info_.length) return false;
  const size_t n = static_cast<size_t>(std::min<uint64_t>(ctx_->in.size(), info_.length - read_));
  in_.ReadAt(info_.offset + read_, ctx_->in.data(), n);
  if (verify_crc_) crc_ = Crc32c(crc_, ctx_->in.data(), n);
  read_ += n;
  ctx_->in_pos = 0;
  ctx_->in_size = n;
  return true;
}

void ZstdItemReader::Decompress(void* dst, size_t n, bool to_frame_end) {
  ZSTD_outBuffer out{dst, n, 0};
  while (out.pos < out.size || to_frame_end) {
    if (frame_done_) {
      if (to_frame_end) return;
      Fail("it decompresses to only " + std::to_string(produced_ + out.pos) + " bytes");
    }
    if (ctx_->in_pos == ctx_->in_size) Refill();
    ZSTD_inBuffer in{ctx_->in.data(), ctx_->in_size, ctx_->in_pos};
    const size_t out_before = out.pos, in_before = in.pos;
    const size_t r = ZSTD_decompressStream(ctx_->dctx, &out, &in);
    ctx_->in_pos = in.pos;
    if (ZSTD_isError(r)) Fail(std::string("zstd: ") + ZSTD_getErrorName(r));
    if (to_frame_end && out.pos > 0) {
      Fail("it decompresses to more than " + std::to_string(info_.raw_length) + " bytes");
    }
    if (r == 0) {
      frame_done_ = true;
    } else if (out.pos == out_before && in.pos == in_before && read_ == info_.length &&
               ctx_->in_pos == ctx_->in_size) {
      Fail("the zstd frame is truncated after " + std::to_string(produced_ + out.pos) +
           " decompressed bytes");
    }
  }
  produced_ += out.pos;
}

void ZstdItemReader::Read(void* dst, size_t n) {
  if (n > info_.raw_length - produced_) {
    throw InternalError("read past the raw length of compressed item " + what_);
  }
  if (n > 0) Decompress(dst, n, false);
}

void ZstdItemReader::ReadAll(void* dst) {
  if (produced_ != 0) throw InternalError("ReadAll must be the first read of " + what_);
  const size_t n = static_cast<size_t>(info_.raw_length);
  if (ZSTD_isError(ZSTD_DCtx_setParameter(ctx_->dctx, ZSTD_d_stableOutBuffer, 1))) {
    Read(dst, n);  // buffered: zstd decodes into its window, then copies out
    CheckEnd();
    return;
  }
  // Stable output: zstd decodes straight into `dst` (no window buffer, no copy). The output
  // buffer must stay the same across calls, so this runs to the end of the frame on its own.
  char none;
  ZSTD_outBuffer out{n > 0 ? dst : &none, n, 0};
  while (!frame_done_) {
    if (ctx_->in_pos == ctx_->in_size) Refill();
    ZSTD_inBuffer in{ctx_->in.data(), ctx_->in_size, ctx_->in_pos};
    const size_t out_before = out.pos, in_before = in.pos;
    const size_t r = ZSTD_decompressStream(ctx_->dctx, &out, &in);
    ctx_->in_pos = in.pos;
    if (ZSTD_isError(r)) {
      if (ZSTD_getErrorCode(r) == ZSTD_error_dstSize_tooSmall) {
        Fail("it decompresses to more than " + std::to_string(n) + " bytes");
      }
      Fail(std::string("zstd: ") + ZSTD_getErrorName(r));
    }
    if (r == 0) {
      frame_done_ = true;
    } else if (out.pos == out_before && in.pos == in_before && read_ == info_.length &&
               ctx_->in_pos == ctx_->in_size) {
      Fail("the zstd frame is truncated after " + std::to_string(out.pos) + " decompressed bytes");
    }
  }
  if (out.pos != n) Fail("it decompresses to only " + std::to_string(out.pos) + " bytes");
  produced_ = n;
  CheckEnd();
}

void ZstdItemReader::Skip(uint64_t n, HostBuffer& scratch, size_t limit) {
  while (n > 0) {
    const size_t piece = static_cast<size_t>(std::min<uint64_t>(std::max<size_t>(limit, 1), n));
    scratch.Reserve(piece);
    Read(scratch.data(), piece);
    n -= piece;
  }
}

void ZstdItemReader::Finish(HostBuffer& scratch, size_t limit) {
  Skip(info_.raw_length - produced_, scratch, limit);
  CheckEnd();
}

void ZstdItemReader::CheckEnd() {
  char probe[64];
  Decompress(probe, sizeof probe, true);  // to the end of the frame (its checksum); no output
  const uint64_t consumed = read_ - (ctx_->in_size - ctx_->in_pos);
  if (consumed != info_.length) {
    Fail(std::to_string(info_.length - consumed) + " stored bytes follow the zstd frame");
  }
  if (verify_crc_ && crc_ != *info_.crc32c) {
    throw CorruptionError("checksum mismatch for " + what_ + " at offset " +
                          std::to_string(info_.offset) + " (" + std::to_string(info_.length) +
                          " bytes, zstd): stored crc32c " + std::to_string(*info_.crc32c) +
                          ", computed " + std::to_string(crc_));
  }
}

namespace {

// Walks a stored chunk in row-major order, reading the pieces inside the box and skipping the
// rest (skips are merged and only done when a later read needs them).
struct BoxWalk {
  ZstdItemReader& reader;
  DType dtype;
  const Shape& sizes;
  const Shape& off;
  const Shape& len;
  const TensorView& dst;
  HostBuffer& scratch;
  size_t limit;
  size_t split = 0;           // the dimension read in pieces; dimensions before it go one by one
  int64_t per_piece = 1;      // indices of `split` per piece
  Shape strides{};            // row-major strides of the stored chunk, in elements
  uint64_t pending_skip = 0;  // bytes to skip before the next read
  Shape prefix{};             // box-relative indices of the dimensions before `split`

  uint64_t Bytes(size_t d, int64_t count) const {
    return static_cast<uint64_t>(count) * static_cast<uint64_t>(strides[d]) * ElementSize(dtype);
  }

  void Walk(size_t d) {
    pending_skip += Bytes(d, off[d]);
    if (d < split) {
      for (int64_t i = 0; i < len[d]; ++i) {
        prefix.push_back(i);
        Walk(d + 1);
        prefix.pop_back();
      }
    } else {
      for (int64_t i = 0; i < len[d]; i += per_piece) {
        const int64_t n = std::min(per_piece, len[d] - i);
        reader.Skip(pending_skip, scratch, limit);
        pending_skip = 0;
        const size_t bytes = static_cast<size_t>(Bytes(d, n));
        scratch.Reserve(bytes);
        reader.Read(scratch.data(), bytes);
        CopySlabIntoBox(dst, scratch.data(), dtype, sizes, off, len, prefix, d, i, n);
      }
    }
    pending_skip += Bytes(d, sizes[d] - off[d] - len[d]);
  }
};

}  // namespace

void ReadZstdBox(ZstdItemReader& reader, DType dtype, const Shape& sizes, const Shape& box_off,
                 const Shape& box_len, const TensorView& dst, HostBuffer& scratch, size_t limit,
                 bool to_end) {
  const size_t esize = ElementSize(dtype);
  limit = std::max(limit, esize);
  if (sizes.empty()) {  // a scalar: one element
    scratch.Reserve(esize);
    reader.Read(scratch.data(), esize);
    CopyTensor(dst, TensorView::FromContiguous(scratch.data(), dtype, {}));
  } else if (NumElements(box_len) > 0) {
    BoxWalk w{reader, dtype, sizes, box_off, box_len, dst, scratch, limit};
    w.strides = ContiguousStrides(sizes);
    // The outermost dimension one index of which (later dimensions whole) fits the limit.
    w.split = sizes.size() - 1;
    for (size_t d = 0; d < sizes.size(); ++d) {
      if (w.Bytes(d, 1) <= limit) {
        w.split = d;
        break;
      }
    }
    w.per_piece = std::max<int64_t>(1, static_cast<int64_t>(limit / w.Bytes(w.split, 1)));
    w.Walk(0);
  }
  if (to_end) reader.Finish(scratch, limit);
}

namespace {

class ZstdItemDecoder : public ItemDecoder {
 public:
  explicit ZstdItemDecoder(const LoadContext& ctx) : ctx_(ctx) {}

  bool Decodes(const StorageInfo& info) const override { return IsZstdItem(info); }

  void Read(const ItemRead& r) override {
    const ReadItem& item = r.item;
    const StorageInfo& info = r.info;
    const std::string& uri = ctx_.store.uri();
    const StorageOptions& options = ctx_.options;
    const size_t limit = ScratchLimit(options);
    ZstdItemReader z(r.in, info, options.verify_checksums, limit,
                     item.storage_index.ToString() + " in '" + uri + "/" + r.file + "'");
    if (item.type == ReadItemType::kBytes) {
      z.CheckFrameHeader();  // before raw_length sizes the blob (a tensor's destination exists)
      std::string bytes = AllocateOrThrow(
          [&] { return std::string(info.raw_length, '\0'); },
          item.storage_index.ToString() + " from '" + uri + "/" + r.file + "'", info.raw_length);
      z.ReadAll(bytes.data());
      r.planner.LoadBytes(item, std::move(bytes));
      return;
    }
    const ChunkMeta chunk = StoredChunk(ctx_.metadata, item, uri);
    const auto& entry = StoredEntry(ctx_.metadata, item);
    TensorView dst = CheckedDestination(r.planner, item, entry);
    const bool whole = item.lengths == chunk.sizes;
    // A device destination takes the scratch path: each decompressed piece is copied host to
    // device by CopyTensor (proto/device/device.h).
    if (whole && IsDense(dst) && dst.device.is_cpu()) {
      // The lowest address of a dense view is its data pointer.
      z.ReadAll(dst.data);
    } else {
      const bool to_end = whole || (options.verify_partial_reads && options.verify_checksums &&
                                    r.verified.insert(item.storage_index).second);
      ReadZstdBox(z, entry.dtype, chunk.sizes, item.storage_offsets, item.lengths, dst, r.scratch,
                  limit, to_end);
    }
    r.planner.CommitTensor(item, dst);
  }

 private:
  LoadContext ctx_;
};

}  // namespace

std::unique_ptr<ItemDecoder> NewZstdItemDecoder(const LoadContext& ctx) {
  return std::make_unique<ZstdItemDecoder>(ctx);
}

}  // namespace dcp
