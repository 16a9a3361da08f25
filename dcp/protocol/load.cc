#include "dcp/protocol/load.h"

#include <algorithm>
#include <optional>
#include <string_view>

#include "dcp/planner/coop_reads.h"
#include "dcp/planner/default_planner.h"
#include "dcp/planner/read_sharing.h"
#include "dcp/planner/rule_reads.h"
#include "dcp/proto/error.h"
#include "dcp/proto/executor.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/protocol/coop_read.h"
#include "dcp/protocol/phase.h"
#include "dcp/protocol/read_once.h"
#include "dcp/protocol/rule_exchange.h"

namespace dcp::protocol {

namespace {

// One rank's part of one load, as named steps:
//   Run:  open the operation -> ExchangeMetadata -> Plan -> Read
// `load_all`: the state dict is replaced by every entry of the checkpoint (LoadAll).
class LoadOperation {
 public:
  LoadOperation(StateDict& state_dict, StorageReader& reader, Communicator& comm,
                const LoadOptions& options, bool load_all)
      : state_dict_(state_dict),
        reader_(reader),
        comm_(comm),
        options_(options),
        rank_(comm.rank()),
        size_(comm.size()),
        default_planner_(PlannerOptions(options, load_all)),
        planner_(options.planner ? *options.planner : default_planner_),
        // Read-once needs the default planner: a custom one may reorder its plan in FinishPlan
        // or do anything in CommitTensor, so its rank reads all of its own items.
        can_share_(options.read_once && options.planner == nullptr && size_ > 1) {}

  LoadResult Run() {
    OperationScope op(comm_, "load", reader_.uri());
    const std::string md_bytes = ExchangeMetadata();
    Plan(md_bytes);
    Read();
    LoadResult result;
    result.metadata = std::move(md_);
    result.stats = stats_;
    if (!options_.planner) result.unrequested_keys = default_planner_.extra_keys();
    return result;
  }

 private:
  static LoadPlannerOptions PlannerOptions(const LoadOptions& options, bool load_all) {
    LoadPlannerOptions planner_options;
    planner_options.allow_partial_load = options.allow_partial_load;
    planner_options.load_all = load_all;
    planner_options.cast_dtypes = options.cast_dtypes;
    return planner_options;
  }

  // The coordinator alone reads (and validates) the metadata; everyone else receives it: the
  // bytes of the file as read when they are its wire encoding (the dcp format), so that it is
  // not encoded again, and the coordinator keeps what it decoded instead of decoding it twice.
  std::string ExchangeMetadata() {
    return RunPhase(
        comm_, "load/metadata", [] { return std::string(); },
        [&](std::vector<std::string>) {
          Metadata md = reader_.ReadMetadata();
          std::string encoded = reader_.TakeEncodedMetadata();
          if (encoded.empty()) encoded = EncodeMetadata(md);
          coordinator_md_ = std::move(md);
          return std::vector<std::string>{std::move(encoded)};
        },
        /*decides_commit=*/false, /*same_reply=*/true);
  }

  // Every rank plans what it reads, alone. What crosses the wire is a summary of each rank's
  // request (planner/read_sharing.h: which whole-value items it reads, for read-once), and back
  // one schedule of shared reads for all: O(ranks x replicated entries) bits, never a plan, so
  // an all-to-all reshard at thousands of ranks plans in O(own reads) per rank. Only when the
  // coordinator's planner or reader has a global step that may change the plans (a custom
  // planner, a reader without GlobalPlanChangesNothing) does it answer kRetryFull, and every
  // rank sends its plan in full for that step (PlanInFull).
  void Plan(const std::string& md_bytes) {
    const std::string reply = RunPhase(
        comm_, "load/plan",
        [&] {
          if (coordinator_md_) {
            md_ = std::move(*coordinator_md_);
            coordinator_md_.reset();
          } else {
            md_ = DecodeMetadata(md_bytes, reader_.uri());
          }
          reader_.SetUp(md_, StorageContext{rank_, size_, rank_ == 0, {}, nullptr});
          planner_.SetUp(state_dict_, md_, PlannerContext{rank_, size_, rank_ == 0});
          local_ = reader_.PrepareLocalPlan(planner_.CreateLocalPlan());
          candidates_ = ShareCandidates(md_);
          candidate_items_ = CandidateItems(local_, candidates_, md_);
          summary_ = SummarizeRequest(local_, candidate_items_, md_, can_share_);
          if (can_share_ && comm_.ExchangesDirectly() && reader_.item_streamer() != nullptr) {
            SummarizeExchanges();
          }
          return CountPlanMessage(TagString(Tag::kRequestSummary) +
                                  EncodeReadRequestSummary(summary_));
        },
        [&](std::vector<std::string> summaries) { return ScheduleSharedReads(summaries); },
        /*decides_commit=*/false, /*same_reply=*/true);
    if (HasTag(reply, Tag::kRetryFull)) return PlanInFull();
    if (!HasTag(reply, Tag::kShareSchedule)) {
      throw CorruptionError("load/plan: a reply of unknown form from the coordinator");
    }
    stats_.rank_local_plan = true;
    const ShareSchedule schedule =
        DecodeShareSchedule(std::string_view(reply).substr(1), candidates_.size());
    batches_ = BatchesFor(schedule, summary_, candidate_items_, rank_);
    cooperative_ = schedule.cooperative;
    rule_exchange_ = schedule.rule_exchange;
    rule_table_ = std::move(rule_tables_[schedule.rule_ceil_first ? 1 : 0]);
    rule_tables_[0] = rule_tables_[1] = RuleReadTable();
    central_ = std::move(local_);
  }

