// The s3:// backend. Client library: libcurl (Debian's libcurl4-openssl-dev), with our own
// SigV4 (storage/s3/s3_sigv4.cc, OpenSSL's HMAC/SHA-256). Why not a full SDK: Debian 12 packages
// no AWS C++ SDK; libs3 is old (2017) and synchronous per request with its own threading
// model; libcurl is maintained, everywhere, does HTTP/1.1 keep-alive, TLS and proxies, and the
// S3 subset a checkpoint needs is ten requests. Signing is the only part where being wrong is
// silent, so it sits in one small file tested against AWS's vectors.
//
// Design notes (the why):
//  * Connections: a pool of curl easy handles per store. A handle keeps its connection alive,
//    so parts and ranges reuse connections across threads instead of a TLS handshake each.
//  * Writes: S3 has no append, so an object is a multipart upload. Parts go up in parallel
//    (parts_in_flight) while the writer fills the next; the bound keeps memory at
//    part_size x (parts_in_flight + 1). The object appears atomically at
//    CompleteMultipartUpload, which gives the Store rule "invisible until Close" for free; a
//    writer destroyed without Close aborts the upload so no orphaned parts stay billed.
//  * Reads: dcp reads large items as Prefetch(range) then 1 MiB ReadAt steps (so the CRC runs
//    cache-hot). One GET per 1 MiB step would be latency-bound; Prefetch starts part_size
//    ranged GETs ahead (a sliding window of read_ahead_parts) and ReadAt serves from them. A
//    ReadAt that no window covers is a ranged GET straight into the destination, split into
//    parallel ranges when large.
//  * Retries: 5xx, 429 and transport failures are retried with exponential backoff (bounded);
//    4xx are the caller's mistake or the server's verdict and are not. Non-idempotent steps
//    (conditional PUTs, CompleteMultipartUpload) recognise on a retry that their first attempt
//    did succeed (412 on our own bytes, 404 NoSuchUpload with the object in place).
//  * The commit: the checkpoint protocol publishes metadata.dcp last; for a new checkpoint with
//    Store::PublishNew (If-None-Match: *), so even two jobs that both bypassed the lock cannot
//    both commit: the second gets 412 -> AlreadyExistsError.
#include "dcp/storage/s3/s3_store.h"

#include <curl/curl.h>
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "dcp/proto/error.h"
#include "dcp/proto/random_name.h"
#include "dcp/storage/s3/s3_sigv4.h"

namespace dcp {

namespace {

std::mutex g_hook_mu;
std::function<S3Fault(const S3RequestInfo&)> g_hook;
std::atomic<uint64_t> g_requests{0};

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

int64_t EnvInt(const char* name, int64_t fallback) {
  const std::string v = Env(name);
  if (v.empty()) return fallback;
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (end == v.c_str() || *end != '\0') {
    throw InvalidArgumentError(std::string(name) + "='" + v + "' is not an integer");
  }
  return x;
}

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The text of <tag>...</tag> from `pos` on; npos-safe. S3's XML is flat enough for this.
std::string XmlValue(const std::string& xml, const std::string& tag, size_t* pos = nullptr) {
  const std::string open = "<" + tag + ">", close = "</" + tag + ">";
  const size_t from = pos ? *pos : 0;
  const size_t a = xml.find(open, from);
  if (a == std::string::npos) {
    if (pos) *pos = std::string::npos;
    return {};
  }
  const size_t b = xml.find(close, a + open.size());
  if (b == std::string::npos) {
    if (pos) *pos = std::string::npos;
    return {};
  }
  if (pos) *pos = b + close.size();
  return xml.substr(a + open.size(), b - a - open.size());
}

std::string XmlUnescape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '&') {
      out += s[i];
      continue;
    }
    const size_t semi = s.find(';', i);
    if (semi == std::string::npos) {
      out += s[i];
      continue;
    }
    const std::string ent = s.substr(i + 1, semi - i - 1);
    if (ent == "amp")
      out += '&';
    else if (ent == "lt")
      out += '<';
    else if (ent == "gt")
      out += '>';
    else if (ent == "quot")
      out += '"';
    else if (ent == "apos")
      out += '\'';
    else if (!ent.empty() && ent[0] == '#') {
      const long c = ent.size() > 1 && (ent[1] == 'x' || ent[1] == 'X')
                         ? std::strtol(ent.c_str() + 2, nullptr, 16)
                         : std::strtol(ent.c_str() + 1, nullptr, 10);
      if (c < 0x80) {
        out += static_cast<char>(c);
      } else {  // UTF-8 of the code point (keys are UTF-8)
        if (c < 0x800) {
          out += static_cast<char>(0xC0 | (c >> 6));
        } else {
          if (c < 0x10000) {
            out += static_cast<char>(0xE0 | (c >> 12));
          } else {
            out += static_cast<char>(0xF0 | (c >> 18));
            out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
          }
          out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
        }
        out += static_cast<char>(0x80 | (c & 0x3F));
      }
    } else {
      out += s.substr(i, semi - i + 1);
    }
    i = semi;
  }
  return out;
}

std::string Unquote(std::string s) {
  if (s.size() >= 2 && s.front() == '"' && s.back() == '"') s = s.substr(1, s.size() - 2);
  return s;
}

// ---- HTTP ---------------------------------------------------------------------------------

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

class Client {
 public:
  Client(S3Options o, std::string bucket) : o_(std::move(o)), bucket_(std::move(bucket)) {
    EnsureCurl();
    std::string rest = o_.endpoint.substr(o_.endpoint.find("://") + 3);
    host_ = rest.substr(0, rest.find('/'));
  }
  ~Client() {
    for (CURL* h : pool_) curl_easy_cleanup(h);
  }
  const S3Options& options() const { return o_; }
  const std::string& bucket() const { return bucket_; }

