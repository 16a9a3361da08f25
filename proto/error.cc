#include "dcp/proto/error.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <new>
#include <set>
#include <sstream>

namespace dcp {

const char* ErrorCodeName(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return "InvalidArgument";
    case ErrorCode::kNotFound:
      return "NotFound";
    case ErrorCode::kAlreadyExists:
      return "AlreadyExists";
    case ErrorCode::kCorruption:
      return "Corruption";
    case ErrorCode::kIo:
      return "Io";
    case ErrorCode::kUnsupported:
      return "Unsupported";
    case ErrorCode::kCollective:
      return "Collective";
    case ErrorCode::kTimeout:
      return "Timeout";
    case ErrorCode::kInternal:
      return "Internal";
    case ErrorCode::kDevice:
      return "Device";
    case ErrorCode::kResourceExhausted:
      return "ResourceExhausted";
    case ErrorCode::kPreempted:
      return "Preempted";
  }
  return "Unknown";
}

Error::Error(ErrorCode code, const std::string& message, bool retryable)
    : std::runtime_error(message), code_(code), retryable_(retryable) {}

IoError MakeIoError(const std::string& operation, const std::string& path, int errno_value) {
  // Retryable: conditions that can clear by themselves. ENOSPC is not: someone must free space.
  const bool retryable = errno_value == EINTR || errno_value == EAGAIN || errno_value == EBUSY ||
                         errno_value == ETIMEDOUT || errno_value == ECONNRESET;
  std::ostringstream os;
  os << operation << " failed for '" << path << "': " << std::strerror(errno_value) << " (errno "
     << errno_value << ")";
  return IoError(os.str(), retryable, errno_value);
}

namespace {
std::string DescribeFailures(const std::string& phase, const std::vector<RankFailure>& failures) {
  std::ostringstream os;
  std::set<int> ranks;
  for (const auto& f : failures) ranks.insert(f.rank);
  os << "collective " << phase << " failed on rank" << (ranks.size() == 1 ? " " : "s ");
  bool first = true;
  for (int r : ranks) {
    os << (first ? "" : ", ") << r;
    first = false;
  }
  for (const auto& f : failures) {
    os << "\n  rank " << f.rank << ": [" << ErrorCodeName(f.code) << "] " << f.message;
  }
  return os.str();
}
}  // namespace

const char* OutcomeName(Outcome outcome) {
  switch (outcome) {
    case Outcome::kFailed:
      return "failed";
    case Outcome::kUnknown:
      return "unknown";
    case Outcome::kCommitted:
      return "committed";
  }
  return "?";
}

namespace {
std::string DescribeOutcome(Outcome outcome) {
  switch (outcome) {
    case Outcome::kFailed:
      return "";
    case Outcome::kUnknown:
      return " [outcome unknown to this rank: the checkpoint exists exactly when its metadata "
             "does; this rank's data files were kept]";
    case Outcome::kCommitted:
      return " [the checkpoint WAS committed and is loadable; a step after the commit failed]";
  }
  return "";
}
}  // namespace

CollectiveError::CollectiveError(std::string phase, std::vector<RankFailure> failures,
                                 Outcome outcome)
    : Error(ErrorCode::kCollective, DescribeFailures(phase, failures) + DescribeOutcome(outcome),
            !failures.empty() && std::all_of(failures.begin(), failures.end(),
                                             [](const RankFailure& f) { return f.retryable; })),
      phase_(std::move(phase)),
      failures_(std::move(failures)),
      outcome_(outcome) {}

std::vector<int> CollectiveError::failed_ranks() const {
  std::set<int> ranks;
  for (const auto& f : failures_) ranks.insert(f.rank);
  return {ranks.begin(), ranks.end()};
}

bool CollectiveError::timed_out() const {
  return std::any_of(failures_.begin(), failures_.end(),
                     [](const RankFailure& f) { return f.code == ErrorCode::kTimeout; });
}

void ThrowError(ErrorCode code, const std::string& message, bool retryable) {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      throw InvalidArgumentError(message);
    case ErrorCode::kNotFound:
      throw NotFoundError(message);
    case ErrorCode::kAlreadyExists:
      throw AlreadyExistsError(message);
    case ErrorCode::kCorruption:
      throw CorruptionError(message);
    case ErrorCode::kIo:
      throw IoError(message, retryable);
    case ErrorCode::kUnsupported:
      throw UnsupportedError(message);
    case ErrorCode::kInternal:
      throw InternalError(message);
    case ErrorCode::kDevice:
      throw DeviceError(message);
    case ErrorCode::kResourceExhausted:
      throw ResourceError(message);
    case ErrorCode::kPreempted:
      throw PreemptedError(message);
    default:
      throw Error(code, message, retryable);
  }
}

std::string OutOfMemoryMessage(const std::string& what, unsigned long long bytes) {
  return "out of memory: cannot allocate " + std::to_string(bytes) + " bytes for " + what;
}

RankFailure CurrentExceptionAsFailure(int rank) {
  RankFailure f;
  f.rank = rank;
  try {
    throw;
  } catch (const Error& e) {
    f.code = e.code();
    f.message = e.what();
    f.retryable = e.retryable();
  } catch (const std::bad_alloc& e) {
    // Library paths that allocate what a checkpoint asks for throw ResourceError naming it;
    // a bare bad_alloc reaching here came from elsewhere (the caller, a small allocation).
    f.code = ErrorCode::kResourceExhausted;
    f.message = std::string("out of memory: ") + e.what();
  } catch (const std::exception& e) {
    f.code = ErrorCode::kInternal;
    f.message = e.what();
  } catch (...) {
    f.code = ErrorCode::kInternal;
    f.message = "unknown exception";
  }
  return f;
}

}  // namespace dcp
