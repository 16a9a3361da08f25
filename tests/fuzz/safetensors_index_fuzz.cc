// libFuzzer target: a whole sharded safetensors checkpoint is untrusted input
// (storage/format/safetensors.h): model.safetensors.index.json and the files it names. The input
// is the index, then each file as "\n==> NAME\n" and its bytes:
//
//   {"weight_map": {"a": "x.safetensors"}}
//   ==> x.safetensors
//   <8-byte length><header JSON><data>
//
// so the fuzzer varies the index, the file names and every header together (the other
// safetensors target, safetensors_fuzz.cc, varies a header alone, or an index over two fixed
// files). The checkpoint is put into a mem:// store and read as a load reads it. Reading must
// either throw a dcp::Error or give metadata that holds what the reader promises: every item
// inside its file, no two tensors' bytes overlapping. A breach aborts (a finding), as a crash,
// a hang, an out-of-bounds read or an absurd allocation does. Built with clang when DCP_FUZZ is
// on; `tools/setup.sh test` runs it over tests/fuzz/safetensors_index_corpus.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "dcp/proto/error.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/storage/backends/mem_store.h"
#include "dcp/storage/format/safetensors.h"
#include "fuzz_files.h"

namespace {

constexpr char kStoreName[] = "safetensors-index-fuzz";

void Put(dcp::Store& store, const std::string& name, std::string_view bytes) {
  auto w = store.Create(name);
  w->Append(bytes.data(), bytes.size());
  w->Close();
}

[[noreturn]] void Breach(const std::string& what) {
  std::fprintf(stderr, "accepted a checkpoint that breaks the reader's promise: %s\n",
               what.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  std::string_view index;
  std::map<std::string, std::string_view> files = dcp::fuzz::SplitFiles(in, &index);

  dcp::ClearMemStore(kStoreName);
  const std::shared_ptr<dcp::Store> store = dcp::MakeMemStore(kStoreName);
  dcp::Metadata md;
  try {
    for (const auto& [name, body] : files) Put(*store, name, body);
    Put(*store, dcp::kSafetensorsIndexName, index);
    md = dcp::ReadSafetensorsMetadata(*store);
  } catch (const dcp::Error&) {
    return 0;
  }
  // Accepted: every item lies inside its file, and no two overlap.
  std::map<std::string, std::vector<std::pair<uint64_t, uint64_t>>> ranges;
  files[dcp::kSafetensorsIndexName] = index;  // what the store holds under that name
  for (const auto& [index_key, info] : md.storage) {
    auto it = files.find(info.relative_path);
    if (it == files.end()) Breach("an item in '" + info.relative_path + "', which was not given");
    if (info.offset > it->second.size() || info.length > it->second.size() - info.offset) {
      Breach("item '" + index_key.fqn + "' reaches past the end of '" + info.relative_path + "'");
    }
    if (info.length > 0) ranges[info.relative_path].emplace_back(info.offset, info.length);
  }
  for (auto& [file, rs] : ranges) {
    std::sort(rs.begin(), rs.end());
    for (size_t i = 1; i < rs.size(); ++i) {
      if (rs[i].first < rs[i - 1].first + rs[i - 1].second) Breach("items overlap in " + file);
    }
  }
  return 0;
}
