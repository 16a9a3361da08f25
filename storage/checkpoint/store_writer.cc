// The checkpoint protocol over a Store.
//
// Save, per rank:
//   1. The coordinator takes the location's writer lock (Store::TryLock; LockedError when
//      another job holds it) and, under it, refuses to proceed if metadata exists and
//      overwrite is off. It holds the lock until Finish or Abort ends.
//   2. The coordinator names each rank's files "data-<save_id>-r<rank>" (the plan's
//      storage_data); a rank appends "-b<bucket>.data".
//   3. Each rank spreads its items over `files_per_rank` buckets (largest first onto the
//      lightest), writes the buckets on as many threads as the memory budget allows, CRC32C-ing
//      every item as it goes, and fsyncs each file.
//   4. The coordinator, once every rank succeeded, publishes metadata.dcp atomically
//      (temp + fsync + rename + directory fsync) and, where the store can decide it, only if
//      the location still holds what step 1 saw (Store::PublishNew, PublishReplacing: s3://
//      If-None-Match, If-Match). Once every rank was sent the verdict (AfterCommitDelivered),
//      still under the lock, it removes the files of dead saves (unreferenced data files,
//      metadata temporaries) and releases the lock.
// A failed save calls Abort on every rank, which removes that rank's files of this save.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <exception>
#include <future>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_set>
#include <utility>

#include "dcp/proto/error.h"
#include "dcp/proto/executor.h"
#include "dcp/proto/random_name.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/storage/checkpoint/store_checkpoint.h"
#include "dcp/storage/format/layout.h"

namespace dcp {

namespace {

class StoreWriter : public StorageWriter {
 public:
  StoreWriter(std::shared_ptr<Store> store, StorageOptions options)
      : store_(std::move(store)),
        options_(std::move(options)),
        layout_(LayoutFor(options_.format)),
        metadata_name_(layout_.metadata_name()) {
    if (options_.files_per_rank < 1) {
      throw InvalidArgumentError("files_per_rank must be at least 1");
    }
    layout_.ValidateWriteOptions(options_, store_->uri());
  }

  std::string uri() const override { return store_->uri(); }

  void SetUp(const StorageContext& ctx) override {
    ctx_ = ctx;
    created_.clear();
    {
      std::lock_guard<std::mutex> lock(files_mutex_);
      files_.clear();
    }
    replaced_.clear();
    referenced_.clear();
    metadata_version_.clear();
    committed_ = false;
    lock_.reset();
    store_->CreateRoot();
    if (!ctx.is_coordinator) return;
    // One writer per location: the coordinator holds the store's lock from here (before any
    // rank writes) to the end of Finish or Abort, so the "already exists" decision below, the
    // commit and the clean-up cannot interleave with another job's. A loser fails here, in
    // the plan phase, so none of its ranks writes anything.
    lock_ = store_->TryLock(LockHolder(ctx));
    if (!lock_) WarnNoLock();
    // What the location holds: each other layout's checkpoint, and this one's metadata. Asked
    // together (on an object store each question is a round trip of its own), judged in order.
    const std::vector<const CheckpointLayout*>& layouts = AllLayouts();
    std::vector<char> present(layouts.size() + 1, 0);
    ParallelFor(
        present.size(),
        [&](size_t i) {
          if (i == layouts.size()) {
            // The version seen (s3://: the HEAD's ETag) fences an overwrite's commit (Finish).
            present[i] = store_->SizeAndVersion(metadata_name_, &metadata_version_).has_value();
          } else if (layouts[i]->metadata_name() != metadata_name_) {
            present[i] = layouts[i]->Detect(*store_);
          }
        },
        present.size());
    for (size_t i = 0; i < layouts.size(); ++i) {
      if (!present[i]) continue;
      const CheckpointLayout* other = layouts[i];
      lock_.reset();
      throw AlreadyExistsError(store_->uri() + " holds a " + std::string(other->display_name()) +
                               " checkpoint (" + other->metadata_name() + "); a " +
                               std::string(layout_.display_name()) +
                               " checkpoint cannot replace it there: remove it or save elsewhere");
    }
    const bool exists = present[layouts.size()] != 0;
    replacing_ = exists;
    if (exists && !options_.overwrite) {
      lock_.reset();
      throw AlreadyExistsError("a checkpoint already exists at " + store_->uri() + " (it has " +
                               metadata_name_ + "); pass overwrite to replace it");
    }
    if (exists && !lock_) {
      // Unlocked, the clean-up may only remove what the replaced checkpoint listed: nothing
      // proves any other unreferenced file dead (it may be a concurrent save's).
      try {
        const Metadata old = ReadOwnMetadata();
        for (const auto& name : old.DataFileNames()) replaced_.insert(name);
      } catch (const Error&) {
        // A damaged old checkpoint: its files stay behind (dcp verify lists them).
      }
    }
  }

