// MemoryTier::Drain: a committed step copied from the tier to a durable dcp location, committed
// there as a save commits.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "dcp/memory_tier.h"
#include "dcp/proto/error.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/storage/checkpoint/store_checkpoint.h"
#include "dcp/storage/registry.h"
#include "dcp/tier/file_mapping.h"
#include "dcp/tier/step_store.h"
#include "dcp/tier/tier_internal.h"

namespace dcp {

using namespace tier_detail;

namespace {

// The drain's destination. Rank 0 holds its writer lock from the existence check to the commit
// and the clean-up, as a save does: a replaced checkpoint (StorageOptions::overwrite) stays
// loadable until the new metadata is in place, and its files go only after that.
struct DrainTarget {
  std::shared_ptr<Store> dest;
  std::unique_ptr<StoreLock> lock;
  bool replacing = false;
  std::string replaced_version;  // what the commit may replace (s3://: its ETag)
  std::set<std::string> replaced_files;
};

// The destination's writer lock for a drain of `step`. The holder names this node's tier lock
// (`node_lock`, NodeLockIdentity; "" on a rank that holds none). An object store's lock is a
// lease that outlives a killed holder: a drain killed midway would keep the step's location
// locked for the lease's length, so a restart preempted meanwhile could not drain the step it
// restored. A lock whose holder names the tier lock this process holds now is such a drain's:
// its process held that flock and no longer does, so it is gone, and the lock is taken over.
std::unique_ptr<StoreLock> LockForDrain(Store& dest, int64_t step, const std::string& uri,
                                        const std::string& node_lock) {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "unknown-host");
  const std::string mark = node_lock.empty() ? std::string() : " tier-lock=" + node_lock;
  const std::string holder = std::string("host=") + host + " pid=" + std::to_string(::getpid()) +
                             " memory-tier-drain step=" + std::to_string(step) + mark;
  try {
    return dest.TryLock(holder);
  } catch (const LockedError& e) {
    const std::string& other = e.holder();
    const bool ours =
        !mark.empty() && (other.find(mark + " ") != std::string::npos || other.ends_with(mark));
    if (!ours) throw;
    std::fprintf(stderr,
                 "dcp: memory tier: %s is locked by a drain whose process is gone (%s; it held "
                 "this node's tier lock, which this process holds now): taking the lock over\n",
                 uri.c_str(), other.c_str());
    return dest.TryLockOver(holder, other);
  }
}

// Rank 0: opens `uri`, takes its lock (LockForDrain) and looks for a checkpoint there. Returns
// the failure as ErrorText, or "".
std::string OpenDestination(DrainTarget& target, int64_t step, const std::string& uri,
                            const StorageOptions& options, const std::string& node_lock) {
  try {
    target.dest = OpenStore(uri, options.backend);
    target.dest->CreateRoot();
    target.lock = LockForDrain(*target.dest, step, uri, node_lock);
    if (target.dest->SizeAndVersion(TierMetadataName(), &target.replaced_version)) {
      if (!options.overwrite) {
        throw AlreadyExistsError("memory tier: " + uri +
                                 " already holds a checkpoint; set StorageOptions::overwrite "
                                 "(CheckpointManager: allow_replacing_steps) to replace it");
      }
      target.replacing = true;
      try {
        target.replaced_files = ReadMetadata(uri, options).DataFileNames();
      } catch (const Error&) {
        // A damaged checkpoint being replaced: its files stay (dcp verify lists them).
      }
    }
  } catch (const std::exception& e) {
    return ErrorText(e);
  }
  return {};
}

// Copies this rank's files `names` of the step in `dir` to `dest`, naming each in `copied`
// before it is created there (so that a failed drain removes it again). Returns the failure as
// ErrorText, or "". Each file is mapped and handed to the store straight from its pages: the
// file store writes page-aligned memory with O_DIRECT from where it lies, so a copy costs the
// disk's write and nothing more (reading it into a buffer first cost a memcpy, and the store's
// staging another: 1.5x a raw write).
std::string CopyOwnFiles(std::shared_ptr<Store>& dest, const std::string& uri,
                         const StorageOptions& options, const std::string& dir,
                         const std::vector<std::string>& names, std::vector<std::string>& copied,
                         TierStats& stats) {
  try {
    if (!dest) dest = OpenStore(uri, options.backend);
    constexpr uint64_t kPiece = 64 << 20;  // what a store is handed at once
    for (const auto& name : names) {
      const std::string path = dir + "/" + name;
      int fd = OpenTierFile(path, O_RDONLY);
      void* map = MAP_FAILED;
      uint64_t size = 0;
      try {
        struct stat st {};
        if (::fstat(fd, &st) != 0) throw TierIoError("memory tier: cannot stat " + path);
        size = static_cast<uint64_t>(st.st_size);
        if (size > 0) {
          map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
          if (map == MAP_FAILED) throw TierIoError("memory tier: cannot map " + path);
          ::madvise(map, size, MADV_SEQUENTIAL);
        }
        copied.push_back(name);
        auto out = dest->Create(name);
        const char* bytes = static_cast<const char*>(map);
        for (uint64_t at = 0; at < size; at += kPiece) {
          out->Append(bytes + at, static_cast<size_t>(std::min(kPiece, size - at)));
        }
        if (options.sync) out->Sync();
        out->Close();
        stats.bytes_sent += size;
      } catch (...) {
        if (map != MAP_FAILED) ::munmap(map, size);
        ::close(fd);
        throw;
      }
      if (map != MAP_FAILED) ::munmap(map, size);
      ::close(fd);
    }
  } catch (const std::exception& e) {
    return ErrorText(e);
  }
  return {};
}

// What a failed drain leaves: the files this rank copied go again.
void RemoveCopies(Store* dest, const std::vector<std::string>& copied) noexcept {
  for (const auto& name : copied) {
    try {
      dest->Remove(name);
    } catch (...) {
      // Unreferenced: dcp verify lists it, and the next save there removes it.
    }
  }
}

// Rank 0, after every copy succeeded: publishes the metadata `encoded`, only over the checkpoint
// found (a writer that took the location over meanwhile, a lease that ran out, keeps its
// commit). Returns the failure as ErrorText, or "".
std::string PublishMetadata(DrainTarget& target, const std::string& encoded) {
  try {
    if (target.lock) target.lock->CheckHeld();
    if (target.replacing) {
      target.dest->PublishReplacing(TierMetadataName(), encoded, target.replaced_version);
    } else {
      target.dest->PublishNew(TierMetadataName(), encoded);
    }
  } catch (const std::exception& e) {
    // Committed all the same when the metadata in place is ours (a failure after the rename).
    bool ours = false;
    try {
      ours = target.dest->Size(TierMetadataName()) == encoded.size() &&
             target.dest->ReadAll(TierMetadataName(), encoded.size()) == encoded;
    } catch (...) {
    }
    if (!ours) return ErrorText(e);
  }
  return {};
}

// The replaced checkpoint's files that the new one does not name are dead now: removed, or
// reported on stderr (dcp verify lists them).
void RemoveReplacedFiles(DrainTarget& target, const std::string& encoded, int64_t step,
                         const std::string& uri) {
  std::vector<std::string> dead;
  try {
    const Metadata md = DecodeMetadataFile(encoded, uri);
    const auto live = md.DataFileNames();
    for (const auto& name : target.replaced_files) {
      if (!live.count(name)) dead.push_back(name);
    }
    if (target.lock) target.lock->CheckHeld();
    target.dest->RemoveMany(dead);
  } catch (const std::exception& e) {
    std::cerr << "dcp: memory tier: step " << step << " replaced the checkpoint at " << uri
              << "; removing the replaced files failed (" << e.what()
              << "): dcp verify lists them\n";
  }
}

}  // namespace

