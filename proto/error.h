// Typed errors shared by every layer of dcp.
//
// Every failure the library reports is a dcp::Error (a std::runtime_error) whose code() tells a
// caller what to do about it:
// - kInvalidArgument: the request itself is wrong (bad state dict, mismatched shapes).
// - kNotFound: a checkpoint, file or key is absent.
// - kAlreadyExists: a checkpoint is there and overwrite was not asked for.
// - kCorruption: stored bytes or metadata are damaged or not dcp's; do not retry.
// - kIo: the storage failed; retryable() says whether retrying may succeed.
// - kUnsupported: a format version or feature this build does not understand.
// - kCollective: one or more ranks failed or did not answer; failures() names them.
// - kInternal: a broken invariant inside dcp (a bug); please report it.
// - kDevice: the accelerator runtime failed (a CUDA error, out of device or pinned memory);
//   the message carries the runtime's own error text.
// - kResourceExhausted: host memory for what a checkpoint (or the caller) asked for could not be
//   allocated; the message names the entry, the file and the size. Not retryable as is.
// - kPreempted: a preemption notice (SIGTERM, or dcp::NotifyPreemption) stopped a save before
//   its commit: the step does not exist; the preemption handler drains the newest committed one
//   (CheckpointManager::HandlePreemption). Stop the job.
// Errors cross threads inside std::future and cross ranks as ErrorReport messages; both keep the
// code, the message and the retryable bit.
#pragma once

#include <new>
#include <stdexcept>
#include <string>
#include <vector>

namespace dcp {

enum class ErrorCode : int {
  kInvalidArgument = 1,
  kNotFound = 2,
  kAlreadyExists = 3,
  kCorruption = 4,
  kIo = 5,
  kUnsupported = 6,
  kCollective = 7,
  kTimeout = 8,  // used inside RankFailure: the rank did not answer in time
  kInternal = 9,
  kDevice = 10,
  kResourceExhausted = 11,
  kPreempted = 12,
};

/// Return the stable name of a code ("InvalidArgument", "Io", ...).
const char* ErrorCodeName(ErrorCode code);

/// Root of every exception dcp throws.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message, bool retryable = false);
  ErrorCode code() const noexcept { return code_; }
  /// True when repeating the same call may succeed (transient I/O, a peer that timed out).
  bool retryable() const noexcept { return retryable_; }

 private:
  ErrorCode code_;
  bool retryable_;
};

class InvalidArgumentError : public Error {
 public:
  explicit InvalidArgumentError(const std::string& m) : Error(ErrorCode::kInvalidArgument, m) {}
};
class NotFoundError : public Error {
 public:
  explicit NotFoundError(const std::string& m) : Error(ErrorCode::kNotFound, m) {}
};
class AlreadyExistsError : public Error {
 public:
  explicit AlreadyExistsError(const std::string& m) : Error(ErrorCode::kAlreadyExists, m) {}
};
/// Another writer holds a location's lock (Store::TryLock). An AlreadyExistsError, so callers
/// that handle "a checkpoint is already there" handle this too; the message names the location
/// and, when known, the holder.
class LockedError : public AlreadyExistsError {
 public:
  LockedError(const std::string& location, const std::string& holder)
      : AlreadyExistsError("checkpoint location " + location +
                           " is locked by another save in progress (" +
                           (holder.empty() ? std::string("holder unknown") : "held by " + holder) +
                           "); two jobs must not write one location at once"),
        location_(location),
        holder_(holder) {}
  const std::string& location() const { return location_; }
  const std::string& holder() const { return holder_; }

 protected:
  LockedError(const std::string& location, const std::string& holder, const std::string& message)
      : AlreadyExistsError(message), location_(location), holder_(holder) {}

 private:
  std::string location_, holder_;
};

/// The writer lock a save held was lost before its commit: its lease (object stores) ran out
/// without being renewed, or another job took the location over, or it could not be confirmed
/// in time. The save must not commit; the location keeps what the other job wrote. A
/// LockedError (code kAlreadyExists): another writer may own the location now. holder() names
/// the new holder where it is known.
class LeaseLostError : public LockedError {
 public:
  LeaseLostError(const std::string& location, const std::string& why,
                 const std::string& new_holder = "")
      : LockedError(location, new_holder,
                    "the writer lock of checkpoint location " + location + " was lost (" + why +
                        (new_holder.empty() ? std::string() : "; now held by " + new_holder) +
                        "): this save must not commit, another job may own the location") {}
};

