// PyTorch DCP's layout (storage/format/torch_dcp.h): `.metadata`, a pickle, and record files
// "__<rank>_<n>.<save>.distcp" of torch.save archives, one per item. torch reads neither dcp's
// zstd items nor its CRC32C, so compression is refused; every record carries zip CRC-32s.
#include "dcp/proto/device/device.h"
#include "dcp/proto/error.h"
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
    const bool as_is =
        IsTorchSaveArchive(data.bytes) && !TorchSaveBytesPayload(data.bytes, &payload);
    const std::string wrapped = as_is ? std::string() : TorchSaveOfBytes(data.bytes);
    const std::string_view record = as_is ? data.bytes : std::string_view(wrapped);
    out.Append(record.data(), record.size());
    info.length = record.size();
    info.raw_length = record.size();
  }

 private:
  bool torch2_;
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
