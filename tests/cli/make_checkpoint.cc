// Makes the small checkpoints the CLI tests work on: 2 ranks (threads of one process), a
// row-sharded, a column-sharded and a middle-dimension-sharded tensor, a replicated one, mixed
// dtypes, a scalar, a blob. Values follow simple formulas that tests/cli/cli_test.py recomputes
// independently.
//
//   dcp_cli_fixture DIR [--changed] [--zstd] [--hostile KIND]
//   dcp_cli_fixture DIR [--hashes] [--base SIBLING]
//   --changed: model.w[1][2] += 0.5; --zstd: compress every item that gets smaller (a mix)
//   --hashes: record content hashes (format version 3); --base SIBLING: an incremental save
//   sharing unchanged items with the checkpoint SIBLING beside DIR
//   --hostile KIND: then rewrite the metadata (or add files) as an attacker could; KIND is
//     blob-8g (the blob claims 8 GiB), zstd-8g (a zstd blob with raw_length 8 GiB),
//     alloc-2g (the blob claims 2 GiB, backed by a sparse data file), rot13, zstd-zstd,
//     no-crc (every checksum stripped), key-path (model.w's key path disagrees with it),
//     nested (an entry under the blob), slash (a relative_path with a '/'), tmp (a leftover
//     metadata.dcp.tmp.* file); saved with metadata version 2: v2-chunks (a rule claiming 2^30
//     chunks of no bytes over 2 ranks' files), v2-index-1g (rank 0's file made a sparse 1 GiB
//     with its table row claiming a 1 GiB index)
#include <unistd.h>

#include <cstring>
#include <iostream>
#include <thread>

#include "dcp/dcp.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/storage/format/dcp_layout.h"
#include "dcp/storage/registry.h"

using namespace dcp;

namespace {

uint16_t ToHalf(float f) {  // exact for the small multiples of 1/8 used here
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  if ((x & 0x7fffffff) == 0) return static_cast<uint16_t>(sign);
  const int exp = static_cast<int>((x >> 23) & 0xff) - 127 + 15;
  return static_cast<uint16_t>(sign | (exp << 10) | ((x >> 13) & 0x3ff));
}

uint16_t ToBFloat16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  return static_cast<uint16_t>(x >> 16);
}

struct Globals {
  TensorView w = TensorView::Allocate(DType::kFloat32, {6, 5});
  TensorView c = TensorView::Allocate(DType::kFloat32, {4, 6});
  TensorView h = TensorView::Allocate(DType::kFloat16, {3, 4});
  TensorView bf = TensorView::Allocate(DType::kBFloat16, {5});
  TensorView step = TensorView::Allocate(DType::kInt64, {});
  TensorView mask = TensorView::Allocate(DType::kBool, {7});
  TensorView i8 = TensorView::Allocate(DType::kInt8, {2, 3});
  TensorView k = TensorView::Allocate(DType::kFloat64, {2, 3, 4});
};

void Fill(Globals& g, bool changed) {
  auto* w = static_cast<float*>(g.w.data);
  for (int i = 0; i < 6; ++i)
    for (int j = 0; j < 5; ++j) w[i * 5 + j] = i * 10 + j + 0.25f;
  if (changed) w[1 * 5 + 2] += 0.5f;
  auto* c = static_cast<float*>(g.c.data);
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 6; ++j) c[i * 6 + j] = (i - j) * 0.5f;
  auto* h = static_cast<uint16_t*>(g.h.data);
  for (int i = 0; i < 12; ++i) h[i] = ToHalf(i / 8.0f);
  auto* bf = static_cast<uint16_t*>(g.bf.data);
  for (int i = 0; i < 5; ++i) bf[i] = ToBFloat16(i - 2.5f);
  *static_cast<int64_t*>(g.step.data) = 1234567890123;
  auto* mask = static_cast<uint8_t*>(g.mask.data);
  for (int i = 0; i < 7; ++i) mask[i] = i % 2 == 0;
  auto* i8 = static_cast<int8_t*>(g.i8.data);
  for (int i = 0; i < 6; ++i) i8[i] = static_cast<int8_t>(i - 3);
  auto* k = static_cast<double*>(g.k.data);
  for (int i = 0; i < 24; ++i) k[i] = (i / 12) * 100 + (i / 4 % 3) * 10 + i % 4;
}

StateDict RankState(Globals& g, int rank) {
  StateDict sd;
  // model.w: rows 0-3 on rank 0, 3-6 on rank 1. model.c: columns 0-2 / 2-6 (strided views).
  const int64_t r0 = rank == 0 ? 0 : 3, c0 = rank == 0 ? 0 : 2, cn = rank == 0 ? 2 : 4;
  sd.Nested("model")
      .Set("w", ShardedTensor{DType::kFloat32, {6, 5}, {{g.w.Narrow({r0, 0}, {3, 5}), {r0, 0}}}})
      .Set("c", ShardedTensor{DType::kFloat32, {4, 6}, {{g.c.Narrow({0, c0}, {4, cn}), {0, c0}}}})
      .Set("h", g.h)  // replicated: written once
      .Set("bf", g.bf)
      // model.k: a 3-d tensor sharded along its middle dimension (1 / 2 of 3 on ranks 0 / 1).
      .Set("k", ShardedTensor{DType::kFloat64,
                              {2, 3, 4},
                              {{g.k.Narrow({0, rank, 0}, {2, rank + 1, 4}), {0, rank, 0}}}});
  sd.Set("step", g.step).Set("mask", g.mask).Set("i8", g.i8);
  sd.Set("rng", Blob{std::string("\x00\x01\xffstate", 8)});
  return sd;
}

