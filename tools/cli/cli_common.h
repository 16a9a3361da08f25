// Shared pieces of the `dcp` command line: exit codes, opening a checkpoint with a precise
// diagnosis, bounded-memory streaming of a tensor in row-major order, and element decoding.
//
// Nothing here needs MPI or LibTorch; everything reads through the Store interface, so every
// Store-based scheme (file://, mem://, a plugin's) works.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "dcp/proto/error.h"
#include "dcp/proto/plan.h"
#include "dcp/proto/state_dict.h"
#include "dcp/storage/format/zstd_transform.h"
#include "dcp/storage/store.h"

namespace dcp::cli {

/// Exit codes of `dcp` (printed by `dcp --help`).
enum Exit : int {
  kOk = 0,
  kFailed = 1,           // verify found damage; diff found differences
  kUsage = 2,            // bad command line
  kNotCheckpoint = 3,    // no metadata and no data files, or not a dcp metadata file
  kIncomplete = 4,       // data files but no metadata (an unfinished save)
  kCorruptMetadata = 5,  // metadata damaged or inconsistent
  kUnsupported = 6,      // newer format version, unknown transform, or a feature not built
  kIoError = 7,          // storage failed, out of memory, or any other error
};

/// The text for `dcp --help`.
std::string ExitCodeHelp();
/// The name of an exit code's category in `--json` output ("usage", "damaged_data", ...).
const char* ExitCategory(int code);

/// A failure with the exit code it maps to.
struct CliError {
  int code;
  std::string message;
};

/// The exit code for damage of kind `code` found in a checkpoint whose metadata opened fine
/// (the one mapping every command uses, so the same damage gives the same exit code in verify,
/// diff and convert): a missing (kNotFound) or truncated/damaged (kCorruption) data file or
/// item -> kFailed; an unknown transform (kUnsupported) -> kUnsupported; a bad request
/// (kInvalidArgument, kAlreadyExists) -> kUsage; anything else, out of memory included -> kIoError.
int ExitCodeFor(ErrorCode code);

/// Map the exception being handled (call inside a catch block) to a CliError (via ExitCodeFor
/// for dcp errors; a bare std::bad_alloc is kIoError, "out of memory"). The message names the
/// CLI's flags where the library's names its option fields (NameCliFlags), and a one-process
/// save's failure is reported as itself, without the collective wrapper.
CliError ClassifyCurrentException();
/// `message` with the library option fields it names replaced by the `dcp` flags that set them
/// ("pass overwrite to replace it" -> "use --overwrite to replace it", "compression_level" ->
/// "--compress-level").
std::string NameCliFlags(std::string message);

/// An opened checkpoint: its store and its validated metadata.
struct Checkpoint {
  std::string uri;
  std::string format;  // "dcp", or "torchdcp" for a PyTorch DCP directory
  std::shared_ptr<Store> store;
  Metadata md;
};

/// Open `path` (a directory, file://, mem:// or a registered Store-based URI) and read its
/// metadata. Throws CliError with kNotCheckpoint / kIncomplete / kCorruptMetadata / kUnsupported.
/// `store`, when given, is read in place of the store `path` opens (e.g. a SafetensorsFileView
/// of a file whose name does not end in .safetensors); `path` still names it in messages.
Checkpoint OpenCheckpoint(const std::string& path, std::shared_ptr<Store> store = nullptr);
/// Check that every data file the metadata references exists and holds the bytes placed in it,
/// before anything is allocated or read from it (what load does too). CliError naming the file
/// and an item otherwise: missing -> ExitCodeFor(kNotFound), truncated -> ExitCodeFor(kCorruption).
void CheckDataFiles(const Checkpoint& c);

/// Sum of the stored lengths of the items of `fqn`.
uint64_t StoredBytesOf(const Metadata& md, const std::string& fqn);
/// The stored item for a chunk; CorruptionError when absent.
const StorageInfo& ItemInfo(const Metadata& md, const std::string& fqn, const Shape& offsets);

/// Pulls the bytes of one tensor in row-major (C) order, a bounded piece at a time. A piece is a
/// run of consecutive indices along one split dimension d (with every later dimension whole, at
/// one fixed index of each earlier dimension), so it is contiguous in the row-major output; d is
/// the outermost dimension whose slices fit in `budget_bytes`, so memory stays at about
/// 2 x `budget_bytes` whatever the shape. Each stored chunk is read front to back in pieces;
/// its CRC32C is checked when its last piece has been read (CorruptionError naming the fqn,
/// the file and the offset on mismatch). Compressed (zstd) chunks are decompressed as they are
/// consumed, with one decoder (zstd's window, up to 8 MiB at levels up to 19, plus a 1 MiB
/// input buffer) per chunk in progress: for a tensor split along a later dimension than the
/// pieces, all its chunks are in progress at once.
class TensorStream {
 public:
  TensorStream(Store& store, const Metadata& md, const std::string& fqn,
               size_t budget_bytes = 64 << 20);
  /// The next piece of the tensor's bytes. False at the end.
  bool Next(const char*& data, size_t& nbytes);
  const TensorMetadata& entry() const { return entry_; }

