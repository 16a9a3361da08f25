// The unit tests' runner: Catch2's, plus exit code 77 when every test case it ran skipped
// (dcp::testing::SkipTestCase: no S3 test server, a build without the s3:// backend), so that
// CTest, which runs each test case in a process of its own with SKIP_RETURN_CODE 77, reports
// those as "Skipped" instead of passed. A run with a failure keeps Catch2's code; a run where
// any test case ran keeps 0.
#define CATCH_CONFIG_EXTERNAL_INTERFACES  // the listener base class
#include <catch2/catch.hpp>

#include "support/catch_runner.h"
#include "support/test_support.h"

namespace {

int g_ran = 0, g_skipped = 0;

class SkipCounter : public Catch::TestEventListenerBase {
 public:
  using TestEventListenerBase::TestEventListenerBase;
  void testCaseStarting(const Catch::TestCaseInfo& info) override {
    dcp::testing::TakeTestCaseSkipped();  // nothing of an earlier case counts
    TestEventListenerBase::testCaseStarting(info);
  }
  void testCaseEnded(const Catch::TestCaseStats& stats) override {
    ++(dcp::testing::TakeTestCaseSkipped() ? g_skipped : g_ran);
    TestEventListenerBase::testCaseEnded(stats);
  }
};

}  // namespace

CATCH_REGISTER_LISTENER(SkipCounter)

int main(int argc, char* argv[]) {
  const int result = dcp::testing::RunCatchSession(argc, argv);
  if (result == 0 && g_skipped > 0 && g_ran == 0) return 77;
  return result;
}
