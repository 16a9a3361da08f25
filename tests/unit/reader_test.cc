// The reader's parallel path: a large whole item is read in 32 MiB pieces by every read thread,
// each piece CRC'd alone and the CRCs combined; corruption in any piece is still named.
#include <catch2/catch.hpp>
#include <cstdio>
#include <filesystem>

#include "support/test_support.h"

using namespace dcp;
using namespace dcp::testing;
using Catch::Matchers::Contains;

TEST_CASE("reader: large items read in parallel pieces, corruption in any piece is named",
          "[reader]") {
  TempDir dir("rd");
  const TensorView big = RandomTensor(DType::kFloat32, {5, 5 << 20}, 81);  // 100 MiB: 4 pieces
  const TensorView small = RandomTensor(DType::kInt8, {1000}, 82);
  StateDict sd;
  sd.Set("big", big);
  sd.Set("small", small);
  LocalCommunicator comm;
  Save(sd, dir / "c", comm);
  for (int threads : {1, 2, 3}) {
    for (bool verify : {true, false}) {
      INFO("threads " << threads << " verify " << verify);
      StateDict back;
      TensorView b = TensorView::Allocate(DType::kFloat32, big.shape);
      TensorView s = TensorView::Allocate(DType::kInt8, {1000});
      back.Set("big", b);
      back.Set("small", s);
      LoadOptions o;
      o.storage.read_threads = threads;
      o.storage.verify_checksums = verify;
      Load(back, dir / "c", comm, o);
      CHECK(SameElements(b, big));
      CHECK(SameElements(s, small));
    }
  }
  // Flip one byte in the third piece of "big" (the file holds big first: larger items first).
  std::string data;
  for (const auto& e : std::filesystem::directory_iterator(dir / "c")) {
    if (e.path().extension() == ".data") data = e.path();
  }
  const Metadata md = ReadMetadata(dir / "c");
  uint64_t offset = 0;
  for (const auto& [index, info] : md.storage) {
    if (index.fqn == "big") offset = info.offset;
  }
  const long at = static_cast<long>(offset + (70u << 20) + 12345);
  std::FILE* f = std::fopen(data.c_str(), "r+b");
  REQUIRE(f);
  std::fseek(f, at, SEEK_SET);
  const int c = std::fgetc(f);
  std::fseek(f, at, SEEK_SET);
  std::fputc(c ^ 1, f);
  std::fclose(f);
  StateDict back;
  back.Set("big", TensorView::Allocate(DType::kFloat32, big.shape));
  LoadOptions o;
  o.allow_partial_load = true;
  o.storage.read_threads = 2;
  const std::string msg = MessageOf<CollectiveError>([&] { Load(back, dir / "c", comm, o); });
  CHECK_THAT(msg, Contains("checksum mismatch") && Contains("big") && Contains(".data") &&
                      Contains("offset " + std::to_string(offset)));
}