 private:
  struct ChunkState {
    const ChunkMeta* chunk;
    const StorageInfo* info;
    // A PyTorch DCP record: its values as a plain item (row-major), or materialised row-major
    // in memory (a record saved with other strides, e.g. a transposed tensor).
    std::shared_ptr<StorageInfo> resolved{};
    std::shared_ptr<std::vector<char>> memory{};
    uint32_t crc = 0;
    uint64_t consumed = 0;                   // raw bytes
    std::unique_ptr<ZstdItemReader> zstd{};  // for a compressed chunk being read
  };
  ReadableObject& Object(const std::string& name);
  void ResolveTorchRecord(ChunkState& cs);
  void ReadScalar();
  void ReadPiece();
  void CopyFromChunk(ChunkState& cs, int64_t r0, int64_t n, const TensorView& piece);
  void ReadChunkBytes(ChunkState& cs, uint64_t begin, size_t len);
  void Advance(int64_t n);

  Store& store_;
  std::string fqn_;
  const TensorMetadata& entry_;
  std::vector<ChunkState> chunks_;
  std::map<std::string, std::unique_ptr<ReadableObject>> objects_;
  size_t split_ = 0;        // the split dimension d
  size_t inner_bytes_ = 0;  // bytes of one index of dimension d (later dimensions whole)
  int64_t per_piece_ = 1;   // indices of dimension d per piece
  Shape prefix_;            // current index of each dimension before d
  int64_t pos_ = 0;         // next index along dimension d
  bool done_ = false;
  std::vector<char> piece_, scratch_;
};

/// Read a byte entry (blob) whole, decompressed, checking its CRC32C. A zstd frame header must
/// declare raw_length before the blob is allocated; an allocation failure is a ResourceError
/// naming the entry, the file and the size.
std::string ReadBlob(Store& store, const Metadata& md, const std::string& fqn);

/// Element `i` of `data` (of `dtype`) as a double, for floating and integer dtypes; for complex
/// dtypes `i` indexes the real/imaginary components. False for dtypes without a numeric
/// decoding here (fnuz float8 kinds, e8m0), which are compared bytewise.
bool ElementAsDouble(DType dtype, const char* data, size_t i, double& out);
/// True for bool and integer dtypes (compared exactly).
bool IsIntegral(DType dtype);
/// Numeric components per element: 2 for complex dtypes, else 1.
int ComponentsPerElement(DType dtype);

/// `s` as it may be shown on a terminal: every string read from a checkpoint (entry and file
/// names, metadata strings, messages quoting them) goes through this before it is printed, so
/// a hostile name cannot send escape sequences or move the cursor. Control characters (C0, DEL,
/// and the C1 controls U+0080..U+009F that some terminals take as CSI), and bytes that are not
/// valid UTF-8, become \xNN (C1: \u00NN); valid UTF-8 stays as it is. With `keep_newlines`,
/// '\n' stays (for messages of several lines, e.g. one failure per rank).
std::string Printable(std::string_view s, bool keep_newlines = false);
/// `j` as --json prints it (indented): strings that are not valid UTF-8 have U+FFFD in place of
/// their bad bytes (nlohmann-json would throw), control characters (C1 included) are JSON
/// escapes.
std::string DumpJson(const nlohmann::ordered_json& j);

/// "2026-11-22 03:04:05 UTC".
std::string FormatTime(int64_t unix_ns);
/// "1.5 MiB".
std::string FormatBytes(uint64_t bytes);

/// A progress bar on stderr, drawn only when stderr is a terminal.
class Progress {
 public:
  Progress(std::string label, uint64_t total);
  ~Progress();
  void Add(uint64_t n);

 private:
  void Draw(bool final);
  std::string label_;
  uint64_t total_, done_ = 0;
  int last_permille_ = -1;
  bool enabled_;
};

/// Insert `value` at the dotted path `fqn`, rebuilding nesting ("model.w" -> model/w).
/// InvalidArgumentError when the key is already present.
void InsertDotted(StateDict& root, const std::string& fqn, StateValue value);

}  // namespace dcp::cli