  // One request with retries of retryable failures; the final response (any status) or a
  // retryable IoError once the retries are spent. `retried`: set when more than one attempt
  // was made (non-idempotent callers use it to recognise their own earlier success).
  Response Send(const Call& c, bool* retried = nullptr) {
    std::string last;
    for (int attempt = 0;; ++attempt) {
      if (retried) *retried = attempt > 0;
      try {
        Response r = Once(c, attempt);
        if (!Retryable(r.status)) return r;
        last = "HTTP " + std::to_string(r.status) + " " + ErrorCode(r) + " " +
               XmlValue(r.body, "Message");
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
          base / 2 +
          static_cast<int64_t>(std::hash<std::string>{}(RandomHex(8)) % (base / 2 + 1))));
    }
  }

  // Send and require a 2xx; map the rest onto dcp errors.
  Response Ok(const Call& c, bool* retried = nullptr) {
    Response r = Send(c, retried);
    if (r.status / 100 != 2) Throw(c, r);
    return r;
  }

  std::string Describe(const std::string& key) const {
    return "s3://" + bucket_ + (key.empty() ? "" : "/" + key);
  }

  static std::string ErrorCode(const Response& r) { return XmlValue(r.body, "Code"); }

  [[noreturn]] void Throw(const Call& c, const Response& r) const {
    const std::string code = ErrorCode(r);
    const std::string where = Describe(c.key);
    const std::string detail =
        "HTTP " + std::to_string(r.status) + (code.empty() ? "" : " " + code) +
        (XmlValue(r.body, "Message").empty() ? "" : ": " + XmlValue(r.body, "Message"));
    if (r.status == 404) {
      if (code == "NoSuchBucket") {
        throw NotFoundError("bucket s3://" + bucket_ + " does not exist (" + detail + ")");
      }
      throw NotFoundError("object '" + where + "' does not exist (" + c.method + ": " + detail +
                          ")");
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

  static bool Retryable(long status) { return status >= 500 || status == 429 || status == 408; }

 private:
  struct Transfer {
    const Call* call;
    Response* response;
    size_t sent = 0;
    size_t drop_after = SIZE_MAX;  // test hook: abort the upload after this many bytes
    CURL* handle = nullptr;
    long status = -1;
  };

  static size_t ReadBody(char* buf, size_t size, size_t nitems, void* user) {
    auto* t = static_cast<Transfer*>(user);
    if (t->sent >= t->drop_after) return CURL_READFUNC_ABORT;
    size_t n = std::min(size * nitems, t->call->body_size - t->sent);
    n = std::min(n, t->drop_after - t->sent);
    if (n > 0) std::memcpy(buf, t->call->body + t->sent, n);
    t->sent += n;
    return n;
  }

  static size_t WriteBody(char* data, size_t size, size_t nmemb, void* user) {
    auto* t = static_cast<Transfer*>(user);
    const size_t n = size * nmemb;
    if (t->status < 0) curl_easy_getinfo(t->handle, CURLINFO_RESPONSE_CODE, &t->status);
    if (t->call->dst != nullptr && t->status / 100 == 2) {
      Response& r = *t->response;
      if (r.dst_bytes + n > t->call->dst_size) return 0;  // more than asked: abort (checked)
      std::memcpy(t->call->dst + r.dst_bytes, data, n);
      r.dst_bytes += n;
    } else {
      if (t->response->body.size() + n > (size_t{64} << 20)) return 0;  // no unbounded bodies
      t->response->body.append(data, n);
    }
    return n;
  }

  static size_t Header(char* data, size_t size, size_t nitems, void* user) {
    auto* r = static_cast<Response*>(user);
    const size_t n = size * nitems;
    std::string line(data, n);
    const size_t colon = line.find(':');
    if (colon != std::string::npos) {
      std::string name = line.substr(0, colon);
      std::transform(name.begin(), name.end(), name.begin(), ::tolower);
      std::string value = line.substr(colon + 1);
      while (!value.empty() &&
             (value.back() == '\r' || value.back() == '\n' || value.back() == ' '))
        value.pop_back();
      while (!value.empty() && value.front() == ' ') value.erase(0, 1);
      r->headers[name] = value;
    } else if (line.rfind("HTTP/", 0) == 0) {
      r->headers.clear();  // a new response (after 100 Continue or a redirect)
    }
    return n;
  }

  CURL* Acquire() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!pool_.empty()) {
        CURL* h = pool_.back();
        pool_.pop_back();
        return h;
      }
    }
    CURL* h = curl_easy_init();
    if (h == nullptr) throw ResourceError("curl_easy_init failed");
    return h;
  }
  void Return(CURL* h) {
    std::lock_guard<std::mutex> lock(mu_);
    pool_.push_back(h);
  }

  // The overall deadline of one request (see Once): its base, plus 1 ms per 256 bytes it
  // sends or asks for (a ranged GET's range; other responses are small).
  long DeadlineMs(const Call& c) const {
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
    const uint64_t base = static_cast<uint64_t>(o_.request_timeout_seconds) * 1000 *
                          (c.method == "POST" ? 10 : 1);
    const uint64_t ms = base + bytes / 256;
    return static_cast<long>(std::min<uint64_t>(ms, uint64_t{1} << 40));
  }

  Response Once(const Call& c, int attempt) {
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
    if (!o_.session_token.empty())
      sr.headers.emplace_back("x-amz-security-token", o_.session_token);
    const std::string auth = sigv4::Authorization(
        sr, {o_.access_key_id, o_.secret_access_key, o_.session_token}, o_.region, "s3", amz_date);

    curl_slist* list = nullptr;
    for (const auto& [k, v] : sr.headers) list = curl_slist_append(list, (k + ": " + v).c_str());
    list = curl_slist_append(list, ("Authorization: " + auth).c_str());
    list = curl_slist_append(list, "Expect:");  // no 100-continue round trip
    if (c.body != nullptr) list = curl_slist_append(list, "Content-Type: application/octet-stream");

    CURL* h = Acquire();
    Response r;
    Transfer t{&c, &r};
    t.handle = h;
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
    curl_easy_setopt(h, CURLOPT_HEADERDATA, &r);
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
    Return(h);
    r.status = status;
    return r;
  }

  S3Options o_;
  std::string bucket_;
  std::string host_;
  std::mutex mu_;
  std::vector<CURL*> pool_;
};