bool MemoryTier::DrainCopies(const StorageOptions& options) {
  // (Content hashes and incremental bases change what the files hold: a save, not a copy.)
  return options.format == CheckpointFormat::kDcp && options.compression == Compression::kNone &&
         !options.content_hashes && options.incremental_base.empty();
}

void MemoryTier::Drain(int64_t step, const std::string& uri, const StorageOptions& options) {
  Wait();
  DrainOn(comm_, step, uri, options, stats_, /*vetoed=*/true);
}

void MemoryTier::DrainForPreemption(Communicator& comm, int64_t step, const std::string& uri,
                                    const StorageOptions& options, TierStats& stats) {
  DrainOn(comm, step, uri, options, stats, /*vetoed=*/false);
}

void MemoryTier::DrainOn(Communicator& comm, int64_t step, const std::string& uri,
                         const StorageOptions& options, TierStats& stats, bool vetoed) {
  const auto t0 = std::chrono::steady_clock::now();
  BusyScope busy(*this);
  if (vetoed) busy.Enter();
  std::vector<std::string> files;
  std::string encoded;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto w = written_.find(step);
    if (w == written_.end()) {
      throw InvalidArgumentError("memory tier: step " + std::to_string(step) +
                                 " was not saved by this tier (or is no longer kept): cannot "
                                 "drain it to " +
                                 uri);
    }
    files = w->second;
    if (rank_ == 0) encoded = metadata_.at(step);
  }
  if (!DrainCopies(options)) {
    throw InvalidArgumentError(
        "memory tier: Drain copies the tier's files (the dcp format, uncompressed) and cannot "
        "write another format or compress; save the state to " +
        uri + " with dcp::Save (CheckpointManager does so for such durable steps)");
  }
  const std::string what = "the drain of step " + std::to_string(step) + " to " + uri;
  DrainTarget target;
  std::string error = vetoed ? PreemptionVeto(what) : std::string();
  if (rank_ == 0 && error.empty()) {
    error = OpenDestination(target, step, uri, options, node_lock_identity_);
  }
  Vote(comm, error, "tier/drain-open");
  // Each rank copies the files it wrote; what it copied goes again if the drain fails.
  std::vector<std::string> copied;
  error = CopyOwnFiles(target.dest, uri, options, StepDirectory(step), files, copied, stats);
  if (error.empty() && vetoed) error = PreemptionVeto(what);
  try {
    Vote(comm, error, "tier/drain");
  } catch (...) {
    RemoveCopies(target.dest.get(), copied);
    throw;
  }
  error.clear();
  if (rank_ == 0) {
    error = PublishMetadata(target, encoded);
    if (error.empty() && !target.replaced_files.empty()) {
      RemoveReplacedFiles(target, encoded, step, uri);
    }
  }
  try {
    Vote(comm, error, "tier/drain-commit");
  } catch (...) {
    RemoveCopies(target.dest.get(), copied);
    throw;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    drained_[step] = uri;
  }
  stats.drain_s = SecondsSince(t0);
}

}  // namespace dcp
