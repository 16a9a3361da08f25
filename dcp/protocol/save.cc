#include "dcp/protocol/save.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <random>
#include <string_view>
#include <typeinfo>

#include "dcp/planner/compact_plan.h"
#include "dcp/planner/default_planner.h"
#include "dcp/proto/checksum.h"
#include "dcp/proto/error.h"
#include "dcp/proto/executor.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/protocol/phase.h"
#include "dcp_version.h"

namespace dcp::protocol {

namespace {

// Every rank knows the save's operation id, so the save id derives from it.
std::string SaveIdOf(uint64_t operation_id) {
  char buf[17];
  snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(operation_id));
  return buf;
}

std::string NewSaveId() {
  std::random_device rd;
  std::mt19937_64 rng(
      (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  char buf[17];
  snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(rng()));
  return buf;
}

// Plan caching (SavePlanCache): a 64-bit hash of an encoded local plan (two CRC32Cs with
// different seeds and the length: equal plans hash equal on every rank, and a changed plan is
// caught with overwhelming probability; a false hit would still fail the save's validation
// rather than write wrongly placed data).
uint64_t PlanHash(std::string_view plan) {
  const uint64_t a = Crc32c(0, plan.data(), plan.size());
  const uint64_t b = Crc32c(0x9E3779B9u, plan.data(), plan.size());
  return ((a << 32) | b) ^ (static_cast<uint64_t>(plan.size()) * 0x9E3779B97F4A7C15ull);
}

std::string PackId(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

uint64_t UnpackId(std::string_view s) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(s[static_cast<size_t>(i)]);
  return v;
}

struct CacheProbe {
  bool usable = false;
  uint64_t hash = 0, plan_id = 0;
};

std::string PackCacheProbe(bool usable, uint64_t hash, uint64_t plan_id) {
  return std::string(1, usable ? 'U' : '-') + PackId(hash) + PackId(plan_id);
}

CacheProbe UnpackCacheProbe(std::string_view s) {
  if (s.size() != 17) throw InternalError("malformed plan cache probe");
  return {s[0] == 'U', UnpackId(s.substr(1, 8)), UnpackId(s.substr(9, 8))};
}

// After an unknown verdict: the save is committed when the metadata in place names this save
// (its id is on every rank), which a rank sharing the store can read itself.
std::optional<Metadata> CommittedMetadata(const StorageWriter& writer, const std::string& save_id,
                                          const StorageOptions& options) noexcept {
  if (save_id.empty()) return std::nullopt;
  try {
    Metadata md = ReadMetadata(writer.uri(), options);
    if (md.save_id == save_id) return md;
  } catch (...) {
    // Not readable from this rank (a store it does not share, no metadata): still unknown.
  }
  return std::nullopt;
}

// Version 2: every chunk and byte entry of `md` records the rank that writes it, and every item
// of the global plans its chunk ordinal (the data files' indexes are keyed by it). The default
// planner records both as it merges; for other planners they are read off the global plans
// here. Entries nobody writes are an InternalError (ValidateMetadata would refuse them too).
void AssignWriters(Metadata& md, std::vector<SavePlan>& plans) {
  bool complete = true;
  for (const auto& [fqn, entry] : md.entries) {
    if (const auto* t = std::get_if<TensorMetadata>(&entry)) {
      complete = complete && (t->regular || t->chunk_writers.size() == t->chunks.size());
    } else {
      complete = complete && std::get<BytesMetadata>(entry).writer >= 0;
    }
  }
  if (complete) return;
  for (auto& [fqn, entry] : md.entries) {
    if (auto* t = std::get_if<TensorMetadata>(&entry); t && !t->regular) {
      t->chunk_writers.assign(t->chunks.size(), -1);
    }
  }
  for (size_t r = 0; r < plans.size(); ++r) {
    for (WriteItem& item : plans[r].items) {
      auto e = md.entries.find(item.index.fqn);
      if (e == md.entries.end()) {
        throw InternalError("global plan of rank " + std::to_string(r) + " writes " +
                            item.index.ToString() + ", which the metadata does not list");
      }
      if (auto* t = std::get_if<TensorMetadata>(&e->second)) {
        const auto k = ChunkOrdinal(*t, item.index.offset, item.index.index);
        if (!k) {
          throw InternalError("global plan of rank " + std::to_string(r) + " writes " +
                              item.index.ToString() + ", which is no chunk of its tensor");
        }
        item.index.index = static_cast<int32_t>(*k);
        if (!t->regular) t->chunk_writers[*k] = static_cast<int32_t>(r);
      } else {
        item.index.index = 0;
        std::get<BytesMetadata>(e->second).writer = static_cast<int32_t>(r);
        std::get<BytesMetadata>(e->second).size = item.size_bytes;
      }
    }
  }
  for (const auto& [fqn, entry] : md.entries) {
    const auto* t = std::get_if<TensorMetadata>(&entry);
    const bool unwritten = t ? std::find(t->chunk_writers.begin(), t->chunk_writers.end(), -1) !=
                                   t->chunk_writers.end()
                             : std::get<BytesMetadata>(entry).writer < 0;
    if (unwritten) {
      throw InternalError("no rank's global plan writes (all of) '" + fqn + "'");
    }
  }
}

// Version 2: the items rank r writes: its global plan's (the residual ones, in compact
// planning) plus chunk r of every rule that has one.
std::vector<uint64_t> ExpectedItemsPerRank(const Metadata& md, const std::vector<SavePlan>& plans) {
  std::vector<int64_t> starts(plans.size() + 1, 0);
  for (const auto& [fqn, entry] : md.entries) {
    const auto* t = std::get_if<TensorMetadata>(&entry);
    if (t == nullptr || !t->regular) continue;
    starts[0] += 1;
    starts[std::min(ChunkCount(*t), plans.size())] -= 1;
  }
  std::vector<uint64_t> out(plans.size());
  int64_t running = 0;
  for (size_t r = 0; r < plans.size(); ++r) {
    running += starts[r];
    out[r] = plans[r].items.size() + static_cast<uint64_t>(running);
  }
  return out;
}

// The writer's exchange among ranks (StorageContext::exchange) as one Gather per destination:
// a non-root's Gather only sends, so every rank posts its messages, then collects its own at its
// turn. Runs inside the save's operation, so each message carries its id and phase.
class CommunicatorExchange : public RankExchange {
 public:
  explicit CommunicatorExchange(Communicator& comm) : comm_(comm) {}
  std::vector<std::string> AllToAll(std::vector<std::string> to, std::string_view what) override {
    const int n = comm_.size();
    if (to.size() != static_cast<size_t>(n)) {
      throw InternalError("exchange " + std::string(what) + ": " + std::to_string(to.size()) +
                          " messages for " + std::to_string(n) + " ranks");
    }
    std::vector<std::string> got;
    for (int r = 0; r < n; ++r) {
      std::vector<std::string> in = comm_.Gather(std::move(to[static_cast<size_t>(r)]), r, what);
      if (r == comm_.rank()) got = std::move(in);
    }
    return got;
  }

 private:
  Communicator& comm_;
};

// One rank's part of one save: the state machine of docs/PROTOCOL.md as named steps.
//   Run:  open the operation -> TryPlanCache -> Plan -> WriteAndCommit
// Every local step runs inside a phase (RunPhase), so an error on one rank is everyone's; only
// a verdict of kFailed lets a rank remove what it wrote (Run's handlers).
class SaveOperation {
 public:
  SaveOperation(const StateDict& state_dict, StorageWriter& writer, Communicator& comm,
                const SaveOptions& options)
      : state_dict_(state_dict),
        writer_(writer),
        comm_(comm),
        options_(options),
        rank_(comm.rank()),
        size_(comm.size()),
        planner_(options.planner ? *options.planner : default_planner_),
        planner_type_(typeid(planner_).name()),
        cache_(options.plan_cache.get()),
        exchange_(comm),
        sctx_{rank_, size_, rank_ == 0, std::string(), &exchange_} {}

  SaveResult Run() {
    try {
      // The step is part of what every rank must open alike (SaveOptions::step).
      OperationScope op(comm_, "save",
                        options_.step
                            ? writer_.uri() + " (step " + std::to_string(*options_.step) + ")"
                            : writer_.uri());
      sctx_.save_id = SaveIdOf(op.id());
      if (!(cache_ && TryPlanCache())) Plan();
      WriteAndCommit();
      // The verdict is out: only now the coordinator's post-commit housekeeping.
      if (committed_) writer_.AfterCommitDelivered();
    } catch (const CollectiveError& e) {
      if (committed_) {  // the coordinator could not deliver a verdict of a committed save
        writer_.AfterCommitDelivered();
        throw CollectiveError(e.phase(), e.failures(), Outcome::kCommitted);
      }
      // A rank that reported its writes and missed the verdict settles it from the commit
      // record where it shares the store.
      if (e.outcome() == Outcome::kUnknown) {
        if (auto md = CommittedMetadata(writer_, sctx_.save_id, options_.storage)) {
          return SaveResult{std::move(*md), stats_};
        }
      }
      // Only a save known not to be committed may remove data (docs/PROTOCOL.md).
      if (e.outcome() == Outcome::kFailed) writer_.Abort();
      throw;
    } catch (...) {
      if (committed_) {
        writer_.AfterCommitDelivered();
        throw;
      }
      writer_.Abort();
      throw;
    }
    // Committed: whatever fails from here on removes nothing.
    return SaveResult{DecodeMetadata(md_bytes_, writer_.uri()), stats_};
  }

 private:
  // The forms a plan exchange can take: compact with the declarations of short tensors hashed;
  // compact with every declaration in full (after kRetryDeclared); item by item (kRetryFull,
  // or when compact planning does not apply).
  enum class PlanForm { kCompactHashed, kCompact, kFull };

  // This rank's local plan, made once (the plan cache, compact and full planning all start
  // from it).
  const SavePlan& LocalPlan() {
    if (!have_local_) {
      writer_.SetUp(sctx_);
      planner_.SetUp(state_dict_, PlannerContext{rank_, size_, rank_ == 0});
      my_full_ = writer_.PrepareLocalPlan(planner_.CreateLocalPlan());
      have_local_ = true;
    }
    return my_full_;
  }

  // Plan caching: every rank hashes its local plan; rank 0 says whether all match the cached
  // global plan. On a hit each rank gets only its data file names, and this returns true.
  bool TryPlanCache() {
    std::vector<uint64_t> hashes;  // rank 0: every rank's, for the cache on a miss
    const std::string verdict = RunPhase(
        comm_, "save/plan-cache",
        [&] {
          my_local_ = EncodeSavePlan(LocalPlan());
          my_hash_ = PlanHash(my_local_);
          const SavePlanCache::Entry& e = cache_->entry;
          const bool usable = e.valid && e.world_size == size_ && e.planner == planner_type_;
          std::string probe = PackCacheProbe(usable, my_hash_, usable ? e.plan_id : 0);
          stats_.plan_bytes_sent += probe.size();
          return probe;
        },
        [&](std::vector<std::string> probes) { return JudgeCacheProbes(probes, hashes); });
    if (HasTag(verdict, Tag::kCacheHit)) {
      central_ = cache_->entry.central;
      central_.storage_data = verdict.substr(1);
      stats_.cached_plan = true;
      ++cache_->hits_;
      return true;
    }
    ++cache_->misses_;
    cache_->entry.valid = false;  // refreshed by Plan once the full plan is known
    if (rank_ == 0) cache_->entry.hashes = std::move(hashes);
    return false;
  }

  // Coordinator: a hit when every rank's probe matches the cache; then the writer names this
  // save's files and each rank's reply carries them.
  std::vector<std::string> JudgeCacheProbes(const std::vector<std::string>& probes,
                                            std::vector<uint64_t>& hashes) {
    SavePlanCache::Entry& e = cache_->entry;
    bool hit = e.valid && e.hashes.size() == static_cast<size_t>(size_) &&
               e.global_plans.size() == static_cast<size_t>(size_);
    for (int r = 0; r < size_; ++r) {
      const CacheProbe p = UnpackCacheProbe(probes[static_cast<size_t>(r)]);
      hashes.push_back(p.hash);
      hit = hit && p.usable && p.hash == e.hashes[static_cast<size_t>(r)] && p.plan_id == e.plan_id;
    }
    std::vector<std::string> out(static_cast<size_t>(size_), TagString(Tag::kCacheMiss));
    if (!hit) return out;
    // The cached plans are moved through the writer, not copied (they are every rank's plan);
    // what comes back is cached again, so a writer's PrepareGlobalPlan must accept its own
    // output (it only sets storage).
    e.global_plans = writer_.PrepareGlobalPlan(std::move(e.global_plans));
    if (e.global_plans.size() != static_cast<size_t>(size_)) {
      e.valid = false;
      throw InternalError("the storage writer returned " + std::to_string(e.global_plans.size()) +
                          " plans for " + std::to_string(size_) + " ranks");
    }
    global_md_ = e.skeleton;
    expected_items_ = ExpectedItemsPerRank(global_md_, e.global_plans);
    for (int r = 0; r < size_; ++r) {
      out[static_cast<size_t>(r)] =
          TagString(Tag::kCacheHit) + e.global_plans[static_cast<size_t>(r)].storage_data;
    }
    return out;
  }

  // The plan exchange. Every plan message starts with its form: kCompactPlan (planner/
  // compact_plan.h: regularly sharded tensors described once, not once per rank) or kFullPlan.
  // A rank sends a compact plan when it plans with the default planner and its writer only
  // names files. The coordinator merges compactly when every rank sent one, in full when none
  // did, and otherwise (ranks that differ, or regular shards the ranks do not all describe
  // alike) answers kRetryFull: every rank then plans again in full.
  void Plan() {
    const bool can_compact =
        options_.planner == nullptr && size_ > 1 && writer_.GlobalPlanOnlyNamesFiles();
    PlanForm form = can_compact ? PlanForm::kCompactHashed : PlanForm::kFull;
    for (int attempt = 0;; ++attempt) {
      if (attempt > 2) throw InternalError("save planning did not converge");
      const std::string reply = RunPhase(
          comm_,
          attempt == 0              ? "save/plan"
          : form == PlanForm::kFull ? "save/plan-full"
                                    : "save/plan-declared",
          [&] { return PlanMessage(form); },
          [&](std::vector<std::string> locals) { return MergePlans(locals); });
      if (AcceptPlanReply(reply, form)) return;
    }
  }

  // This rank's plan message in `form`.
  std::string PlanMessage(PlanForm form) {
    std::string msg;
    if (form != PlanForm::kFull) {
      split_ = SplitRegularShards(LocalPlan(), rank_, size_, form == PlanForm::kCompactHashed);
      msg = TagString(Tag::kCompactPlan) + EncodeCompactSavePlan(split_);
    } else {
      msg = TagString(Tag::kFullPlan) + (cache_ ? my_local_ : EncodeSavePlan(LocalPlan()));
    }
    stats_.plan_bytes_sent += msg.size();
    ++stats_.plan_rounds;
    return msg;
  }

  // Coordinator: merge every rank's plan message (see Plan for the forms).
  std::vector<std::string> MergePlans(std::vector<std::string>& locals) {
    size_t compact_ranks = 0;
    for (const auto& m : locals) {
      if (!HasTag(m, Tag::kCompactPlan) && !HasTag(m, Tag::kFullPlan)) {
        throw InternalError("a save plan message of unknown form");
      }
      compact_ranks += HasTag(m, Tag::kCompactPlan);
    }
    if (compact_ranks == locals.size()) return MergeCompact(locals);
    if (compact_ranks == 0) return MergeFull(locals);
    return std::vector<std::string>(locals.size(), TagString(Tag::kRetryFull));
  }

  std::vector<std::string> MergeFull(std::vector<std::string>& locals) {
    // Per-rank decoding and encoding grow with the world: spread them over threads, and free
    // each message as soon as it is decoded (or each plan once encoded).
    std::vector<SavePlan> plans(locals.size());
    ParallelFor(locals.size(), [&](size_t r) {
      plans[r] = DecodeSavePlan(std::string_view(locals[r]).substr(1));
      std::string().swap(locals[r]);
    });
    auto [global_plans, md] = planner_.CreateGlobalPlan(std::move(plans));
    return ReplyPlans(std::move(global_plans), std::move(md), Tag::kFullPlan);
  }

  std::vector<std::string> MergeCompact(std::vector<std::string>& locals) {
    std::vector<CompactSavePlan> got(locals.size());
    ParallelFor(locals.size(), [&](size_t r) {
      got[r] = DecodeCompactSavePlan(std::string_view(locals[r]).substr(1), static_cast<int>(r));
      std::string().swap(locals[r]);
    });
    CompactMerge merged = MergeCompactPlans(default_planner_, my_full_, split_, std::move(got));
    if (merged.outcome != RegularAgreement::kAgreed) {
      return std::vector<std::string>(
          static_cast<size_t>(size_),
          TagString(merged.outcome == RegularAgreement::kDeclarationsDiffer ? Tag::kRetryDeclared
                                                                            : Tag::kRetryFull));
    }
    return ReplyPlans(std::move(merged.plans), std::move(merged.md), Tag::kCompactPlan);
  }

  // Coordinator: cache the global plans and metadata skeleton, have the writer name the files,
  // and encode each rank's reply (`tag`, the plan id with a cache, the plan).
  std::vector<std::string> ReplyPlans(std::vector<SavePlan> global_plans, Metadata md, Tag tag) {
    if (writer_.WritesFileIndexes()) {
      AssignWriters(md, global_plans);
      expected_items_ = ExpectedItemsPerRank(md, global_plans);
    }
    if (cache_) {
      cache_->entry.global_plans = global_plans;
      cache_->entry.skeleton = md;
    }
    global_plans = writer_.PrepareGlobalPlan(std::move(global_plans));
    if (global_plans.size() != static_cast<size_t>(size_)) {
      throw InternalError("the storage writer returned " + std::to_string(global_plans.size()) +
                          " plans for " + std::to_string(size_) + " ranks");
    }
    global_md_ = std::move(md);
    const uint64_t plan_id = std::stoull(NewSaveId(), nullptr, 16);
    std::vector<std::string> out(global_plans.size());
    ParallelFor(global_plans.size(), [&](size_t r) {
      out[r] = TagString(tag) + (cache_ ? PackId(plan_id) : std::string()) +
               EncodeSavePlan(global_plans[r]);
      global_plans[r] = SavePlan();
    });
    return out;
  }

  // Takes this rank's central plan from the coordinator's reply; false when the coordinator
  // asked for another attempt (and `form` is the form to try next).
  bool AcceptPlanReply(const std::string& reply, PlanForm& form) {
    if (reply.empty()) throw InternalError("empty save plan reply");
    const bool compact = form != PlanForm::kFull;
    const std::string_view body = std::string_view(reply).substr(1);
    const size_t id_bytes = cache_ ? 8 : 0;
    if (HasTag(reply, Tag::kRetryFull)) {
      form = PlanForm::kFull;
      return false;
    }
    if (HasTag(reply, Tag::kRetryDeclared)) {
      if (form != PlanForm::kCompactHashed)
        throw InternalError("save plan reply of the wrong form");
      form = PlanForm::kCompact;
      return false;
    }
    if (HasTag(reply, Tag::kCompactPlan) && compact) {
      central_ = RebuildGlobalPlan(my_full_, split_, DecodeSavePlan(body.substr(id_bytes)), rank_);
      stats_.compact_plan = true;
      stats_.regular_items = split_.regular.size();
    } else if (HasTag(reply, Tag::kFullPlan) && !compact) {
      central_ = DecodeSavePlan(body.substr(id_bytes));
    } else {
      throw InternalError("save plan reply of the wrong form");
    }
    RememberPlan(body);
    return true;
  }

  // What the plan cache keeps of a plan that came from the coordinator.
  void RememberPlan(std::string_view reply) {
    if (!cache_) return;
    if (reply.size() < 8) throw InternalError("save plan reply without its plan id");
    SavePlanCache::Entry& e = cache_->entry;
    e.valid = true;
    e.hash = my_hash_;
    e.plan_id = UnpackId(reply);
    e.world_size = size_;
    e.planner = planner_type_;
    e.central = central_;
  }

  // Every rank writes its items; the coordinator commits the metadata (the phase that decides
  // the save's outcome) and every rank gets it back.
  void WriteAndCommit() {
    SavePlan plan;
    md_bytes_ = RunPhase(
        comm_, "save/write",
        [&] {
          plan = planner_.FinishPlan(std::move(central_));
          std::vector<WriteResult> results = writer_.WriteData(plan, planner_).get();
          if (!writer_.WritesFileIndexes()) return EncodeWriteResults(results);
          // Version 2: where each item lies stays in this rank's files' indexes; the
          // coordinator gets the files only.
          if (results.size() != plan.items.size()) {
            throw InternalError("the storage writer reported " + std::to_string(results.size()) +
                                " results for " + std::to_string(plan.items.size()) + " items");
          }
          return EncodeDataFiles(writer_.TakeDataFiles());
        },
        [&](std::vector<std::string> locals) { return Commit(locals); },
        /*decides_commit=*/true, /*same_reply=*/true);
  }

  // Coordinator: complete the metadata with every rank's write results and have the writer
  // commit it.
  std::vector<std::string> Commit(std::vector<std::string>& locals) {
    global_md_.checkpoint_id =
        options_.checkpoint_id.empty() ? writer_.uri() : options_.checkpoint_id;
    global_md_.save_id = sctx_.save_id;
    global_md_.world_size = size_;
    global_md_.created_unix_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::system_clock::now().time_since_epoch())
                                     .count();
    global_md_.library_version = DCP_VERSION_STRING;
    if (writer_.WritesFileIndexes()) {
      global_md_.format_version = writer_.FileIndexFormatVersion();
      global_md_.files.clear();
      for (size_t r = 0; r < locals.size(); ++r) {
        // The items each rank's indexes list must be those its plan gave it (a count check:
        // where they lie is the rank's own business, but a rank that wrote more or fewer items
        // than the metadata expects of it would commit a checkpoint that cannot load).
        uint64_t items = 0;
        for (DataFile& f : DecodeDataFiles(locals[r], static_cast<int>(r))) {
          items += (f.index_length - std::min(f.index_length, kFileIndexHeaderBytes)) /
                   FileIndexItemBytes(global_md_.format_version);
          global_md_.files.push_back(std::move(f));
        }
        if (r < expected_items_.size() && items != expected_items_[r]) {
          throw InternalError("rank " + std::to_string(r) + " indexed " + std::to_string(items) +
                              " items, its plan gave it " + std::to_string(expected_items_[r]));
        }
        std::string().swap(locals[r]);
      }
      // Index copies past the budget (from a writer that ignored its share) are all dropped:
      // a load reads the index of a file without a copy from the file, one round trip more.
      uint64_t copies = 0;
      for (const DataFile& f : global_md_.files) copies += f.index_copy.size();
      if (copies > kMetadataIndexCopyBytes) {
        for (DataFile& f : global_md_.files) std::string().swap(f.index_copy);
      }
      writer_.Finish(global_md_, {});
    } else if (writer_.FinishTakesFilledStorage()) {
      global_md_.format_version = 1;
      // Each result moves from its rank's payload into the metadata (never all of them decoded
      // beside the map they fill: at thousands of ranks that was most of the coordinator's
      // memory).
      FillStorageFromEncoded(global_md_, locals);
      writer_.Finish(global_md_, {});
    } else {
      global_md_.format_version = 1;
      std::vector<std::vector<WriteResult>> results(locals.size());
      ParallelFor(locals.size(), [&](size_t r) {
        results[r] = DecodeWriteResults(locals[r]);
        std::string().swap(locals[r]);
      });
      writer_.Finish(global_md_, results);
    }
    committed_ = true;
    std::vector<std::string> reply{EncodeMetadata(global_md_)};
    global_md_ = Metadata();  // every rank, this one too, decodes the reply
    return reply;
  }

  const StateDict& state_dict_;
  StorageWriter& writer_;
  Communicator& comm_;
  const SaveOptions& options_;
  const int rank_, size_;
  DefaultSavePlanner default_planner_;
  SavePlanner& planner_;
  const std::string planner_type_;
  SavePlanCache* cache_;
  CommunicatorExchange exchange_;
  StorageContext sctx_;  // its save id is set from the operation's id once it is open
  SaveStats stats_;
  SavePlan my_full_;  // this rank's local plan (LocalPlan)
  bool have_local_ = false;
  std::string my_local_;  // with a plan cache: the local plan, encoded, and its hash
  uint64_t my_hash_ = 0;
  PlanSplit split_;     // compact planning: this rank's plan split into regular and other items
  SavePlan central_;    // this rank's plan from the coordinator
  Metadata global_md_;  // built on the coordinator
  std::vector<uint64_t> expected_items_;  // coordinator, version 2: items each rank writes
  std::string md_bytes_;                  // the committed metadata, as every rank received it
  bool committed_ = false;                // the coordinator's Finish committed
};

}  // namespace

SaveResult RunSave(const StateDict& state_dict, StorageWriter& writer, Communicator& comm,
                   const SaveOptions& options) {
  return SaveOperation(state_dict, writer, comm, options).Run();
}

}  // namespace dcp::protocol
