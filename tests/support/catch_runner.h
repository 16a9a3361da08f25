// The test binaries' entry into Catch2, whose implementation is compiled once
// (catch_runner.cc) for all of them: each main.cc calls this instead of declaring a session.
#pragma once

namespace dcp::testing {

/// Runs Catch2's session on argv (test specs, reporter options) and returns its exit code.
/// quiet: the compact reporter (an MPI job's other ranks, running the same tests, report their
/// failures only, so the log stays readable).
int RunCatchSession(int argc, char** argv, bool quiet = false);

}  // namespace dcp::testing
