// The "zstd" transform: per-item compression of stored bytes (docs/FORMAT.md, StorageOptions).
//
// A compressed item is exactly one zstd frame (RFC 8878) that records its content size and
// carries zstd's content checksum; it decompresses to the item's `raw_length` raw bytes (a
// tensor chunk in row-major order, or a blob). `length`, `offset` and `crc32c` describe the
// stored (compressed) bytes, so `dcp verify` checks a compressed item without decompressing it.
// Nothing here holds a whole item in memory (beyond the writer's 8 MiB probe) unless it is
// the caller's destination.
//
// Thread safety: one ZstdItemCompressor or ZstdItemReader is used by one thread at a time;
// different objects may be used from different threads at once.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dcp/proto/plan.h"
#include "dcp/proto/staging.h"
#include "dcp/proto/tensor.h"
#include "dcp/storage/storage.h"
#include "dcp/storage/store.h"

namespace dcp {

/// The name recorded in StorageInfo::transforms for a zstd-compressed item.
inline constexpr char kZstdTransform[] = "zstd";

/// True when `info` is a zstd-compressed item (transforms == {"zstd"}).
bool IsZstdItem(const StorageInfo& info);

class ItemDecoder;
struct LoadContext;
/// The read side of the transform (storage/format/layout.h): zstd items decompressed on the way
/// in, straight into a dense destination when the read covers the whole item, else piece by
/// piece through the thread's scratch (ReadZstdBox), to the end of the item when it is
/// verified (once per thread's run, as for raw partial reads).
std::unique_ptr<ItemDecoder> NewZstdItemDecoder(const LoadContext& ctx);

/// InvalidArgumentError when the compression settings of `options` are out of range.
void ValidateCompressionOptions(const StorageOptions& options);

/// Compresses items on save, each into one zstd frame appended to the data file, under the
/// policy of StorageOptions (compression, level, threads, min bytes, max ratio). One per data
/// file being written: it keeps one zstd context for all the file's items.
///
/// Streaming: the item's raw bytes are compressed as they are appended, so a large item never
/// needs an uncompressed (or whole compressed) copy in memory. Whether it pays off is decided
/// on a prefix: the compressed output is held back until `kZstdProbeBytes` raw bytes went in
/// (or the item ended, for smaller items, which are thus judged on their exact size). If the
/// output is then larger than `compression_max_ratio` of the input, compression is abandoned
/// and the item is stored raw; otherwise the output goes to the file and the rest streams
/// through. A large item whose tail compresses worse than its first 8 MiB therefore stays
/// compressed even when the final ratio ends above the bound; zstd stores incompressible blocks
/// raw, so it is never more than about 0.003% (3 bytes per 128 KiB block, plus a header) larger
/// than raw. An abandoned item costs the compression of its first 8 MiB, and its source is read
/// again by the caller's raw write. Memory: the held-back output (at most about 8 MiB) and zstd's
/// context (a few MiB at level 3; more at high levels and with worker threads).
class ZstdItemCompressor {
 public:
  explicit ZstdItemCompressor(const StorageOptions& options);
  ~ZstdItemCompressor();
  ZstdItemCompressor(const ZstdItemCompressor&) = delete;
  ZstdItemCompressor& operator=(const ZstdItemCompressor&) = delete;

  /// Store one item of `raw_bytes` raw bytes, which `write(sink)` appends to `sink` (a
  /// WritableObject that compresses; `write` may stop early by exception, and is called at most
  /// once). Returns the CRC32C of the bytes appended to `out` (one zstd frame) when the item is
  /// stored compressed, or nullopt when it is to be stored raw (compression off, an item below
  /// compression_min_bytes, or a ratio above compression_max_ratio); then nothing was appended
  /// to `out` and the caller writes the item raw. `what` names the item for messages.
  std::optional<uint32_t> Compress(WritableObject& out, uint64_t raw_bytes,
                                   const std::function<void(WritableObject& sink)>& write,
                                   const std::string& what);

