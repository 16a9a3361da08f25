// Internal (not installed): what the files of the codec share (proto/schema/codec.cc,
// metadata_codec.cc, metadata_file.cc): conversions between dcp's structs and their protobuf
// messages, and the metadata payload encoder the file envelope writes around.
//
// The From/ToPb functions convert field by field; FromPb trusts nothing it does not check
// (ToDType refuses an unknown dtype), everything else is validated later by ValidateMetadata.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "dcp/proto/plan.h"
#include "schema/dcp.pb.h"  // generated from proto/schema/dcp.proto

namespace dcp::internal {

template <typename Repeated>
Shape ToShape(const Repeated& r) {
  return Shape(r.begin(), r.end());
}
template <typename Repeated>
void FromShape(const Shape& s, Repeated* r) {
  r->Clear();
  for (int64_t v : s) r->Add(v);
}

/// `v` as a DType; CorruptionError naming `source` when it is none.
DType ToDType(int v, std::string_view source);

void ToPb(const MetadataIndex& i, pb::MetadataIndex* p);
MetadataIndex FromPb(const pb::MetadataIndex& p);
void ToPb(const ChunkMeta& c, pb::Chunk* p);
ChunkMeta FromPb(const pb::Chunk& p);
void ToPb(const StorageInfo& s, pb::StorageInfo* p);
StorageInfo FromPb(const pb::StorageInfo& p);
void ToPb(const DataFile& f, pb::DataFile* out);
DataFile FromPb(const pb::DataFile& f);

/// EncodeMetadata's bytes after `prefix` zero bytes (room for the file envelope, written in
/// place by EncodeMetadataFile). InvalidArgumentError for an entry too large to encode.
std::string EncodeMetadataAfter(const Metadata& md, size_t prefix);

}  // namespace dcp::internal