// ---- objects --------------------------------------------------------------------------------

class S3Writable : public WritableObject {
 public:
  S3Writable(std::shared_ptr<Client> client, std::string key)
      : client_(std::move(client)), key_(std::move(key)) {
    part_size_ = client_->options().part_size;
  }

  ~S3Writable() override {
    if (closed_) return;
    // Abandoned: let the parts in flight end, then abort so nothing partial stays.
    for (auto& p : inflight_) {
      try {
        p.etag.get();
      } catch (...) {
      }
    }
    if (!upload_id_.empty()) {
      try {
        Call c{"DELETE", key_, {{"uploadId", upload_id_}}};
        client_->Send(c);
      } catch (...) {
        // Best effort: a bucket lifecycle rule (AbortIncompleteMultipartUpload) cleans up
        // what a failed abort leaves.
      }
    }
  }

  void Append(const void* data, size_t n) override {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      if (buffer_.capacity() < part_size_) buffer_.reserve(part_size_);
      const size_t take = std::min(n, part_size_ - buffer_.size());
      buffer_.append(p, take);
      p += take;
      n -= take;
      size_ += take;
      if (buffer_.size() == part_size_) ShipPart();
    }
  }

  // Parts already shipped are on the server once their PUT returned; the object itself becomes
  // durable (and visible) at Close. Sync surfaces any failed part now.
  void Sync() override {
    for (auto& p : inflight_) p.etag.wait();
    Reap(0);
  }

  void Close() override {
    if (closed_) return;
    if (upload_id_.empty()) {
      // Smaller than one part: one PUT.
      Call c{"PUT", key_};
      c.body = buffer_.data();
      c.body_size = buffer_.size();
      client_->Ok(c);
    } else {
      if (!buffer_.empty()) ShipPart();
      Reap(0);
      std::string xml = "<CompleteMultipartUpload>";
      for (size_t i = 0; i < etags_.size(); ++i) {
        xml += "<Part><PartNumber>" + std::to_string(i + 1) + "</PartNumber><ETag>" + etags_[i] +
               "</ETag></Part>";
      }
      xml += "</CompleteMultipartUpload>";
      Call c{"POST", key_, {{"uploadId", upload_id_}}};
      c.body = xml.data();
      c.body_size = xml.size();
      bool retried = false;
      Response r = client_->Send(c, &retried);
      if (r.status == 404 && retried && Client::ErrorCode(r) == "NoSuchUpload") {
        // Our first attempt completed it and its answer was lost: the object is there.
        Call head{"HEAD", key_};
        Response h = client_->Send(head);
        if (h.status / 100 != 2 ||
            std::strtoull(h.headers["content-length"].c_str(), nullptr, 10) != size_) {
          client_->Throw(c, r);
        }
      } else if (r.status / 100 != 2 || r.body.find("<Error>") != std::string::npos) {
        // S3 may answer 200 and put the error in the body (the completion failed late).
        if (r.status / 100 == 2) r.status = 500;
        client_->Throw(c, r);
      }
    }
    closed_ = true;
    buffer_ = std::string();
  }

  uint64_t size() const override { return size_; }

 private:
  struct Part {
    size_t index;
    std::future<std::string> etag;
  };

  void ShipPart() {
    if (upload_id_.empty()) {
      Call c{"POST", key_, {{"uploads", ""}}};
      Response r = client_->Ok(c);
      upload_id_ = XmlValue(r.body, "UploadId");
      if (upload_id_.empty()) {
        throw IoError(
            "s3: CreateMultipartUpload of " + client_->Describe(key_) + " returned no UploadId",
            true);
      }
    }
    Reap(static_cast<size_t>(client_->options().parts_in_flight) - 1);
    std::string part;
    if (!spare_.empty()) {
      part = std::move(spare_.back());
      spare_.pop_back();
    }
    part.swap(buffer_);
    buffer_.clear();
    const size_t index = etags_.size() + inflight_.size();
    auto shared = std::make_shared<std::string>(std::move(part));
    auto client = client_;
    const std::string key = key_, upload = upload_id_;
    inflight_.push_back(
        {index, std::async(std::launch::async, [client, key, upload, index, shared] {
           Call c{"PUT", key, {{"partNumber", std::to_string(index + 1)}, {"uploadId", upload}}};
           c.body = shared->data();
           c.body_size = shared->size();
           Response r = client->Ok(c);
           const std::string etag = r.headers["etag"];
           if (etag.empty()) {
             throw IoError("s3: UploadPart " + std::to_string(index + 1) + " of " +
                               client->Describe(key) + " returned no ETag",
                           true);
           }
           return etag;
         })});
    parts_.push_back(shared);
  }

  // Wait until at most `keep` parts are in flight, oldest first; record their ETags.
  void Reap(size_t keep) {
    while (inflight_.size() > keep) {
      Part p = std::move(inflight_.front());
      inflight_.pop_front();
      auto buf = parts_.front();
      parts_.pop_front();
      etags_.push_back(p.etag.get());  // rethrows a failed part
      if (buf.use_count() == 1) spare_.push_back(std::move(*buf));
    }
  }

  std::shared_ptr<Client> client_;
  std::string key_;
  size_t part_size_;
  std::string buffer_;
  std::vector<std::string> spare_;
  std::string upload_id_;
  std::deque<Part> inflight_;
  std::deque<std::shared_ptr<std::string>> parts_;
  std::vector<std::string> etags_;
  uint64_t size_ = 0;
  bool closed_ = false;
};