 private:
  class Sink;
  StorageOptions options_;
  std::unique_ptr<Sink> sink_;  // created with its zstd context on the first compressed item
};

/// Raw bytes the compressor feeds before it decides whether an item is worth compressing.
inline constexpr uint64_t kZstdProbeBytes = uint64_t{8} << 20;

/// Streams the raw bytes of one zstd item, front to back: reads its stored bytes in pieces of at
/// most `max_input_bytes` (and at most 1 MiB), CRC-ing them when `verify_crc`, and decompresses.
/// Every failure is a CorruptionError naming `what` (the item and its file), the offset and the
/// stored length: undecodable data or a failed zstd checksum, a frame that ends before or runs
/// past `raw_length`, bytes after the frame, or a CRC32C mismatch of the stored bytes.
/// zstd checks its own content checksum whatever `verify_crc` says.
class ZstdItemReader {
 public:
  ZstdItemReader(ReadableObject& in, const StorageInfo& info, bool verify_crc,
                 size_t max_input_bytes, std::string what);
  ~ZstdItemReader();
  ZstdItemReader(const ZstdItemReader&) = delete;
  ZstdItemReader& operator=(const ZstdItemReader&) = delete;

  /// Check the frame header before anything is allocated for the item: it must be a zstd
  /// frame, and a content size it declares must equal raw_length (CorruptionError otherwise).
  /// Reads at most 18 bytes; does not move the stream. Idempotent.
  void CheckFrameHeader();
  /// The whole item, decompressed straight into `dst` (raw_length bytes), and every check of
  /// Finish. Must be the first call.
  void ReadAll(void* dst);
  /// The next `n` raw bytes into `dst`.
  void Read(void* dst, size_t n);
  /// Decompress and discard the next `n` raw bytes, through `scratch` (grown to at most
  /// `limit` bytes).
  void Skip(uint64_t n, HostBuffer& scratch, size_t limit);
  /// Decompress and discard the rest, then check that the item is exactly one frame of
  /// raw_length bytes, followed by nothing, and (when verifying) its CRC32C.
  void Finish(HostBuffer& scratch, size_t limit);
  /// Raw bytes produced (read or skipped) so far.
  uint64_t position() const { return produced_; }

 private:
  struct Context;
  static std::vector<std::unique_ptr<Context>>& Pool();
  // Decompress into [dst, dst+n); with `to_frame_end`, instead run to the end of the frame
  // expecting no more output.
  void Decompress(void* dst, size_t n, bool to_frame_end);
  bool Refill();
  [[noreturn]] void Fail(const std::string& why) const;
  void CheckEnd();

  ReadableObject& in_;
  const StorageInfo& info_;
  bool verify_crc_;
  std::string what_;
  std::unique_ptr<Context> ctx_;  // the zstd decompression context and the input buffer
  uint64_t read_ = 0;             // stored bytes read from `in_` so far
  uint64_t produced_ = 0;         // raw bytes decompressed so far
  uint32_t crc_ = 0;              // CRC32C of the stored bytes read so far
  bool frame_done_ = false;
};

/// Copy the box [box_off, +box_len) of a stored chunk of shape `sizes` whose row-major raw
/// bytes `reader` streams (from the start) into `dst` (shape box_len). Pieces of at most `limit`
/// bytes of whole rows (of the deepest dimension needed to fit) are decompressed into `scratch`
/// and the part inside the box copied; the bytes before the box are decompressed and
/// discarded. With `to_end` the rest of the item is decompressed too and every check of
/// ZstdItemReader::Finish made; without it reading stops after the box (nothing is verified).
void ReadZstdBox(ZstdItemReader& reader, DType dtype, const Shape& sizes, const Shape& box_off,
                 const Shape& box_len, const TensorView& dst, HostBuffer& scratch, size_t limit,
                 bool to_end);

}  // namespace dcp