  SavePlan PrepareLocalPlan(SavePlan plan) override { return plan; }

  std::vector<SavePlan> PrepareGlobalPlan(std::vector<SavePlan> plans) override {
    const std::string save = ctx_.save_id.empty() ? RandomHex(8) : ctx_.save_id;
    for (size_t r = 0; r < plans.size(); ++r) {
      plans[r].storage_data = layout_.FilePrefix(save, r);
    }
    return plans;
  }

  std::future<std::vector<WriteResult>> WriteData(const SavePlan& plan,
                                                  const SavePlanner& planner) override {
    if (plan.storage_data.empty() && !plan.items.empty()) {
      throw InternalError("save plan has no file prefix; PrepareGlobalPlan was not applied");
    }
    // Size-balanced buckets: largest item first onto the bucket with the fewest bytes.
    const size_t nb =
        std::min<size_t>(options_.files_per_rank, std::max<size_t>(plan.items.size(), 1));
    std::vector<size_t> order(plan.items.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return plan.items[a].size_bytes > plan.items[b].size_bytes;
    });
    std::vector<std::vector<size_t>> buckets(nb);
    std::vector<uint64_t> bytes(nb, 0);
    for (size_t i : order) {
      const size_t b = std::min_element(bytes.begin(), bytes.end()) - bytes.begin();
      buckets[b].push_back(i);
      bytes[b] += plan.items[i].size_bytes;
    }
    for (auto& b : buckets) std::sort(b.begin(), b.end());  // plan order within a file
    for (size_t b = 0; b < nb; ++b) {
      if (!buckets[b].empty()) {
        created_.push_back(layout_.DataFileName(plan.storage_data, b));
      }
    }
    return Spawn([this, &plan, &planner, buckets = std::move(buckets)] {
             base_.reset();
             if (!options_.incremental_base.empty()) {
               base_ = std::make_unique<IncrementalBase>(*store_, options_, plan);
               if (!base_->why_not().empty() && ctx_.is_coordinator) {
                 std::fprintf(stderr,
                              "dcp: incremental save to %s writes every item: its base '%s' "
                              "cannot be shared (%s)\n",
                              store_->uri().c_str(), options_.incremental_base.c_str(),
                              base_->why_not().c_str());
               }
             }
             // Writers run concurrently as far as the memory budget allows, each taking the next
             // file; after a failure no further file is started.
             std::vector<size_t> to_write;
             for (size_t b = 0; b < buckets.size(); ++b) {
               if (!buckets[b].empty()) to_write.push_back(b);
             }
             const size_t writers =
                 std::clamp<size_t>(options_.memory_budget_bytes / kWriterStagingBytes, 1,
                                    std::max<size_t>(to_write.size(), 1));
             std::vector<std::vector<WriteResult>> results(buckets.size());
             ParallelFor(
                 to_write.size(),
                 [&](size_t i) {
                   const size_t b = to_write[i];
                   results[b] =
                       WriteBucket(plan, planner, layout_.DataFileName(plan.storage_data, b),
                                   buckets[b], options_.memory_budget_bytes / writers);
                 },
                 writers);
             std::vector<WriteResult> all;
             for (auto& r : results) {
               all.insert(all.end(), std::make_move_iterator(r.begin()),
                          std::make_move_iterator(r.end()));
             }
             // In stored-item order, so the coordinator merges every rank's results into the
             // metadata without a tree walk per item (FillStorageFromEncoded).
             std::sort(all.begin(), all.end(), [](const WriteResult& a, const WriteResult& b) {
               return a.index < b.index;
             });
             return all;
           })
        .ToFuture();
  }

