// The file store's O_DIRECT writer: exact sizes and bytes for odd, aligned and unaligned appends
// (with and without direct I/O, which must produce identical files), Sync in the middle of a
// partial block, abandonment, and checkpoint round trips of odd-sized tensors either way.
#include <catch2/catch.hpp>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "dcp/storage/backends/file_store.h"
#include "dcp/storage/registry.h"
#include "support/test_support.h"

using namespace dcp;
using dcp::testing::FillRandom;
using dcp::testing::RandomTensor;
using dcp::testing::ReadFileBytes;
using dcp::testing::SameElements;
using dcp::testing::TempDir;

namespace {

struct AlignedBuffer {
  explicit AlignedBuffer(size_t n) : size(n) {
    p = static_cast<char*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096));
  }
  ~AlignedBuffer() { std::free(p); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  char* p;
  size_t size;
};

// Appends of awkward sizes, an aligned append larger than a staging buffer (the zero-copy path
// when the file offset is aligned), and Syncs that leave a partial block behind.
std::string WriteAwkwardObject(Store& store, const std::string& name) {
  std::string expected;
  auto out = store.Create(name);
  auto append = [&](const char* p, size_t n) {
    out->Append(p, n);
    expected.append(p, n);
    REQUIRE(out->size() == expected.size());
  };
  std::vector<char> small(70000);
  FillRandom(small.data(), small.size(), 1);
  const size_t kBig = (32u << 20) + 4096;  // larger than one 16 MiB staging buffer
  AlignedBuffer big(kBig);
  FillRandom(big.p, kBig, 2);

  append(big.p, kBig - 100);  // offset 0: whole blocks straight from aligned memory
  append(small.data(), 1);
  append(small.data() + 1, 4095);  // completes a block
  append(small.data() + 7, 4097);
  out->Sync();                      // partial block written through the page cache
  append(small.data() + 11, 3);     // extends the partial block after the Sync
  append(big.p + 4096, 17u << 20);  // crosses a buffer boundary, unaligned file offset
  out->Sync();
  out->Sync();  // idempotent
  append(small.data(), 0);
  append(small.data() + 5, 65537);
  append(big.p, kBig);  // aligned memory, unaligned offset: staged
  append(small.data() + 13, 1);
  out->Close();
  return expected;
}

}  // namespace

TEST_CASE("file store direct I/O: exact bytes and sizes, same as buffered", "[storage][direct]") {
  TempDir dir("direct");
  auto direct = MakeFileStore(dir.path(), FileStoreOptions{true});
  auto buffered = MakeFileStore(dir.path(), FileStoreOptions{false});
  const std::string a = WriteAwkwardObject(*direct, "direct.data");
  const std::string b = WriteAwkwardObject(*buffered, "buffered.data");
  REQUIRE(a == b);
  CHECK(std::filesystem::file_size(dir / "direct.data") == a.size());
  CHECK(ReadFileBytes(dir / "direct.data") == a);
  CHECK(ReadFileBytes(dir / "buffered.data") == b);
  CHECK(direct->Size("direct.data") == a.size());
}

TEST_CASE("file store direct I/O: tiny objects and abandonment", "[storage][direct]") {
  TempDir dir("direct-small");
  for (bool use_direct : {true, false}) {
    DYNAMIC_SECTION("direct_io=" << use_direct) {
      auto store = MakeFileStore(dir.path(), FileStoreOptions{use_direct});
      for (size_t n : {size_t{0}, size_t{1}, size_t{511}, size_t{4096}, size_t{4097}}) {
        std::string bytes(n, '\0');
        FillRandom(bytes.data(), n, n);
        const std::string name = "o" + std::to_string(n);
        auto out = store->Create(name);
        out->Append(bytes.data(), n);
        out->Sync();
        out->Close();
        CHECK(ReadFileBytes(dir / name) == bytes);
      }
      {
        auto out = store->Create("abandoned");
        std::vector<char> v((20u << 20) + 3, 'x');  // one buffer in flight, one partial
        out->Append(v.data(), v.size());
      }
      CHECK_FALSE(store->Size("abandoned"));
    }
  }
}

TEST_CASE("file store direct I/O: odd tensors round-trip bit-exact", "[storage][direct]") {
  RegisterBackend(
      "file-buffered-test",
      [](const std::string& loc) { return MakeFileStore(loc, FileStoreOptions{false}); }, true);
  for (std::string scheme : {"file", "file-buffered-test"}) {
    for (int files : {1, 2}) {
      DYNAMIC_SECTION(scheme << " files_per_rank=" << files) {
        TempDir dir("direct-rt");
        const std::string uri = scheme + "://" + dir.path() + "/ckpt";
        std::vector<TensorView> src, dst;
        src.push_back(RandomTensor(DType::kUInt8, {1}, 1));
        src.push_back(RandomTensor(DType::kFloat32, {1023, 3}, 2));
        src.push_back(RandomTensor(DType::kUInt8, {4097}, 3));
        src.push_back(RandomTensor(DType::kBFloat16, {4099, 1031}, 4));  // > 8 MiB, odd
        src.push_back(RandomTensor(DType::kFloat64, {1}, 5));
        src.push_back(RandomTensor(DType::kInt8, {4096 * 4096 + 1}, 6));
        StateDict sd, back;
        for (size_t i = 0; i < src.size(); ++i) {
          sd.Set("t" + std::to_string(i), src[i]);
          dst.push_back(TensorView::Allocate(src[i].dtype, src[i].shape));
          back.Set("t" + std::to_string(i), dst.back());
        }
        SaveOptions so;
        so.storage.files_per_rank = files;
        Save(sd, uri, so);
        Load(back, uri);
        for (size_t i = 0; i < src.size(); ++i) CHECK(SameElements(src[i], dst[i]));
      }
    }
  }
}