class S3Readable : public ReadableObject {
 public:
  S3Readable(std::shared_ptr<Client> client, std::string key, uint64_t size)
      : client_(std::move(client)), key_(std::move(key)), size_(size) {}
  ~S3Readable() override {
    for (auto& c : window_) c.data.wait();
  }

  void ReadAt(uint64_t offset, void* dst, size_t n) override {
    if (offset > size_ || n > size_ - offset) {
      throw CorruptionError("object '" + client_->Describe(key_) + "' is truncated: need " +
                            std::to_string(n) + " bytes at offset " + std::to_string(offset) +
                            " but it has " + std::to_string(size_));
    }
    if (n == 0) return;
    char* out = static_cast<char*>(dst);
    // Serve what the prefetch window holds, in order.
    while (n > 0 && !window_.empty()) {
      Chunk& c = window_.front();
      if (offset >= c.offset + c.size) {  // passed it: drop
        window_.pop_front();
        TopUp();
        continue;
      }
      if (offset < c.offset) break;  // a backward jump: not in the window
      const std::string* bytes = nullptr;
      try {
        bytes = &c.data.get();
      } catch (const Error&) {
        // A failed prefetch: drop the window, the direct read below retries on its own.
        window_.clear();
        break;
      }
      const size_t take = std::min<uint64_t>(n, c.offset + c.size - offset);
      std::memcpy(out, bytes->data() + (offset - c.offset), take);
      out += take;
      offset += take;
      n -= take;
      if (offset >= c.offset + c.size) {
        window_.pop_front();
        TopUp();
      }
    }
    if (n > 0) Direct(offset, out, n);
  }

  uint64_t size() const override { return size_; }

  void Prefetch(uint64_t offset, uint64_t n) noexcept override {
    try {
      if (offset >= size_) return;
      n = std::min(n, size_ - offset);
      if (!window_.empty() && offset >= window_.front().offset && offset <= ahead_end_) {
        // Inside or right after what is coming (the next piece of a sequential read): extend the
        // window instead of restarting it, so the stream of GETs has no gap between pieces.
        ahead_end_ = std::max(ahead_end_, offset + n);
        TopUp();
        return;
      }
      window_.clear();  // futures of std::async wait in their destructors
      next_ = offset;
      ahead_end_ = offset + n;
      TopUp();
    } catch (...) {
      // A hint: the reads that follow fetch directly.
    }
  }

 private:
  struct Chunk {
    uint64_t offset;
    uint64_t size;
    std::shared_future<std::string> data;
  };

  void TopUp() {
    const uint64_t part = client_->options().part_size;
    while (window_.size() < static_cast<size_t>(client_->options().read_ahead_parts) &&
           next_ < ahead_end_) {
      const uint64_t len = std::min(part, ahead_end_ - next_);
      auto client = client_;
      const std::string key = key_;
      const uint64_t off = next_;
      window_.push_back({off, len, std::async(std::launch::async, [client, key, off, len] {
                                     std::string buf(len, '\0');
                                     Get(*client, key, off, buf.data(), len);
                                     return buf;
                                   }).share()});
      next_ += len;
    }
  }