  // A reshard between two rules is exchanged by arithmetic (rule_reads.h), never asked for piece
  // by piece: the summary carries the hashes of this rank's rule-read tables (found checking
  // either rule first), and those reads leave what cooperative reads weigh. Cooperative reads
  // pay only where partial reads fetch far more than their boxes; the rank reports how much more
  // (enough of it to pass the bar, ShouldCooperate).
  void SummarizeExchanges() {
    const uint64_t round = CoopRoundBytes(options_.storage.memory_budget_bytes);
    for (const RegularRule first : {kRuleBalanced, kRuleCeil}) {
      RuleReadTable& table = rule_tables_[first == kRuleCeil];
      table = FindRuleReads(local_, md_, rank_, size_, round, first);
      if (!CanServeRuleReads(table, reader_.item_streamer(), rank_, size_, md_.world_size)) {
        table = RuleReadTable();
      }
    }
    summary_.rule_hash = rule_tables_[0].hash;
    summary_.rule_hash_ceil_first = rule_tables_[1].hash;
    const std::vector<RuleRead>& ruled_reads = rule_tables_[0].reads;  // the same items in both
    std::vector<char> ruled(local_.items.size(), 0);
    for (const RuleRead& r : ruled_reads) ruled[r.item] = 1;
    const LoadPlan rest = ruled_reads.empty() ? LoadPlan() : WithoutItems(local_, ruled);
    summary_.coop_waste = CoopWaste(ruled_reads.empty() ? local_ : rest, md_,
                                    CoopOwners(md_, size_), options_.storage.verify_checksums,
                                    std::max(kCoopMinWaste, summary_.plan_bytes / 16));
  }

  std::string CountPlanMessage(std::string msg) {
    stats_.plan_bytes_sent += msg.size();
    ++stats_.plan_rounds;
    return msg;
  }

  // Coordinator: the read-once schedule from every rank's summary, or kRetryFull when its own
  // planner or reader must see every plan.
  std::vector<std::string> ScheduleSharedReads(std::vector<std::string>& summaries) {
    if (options_.planner != nullptr || !reader_.GlobalPlanChangesNothing()) {
      return {TagString(Tag::kRetryFull)};
    }
    std::vector<ReadRequestSummary> got(summaries.size());
    for (size_t r = 0; r < summaries.size(); ++r) {
      if (!HasTag(summaries[r], Tag::kRequestSummary)) {
        throw InternalError("load/plan: rank " + std::to_string(r) +
                            " sent a message of unknown form");
      }
      got[r] = DecodeReadRequestSummary(std::string_view(summaries[r]).substr(1),
                                        candidates_.size(), static_cast<int>(r));
      std::string().swap(summaries[r]);
    }
    ShareSchedule schedule;
    if (std::count_if(got.begin(), got.end(), [](const auto& g) { return g.can_share; }) > 1) {
      schedule = ScheduleCandidates(got, CandidateBytes(candidates_, md_),
                                    options_.storage.memory_budget_bytes);
      schedule.cooperative = ShouldCooperate(got);
      const std::optional<RegularRule> order = RuleExchangeOrder(got);
      schedule.rule_exchange = order.has_value();
      schedule.rule_ceil_first = order == kRuleCeil;
    }
    return {TagString(Tag::kShareSchedule) + EncodeShareSchedule(schedule)};
  }

  // Every plan to the coordinator, for its planner's and reader's global steps; each rank gets
  // back its plan and its read-once batches.
  void PlanInFull() {
    const std::string assignment = RunPhase(
        comm_, "load/plan-full",
        [&] { return CountPlanMessage(EncodeLocalLoadPlan(local_, can_share_)); },
        [&](std::vector<std::string> locals) { return MergePlans(locals); });
    local_ = LoadPlan();
    auto [central, batches] = DecodeLoadAssignment(assignment);
    central_ = std::move(central);
    batches_ = std::move(batches);
  }