  bool WritesFileIndexes() const override { return layout_.WritesFileIndexes(options_); }
  uint32_t FileIndexFormatVersion() const override { return WritesContentHashes(options_) ? 3 : 2; }

  std::vector<DataFile> TakeDataFiles() override {
    std::lock_guard<std::mutex> lock(files_mutex_);
    std::sort(files_.begin(), files_.end(),
              [](const DataFile& a, const DataFile& b) { return a.name < b.name; });
    // The metadata carries this rank's indexes only within its share of the budget, so that the
    // copies cost a load nothing at any world size (and the gather no more than the budget).
    uint64_t copies = 0;
    for (const DataFile& f : files_) copies += f.index_copy.size();
    if (copies > kMetadataIndexCopyBytes / static_cast<uint64_t>(std::max(1, ctx_.world_size))) {
      for (DataFile& f : files_) std::string().swap(f.index_copy);
    }
    return std::exchange(files_, {});
  }

  bool FinishTakesFilledStorage() const override { return true; }
  bool GlobalPlanOnlyNamesFiles() const override { return true; }

  void Finish(Metadata& md, const std::vector<std::vector<WriteResult>>& results) override {
    bool any_result = false;
    for (const auto& rank_results : results) any_result = any_result || !rank_results.empty();
    if (any_result) FillStorage(md, results);  // else the protocol filled md.storage
    std::set<std::string> referenced;
    for (const auto& f : md.files) referenced.insert(f.name);
    {
      // Items of many ranks alternate in the map's order, so a hash set of views comes first.
      std::unordered_set<std::string_view> files;
      const std::string* last = nullptr;
      for (const auto& [index, info] : md.storage) {
        if (last == nullptr || *last != info.relative_path) {
          files.insert(info.relative_path);
          last = &info.relative_path;
        }
      }
      for (std::string_view f : files) referenced.emplace(f);
    }
    // Every entry must have been written; checking here keeps a bad plan from committing.
    ValidateMetadata(md, store_->uri());
    const std::string encoded = layout_.EncodeMetadata(md, store_->uri());
    // Fence: a lock that can be lost (a lease that ran out unrenewed and was taken over) must
    // still be ours right before the commit; LeaseLostError here fails the save with nothing
    // committed, and Abort follows.
    if (lock_) lock_->CheckHeld();
    // The publish is conditional on what SetUp saw where the store can decide that atomically:
    // a new checkpoint's metadata only if still absent (S3: If-None-Match: *), an overwrite's
    // only if the metadata is still the version SetUp read under the lock (S3: If-Match: its
    // ETag). So no commit lands over another writer's that came after this save looked, even
    // past the lock: a writer paused (or stalled) between the check above and its publish
    // while its lease ran out and another job took over, committed and cleaned up.
    const bool conditional = !replacing_ || !metadata_version_.empty();
    try {
      if (!replacing_) {
        store_->PublishNew(metadata_name_, encoded);
      } else if (!metadata_version_.empty()) {
        store_->PublishReplacing(metadata_name_, encoded, metadata_version_);
      } else {
        store_->PublishAtomically(metadata_name_, encoded);
      }
    } catch (const Error& e) {
      // The rename may have happened before the failure (e.g. the directory fsync failed): then
      // the checkpoint is committed and every rank must keep its data (docs/PROTOCOL.md).
      const Outcome outcome = CommitOutcome(encoded);
      if (outcome == Outcome::kFailed) {
        // Nothing committed: Abort follows.
        if (conditional && e.code() == ErrorCode::kAlreadyExists) {
          throw AlreadyExistsError(ConflictMessage(e));
        }
        throw;
      }
      ReleaseLock();  // the outcome is decided; no Abort follows
      throw CommitError(outcome, e.code(),
                        std::string(outcome == Outcome::kCommitted
                                        ? "the checkpoint was committed, then: "
                                        : "the commit may or may not have happened: ") +
                            e.what());
    }
    // Still ours after the publish: nobody took the lock over while it was under way, so the
    // metadata landed under it. Lost: a slow publish may have landed after another job took
    // over (and even after that job's clean-up), so what the location holds is unknown.
    // The clean-up's listings go out with that question (on an object store each is a round
    // trip): they only read, and RemoveDeadFiles confirms the lock again before it removes.
    std::exception_ptr lost;
    listing_ = {};
    std::string list_error[2];  // of List, of ListIncomplete (each written by its own thread)
    ParallelFor(
        3,
        [&](size_t i) {
          try {
            if (i == 0) {
              if (lock_) lock_->CheckHeld();
            } else if (i == 1) {
              listing_.names = store_->List();
            } else if (lock_) {
              listing_.unfinished = store_->ListIncomplete();
            }
          } catch (const Error& e) {
            if (i == 0) {
              lost = std::current_exception();
            } else {
              list_error[i - 1] = e.what();
            }
          } catch (const std::exception& e) {
            if (i == 0) throw;
            list_error[i - 1] = e.what();
          }
        },
        3);
    listing_.error = list_error[0].empty() ? list_error[1] : list_error[0];
    if (lost) {
      ReleaseLock();
      try {
        std::rethrow_exception(lost);
      } catch (const Error& e) {
        throw CommitError(Outcome::kUnknown, e.code(),
                          std::string("the metadata was published, but the writer lock was lost "
                                      "meanwhile: ") +
                              e.what());
      }
    }
    // The clean-up waits for AfterCommitDelivered: the ranks learn the verdict first.
    referenced_ = std::move(referenced);
    committed_ = true;
  }

