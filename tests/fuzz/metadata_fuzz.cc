// libFuzzer target: a dcp checkpoint is untrusted input. The first byte picks what the rest is:
// - even: a metadata file. Decoding and validating any byte string must either succeed or throw
//   a dcp::Error: never crash, hang, read out of bounds or allocate absurdly.
// - odd: a whole checkpoint, [u32 little-endian n][metadata.dcp, n bytes][data], where `data` is
//   the content of every data file the metadata names (version 2: its file table; each file
//   then ends in the index the table places, so crafted indexes meet the reader too). It is loaded
//   whole (load_all) from mem:// through the store reader, so every item path (raw, zstd, partial,
//   blobs) and every size and checksum check meets crafted records, with the same rule.
// Built with clang when DCP_FUZZ is on; `tools/setup.sh test` runs it for a bounded time over
// the corpus in tests/fuzz/corpus.
#include <google/protobuf/stubs/logging.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <string_view>

#include "dcp/checkpoint.h"
#include "dcp/proto/error.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/storage/backends/mem_store.h"

namespace {

void LoadCheckpoint(std::string_view bytes) {
  if (bytes.size() < 4) return;
  uint32_t n = 0;
  for (int i = 0; i < 4; ++i) n |= static_cast<uint32_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
  bytes.remove_prefix(4);
  const std::string_view meta = bytes.substr(0, std::min<size_t>(n, bytes.size()));
  const std::string_view data = bytes.substr(meta.size());
  dcp::ClearMemStore("fuzz");
  auto store = dcp::MakeMemStore("fuzz");
  store->PublishAtomically("metadata.dcp", meta);
  std::set<std::string> files;
  try {
    const dcp::Metadata md = dcp::DecodeMetadataFile(meta, "fuzz");
    for (const auto& [index, info] : md.storage) {
      if (files.size() < 8) files.insert(info.relative_path);
    }
    for (const auto& f : md.files) {  // version 2: the file table (each file ends in its index)
      if (files.size() < 8) files.insert(f.name);
    }
  } catch (const dcp::Error&) {
  }
  for (const std::string& f : files) {
    if (f.empty() || f.find('/') != std::string::npos) continue;
    try {
      store->PublishAtomically(f, data);
    } catch (const dcp::Error&) {
    }
  }
  dcp::LoadAll("mem://fuzz");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool quiet = [] {
    google::protobuf::SetLogHandler(nullptr);  // invalid inputs are expected; keep the log clean
    return true;
  }();
  (void)quiet;
  if (size == 0) return 0;
  const std::string_view bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 1) {
    try {
      LoadCheckpoint(bytes);
    } catch (const dcp::Error&) {
    }
    return 0;
  }
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
