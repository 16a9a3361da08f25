// The checkpoint protocol over any Store: atomic commit, overwrite, clean-up. Its entry points,
// MakeStoreWriter and MakeStoreReader, are declared in storage/builtin.h for the registry.
//
// How a checkpoint's files are named and encoded is its layout's (storage/format/layout.h; dcp's
// own: format/dcp_layout.h, docs/FORMAT.md). Data files carry the save id, so a new save never
// touches the files of the checkpoint it replaces: the old checkpoint stays loadable until the new
// metadata is renamed over it, and its files are removed only afterwards.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "dcp/storage/builtin.h"
#include "dcp/storage/storage.h"
#include "dcp/storage/store.h"

namespace dcp {

/// Independent store requests a checkpoint operation makes at once (the metadata check's size
/// queries, the clean-up's removals): each is a round trip on an object store.
inline constexpr size_t kStoreRequestsInFlight = 16;

class ItemLocator;  // storage/format/layout.h
class ItemDecoder;

/// Cooperative reads (storage.h's ItemStreamer, item_streamer.cc): what a StoreReader reads
/// with, borrowed from it: every reference must outlive the streamer,
/// and the streamer is used only while the reader runs no ReadData (it adds to `resolved`).
struct StoreItemSource {
  Store& store;
  const StorageOptions& options;
  const Metadata& metadata;
  ItemLocator* locator;                            // version 2; null when the metadata lists
  std::map<MetadataIndex, StorageInfo>& resolved;  // items located or decoded to plain ones
  std::vector<std::unique_ptr<ItemDecoder>>& decoders;
  const std::unordered_map<std::string, uint64_t>& file_sizes;  // version 2's file table
};

/// Streams raw tensor items (dcp's raw items with their CRC32C, PyTorch DCP records whose values
/// are their storage with its zip CRC-32, safetensors tensors without a checksum). Transformed
/// items (zstd, strided records) are not streamed: StreamableLength is 0 for them.
std::unique_ptr<ItemStreamer> NewStoreItemStreamer(const StoreItemSource& source);

}  // namespace dcp