  // Coordinator: the global plan, and the read-once batches of the ranks that share reads.
  std::vector<std::string> MergePlans(std::vector<std::string>& locals) {
    std::vector<LoadPlan> plans(locals.size());
    std::vector<char> shares(locals.size());
    ParallelFor(locals.size(), [&](size_t r) {
      auto decoded = DecodeLocalLoadPlan(locals[r]);
      plans[r] = std::move(decoded.first);
      shares[r] = decoded.second;
      std::string().swap(locals[r]);
    });
    std::vector<bool> sharing(shares.begin(), shares.end());
    plans = reader_.PrepareGlobalPlan(planner_.CreateGlobalPlan(std::move(plans)));
    std::vector<std::vector<SharedReadBatch>> batches(plans.size());
    if (std::count(sharing.begin(), sharing.end(), true) > 1) {
      batches = PlanSharedReads(plans, md_, sharing, options_.storage.memory_budget_bytes);
    }
    std::vector<std::string> out(plans.size());
    ParallelFor(plans.size(), [&](size_t r) {
      out[r] = EncodeLoadAssignment(plans[r], batches[r]);
      plans[r] = LoadPlan();
    });
    return out;
  }

  // Every rank reads its items (sharing what the batches say); the phase ends when all did.
  void Read() {
    RunPhase(
        comm_, "load/read",
        [&] {
          const LoadPlan plan = planner_.FinishPlan(std::move(central_));
          // Rule exchange, then cooperative reads: what owners serve, this rank does not read
          // itself. Their errors wait until this rank has joined the collectives below.
          RuleExchangeResult ruled;
          if (rule_exchange_) {
            ruled = ExchangeByRule(plan, md_, rule_table_, reader_, planner_, comm_,
                                   options_.storage, stats_);
          }
          const bool any_ruled =
              std::find(ruled.served.begin(), ruled.served.end(), 1) != ruled.served.end();
          const LoadPlan rest_of_plan = any_ruled ? WithoutItems(plan, ruled.served) : LoadPlan();
          const LoadPlan& rest = any_ruled ? rest_of_plan : plan;
          CoopReadResult coop;
          if (cooperative_) {
            coop = ReadCooperatively(rest, md_, reader_, planner_, comm_, options_.storage, stats_);
          }
          std::function<bool(const ReadItem&)> skip;
          if (!coop.served.empty()) {
            skip = [&](const ReadItem& item) { return coop.served.count(CoopItemKey(item)) > 0; };
          }
          if (batches_.empty()) {
            // Readers see plain items only: spans become one item per stored chunk here, a
            // bounded part at a time (each part's indexes are read before the next expands).
            ForEachExpandedPart(rest, md_, kMaxExpandedItems, [&](const LoadPlan& pieces) {
              if (!skip) return reader_.ReadData(pieces, planner_).get();
              LoadPlan rest;
              rest.storage_data = pieces.storage_data;
              rest.planner_data = pieces.planner_data;
              for (const ReadItem& item : pieces.items) {
                if (!skip(item)) rest.items.push_back(item);
              }
              if (!rest.items.empty()) reader_.ReadData(rest, planner_).get();
            });
          } else {
            ReadWithSharing(plan, md_, batches_, reader_, planner_, comm_,
                            options_.storage.memory_budget_bytes, stats_, skip, ruled.served);
          }
          if (ruled.error) std::rethrow_exception(ruled.error);
          if (coop.error) std::rethrow_exception(coop.error);
          return std::string();
        },
        [&](std::vector<std::string>) { return std::vector<std::string>(1); },
        /*decides_commit=*/false, /*same_reply=*/true);
  }

  StateDict& state_dict_;
  StorageReader& reader_;
  Communicator& comm_;
  const LoadOptions& options_;
  const int rank_, size_;
  DefaultLoadPlanner default_planner_;
  LoadPlanner& planner_;
  const bool can_share_;
  std::optional<Metadata> coordinator_md_;  // rank 0: the metadata as ReadMetadata decoded it
  Metadata md_;
  LoadPlan local_;    // this rank's plan, as its planner and reader made it
  LoadPlan central_;  // what it reads: its local plan, or the coordinator's global step's
  std::vector<MetadataIndex> candidates_;  // stored items read-once may share (ShareCandidates)
  std::vector<int32_t> candidate_items_;   // which item of local_ reads each, or -1
  ReadRequestSummary summary_;
  std::vector<SharedReadBatch> batches_;
  bool cooperative_ = false;      // the schedule says every rank reads cooperatively
  RuleReadTable rule_tables_[2];  // this rank's rule reads (rule_reads.h), kRuleBalanced or
                                  // kRuleCeil checked first; items of local_
  RuleReadTable rule_table_;      // the one the schedule chose
  bool rule_exchange_ = false;    // the schedule says every rank exchanges them
  LoadStats stats_;
};

}  // namespace

LoadResult RunLoad(StateDict& state_dict, StorageReader& reader, Communicator& comm,
                   const LoadOptions& options, bool load_all) {
  return LoadOperation(state_dict, reader, comm, options, load_all).Run();
}

}  // namespace dcp::protocol
