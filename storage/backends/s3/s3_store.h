// s3://bucket/prefix: checkpoints in an S3-compatible object store (AWS S3, Ceph RADOS Gateway,
// MinIO, ...), over libcurl with AWS SigV4 signing (storage/backends/s3/s3_sigv4.h). Built when
// libcurl, OpenSSL's libcrypto and tinyxml2 are found (DCP_HAVE_S3); otherwise the scheme is not
// registered.
//
// Configuration, from the usual environment variables unless S3Options says otherwise:
//   AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY   credentials (required)
//   AWS_SESSION_TOKEN                          temporary credentials' token (optional)
//   AWS_REGION or AWS_DEFAULT_REGION           signing region (default us-east-1)
//   AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL    e.g. http://127.0.0.1:7480 for an S3-compatible
//                                              server (default https://s3.<region>.amazonaws.com)
//   DCP_S3_TARGET_GBPS (10), DCP_S3_MAX_CONNECTIONS (from the target: 10 / 2.5 = 4),
//   DCP_S3_PART_SIZE_MIB (8), DCP_S3_PARTS_IN_FLIGHT and DCP_S3_READ_AHEAD_PARTS (both
//   max_connections), DCP_S3_MAX_RETRIES (4), DCP_S3_LOCK_LEASE_S (60), DCP_S3_SIGN_PAYLOAD (0),
//   DCP_S3_REQUEST_TIMEOUT_S (60)
//   The same keys (target_gbps, max_connections, part_size_mib, ...) in a URI's query
//   (s3://bucket/ckpt?target_gbps=25) override the environment (storage/registry.h).
// Sizing (as the AWS CRT client): the throughput target gives the connections, max_connections
// = ceil(target_gbps / kS3ConnectionGbps); every store bounds its data requests (part uploads,
// ranged GETs) in flight to that many, whichever objects they belong to, and each writer or
// reader may use all of them.
// Requests use path-style addressing (endpoint/bucket/key), which every S3-compatible server
// accepts.
//
// How the Store maps onto S3 (the files of storage/backends/s3/ say why):
//   Create   a multipart upload: parts of part_size bytes, up to parts_in_flight uploading while
//            the next one fills, so one writer holds at most part_size x (parts_in_flight + 1)
//            bytes (40 MiB by default). An object smaller than one part is a single PUT at Close.
//            Close completes the upload (only then is the object visible); destroying the writer
//            without Close aborts it (AbortMultipartUpload: nothing partial remains, no parts left
//            billed).
//   ListIncomplete  ListMultipartUploads under the prefix (a killed writer's uploads, whose
//            parts stay billed); DiscardIncomplete aborts a key's uploads. The next locked save
//            at the location calls them after its commit (storage/store.h).
//   Open     HEAD for the size (SizeAndVersion: the same HEAD, its ETag the version); ReadAt is a
//   ranged GET (a large one split into parallel
//            ranges); Prefetch starts up to read_ahead_parts ranged GETs of part_size ahead.
//            ReadAtStreaming: ranged GETs of part_size straight into the destination, up to
//            read_ahead_parts in flight, each piece reported as it lands. PrefetchRanges: the
//            ranges are coalesced (S3CoalesceRanges: gaps up to kS3CoalesceGapBytes are read
//            through) into GETs of at most part_size, read_ahead_parts in flight.
//   PublishAtomically  a single PUT (atomic in S3). PublishNew: PUT with If-None-Match: *
//            (the commit of a new checkpoint: two jobs cannot both commit). PublishReplacing:
//            PUT with If-Match: <ETag> (the commit of an overwrite, on the ETag of the metadata
//            the save's existence HEAD saw under its lock): a writer paused past its lease
//            between its CheckHeld and this PUT gets 412 (AlreadyExistsError, nothing written)
//            once the job that took over has committed, instead of replacing that commit.
//   List     ListObjectsV2 under the prefix ("/"-delimited: only the prefix's own objects).
//   TryLock  the lock object .dcp.lock created with If-None-Match: *, holding a lease
//            (lock_lease_seconds, 60 s by default); an expired lease is taken over with
//            If-Match: <its ETag> (docs/STORAGE_BACKENDS.md). While held, a background thread
//            per lock renews the lease every lease/3 by rewriting the object If-Match: <the ETag
//            of our last write>, so a live holder keeps it however long a save takes, and a
//            crashed holder's lock is free one lease after its last renewal.
//            StoreLock::CheckHeld (called by the checkpoint writer right before it publishes
//            metadata and before it removes dead files) renews once more, synchronously:
//            LeaseLostError when the object is no longer ours (412: taken over after our lease
//            ran out unrenewed, e.g. a frozen or partitioned process), or when it cannot be
//            renewed and less than a quarter of the lease is left. The save then fails on every
//            rank and the other job's checkpoint stays as it is. Release stops the thread and
//            deletes the object only if it still holds our record (GET, compare, DELETE with
//            If-Match; RGW ignores If-Match on DELETE, AWS S3 honours it). Contenders compare
//            the expiry with their own clock: hosts' clocks must agree to well within a quarter
//            of the lease. A lock is used from any thread; Release and CheckHeld may race the
//            renewal thread (they are serialised with it).
// Errors: HTTP 404 is NotFoundError; 403 an IoError naming the bucket and key and the
// credentials' variables; other 4xx non-retryable IoErrors; 5xx, 429 and connection failures
// retryable IoErrors, retried here (bounded exponential backoff) before they are thrown.
//
// Thread safety: as every Store (storage/store.h). Connections are pooled per store.
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
