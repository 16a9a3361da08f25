// The s3:// Store: object names onto keys under the prefix, bucket creation, conditional
// publishing, bounded listings, and MakeS3Store.
//
// The commit: the checkpoint protocol publishes metadata.dcp last; for a new checkpoint with
// Store::PublishNew (If-None-Match: *), so even two jobs that both bypassed the lock cannot both
// commit: the second gets 412 -> AlreadyExistsError. An overwrite publishes with
// Store::PublishReplacing (If-Match: the ETag its coordinator's existence HEAD saw, under the
// lock): a writer paused past its lease between its lock check and its PUT cannot replace what
// the job that took over committed meanwhile (the server refuses it, 412).
#include "dcp/storage/backends/s3/s3_store.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dcp/proto/error.h"
#include "dcp/proto/executor.h"
#include "dcp/proto/staging.h"
#include "dcp/storage/backends/s3/s3_http.h"
#include "dcp/storage/backends/s3/s3_lock.h"
#include "dcp/storage/backends/s3/s3_object.h"
#include "dcp/storage/backends/s3/s3_sigv4.h"
#include "dcp/storage/backends/s3/s3_xml.h"
#include "dcp/storage/builtin.h"

namespace dcp {

namespace s3 {

namespace {

// ---- listings -------------------------------------------------------------------------------

// A listing is paged by the server, so a server that lies (a continuation token it already
// gave, pages that never end, or end only after more keys than any checkpoint location holds)
// could keep a reader listing forever and growing its memory. Each page is checked here:
// CorruptionError, naming the location, ends such a listing.
class ListingBounds {
 public:
  static constexpr uint64_t kMaxKeys = uint64_t{1} << 24;  // 16.7 M objects
  static constexpr int kMaxEmptyPages = 100;               // truncated pages without a key
  // Each page has its own deadline, but a server can answer every page just inside it, a few
  // keys at a time, and a listing of pages would then take days. A listing must keep up, on
  // average, this rate once a request's timeout has passed: real servers list thousands of keys
  // per second (a page of 1,000 in tens of milliseconds).
  static constexpr uint64_t kMinKeysPerSecond = 1000;

  ListingBounds(std::string what, int64_t grace_seconds)
      : what_(std::move(what)), grace_seconds_(grace_seconds) {}

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
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    if (elapsed > grace_seconds_ + static_cast<double>(keys_) / kMinKeysPerSecond) {
      // Slow, not lying: an I/O failure a caller may retry.
      throw IoError("listing " + what_ + ": the server listed " + std::to_string(keys_) +
                        " objects in " + std::to_string(static_cast<int64_t>(elapsed)) +
                        " s, slower than " + std::to_string(kMinKeysPerSecond) +
                        " per second after the first " + std::to_string(grace_seconds_) +
                        " s (DCP_S3_REQUEST_TIMEOUT_S); the listing was abandoned",
                    /*retryable=*/true);
    }
  }

 private:
  [[noreturn]] void Fail(const std::string& why) const {
    throw CorruptionError("listing " + what_ + ": " + why + "; the listing was abandoned");
  }
  std::string what_;
  int64_t grace_seconds_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::set<std::string> tokens_;
  uint64_t keys_ = 0;
  int empty_pages_ = 0;
};

// ---- the store ------------------------------------------------------------------------------

// The buckets this process has seen exist (endpoint, credentials, bucket).
class BucketSet {
 public:
  bool Contains(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    return keys_.count(key) > 0;
  }
  void Add(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    keys_.insert(key);
  }

 private:
  std::mutex mu_;
  std::set<std::string> keys_;
};

BucketSet& KnownBuckets() {
  static BucketSet* known = new BucketSet;  // never destroyed: stores may outlive main
  return *known;
}

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
    // Every rank's save asks; once one store of this process has seen the bucket, the others
    // skip the round trip (a bucket removed since makes the writes fail with NoSuchBucket).
    const std::string bucket_key = client_->options().endpoint + "\n" +
                                   client_->options().access_key_id + "\n" + client_->bucket();
    if (KnownBuckets().Contains(bucket_key)) {
      std::lock_guard<std::mutex> lock(mu_);
      root_ok_ = true;
      return;
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
    KnownBuckets().Add(bucket_key);
    std::lock_guard<std::mutex> lock(mu_);
    root_ok_ = true;
  }

