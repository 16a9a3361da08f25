// The s3:// backend's objects: the multipart writer (S3Writable) and the ranged reader with its
// prefetch window (S3Readable).
//
// Design notes (the why):
//  * Writes: S3 has no append, so an object is a multipart upload. Parts go up in parallel
//    (parts_in_flight) while the writer fills the next; the bound keeps memory at
//    part_size x (parts_in_flight + 1). The object appears atomically at
//    CompleteMultipartUpload, which gives the Store rule "invisible until Close" for free; a
//    writer destroyed without Close aborts the upload so no orphaned parts stay billed.
//  * Reads: a large verified read is ReadAtStreaming: part_size ranged GETs straight into the
//    destination, read_ahead_parts in flight, each piece handed to the caller's CRC as it lands
//    (no bounce buffer, no copy, no zero-fill: on a host that also runs the server, or that is
//    short of memory bandwidth, each extra pass over the bytes is a measurable share of the
//    load). Small reads (the items of a file run, a resharding load's boxes) come after a
//    PrefetchRanges hint: the ranges are coalesced (gaps up to kS3CoalesceGapBytes read through)
//    into part_size GETs of a sliding window of read_ahead_parts, and ReadAt serves from them,
//    so N adjacent small items cost about size/part_size requests instead of N. A ReadAt that
//    no window covers is a ranged GET straight into the destination, split into parallel ranges
//    when large. Every data request also takes one of the client's max_connections slots
//    (s3_http.h), so however many readers a load runs, the store's concurrency is the one its
//    throughput target chose.
#include "dcp/storage/backends/s3/s3_object.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <optional>
#include <utility>
#include <vector>

#include "dcp/proto/error.h"
#include "dcp/proto/executor.h"
#include "dcp/proto/staging.h"
#include "dcp/storage/backends/s3/s3_xml.h"

namespace dcp::s3 {

namespace {

// Room past a part's size for what follows it when that is all that follows (S3Writable::Append).
constexpr size_t kS3PartSlackBytes = size_t{256} << 10;

class S3Writable : public WritableObject {
 public:
  S3Writable(std::shared_ptr<Client> client, std::string key)
      : client_(std::move(client)), key_(std::move(key)) {
    part_size_ = client_->options().part_size;
    parts_in_flight_ = static_cast<size_t>(std::max(1, client_->options().parts_in_flight));
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
      // A full part takes what follows into its slack when all of it fits there: the last bytes
      // of an object (a data file's index) then travel with its last part, not in a small part
      // of their own, one more round trip before the completion. Otherwise the part goes.
      if (buffer_ && buffer_->size >= buffer_->target && n > buffer_->capacity - buffer_->size) {
        ShipPart();
      }
      if (!buffer_) {
        const size_t index = etags_.size() + inflight_.size();
        if (index >= kS3MaxParts) {
          throw InvalidArgumentError("s3: " + client_->Describe(key_) + " would need more than " +
                                     std::to_string(kS3MaxParts) + " parts (" +
                                     std::to_string(size_) + " bytes so far)");
        }
        buffer_ = std::make_shared<PartBuffer>();
        buffer_->target = S3PartSize(part_size_, index);
        buffer_->capacity = buffer_->target + kS3PartSlackBytes;
        // From the process-wide pool, back after its PUT.
        buffer_->memory.Reserve(buffer_->capacity);
      }
      const size_t end = buffer_->size < buffer_->target ? buffer_->target : buffer_->capacity;
      const size_t take = std::min(n, end - buffer_->size);
      std::memcpy(buffer_->memory.data() + buffer_->size, p, take);
      buffer_->size += take;
      p += take;
      n -= take;
      size_ += take;
    }
  }

  // Parts already shipped are on the server once their PUT returned; the object itself becomes
  // durable (and visible) at Close. Sync surfaces any failed part now.
  void Sync() override {
    for (auto& p : inflight_) p.etag.Wait();
    Reap(0);
  }

