// A lying S3 server (issue 22): a listing that never stops paginating must end in an error, not
// list forever. The server here is a small HTTP responder on loopback that answers every
// request with what the test case gives it; no RGW needed.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>

#include "dcp/proto/error.h"
#include "dcp/storage/registry.h"

using namespace dcp;
using Catch::Matchers::Contains;

#ifdef DCP_HAVE_S3
namespace {

// Answers each request (its first line, e.g. "GET /bucket?list-type=2&... HTTP/1.1") with
// status 200 and the body `respond` returns, one request per connection; with `trickle`, 128
// bytes at a time, `trickle` apart. Stops (and joins) on destruction.
class FakeS3 {
 public:
  explicit FakeS3(std::function<std::string(const std::string&)> respond,
                  std::chrono::milliseconds trickle = std::chrono::milliseconds(0))
      : respond_(std::move(respond)), trickle_(trickle) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
    socklen_t n = sizeof(a);
    REQUIRE(::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &n) == 0);
    port_ = ntohs(a.sin_port);
    REQUIRE(::listen(fd_, 16) == 0);
    thread_ = std::thread([this] { Serve(); });
  }
  ~FakeS3() {
    stop_ = true;
    thread_.join();
    ::close(fd_);
  }
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int requests() const { return requests_; }

 private:
  void Serve() {
    while (!stop_) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) continue;
      std::string request;
      char buf[4096];
      while (request.find("\r\n\r\n") == std::string::npos) {
        pollfd q{c, POLLIN, 0};
        if (::poll(&q, 1, 2000) <= 0) break;
        const ssize_t k = ::recv(c, buf, sizeof(buf), 0);
        if (k <= 0) break;
        request.append(buf, static_cast<size_t>(k));
      }
      ++requests_;
      const std::string body = respond_(request.substr(0, request.find("\r\n")));
      const std::string reply =
          "HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\n"
          "Content-Length: " +
          std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body;
      for (size_t at = 0; at < reply.size() && !stop_;) {
        const size_t n =
            trickle_.count() > 0 ? std::min<size_t>(128, reply.size() - at) : reply.size() - at;
        const ssize_t k = ::send(c, reply.data() + at, n, MSG_NOSIGNAL);
        if (k <= 0) break;
        at += static_cast<size_t>(k);
        if (trickle_.count() > 0) std::this_thread::sleep_for(trickle_);
      }
      ::close(c);
    }
  }
  std::function<std::string(const std::string&)> respond_;
  std::chrono::milliseconds trickle_;
  int fd_ = -1;
  int port_ = 0;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<int> requests_{0};
};

// The S3 client's environment for the fake server, restored afterwards.
struct FakeEnvironment {
  explicit FakeEnvironment(const std::string& endpoint) {
    ::setenv("AWS_ENDPOINT_URL_S3", endpoint.c_str(), 1);
    ::setenv("AWS_ACCESS_KEY_ID", "fake", 1);
    ::setenv("AWS_SECRET_ACCESS_KEY", "fake", 1);
    ::setenv("DCP_S3_MAX_RETRIES", "0", 1);
  }
  ~FakeEnvironment() {
    ::unsetenv("AWS_ENDPOINT_URL_S3");
    ::unsetenv("DCP_S3_MAX_RETRIES");
    ::unsetenv("DCP_S3_REQUEST_TIMEOUT_S");
  }
};

std::string Page(const std::string& keys, const std::string& token) {
  return "<?xml version=\"1.0\" encoding=\"UTF-8\"?><ListBucketResult><Name>b</Name>" + keys +
         "<IsTruncated>true</IsTruncated><NextContinuationToken>" + token +
         "</NextContinuationToken></ListBucketResult>";
}

}  // namespace

TEST_CASE("s3 hostile: a listing whose continuation token repeats ends in an error",
          "[hostile][s3fake]") {
  FakeS3 server(
      [](const std::string&) { return Page("<Contents><Key>p/data-1</Key></Contents>", "again"); });
  FakeEnvironment env(server.endpoint());
  auto store = OpenStore("s3://bkt/p");
  CHECK_THROWS_WITH(store->List(),
                    Contains("repeated a continuation token") && Contains("s3://bkt/p"));
  CHECK(server.requests() <= 3);
}

TEST_CASE("s3 hostile: a listing of empty pages that never ends is abandoned",
          "[hostile][s3fake]") {
  std::atomic<int> n{0};
  FakeS3 server([&](const std::string&) { return Page("", "t" + std::to_string(n++)); });
  FakeEnvironment env(server.endpoint());
  auto store = OpenStore("s3://bkt/p");
  CHECK_THROWS_WITH(store->List(), Contains("without a key"));
  CHECK(server.requests() < 200);
}

TEST_CASE("s3 hostile: a response trickled just above the stall limit is cut at its deadline",
          "[hostile][s3fake]") {
  // One page of 4,000 keys (~200 KB) at 2.5 KiB/s would take 80 s; the stall limit (1 KiB/s)
  // never fires. The request's overall deadline does.
  std::string keys;
  for (int i = 0; i < 4000; ++i)
    keys += "<Contents><Key>p/data-" + std::to_string(i) + "</Key></Contents>";
  FakeS3 server(
      [&](const std::string&) {
        return "<?xml version=\"1.0\"?><ListBucketResult>" + keys +
               "<IsTruncated>false</IsTruncated></ListBucketResult>";
      },
      std::chrono::milliseconds(50));
  FakeEnvironment env(server.endpoint());
  ::setenv("DCP_S3_REQUEST_TIMEOUT_S", "2", 1);
  auto store = OpenStore("s3://bkt/p");
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(store->List(), IoError);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(secs < 20);
}
TEST_CASE("s3 hostile: a listing whose every page comes just inside its deadline is abandoned",
          "[hostile][s3fake]") {
  // Each page holds one key and takes ~0.3 s: no page times out, no page is empty, no token
  // repeats, yet the listing would never end. It must keep up 1,000 keys/s after the request
  // timeout (1 s here).
  std::atomic<int> n{0};
  FakeS3 server(
      [&](const std::string&) {
        const int i = n++;
        return Page("<Contents><Key>p/data-" + std::to_string(i) + "</Key></Contents>",
                    "t" + std::to_string(i));
      },
      std::chrono::milliseconds(150));
  FakeEnvironment env(server.endpoint());
  ::setenv("DCP_S3_REQUEST_TIMEOUT_S", "1", 1);
  auto store = OpenStore("s3://bkt/p");
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(store->List(), IoError);
  CHECK_THROWS_WITH(store->List(), Contains("slower than 1000 per second") &&
                                       Contains("s3://bkt/p") && Contains("abandoned"));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(secs < 10);
}
#endif
