#include "dcp/tier/step_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "dcp/memory_tier.h"
#include "dcp/proto/checksum.h"
#include "dcp/proto/error.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/storage/backends/file_store.h"

namespace dcp {

namespace fs = std::filesystem;

namespace tier_detail {

std::string StepName(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%010lld", static_cast<long long>(step));
  return buf;
}

std::optional<int64_t> ParseStepName(const std::string& name) {
  if (name.size() != 15 || name.rfind("step-", 0) != 0) return std::nullopt;
  int64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

namespace {

constexpr char kPrivateDirAdvice[] =
    "remove it (as its owner, or as root) or set MemoryTierOptions::shm_root to a directory of "
    "your own";

std::string OctalMode(mode_t mode) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

// The job record of a tier directory: the owner it was created for.
constexpr char kJobRecordName[] = "JOB";
// The lock file of a node's directory: flock()ed by the node's first rank while a tier object
// uses it, so two processes of one job never share a node's steps (a job started twice).
constexpr char kNodeLockName[] = "LOCK";

}  // namespace

void MakePrivateDirectory(const std::string& path) {
  if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
    throw TierIoError("memory tier: cannot create " + path + ": " + std::strerror(errno));
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ELOOP || errno == ENOTDIR) {
      throw InvalidArgumentError("memory tier: " + path +
                                 " is a symbolic link or not a directory: the tier does not "
                                 "follow it; " +
                                 kPrivateDirAdvice);
    }
    const int err = errno;
    struct stat there {};
    if (err == EACCES && ::lstat(path.c_str(), &there) == 0 && there.st_uid != ::geteuid()) {
      throw InvalidArgumentError("memory tier: the directory " + path + " belongs to uid " +
                                 std::to_string(there.st_uid) + ", not to this process's uid " +
                                 std::to_string(::geteuid()) + "; " + kPrivateDirAdvice);
    }
    throw TierIoError("memory tier: cannot open " + path + ": " + std::strerror(err));
  }
  struct stat sb {};
  std::string problem;
  if (::fstat(fd, &sb) != 0) {
    problem = std::string("cannot stat it: ") + std::strerror(errno);
  } else if (sb.st_uid != ::geteuid()) {
    problem = "belongs to uid " + std::to_string(sb.st_uid) + ", not to this process's uid " +
              std::to_string(::geteuid()) + ": its owner could read the steps or plant one";
  } else if ((sb.st_mode & 022) != 0) {
    problem = "is writable by other users (mode " + OctalMode(sb.st_mode) +
              "): a step in it may have been planted";
  } else if ((sb.st_mode & 077) != 0 && ::fchmod(fd, 0700) != 0) {
    problem = std::string("cannot make it private (mode 0700): ") + std::strerror(errno);
  }
  ::close(fd);
  if (!problem.empty()) {
    throw InvalidArgumentError("memory tier: the directory " + path + " " + problem + "; " +
                               kPrivateDirAdvice);
  }
}

void CheckSharedRoot(const std::string& shm_root) {
  struct stat sb {};
  if (::stat(shm_root.c_str(), &sb) != 0) {
    throw TierIoError("memory tier: shm_root " + shm_root + ": " + std::strerror(errno));
  }
  if (!S_ISDIR(sb.st_mode)) {
    throw InvalidArgumentError("memory tier: shm_root " + shm_root + " is not a directory");
  }
  if ((sb.st_mode & 022) != 0 && (sb.st_mode & S_ISVTX) == 0) {
    throw InvalidArgumentError("memory tier: shm_root " + shm_root + " (mode " +
                               OctalMode(sb.st_mode) +
                               ") is writable by other users without the sticky bit: they could "
                               "replace the tier's directory; use a tmpfs like /dev/shm (mode "
                               "1777) or a directory of your own");
  }
}

std::string OwnerHash(const std::string& owner) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : owner) {
    h ^= c;
    h *= 1099511628211ull;
  }
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

void ClaimJobDirectory(const std::string& job_dir, const std::string& owner) {
  const std::string record = job_dir + "/" + kJobRecordName;
  const std::string text = "owner=" + owner + "\n";
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      const std::string there = ReadTierFile(record, kMaxTierMetadataBytes);
      if (there == text) return;
      throw InvalidArgumentError(
          "memory tier: " + job_dir + " holds the steps of another job (" +
          ClippedName(there.substr(0, there.find('\n'))) + "), not of owner=" + owner +
          ": its steps are never restored or freed by this one; give this job its own "
          "MemoryTierOptions::name");
    } catch (const NotFoundError&) {
    }
    const std::string tmp = record + ".tmp." + std::to_string(::getpid()) + "." +
                            std::to_string(attempt) + "." + std::to_string(::gettid());
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
      throw TierIoError("memory tier: cannot create " + tmp + ": " + std::strerror(errno));
    try {
      WriteAt(fd, text.data(), text.size(), 0, tmp);
    } catch (...) {
      ::close(fd);
      ::unlink(tmp.c_str());
      throw;
    }
    ::close(fd);
    const bool linked = ::link(tmp.c_str(), record.c_str()) == 0;
    const int err = errno;
    ::unlink(tmp.c_str());
    if (linked) return;
    if (err != EEXIST) {
      throw TierIoError("memory tier: cannot record the job in " + record + ": " +
                        std::strerror(err));
    }
  }
  throw TierIoError("memory tier: cannot read or write the job record " + record);
}