  std::unique_ptr<WritableObject> Create(const std::string& name) override {
    return MakeWritable(client_, Key(name));
  }

  std::unique_ptr<ReadableObject> Open(const std::string& name) override {
    auto size = Size(name);
    if (!size) throw NotFoundError("object '" + uri() + "/" + name + "' does not exist");
    return MakeReadable(client_, Key(name), *size);
  }

  // No HEAD: the caller vouches for the size (a GET past the real end fails, naming the key).
  std::unique_ptr<ReadableObject> OpenKnownSize(const std::string& name, uint64_t size) override {
    return MakeReadable(client_, Key(name), size);
  }

  std::optional<uint64_t> Size(const std::string& name) override {
    return SizeAndVersion(name, nullptr);
  }

  // The HEAD's ETag is the version: it changes with every write of the key (a PUT of other
  // bytes, a multipart upload), which is all PublishReplacing's If-Match needs.
  std::optional<uint64_t> SizeAndVersion(const std::string& name, std::string* version) override {
    if (version != nullptr) version->clear();
    Call head{"HEAD", Key(name)};
    Response r = client_->Send(head);
    if (r.status == 404) return std::nullopt;
    if (r.status / 100 != 2) client_->Throw(head, r);
    if (version != nullptr) {
      if (auto it = r.headers.find("etag"); it != r.headers.end()) *version = Unquote(it->second);
    }
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
      if (Size(name) == bytes.size() && ReadAll(name, bytes.size()) == bytes) return;
    }
    if (r.status / 100 != 2) client_->Throw(put, r);
  }

  // If-Match with the bare ETag (RGW 16 rejects the quoted form; the lock relies on the same).
  // 412, or 404 from a server that answers so for a key gone meanwhile: another writer replaced
  // or removed it, and nothing was written.
  void PublishReplacing(const std::string& name, std::string_view bytes,
                        const std::string& version) override {
    if (version.empty()) return PublishAtomically(name, bytes);
    Call put{"PUT", Key(name)};
    put.headers = {{"if-match", version}};
    put.body = bytes.data();
    put.body_size = bytes.size();
    bool retried = false;
    Response r = client_->Send(put, &retried);
    if (r.status / 100 == 2) return;
    if (r.status == 412 || r.status == 404) {
      // Our lost first attempt may be what is there.
      if (retried && Size(name) == bytes.size() && ReadAll(name, bytes.size()) == bytes) return;
      throw AlreadyExistsError("object '" + client_->Describe(Key(name)) +
                               "' was replaced or removed since version " + version +
                               " was read (PUT If-Match: HTTP " + std::to_string(r.status) +
                               "); nothing was written");
    }
    client_->Throw(put, r);
  }

  std::vector<std::string> List() override {
    std::vector<std::string> names;
    ListPages([&](std::string name, int64_t) {
      names.push_back(std::move(name));
      return true;
    });
    return names;
  }

  std::optional<std::vector<std::pair<std::string, uint64_t>>> ListSizes(
      size_t max_names) override {
    std::vector<std::pair<std::string, uint64_t>> sizes;
    bool whole = ListPages([&](std::string name, int64_t size) {
      if (sizes.size() >= max_names) return false;
      // A key without a readable size is left out: the caller asks for it (Size).
      if (size >= 0) sizes.emplace_back(std::move(name), static_cast<uint64_t>(size));
      return true;
    });
    if (!whole) return std::nullopt;
    return sizes;
  }