  void AfterCommitDelivered() noexcept override {
    if (committed_) RemoveDeadFiles(referenced_);
    committed_ = false;
    referenced_.clear();
    listing_ = {};
    ReleaseLock();
  }

  // After a failed publish: kCommitted when the metadata in place is this save's (byte for
  // byte: it names this save's files), kFailed when it is absent or another's, kUnknown when it
  // cannot be read.
  Outcome CommitOutcome(const std::string& encoded) const noexcept {
    try {
      if (store_->Size(metadata_name_) != encoded.size()) return Outcome::kFailed;
      return store_->ReadAll(metadata_name_, encoded.size()) == encoded ? Outcome::kCommitted
                                                                        : Outcome::kFailed;
    } catch (...) {
      return Outcome::kUnknown;
    }
  }

  void Abort() noexcept override {
    for (const auto& name : created_) {
      try {
        store_->Remove(name);
      } catch (...) {
        // Abort runs after the real error was reported; a file left behind is unreferenced.
      }
    }
    created_.clear();
    ReleaseLock();
  }

 private:
  // The new checkpoint is committed. Under the lock, every data file it does not reference is
  // provably dead: the checkpoint it replaced, saves that failed or crashed, and saves whose
  // outcome their ranks never learned (their coordinator released the lock, so their commit
  // decision is final and the metadata in place is the only one that counts). So are
  // metadata temporaries: no other publisher can be running. Without a lock only the replaced
  // checkpoint's files (read at SetUp) are known dead.
  // Runs after the verdict went out, so a failure is reported here (stderr) and changes nothing.
  void RemoveDeadFiles(const std::set<std::string>& referenced) noexcept {
    auto report = [&](const std::string& what, const char* error) {
      std::fprintf(stderr,
                   "dcp: after committing %s, %s failed (%s); the checkpoint is committed and "
                   "the next save there removes the leftover files\n",
                   store_->uri().c_str(), what.c_str(), error);
    };
    const std::string tmp_prefix = metadata_name_ + ".tmp.";
    auto is_data = [&](const std::string& name) { return layout_.IsDataFile(name); };
    try {
      // Writes in progress that List() does not show (s3:// multipart uploads) are dead too
      // under the lock: every write of this save is closed, so they are a crashed or failed
      // save's, still holding (and billing) their parts. Both were listed after the publish
      // (Finish).
      if (!listing_.error.empty()) {
        report("listing the dead files", listing_.error.c_str());
        return;
      }
      const std::vector<std::string>& names = listing_.names;
      const std::vector<std::string>& unfinished = listing_.unfinished;
      std::vector<std::string> dead;
      for (const auto& name : names) {
        if (referenced.count(name) == 0 && (lock_ ? is_data(name) || name.rfind(tmp_prefix, 0) == 0
                                                  : replaced_.count(name) > 0 && is_data(name))) {
          dead.push_back(name);
        }
      }
      // Files are dead only while no other writer can exist: with a lock that can be lost,
      // confirm it after the listing (a lost lock leaves them for the next locked save).
      if (lock_ && !(dead.empty() && unfinished.empty())) lock_->CheckHeld();
      // Together: on an object store each is a round trip, and a save that replaces a
      // checkpoint of N ranks finds N or more dead files (s3://: one request per 1,000, as
      // RemoveMany does), beside the unfinished uploads' discards.
      const size_t n = (dead.empty() ? 0 : 1) + unfinished.size();
      ParallelFor(
          n,
          [&](size_t i) {
            const bool is_dead = !dead.empty() && i == 0;
            try {
              if (is_dead) {
                store_->RemoveMany(dead);
              } else {
                store_->DiscardIncomplete(unfinished[i - (dead.empty() ? 0 : 1)]);
              }
            } catch (const std::exception& e) {
              // Leftover garbage does not make the committed checkpoint wrong; `dcp verify`
              // lists unreferenced files, and the next locked save removes them.
              report(is_dead ? "removing the " + std::to_string(dead.size()) + " dead files"
                             : "discarding the unfinished upload " +
                                   unfinished[i - (dead.empty() ? 0 : 1)],
                     e.what());
            }
          },
          std::min<size_t>(std::max<size_t>(n, 1), kStoreRequestsInFlight));
    } catch (const std::exception& e) {
      // Listing failed after the commit, or the lock could not be confirmed: the garbage waits
      // for the next save.
      report("listing the dead files", e.what());
    } catch (...) {
      report("the clean-up", "unknown error");
    }
  }