  // A ranged GET straight into dst; large ranges split across parallel requests.
  void Direct(uint64_t offset, char* dst, size_t n) {
    const uint64_t part = client_->options().part_size;
    if (n <= part) {
      Get(*client_, key_, offset, dst, n);
      return;
    }
    const size_t width = static_cast<size_t>(std::max(1, client_->options().read_ahead_parts));
    std::deque<std::future<void>> running;
    for (uint64_t pos = 0; pos < n; pos += part) {
      if (running.size() >= width) {
        running.front().get();
        running.pop_front();
      }
      const uint64_t len = std::min<uint64_t>(part, n - pos);
      running.push_back(std::async(std::launch::async, [this, offset, dst, pos, len] {
        Get(*client_, key_, offset + pos, dst + pos, len);
      }));
    }
    std::exception_ptr first;
    for (auto& f : running) {
      try {
        f.get();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  }

  static void Get(Client& client, const std::string& key, uint64_t offset, char* dst, uint64_t n) {
    // A short body (a connection cut mid-response that curl did not notice) is retried too.
    for (int attempt = 0;; ++attempt) {
      Call c{"GET", key};
      c.headers = {
          {"range", "bytes=" + std::to_string(offset) + "-" + std::to_string(offset + n - 1)}};
      c.dst = dst;
      c.dst_size = n;
      Response r = client.Ok(c);
      if (r.dst_bytes == n) return;
      if (attempt >= client.options().max_retries) {
        throw IoError("s3: GET " + client.Describe(key) + " returned " +
                          std::to_string(r.dst_bytes) + " of " + std::to_string(n) +
                          " bytes at offset " + std::to_string(offset),
                      true);
      }
    }
  }

  std::shared_ptr<Client> client_;
  std::string key_;
  uint64_t size_;
  std::deque<Chunk> window_;
  uint64_t next_ = 0, ahead_end_ = 0;
};

// ---- the lock -------------------------------------------------------------------------------

// The lock object's body: "<expiry, ms since the epoch>\n<holder> lock=<random id>". The tail
// after the newline is the same for every renewal of one lock and unique to it.
std::string LockRecord(int64_t expires_ms, const std::string& tail) {
  return std::to_string(expires_ms) + "\n" + tail;
}

std::string LockTail(const std::string& body) {
  const size_t nl = body.find('\n');
  return nl == std::string::npos ? std::string() : body.substr(nl + 1);
}

// A held lease. Whether it is still ours is decided by the server, never by our clock: every
// rewrite of the lock object is conditional on the ETag of our own last write (If-Match), and a
// contender takes an expired lease over with a conditional write too, so a successful renewal
// proves that nobody took the lock over since our previous one. The clock only bounds how long
// we may act on a past confirmation without a new one (CheckHeld).
class S3Lock : public StoreLock {
 public:
  S3Lock(std::shared_ptr<Client> client, std::string location, std::string key, std::string tail,
         std::string holder, std::string etag, int64_t expires_ms)
      : client_(std::move(client)),
        location_(std::move(location)),
        key_(std::move(key)),
        tail_(std::move(tail)),
        holder_(std::move(holder)),
        lease_ms_(client_->options().lock_lease_seconds * 1000),
        etag_(std::move(etag)),
        expires_ms_(expires_ms) {
    heartbeat_ = std::thread([this] { Heartbeat(); });
  }

  ~S3Lock() override {
    try {
      Release();
    } catch (const Error&) {
      // The lease frees it (StoreLock's contract: call Release() to see the error).
    }
    StopHeartbeat();
  }

  void Release() override {
    StopHeartbeat();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (released_) return;
      released_ = true;
    }
    // Delete only our own lock. RGW ignores If-Match on DELETE (it deletes whatever is there), so
    // the body is compared first; the DELETE still carries If-Match, which servers that honour
    // it (AWS S3) make exact. Where it is ignored, the window is the one round trip between the
    // GET and the DELETE, and only after our lease ran out unrenewed.
    Call get{"GET", key_};
    Response r = client_->Send(get);
    if (r.status == 404) return;
    if (r.status / 100 != 2) client_->Throw(get, r);
    if (LockTail(r.body) != tail_) return;
    Call del{"DELETE", key_};
    del.headers = {{"if-match", Unquote(r.headers["etag"])}};
    Response d = client_->Send(del);
    if (d.status / 100 == 2 || d.status == 404 || d.status == 412) return;
    client_->Throw(del, d);
  }

  std::string holder() const override { return holder_; }

  void CheckHeld() override {
    try {
      Renew();
    } catch (const LeaseLostError&) {
      throw;
    } catch (const Error& e) {
      // The server could not be asked now: our last confirmed lease may still cover us.
      if (NowMs() < Expires() - Margin()) return;
      throw LeaseLostError(
          location_, std::string("its lease could not be renewed before it ran out: ") + e.what());
    }
    if (NowMs() >= Expires() - Margin()) {
      throw LeaseLostError(location_, "renewing its lease took longer than the lease (" +
                                          std::to_string(lease_ms_ / 1000) +
                                          " s) leaves to act on it");
    }
  }

  void SuspendRenewalForTesting() {
    std::lock_guard<std::mutex> lock(mu_);
    suspended_ = true;
  }

 private:
  // The margin kept at the end of a lease for clock skew between hosts and the time a request
  // takes to land: a quarter of the lease.
  int64_t Margin() const { return lease_ms_ / 4; }

  int64_t Expires() {
    std::lock_guard<std::mutex> lock(mu_);
    return expires_ms_;
  }

  // Rewrite the lock object with a new expiry, If-Match the ETag of our last write. Throws
  // LeaseLostError (and remembers it) when the object is no longer ours, IoError when the server
  // could not be asked.
  void Renew() {
    std::lock_guard<std::mutex> serial(renew_mu_);  // each renewal matches the previous one's ETag
    std::string etag;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!lost_why_.empty()) throw LeaseLostError(location_, lost_why_, lost_to_);
      if (released_) throw LeaseLostError(location_, "it was released");
      etag = etag_;
    }
    for (int attempt = 0;; ++attempt) {
      const int64_t sent = NowMs();
      const std::string record = LockRecord(sent + lease_ms_, tail_);
      Call put{"PUT", key_};
      put.headers = {{"if-match", etag}};
      put.body = record.data();
      put.body_size = record.size();
      Response r = client_->Send(put);
      if (r.status / 100 == 2 && r.headers.count("etag")) {
        std::lock_guard<std::mutex> lock(mu_);
        etag_ = Unquote(r.headers["etag"]);
        expires_ms_ = sent + lease_ms_;
        return;
      }
      if (r.status / 100 != 2 && r.status != 412 && r.status != 404) client_->Throw(put, r);
      // 412/404: taken over or deleted, unless what is there is still ours: the tail is unique
      // to this lock, so a body with it is a write of ours whose answer we did not get (a
      // request retried after its first attempt landed, an earlier renewal that failed on the
      // way back) or that came without an ETag.
      Call get{"GET", key_};
      Response cur = client_->Send(get);
      if (cur.status / 100 != 2 && cur.status != 404) client_->Throw(get, cur);
      if (cur.status / 100 == 2 && LockTail(cur.body) == tail_ && cur.headers.count("etag")) {
        etag = Unquote(cur.headers["etag"]);
        {
          std::lock_guard<std::mutex> lock(mu_);
          etag_ = etag;
          expires_ms_ = std::strtoll(cur.body.c_str(), nullptr, 10);
        }
        if (cur.body == record || attempt > 0) return;
        continue;  // renew on top of our earlier write
      }
      const bool gone = cur.status == 404;
      const std::string other = gone ? std::string() : LockTail(cur.body);
      const std::string why =
          gone ? "its lock object was deleted: another job took it over after the lease ran "
                 "out, and released it"
               : "another job took the lock over after its lease ran out unrenewed";
      std::lock_guard<std::mutex> lock(mu_);
      lost_why_ = why;
      lost_to_ = other;
      throw LeaseLostError(location_, why, other);
    }
  }

  // Renew every lease/3 (sooner after a failed attempt) until released or lost.
  void Heartbeat() {
    const auto period = std::chrono::milliseconds(std::max<int64_t>(1, lease_ms_ / 3));
    const auto retry = std::chrono::milliseconds(std::max<int64_t>(1, lease_ms_ / 12));
    auto next = std::chrono::steady_clock::now() + period;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (cv_.wait_until(lock, next, [&] { return stop_; })) return;
      if (suspended_) {
        next = std::chrono::steady_clock::now() + period;
        continue;
      }
      lock.unlock();
      bool renewed = false;
      try {
        Renew();
        renewed = true;
      } catch (const LeaseLostError&) {
        return;  // remembered in lost_why_: CheckHeld reports it
      } catch (...) {
        // A failed attempt (requests are retried by the client already): the lease still runs;
        // try again soon. Nothing is lost by not reporting it here: CheckHeld renews itself
        // before the commit and reports what fails then.
      }
      lock.lock();
      next = std::chrono::steady_clock::now() + (renewed ? period : retry);
    }
  }

  void StopHeartbeat() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (heartbeat_.joinable() && heartbeat_.get_id() != std::this_thread::get_id()) {
      heartbeat_.join();
    }
  }

  std::shared_ptr<Client> client_;
  const std::string location_, key_, tail_, holder_;
  const int64_t lease_ms_;
  std::mutex renew_mu_;
  std::mutex mu_;  // guards what follows
  std::condition_variable cv_;
  std::string etag_;
  int64_t expires_ms_;
  std::string lost_why_, lost_to_;  // set once the lock is known lost
  bool released_ = false, stop_ = false, suspended_ = false;
  std::thread heartbeat_;
};

