// PyTorch DCP's layout (storage/format/torch_dcp.h): `.metadata`, a pickle, and record files
// "__<rank>_<n>.<save>.distcp" of torch.save archives, one per item. torch reads neither dcp's
// zstd items nor its CRC32C, so compression is refused; every record carries zip CRC-32s.
//
// Read side: a tensor record's values are located once per load (TorchItemDecoder::Prepare);
// row-major values that are the whole storage become a plain item the reader reads as its own,
// checked against the zip entry's CRC-32 on every path it takes; other records and byte
// entries are read here.
#include <algorithm>
#include <atomic>
#include <exception>
#include <map>
#include <optional>
#include <set>

#include "dcp/proto/device/device.h"
#include "dcp/proto/error.h"
#include "dcp/proto/executor.h"
#include "dcp/storage/format/layout.h"
#include "dcp/storage/format/torch_dcp.h"

namespace dcp {
namespace {

class TorchItemEncoder : public ItemEncoder {
 public:
  explicit TorchItemEncoder(bool torch2) : torch2_(torch2) {}

  // A tensor's archive; a blob as it is when it is a torch.save archive (e.g. read from a
  // PyTorch DCP checkpoint), wrapped as a pickled Python bytes object otherwise (the reader
  // unwraps it, so blobs round-trip exactly).
  void Append(WritableObject& out, const WriteItem& item, const ResolvedData& data,
              StorageInfo& info) override {
    info.transforms = {kTorchSaveTransform};
    if (item.is_tensor()) {
      CheckUnchanged(item, data);
      try {
        info.length = AppendTorchTensorRecord(out, data.tensor, torch2_);
      } catch (const DeviceError& e) {
        throw DeviceError("tensor '" + item.index.fqn + "': " + e.what());
      } catch (const UnsupportedError& e) {
        throw UnsupportedError("tensor '" + item.index.fqn + "': " + e.what());
      }
      info.raw_length = data.tensor.nbytes();
      return;
    }
    std::string payload;
    // A blob that is an archive of anything but a bytes object came from a record (a load of a
    // PyTorch DCP checkpoint): it stays one. One of a bytes object is wrapped again, because
    // reads unwrap such records into their payload (ItemDecoder below).
    const bool as_is =
        IsTorchSaveArchive(data.bytes) &&
        (data.bytes_are_torch_record || !TorchSaveBytesPayload(data.bytes, &payload));
    const std::string wrapped = as_is ? std::string() : TorchSaveOfBytes(data.bytes);
    const std::string_view record = as_is ? data.bytes : std::string_view(wrapped);
    out.Append(record.data(), record.size());
    info.length = record.size();
    info.raw_length = record.size();
  }

 private:
  bool torch2_;
};

bool IsTorchRecord(const StorageInfo& info) {
  return info.transforms.size() == 1 && info.transforms[0] == kTorchSaveTransform;
}

class TorchItemDecoder : public ItemDecoder {
 public:
  explicit TorchItemDecoder(const LoadContext& ctx) : ctx_(ctx) {}

  bool Decodes(const StorageInfo& info) const override { return IsTorchRecord(info); }
  // A record is read through its archive's directories: not one front-to-back stream.
  bool ReadsStoredRange() const override { return false; }

  // A PyTorch DCP tensor record is a torch.save archive: find where its values lie (libzip
  // reads the archive's directories and its small pickle), once per record, before any read.
  // Row-major values that are the whole storage become a plain stored item, read like dcp's
  // own; other layouts (a transposed tensor is saved with its strides) are copied by Read.
  void Prepare(const LoadPlan& plan, std::map<MetadataIndex, StorageInfo>& plain) override {
    std::vector<const ReadItem*> todo;  // one item per record to resolve
    std::set<MetadataIndex> seen;
    for (const ReadItem& item : plan.items) {
      if (item.type != ReadItemType::kTensor || plain.count(item.storage_index) ||
          strided_.count(item.storage_index)) {
        continue;
      }
      if (!IsTorchRecord(Info(item))) continue;
      if (seen.insert(item.storage_index).second) todo.push_back(&item);
    }
    if (todo.empty()) return;
    std::vector<Resolved> results = ResolveAll(todo);
    for (size_t i = 0; i < todo.size(); ++i) {
      if (results[i].error) std::rethrow_exception(results[i].error);
      if (!results[i].rec) continue;  // not reached after an error elsewhere
      const ReadItem& item = *todo[i];
      TorchTensorRecord& rec = *results[i].rec;
      if (!rec.covers_storage()) {
        strided_.emplace(item.storage_index, std::move(rec));
        continue;
      }
      // The values are the whole storage: read as a plain item, checked against the zip
      // entry's CRC-32 on every path a plain item takes (whole, split, device, partial).
      StorageInfo info;
      info.relative_path = Info(item).relative_path;
      info.offset = rec.values_begin();
      info.length = static_cast<uint64_t>(Chunk(item).numel()) * ElementSize(rec.dtype);
      info.raw_length = info.length;
      info.zip_crc32 = rec.zip_crc32;
      plain.emplace(item.storage_index, std::move(info));
    }
  }

