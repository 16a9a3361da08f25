// `dcp convert`: checkpoints to and from safetensors and torch.save files.
#pragma once

#include <cstddef>
#include <string>

#include "tools/cli/cli_common.h"

namespace dcp::cli {

struct ConvertOptions {
  bool overwrite = false;                  // replace an existing destination
  size_t budget_bytes = size_t{64} << 20;  // per-piece memory bound when streaming
  std::string compress = "none";           // "zstd": compress the items of a dcp destination
  int compress_level = 3;                  // zstd level
  uint32_t metadata_version = 2;           // of a dcp destination (docs/FORMAT.md)
};

/// Every entry of `src` into one safetensors file. Streams: the header first, then each tensor
/// assembled from its chunks in row-major order, a bounded piece at a time. Blobs become U8
/// tensors, named in the header's __metadata__ "dcp.blobs" so that the way back restores them.
void ExportSafetensors(const Checkpoint& src, const std::string& out, const ConvertOptions& o);
/// A safetensors file into a new dcp checkpoint at `out_uri`. Its header is read by the
/// safetensors reader (OpenCheckpoint: the bounds and checks verify and load apply, with their
/// messages); the file is then memory-mapped and saved straight from the mapping (no copy of
/// the data in memory).
void ImportSafetensors(const std::string& in, const std::string& out_uri, const ConvertOptions& o);

/// Save `sd` (an imported file's entries) as a new checkpoint at `out_uri`, as `o` asks
/// (overwrite, compression).
void SaveConverted(const StateDict& sd, const std::string& out_uri, const ConvertOptions& o);

/// dcp <-> torch.save files (a file Python's torch.load reads: a dict {fqn: tensor}, blobs as
/// uint8 tensors listed under "__dcp_blobs__"). To torch.save: implemented in a module loaded on
/// demand (libdcp_cli_torch.so, built with LibTorch), so that the other commands do not pay
/// LibTorch's start-up; CliError kUnsupported when this build has no such module. LibTorch
/// pickles one value, so the whole state is in memory at once. From torch.save: ImportTorch.
void ConvertTorch(bool to_torch, const std::string& src, const std::string& dst,
                  const ConvertOptions& o);

/// A torch.save file into a new dcp checkpoint at `out_uri`, without LibTorch: what
/// torch.save(model.state_dict()) or torch.save({...nested dicts...}) writes. The file is
/// memory-mapped and saved from the mapping (tensors that share a storage, and strided views,
/// included). Nested dict keys join with '.'; int keys become their decimal text; values that
/// are neither tensors nor dicts become byte entries (bytes as themselves, any other value as
/// its own torch.save record, as PyTorch DCP stores it). CliError kNotCheckpoint for a file
/// that is not a valid torch.save archive, kUnsupported for one whose root is not a dict or that
/// holds tensors inside lists.
void ImportTorch(const std::string& in, const std::string& out_uri, const ConvertOptions& o);

/// Entry point of the torch module: to_torch != 0 converts the checkpoint at `src` into the
/// torch.save file `dst`, else the reverse. Returns an exit code (Exit); on failure writes a
/// message into err[0..err_len).
using ConvertTorchFn = int(int to_torch, const char* src, const char* dst, int overwrite,
                           unsigned long long budget_bytes, char* err, size_t err_len);
inline constexpr char kConvertTorchSymbol[] = "dcp_cli_torch_convert";

}  // namespace dcp::cli