  void Close() override {
    if (closed_) return;
    if (upload_id_.empty()) {
      // Smaller than one part: one PUT.
      Call c{"PUT", key_};
      c.body = buffer_ ? buffer_->memory.data() : "";
      c.body_size = buffer_ ? buffer_->size : 0;
      client_->Ok(c);
    } else {
      if (buffer_ && buffer_->size > 0) ShipPart();
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
      } else if (r.status / 100 != 2 || IsS3ErrorBody(r.body)) {
        // S3 may answer 200 and put the error in the body (the completion failed late).
        if (r.status / 100 == 2) r.status = 500;
        client_->Throw(c, r);
      }
    }
    closed_ = true;
    buffer_.reset();
  }

  uint64_t size() const override { return size_; }

  // One part is filled while up to parts_in_flight_ are sent: (parts_in_flight_ + 1) parts of
  // part_size_ in all. Within `bytes`, fewer parts first, then smaller ones, never below S3's
  // 5 MiB minimum part nor one part in flight.
  void LimitBuffers(size_t bytes) noexcept override {
    if (buffer_ || !upload_id_.empty()) return;  // too late: parts are out
    constexpr size_t kMinPart = size_t{5} << 20;
    if (bytes < 2 * part_size_) part_size_ = std::max(kMinPart, bytes / 2);
    parts_in_flight_ = std::clamp<size_t>(bytes / part_size_, 2, parts_in_flight_ + 1) - 1;
  }

 private:
  struct PartBuffer {
    HostBuffer memory;
    size_t target = 0;    // this part's size (S3PartSize)
    size_t capacity = 0;  // target + kS3PartSlackBytes
    size_t size = 0;
  };
  struct Part {
    size_t index;
    Task<std::string> etag;
  };

  void ShipPart() {
    if (upload_id_.empty()) {
      Call c{"POST", key_, {{"uploads", ""}}};
      Response r = client_->Ok(c);
      upload_id_ = ParseInitiateMultipartUpload(r.body, client_->Describe(key_));
    }
    Reap(parts_in_flight_ - 1);
    std::shared_ptr<const PartBuffer> shared = std::move(buffer_);
    buffer_.reset();
    const size_t index = etags_.size() + inflight_.size();
    auto client = client_;
    const std::string key = key_, upload = upload_id_;
    inflight_.push_back(
        {index, Spawn([client, key, upload, index, shared] {
           Call c{"PUT", key, {{"partNumber", std::to_string(index + 1)}, {"uploadId", upload}}};
           c.body = shared->memory.data();
           c.body_size = shared->size;
           Response r = client->Ok(c);
           const std::string etag = r.headers["etag"];
           if (etag.empty()) {
             throw IoError("s3: UploadPart " + std::to_string(index + 1) + " of " +
                               client->Describe(key) + " returned no ETag",
                           true);
           }
           return etag;
         })});
  }

  // Wait until at most `keep` parts are in flight, oldest first; record their ETags.
  void Reap(size_t keep) {
    while (inflight_.size() > keep) {
      Part p = std::move(inflight_.front());
      inflight_.pop_front();
      etags_.push_back(p.etag.get());  // rethrows a failed part
    }
  }

  std::shared_ptr<Client> client_;
  std::string key_;
  size_t part_size_;
  size_t parts_in_flight_;
  std::shared_ptr<PartBuffer> buffer_;  // the part being filled
  std::string upload_id_;
  std::deque<Part> inflight_;
  std::vector<std::string> etags_;
  uint64_t size_ = 0;
  bool closed_ = false;
};

// A ReadAt under kSmallReadBytes that no window covers fetches kSmallReadAheadBytes (see ReadAt).
constexpr size_t kSmallReadBytes = size_t{64} << 10;
constexpr uint64_t kSmallReadAheadBytes = uint64_t{1} << 20;

class S3Readable : public ReadableObject {
 public:
  S3Readable(std::shared_ptr<Client> client, std::string key, uint64_t size)
      : client_(std::move(client)), key_(std::move(key)), size_(size) {
    window_request_bytes_ = client_->options().part_size;
    window_parts_ = static_cast<size_t>(std::max(1, client_->options().read_ahead_parts));
  }
  ~S3Readable() override {
    for (auto& c : window_) c.fetch.Wait();
  }