  // A PyTorch DCP byte entry (the record is torch.save bytes: a pickled Python bytes object
  // is unwrapped to its payload, anything else is the blob) or a tensor record whose values
  // are not its whole storage, row-major: the storage is read into memory (at most the
  // record's length, which the reader bounded by the file), checked against its zip CRC-32
  // and copied through the record's strides. Either way every zip CRC is checked.
  void Read(const ItemRead& r) override {
    const ReadItem& item = r.item;
    const StorageInfo& info = r.info;
    const bool verify = ctx_.options.verify_checksums;
    const std::string what =
        item.storage_index.ToString() + " from '" + ctx_.store.uri() + "/" + r.file + "'";
    if (item.type == ReadItemType::kBytes) {
      std::string bytes =
          AllocateOrThrow([&] { return std::string(info.length, '\0'); }, what, info.length);
      r.in.ReadAt(info.offset, bytes.data(), bytes.size());
      if (verify && IsTorchSaveArchive(bytes)) CheckTorchArchiveCrcs(bytes, what);
      std::string payload;
      if (TorchSaveBytesPayload(bytes, &payload)) bytes = std::move(payload);
      r.planner.LoadBytes(item, std::move(bytes));
      return;
    }
    auto it = strided_.find(item.storage_index);
    if (it == strided_.end()) throw InternalError("unresolved torch record " + what);
    const TorchTensorRecord& rec = it->second;
    TensorView dst = CheckedDestination(r.planner, item, StoredEntry(ctx_.metadata, item));
    const std::vector<char> storage = ReadTorchRecordStorage(r.in, rec, what, verify);
    if (rec.span_bytes > 0) {  // checked by ResolveTorchTensorRecord to lie in the storage
      TensorView src;
      src.data = const_cast<char*>(storage.data()) + (rec.values_begin() - rec.storage_begin);
      src.dtype = rec.dtype;
      src.shape = rec.sizes;
      src.strides = rec.strides;
      CopyTensor(dst, src.Narrow(item.storage_offsets, item.lengths));
    }
    r.planner.CommitTensor(item, dst);
  }

 private:
  const StorageInfo& Info(const ReadItem& item) const {
    auto it = ctx_.metadata.storage.find(item.storage_index);
    if (it == ctx_.metadata.storage.end()) {
      throw CorruptionError(ctx_.store.uri() + ": metadata has no stored item " +
                            item.storage_index.ToString());
    }
    return it->second;
  }
  ChunkMeta Chunk(const ReadItem& item) const {
    return StoredChunk(ctx_.metadata, item, ctx_.store.uri());
  }

  struct Resolved {
    std::optional<TorchTensorRecord> rec;
    std::exception_ptr error;
  };

  // The record of each item, checked against its entry. Each record costs a few small reads
  // (directories, pickle): they are spread over the read threads, each with its own open files,
  // so a cold directory is not read one seek at a time. After an error the rest are left.
  std::vector<Resolved> ResolveAll(const std::vector<const ReadItem*>& todo) const {
    std::vector<Resolved> results(todo.size());
    std::atomic<size_t> next{0};
    auto worker = [&] {
      std::map<std::string, std::unique_ptr<ReadableObject>> open;
      for (size_t i; (i = next.fetch_add(1)) < todo.size();) {
        try {
          results[i].rec = Resolve(*todo[i], open);
        } catch (...) {
          results[i].error = std::current_exception();
          next = todo.size();
        }
      }
    };
    const size_t nthreads =
        std::clamp<size_t>(std::max(ctx_.options.read_threads, 4), 1, todo.size());
    {
      std::vector<Task<void>> helpers;  // their destructors wait, also on a throw
      for (size_t t = 1; t < nthreads; ++t) helpers.push_back(Spawn(worker));
      worker();
    }
    return results;
  }

