// libFuzzer target: metadata is untrusted input. Decoding and validating any byte string must
// either succeed or throw a dcp::Error: never crash, hang, read out of bounds or allocate absurdly.
// Built with clang when DCP_FUZZ is on; `tools/setup.sh test` runs it for a bounded time over
// the corpus in tests/fuzz/corpus.
#include <google/protobuf/stubs/logging.h>

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "dcp/proto/codec.h"
#include "dcp/proto/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool quiet = [] {
    google::protobuf::SetLogHandler(nullptr);  // invalid inputs are expected; keep the log clean
    return true;
  }();
  (void)quiet;
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    dcp::DecodeMetadataFile(bytes, "fuzz");
  } catch (const dcp::Error&) {
  }
  // The payload alone (as received over the wire), then validated.
  try {
    dcp::ValidateMetadata(dcp::DecodeMetadata(bytes, "fuzz"), "fuzz");
  } catch (const dcp::Error&) {
  }
  return 0;
}
