// The s3:// backend's HTTP client (internal): signed libcurl requests, a process-wide pool of
// idle connections per endpoint, retries with backoff, and the mapping of HTTP answers onto dcp
// errors.
#pragma once

#include <curl/curl.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "dcp/storage/backends/s3/s3_store.h"

namespace dcp::s3 {

struct Response {
  long status = 0;
  std::string body;                            // error bodies and small results
  std::map<std::string, std::string> headers;  // lowercase names
  size_t dst_bytes = 0;                        // bytes written into the caller's buffer
};

struct Call {
  Call(std::string m, std::string k, std::vector<std::pair<std::string, std::string>> q = {})
      : method(std::move(m)), key(std::move(k)), query(std::move(q)) {}
  std::string method;
  std::string key;  // "" for the bucket itself
  std::vector<std::pair<std::string, std::string>> query;
  std::vector<std::pair<std::string, std::string>> headers;
  const char* body = nullptr;
  size_t body_size = 0;
  // A 2xx response body goes here (ranged GETs) instead of Response::body.
  char* dst = nullptr;
  size_t dst_size = 0;
};

// An ETag header's value without its quotes.
std::string Unquote(std::string s);

class Client {
 public:
  Client(S3Options o, std::string bucket);
  ~Client();
  const S3Options& options() const { return o_; }
  const std::string& bucket() const { return bucket_; }

  // One request with retries of retryable failures; the final response (any status) or a
  // retryable IoError once the retries are spent. A data request (a ranged GET into a caller's
  // buffer, a PUT of 1 MiB or more) first waits until fewer than options().max_connections
  // data requests of this client are in flight, so the store's concurrency is the one its
  // throughput target chose, however many objects are being read or written. `retried`: set when
  // more than one attempt was made (non-idempotent callers use it to recognise their own earlier
  // success).
  Response Send(const Call& c, bool* retried = nullptr);

  // Send and require a 2xx; map the rest onto dcp errors.
  Response Ok(const Call& c, bool* retried = nullptr);

  std::string Describe(const std::string& key) const;

  static std::string ErrorCode(const Response& r);

  [[noreturn]] void Throw(const Call& c, const Response& r) const;

  static bool Retryable(long status) { return status >= 500 || status == 429 || status == 408; }

 private:
  struct Transfer;

  static size_t ReadBody(char* buf, size_t size, size_t nitems, void* user);
  static size_t WriteBody(char* data, size_t size, size_t nmemb, void* user);
  static size_t Header(char* data, size_t size, size_t nitems, void* user);
  static int SocketOpened(void* user, curl_socket_t fd, curlsocktype purpose);

  // A connection (an easy handle and the socket it keeps open, if known) from the endpoint's
  // idle ones or a new handle; given back after a transfer that completed.
  struct Connection {
    CURL* handle = nullptr;
    curl_socket_t socket = CURL_SOCKET_BAD;
  };
  Connection Acquire();
  void Return(Connection c);
  long DeadlineMs(const Call& c) const;
  Response Once(const Call& c, int attempt);

  // A data request (see Send) waits here for one of o_.max_connections slots.
  class Slot;

  S3Options o_;
  std::string bucket_;
  std::string host_;
  std::mutex mu_;
  std::condition_variable slot_freed_;  // with mu_
  int slots_in_use_ = 0;
  uint64_t slot_tickets_ = 0, slot_next_ = 0;  // FIFO order of the waiters
};

}  // namespace dcp::s3
