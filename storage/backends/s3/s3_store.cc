// The s3:// Store: object names onto keys under the prefix, bucket creation, conditional
// publishing, bounded listings, and MakeS3Store.
//
// The commit: the checkpoint protocol publishes metadata.dcp last; for a new checkpoint with
// Store::PublishNew (If-None-Match: *), so even two jobs that both bypassed the lock cannot both
// commit: the second gets 412 -> AlreadyExistsError.
#include "dcp/storage/backends/s3/s3_store.h"

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dcp/proto/error.h"
#include "dcp/storage/backends/s3/s3_http.h"
#include "dcp/storage/backends/s3/s3_lock.h"
#include "dcp/storage/backends/s3/s3_object.h"
#include "dcp/storage/backends/s3/s3_xml.h"

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
      ListObjectsPage page = ParseListObjectsV2(r.body, uri());
      for (std::string& key : page.keys) {
        if (key.size() > pre.size() && key.compare(0, pre.size(), pre) == 0) {
          key = key.substr(pre.size());
          if (key != kLockObjectName) names.push_back(std::move(key));
        }
      }
      if (!page.truncated) break;
      token = std::move(page.next_token);
      if (token.empty()) break;
      bounds.NextPage(page.keys.size(), token);
    }
    return names;
  }

  void Remove(const std::string& name) override {
    Call del{"DELETE", Key(name)};
    Response r = client_->Send(del);
    if (r.status == 404 || r.status / 100 == 2) return;
    client_->Throw(del, r);
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

 private:
  static std::string ErrorCodeOf(const Response& r) { return Client::ErrorCode(r); }

  struct Upload {
    std::string key;
    std::string id;
  };
  // ListMultipartUploads under `key_prefix`, every page (in key order).
  std::vector<Upload> Uploads(const std::string& key_prefix) {
    std::vector<Upload> uploads;
    std::string key_marker, id_marker;
    const std::string what = uri() + " (incomplete uploads)";
    ListingBounds bounds(what);
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

}  // namespace dcp