  // One ranged GET: the answer's Content-Range ("bytes 0-N/SIZE") states the object's size.
  std::string ReadPrefix(const std::string& name, uint64_t max_bytes, uint64_t* size) override {
    if (max_bytes == 0) return Store::ReadPrefix(name, max_bytes, size);
    // A short body (a connection cut mid-response that curl did not notice) is retried.
    for (int attempt = 0;; ++attempt) {
      try {
        return ReadPrefixOnce(name, max_bytes, size);
      } catch (const ShortRead&) {
        if (attempt >= client_->options().max_retries) throw;
      }
    }
  }

 private:
  struct ShortRead : IoError {
    using IoError::IoError;
  };

  std::string ReadPrefixOnce(const std::string& name, uint64_t max_bytes, uint64_t* size) {
    // Received into a pooled buffer, returned as a string of what came: a fresh 1 MiB string per
    // read would leave malloc's arenas holding them (RSS growing over a thousand loads).
    HostBuffer buffer(static_cast<size_t>(max_bytes));
    Call c{"GET", Key(name)};
    c.headers = {{"range", "bytes=0-" + std::to_string(max_bytes - 1)}};
    c.dst = buffer.data();
    c.dst_size = static_cast<size_t>(max_bytes);
    Response r = client_->Send(c);
    if (r.status == 404) throw NotFoundError("object '" + uri() + "/" + name + "' does not exist");
    if (r.status == 416) {
      // No byte 0: an empty object (asked for its size, so that a server's odd answer cannot
      // pass for one).
      return Store::ReadPrefix(name, max_bytes, size);
    }
    if (r.status / 100 != 2) client_->Throw(c, r);
    uint64_t total = r.dst_bytes;  // 200: the whole object (the client refuses more than asked)
    if (r.status == 206) {
      const std::string& range = r.headers["content-range"];
      const size_t slash = range.rfind('/');
      char* end = nullptr;
      total = slash == std::string::npos ? 0 : std::strtoull(range.c_str() + slash + 1, &end, 10);
      if (slash == std::string::npos || end == range.c_str() + slash + 1 || *end != '\0') {
        throw IoError("s3: GET " + client_->Describe(Key(name)) +
                          " answered a range without the object's size (Content-Range: '" + range +
                          "')",
                      true);
      }
    }
    if (r.dst_bytes != std::min(total, max_bytes)) {
      throw ShortRead("s3: GET " + client_->Describe(Key(name)) + " returned " +
                          std::to_string(r.dst_bytes) + " bytes of the first " +
                          std::to_string(std::min(total, max_bytes)),
                      true);
    }
    *size = total;
    return std::string(buffer.data(), r.dst_bytes);
  }

 public:
  void Remove(const std::string& name) override {
    Call del{"DELETE", Key(name)};
    Response r = client_->Send(del);
    if (r.status == 404 || r.status / 100 == 2) return;
    client_->Throw(del, r);
  }

  // DeleteObjects: up to 1,000 keys per request (S3's limit), quiet (the answer lists only the
  // failures), the requests in flight together. A key that does not exist counts as deleted.
  void RemoveMany(const std::vector<std::string>& names) override {
    constexpr size_t kKeysPerRequest = 1000;
    const size_t requests = (names.size() + kKeysPerRequest - 1) / kKeysPerRequest;
    std::vector<std::vector<DeleteFailure>> failed(requests);
    std::vector<std::exception_ptr> errors(requests);
    ParallelFor(
        requests,
        [&](size_t k) {
          try {
            const size_t begin = k * kKeysPerRequest;
            const size_t end = std::min(names.size(), begin + kKeysPerRequest);
            std::string body = "<Delete xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">";
            body += "<Quiet>true</Quiet>";
            for (size_t i = begin; i < end; ++i) {
              body += "<Object><Key>" + XmlEscaped(Key(names[i])) + "</Key></Object>";
            }
            body += "</Delete>";
            Call c{"POST", "", {{"delete", ""}}};
            c.headers = {{"content-md5", sigv4::Md5Base64(body)}};
            c.body = body.data();
            c.body_size = body.size();
            Response r = client_->Send(c);
            if (r.status / 100 != 2) client_->Throw(c, r);
            failed[k] = ParseDeleteResult(r.body, uri());
          } catch (...) {
            errors[k] = std::current_exception();
          }
        },
        std::min<size_t>(std::max<size_t>(requests, 1), 16));
    for (const auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }
    size_t count = 0;
    const DeleteFailure* first = nullptr;
    for (const auto& f : failed) {
      for (const DeleteFailure& d : f) {
        if (d.code == "NoSuchKey") continue;
        if (first == nullptr) first = &d;
        ++count;
      }
    }
    if (first != nullptr) {
      throw IoError("s3: removing " + std::to_string(names.size()) + " objects under " + uri() +
                        ": " + std::to_string(count) + " failed, the first s3://" +
                        client_->bucket() + "/" + first->key + " (" + first->code + ": " +
                        first->message + ")",
                    first->code == "InternalError" || first->code == "SlowDown");
    }
  }

