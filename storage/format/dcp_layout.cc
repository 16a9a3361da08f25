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

// The CRC32C of an item's bytes as they are appended and, with a block size, of each of its
// blocks: each closed block's CRC is combined into the item's (Crc32cCombine), so the bytes are
// read once for both. Blocks are kept only for an item longer than one block (the block table
// lists no others: the item's CRC is their one block's).
struct ItemCrcs {
  uint64_t block = 0;  // 0: the item's CRC only
  uint32_t item = 0;   // of the bytes before the open block
  uint32_t open = 0;   // of the open block's bytes so far
  uint64_t open_len = 0;
  std::vector<uint32_t> blocks;
  ContentHasher* hasher = nullptr;  // the item's content hash, in the same pass (version 3)

  void Add(const void* data, size_t n) {
    if (hasher != nullptr) hasher->Add(data, n);
    if (block == 0) {
      item = Crc32c(item, data, n);
      return;
    }
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const size_t k = static_cast<size_t>(std::min<uint64_t>(n, block - open_len));
      open = Crc32c(open, p, k);
      open_len += k;
      p += k;
      n -= k;
      if (open_len == block) Close();
    }
  }
  // The item's CRC; `blocks` is left empty unless the item has more than one block.
  uint32_t Finish() {
    if (open_len > 0) Close();
    if (blocks.size() <= 1) blocks.clear();
    return item;
  }
  void Close() {
    blocks.push_back(open);
    item = Crc32cCombine(item, open, open_len);
    open = 0;
    open_len = 0;
  }
};

// Stream a tensor view (host or device, any strides) into `out` in row-major order, CRC-ing
// each piece (into `crcs`) right after it is appended. Contiguous host views go straight from
// tensor memory; strided ones through a reused staging buffer; device views through pinned
// buffers whose device-to-host copy of the next piece overlaps this append
// (proto/device/device.h). A large piece's CRC runs on a helper thread while this thread appends
// the same bytes: both only read them, and a large O_DIRECT write leaves the CPU idle while the
// device DMAs.
void AppendTensor(WritableObject& out, const TensorView& view, ItemCrcs& crcs) {
  constexpr size_t kOverlapMinBytes = 1 << 20;  // below this a thread costs more than it saves
  StreamToHost(view, kDevicePieceBytes, [&](const void* data, size_t n) {
    if (n < kOverlapMinBytes) {
      out.Append(data, n);
      crcs.Add(data, n);
      return;
    }
    // The Task's destructor waits, so `data` outlives the CRC even if Append throws.
    Task<ItemCrcs> pending = Spawn([c = std::move(crcs), data, n]() mutable {
      c.Add(data, n);
      return std::move(c);
    });
    out.Append(data, n);
    crcs = pending.get();
  });
}

class DcpItemEncoder : public ItemEncoder {
 public:
  explicit DcpItemEncoder(const StorageOptions& options)
      : compressor_(options),
        block_bytes_(options.metadata_version >= 2 ? options.checksum_block_bytes : 0),
        hashes_(WritesContentHashes(options)) {}

  void Append(WritableObject& out, const WriteItem& item, const ResolvedData& data,
              StorageInfo& info) override {
    const uint64_t start = out.size();
    if (item.is_tensor()) CheckUnchanged(item, data);
    // The item's raw bytes into `sink` (the data file, or the compressor feeding it).
    ItemCrcs crcs;
    // A hash the writer computed already (to compare with an earlier step's) is not redone.
    const bool hash = hashes_ && !info.content_hash;
    auto append = [&](WritableObject& sink) {
      crcs = ItemCrcs{};
      crcs.block = block_bytes_;
      if (hash) {
        hasher_.Reset();
        crcs.hasher = &hasher_;
      }
      if (item.is_tensor()) {
        try {
          AppendTensor(sink, data.tensor, crcs);
        } catch (const DeviceError& e) {
          throw DeviceError("tensor '" + item.index.fqn + "': " + e.what());
        }
      } else {
        sink.Append(data.bytes.data(), data.bytes.size());
        crcs.Add(data.bytes.data(), data.bytes.size());
      }
      return crcs.Finish();
    };
    const uint64_t raw = item.is_tensor() ? data.tensor.nbytes() : data.bytes.size();
    uint32_t crc;
    if (auto stored_crc = compressor_.Compress(
            out, raw, [&](WritableObject& sink) { append(sink); }, item.index.ToString())) {
      crc = *stored_crc;  // of the compressed bytes, as stored
      info.transforms = {kZstdTransform};
    } else {
      crc = append(out);
      info.block_crc32c = std::move(crcs.blocks);  // raw: a partial read checks its blocks
    }
    info.length = out.size() - start;
    info.raw_length = raw;
    info.crc32c = crc;
    if (hash) info.content_hash = hasher_.Digest();
  }

 private:
  ZstdItemCompressor compressor_;  // stores items raw unless options.compression
  uint64_t block_bytes_;           // of the block CRCs (0: none; version 1 has no table)
  bool hashes_;                    // version 3: every item's content hash
  ContentHasher hasher_;
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
    return AppendFileIndex(out, name, results, rank, options.checksum_block_bytes,
                           WritesContentHashes(options) ? 3 : 2);
  }
  std::unique_ptr<ItemDecoder> NewItemDecoder(const LoadContext& ctx) const override {
    return NewZstdItemDecoder(ctx);
  }

 private:
  const std::string name_ = kMetadataName;
};

}  // namespace

bool WritesContentHashes(const StorageOptions& options) {
  return options.metadata_version >= 2 &&
         (options.content_hashes || !options.incremental_base.empty());
}

bool IsDataObjectName(const std::string& name) {
  return name.rfind("data-", 0) == 0 && name.size() > 10 &&
         name.compare(name.size() - 5, 5, ".data") == 0;
}

const CheckpointLayout& DcpLayout() {
  static const DcpLayoutImpl layout;
  return layout;
}

}  // namespace dcp
