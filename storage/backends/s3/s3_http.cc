// The s3:// backend's HTTP client: libcurl requests signed with SigV4, the connection pool,
// retries, the mapping of HTTP answers onto dcp errors, and the tests' fault hook.
//
// Client library: libcurl (Debian's libcurl4-openssl-dev), with our own SigV4
// (storage/backends/s3/s3_sigv4.cc, OpenSSL's HMAC/SHA-256). Why not a full SDK: Debian 12 packages
// no AWS C++ SDK; libs3 is old (2017) and synchronous per request with its own threading
// model; libcurl is maintained, everywhere, does HTTP/1.1 keep-alive, TLS and proxies, and the
// S3 subset a checkpoint needs is ten requests. Signing is the only part where being wrong is
// silent, so it sits in one small file tested against AWS's vectors.
//
// Design notes (the why):
//  * Connections: a pool of idle curl easy handles per endpoint, for the whole process. A handle
//    keeps its connection alive, so parts and ranges reuse connections across threads instead
//    of a TLS handshake each; and since every save and load opens a store of its own, the
//    connections outlive the store: the next operation on the endpoint starts on warm ones, and
//    an operation's end closes none (about 1 ms of a 4-rank load on loopback; a TLS handshake
//    per connection on a real endpoint).
//  * Retries: 5xx, 429 and transport failures are retried with exponential backoff (bounded);
//    4xx are the caller's mistake or the server's verdict and are not. Non-idempotent steps
//    (conditional PUTs, CompleteMultipartUpload) recognise on a retry that their first attempt
//    did succeed (412 on our own bytes, 404 NoSuchUpload with the object in place).
#include "dcp/storage/backends/s3/s3_http.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <thread>

#include "dcp/proto/error.h"
#include "dcp/proto/random_name.h"
#include "dcp/storage/backends/s3/s3_sigv4.h"
#include "dcp/storage/backends/s3/s3_xml.h"

