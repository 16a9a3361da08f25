// libFuzzer target: PyTorch DCP inputs are untrusted. A `.metadata` pickle (restricted unpickler,
// then the mapping onto dcp's Metadata and its validation), a torch.save record read as a load
// reads it (libzip over the archive, the tensor pickle, its storage and CRC-32, a strided copy of
// its values), a record's every entry inflated and checked as verify does, and a whole torch.save
// file as `dcp convert` reads it must each either succeed or throw a dcp::Error: never crash,
// hang, read out of bounds or allocate absurdly. The first byte picks the target.
// Built with clang when DCP_FUZZ is on; `tools/setup.sh test` runs it over tests/fuzz/torch_corpus.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

#include "dcp/proto/error.h"
#include "dcp/proto/tensor.h"
#include "dcp/storage/format/pickle.h"
#include "dcp/storage/format/torch_dcp.h"

namespace {

class BytesObject : public dcp::ReadableObject {
 public:
  explicit BytesObject(std::string_view s) : s_(s) {}
  void ReadAt(uint64_t offset, void* dst, size_t n) override {
    if (offset > s_.size() || n > s_.size() - offset) throw dcp::CorruptionError("short read");
    if (n > 0) std::memcpy(dst, s_.data() + offset, n);
  }
  uint64_t size() const override { return s_.size(); }

 private:
  std::string_view s_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    switch (data[0] % 8) {  // 4-7: a whole torch.save file (ReadTorchSaveFile)
      case 0:
        dcp::DecodeTorchDcpMetadata(bytes, "fuzz");
        break;
      case 1: {
        // A record as a load reads it: resolved, its storage read and CRC-checked, and its
        // values copied through its strides into a row-major tensor (as a strided load does).
        BytesObject in(bytes);
        const dcp::TorchTensorRecord rec =
            dcp::ResolveTorchTensorRecord(in, 0, bytes.size(), "fuzz");
        const std::vector<char> storage = dcp::ReadTorchRecordStorage(in, rec, "fuzz", true);
        const int64_t numel = dcp::NumElements(rec.sizes);
        if (rec.span_bytes > 0 && numel <= (int64_t{64} << 20) / 8) {  // stride 0 is legal
          std::vector<char> dst(static_cast<size_t>(numel) * dcp::ElementSize(rec.dtype));
          dcp::TensorView src;
          src.data = const_cast<char*>(storage.data()) + (rec.values_begin() - rec.storage_begin);
          src.dtype = rec.dtype;
          src.shape = rec.sizes;
          src.strides = rec.strides;
          dcp::CopyTensor(dcp::TensorView::FromContiguous(dst.data(), rec.dtype, rec.sizes), src);
        }
        break;
      }
      case 3: {
        // Every entry of a record inflated and CRC-checked, as `dcp verify` does.
        BytesObject in(bytes);
        dcp::CheckTorchArchiveCrcs(in, 0, bytes.size(), "fuzz");
        break;
      }
      default: {
        // A whole torch.save file, as `dcp convert FILE.pt` reads it: every leaf located, and
        // each tensor's storage read and CRC-checked.
        BytesObject in(bytes);
        for (const auto& leaf : dcp::ReadTorchSaveFile(in, bytes.size(), "fuzz")) {
          if (leaf.tensor) dcp::ReadTorchRecordStorage(in, *leaf.tensor, "fuzz", true);
        }
        break;
      }
      case 2:
        dcp::pickle::Load(
            bytes, [](std::string_view, std::string_view) { return true; }, "fuzz");
        break;
    }
  } catch (const dcp::Error&) {
  }
  return 0;
}
