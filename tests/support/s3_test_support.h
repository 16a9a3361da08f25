// The s3:// test server: tests that need it call S3TestRoot(), which gives a fresh location on
// the server the harness started (tests/s3/start_rgw.sh exports DCP_TEST_S3_ENDPOINT and the
// AWS_* credentials), or an empty string and the reason it cannot (no libcurl in this build, no
// server). A test case that needs the server skips with that reason (S3ServerOrSkip:
// SkipTestCase, reported "Skipped" by CTest), never silently passes; a suite's s3:// row that
// cannot run says so in a WARN while its other rows run.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <random>
#include <string>

#include "dcp/storage/registry.h"
#include "support/test_support.h"

namespace dcp::testing {

inline constexpr char kS3TestBucket[] = "dcp-test";

/// Why s3:// tests cannot run here, or "" when they can.
inline std::string S3SkipReason() {
#ifndef DCP_HAVE_S3
  return "dcp was built without the s3:// backend (libcurl, OpenSSL or tinyxml2 not found)";
#else
  const char* endpoint = std::getenv("DCP_TEST_S3_ENDPOINT");
  if (endpoint == nullptr || *endpoint == '\0') {
    return "no S3 test server (DCP_TEST_S3_ENDPOINT is not set; `tools/setup.sh test` starts "
           "Ceph's RADOS Gateway with tests/s3/start_rgw.sh and exports it)";
  }
  if (std::getenv("AWS_ACCESS_KEY_ID") == nullptr ||
      std::getenv("AWS_SECRET_ACCESS_KEY") == nullptr) {
    return "DCP_TEST_S3_ENDPOINT is set but AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY are not";
  }
  ::setenv("AWS_ENDPOINT_URL", endpoint, 1);  // the test server, whatever else is configured
  return "";
#endif
}

/// True when the test server is there; otherwise the running test case is skipped with the
/// reason (SkipTestCase) and the caller returns at once.
inline bool S3ServerOrSkip() {
  const std::string why = S3SkipReason();
  if (!why.empty()) SkipTestCase(why);
  return why.empty();
}

/// A fresh, empty s3:// location on the test server ("s3://dcp-test/<unique prefix>"), or ""
/// when S3SkipReason() is not empty.
inline std::string S3TestRoot(const std::string& tag) {
  if (!S3SkipReason().empty()) return "";
  static std::atomic<int> counter{0};
  static const std::string run = [] {
    std::random_device rd;
    return std::to_string(::getpid()) + "-" + std::to_string(rd() % 100000);
  }();
  const std::string uri = std::string("s3://") + kS3TestBucket + "/" + tag + "-" + run + "-" +
                          std::to_string(counter++);
  OpenStore(uri)->CreateRoot();  // the bucket
  return uri;
}

}  // namespace dcp::testing
