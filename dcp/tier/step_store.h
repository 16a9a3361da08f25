// The memory tier's directories on a node (not installed): the user's private anchor
// <shm_root>/dcp-tier-u<uid>, the job's directory and its owner record, the node's directory and
// its lock, and the step directories in it, each seen as a dcp location (TierStepStore).
//
// The tier keeps model weights under a directory every local user reaches (/dev/shm). Its
// anchor is created 0700 and used only while it is a real directory of this user that no one
// else may write; everything below it is created 0700/0600 and opened without following links,
// and only regular files are read. So another user can neither read a step nor plant or
// redirect one.
//
// Errors: InvalidArgumentError (saying what to do) for a directory the tier refuses, TierIoError
// for a failed call. TierStepStore is thread-safe, as a Store must be; the rest is called by one
// thread per rank.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>

#include "dcp/proto/plan.h"
#include "dcp/storage/checkpoint/store_checkpoint.h"
#include "dcp/storage/format/layout.h"
#include "dcp/storage/store.h"
#include "dcp/tier/file_mapping.h"
#include "dcp/tier/tier_internal.h"

namespace dcp::tier_detail {

// A tier step is a checkpoint in dcp's own layout: its commit marker and its data files are the
// layout's (storage/format/layout.h).
inline const std::string& TierMetadataName() {
  return LayoutFor(CheckpointFormat::kDcp).metadata_name();
}
inline bool IsTierDataFile(const std::string& name) {
  return LayoutFor(CheckpointFormat::kDcp).IsDataFile(name);
}

// The most a tier's metadata.dcp or job record may hold.
inline constexpr uint64_t kMaxTierMetadataBytes = uint64_t{1} << 30;

// Data files of freed steps wait in this directory of the node's tier to be written over by the
// next step: overwriting a tmpfs file's pages costs about half of faulting in fresh ones (and
// freeing them is not free either).
inline constexpr char kRecycleDir[] = "recycle";

// "step-<N>", N zero-padded to 10 digits; ParseStepName reads it back (nullopt for other names).
std::string StepName(int64_t step);
std::optional<int64_t> ParseStepName(const std::string& name);

// `path` (whose parent exists) as a private directory: created 0700, or the one there if it is
// a real directory of this user that no one else may write (its group and other bits are then
// cleared). InvalidArgumentError, saying what to do, for anything else.
void MakePrivateDirectory(const std::string& path);
// shm_root must be a directory that no one else can rename the tier's directory out of: not
// writable by other users unless sticky (as /dev/shm and /tmp are). InvalidArgumentError else.
void CheckSharedRoot(const std::string& shm_root);

// A stable 64-bit hash (FNV-1a) of the owner, for the job directory's name: 16 hex digits.
std::string OwnerHash(const std::string& owner);
// Records `owner` as the job of `job_dir` (created if absent: link(2) makes the first writer
// win atomically), or checks the record there. InvalidArgumentError when another job owns it.
void ClaimJobDirectory(const std::string& job_dir, const std::string& owner);
// Takes the node directory's lock (flock: the kernel frees it when the process dies, so a
// crashed job's restart takes it at once) and records the holder in it. Returns the descriptor
// that holds it; LockedError naming the holder when another process of the job holds it.
int LockNodeDirectory(const std::string& node_dir, const std::string& name);

// What identifies the node lock held on `fd` (LockNodeDirectory's) across processes of this
// machine's current boot: "<boot id>:<device>:<inode>" of its file. A drain records it in its
// lock's holder; a later process holding the same file's flock knows that drain's process is
// gone (separate tmpfs mounts differ in device; a recreated file in inode). "" when the boot id
// cannot be read (no proof is then ever made).
std::string NodeLockIdentity(int fd);
// The user's tier directory (job_dir's parent), the job's, claimed for `owner`, and the node's
// `node_dir` in it: created, or checked.
void MakeNodeDirectories(const std::string& job_dir, const std::string& owner,
                         const std::string& node_dir);
// Replaces the step directory `dir` by an empty one (a link there is removed itself, never
// followed), making the directories above it again first (a node whose memory was wiped lost
// them). Returns the failure as ErrorText, or "".
std::string FreshStepDirectory(const std::string& dir, const std::string& job_dir,
                               const std::string& owner, const std::string& node_dir);

// The checkpoint's data files and, for each, the extent its items reach (a file shorter than
// that is torn).
std::map<std::string, uint64_t> ReferencedFiles(const Metadata& md);

// The committed steps of the node directory `node_dir`, encoded for GatherReports: per step its
// number, the CRC32C of its metadata, how many files it names, and those present and long enough
// (name, size). Unreadable metadata and links are skipped with a note on stderr.
std::string EncodeStepReports(const std::string& node_dir);
// Every rank's EncodeStepReports (empty but for the nodes' first ranks), as reports of the
// nodes in `nodes` (ranks of each node, ascending). CorruptionError for a malformed one.
std::vector<StepReport> DecodeStepReports(const std::vector<std::string>& all,
                                          const std::vector<std::vector<int>>& nodes);

// What is wrong with the copy of data file `name` of step metadata `md` in step directory `dir`
// ("" when nothing is): every item of it that has a CRC32C is read and checked, found where a
// load finds it (version 2: the layout's locator, from its writer's indexes, each checked
// against the metadata's file table; version 1: the metadata). A copy that cannot be read counts
// as damaged, with the error's message. Items saved without checksums cannot be checked and
// pass.
std::string DamageIn(const std::string& dir, const Metadata& md, const std::string& name);

// A step directory over the file store, as the tier writes and reads it (no O_DIRECT: on tmpfs
// the page cache is the storage).
std::shared_ptr<Store> StepStore(const std::string& dir);

// The tier's view of one step directory as a dcp location: a common uri on every rank (the
// operation's target must agree), the names this rank creates, and the metadata held back
// (the tier commits it itself, after the replicas). For a restore, the files of the step that
// only other nodes hold count as present with their size (`elsewhere`): the reader's check that
// every data file exists must pass on a node that fetched only what its ranks read; opening
// one still fails, naming it.
class TierStepStore : public ForwardingStore {
 public:
  TierStepStore(std::shared_ptr<Store> target, MappingPool& pool, std::string dir,
                std::string recycle, std::string uri,
                std::map<std::string, uint64_t> elsewhere = {})
      : ForwardingStore(std::move(target)),
        pool_(pool),
        dir_(std::move(dir)),
        recycle_(std::move(recycle)),
        uri_(std::move(uri)),
        elsewhere_(std::move(elsewhere)) {}
  std::string uri() const override { return uri_; }
  std::optional<uint64_t> Size(const std::string& name) override {
    auto size = ForwardingStore::Size(name);
    if (!size) {
      if (auto it = elsewhere_.find(name); it != elsewhere_.end()) return it->second;
    }
    return size;
  }
  std::unique_ptr<WritableObject> Create(const std::string& name) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      created_.insert(name);
    }
    if (!IsPlainName(name)) return ForwardingStore::Create(name);  // refused there, named
    const std::string path = dir_ + "/" + name;
    std::function<void(const std::string&)> on_closed;
    if (on_closed_) on_closed = [notify = on_closed_, name](const std::string&) { notify(name); };
    return std::make_unique<TierFileWriter>(OpenForOverwrite(recycle_, path, pool_), path, pool_,
                                            std::move(on_closed));
  }
  // Called with the name of each data file this store's writers complete (set before any is
  // created; called on the writers' threads).
  void NotifyClosed(std::function<void(const std::string&)> on_closed) {
    on_closed_ = std::move(on_closed);
  }
  void PublishAtomically(const std::string& name, std::string_view bytes) override {
    if (Hold(name, bytes)) return;
    ForwardingStore::PublishAtomically(name, bytes);
  }
  void PublishNew(const std::string& name, std::string_view bytes) override {
    if (Hold(name, bytes)) return;
    ForwardingStore::PublishNew(name, bytes);
  }
  std::set<std::string> created() const {
    std::lock_guard<std::mutex> lock(mu_);
    return created_;
  }
  const std::string& held_metadata() const { return metadata_; }

 private:
  bool Hold(const std::string& name, std::string_view bytes) {
    if (name != TierMetadataName()) return false;
    std::lock_guard<std::mutex> lock(mu_);
    metadata_.assign(bytes);
    return true;
  }
  MappingPool& pool_;
  std::string dir_, recycle_, uri_;
  std::map<std::string, uint64_t> elsewhere_;
  std::function<void(const std::string&)> on_closed_;
  mutable std::mutex mu_;
  std::set<std::string> created_;
  std::string metadata_;
};

}  // namespace dcp::tier_detail