  void ReadAt(uint64_t offset, void* dst, size_t n) override {
    CheckRange(offset, n);
    if (n == 0) return;
    char* out = static_cast<char*>(dst);
    Serve(offset, out, n);
    if (n > 0 && n < kSmallReadBytes && window_.empty()) {
      // A small read with nothing coming (a metadata header, a zip directory): fetch what
      // follows along with it, so the read after it (the rest of the file) is served from here.
      // A small GET costs a round trip, and often a delayed-ACK stall (~40 ms on a server that
      // keeps Nagle on, as RGW's beast does by default) next to which the extra bytes are free.
      Queue({{offset, std::min<uint64_t>(kSmallReadAheadBytes, size_ - offset)}});
      TopUp();
      Serve(offset, out, n);
    }
    if (n > 0) Direct(offset, out, n);
  }

  uint64_t size() const override { return size_; }

  // The prefetch window holds window_parts_ GETs of window_request_bytes_: within `bytes`, fewer
  // GETs first, then smaller ones, down to one of 1 MiB.
  void LimitBuffers(size_t bytes) noexcept override {
    if (!window_.empty() || !pending_.empty()) return;  // too late: requests are out
    constexpr uint64_t kMinRequest = uint64_t{1} << 20;
    if (bytes < window_request_bytes_) {
      window_request_bytes_ = std::max<uint64_t>(kMinRequest, bytes);
    }
    window_parts_ = std::clamp<size_t>(bytes / window_request_bytes_, 1, window_parts_);
  }

  // Serve the start of [offset, offset + n) from the prefetch window, in order, advancing the
  // arguments past what it served.
  void Serve(uint64_t& offset, char*& out, size_t& n) {
    while (n > 0 && !window_.empty()) {
      Chunk& c = window_.front();
      if (offset >= c.offset + c.size) {  // passed it: drop
        window_.pop_front();
        TopUp();
        continue;
      }
      if (offset < c.offset) break;  // a backward jump, or a gap between requests
      const char* bytes = nullptr;
      try {
        bytes = c.Bytes();
      } catch (const Error&) {
        // A failed prefetch: drop the window, the direct read below retries on its own.
        Reset();
        break;
      }
      const size_t take = std::min<uint64_t>(n, c.offset + c.size - offset);
      std::memcpy(out, bytes + (offset - c.offset), take);
      out += take;
      offset += take;
      n -= take;
      if (offset >= c.offset + c.size) {
        window_.pop_front();
        TopUp();
      }
    }
  }

  void Prefetch(uint64_t offset, uint64_t n) noexcept override {
    try {
      if (offset >= size_) return;
      n = std::min(n, size_ - offset);
      if (!window_.empty() && offset >= window_.front().offset && offset <= ahead_end_) {
        // Inside or right after what is coming (the next piece of a sequential read): extend the
        // window instead of restarting it, so the stream of GETs has no gap between pieces.
        if (offset + n > ahead_end_) Queue({{ahead_end_, offset + n - ahead_end_}});
      } else {
        Reset();
        Queue({{offset, n}});
      }
      TopUp();
    } catch (...) {
      // A hint: the reads that follow fetch directly.
    }
  }

  void PrefetchRanges(const std::vector<ByteRange>& ranges) noexcept override {
    try {
      std::vector<ByteRange> wanted;
      for (ByteRange r : ranges) {
        if (r.offset >= size_) continue;
        r.length = std::min(r.length, size_ - r.offset);
        wanted.push_back(r);
      }
      if (wanted.empty()) return;
      const uint64_t first = std::min_element(wanted.begin(), wanted.end(), [](auto& a, auto& b) {
                               return a.offset < b.offset;
                             })->offset;
      if (window_.empty() || first < window_.front().offset) {
        Reset();
        Queue(std::move(wanted));
      } else {
        // A continuation: what is queued or arrived already is not asked for twice.
        std::vector<ByteRange> rest;
        for (const ByteRange& r : wanted) {
          if (r.end() <= ahead_end_) continue;
          const uint64_t b = std::max(r.offset, ahead_end_);
          rest.push_back({b, r.end() - b});
        }
        Queue(std::move(rest));
      }
      TopUp();
    } catch (...) {
      // A hint: the reads that follow fetch directly.
    }
  }

