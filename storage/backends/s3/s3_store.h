// s3://bucket/prefix: checkpoints in an S3-compatible object store (AWS S3, Ceph RADOS Gateway,
// MinIO, ...), over libcurl with AWS SigV4 signing (storage/backends/s3/s3_sigv4.h). Built when
// libcurl, OpenSSL's libcrypto and tinyxml2 are found (DCP_HAVE_S3); otherwise the scheme is not
// registered. S3 has no append and no rename, so files are multipart uploads that appear whole at
// Close, and commits and the writer lock are conditional PUTs. How each Store call maps onto S3
// requests, the sizing, the lease lock and the retries: docs/STORAGE_BACKENDS.md section 7.
//
// Configuration: S3Options, from the AWS_* and DCP_S3_* environment variables, overridden by the
// same keys in a URI's query (s3://bucket/ckpt?target_gbps=25; storage/registry.h).
// Errors: HTTP 404 is NotFoundError; 403 an IoError naming the bucket and key and the
// credentials' variables; 412 on a conditional PUT AlreadyExistsError; other 4xx non-retryable
// IoErrors; 5xx, 429 and connection failures retryable IoErrors, thrown after bounded retries.
// A lock that was taken over, or cannot be renewed in time, is a LeaseLostError at CheckHeld.
//
// Thread safety: as every Store (storage/store.h). A lock may be used from any thread; Release
// and CheckHeld are serialised with its renewal thread. Idle connections go to one process-wide
// pool per endpoint (s3_http.h), so they outlive the store.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dcp/storage/store.h"

namespace dcp {

/// What one connection is planned to carry, Gbit/s: target_gbps / this = connections. About
/// what one TCP stream to an S3 endpoint (or a local RADOS Gateway) sustains for 8 MiB requests.
inline constexpr double kS3ConnectionGbps = 2.5;
/// How long one data request should carry bytes, seconds: the default part size is what a
/// connection carries in this time at its share of the target (target_gbps / max_connections),
/// so the fixed cost of a request (a round trip, the server's bookkeeping) stays a small part
/// of it. 27 ms at 2.5 Gbit/s is 8 MiB, the size the AWS CRT client uses.
inline constexpr double kS3RequestSeconds = 0.027;
/// S3's most parts in one multipart upload.
inline constexpr size_t kS3MaxParts = 10000;
/// The size of part `index` (0-based) of an upload whose first parts are `base` bytes: doubled
/// every 1,000 parts, so that 10,000 parts hold more than S3's 5 TiB object limit from an
/// 8 MiB base (a 100 GB object reaches 64 MiB parts). Exposed for tests.
uint64_t S3PartSize(uint64_t base, size_t index);

struct S3Options {
  /// Empty fields are taken from the environment (see above).
  std::string endpoint;  // scheme://host[:port], no path
  std::string region;
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;
  /// The throughput to plan for, in Gbit/s (DCP_S3_TARGET_GBPS, default 10), as the AWS CRT
  /// client does: it sets max_connections, and through it the defaults of parts_in_flight and
  /// read_ahead_parts.
  double target_gbps = 0;
  /// 0: from DCP_S3_* or the defaults above.
  /// Data requests (part uploads, ranged GETs) in flight per store, over all its objects
  /// (DCP_S3_MAX_CONNECTIONS); by default ceil(target_gbps / kS3ConnectionGbps), 2 to 64.
  int max_connections = 0;
  /// At least 5 MiB (S3's minimum part size); also the GET size (DCP_S3_PART_SIZE_MIB). By
  /// default from the target: what one connection carries in kS3RequestSeconds, rounded to a
  /// MiB, 5 to 64 MiB (8 MiB at the default target). A writer uses less when its memory share
  /// is smaller (WritableObject::LimitBuffers), and grows it past 1,000 parts (S3PartSize).
  uint64_t part_size = 0;
  int parts_in_flight = 0;   // uploads in flight per writer (default: max_connections)
  int read_ahead_parts = 0;  // ranged GETs in flight per reader (default: max_connections)
  int max_retries = -1;      // retries after the first attempt of a retryable failure
  /// The writer lock's lease (DCP_S3_LOCK_LEASE_S, default 60): a crashed holder's lock is
  /// taken over this long after its last renewal; renewed every lease/3 while held.
  int64_t lock_lease_seconds = 0;
  /// Sign the payload's SHA-256 (x-amz-content-sha256) instead of UNSIGNED-PAYLOAD: the server
  /// then checks every body. Off by default: dcp checksums every item itself, and https
  /// protects the transport.
  bool sign_payload = false;
  /// Every request's overall deadline (DCP_S3_REQUEST_TIMEOUT_S, default 60), plus the time
  /// its bytes take at 256 KiB/s: a server that trickles (faster than the 1 KiB/s stall limit)
  /// cannot hold a reader or writer forever. A request past it fails as a connection failure
  /// would (retried, then an IoError).
  int64_t request_timeout_seconds = 0;

  /// Fill every empty field from the environment and the defaults. InvalidArgumentError when
  /// the credentials are missing or a value is out of range.
  static S3Options FromEnvironment(S3Options given);
};

/// The store at `location` ("bucket" or "bucket/prefix", as after "s3://").
/// InvalidArgumentError for a malformed location or missing credentials. No request is made
/// until the store is used (CreateRoot creates the bucket if it does not exist).
std::shared_ptr<Store> MakeS3Store(const std::string& location, S3Options options = {});

// ---- for tests ------------------------------------------------------------------------------

/// What the client is about to send (method, key relative to the bucket, query string).
struct S3RequestInfo {
  std::string method;
  std::string key;
  std::string query;
  int attempt = 0;  // 0 for the first try, 1.. for retries
};
enum class S3Fault {
  kNone,
  kDropMidBody,     // send half the request body, then drop the connection
  kServerError503,  // answer 503 SlowDown without sending (as a server under load would)
  kClientError400,  // answer 400 without sending
};
/// Install (or, with an empty function, remove) a process-wide hook consulted before every
/// request. Tests only.
void SetS3FaultHookForTesting(std::function<S3Fault(const S3RequestInfo&)> hook);
/// Requests sent (or faulted) by every S3 store of the process so far.
uint64_t S3RequestCountForTesting();
/// Response body bytes every S3 store of the process has received so far (objects, ranges, XML).
uint64_t S3BytesReceivedForTesting();
/// TCP connections the s3:// client has opened in this process.
uint64_t S3ConnectionsOpenedForTesting();

/// Gaps between wanted ranges up to this many bytes are read through (one GET instead of two):
/// a request costs about a round trip, in which a connection would have carried more.
inline constexpr uint64_t kS3CoalesceGapBytes = uint64_t{1} << 20;

/// The ranged GETs that fetch `ranges` (any order; they may overlap): the ranges sorted and
/// merged where they overlap or their gap is at most `max_gap`, then each merged span cut into
/// equal requests of at most `request_bytes` (> 0). Empty ranges are dropped. Exposed for tests.
std::vector<ByteRange> S3CoalesceRanges(std::vector<ByteRange> ranges, uint64_t max_gap,
                                        uint64_t request_bytes);
/// Stop renewing `lock` (an s3:// TryLock's) from its background thread, as if its process
/// were frozen: its lease then runs out and another job may take it over. CheckHeld still
/// renews. InvalidArgumentError for another kind of lock. Tests only.
void SuspendS3LockRenewalForTesting(StoreLock& lock);

}  // namespace dcp
