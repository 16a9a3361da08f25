// libFuzzer target: a whole version-2 dcp checkpoint is untrusted input (docs/FORMAT.md §5a): the
// metadata with its file table, and the data files with the indexes at their ends. The input is
// the metadata's bytes, then each data file as "\n==> NAME\n" and its bytes:
//
//   <metadata.dcp bytes>
//   ==> data-...-r0-b0.data
//   <items><index>
//
// so the fuzzer varies the document, the file names, the items and every index together (the
// other dcp target, metadata_fuzz.cc, varies a document alone). The checkpoint is put into a
// mem:// store and judged as `dcp verify` judges it (its own code, output discarded); when
// verify accepts it, every entry is loaded whole (dcp::Load, the path every load takes), which
// must succeed: whatever verify accepts loads with the values it checked. Every claim is bounded
// by what is stored, so a load of an input of a few KiB allocates little: a claim past
// kMaxLoadBytes that verify accepts is a finding, as a crash, a hang, an out-of-bounds read or
// an absurd allocation (libFuzzer's -rss_limit_mb) is. Built with clang when DCP_FUZZ is on;
// `tools/setup.sh test` runs it over tests/fuzz/metadata_v2_corpus.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <string_view>

#include "dcp/checkpoint.h"
#include "dcp/proto/error.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/storage/backends/mem_store.h"
#include "dcp/storage/format/dcp_layout.h"
#include "fuzz_files.h"
#include "tools/cli/cli_common.h"
#include "tools/cli/commands.h"

namespace {

constexpr char kStoreName[] = "metadata-v2-fuzz";
// The entries' bytes a load may be asked to allocate: an accepted input's claims are backed by
// its stored bytes (at most kMaxZstdExpansion x for zstd items), and inputs are kept small.
constexpr uint64_t kMaxLoadBytes = uint64_t{256} << 20;

void Put(dcp::Store& store, const std::string& name, std::string_view bytes) {
  auto w = store.Create(name);
  w->Append(bytes.data(), bytes.size());
  w->Close();
}

[[noreturn]] void Breach(const std::string& what) {
  std::fprintf(stderr, "verify accepted a checkpoint that a load does not: %s\n", what.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Verify reports on stdout; a fuzzing run does not need its lines.
  if (std::freopen("/dev/null", "w", stdout) == nullptr) std::abort();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  std::string_view metadata;
  std::map<std::string, std::string_view> files = dcp::fuzz::SplitFiles(in, &metadata);
  files.erase(dcp::kMetadataName);  // the document is the metadata

  dcp::ClearMemStore(kStoreName);
  const std::shared_ptr<dcp::Store> store = dcp::MakeMemStore(kStoreName);
  const std::string uri = std::string("mem://") + kStoreName;
  try {
    for (const auto& [name, body] : files) Put(*store, name, body);
    Put(*store, dcp::kMetadataName, metadata);
  } catch (const dcp::Error&) {
    return 0;
  }
  int verdict;
  try {
    verdict = dcp::cli::Verify(uri, /*json=*/false);
  } catch (const dcp::Error&) {
    return 0;  // refused, with a typed error
  } catch (const dcp::cli::CliError&) {
    return 0;  // refused, as the command line reports it (its exit code)
  }
  if (verdict != dcp::cli::kOk) return 0;

  // Accepted: a load of every entry, whole, succeeds.
  dcp::Metadata md;
  try {
    md = dcp::ReadMetadata(uri);
  } catch (const dcp::Error& e) {
    Breach(std::string("reading its metadata: ") + e.what());
  }
  dcp::StateDict sd;
  uint64_t bytes = 0;
  for (const auto& [fqn, entry] : md.entries) {
    if (const auto* t = std::get_if<dcp::TensorMetadata>(&entry)) {
      bytes += static_cast<uint64_t>(dcp::NumElements(t->shape)) * dcp::ElementSize(t->dtype);
      if (bytes > kMaxLoadBytes) Breach("its entries claim more than " + std::to_string(bytes));
      sd.Set(fqn, dcp::TensorView::Allocate(t->dtype, t->shape));
    } else {
      bytes += std::get<dcp::BytesMetadata>(entry).size;
      if (bytes > kMaxLoadBytes) Breach("its entries claim more than " + std::to_string(bytes));
      sd.Set(fqn, dcp::Blob{});
    }
  }
  try {
    dcp::Load(sd, uri);
  } catch (const dcp::Error& e) {
    Breach(std::string("the load failed: ") + e.what());
  }
  return 0;
}