  // Ranged GETs of part_size straight into dst, read_ahead_parts in flight (no buffer, no
  // copy): each piece is reported as it lands, in order, while the next ones are still coming,
  // so the caller's checksum of one piece overlaps the transfer of the others.
  void ReadAtStreaming(uint64_t offset, void* dst, size_t n, size_t step,
                       const std::function<void(size_t, size_t)>& landed) override {
    ReadManyStreaming({{offset, dst, n}}, step,
                      [&](size_t, size_t pos, size_t len) { landed(pos, len); });
  }

  // Ranged GETs of at most part_size straight into the targets, read_ahead_parts in flight
  // across target boundaries: a target's first GETs go out while the previous one's last are
  // still coming.
  void ReadManyStreaming(const std::vector<ReadTarget>& targets, size_t step,
                         const std::function<void(size_t, size_t, size_t)>& landed) override {
    bool windowed = false;  // the window has (some of) it: serve from there (ReadAt steps)
    for (const ReadTarget& t : targets) {
      CheckRange(t.offset, t.n);
      windowed = windowed || Overlaps(t.offset, t.n);
    }
    if (windowed) {
      for (size_t k = 0; k < targets.size(); ++k) {
        ReadableObject::ReadAtStreaming(targets[k].offset, targets[k].dst, targets[k].n, step,
                                        [&](size_t pos, size_t len) { landed(k, pos, len); });
      }
      return;
    }
    const uint64_t part = client_->options().part_size;
    const size_t width = static_cast<size_t>(std::max(1, client_->options().read_ahead_parts));
    struct Piece {
      size_t target, pos, len;
      Task<void> get;
    };
    std::deque<Piece> running;    // on a throw, their destructors wait: dst is not written after
    size_t target = 0, next = 0;  // the next piece to ask for
    auto issue = [&] {
      while (running.size() < width && target < targets.size()) {
        const ReadTarget& t = targets[target];
        if (next >= t.n) {
          ++target;
          next = 0;
          continue;
        }
        const size_t len = static_cast<size_t>(std::min<uint64_t>(part, t.n - next));
        char* to = static_cast<char*>(t.dst) + next;
        const uint64_t at = t.offset + next;
        running.push_back(
            {target, next, len, Spawn([this, at, to, len] { Get(*client_, key_, at, to, len); })});
        next += len;
      }
    };
    issue();
    while (!running.empty()) {
      Piece p = std::move(running.front());
      running.pop_front();
      p.get.get();
      issue();  // keep the connections busy while the caller works on this piece
      landed(p.target, p.pos, p.len);
    }
  }

 private:
  struct Chunk {
    uint64_t offset;
    uint64_t size;
    Task<std::shared_ptr<HostBuffer>> fetch;
    std::shared_ptr<HostBuffer> bytes;
    // The prefetched bytes, waiting for them the first time (rethrows a failed GET).
    const char* Bytes() {
      if (!bytes) bytes = fetch.get();
      return bytes->data();
    }
  };

  void CheckRange(uint64_t offset, size_t n) const {
    if (offset > size_ || n > size_ - offset) {
      throw CorruptionError("object '" + client_->Describe(key_) + "' is truncated: need " +
                            std::to_string(n) + " bytes at offset " + std::to_string(offset) +
                            " but it has " + std::to_string(size_));
    }
  }

  // Whether the window (arrived or queued) holds any byte of [offset, offset + n).
  bool Overlaps(uint64_t offset, uint64_t n) const {
    auto hit = [&](uint64_t o, uint64_t len) { return o < offset + n && offset < o + len; };
    for (const Chunk& c : window_) {
      if (hit(c.offset, c.size)) return true;
    }
    for (const ByteRange& r : pending_) {
      if (hit(r.offset, r.length)) return true;
    }
    return false;
  }