// ---- listings -------------------------------------------------------------------------------

// A listing is paged by the server, so a server that lies (a continuation token it already
// gave, pages that never end, or end only after more keys than any checkpoint location holds)
// could keep a reader listing forever and growing its memory. Each page is checked here:
// CorruptionError, naming the location, ends such a listing.
class ListingBounds {
 public:
  static constexpr uint64_t kMaxKeys = uint64_t{1} << 24;  // 16.7 M objects
  static constexpr int kMaxEmptyPages = 100;               // truncated pages without a key

  explicit ListingBounds(std::string what) : what_(std::move(what)) {}

  // A truncated page of `keys` keys continues at `token`.
  void NextPage(size_t keys, const std::string& token) {
    keys_ += keys;
    empty_pages_ = keys == 0 ? empty_pages_ + 1 : 0;
    if (!tokens_.insert(token).second) {
      Fail("the server repeated a continuation token (it would list forever)");
    }
    if (keys_ > kMaxKeys) {
      Fail("the listing goes on past " + std::to_string(kMaxKeys) + " objects");
    }
    if (empty_pages_ > kMaxEmptyPages) {
      Fail("the server sent " + std::to_string(empty_pages_) +
           " truncated pages in a row without a key");
    }
  }

 private:
  [[noreturn]] void Fail(const std::string& why) const {
    throw CorruptionError("listing " + what_ + ": " + why + "; the listing was abandoned");
  }
  std::string what_;
  std::set<std::string> tokens_;
  uint64_t keys_ = 0;
  int empty_pages_ = 0;
};

// ---- the store ------------------------------------------------------------------------------

class S3Store : public Store {
 public:
  S3Store(std::shared_ptr<Client> client, std::string prefix)
      : client_(std::move(client)), prefix_(std::move(prefix)) {}

  std::string uri() const override {
    return "s3://" + client_->bucket() + (prefix_.empty() ? "" : "/" + prefix_);
  }

