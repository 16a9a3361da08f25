// libFuzzer target: PyTorch DCP inputs are untrusted. A `.metadata` pickle (restricted unpickler,
// then the mapping onto dcp's Metadata and its validation) and a torch.save record (minizip over
// the archive, then the tensor pickle) must each either succeed or throw a dcp::Error: never
// crash, hang, read out of bounds or allocate absurdly. The first byte picks the target.
// Built with clang when DCP_FUZZ is on; `tools/setup.sh test` runs it over tests/fuzz/torch_corpus.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "dcp/proto/error.h"
#include "dcp/storage/pickle.h"
#include "dcp/storage/torch_dcp.h"

namespace {

class BytesObject : public dcp::ReadableObject {
 public:
  explicit BytesObject(std::string_view s) : s_(s) {}
  void ReadAt(uint64_t offset, void* dst, size_t n) override {
    if (offset > s_.size() || n > s_.size() - offset) throw dcp::CorruptionError("short read");
    std::memcpy(dst, s_.data() + offset, n);
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
    switch (data[0] % 3) {
      case 0:
        dcp::DecodeTorchDcpMetadata(bytes, "fuzz");
        break;
      case 1: {
        BytesObject in(bytes);
        dcp::ResolveTorchTensorRecord(in, 0, bytes.size(), "fuzz");
        break;
      }
      default:
        dcp::pickle::Load(
            bytes, [](std::string_view, std::string_view) { return true; }, "fuzz");
        break;
    }
  } catch (const dcp::Error&) {
  }
  return 0;
}
