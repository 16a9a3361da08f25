// dcp's own layout (docs/FORMAT.md): the names it gives a checkpoint's files.
//   metadata.dcp                          the commit marker: checksummed protobuf Metadata
//   data-<save_id>-r<rank>-b<bucket>.data raw or zstd item bytes; located by the metadata
// Internal (not installed). Stateless; thread-safe.
#pragma once

#include <string>

namespace dcp {

/// The dcp layout's metadata file: its atomic appearance commits a checkpoint.
inline constexpr char kMetadataName[] = "metadata.dcp";

/// True for names the dcp layout's writer creates for data (so tools and clean-up never touch
/// user files).
bool IsDataObjectName(const std::string& name);

}  // namespace dcp
