// Catch2's implementation (its single header, with the runner but without a main), compiled
// once and linked into every test binary through dcp_test_support.
#define CATCH_CONFIG_RUNNER
#include "support/catch_runner.h"

#include <catch2/catch.hpp>

namespace dcp::testing {

int RunCatchSession(int argc, char** argv, bool quiet) {
  Catch::Session session;
  if (quiet) session.configData().reporterName = "compact";
  return session.run(argc, argv);
}

}  // namespace dcp::testing
