// dcp -> torch.save files, through LibTorch's pickler (torch::pickle_save writes the zip format
// of Python's torch.save). Built only with LibTorch, as the module libdcp_cli_torch.so that the
// `dcp` command loads on demand (convert_torch_loader.cc). The way back needs no LibTorch
// (convert_torch_import.cc).
//
// Memory: LibTorch pickles one IValue, so the whole state lives in memory at once (the
// checkpoint's tensors are still read chunk by chunk, in bounded pieces, into the destination
// tensors; no second copy is made). For states larger than memory use safetensors, which
// streams.
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "dcp/checkpoint.h"
#include "dcp/proto/error.h"
#include "dcp/torch_adapter.h"
#include "tools/cli/convert.h"

namespace dcp::cli {

namespace {

// The key under which the names of byte entries are listed (their values are uint8 tensors).
constexpr char kBlobsKey[] = "__dcp_blobs__";

torch::Tensor BytesTensor(const std::string& bytes) {
  torch::Tensor t = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
  if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

}  // namespace

void ExportTorch(const Checkpoint& src, const std::string& out, const ConvertOptions& o);

void ExportTorch(const Checkpoint& src, const std::string& out, const ConvertOptions& o) {
  if (!o.overwrite && std::filesystem::exists(out)) {
    throw CliError{kUsage, "'" + out + "' exists; pass --overwrite to replace it"};
  }
  const Metadata& md = src.md;
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  c10::List<std::string> blob_names;
  {
    Progress progress("read", md.TotalStoredBytes());
    for (const auto& [fqn, entry] : md.entries) {
      if (const auto* t = std::get_if<TensorMetadata>(&entry)) {
        // CheckDataFiles (run on open) made sure the data backs this size; the machine may
        // still lack the memory, which is reported naming the entry, not as a bare failure.
        const uint64_t nbytes =
            static_cast<uint64_t>(NumElements(t->shape)) * ElementSize(t->dtype);
        // A dtype this LibTorch lacks is UnsupportedError (exit 6), not an allocation failure.
        const c10::ScalarType dtype = ToTorchDType(t->dtype);
        torch::Tensor tensor;
        try {
          tensor = torch::empty(t->shape, torch::dtype(dtype));
        } catch (const std::exception& e) {  // c10's allocation failure, or std::bad_alloc
          throw ResourceError(OutOfMemoryMessage("entry '" + fqn + "'", nbytes) + " (" + e.what() +
                              ")");
        }
        auto* dst = static_cast<char*>(tensor.data_ptr());
        TensorStream stream(*src.store, md, fqn, o.budget_bytes);
        const char* data;
        size_t n;
        while (stream.Next(data, n)) {
          std::memcpy(dst, data, n);
          dst += n;
          progress.Add(n);
        }
        dict.insert(fqn, tensor);
      } else {
        const std::string bytes = ReadBlob(*src.store, md, fqn);
        progress.Add(bytes.size());
        dict.insert(fqn, BytesTensor(bytes));
        blob_names.push_back(fqn);
      }
    }
  }
  if (!blob_names.empty()) dict.insert(kBlobsKey, blob_names);
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(dict));
  const std::string tmp = out + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    f.close();
    if (!f) {
      std::error_code ec;
      std::filesystem::remove(tmp, ec);
      throw IoError("cannot write '" + tmp + "'", false);
    }
  }
  std::filesystem::rename(tmp, out);
}

}  // namespace dcp::cli

extern "C" int dcp_cli_torch_convert(int to_torch, const char* src, const char* dst, int overwrite,
                                     unsigned long long budget_bytes, char* err, size_t err_len) {
  using namespace dcp::cli;
  try {
    ConvertOptions o;
    o.overwrite = overwrite != 0;
    o.budget_bytes = static_cast<size_t>(budget_bytes);
    if (!to_torch) throw CliError{kUsage, "this module writes torch.save files only"};
    const Checkpoint c = OpenCheckpoint(src);
    CheckDataFiles(c);
    ExportTorch(c, dst, o);
    return kOk;
  } catch (...) {
    const CliError e = ClassifyCurrentException();
    std::snprintf(err, err_len, "%s", e.message.c_str());
    return e.code;
  }
}