  Metadata ReadOwnMetadata() const { return layout_.ReadMetadata(*store_); }

  // A conditional publish was refused: another writer's metadata came after this save looked.
  // Whether this save's lock had been lost (it was paused or cut off past its lease, and the
  // other job took the location over) is asked once more, for the message only.
  std::string ConflictMessage(const Error& refused) const {
    bool lease_lost = false;
    if (lock_) {
      try {
        lock_->CheckHeld();
      } catch (const LeaseLostError&) {
        lease_lost = true;
      } catch (const Error&) {
        // Unconfirmed either way: the message does not claim it.
      }
    }
    return "another writer committed at " + store_->uri() +
           (lease_lost ? " after this save's lease ran out" : " since this save began") +
           "; nothing of this save was committed (its conditional publish of " + metadata_name_ +
           " was refused: " + refused.what() + ")";
  }

  void ReleaseLock() noexcept {
    if (!lock_) return;
    try {
      lock_->Release();
    } catch (const Error&) {
      // The backend frees it by its own rule (kernel, lease); the save's outcome stands.
    }
    lock_.reset();
  }

  static std::string LockHolder(const StorageContext& ctx) {
    char host[256] = {};
    if (::gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
    return std::string("host=") + host + " pid=" + std::to_string(::getpid()) +
           " save=" + (ctx.save_id.empty() ? std::string("?") : ctx.save_id);
  }

  void WarnNoLock() const {
    static std::once_flag once;
    std::call_once(once, [&] {
      std::fprintf(stderr,
                   "dcp: warning: storage %s has no writer lock; concurrent saves to one "
                   "location are not excluded (see docs/STORAGE_BACKENDS.md)\n",
                   store_->uri().c_str());
    });
  }

  // `share`: this writer's part of the memory budget. Half of it goes to the store's write
  // buffers, the rest to the encoder's gather buffer and device pieces (kWriterStagingBytes).
  std::vector<WriteResult> WriteBucket(const SavePlan& plan, const SavePlanner& planner,
                                       const std::string& name, const std::vector<size_t>& items,
                                       size_t share) {
    auto out = store_->Create(name);
    out->LimitBuffers(share / 2);
    const auto encoder = layout_.NewItemEncoder(options_);
    if (!encoder) {
      throw InternalError("the " + std::string(layout_.display_name()) +
                          " layout has no per-rank data files");
    }
    std::vector<WriteResult> results;
    results.reserve(items.size());
    for (size_t i : items) {
      const WriteItem& item = plan.items[i];
      const ResolvedData data = planner.ResolveData(item);
      WriteResult r;
      r.index = item.index;
      if (const BaseItem* kept = base_ ? base_->Find(i) : nullptr) {
        // The base holds it: kept there when frozen or when its bytes hash the same (a hash
        // computed for that is not computed again if it is written after all).
        if (item.is_tensor()) CheckUnchanged(item, data);
        std::optional<ContentHash> hash;
        if (base_->Unchanged(i, item, data, hash)) {
          r.storage = kept->info;
          r.reference = kept->reference;
          results.push_back(std::move(r));
          continue;
        }
        r.storage.content_hash = hash;
      }
      r.storage.relative_path = name;
      r.storage.offset = out->size();
      encoder->Append(*out, item, data, r.storage);
      r.size_in_bytes = r.storage.length;
      results.push_back(std::move(r));
    }
    if (std::optional<DataFile> file =
            layout_.FinishDataFile(*out, name, results, options_, ctx_.rank)) {
      std::lock_guard<std::mutex> lock(files_mutex_);
      files_.push_back(std::move(*file));
    }
    // The block CRCs are in the file's block table now; results go on to the metadata.
    for (WriteResult& r : results) std::vector<uint32_t>().swap(r.storage.block_crc32c);
    if (options_.sync) out->Sync();
    out->Close();
    return results;
  }

  std::shared_ptr<Store> store_;
  StorageOptions options_;
  const CheckpointLayout& layout_;
  const std::string metadata_name_;
  StorageContext ctx_;
  std::vector<std::string> created_;
  std::unique_ptr<StoreLock> lock_;   // coordinator: held from SetUp to AfterCommitDelivered/Abort
  std::set<std::string> referenced_;  // coordinator: files of the committed metadata
  struct Listing {
    std::vector<std::string> names, unfinished;  // List(), ListIncomplete() after the publish
    std::string error;                           // why they failed, if they did
  };
  Listing listing_;                        // coordinator: what the clean-up after the commit judges
  bool committed_ = false;                 // coordinator: Finish committed; clean-up pending
  bool replacing_ = false;                 // metadata existed at SetUp (an overwrite)
  std::string metadata_version_;           // its version then (Store::SizeAndVersion), "" if none
  std::set<std::string> replaced_;         // unlocked overwrite: files of the replaced checkpoint
  std::unique_ptr<IncrementalBase> base_;  // incremental saves: what the base holds of the plan
  std::mutex files_mutex_;                 // guards files_ (files are written in parallel)
  std::vector<DataFile> files_;            // this rank's files of the current save (FinishDataFile)
};

}  // namespace

std::unique_ptr<StorageWriter> MakeStoreWriter(std::shared_ptr<Store> store,
                                               const StorageOptions& options) {
  auto writer = std::make_unique<StoreWriter>(store, options);
  return LayoutFor(options.format).WrapWriter(std::move(writer), std::move(store), options);
}

}  // namespace dcp