class CorruptionError : public Error {
 public:
  explicit CorruptionError(const std::string& m) : Error(ErrorCode::kCorruption, m) {}
};
class UnsupportedError : public Error {
 public:
  explicit UnsupportedError(const std::string& m) : Error(ErrorCode::kUnsupported, m) {}
};
class DeviceError : public Error {
 public:
  explicit DeviceError(const std::string& m) : Error(ErrorCode::kDevice, m) {}
};
/// An allocation failed (std::bad_alloc) for something of a known size: never a bare bad_alloc.
class ResourceError : public Error {
 public:
  explicit ResourceError(const std::string& m) : Error(ErrorCode::kResourceExhausted, m) {}
};
/// A save refused because the job is being preempted (see kPreempted above).
class PreemptedError : public Error {
 public:
  explicit PreemptedError(const std::string& m) : Error(ErrorCode::kPreempted, m) {}
};
class InternalError : public Error {
 public:
  explicit InternalError(const std::string& m) : Error(ErrorCode::kInternal, m) {}
};

/// A storage failure. errno_value is the OS error when there was one (0 otherwise).
class IoError : public Error {
 public:
  IoError(const std::string& m, bool retryable, int errno_value = 0)
      : Error(ErrorCode::kIo, m, retryable), errno_value_(errno_value) {}
  int errno_value() const noexcept { return errno_value_; }

 private:
  int errno_value_;
};

/// Build an IoError from an errno value, naming the operation and the path.
/// EINTR, EAGAIN, EBUSY, ETIMEDOUT and ENOSPC... are classified as retryable where a retry of
/// the same call can reasonably succeed.
IoError MakeIoError(const std::string& operation, const std::string& path, int errno_value);

/// "out of memory: cannot allocate N bytes for WHAT": the message of a ResourceError.
std::string OutOfMemoryMessage(const std::string& what, unsigned long long bytes);

/// Return `allocate()` (which allocates `bytes` for `what`, e.g. "entry 'x' from 'file'"),
/// turning std::bad_alloc into a ResourceError naming `what` and the size; other exceptions
/// pass through unchanged.
template <typename F>
auto AllocateOrThrow(F&& allocate, const std::string& what, unsigned long long bytes)
    -> decltype(allocate()) {
  try {
    return allocate();
  } catch (const std::bad_alloc&) {
    throw ResourceError(OutOfMemoryMessage(what, bytes));
  }
}

/// One rank's failure as seen by every rank after a collective phase.
struct RankFailure {
  int rank = -1;
  ErrorCode code = ErrorCode::kInternal;
  std::string message;
  bool retryable = false;
};

/// What a failed save left behind at its location, as far as this rank knows.
enum class Outcome : int {
  /// Nothing was committed: the location keeps what it had before, and this rank removed the
  /// data files it wrote in this save.
  kFailed = 0,
  /// This rank reported its writes but could not learn rank 0's verdict (rank 0 did not answer
  /// in time): the checkpoint exists exactly when its metadata does. This rank kept its data
  /// files; a later save to the location removes them if they were not committed.
  kUnknown = 1,
  /// The checkpoint was committed (its metadata is in place and loadable), then a later step
  /// failed, e.g. making the commit durable (the directory fsync). Nothing was removed.
  kCommitted = 2,
};
const char* OutcomeName(Outcome outcome);

/// A storage writer's commit failed after (or perhaps after) the metadata became visible:
/// `outcome()` says whether the checkpoint is committed (kCommitted) or cannot be told
/// (kUnknown). Carries the code of the underlying failure. Never kFailed.
class CommitError : public Error {
 public:
  CommitError(Outcome outcome, ErrorCode code, const std::string& message)
      : Error(code, message), outcome_(outcome) {}
  Outcome outcome() const noexcept { return outcome_; }

 private:
  Outcome outcome_;
};

/// One or more ranks failed (threw, or did not answer within the timeout) during `phase`.
/// Every rank of the job throws an equal CollectiveError for the same failure, except that
/// outcome() may be kUnknown on a rank that could not learn the verdict (see Outcome).
class CollectiveError : public Error {
 public:
  CollectiveError(std::string phase, std::vector<RankFailure> failures,
                  Outcome outcome = Outcome::kFailed);
  /// For a save: what the failure left at the location (kFailed for every other operation).
  Outcome outcome() const noexcept { return outcome_; }
  const std::string& phase() const noexcept { return phase_; }
  const std::vector<RankFailure>& failures() const noexcept { return failures_; }
  /// Ranks named in failures(), ascending, without duplicates.
  std::vector<int> failed_ranks() const;
  /// True when some rank did not answer in time (as opposed to reporting an error).
  bool timed_out() const;

 private:
  std::string phase_;
  std::vector<RankFailure> failures_;
  Outcome outcome_;
};

/// Throw the typed Error matching `code` (used to re-raise errors received from other ranks).
[[noreturn]] void ThrowError(ErrorCode code, const std::string& message, bool retryable);

/// Describe the exception currently being handled as a RankFailure for `rank`
/// (call only inside a catch block). Non-dcp exceptions become kInternal with their what().
RankFailure CurrentExceptionAsFailure(int rank);

}  // namespace dcp
