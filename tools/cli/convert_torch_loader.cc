// ConvertTorch: a checkpoint into a torch.save file loads the LibTorch-based module
// (libdcp_cli_torch.so, next to the executable in the build tree, or in the library directory
// when installed) only when asked for, so that the other commands start in milliseconds instead
// of loading LibTorch. The other way needs no LibTorch (convert_torch_import.cc).
#include <dlfcn.h>
#include <unistd.h>

#include <filesystem>
#include <vector>

#include "tools/cli/convert.h"

#ifndef DCP_CLI_TORCH_MODULE
#define DCP_CLI_TORCH_MODULE ""  // this build has no LibTorch
#endif
#ifndef DCP_CLI_LIBDIR_FROM_BINDIR
#define DCP_CLI_LIBDIR_FROM_BINDIR "../lib"
#endif

namespace dcp::cli {

namespace {

ConvertTorchFn* LoadModule() {
  const std::string module = DCP_CLI_TORCH_MODULE;
  if (module.empty()) {
    throw CliError{kUnsupported,
                   "this dcp was built without LibTorch: writing torch.save files is unavailable "
                   "(rebuild with -DDCP_WITH_TORCH=ON and LibTorch installed); reading them, and "
                   "safetensors both ways, work"};
  }
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  std::vector<std::filesystem::path> candidates;
  if (!ec) {
    candidates.push_back(exe.parent_path() / module);
    candidates.push_back(exe.parent_path() / DCP_CLI_LIBDIR_FROM_BINDIR / module);
  }
  std::string errors;
  for (const auto& path : candidates) {
    if (!std::filesystem::exists(path, ec)) continue;
    void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
      const char* e = ::dlerror();
      errors += std::string("; ") + (e ? e : path.string());
      continue;
    }
    if (void* fn = ::dlsym(handle, kConvertTorchSymbol))
      return reinterpret_cast<ConvertTorchFn*>(fn);
    errors += "; " + path.string() + " has no " + kConvertTorchSymbol;
  }
  throw CliError{kUnsupported, "the torch conversion module " + module +
                                   " is missing or cannot be loaded (looked next to the dcp "
                                   "executable and in its library directory" +
                                   errors + ")"};
}

}  // namespace

void ConvertTorch(bool to_torch, const std::string& src, const std::string& dst,
                  const ConvertOptions& o) {
  if (!to_torch) {
    ImportTorch(src, dst, o);  // needs no LibTorch (convert_torch_import.cc)
    return;
  }
  ConvertTorchFn* fn = LoadModule();
  std::vector<char> err(8192, '\0');
  const int rc = fn(to_torch ? 1 : 0, src.c_str(), dst.c_str(), o.overwrite ? 1 : 0, o.budget_bytes,
                    err.data(), err.size());
  if (rc != kOk) throw CliError{rc, err.data()};
}

}  // namespace dcp::cli