// Rewrite the checkpoint at `dir` as `kind` says (see the header). False for an unknown kind.
bool MakeHostile(const std::string& dir, const std::string& kind) {
  auto store = OpenStore(dir);
  Metadata md = DecodeMetadataFile(store->ReadAll(kMetadataName, UINT64_MAX), dir);
  constexpr uint64_t kGiB = uint64_t{1} << 30;
  if (kind == "v2-chunks") {
    TensorMetadata* rule = nullptr;
    for (auto& [fqn, e] : md.entries) {
      auto* t = std::get_if<TensorMetadata>(&e);
      if (t != nullptr && t->regular) {
        t->regular->world = int32_t{1} << 30;
        rule = t;
      }
    }
    if (rule == nullptr) return false;
    md.world_size = int32_t{1} << 30;
    rule->shape.assign(rule->shape.size(), 0);
    rule->shape[static_cast<size_t>(rule->regular->dim)] = int64_t{1} << 30;
    store->PublishAtomically(kMetadataName, EncodeMetadataFile(md));
    return true;
  }
  if (kind == "v2-index-1g") {
    DataFile& f = md.files.at(0);
    f.index_copy.clear();
    f.index_length = kFileIndexHeaderBytes + (kGiB / kFileIndexItemBytes) * kFileIndexItemBytes;
    f.size = f.index_offset + f.index_length;
    const std::string file = dir + "/" + f.name;
    if (::truncate(file.c_str(), static_cast<off_t>(f.size)) != 0) return false;
    store->PublishAtomically(kMetadataName, EncodeMetadataFile(md));
    return true;
  }
  StorageInfo& rng = md.storage.at(MetadataIndex{"rng", {}, {}});
  if (kind == "blob-8g") {
    rng.length = rng.raw_length = 8 * kGiB;
  } else if (kind == "zstd-8g") {
    rng.transforms = {"zstd"};
    rng.raw_length = 8 * kGiB;
  } else if (kind == "alloc-2g") {
    // A new data file, sparse, that really is long enough: only memory can refuse it.
    rng.relative_path = "data-ffffffffffffffff-r0-b0.data";
    rng.offset = 0;
    rng.length = rng.raw_length = 2 * kGiB;
    rng.crc32c.reset();
    const std::string file = dir + "/" + rng.relative_path;
    auto out = store->Create(rng.relative_path);
    out->Close();
    if (::truncate(file.c_str(), static_cast<off_t>(2 * kGiB)) != 0) return false;
  } else if (kind == "rot13") {
    rng.transforms = {"rot13"};
  } else if (kind == "zstd-zstd") {
    rng.transforms = {"zstd", "zstd"};
  } else if (kind == "no-crc") {
    for (auto& [index, info] : md.storage) info.crc32c.reset();
  } else if (kind == "key-path") {
    md.key_paths["model.w"] = {"model", "v"};
  } else if (kind == "nested") {
    md.entries["rng.state"] = BytesMetadata{};
    md.storage[MetadataIndex{"rng.state", {}, {}}] = rng;
    md.key_paths["rng.state"] = {"rng", "state"};
  } else if (kind == "slash") {
    rng.relative_path = "sub/" + rng.relative_path;
  } else if (kind == "tmp") {
    store->Create(std::string(kMetadataName) + ".tmp.0123abcd")->Close();
    return true;
  } else {
    return false;
  }
  store->PublishAtomically(kMetadataName, EncodeMetadataFile(md));
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: dcp_cli_fixture DIR [--changed] [--zstd]\n";
    return 2;
  }
  const std::string dir = argv[1];
  bool changed = false;
  std::string hostile;
  SaveOptions so;
  for (int i = 2; i < argc; ++i) {
    if (std::strcmp(argv[i], "--changed") == 0) {
      changed = true;
    } else if (std::strcmp(argv[i], "--zstd") == 0) {
      so.storage.compression = Compression::kZstd;
      so.storage.compression_min_bytes = 0;  // the items are tiny: compress whatever shrinks
      so.storage.compression_max_ratio = 1;
    } else if (std::strcmp(argv[i], "--hashes") == 0) {
      so.storage.content_hashes = true;  // format version 3
    } else if (std::strcmp(argv[i], "--base") == 0 && i + 1 < argc) {
      so.storage.incremental_base = argv[++i];  // share unchanged items with that sibling
    } else if (std::strcmp(argv[i], "--hostile") == 0 && i + 1 < argc) {
      hostile = argv[++i];
      // Most attacks edit the items version 1 lists; the v2- ones the file table and rules.
      so.storage.metadata_version = hostile.rfind("v2-", 0) == 0 ? 2 : 1;
    } else {
      std::cerr << "unknown option " << argv[i] << "\n";
      return 2;
    }
  }
  Globals g;
  Fill(g, changed);
  InProcessGroup group(2);
  std::vector<std::exception_ptr> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        StateDict sd = RankState(g, r);
        Save(sd, dir, group.communicator(r), so);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) {
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& ex) {
        std::cerr << "save failed: " << ex.what() << "\n";
        return 1;
      }
    }
  }
  if (!hostile.empty() && !MakeHostile(dir, hostile)) {
    std::cerr << "cannot make hostile checkpoint '" << hostile << "'\n";
    return 2;
  }
  return 0;
}