int LockNodeDirectory(const std::string& node_dir, const std::string& name) {
  const std::string path = node_dir + "/" + kNodeLockName;
  const int fd = OpenTierFile(path, O_RDWR | O_CREAT);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char holder[256] = {};
    const ssize_t n = ::pread(fd, holder, sizeof(holder) - 1, 0);
    ::close(fd);
    if (err != EWOULDBLOCK) {
      throw TierIoError("memory tier: cannot lock " + path + ": " + std::strerror(err));
    }
    throw LockedError(
        "memory tier '" + name + "' at " + node_dir,
        n > 0 ? ClippedName(std::string(holder, static_cast<size_t>(n))) : std::string());
  }
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "unknown-host");
  const std::string holder = std::string("host=") + host + " pid=" + std::to_string(::getpid());
  if (::ftruncate(fd, 0) == 0) {
    ssize_t ignored = ::pwrite(fd, holder.data(), holder.size(), 0);  // for messages only
    (void)ignored;
  }
  return fd;
}

std::string NodeLockIdentity(int fd) {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string boot;
  std::getline(in, boot);
  struct stat st {};
  if (boot.empty() || ::fstat(fd, &st) != 0) return {};
  return boot + ":" + std::to_string(static_cast<uint64_t>(st.st_dev)) + ":" +
         std::to_string(static_cast<uint64_t>(st.st_ino));
}

std::map<std::string, uint64_t> ReferencedFiles(const Metadata& md) {
  std::map<std::string, uint64_t> files;
  for (const DataFile& f : md.files) files[f.name] = f.size;  // version 2
  for (const auto& [index, info] : md.storage) {
    uint64_t& end = files[info.relative_path];
    end = std::max(end, info.offset + info.length);
  }
  return files;
}

void MakeNodeDirectories(const std::string& job_dir, const std::string& owner,
                         const std::string& node_dir) {
  MakePrivateDirectory(fs::path(job_dir).parent_path().string());
  MakePrivateDirectory(job_dir);
  ClaimJobDirectory(job_dir, owner);
  MakePrivateDirectory(node_dir);
}

std::string FreshStepDirectory(const std::string& dir, const std::string& job_dir,
                               const std::string& owner, const std::string& node_dir) {
  std::error_code ec;
  fs::remove_all(dir, ec);  // a link there is removed itself, never followed
  try {
    if (ec) throw TierIoError("memory tier: cannot prepare " + dir + ": " + ec.message());
    MakeNodeDirectories(job_dir, owner, node_dir);
    MakePrivateDirectory(dir);
  } catch (const std::exception& e) {
    return ErrorText(e);
  }
  return {};
}

std::shared_ptr<Store> StepStore(const std::string& dir) {
  FileStoreOptions o;
  o.direct_io = false;  // tmpfs: the page cache is the storage
  return MakeFileStore(dir, o);
}

std::string EncodeStepReports(const std::string& node_dir) {
  std::string mine;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(node_dir, ec)) {
    auto step = ParseStepName(e.path().filename().string());
    if (!step) continue;
    if (!IsRealDirectory(e.path())) {
      std::cerr << "dcp: memory tier: ignoring " << e.path().string()
                << ": not a directory of the tier (a link is never followed)\n";
      continue;
    }
    const std::string md_path = (e.path() / TierMetadataName()).string();
    std::string bytes;
    Metadata md;
    try {
      bytes = ReadTierFile(md_path, kMaxTierMetadataBytes);
      md = DecodeMetadataFile(bytes, md_path);
    } catch (const NotFoundError&) {
      continue;  // not committed on this node
    } catch (const std::exception& ex) {
      std::cerr << "dcp: memory tier: ignoring " << md_path << ": " << ex.what() << "\n";
      continue;
    }
    const auto referenced = ReferencedFiles(md);
    PutU64(mine, static_cast<uint64_t>(*step));
    PutU64(mine, Crc32c(0, bytes.data(), bytes.size()));
    PutU64(mine, referenced.size());
    std::string present;
    uint64_t count = 0;
    for (const auto& [name, extent] : referenced) {
      struct stat st {};
      const std::string path = (e.path() / name).string();
      if (::lstat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
          static_cast<uint64_t>(st.st_size) >= extent) {
        PutString(present, name);
        PutU64(present, static_cast<uint64_t>(st.st_size));
        ++count;
      }
    }
    PutU64(mine, count);
    mine += present;
  }
  return mine;
}

