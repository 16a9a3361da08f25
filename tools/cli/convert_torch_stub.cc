// Built when dcp is configured without LibTorch: the torch conversions report that clearly.
#include "proto/error.h"
#include "tools/cli/convert.h"

namespace dcp::cli {

namespace {
[[noreturn]] void NoTorch() {
  throw CliError{kUnsupported,
                 "this dcp was built without LibTorch: torch.save conversion is unavailable "
                 "(rebuild with -DDCP_WITH_TORCH=ON and LibTorch installed); safetensors works"};
}
}  // namespace

bool HaveTorch() { return false; }
void ExportTorch(const Checkpoint&, const std::string&, const ConvertOptions&) { NoTorch(); }
void ImportTorch(const std::string&, const std::string&, const ConvertOptions&) { NoTorch(); }

}  // namespace dcp::cli