  void Reset() {
    window_.clear();  // a Task waits for its GET in its destructor
    pending_.clear();
    ahead_end_ = 0;
  }

  // Add `ranges` to the requests to make, coalesced and cut to part_size.
  void Queue(std::vector<ByteRange> ranges) {
    for (const ByteRange& r :
         S3CoalesceRanges(std::move(ranges), kS3CoalesceGapBytes, window_request_bytes_)) {
      pending_.push_back(r);
      ahead_end_ = std::max(ahead_end_, r.end());
    }
  }

  // Start queued requests until window_parts_ are in flight or arrived unread.
  void TopUp() {
    while (window_.size() < window_parts_ && !pending_.empty()) {
      const ByteRange r = pending_.front();
      pending_.pop_front();
      auto client = client_;
      const std::string key = key_;
      const uint64_t off = r.offset, len = r.length;
      window_.push_back({off, len, Spawn([client, key, off, len] {
                           // From the process-wide pool, as the write parts: reused from one
                           // window to the next, where malloc kept freed ones per thread.
                           auto buf = std::make_shared<HostBuffer>(len);
                           Get(*client, key, off, buf->data(), len);
                           return buf;
                         }),
                         nullptr});
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
    std::deque<Task<void>> running;
    for (uint64_t pos = 0; pos < n; pos += part) {
      if (running.size() >= width) {
        running.front().get();
        running.pop_front();
      }
      const uint64_t len = std::min<uint64_t>(part, n - pos);
      running.push_back(Spawn(
          [this, offset, dst, pos, len] { Get(*client_, key_, offset + pos, dst + pos, len); }));
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
  uint64_t window_request_bytes_;  // the size of a prefetch GET (part_size unless limited)
  size_t window_parts_;            // prefetch GETs at most in flight or arrived unread
  std::deque<Chunk> window_;       // GETs in flight or arrived, in the order they will be read
  std::deque<ByteRange> pending_;  // requests not made yet, in order
  uint64_t ahead_end_ = 0;         // the end of the last range queued
};

}  // namespace

}  // namespace dcp::s3

namespace dcp {

uint64_t S3PartSize(uint64_t base, size_t index) {
  return base << std::min<size_t>(index / 1000, 20);
}

std::vector<ByteRange> S3CoalesceRanges(std::vector<ByteRange> ranges, uint64_t max_gap,
                                        uint64_t request_bytes) {
  if (request_bytes == 0) throw InvalidArgumentError("S3CoalesceRanges: request_bytes is 0");
  ranges.erase(std::remove_if(ranges.begin(), ranges.end(),
                              [](const ByteRange& r) { return r.length == 0; }),
               ranges.end());
  std::sort(ranges.begin(), ranges.end(),
            [](const ByteRange& a, const ByteRange& b) { return a.offset < b.offset; });
  std::vector<ByteRange> spans;
  for (const ByteRange& r : ranges) {
    if (!spans.empty() && r.offset <= spans.back().end() + max_gap) {
      spans.back().length = std::max(spans.back().end(), r.end()) - spans.back().offset;
    } else {
      spans.push_back(r);
    }
  }
  // Equal requests (not full ones and a small tail), so that parallel GETs end together.
  std::vector<ByteRange> out;
  for (const ByteRange& s : spans) {
    const uint64_t k = (s.length + request_bytes - 1) / request_bytes;
    const uint64_t base = s.length / k, extra = s.length % k;
    uint64_t at = s.offset;
    for (uint64_t i = 0; i < k; ++i) {
      const uint64_t len = base + (i < extra ? 1 : 0);
      out.push_back({at, len});
      at += len;
    }
  }
  return out;
}

}  // namespace dcp

namespace dcp::s3 {

std::unique_ptr<WritableObject> MakeWritable(std::shared_ptr<Client> client, std::string key) {
  return std::make_unique<S3Writable>(std::move(client), std::move(key));
}

std::unique_ptr<ReadableObject> MakeReadable(std::shared_ptr<Client> client, std::string key,
                                             uint64_t size) {
  return std::make_unique<S3Readable>(std::move(client), std::move(key), size);
}

}  // namespace dcp::s3