std::vector<StepReport> DecodeStepReports(const std::vector<std::string>& all,
                                          const std::vector<std::vector<int>>& nodes) {
  const int node_count = static_cast<int>(nodes.size());
  std::vector<StepReport> reports;
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    MessageReader in(all[r], "rank " + std::to_string(r));
    int node = 0;
    while (node < node_count && nodes[node].front() != r) ++node;
    while (!in.done()) {
      StepReport rep;
      rep.node = node;
      rep.step = static_cast<int64_t>(in.U64());
      rep.metadata_hash = in.U64();
      rep.referenced = in.U64();
      const uint64_t count = in.U64();
      for (uint64_t i = 0; i < count; ++i) {
        std::string name = in.String();
        rep.present[name] = in.U64();
      }
      reports.push_back(std::move(rep));
    }
  }
  return reports;
}

std::vector<Candidate> Candidates(const std::vector<StepReport>& reports) {
  std::map<std::pair<int64_t, uint64_t>, Candidate> by_key;
  for (const auto& rep : reports) {
    Candidate& c = by_key[{rep.step, rep.metadata_hash}];
    c.step = rep.step;
    c.hash = rep.metadata_hash;
    c.referenced = rep.referenced;
    c.nodes.push_back(rep.node);
    for (const auto& [name, size] : rep.present) c.holders[name].push_back(rep.node);
  }
  std::vector<Candidate> out;
  for (auto it = by_key.rbegin(); it != by_key.rend(); ++it) out.push_back(std::move(it->second));
  return out;
}

}  // namespace tier_detail

using namespace tier_detail;

std::vector<StepReport> MemoryTier::GatherReports(Communicator& comm) {
  std::string mine = leader() ? EncodeStepReports(root_) : std::string();
  return DecodeStepReports(comm.AllGather(std::move(mine), "tier/report"), nodes_);
}

// Keeps the newest `keep` committed steps up to `newest` and frees every other step directory
// of this node (uncommitted leftovers included). Bookkeeping: a failure is reported, not raised.
void MemoryTier::Retain(int64_t newest) {
  // A preemption drains the newest committed step from any rank's files: nothing goes now.
  if (preempting_.load()) return;
  std::vector<int64_t> committed;
  std::vector<int64_t> other;
  if (leader()) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(root_, ec)) {
      auto step = ParseStepName(e.path().filename().string());
      if (!step) continue;
      if (!IsRealDirectory(e.path())) {
        fs::remove(e.path(), ec);  // a link in the tier's place: removed itself, never followed
        continue;
      }
      const bool has_md = IsRealFile(e.path() / TierMetadataName());
      if (has_md && *step <= newest) {
        committed.push_back(*step);
      } else if (!has_md && *step != newest) {
        other.push_back(*step);  // an attempt that never committed (this job's: see LOCK)
      }
      // A committed step newer than this one (the job's earlier run got further) is kept.
    }
    std::sort(committed.rbegin(), committed.rend());
    for (size_t i = options_.keep; i < committed.size(); ++i) other.push_back(committed[i]);
    // A freed step's data files go to the recycle directory (replacing the previous step's), to
    // be written over by the next saves. Its metadata goes first: a crash midway leaves a step
    // that is not committed here, never a committed one with files missing.
    const fs::path recycle = fs::path(root_) / kRecycleDir;
    bool recycled = false;
    for (int64_t s : other) {
      const fs::path dir = StepDirectory(s);
      if (!recycled && IsRealFile(dir / TierMetadataName())) {
        fs::remove(dir / TierMetadataName(), ec);
        if (!ec) {
          fs::remove_all(recycle, ec);
          try {
            MakePrivateDirectory(recycle.string());
          } catch (const Error& e) {
            std::cerr << "dcp: memory tier: " << e.what() << "\n";
          }
          for (const auto& e : fs::directory_iterator(dir, ec)) {
            if (IsTierDataFile(e.path().filename().string()) && IsRealFile(e.path())) {
              fs::rename(e.path(), recycle / e.path().filename(), ec);
            }
          }
          recycled = true;
        }
      }
      fs::remove_all(dir, ec);
      if (ec) {
        std::cerr << "dcp: memory tier: cannot free " << StepDirectory(s) << ": " << ec.message()
                  << "\n";
      }
    }
  }
  // Every rank forgets what no node keeps: the same rule, on the steps it saved.
  std::lock_guard<std::mutex> lock(mu_);
  while (static_cast<int>(written_.size()) > options_.keep) {
    metadata_.erase(written_.begin()->first);
    drained_.erase(written_.begin()->first);
    written_.erase(written_.begin());
  }
}

}  // namespace dcp
