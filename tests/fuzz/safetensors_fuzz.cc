// libFuzzer target: safetensors input is untrusted (storage/format/safetensors.h). The first byte
// picks what the rest is: a safetensors file (its 8-byte length, JSON header and data mapped
// onto dcp Metadata and validated), or a model.safetensors.index.json beside two small shards
// (the weight_map's file names checked, each named file's header read through a Store). Each
// must either succeed or throw a dcp::Error: never crash, hang, read out of bounds or allocate
// absurdly. Built with clang when DCP_FUZZ is on; `tools/setup.sh test` runs it over
// tests/fuzz/safetensors_corpus.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "dcp/proto/error.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/storage/backends/mem_store.h"
#include "dcp/storage/format/safetensors.h"

namespace {

void Put(dcp::Store& store, const std::string& name, std::string_view bytes) {
  auto w = store.Create(name);
  w->Append(bytes.data(), bytes.size());
  w->Close();
}

std::string Shard(std::string_view header, size_t data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return out + std::string(header) + std::string(data, '\x3c');
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    if (data[0] % 2 == 0) {
      dcp::Metadata md;
      dcp::AddSafetensorsFile(bytes, bytes.size(), "model.safetensors", "fuzz", md);
      dcp::ValidateMetadata(md, "fuzz");
    } else {
      static const std::shared_ptr<dcp::Store> store = [] {
        dcp::ClearMemStore("safetensors-fuzz");
        auto s = dcp::MakeMemStore("safetensors-fuzz");
        Put(*s, "model-00001-of-00002.safetensors",
            Shard(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})", 16));
        Put(*s, "model-00002-of-00002.safetensors",
            Shard(R"({"b":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]},)"
                  R"("__metadata__":{"format":"pt"}})",
                  6));
        return s;
      }();
      Put(*store, dcp::kSafetensorsIndexName, bytes);
      dcp::ReadSafetensorsMetadata(*store);
    }
  } catch (const dcp::Error&) {
  }
  return 0;
}