namespace dcp {

namespace {

std::mutex g_hook_mu;
std::function<S3Fault(const S3RequestInfo&)> g_hook;
std::atomic<uint64_t> g_requests{0};
std::atomic<uint64_t> g_body_bytes_received{0};

struct CurlGlobal {
  CurlGlobal() { curl_global_init(CURL_GLOBAL_DEFAULT); }
};

void EnsureCurl() {
  static CurlGlobal g;
  (void)g;
}

// SIGPIPE blocked on this thread for one transfer: a write to a connection the server closed
// (a TLS write in particular, which libcurl cannot flag MSG_NOSIGNAL) must be an error to retry,
// not the death of the training job. We keep CURLOPT_NOSIGNAL (no process-wide signal handler
// juggling from many threads) and drain a SIGPIPE the transfer raised before unblocking.
class SigpipeBlocked {
 public:
  SigpipeBlocked() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
    sigset_t pending;
    sigpending(&pending);
    pending_before_ = sigismember(&pending, SIGPIPE) == 1;
  }
  ~SigpipeBlocked() {
    if (!pending_before_) {
      sigset_t pending;
      sigpending(&pending);
      if (sigismember(&pending, SIGPIPE) == 1) {
        const timespec zero{0, 0};
        while (sigtimedwait(&pipe_, nullptr, &zero) == SIGPIPE) {
        }
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SigpipeBlocked(const SigpipeBlocked&) = delete;
  SigpipeBlocked& operator=(const SigpipeBlocked&) = delete;

 private:
  sigset_t pipe_, old_;
  bool pending_before_ = false;
};

// A transport-level failure of one attempt, retryable.
struct TransportFailure {
  std::string what;
};

}  // namespace

namespace s3 {

std::string Unquote(std::string s) {
  if (s.size() >= 2 && s.front() == '"' && s.back() == '"') s = s.substr(1, s.size() - 2);
  return s;
}

Client::Client(S3Options o, std::string bucket) : o_(std::move(o)), bucket_(std::move(bucket)) {
  EnsureCurl();
  std::string rest = o_.endpoint.substr(o_.endpoint.find("://") + 3);
  host_ = rest.substr(0, rest.find('/'));
}

namespace {

// The process's idle connections, by endpoint. Never destroyed (a static's destructor could run
// after curl's global cleanup, or while a detached thread still transfers); at exit the
// sockets close with the process.
//
// A forked child must not use them: its parent's requests run on the same sockets, and two
// processes writing one connection corrupt both streams. The child forgets them at the fork
// (pthread_atfork), leaving them untouched (a curl cleanup could send a TLS close_notify on the
// parent's connection); the mutex is held across the fork so the child never inherits it locked.
class IdleConnections {
 public:
  static IdleConnections& Instance() {
    static IdleConnections* pool = [] {
      auto* p = new IdleConnections;
      pthread_atfork([] { Instance().mu_.lock(); }, [] { Instance().mu_.unlock(); },
                     [] {
                       IdleConnections& self = Instance();
                       for (auto& [endpoint, idle] : self.idle_) {
                         self.inherited_.insert(self.inherited_.end(), idle.begin(), idle.end());
                       }
                       self.idle_.clear();
                       self.mu_.unlock();
                     });
      return p;
    }();
    return *pool;
  }

  bool Take(const std::string& endpoint, CURL** handle, curl_socket_t* socket) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = idle_.find(endpoint);
    if (it == idle_.end() || it->second.empty()) return false;
    *handle = it->second.back().first;
    *socket = it->second.back().second;
    it->second.pop_back();
    return true;
  }

  void Give(const std::string& endpoint, CURL* handle, curl_socket_t socket) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& idle = idle_[endpoint];
      if (idle.size() < kMaxIdlePerEndpoint) {
        idle.emplace_back(handle, socket);
        return;
      }
    }
    curl_easy_cleanup(handle);
  }

 private:
  // A store has at most 64 data connections (S3Options::max_connections) and a few control
  // requests; connections past this many idle ones are closed.
  static constexpr size_t kMaxIdlePerEndpoint = 128;
  std::mutex mu_;
  std::map<std::string, std::vector<std::pair<CURL*, curl_socket_t>>> idle_;
  // In a forked child: the parent's connections, never used or cleaned up (see above).
  std::vector<std::pair<CURL*, curl_socket_t>> inherited_;
};

std::atomic<uint64_t> g_connections_opened{0};

}  // namespace

Client::~Client() = default;

// Holds one of the client's data-request slots for its lifetime (nothing for other requests:
// small control requests, e.g. a lock's renewal, never queue behind bulk transfers).
class Client::Slot {
 public:
  Slot(Client& client, const Call& c)
      : client_(c.dst != nullptr || (c.method == "PUT" && c.body_size >= (size_t{1} << 20))
                    ? &client
                    : nullptr) {
    if (client_ == nullptr) return;
    // First come, first served: a part or range that waits is not overtaken by later ones
    // (one starved part would hold back its whole object's completion).
    std::unique_lock<std::mutex> lock(client_->mu_);
    const uint64_t ticket = client_->slot_tickets_++;
    client_->slot_freed_.wait(lock, [&] {
      return client_->slot_next_ == ticket && client_->slots_in_use_ < client_->o_.max_connections;
    });
    ++client_->slot_next_;
    ++client_->slots_in_use_;
    lock.unlock();
    client_->slot_freed_.notify_all();  // the next ticket may go too
  }
  ~Slot() {
    if (client_ == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(client_->mu_);
      --client_->slots_in_use_;
    }
    client_->slot_freed_.notify_all();
  }
  Slot(const Slot&) = delete;
  Slot& operator=(const Slot&) = delete;

