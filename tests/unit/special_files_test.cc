// Special files in a file:// checkpoint (issue 22): a FIFO in place of the metadata or a data
// file, a data file that is a symbolic link to somewhere else, and a huge sparse metadata file
// are refused at once, by name, at little cost.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>

#include "dcp/dcp.h"
#include "support/test_support.h"

using namespace dcp;
using namespace dcp::testing;
using Catch::Matchers::Contains;

namespace {

StateDict SmallState(TensorView& w) {
  StateDict sd;
  sd.Set("w", w);
  return sd;
}

std::string FirstDataFile(const std::string& dir) {
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("data-", 0) == 0) return e.path().string();
  }
  FAIL("no data file in " << dir);
  return {};
}

}  // namespace

TEST_CASE("special files: a FIFO in place of the metadata or a data file is refused at once",
          "[hostile]") {
  TempDir dir("fifo");
  TensorView w = RandomTensor(DType::kFloat32, {64, 4}, 7);
  StateDict sd = SmallState(w);
  Save(sd, dir.path());
  SECTION("metadata") {
    const std::string md = dir.path() + "/metadata.dcp";
    std::filesystem::remove(md);
    REQUIRE(::mkfifo(md.c_str(), 0644) == 0);
    CHECK_THROWS_WITH(ReadMetadata(dir.path()), Contains("not a regular file"));
  }
  SECTION("data file") {
    const std::string data = FirstDataFile(dir.path());
    std::filesystem::remove(data);
    REQUIRE(::mkfifo(data.c_str(), 0644) == 0);
    TensorView back = TensorView::Allocate(DType::kFloat32, {64, 4});
    StateDict into = SmallState(back);
    CHECK_THROWS_WITH(Load(into, dir.path()), Contains("not a regular file"));
  }
}

TEST_CASE("special files: a data file that is a symbolic link is not followed", "[hostile]") {
  TempDir dir("symlink"), elsewhere("symlink-target");
  TensorView w = RandomTensor(DType::kFloat32, {64, 4}, 8);
  StateDict sd = SmallState(w);
  Save(sd, dir.path());
  const std::string data = FirstDataFile(dir.path());
  const std::string moved = elsewhere.path() + "/outside.data";
  std::filesystem::copy_file(data, moved);
  std::filesystem::remove(data);
  std::filesystem::create_symlink(moved, data);
  TensorView back = TensorView::Allocate(DType::kFloat32, {64, 4});
  StateDict into = SmallState(back);
  CHECK_THROWS_WITH(Load(into, dir.path()), Contains("symbolic link"));
}

TEST_CASE("special files: a huge sparse metadata file costs one small read", "[hostile]") {
  TempDir dir("sparse");
  TensorView w = RandomTensor(DType::kFloat32, {8}, 9);
  StateDict sd = SmallState(w);
  Save(sd, dir.path());
  const std::string md = dir.path() + "/metadata.dcp";
  std::filesystem::remove(md);
  {
    const int fd = ::open(md.c_str(), O_WRONLY | O_CREAT, 0644);
    REQUIRE(fd >= 0);
    REQUIRE(::ftruncate(fd, off_t{4} << 30) == 0);  // 4 GiB of zeros, no blocks on disk
    ::close(fd);
  }
  CHECK_THROWS_WITH(ReadMetadata(dir.path()), Contains("not a dcp metadata file"));
  // Refused from its header: the 4 GiB were never read into memory.
  struct rusage ru {};
  ::getrusage(RUSAGE_SELF, &ru);
  CHECK(ru.ru_maxrss < 1024 * 1024);  // KiB: well under 1 GiB peak for the whole test
}