  // A multipart upload started under the location and neither completed nor aborted: a
  // writer's that is still open, or a crashed one's (its parts are stored, and billed, until
  // aborted; a bucket lifecycle rule is the only other way they go).
  std::vector<std::string> ListIncomplete() override {
    std::vector<std::string> names;
    const size_t skip = prefix_.empty() ? 0 : prefix_.size() + 1;
    for (const auto& upload : Uploads(prefix_.empty() ? "" : prefix_ + "/")) {
      const std::string name = upload.key.substr(skip);
      // Only the location's own objects: "/"-free names, as List() shows them.
      if (name.empty() || name.find('/') != std::string::npos) continue;
      if (names.empty() || names.back() != name) names.push_back(name);
    }
    return names;
  }

  void DiscardIncomplete(const std::string& name) override {
    const std::string key = Key(name);
    for (const auto& upload : Uploads(key)) {
      if (upload.key != key) continue;  // the prefix also matches longer names
      Call c{"DELETE", key, {{"uploadId", upload.id}}};
      Response r = client_->Send(c);
      // 404 NoSuchUpload: it ended meanwhile (completed or aborted by its writer).
      if (r.status / 100 != 2 && r.status != 404) client_->Throw(c, r);
    }
  }

  std::unique_ptr<StoreLock> TryLock(const std::string& holder) override {
    CreateRoot();
    return AcquireLock(client_, uri(), Key(kLockObjectName), holder);
  }

  std::unique_ptr<StoreLock> TryLockOver(const std::string& holder,
                                         const std::string& gone_holder) override {
    CreateRoot();
    return AcquireLock(client_, uri(), Key(kLockObjectName), holder, gone_holder);
  }

 private:
  static std::string ErrorCodeOf(const Response& r) { return Client::ErrorCode(r); }

  static std::string XmlEscaped(const std::string& text) {
    std::string out;
    out.reserve(text.size());
    for (char ch : text) {
      switch (ch) {
        case '&':
          out += "&amp;";
          break;
        case '<':
          out += "&lt;";
          break;
        case '>':
          out += "&gt;";
          break;
        case '"':
          out += "&quot;";
          break;
        case '\'':
          out += "&apos;";
          break;
        default:
          out += ch;
      }
    }
    return out;
  }

  // Every object directly under the prefix (but the lock object), page by page, to `take`
  // (name relative to the prefix, size or -1), until it returns false. False when stopped so.
  template <class Take>
  bool ListPages(Take take) {
    const std::string pre = prefix_.empty() ? "" : prefix_ + "/";
    std::string token;
    ListingBounds bounds(uri(), client_->options().request_timeout_seconds);
    for (;;) {
      Call c{"GET", ""};
      c.query = {{"list-type", "2"}, {"prefix", pre}, {"delimiter", "/"}};
      if (!token.empty()) c.query.emplace_back("continuation-token", token);
      Response r = client_->Send(c);
      if (r.status == 404 && ErrorCodeOf(r) == "NoSuchBucket") return true;  // nothing there
      if (r.status / 100 != 2) client_->Throw(c, r);
      ListObjectsPage page = ParseListObjectsV2(r.body, uri());
      for (size_t i = 0; i < page.keys.size(); ++i) {
        std::string& key = page.keys[i];
        if (key.size() > pre.size() && key.compare(0, pre.size(), pre) == 0) {
          key = key.substr(pre.size());
          if (key != kLockObjectName && !take(std::move(key), page.sizes[i])) return false;
        }
      }
      if (!page.truncated) break;
      token = std::move(page.next_token);
      if (token.empty()) break;
      bounds.NextPage(page.keys.size(), token);
    }
    return true;
  }

