// A plain path takes a query exactly as file:// does (issue 43): `/x/hf?format=safetensors`
// writes Hugging Face's layout into /x/hf, for every entry point (Save, Load, OpenStore, the
// CheckpointManager's step locations). Before, the query of a plain path was part of the path:
// the save wrote dcp's layout into a directory literally named "hf?format=safetensors".
#include <catch2/catch.hpp>
#include <filesystem>

#include "dcp/dcp.h"
#include "dcp/storage/format/dcp_layout.h"
#include "dcp/storage/format/layout.h"
#include "dcp/storage/format/safetensors.h"
#include "dcp/storage/registry.h"
#include "support/test_support.h"

using namespace dcp;
using namespace dcp::testing;
using Catch::Matchers::Contains;

TEST_CASE("registry: a plain path takes a query as file:// does",
          "[storage][option:StorageOptions::format]") {
  const ParsedUri p = ParseUri("/plain/path?x=1&format=safetensors");
  CHECK(p.scheme == "file");
  CHECK(p.location == "/plain/path");
  CHECK(p.query == BackendOptionMap{{"x", "1"}, {"format", "safetensors"}});
  CHECK(ParseUri("relative/dir?direct_io=0").location == "relative/dir");
  CHECK(SplitUri("/plain/path?x=1").second == "/plain/path");
  CHECK(JoinUri("/d/x?format=safetensors", "step-3") == "/d/x/step-3?format=safetensors");
  CHECK(JoinUri("/d/x", "step-3") == "/d/x/step-3");
  // A '?' that does not start a query is refused, saying how paths and queries go together.
  CHECK_THROWS_WITH(ParseUri("/data/run?1"),
                    Contains("'1'") && Contains("not key=value") && Contains("file://"));

  TempDir dir("plain-query");
  StepState s;
  s.Fill(7);

  // Save: the query's format, into the directory the path names.
  Save(s.sd, dir / "hf?format=safetensors");
  CHECK_FALSE(std::filesystem::exists(dir / "hf?format=safetensors"));
  auto store = OpenStore(dir / "hf");
  const CheckpointLayout* layout = DetectLayout(*store);
  REQUIRE(layout != nullptr);
  CHECK(layout->format() == CheckpointFormat::kSafetensors);
  CHECK_FALSE(store->Size(kMetadataName));
  // Load, with the query or without (the format is detected).
  for (const std::string& uri : {dir / "hf?format=safetensors", dir / "hf"}) {
    StepState back;
    back.Fill(0);
    Load(back.sd, uri);
    CHECK(back.Holds(7));
  }
  // Backend options: known ones reach file://, unknown ones are refused naming the key, on a
  // plain path as on file://.
  CHECK(DetectLayout(*OpenStore(dir / "hf?direct_io=0")) != nullptr);
  CHECK_THROWS_WITH(OpenStore(dir / "hf?colour=blue"), Contains("colour") && Contains("file://"));
  CHECK_THROWS_WITH(Save(s.sd, dir / "x?colour=blue"), Contains("colour"));
  CHECK_FALSE(std::filesystem::exists(dir / "x?colour=blue"));

  // The manager's step locations keep the root's query at the end.
  {
    LocalCommunicator comm;
    CheckpointManager m(dir / "managed?direct_io=0", comm);
    m.Save(3, s.sd);
    CHECK(m.PathFor(3) == dir / "managed/step-0000000003?direct_io=0");
    CHECK(std::filesystem::exists(dir / "managed/step-0000000003/" + kMetadataName));
    CHECK(m.CompleteSteps() == std::vector<int64_t>{3});
    m.CloseOrThrow();
  }
  CHECK_FALSE(std::filesystem::exists(dir / "managed?direct_io=0"));
}