  void CreateRoot() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (root_ok_) return;
    }
    Call head{"HEAD", ""};
    Response r = client_->Send(head);
    if (r.status == 404) {
      Call put{"PUT", ""};
      std::string body;
      if (client_->options().region != "us-east-1") {
        body = "<CreateBucketConfiguration><LocationConstraint>" + client_->options().region +
               "</LocationConstraint></CreateBucketConfiguration>";
      }
      put.body = body.data();
      put.body_size = body.size();
      Response p = client_->Send(put);
      // Someone else (another rank) may have created it meanwhile.
      if (p.status / 100 != 2 && ErrorCodeOf(p) != "BucketAlreadyOwnedByYou")
        client_->Throw(put, p);
    } else if (r.status / 100 != 2) {
      client_->Throw(head, r);
    }
    std::lock_guard<std::mutex> lock(mu_);
    root_ok_ = true;
  }

  std::unique_ptr<WritableObject> Create(const std::string& name) override {
    return std::make_unique<S3Writable>(client_, Key(name));
  }

  std::unique_ptr<ReadableObject> Open(const std::string& name) override {
    auto size = Size(name);
    if (!size) throw NotFoundError("object '" + uri() + "/" + name + "' does not exist");
    return std::make_unique<S3Readable>(client_, Key(name), *size);
  }

  std::optional<uint64_t> Size(const std::string& name) override {
    Call head{"HEAD", Key(name)};
    Response r = client_->Send(head);
    if (r.status == 404) return std::nullopt;
    if (r.status / 100 != 2) client_->Throw(head, r);
    return std::strtoull(r.headers["content-length"].c_str(), nullptr, 10);
  }

  void PublishAtomically(const std::string& name, std::string_view bytes) override {
    Call put{"PUT", Key(name)};
    put.body = bytes.data();
    put.body_size = bytes.size();
    client_->Ok(put);
  }

  void PublishNew(const std::string& name, std::string_view bytes) override {
    Call put{"PUT", Key(name)};
    put.headers = {{"if-none-match", "*"}};
    put.body = bytes.data();
    put.body_size = bytes.size();
    bool retried = false;
    Response r = client_->Send(put, &retried);
    if (r.status == 412 && retried) {
      // Our lost first attempt may be what is there.
      if (ReadAll(name) == bytes) return;
    }
    if (r.status / 100 != 2) client_->Throw(put, r);
  }

  std::vector<std::string> List() override {
    std::vector<std::string> names;
    const std::string pre = prefix_.empty() ? "" : prefix_ + "/";
    std::string token;
    ListingBounds bounds(uri());
    for (;;) {
      Call c{"GET", ""};
      c.query = {{"list-type", "2"}, {"prefix", pre}, {"delimiter", "/"}};
      if (!token.empty()) c.query.emplace_back("continuation-token", token);
      Response r = client_->Send(c);
      if (r.status == 404 && ErrorCodeOf(r) == "NoSuchBucket") return names;  // nothing there
      if (r.status / 100 != 2) client_->Throw(c, r);
      size_t pos = 0;
      size_t keys = 0;
      for (;;) {
        const std::string contents = XmlValue(r.body, "Contents", &pos);
        if (pos == std::string::npos) break;
        ++keys;
        std::string key = XmlUnescape(XmlValue(contents, "Key"));
        if (key.size() > pre.size() && key.compare(0, pre.size(), pre) == 0) {
          key = key.substr(pre.size());
          if (key != kLockObjectName) names.push_back(key);
        }
      }
      if (XmlValue(r.body, "IsTruncated") != "true") break;
      token = XmlUnescape(XmlValue(r.body, "NextContinuationToken"));
      if (token.empty()) break;
      bounds.NextPage(keys, token);
    }
    return names;
  }

  void Remove(const std::string& name) override {
    Call del{"DELETE", Key(name)};
    Response r = client_->Send(del);
    if (r.status == 404 || r.status / 100 == 2) return;
    client_->Throw(del, r);
  }

  std::vector<std::string> IncompleteUploads() {
    std::vector<std::string> keys;
    const std::string pre = prefix_.empty() ? "" : prefix_ + "/";
    std::string key_marker, id_marker;
    ListingBounds bounds(uri() + " (incomplete uploads)");
    for (;;) {
      Call c{"GET", "", {{"uploads", ""}, {"prefix", pre}}};
      if (!key_marker.empty()) {
        c.query.emplace_back("key-marker", key_marker);
        c.query.emplace_back("upload-id-marker", id_marker);
      }
      Response r = client_->Send(c);
      if (r.status == 404 && ErrorCodeOf(r) == "NoSuchBucket") return keys;
      if (r.status / 100 != 2) client_->Throw(c, r);
      size_t pos = 0, page = 0;
      for (;;) {
        const std::string upload = XmlValue(r.body, "Upload", &pos);
        if (pos == std::string::npos) break;
        ++page;
        keys.push_back(XmlUnescape(XmlValue(upload, "Key")));
      }
      if (XmlValue(r.body, "IsTruncated") != "true") break;
      key_marker = XmlUnescape(XmlValue(r.body, "NextKeyMarker"));
      id_marker = XmlUnescape(XmlValue(r.body, "NextUploadIdMarker"));
      if (key_marker.empty()) break;
      bounds.NextPage(page, key_marker + "\n" + id_marker);
    }
    return keys;
  }

  std::unique_ptr<StoreLock> TryLock(const std::string& holder) override {
    CreateRoot();
    const std::string key = Key(kLockObjectName);
    const int64_t lease_ms = client_->options().lock_lease_seconds * 1000;
    const std::string tail = holder + " lock=" + RandomHex(8);
    for (int round = 0; round < 5; ++round) {
      const int64_t sent = NowMs();
      const std::string record = LockRecord(sent + lease_ms, tail);
      auto held = [&](const Response& r, int64_t expires) -> std::unique_ptr<StoreLock> {
        return std::make_unique<S3Lock>(client_, uri(), key, tail, holder,
                                        Unquote(r.headers.at("etag")), expires);
      };
      Call create{"PUT", key};
      create.headers = {{"if-none-match", "*"}};
      create.body = record.data();
      create.body_size = record.size();
      Response r = client_->Send(create);
      if (r.status / 100 == 2 && r.headers.count("etag")) return held(r, sent + lease_ms);
      if (r.status / 100 != 2 && r.status != 412) client_->Throw(create, r);
      // Held, or ours already (after a retry, or a server that sent no ETag). Read it.
      Call get{"GET", key};
      Response cur = client_->Send(get);
      if (cur.status == 404) continue;  // released meanwhile: try again
      if (cur.status / 100 != 2) client_->Throw(get, cur);
      const int64_t expires = std::strtoll(cur.body.c_str(), nullptr, 10);
      // Ours: this call's write (of any round) whose answer was lost or had no ETag.
      if (LockTail(cur.body) == tail && cur.headers.count("etag")) return held(cur, expires);
      const std::string other = LockTail(cur.body);
      if (expires > NowMs()) throw LockedError(uri(), other);
      // Expired: take it over, unless someone else just did (If-Match on the ETag we read).
      Call take{"PUT", key};
      take.headers = {{"if-match", Unquote(cur.headers["etag"])}};
      take.body = record.data();
      take.body_size = record.size();
      Response t = client_->Send(take);
      if (t.status / 100 == 2 && t.headers.count("etag")) return held(t, sent + lease_ms);
      if (t.status / 100 == 2) continue;  // no ETag in the answer: read it back next round
      if (t.status == 412)
        throw LockedError(uri(), other + " (lease expired; taken over by another job)");
      client_->Throw(take, t);
    }
    throw LockedError(uri(), "contended: the lock object kept changing");
  }

 private:
  static std::string ErrorCodeOf(const Response& r) { return Client::ErrorCode(r); }
  std::string Key(const std::string& name) const {
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") {
      throw InvalidArgumentError("invalid object name '" + name + "' for " + uri());
    }
    return prefix_.empty() ? name : prefix_ + "/" + name;
  }

  std::shared_ptr<Client> client_;
  std::string prefix_;
  std::mutex mu_;
  bool root_ok_ = false;
};

}  // namespace