  TorchTensorRecord Resolve(const ReadItem& item,
                            std::map<std::string, std::unique_ptr<ReadableObject>>& open) const {
    const StorageInfo& info = Info(item);
    auto& in = open[info.relative_path];
    if (!in) in = ctx_.store.Open(info.relative_path);
    const std::string what = "record of " + item.storage_index.ToString() + " at offset " +
                             std::to_string(info.offset) + " of '" + ctx_.store.uri() + "/" +
                             info.relative_path + "'";
    TorchTensorRecord rec = ResolveTorchTensorRecord(*in, info.offset, info.length, what);
    const auto& entry = StoredEntry(ctx_.metadata, item);
    const ChunkMeta chunk = Chunk(item);
    if (rec.dtype != entry.dtype || rec.sizes != chunk.sizes) {
      throw CorruptionError(what + " holds " + std::string(DTypeName(rec.dtype)) +
                            ShapeToString(rec.sizes) + " but the metadata says " +
                            std::string(DTypeName(entry.dtype)) + ShapeToString(chunk.sizes));
    }
    return rec;
  }

  LoadContext ctx_;
  std::map<MetadataIndex, TorchTensorRecord> strided_;  // records Read copies through strides
};

class TorchDcpLayoutImpl : public CheckpointLayout {
 public:
  explicit TorchDcpLayoutImpl(TorchDcpFlavor flavor) : flavor_(flavor) {}

  CheckpointFormat format() const override {
    return flavor_ == TorchDcpFlavor::kTorch2 ? CheckpointFormat::kTorchDcp
                                              : CheckpointFormat::kTorchDcp113;
  }
  std::string_view display_name() const override { return "PyTorch DCP"; }
  const std::string& metadata_name() const override { return name_; }
  void CheckWriteOptions(const StorageOptions& options, const std::string& uri) const override {
    if (options.compression != Compression::kNone) {
      throw InvalidArgumentError("compression cannot be used for a PyTorch DCP checkpoint at " +
                                 uri + " (torch cannot read dcp's zstd items)");
    }
  }
  std::string FilePrefix(const std::string& save_id, size_t rank) const override {
    return "__" + std::to_string(rank) + "_." + save_id;
  }
  std::string DataFileName(const std::string& prefix, size_t bucket) const override {
    const size_t dot = prefix.find('.');  // "__<rank>_" "." "<save>"
    return prefix.substr(0, dot) + std::to_string(bucket) + prefix.substr(dot) + ".distcp";
  }
  bool IsDataFile(const std::string& name) const override { return IsTorchDcpDataName(name); }
  std::string EncodeMetadata(const Metadata& md, const std::string& uri) const override {
    return EncodeTorchDcpMetadata(md, flavor_, uri);
  }
  Metadata ReadMetadata(Store& store, std::string* encoded) const override {
    if (encoded) encoded->clear();
    const std::string where = store.uri() + "/" + name_;
    // A pickle torch writes starts with PROTO (0x80): anything else larger than the first read
    // is refused after it, before the rest is read. Over 2 GiB is refused unread (the unpickler's
    // own limit, DecodeTorchDcpMetadata).
    constexpr uint64_t kMaxBytes = uint64_t{2} << 30;
    const std::string bytes =
        store.ReadAll(name_, kMaxBytes, [&](std::string_view head, uint64_t size) {
          if (size > head.size() && static_cast<unsigned char>(head[0]) != 0x80) {
            throw CorruptionError(where + ": not a pickle torch wrote (it starts with byte " +
                                  std::to_string(static_cast<unsigned char>(head[0])) +
                                  ", not PROTO 0x80), " + std::to_string(size) +
                                  " bytes; it was not read further");
          }
        });
    return DecodeTorchDcpMetadata(bytes, where);
  }
  std::unique_ptr<ItemEncoder> NewItemEncoder(const StorageOptions&) const override {
    return std::make_unique<TorchItemEncoder>(flavor_ == TorchDcpFlavor::kTorch2);
  }
  std::unique_ptr<ItemDecoder> NewItemDecoder(const LoadContext& ctx) const override {
    return std::make_unique<TorchItemDecoder>(ctx);
  }

 private:
  TorchDcpFlavor flavor_;
  const std::string name_ = kTorchDcpMetadataName;
};

}  // namespace

bool IsTorchDcpDataName(const std::string& name) {
  return name.size() > 9 && name.rfind("__", 0) == 0 &&
         name.compare(name.size() - 7, 7, ".distcp") == 0;
}

const CheckpointLayout& TorchDcpLayout() {
  static const TorchDcpLayoutImpl layout(TorchDcpFlavor::kTorch2);
  return layout;
}

const CheckpointLayout& TorchDcp113Layout() {
  static const TorchDcpLayoutImpl layout(TorchDcpFlavor::kTorch113);
  return layout;
}

}  // namespace dcp