  struct Upload {
    std::string key;
    std::string id;
  };
  // ListMultipartUploads under `key_prefix`, every page (in key order).
  std::vector<Upload> Uploads(const std::string& key_prefix) {
    std::vector<Upload> uploads;
    std::string key_marker, id_marker;
    const std::string what = uri() + " (incomplete uploads)";
    ListingBounds bounds(what, client_->options().request_timeout_seconds);
    for (;;) {
      Call c{"GET", "", {{"uploads", ""}, {"prefix", key_prefix}}};
      if (!key_marker.empty()) {
        c.query.emplace_back("key-marker", key_marker);
        c.query.emplace_back("upload-id-marker", id_marker);
      }
      Response r = client_->Send(c);
      if (r.status == 404 && ErrorCodeOf(r) == "NoSuchBucket") return uploads;
      if (r.status / 100 != 2) client_->Throw(c, r);
      ListUploadsPage page = ParseListMultipartUploads(r.body, what);
      for (size_t i = 0; i < page.keys.size(); ++i) {
        uploads.push_back({page.keys[i], page.upload_ids[i]});
      }
      if (!page.truncated) break;
      key_marker = std::move(page.next_key_marker);
      id_marker = std::move(page.next_upload_id_marker);
      if (key_marker.empty()) break;
      bounds.NextPage(page.keys.size(), key_marker + "\n" + id_marker);
    }
    return uploads;
  }
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

}  // namespace s3

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
  auto client =
      std::make_shared<s3::Client>(S3Options::FromEnvironment(std::move(options)), bucket);
  return std::make_shared<s3::S3Store>(std::move(client), prefix);
}

// Credentials stay in the environment (AWS_*): a URI ends up in logs and error messages.
std::shared_ptr<Store> OpenS3Backend(const std::string& location, const BackendOptionMap& options) {
  BackendOptionReader reader("s3://", options);
  S3Options o;
  if (auto v = reader.String("endpoint")) o.endpoint = *v;
  if (auto v = reader.String("region")) o.region = *v;
  if (auto v = reader.Int("target_gbps", 1, 100000)) o.target_gbps = double(*v);
  if (auto v = reader.Int("max_connections", 1, 1024)) o.max_connections = int(*v);
  if (auto v = reader.Int("part_size_mib", 5, 5 << 10)) o.part_size = uint64_t(*v) << 20;
  if (auto v = reader.Int("parts_in_flight", 1, 1024)) o.parts_in_flight = int(*v);
  if (auto v = reader.Int("read_ahead_parts", 1, 1024)) o.read_ahead_parts = int(*v);
  if (auto v = reader.Int("max_retries", 0, 100)) o.max_retries = int(*v);
  if (auto v = reader.Int("lock_lease_s", 1, 86400)) o.lock_lease_seconds = *v;
  if (auto v = reader.Bool("sign_payload")) o.sign_payload = *v;
  if (auto v = reader.Int("request_timeout_s", 1, 86400)) o.request_timeout_seconds = *v;
  for (const char* secret : {"access_key_id", "secret_access_key", "session_token"}) {
    if (options.count(secret)) {
      throw InvalidArgumentError(std::string("s3:// takes credentials from the environment "
                                             "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                                             "AWS_SESSION_TOKEN), not as the option ") +
                                 secret);
    }
  }
  reader.Done();
  return MakeS3Store(location, o);
}

}  // namespace dcp
