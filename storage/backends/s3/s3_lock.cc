// The s3:// writer lock: the lock object .dcp.lock, taken with a conditional create (or over an
// expired lease with If-Match), renewed by a thread while held, released only if still ours.
// storage/backends/s3/s3_store.h and docs/STORAGE_BACKENDS.md say why it works this way.
#include "dcp/storage/backends/s3/s3_lock.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <utility>

#include "dcp/proto/error.h"
#include "dcp/proto/executor.h"
#include "dcp/proto/random_name.h"

namespace dcp::s3 {

namespace {

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

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
    heartbeat_ = Spawn([this] { Heartbeat(); });
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
    heartbeat_.Wait();
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
  Task<void> heartbeat_;
};

}  // namespace

std::unique_ptr<StoreLock> AcquireLock(std::shared_ptr<Client> client, const std::string& location,
                                       const std::string& key, const std::string& holder,
                                       const std::string& gone_holder) {
  const int64_t lease_ms = client->options().lock_lease_seconds * 1000;
  const std::string tail = holder + " lock=" + RandomHex(8);
  for (int round = 0; round < 5; ++round) {
    const int64_t sent = NowMs();
    const std::string record = LockRecord(sent + lease_ms, tail);
    auto held = [&](const Response& r, int64_t expires) -> std::unique_ptr<StoreLock> {
      std::unique_ptr<StoreLock> lock = std::make_unique<S3Lock>(
          client, location, key, tail, holder, Unquote(r.headers.at("etag")), expires);
      // A write that took a third of the lease or more (a gateway creating its pools, a stalled
      // connection) leaves a lease that is short or already over, which a contender could take
      // before the first renewal: renew it now (LeaseLostError, a LockedError, when it was).
      if (NowMs() - sent >= lease_ms / 3) lock->CheckHeld();
      return lock;
    };
    Call create{"PUT", key};
    create.headers = {{"if-none-match", "*"}};
    create.body = record.data();
    create.body_size = record.size();
    Response r = client->Send(create);
    if (r.status / 100 == 2 && r.headers.count("etag")) return held(r, sent + lease_ms);
    if (r.status / 100 != 2 && r.status != 412) client->Throw(create, r);
    // Held, or ours already (after a retry, or a server that sent no ETag). Read it.
    Call get{"GET", key};
    Response cur = client->Send(get);
    if (cur.status == 404) continue;  // released meanwhile: try again
    if (cur.status / 100 != 2) client->Throw(get, cur);
    const int64_t expires = std::strtoll(cur.body.c_str(), nullptr, 10);
    // Ours: this call's write (of any round) whose answer was lost or had no ETag.
    if (LockTail(cur.body) == tail && cur.headers.count("etag")) return held(cur, expires);
    const std::string other = LockTail(cur.body);
    const bool gone = !gone_holder.empty() && other == gone_holder;
    if (expires > NowMs() && !gone) throw LockedError(location, other);
    // Expired, or its holder proved dead: take it over, unless someone else just did (If-Match
    // on the ETag we read).
    Call take{"PUT", key};
    take.headers = {{"if-match", Unquote(cur.headers["etag"])}};
    take.body = record.data();
    take.body_size = record.size();
    Response t = client->Send(take);
    if (t.status / 100 == 2 && t.headers.count("etag")) return held(t, sent + lease_ms);
    if (t.status / 100 == 2) continue;  // no ETag in the answer: read it back next round
    if (t.status == 412)
      throw LockedError(location, other + " (lease expired; taken over by another job)");
    client->Throw(take, t);
  }
  throw LockedError(location, "contended: the lock object kept changing");
}

}  // namespace dcp::s3

namespace dcp {

void SuspendS3LockRenewalForTesting(StoreLock& lock) {
  auto* held = dynamic_cast<s3::S3Lock*>(&lock);
  if (held == nullptr) throw InvalidArgumentError("not an s3:// lock");
  held->SuspendRenewalForTesting();
}

}  // namespace dcp
