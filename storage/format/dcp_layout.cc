// dcp's own layout (docs/FORMAT.md): metadata.dcp, a checksummed protobuf envelope, and data
// files "data-<save>-r<rank>-b<bucket>.data" of items stored raw or zstd-compressed, each with
// its CRC32C.
#include "dcp/storage/format/dcp_layout.h"

#include <algorithm>

#include "dcp/proto/checksum.h"
#include "dcp/proto/device/device.h"
#include "dcp/proto/error.h"
#include "dcp/proto/executor.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/storage/format/dcp_index.h"
#include "dcp/storage/format/layout.h"
#include "dcp/storage/format/zstd_transform.h"

namespace dcp {
namespace {

// Stream a tensor view (host or device, any strides) into `out` in row-major order, CRC-ing
// each piece right after it is appended. Contiguous host views go straight from tensor memory;
// strided ones through a reused staging buffer; device views through pinned buffers whose
// device-to-host copy of the next piece overlaps this append (proto/device/device.h).
// A large piece's CRC runs on a helper thread while this thread appends the same bytes: both
// only read them, and a large O_DIRECT write leaves the CPU idle while the device DMAs.
uint32_t AppendTensor(WritableObject& out, const TensorView& view) {
  constexpr size_t kOverlapMinBytes = 1 << 20;  // below this a thread costs more than it saves
  uint32_t crc = 0;
  StreamToHost(view, kDevicePieceBytes, [&](const void* data, size_t n) {
    if (n < kOverlapMinBytes) {
      out.Append(data, n);
      crc = Crc32c(crc, data, n);
      return;
    }
    // The Task's destructor waits, so `data` outlives the CRC even if Append throws.
    Task<uint32_t> pending = Spawn([seed = crc, data, n] { return Crc32c(seed, data, n); });
    out.Append(data, n);
    crc = pending.get();
  });
  return crc;
}

class DcpItemEncoder : public ItemEncoder {
 public:
  explicit DcpItemEncoder(const StorageOptions& options) : compressor_(options) {}

  void Append(WritableObject& out, const WriteItem& item, const ResolvedData& data,
              StorageInfo& info) override {
    const uint64_t start = out.size();
    if (item.is_tensor()) CheckUnchanged(item, data);
    // The item's raw bytes into `sink` (the data file, or the compressor feeding it).
    auto append = [&](WritableObject& sink) {
      if (item.is_tensor()) {
        try {
          return AppendTensor(sink, data.tensor);
        } catch (const DeviceError& e) {
          throw DeviceError("tensor '" + item.index.fqn + "': " + e.what());
        }
      }
      sink.Append(data.bytes.data(), data.bytes.size());
      return Crc32c(0, data.bytes.data(), data.bytes.size());
    };
    const uint64_t raw = item.is_tensor() ? data.tensor.nbytes() : data.bytes.size();
    uint32_t crc;
    if (auto stored_crc = compressor_.Compress(
            out, raw, [&](WritableObject& sink) { append(sink); }, item.index.ToString())) {
      crc = *stored_crc;  // of the compressed bytes, as stored
      info.transforms = {kZstdTransform};
    } else {
      crc = append(out);
    }
    info.length = out.size() - start;
    info.raw_length = raw;
    info.crc32c = crc;
  }

 private:
  ZstdItemCompressor compressor_;  // stores items raw unless options.compression
};

// The metadata file's bytes, its header checked first: a file that is not metadata (or a size
// that lies) costs one small read; one larger than protobuf can decode is not read at all.
std::string ReadMetadataFile(Store& store, const std::string& where) {
  return store.ReadAll(kMetadataName, kMetadataHeaderSize + MetadataPayloadLimit(),
                       [&](std::string_view head, uint64_t size) {
                         CheckMetadataFileHeader(head.substr(0, kMetadataHeaderSize), size, where);
                       });
}

class DcpLayoutImpl : public CheckpointLayout {
 public:
  CheckpointFormat format() const override { return CheckpointFormat::kDcp; }
  std::string_view display_name() const override { return "dcp"; }
  const std::string& metadata_name() const override { return name_; }
  std::string FilePrefix(const std::string& save_id, size_t rank) const override {
    return "data-" + save_id + "-r" + std::to_string(rank);
  }
  std::string DataFileName(const std::string& prefix, size_t bucket) const override {
    return prefix + "-b" + std::to_string(bucket) + ".data";
  }
  bool IsDataFile(const std::string& name) const override { return IsDataObjectName(name); }
  std::string EncodeMetadata(const Metadata& md, const std::string& uri) const override {
    std::string encoded = EncodeMetadataFile(md);
    // A payload no reader can decode must fail the save here, before the commit.
    CheckMetadataPayloadSize(encoded.size() - kMetadataHeaderSize, uri);
    return encoded;
  }
  Metadata ReadMetadata(Store& store, std::string* encoded) const override {
    const std::string where = store.uri() + "/" + name_;
    std::string bytes = ReadMetadataFile(store, where);
    Metadata md = DecodeMetadataFile(bytes, where);
    if (encoded) {
      bytes.erase(0, kMetadataHeaderSize);  // the payload is the plain wire encoding
      *encoded = std::move(bytes);
    }
    return md;
  }
  std::unique_ptr<ItemEncoder> NewItemEncoder(const StorageOptions& options) const override {
    return std::make_unique<DcpItemEncoder>(options);
  }
  bool WritesFileIndexes(const StorageOptions& options) const override {
    return options.metadata_version >= 2;
  }
  // Version 2: the index goes after the file's last item, so that it is in the file when the
  // file appears (docs/FORMAT.md).
  std::optional<DataFile> FinishDataFile(WritableObject& out, const std::string& name,
                                         const std::vector<WriteResult>& results,
                                         const StorageOptions& options,
                                         int32_t rank) const override {
    if (!WritesFileIndexes(options)) return std::nullopt;
    return AppendFileIndex(out, name, results, rank);
  }
  std::unique_ptr<ItemDecoder> NewItemDecoder(const LoadContext& ctx) const override {
    return NewZstdItemDecoder(ctx);
  }

 private:
  const std::string name_ = kMetadataName;
};

}  // namespace

bool IsDataObjectName(const std::string& name) {
  return name.rfind("data-", 0) == 0 && name.size() > 10 &&
         name.compare(name.size() - 5, 5, ".data") == 0;
}

const CheckpointLayout& DcpLayout() {
  static const DcpLayoutImpl layout;
  return layout;
}

}  // namespace dcp
