#include "dcp/storage/format/layout.h"

#include <algorithm>

#include "dcp/proto/error.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/storage/format/zstd_transform.h"

namespace dcp {

// Defined by each layout's own file.
const CheckpointLayout& DcpLayout();
const CheckpointLayout& TorchDcpLayout();
const CheckpointLayout& TorchDcp113Layout();
const CheckpointLayout& SafetensorsLayout();

std::string_view CheckpointFormatName(CheckpointFormat format) {
  switch (format) {
    case CheckpointFormat::kDcp:
      return "dcp";
    case CheckpointFormat::kTorchDcp:
      return "torchdcp";
    case CheckpointFormat::kTorchDcp113:
      return "torchdcp113";
    case CheckpointFormat::kSafetensors:
      return "safetensors";
  }
  return "?";
}

CheckpointFormat ParseCheckpointFormat(std::string_view name) {
  for (CheckpointFormat f : {CheckpointFormat::kDcp, CheckpointFormat::kTorchDcp,
                             CheckpointFormat::kTorchDcp113, CheckpointFormat::kSafetensors}) {
    if (CheckpointFormatName(f) == name) return f;
  }
  throw InvalidArgumentError("unknown checkpoint format '" + std::string(name) +
                             "' (known: dcp, torchdcp, torchdcp113, safetensors)");
}

void CheckpointLayout::CheckWriteOptions(const StorageOptions&, const std::string&) const {}

void CheckpointLayout::ValidateWriteOptions(const StorageOptions& options,
                                            const std::string& uri) const {
  ValidateCompressionOptions(options);
  const uint64_t block = options.checksum_block_bytes;
  if (block != 0 && ((block & (block - 1)) != 0 || block < (uint64_t{1} << kMinBlockLog2) ||
                     block > (uint64_t{1} << kMaxBlockLog2))) {
    throw InvalidArgumentError("StorageOptions::checksum_block_bytes = " + std::to_string(block) +
                               ": must be 0 (no block CRCs) or a power of two from 4096 to 2^30");
  }
  const bool incremental = options.content_hashes || !options.incremental_base.empty() ||
                           !options.frozen_prefixes.empty();
  if (incremental && (format() != CheckpointFormat::kDcp || options.metadata_version < 2)) {
    throw InvalidArgumentError(
        "content hashes and incremental saves (StorageOptions::content_hashes, incremental_base, "
        "frozen_prefixes) need the dcp format with metadata version 2; " +
        uri + " would be " + std::string(display_name()) + ", metadata version " +
        std::to_string(options.metadata_version));
  }
  if (!options.incremental_base.empty() && !IsPlainObjectName(options.incremental_base)) {
    throw InvalidArgumentError("StorageOptions::incremental_base '" + options.incremental_base +
                               "' is not the plain name of a checkpoint beside " + uri);
  }
  CheckWriteOptions(options, uri);
}

std::unique_ptr<ItemEncoder> CheckpointLayout::NewItemEncoder(const StorageOptions&) const {
  return nullptr;
}

std::unique_ptr<StorageWriter> CheckpointLayout::WrapWriter(std::unique_ptr<StorageWriter> protocol,
                                                            std::shared_ptr<Store>,
                                                            const StorageOptions&) const {
  return protocol;
}

std::shared_ptr<Store> CheckpointLayout::OpenSingleObject(const StoreOpenFn&, const std::string&,
                                                          const std::string&) const {
  return nullptr;
}

bool CheckpointLayout::WritesFileIndexes(const StorageOptions&) const { return false; }

std::optional<DataFile> CheckpointLayout::FinishDataFile(WritableObject&, const std::string&,
                                                         const std::vector<WriteResult>&,
                                                         const StorageOptions&, int32_t) const {
  return std::nullopt;
}

void ItemDecoder::Prepare(const LoadPlan&, std::map<MetadataIndex, StorageInfo>&) {}

std::unique_ptr<ItemDecoder> CheckpointLayout::NewItemDecoder(const LoadContext&) const {
  return nullptr;
}

bool CheckpointLayout::Detect(Store& store) const {
  return store.Size(metadata_name()).has_value();
}

const CheckpointLayout& LayoutFor(CheckpointFormat format) {
  switch (format) {
    case CheckpointFormat::kDcp:
      return DcpLayout();
    case CheckpointFormat::kTorchDcp:
      return TorchDcpLayout();
    case CheckpointFormat::kTorchDcp113:
      return TorchDcp113Layout();
    case CheckpointFormat::kSafetensors:
      return SafetensorsLayout();
  }
  throw InvalidArgumentError("unknown checkpoint format " +
                             std::to_string(static_cast<int>(format)));
}

// The torch 1.13 layout differs from 2.x only in how its metadata is written; a reader needs
// one entry for both (same metadata name, same decoder). safetensors comes last: a directory
// holding a dcp or PyTorch DCP checkpoint beside a model.safetensors loads as the former.
const std::vector<const CheckpointLayout*>& AllLayouts() {
  static const std::vector<const CheckpointLayout*> all = {&DcpLayout(), &TorchDcpLayout(),
                                                           &SafetensorsLayout()};
  return all;
}

const CheckpointLayout* DetectLayout(Store& store) {
  for (const CheckpointLayout* layout : AllLayouts()) {
    if (layout->Detect(store)) return layout;
  }
  return nullptr;
}

bool IsAnyDataFile(const std::string& name) {
  for (const CheckpointLayout* layout : AllLayouts()) {
    if (layout->IsDataFile(name)) return true;
  }
  return false;
}

std::shared_ptr<Store> OpenSingleObjectCheckpoint(const StoreOpenFn& open,
                                                  const std::string& scheme,
                                                  const std::string& location) {
  for (const CheckpointLayout* layout : AllLayouts()) {
    if (auto store = layout->OpenSingleObject(open, scheme, location)) return store;
  }
  return nullptr;
}

std::vector<std::unique_ptr<ItemDecoder>> NewItemDecoders(const LoadContext& ctx) {
  std::vector<std::unique_ptr<ItemDecoder>> decoders;
  for (const CheckpointLayout* layout : AllLayouts()) {
    if (auto d = layout->NewItemDecoder(ctx)) decoders.push_back(std::move(d));
  }
  return decoders;
}

ChecksumKind StoredCrcKind(const StorageInfo& info) {
  return info.zip_crc32 ? ChecksumKind::kCrc32 : ChecksumKind::kCrc32c;
}

std::string_view StoredCrcName(const StorageInfo& info) {
  return info.zip_crc32 ? "zip CRC-32" : "crc32c";
}

const TensorMetadata& StoredEntry(const Metadata& md, const ReadItem& item) {
  return std::get<TensorMetadata>(md.entries.at(item.storage_index.fqn));
}

ChunkMeta StoredChunk(const Metadata& md, const ReadItem& item, const std::string& uri) {
  const auto& t = StoredEntry(md, item);
  if (auto k = ChunkOrdinal(t, item.storage_index.offset, item.storage_index.index)) {
    return ChunkAt(t, *k);
  }
  throw CorruptionError(uri + ": metadata has no chunk " + item.storage_index.ToString());
}

TensorView CheckedDestination(LoadPlanner& planner, const ReadItem& item,
                              const TensorMetadata& entry) {
  TensorView dst = planner.ResolveTensor(item);
  if (dst.dtype != entry.dtype || dst.shape != item.lengths) {
    throw InternalError("destination for " + item.dest_index.ToString() + " is " + dst.ToString() +
                        ", expected " + ShapeToString(item.lengths));
  }
  return dst;
}

size_t ScratchLimit(const StorageOptions& options) {
  return std::max<size_t>(options.max_scratch_bytes, 64);
}

void CheckUnchanged(const WriteItem& item, const ResolvedData& data) {
  if (data.tensor.shape != item.chunk.sizes || data.tensor.dtype != item.dtype) {
    throw InvalidArgumentError(
        "tensor " + item.index.ToString() + " changed during the save: plan has " +
        std::string(DTypeName(item.dtype)) + ShapeToString(item.chunk.sizes) + ", data is " +
        data.tensor.ToString());
  }
}

}  // namespace dcp