S3Options S3Options::FromEnvironment(S3Options o) {
  if (o.region.empty()) o.region = Env("AWS_REGION");
  if (o.region.empty()) o.region = Env("AWS_DEFAULT_REGION");
  if (o.region.empty()) o.region = "us-east-1";
  if (o.endpoint.empty()) o.endpoint = Env("AWS_ENDPOINT_URL_S3");
  if (o.endpoint.empty()) o.endpoint = Env("AWS_ENDPOINT_URL");
  if (o.endpoint.empty()) o.endpoint = "https://s3." + o.region + ".amazonaws.com";
  while (!o.endpoint.empty() && o.endpoint.back() == '/') o.endpoint.pop_back();
  if (o.endpoint.find("://") == std::string::npos) o.endpoint = "https://" + o.endpoint;
  if (o.endpoint.find('/', o.endpoint.find("://") + 3) != std::string::npos ||
      o.endpoint.find('?') != std::string::npos) {
    throw InvalidArgumentError("S3 endpoint '" + o.endpoint +
                               "' must be scheme://host[:port] without a path (AWS_ENDPOINT_URL)");
  }
  if (o.access_key_id.empty()) o.access_key_id = Env("AWS_ACCESS_KEY_ID");
  if (o.secret_access_key.empty()) o.secret_access_key = Env("AWS_SECRET_ACCESS_KEY");
  if (o.session_token.empty()) o.session_token = Env("AWS_SESSION_TOKEN");
  if (o.access_key_id.empty() || o.secret_access_key.empty()) {
    throw InvalidArgumentError(
        "s3:// needs credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and "
        "AWS_ENDPOINT_URL for an S3-compatible server)");
  }
  if (o.part_size == 0)
    o.part_size = static_cast<uint64_t>(EnvInt("DCP_S3_PART_SIZE_MIB", 8)) << 20;
  if (o.part_size < (uint64_t{5} << 20) || o.part_size > (uint64_t{5} << 30)) {
    throw InvalidArgumentError("s3 part size must be 5 MiB to 5 GiB, not " +
                               std::to_string(o.part_size) + " bytes");
  }
  if (o.parts_in_flight <= 0)
    o.parts_in_flight = static_cast<int>(EnvInt("DCP_S3_PARTS_IN_FLIGHT", 3));
  if (o.read_ahead_parts <= 0)
    o.read_ahead_parts = static_cast<int>(EnvInt("DCP_S3_READ_AHEAD_PARTS", 3));
  if (o.parts_in_flight <= 0 || o.read_ahead_parts <= 0) {
    throw InvalidArgumentError("DCP_S3_PARTS_IN_FLIGHT and DCP_S3_READ_AHEAD_PARTS must be >= 1");
  }
  if (o.max_retries < 0) o.max_retries = static_cast<int>(EnvInt("DCP_S3_MAX_RETRIES", 4));
  if (o.lock_lease_seconds <= 0) o.lock_lease_seconds = EnvInt("DCP_S3_LOCK_LEASE_S", 60);
  if (o.lock_lease_seconds <= 0) {
    throw InvalidArgumentError("DCP_S3_LOCK_LEASE_S must be >= 1 (seconds)");
  }
  if (!o.sign_payload) o.sign_payload = EnvInt("DCP_S3_SIGN_PAYLOAD", 0) != 0;
  if (o.request_timeout_seconds <= 0) {
    o.request_timeout_seconds = EnvInt("DCP_S3_REQUEST_TIMEOUT_S", 60);
  }
  if (o.request_timeout_seconds <= 0) {
    throw InvalidArgumentError("DCP_S3_REQUEST_TIMEOUT_S must be >= 1 (seconds)");
  }
  return o;
}

std::shared_ptr<Store> MakeS3Store(const std::string& location, S3Options options) {
  std::string loc = location;
  while (!loc.empty() && loc.back() == '/') loc.pop_back();
  const size_t slash = loc.find('/');
  const std::string bucket = loc.substr(0, slash);
  const std::string prefix = slash == std::string::npos ? "" : loc.substr(slash + 1);
  if (bucket.size() < 3 || bucket.size() > 63 ||
      bucket.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789.-") != std::string::npos) {
    throw InvalidArgumentError("s3://" + location +
                               ": the bucket name must be 3-63 characters of a-z, 0-9, '.' and "
                               "'-' (s3://bucket/prefix)");
  }
  if (prefix.find("//") != std::string::npos) {
    throw InvalidArgumentError("s3://" + location + ": empty path segment in the prefix");
  }
  auto client = std::make_shared<Client>(S3Options::FromEnvironment(std::move(options)), bucket);
  return std::make_shared<S3Store>(std::move(client), prefix);
}

std::vector<std::string> S3IncompleteUploads(Store& store) {
  auto* s3 = dynamic_cast<S3Store*>(&store);
  if (s3 == nullptr) throw InvalidArgumentError(store.uri() + " is not an s3:// store");
  return s3->IncompleteUploads();
}

void SetS3FaultHookForTesting(std::function<S3Fault(const S3RequestInfo&)> hook) {
  std::lock_guard<std::mutex> lock(g_hook_mu);
  g_hook = std::move(hook);
}

uint64_t S3RequestCountForTesting() { return g_requests.load(); }

void SuspendS3LockRenewalForTesting(StoreLock& lock) {
  auto* s3 = dynamic_cast<S3Lock*>(&lock);
  if (s3 == nullptr) throw InvalidArgumentError("not an s3:// lock");
  s3->SuspendRenewalForTesting();
}

}  // namespace dcp
