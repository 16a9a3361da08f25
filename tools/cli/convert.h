// `dcp convert`: checkpoints to and from safetensors and torch.save files.
#pragma once

#include <cstddef>
#include <string>

#include "tools/cli/cli_common.h"

namespace dcp::cli {

struct ConvertOptions {
  bool overwrite = false;                  // replace an existing destination
  size_t budget_bytes = size_t{64} << 20;  // per-piece memory bound when streaming
};

/// Every entry of `src` into one safetensors file. Streams: the header first, then each tensor
/// assembled from its chunks in row-major order, a bounded piece at a time. Blobs become U8
/// tensors, named in the header's __metadata__ "dcp.blobs" so that the way back restores them.
void ExportSafetensors(const Checkpoint& src, const std::string& out, const ConvertOptions& o);
/// A safetensors file into a new dcp checkpoint at `out_uri`. The file is memory-mapped and
/// saved straight from the mapping (no copy of the data in memory).
void ImportSafetensors(const std::string& in, const std::string& out_uri, const ConvertOptions& o);

/// True when this build can convert to and from torch.save files (built with LibTorch).
bool HaveTorch();
/// A checkpoint into a file Python's torch.load reads: a dict {fqn: tensor} (blobs as uint8
/// tensors). LibTorch's pickle writer needs every tensor in memory at once.
void ExportTorch(const Checkpoint& src, const std::string& out, const ConvertOptions& o);
/// A torch.save file holding a (possibly nested) dict of tensors into a dcp checkpoint. The
/// whole file is read into memory. LibTorch 1.13's unpickler rejects some files Python writes
/// (a dict with exactly one entry uses the SETITEM opcode, which it lacks).
void ImportTorch(const std::string& in, const std::string& out_uri, const ConvertOptions& o);

}  // namespace dcp::cli