 private:
  Client* client_;
};

Response Client::Send(const Call& c, bool* retried) {
  std::string last;
  for (int attempt = 0;; ++attempt) {
    if (retried) *retried = attempt > 0;
    try {
      Slot slot(*this, c);  // released before a retry's backoff
      Response r = Once(c, attempt);
      if (!Retryable(r.status)) return r;
      const S3ErrorBody error = ParseS3Error(r.body);
      last = "HTTP " + std::to_string(r.status) + " " + error.code + " " + error.message;
    } catch (const TransportFailure& t) {
      last = t.what;
    }
    if (attempt >= o_.max_retries) {
      throw IoError("s3: " + c.method + " " + Describe(c.key) + " failed after " +
                        std::to_string(attempt + 1) + " attempts: " + last,
                    true);
    }
    // 50 ms, 100, 200, ... capped at 2 s, with jitter so parallel parts do not retry in step.
    const int64_t base = std::min<int64_t>(2000, int64_t{50} << std::min(attempt, 6));
    std::this_thread::sleep_for(std::chrono::milliseconds(
        base / 2 + static_cast<int64_t>(std::hash<std::string>{}(RandomHex(8)) % (base / 2 + 1))));
  }
}

Response Client::Ok(const Call& c, bool* retried) {
  Response r = Send(c, retried);
  if (r.status / 100 != 2) Throw(c, r);
  return r;
}

std::string Client::Describe(const std::string& key) const {
  return "s3://" + bucket_ + (key.empty() ? "" : "/" + key);
}

std::string Client::ErrorCode(const Response& r) { return ParseS3Error(r.body).code; }

void Client::Throw(const Call& c, const Response& r) const {
  const S3ErrorBody error = ParseS3Error(r.body);
  const std::string& code = error.code;
  const std::string where = Describe(c.key);
  const std::string detail = "HTTP " + std::to_string(r.status) + (code.empty() ? "" : " " + code) +
                             (error.message.empty() ? "" : ": " + error.message);
  if (r.status == 404) {
    if (code == "NoSuchBucket") {
      throw NotFoundError("bucket s3://" + bucket_ + " does not exist (" + detail + ")");
    }
    throw NotFoundError("object '" + where + "' does not exist (" + c.method + ": " + detail + ")");
  }
  if (r.status == 403) {
    throw IoError("s3: access denied to " + where + " (" + c.method + ": " + detail +
                      "); check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and "
                      "AWS_SESSION_TOKEN), AWS_REGION and the bucket's permissions",
                  false);
  }
  if (r.status == 412) {
    throw AlreadyExistsError("object '" + where + "' exists or changed (" + c.method +
                             " precondition failed: " + detail + ")");
  }
  throw IoError("s3: " + c.method + " " + where + " failed: " + detail, Retryable(r.status));
}

struct Client::Transfer {
  const Call* call;
  Response* response;
  size_t sent = 0;
  size_t drop_after = SIZE_MAX;  // test hook: abort the upload after this many bytes
  CURL* handle = nullptr;
  long status = -1;
  Client* client = nullptr;
  curl_socket_t socket = CURL_SOCKET_BAD;  // the connection's, for TCP_QUICKACK (Header)
};

// A new connection for t->handle: remember its socket, which goes back to the pool with the
// handle (a reused connection's comes from there: CURLINFO_ACTIVESOCKET is not set until a
// transfer ends).
int Client::SocketOpened(void* user, curl_socket_t fd, curlsocktype) {
  auto* t = static_cast<Transfer*>(user);
  t->socket = fd;
  g_connections_opened.fetch_add(1);
  return CURL_SOCKOPT_OK;
}

size_t Client::ReadBody(char* buf, size_t size, size_t nitems, void* user) {
  auto* t = static_cast<Transfer*>(user);
  if (t->sent >= t->drop_after) return CURL_READFUNC_ABORT;
  size_t n = std::min(size * nitems, t->call->body_size - t->sent);
  n = std::min(n, t->drop_after - t->sent);
  if (n > 0) std::memcpy(buf, t->call->body + t->sent, n);
  t->sent += n;
  return n;
}

size_t Client::WriteBody(char* data, size_t size, size_t nmemb, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t n = size * nmemb;
  g_body_bytes_received.fetch_add(n, std::memory_order_relaxed);
  if (t->status < 0) curl_easy_getinfo(t->handle, CURLINFO_RESPONSE_CODE, &t->status);
  if (t->call->dst != nullptr && t->status / 100 == 2) {
    Response& r = *t->response;
    if (r.dst_bytes + n > t->call->dst_size) return 0;  // more than asked: abort (checked)
    std::memcpy(t->call->dst + r.dst_bytes, data, n);
    r.dst_bytes += n;
  } else {
    // No unbounded bodies: what is kept is XML (errors, results) or a small object.
    if (t->response->body.size() + n > kMaxXmlBytes) return 0;
    t->response->body.append(data, n);
  }
  return n;
}

size_t Client::Header(char* data, size_t size, size_t nitems, void* user) {
  auto* t = static_cast<Transfer*>(user);
  Response* r = t->response;
  const size_t n = size * nitems;
  std::string line(data, n);
  if (line == "\r\n" || line == "\n") {
    // The end of the headers: acknowledge them now. A server that keeps Nagle's algorithm on
    // (RGW's beast does unless tcp_nodelay=1) holds a small body back until its headers are
    // acknowledged, and our delayed ACK would make every small GET (metadata, a lock) wait
    // ~40 ms. Setting TCP_QUICKACK sends the pending ACK at once (Linux).
    if (t->socket != CURL_SOCKET_BAD) {
      const int one = 1;
      setsockopt(t->socket, IPPROTO_TCP, TCP_QUICKACK, &one, sizeof one);
    }
    return n;
  }
  const size_t colon = line.find(':');
  if (colon != std::string::npos) {
    std::string name = line.substr(0, colon);
    std::transform(name.begin(), name.end(), name.begin(), ::tolower);
    std::string value = line.substr(colon + 1);
    while (!value.empty() && (value.back() == '\r' || value.back() == '\n' || value.back() == ' '))
      value.pop_back();
    while (!value.empty() && value.front() == ' ') value.erase(0, 1);
    r->headers[name] = value;
  } else if (line.rfind("HTTP/", 0) == 0) {
    r->headers.clear();  // a new response (after 100 Continue or a redirect)
  }
  return n;
}

Client::Connection Client::Acquire() {
  Connection c;
  if (IdleConnections::Instance().Take(o_.endpoint, &c.handle, &c.socket)) return c;
  c.handle = curl_easy_init();
  if (c.handle == nullptr) throw ResourceError("curl_easy_init failed");
  return c;
}

void Client::Return(Connection c) {
  IdleConnections::Instance().Give(o_.endpoint, c.handle, c.socket);
}

// The overall deadline of one request (see Once): its base, plus 1 ms per 256 bytes it
// sends or asks for (a ranged GET's range; other responses are small).
long Client::DeadlineMs(const Call& c) const {
  uint64_t bytes = c.body_size;
  for (const auto& [k, v] : c.headers) {
    unsigned long long first = 0, last = 0;
    if (k == "range" && std::sscanf(v.c_str(), "bytes=%llu-%llu", &first, &last) == 2 &&
        last >= first) {
      bytes += last - first + 1;
    }
  }
  // Completing a multipart upload makes the server assemble the object (minutes for a
  // large one on some servers): ten bases.
  const uint64_t base =
      static_cast<uint64_t>(o_.request_timeout_seconds) * 1000 * (c.method == "POST" ? 10 : 1);
  const uint64_t ms = base + bytes / 256;
  return static_cast<long>(std::min<uint64_t>(ms, uint64_t{1} << 40));
}

Response Client::Once(const Call& c, int attempt) {
  g_requests.fetch_add(1);
  const std::string canonical_query = sigv4::CanonicalQuery(c.query);
  S3Fault fault = S3Fault::kNone;
  std::function<S3Fault(const S3RequestInfo&)> hook;
  {
    std::lock_guard<std::mutex> lock(g_hook_mu);
    hook = g_hook;
  }
  if (hook) fault = hook({c.method, c.key, canonical_query, attempt});
  if (fault == S3Fault::kServerError503 || fault == S3Fault::kClientError400) {
    Response r;
    r.status = fault == S3Fault::kServerError503 ? 503 : 400;
    r.body = fault == S3Fault::kServerError503
                 ? "<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
                 : "<Error><Code>InvalidRequest</Code><Message>injected</Message></Error>";
    return r;
  }

  const std::string path =
      "/" + bucket_ + (c.key.empty() ? "" : "/" + sigv4::UriEncode(c.key, true));
  const std::string url =
      o_.endpoint + path + (canonical_query.empty() ? "" : "?" + canonical_query);
  const std::string amz_date = sigv4::AmzDateNow();
  sigv4::Request sr;
  sr.method = c.method;
  sr.encoded_path = path;
  sr.query = c.query;
  sr.payload_hash = o_.sign_payload || c.body == nullptr
                        ? sigv4::Sha256Hex(std::string_view(c.body ? c.body : "", c.body_size))
                        : "UNSIGNED-PAYLOAD";
  sr.headers = c.headers;
  sr.headers.emplace_back("host", host_);
  sr.headers.emplace_back("x-amz-date", amz_date);
  sr.headers.emplace_back("x-amz-content-sha256", sr.payload_hash);
  if (!o_.session_token.empty()) sr.headers.emplace_back("x-amz-security-token", o_.session_token);
  const std::string auth = sigv4::Authorization(
      sr, {o_.access_key_id, o_.secret_access_key, o_.session_token}, o_.region, "s3", amz_date);

  curl_slist* list = nullptr;
  for (const auto& [k, v] : sr.headers) list = curl_slist_append(list, (k + ": " + v).c_str());
  list = curl_slist_append(list, ("Authorization: " + auth).c_str());
  list = curl_slist_append(list, "Expect:");  // no 100-continue round trip
  if (c.body != nullptr) list = curl_slist_append(list, "Content-Type: application/octet-stream");

  const Connection conn = Acquire();
  CURL* h = conn.handle;
  Response r;
  Transfer t{&c, &r};
  t.handle = h;
  t.client = this;
  t.socket = conn.socket;
  if (fault == S3Fault::kDropMidBody) t.drop_after = c.body_size / 2;
  curl_easy_reset(h);
  curl_easy_setopt(h, CURLOPT_URL, url.c_str());
  curl_easy_setopt(h, CURLOPT_HTTPHEADER, list);
  curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, 10000L);
  // A stalled transfer (under 1 KiB/s for 60 s) is a failure to retry, not a hang; and so is
  // one that trickles just above that: every request has an overall deadline of
  // request_timeout_seconds plus the time its bytes take at 256 KiB/s.
  curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, 1024L);
  curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, 60L);
  curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, DeadlineMs(c));
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, &Client::WriteBody);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, &t);
  curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, &Client::Header);
  curl_easy_setopt(h, CURLOPT_HEADERDATA, &t);
  curl_easy_setopt(h, CURLOPT_SOCKOPTFUNCTION, &Client::SocketOpened);
  curl_easy_setopt(h, CURLOPT_SOCKOPTDATA, &t);
  if (c.method == "HEAD") {
    curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
  } else if (c.method == "PUT" || c.method == "POST") {
    curl_easy_setopt(h, CURLOPT_UPLOAD, 1L);
    curl_easy_setopt(h, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(c.body_size));
    curl_easy_setopt(h, CURLOPT_READFUNCTION, &Client::ReadBody);
    curl_easy_setopt(h, CURLOPT_READDATA, &t);
    if (c.method == "POST") curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, "POST");
  } else if (c.method != "GET") {
    curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, c.method.c_str());
  }
  CURLcode rc;
  {
    SigpipeBlocked no_sigpipe;
    rc = curl_easy_perform(h);
  }
  curl_slist_free_all(list);
  long status = 0;
  curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
  if (rc != CURLE_OK) {
    // The connection may be half-used: do not give it to the next request.
    curl_easy_cleanup(h);
    throw TransportFailure{
        std::string(curl_easy_strerror(rc)) +
        (fault == S3Fault::kDropMidBody ? " (injected: connection dropped)" : "")};
  }
  Return({h, t.socket});
  r.status = status;
  return r;
}

}  // namespace s3

void SetS3FaultHookForTesting(std::function<S3Fault(const S3RequestInfo&)> hook) {
  std::lock_guard<std::mutex> lock(g_hook_mu);
  g_hook = std::move(hook);
}

uint64_t S3RequestCountForTesting() { return g_requests.load(); }
uint64_t S3BytesReceivedForTesting() { return g_body_bytes_received.load(); }

uint64_t S3ConnectionsOpenedForTesting() { return s3::g_connections_opened.load(); }

}  // namespace dcp
