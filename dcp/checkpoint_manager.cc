#include "dcp/checkpoint_manager.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <set>

#include "dcp/checkpoint_files.h"
#include "dcp/proto/error.h"
#include "dcp/storage/checkpoint/store_checkpoint.h"
#include "dcp/storage/format/layout.h"
#include "dcp/storage/registry.h"

namespace dcp {

namespace {

constexpr char kStepPrefix[] = "step-";

// Suffix of a step's index entry in the root store (see checkpoint_manager.h).
constexpr char kMarkerSuffix[] = ".step";

// The step of "step-<n>" (a step's location, seen as a directory entry on file://) or of
// "step-<n>.step" (its index entry, on every backend).
std::optional<int64_t> ParseStep(std::string name) {
  const std::string suffix = kMarkerSuffix;
  if (name.size() > suffix.size() &&
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
    name.resize(name.size() - suffix.size());
  }
  if (name.rfind(kStepPrefix, 0) != 0 || name.size() == sizeof(kStepPrefix) - 1)
    return std::nullopt;
  int64_t v = 0;
  for (size_t i = sizeof(kStepPrefix) - 1; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || v > (INT64_MAX - 9) / 10) return std::nullopt;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

// The step the "latest" file names, if it exists and names one.
std::optional<int64_t> LatestFileStep(Store& root) {
  // A step number: a longer file is not one this manager wrote.
  constexpr uint64_t kMaxLatestBytes = 64;
  const std::optional<uint64_t> size = root.Size("latest");
  if (!size || *size > kMaxLatestBytes) return std::nullopt;
  const std::string text = root.ReadAll("latest", kMaxLatestBytes);
  int64_t step = 0;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, step);
  if (ec != std::errc() || p == text.data()) return std::nullopt;
  return step;
}

std::string StepName(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "%s%010lld", kStepPrefix, static_cast<long long>(step));
  return name;
}

std::string Encode(const std::vector<int64_t>& v) {
  std::string s;
  for (int64_t x : v) s += std::to_string(x) + ",";
  return s;
}

std::vector<int64_t> Decode(const std::string& s) {
  std::vector<int64_t> v;
  size_t p = 0;
  while (p < s.size()) {
    size_t c = s.find(',', p);
    v.push_back(std::stoll(s.substr(p, c - p)));
    p = c + 1;
  }
  return v;
}

// A manager collective's name with its step: ranks that disagree about the step (one skipped a
// save) fail on the mismatch instead of pairing.
std::string StepTag(const char* what, int64_t step) {
  return std::string(what) + " step=" + std::to_string(step);
}

// What is left until `deadline`, at least 1 ms (a communicator's timeout).
std::chrono::milliseconds Left(std::chrono::steady_clock::time_point deadline) {
  return std::max(std::chrono::milliseconds(1),
                  std::chrono::duration_cast<std::chrono::milliseconds>(
                      deadline - std::chrono::steady_clock::now()));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// CheckpointManager

struct CheckpointManager::StepScan {
  std::vector<int64_t> complete;                            // ascending
  std::vector<std::pair<int64_t, std::string>> unreadable;  // ascending, with why
  std::vector<int64_t> absent;                              // ascending

  std::string Encode() const {
    std::string out = dcp::Encode(complete) + ";";
    for (const auto& [step, why] : unreadable) out += std::to_string(step) + ",";
    out += ";";
    for (const auto& [step, why] : unreadable) {
      out += std::to_string(why.size()) + ":" + why;
    }
    return out;
  }
  static StepScan Decode(const std::string& s) {
    StepScan scan;
    const size_t a = s.find(';');
    const size_t b = s.find(';', a + 1);
    if (a == std::string::npos || b == std::string::npos) {
      throw InternalError("malformed step scan from rank 0");
    }
    scan.complete = dcp::Decode(s.substr(0, a));
    size_t p = b + 1;
    for (int64_t step : dcp::Decode(s.substr(a + 1, b - a - 1))) {
      const size_t colon = s.find(':', p);
      if (colon == std::string::npos) throw InternalError("malformed step scan from rank 0");
      const size_t n = std::stoull(s.substr(p, colon - p));
      scan.unreadable.emplace_back(step, s.substr(colon + 1, n));
      p = colon + 1 + n;
    }
    return scan;
  }
};

CheckpointManager::CheckpointManager(std::string root, Communicator& comm,
                                     std::unique_ptr<Communicator> background_comm,
                                     ManagerOptions options)
    : root_(std::move(root)), comm_(&comm), options_(std::move(options)) {
  // Any Store backend (file://, mem://, registered ones); OpenStore names the registered
  // schemes when this one is unknown or is not Store based.
  OpenStore(root_);
  if (options_.keep_last < 1) throw InvalidArgumentError("keep_last must be at least 1");
  if (options_.keep_every < 0) throw InvalidArgumentError("keep_every must not be negative");
  // The manager decides these per step; a value here would be silently replaced.
  if (options_.save.step) {
    throw InvalidArgumentError(
        "ManagerOptions::save.step: the manager passes each Save's step itself; leave it unset");
  }
  if (options_.save.storage.overwrite) {
    throw InvalidArgumentError(
        "ManagerOptions::save.storage.overwrite: the manager replaces a step only with "
        "ManagerOptions::allow_replacing_steps");
  }
  if (options_.incremental) {
    // The same checks a save would make, before the first step.
    StorageOptions probe = options_.save.storage;
    probe.content_hashes = true;
    LayoutFor(probe.format).ValidateWriteOptions(probe, root_);
  }
  if (options_.memory_tier) {
    if (options_.memory_every < 1 || options_.durable_every < 1) {
      throw InvalidArgumentError("ManagerOptions::memory_every and durable_every must be >= 1");
    }
    // The tier's steps belong to this job: its durable root, as the store spells it (a relative
    // path and its absolute form are one root), so a restart on the root finds them and a job on
    // another root never sees them.
    if (options_.memory_tier->owner.empty()) options_.memory_tier->owner = OpenStore(root_)->uri();
    // The tier saves in the background itself, on the background communicator.
    tier_ = std::make_unique<MemoryTier>(comm, *options_.memory_tier, std::move(background_comm),
                                         options_.async);
    return;
  }
  if (background_comm) {
    saver_ = std::make_unique<AsyncCheckpointer>(std::move(background_comm), options_.async);
  }
}

CheckpointManager::~CheckpointManager() { Close(); }  // reports on stderr, never throws

AsyncCheckpointer* CheckpointManager::background_saver() const {
  if (saver_) return saver_.get();
  return tier_ ? tier_->background_saver() : nullptr;
}

std::string CheckpointManager::PathFor(int64_t step) const {
  return JoinUri(root_, StepName(step));
}

std::vector<int64_t> CheckpointManager::KnownSteps() const {
  std::set<int64_t> steps;
  for (const auto& name : OpenStore(root_)->List()) {  // an absent root lists nothing
    if (auto step = ParseStep(name)) steps.insert(*step);
  }
  return {steps.begin(), steps.end()};
}

CheckpointManager::StepScan CheckpointManager::ScanSteps() const {
  StepScan scan;
  for (int64_t step : KnownSteps()) {
    const std::string path = PathFor(step);
    try {
      ReadMetadata(path);  // present and valid: complete
      scan.complete.push_back(step);
      continue;
    } catch (const NotFoundError& e) {
      // Absent only when the store says so itself; a read that failed otherwise proves nothing.
      try {
        if (!DetectLayout(*OpenStore(path))) {
          scan.absent.push_back(step);
          continue;
        }
        scan.unreadable.emplace_back(step, e.what());
      } catch (const Error& probe) {
        scan.unreadable.emplace_back(step, probe.what());
      }
    } catch (const Error& e) {
      // An I/O error, a damaged file, a newer format: possibly a committed checkpoint.
      scan.unreadable.emplace_back(step, e.what());
    }
  }
  return scan;
}

CheckpointManager::StepScan CheckpointManager::Scan() {
  return StepScan::Decode(
      OnCoordinator(*comm_, "manager/scan", [&] { return ScanSteps().Encode(); }));
}

void CheckpointManager::RemoveStep(int64_t step, bool only_if_uncommitted,
                                   const std::set<std::string>& shared) {
  if (!RemoveCheckpointFiles(PathFor(step), only_if_uncommitted, shared)) {
    // It committed meanwhile (a checkpoint now), or kept steps share some of its files: its
    // index entry stays, so a later retention finds it again.
    return;
  }
  OpenStore(root_)->Remove(StepName(step) + kMarkerSuffix);  // last: the step stays findable
}

std::vector<int64_t> CheckpointManager::CompleteSteps() {
  if (!tier_) return Scan().complete;
  // The tier's steps count too: what Restore may load. A save in flight ends first (the tier's
  // listing would wait for it anyway), raising its error.
  Wait();
  std::set<int64_t> steps;
  for (int64_t s : Scan().complete) steps.insert(s);
  for (int64_t s : tier_->CompleteSteps()) steps.insert(s);
  return {steps.begin(), steps.end()};
}

std::optional<int64_t> CheckpointManager::LatestStep() {
  auto steps = CompleteSteps();
  if (steps.empty()) return std::nullopt;
  return steps.back();
}

void CheckpointManager::AfterSaveEnded(int64_t step) {
  try {
    Retain(step);
  } catch (const Error& e) {
    // Bookkeeping failed, the save did not: report it on its own and carry on (the next
    // retention retries; an over-kept step costs space, never data).
    ++retention_failures_;
    if (last_retention_error_ != e.what()) {
      std::fprintf(stderr,
                   "dcp: CheckpointManager retention failed (the checkpoints are intact): %s\n",
                   e.what());
    }
    last_retention_error_ = e.what();
  }
}

std::map<std::string, std::set<std::string>> CheckpointManager::SharedFiles(
    const std::vector<int64_t>& steps) const {
  std::map<std::string, std::set<std::string>> shared;
  for (int64_t s : steps) {
    for (const DataFile& f : ReadMetadata(PathFor(s)).files) {
      for (const DataFileReference& r : f.references) {
        // "../<step>/<file>" (validated when the metadata was read).
        const size_t slash = r.name.find('/', 3);
        shared[r.name.substr(3, slash - 3)].insert(r.name.substr(slash + 1));
      }
    }
  }
  return shared;
}

void CheckpointManager::Retain(int64_t step) {
  const std::string reply = OnCoordinator(*comm_, StepTag("manager/retention", step), [&] {
    const StepScan scan = ScanSteps();
    const auto& complete = scan.complete;
    // One step that cannot be removed does not keep the others: the first error is reported
    // after trying them all. A step another writer holds locked is live, not an error.
    std::string first_error;
    int failed = 0;
    // Data files that kept steps share (incremental steps) stay when their own step goes. With
    // an unreadable step (whose references are unknown) every removed step keeps its data.
    // `retire_only`: remove the step's metadata (it stops being a checkpoint), not its data.
    std::map<std::string, std::set<std::string>> shared;
    bool keep_all_data = !scan.unreadable.empty();
    auto remove = [&](int64_t s, bool only_if_uncommitted, bool retire_only) {
      try {
        std::set<std::string> keep;
        if (keep_all_data || retire_only) {
          for (const auto& name : OpenStore(PathFor(s))->List()) {
            if (IsAnyDataFile(name)) keep.insert(name);
          }
        } else if (auto it = shared.find(StepName(s)); it != shared.end()) {
          keep = it->second;
        }
        RemoveStep(s, only_if_uncommitted, keep);
        return true;
      } catch (const LockedError&) {
      } catch (const Error& e) {
        if (failed++ == 0) first_error = e.what();
      }
      return false;
    };
    if (!complete.empty()) {
      const int64_t newest = complete.back();
      std::set<int64_t> keep(complete.end() - std::min<size_t>(complete.size(), options_.keep_last),
                             complete.end());
      keep.insert(newest);
      // "latest" names only a committed step, and never goes back behind a step that may be one.
      // When it cannot be written it stays behind, and so does the step it names; the rest of
      // the pass goes on (a failure is reported with the removals').
      bool latest_written = false;
      if (scan.unreadable.empty() || scan.unreadable.back().first < newest) {
        try {
          OpenStore(root_)->PublishAtomically("latest", std::to_string(newest) + "\n");
          latest_written = true;
        } catch (const Error& e) {
          if (failed++ == 0) first_error = std::string("writing latest: ") + e.what();
        }
      }
      if (!latest_written) {
        // "latest" stays behind: the step it names stays too, however many newer ones exist.
        // (A read that fails throws: this retention then removes nothing.)
        if (auto named = LatestFileStep(*OpenStore(root_))) keep.insert(*named);
      }
      for (int64_t s : complete) {
        if (options_.keep_every > 0 && s % options_.keep_every == 0) keep.insert(s);
      }
      // Two passes, so that no data file goes while a checkpoint that shares it remains: first
      // the metadata of every step that goes (one whose metadata could not be removed stays a
      // checkpoint, and what it shares stays with it), then the data files that the remaining
      // checkpoints do not share. (A save in flight shares only its base's files and what its
      // base shares, and its base is the newest complete step: kept.)
      std::set<int64_t> remaining = keep;
      std::vector<int64_t> retired;
      for (int64_t s : complete) {
        if (keep.count(s) || s == in_flight_step_) continue;
        if (remove(s, false, /*retire_only=*/true)) {
          retired.push_back(s);
        } else {
          remaining.insert(s);
        }
      }
      try {
        shared = SharedFiles({remaining.begin(), remaining.end()});
      } catch (const Error& e) {
        keep_all_data = true;  // a remaining step's references are unknown: no data file goes
        if (failed++ == 0) first_error = std::string("reading a kept step: ") + e.what();
      }
      for (int64_t s : retired) remove(s, true, false);
      // Leftovers of crashed saves (provably without metadata, older than the newest commit),
      // and the data files of earlier retired steps.
      for (int64_t s : scan.absent) {
        if (s < newest && s != in_flight_step_) remove(s, true, false);
      }
    }
    std::string removal_error;
    if (failed > 0) {
      removal_error =
          "retention under " + root_ + " failed " + std::to_string(failed) +
          " time(s) (old steps that could not be removed, or latest); first: " + first_error;
    }
    return std::to_string(removal_error.size()) + ":" + removal_error + scan.Encode();
  });
  const size_t colon = reply.find(':');
  if (colon == std::string::npos) throw InternalError("malformed retention reply from rank 0");
  const size_t n = std::stoull(reply.substr(0, colon));
  const std::string removal_error = reply.substr(colon + 1, n);
  const StepScan scan = StepScan::Decode(reply.substr(colon + 1 + n));
  unreadable_steps_.clear();
  for (const auto& [s, why] : scan.unreadable) unreadable_steps_.push_back(s);
  std::string message = removal_error;
  if (!scan.unreadable.empty()) {
    const auto& [s, why] = scan.unreadable.front();
    message += std::string(message.empty() ? "" : "; ") + "kept " +
               std::to_string(scan.unreadable.size()) + " step(s) under " + root_ +
               " whose metadata could not be read (never removed: each may be a committed "
               "checkpoint); first: step " +
               std::to_string(s) + ": " + why;
  }
  if (!message.empty()) throw IoError(message, /*retryable=*/true);
}

std::string CheckpointManager::BeginStep(int64_t step) {
  try {
    return BeginStepOnCoordinator(step);
  } catch (const CollectiveError&) {
    // Out of step with rank 0 (or poisoned before): the peers' background savers start this
    // step's save without this rank; tell them too, as BeginStep told the job's communicator.
    AsyncCheckpointer* saver = background_saver();
    if (saver != nullptr && comm_->poisoned()) saver->Abandon(comm_->poison_reason());
    throw;
  }
}

std::string CheckpointManager::BeginStepOnCoordinator(int64_t step) {
  // The step's index entry goes in before any of its data, so that a crash leaves a step the
  // next retention can find and remove on every backend (a Store cannot list "folders").
  return OnCoordinator(*comm_, StepTag("manager/begin", step), [&] {
    // Steps increase across restarts: what the store holds counts, not only this process.
    // Only steps at or after this one are read (usually none), newest first.
    const std::vector<int64_t> known = KnownSteps();
    for (auto it = known.rbegin(); it != known.rend() && *it >= step; ++it) {
      const int64_t s = *it;
      std::string state;
      try {
        ReadMetadata(PathFor(s));
        state = "complete";
      } catch (const NotFoundError&) {
        if (!DetectLayout(*OpenStore(PathFor(s)))) continue;  // a crashed attempt
        state = "present but unreadable";
      } catch (const Error& e) {
        state = std::string("unreadable (") + e.what() + ")";
      }
      if (s > step) {
        throw InvalidArgumentError("checkpoint steps must increase: step " + std::to_string(step) +
                                   " is older than step " + std::to_string(s) + " (" + state +
                                   ") in " + root_);
      }
      if (!options_.allow_replacing_steps) {
        throw AlreadyExistsError("step " + std::to_string(step) + " already exists in " + root_ +
                                 " (" + state +
                                 "); set ManagerOptions::allow_replacing_steps to replace it");
      }
    }
    std::shared_ptr<Store> root = OpenStore(root_);
    root->CreateRoot();
    root->PublishAtomically(StepName(step) + kMarkerSuffix, PathFor(step) + "\n");
    if (!options_.incremental) return std::string();
    // The base: the newest complete step before this one (a step whose metadata does not read
    // is passed over; the save then shares with an older one, or with none).
    for (auto it = known.rbegin(); it != known.rend(); ++it) {
      if (*it >= step) continue;
      try {
        ReadMetadata(PathFor(*it));
        return StepName(*it);
      } catch (const Error&) {
      }
    }
    return std::string();
  });
}

std::shared_ptr<AsyncSave> CheckpointManager::Save(int64_t step, const StateDict& state) {
  if (closed_) throw InvalidArgumentError("CheckpointManager is closed");
  if (step < 0) throw InvalidArgumentError("checkpoint steps are non-negative");
  if (step <= last_step_) {
    throw InvalidArgumentError("checkpoint steps must increase: " + std::to_string(step) +
                               " after " + std::to_string(last_step_));
  }
  Wait();
  if (tier_) return SaveThroughTier(step, state);
  return SaveToRoot(step, state);
}

std::shared_ptr<AsyncSave> CheckpointManager::SaveToRoot(int64_t step, const StateDict& state) {
  const std::string base = BeginStep(step);
  last_step_ = step;
  SaveOptions so = options_.save;
  so.storage.overwrite = true;  // checked by BeginStep: only a crashed attempt is overwritten
  so.step = step;
  if (options_.incremental) {
    so.storage.content_hashes = true;
    so.storage.incremental_base = base;
  }
  if (AsyncCheckpointer* saver = background_saver()) {
    in_flight_step_ = step;
    in_flight_ = saver->Save(state, PathFor(step), so);
    return in_flight_;
  }
  // Synchronous: a finished handle, for a uniform return type.
  in_flight_step_ = step;
  const auto t0 = std::chrono::steady_clock::now();
  Metadata md;
  try {
    md = dcp::Save(state, PathFor(step), *comm_, so).metadata;
  } catch (...) {
    in_flight_step_ = -1;
    throw;
  }
  SaveMetrics m;
  m.uri = PathFor(step);
  m.blocking_s = m.background_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  m.bytes_written = md.TotalStoredBytes();
  in_flight_step_ = -1;
  AfterSaveEnded(step);
  return AsyncSave::Completed(std::move(md), std::move(m));
}

// A step to memory, and to the root when due: the tier's save, then the durable copy under the
// root (both in the background when the tier has a background communicator). A durable step is
// entered in the root's index first, as every managed save is. The durable copy honours the
// root's storage options: a copy of the tier's files where they are what those options write,
// else a save of the state (another format, compression). Where the tier cannot save (fewer
// nodes than its replicas need), durable steps are saved to the root directly and the others
// skipped, said once.
std::shared_ptr<AsyncSave> CheckpointManager::SaveThroughTier(int64_t step,
                                                              const StateDict& state) {
  const bool durable = step % options_.durable_every == 0;
  const bool memory = durable || step % options_.memory_every == 0;
  if (!memory) {
    last_step_ = step;
    return AsyncSave::Completed(Metadata{}, SaveMetrics{});
  }
  if (!tier_->save_refusal().empty()) {
    if (!told_tier_refusal_ && comm_->rank() == 0) {
      std::fprintf(stderr,
                   "dcp: CheckpointManager: %s. Durable steps (multiples of %d) are saved to %s "
                   "directly; the other steps are not saved.\n",
                   tier_->save_refusal().c_str(), options_.durable_every, root_.c_str());
    }
    told_tier_refusal_ = true;
    if (!durable) {
      last_step_ = step;
      return AsyncSave::Completed(Metadata{}, SaveMetrics{});
    }
    return SaveToRoot(step, state);
  }
  last_step_ = step;
  const std::string base = durable ? BeginStep(step) : std::string();
  // The tier writes dcp's own layout to shared memory, laid out as the root's would be (files
  // per rank, metadata version) so that a copy of it is the durable checkpoint.
  SaveOptions so = options_.save;
  so.storage = StorageOptions{};
  so.storage.files_per_rank = options_.save.storage.files_per_rank;
  so.storage.metadata_version = options_.save.storage.metadata_version;
  SaveOptions durable_options = options_.save;
  durable_options.storage.overwrite = true;  // checked by BeginStep (allow_replacing_steps)
  durable_options.step = step;
  if (options_.incremental) {
    // The durable copy is a save of the state against the previous durable step (a copy of
    // the tier's files would hold every item): MemoryTier::DrainCopies says no.
    durable_options.storage.content_hashes = true;
    durable_options.storage.incremental_base = base;
  }
  const std::string drain_to = durable ? PathFor(step) : std::string();
  in_flight_step_ = durable ? step : -1;
  in_flight_in_tier_ = true;
  if (tier_->saves_in_background()) {
    try {
      in_flight_ = tier_->SaveAsync(step, state, so, drain_to, durable_options);
    } catch (...) {
      in_flight_in_tier_ = false;
      in_flight_step_ = -1;
      throw;
    }
    return in_flight_;
  }
  // No background communicator: synchronous.
  const auto t0 = std::chrono::steady_clock::now();
  Metadata md;
  try {
    md = tier_->Save(step, state, so).metadata;
    if (durable) {
      if (MemoryTier::DrainCopies(durable_options.storage)) {
        tier_->Drain(step, drain_to, durable_options.storage);
      } else {
        dcp::Save(state, drain_to, *comm_, durable_options);
      }
    }
  } catch (...) {
    in_flight_in_tier_ = false;
    in_flight_step_ = -1;
    if (durable && !comm_->poisoned()) AfterSaveEnded(step);
    throw;
  }
  in_flight_in_tier_ = false;
  in_flight_step_ = -1;
  SaveMetrics m;
  m.uri = durable ? drain_to : tier_->StepDirectory(step);
  m.blocking_s = m.background_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  m.bytes_written = md.TotalStoredBytes();
  if (durable) AfterSaveEnded(step);
  return AsyncSave::Completed(std::move(md), std::move(m));
}

void CheckpointManager::Wait() {
  if (!in_flight_) return;
  std::shared_ptr<AsyncSave> s = std::move(in_flight_);
  in_flight_.reset();
  std::exception_ptr error;
  try {
    if (in_flight_in_tier_) {
      tier_->Wait();
    } else {
      background_saver()->Wait();
    }
  } catch (...) {
    error = std::current_exception();
  }
  in_flight_in_tier_ = false;
  const int64_t step = in_flight_step_;
  in_flight_step_ = -1;
  // Also after a failure: tidies the attempt. (A memory-only step has no durable bookkeeping.)
  if (step >= 0 && !comm_->poisoned()) AfterSaveEnded(step);
  if (error) std::rethrow_exception(error);
}

std::optional<int64_t> CheckpointManager::Restore(StateDict& state, const LoadOptions& options) {
  Wait();
  restore_fallbacks_.clear();
  restore_source_.clear();
  const StepScan scan = Scan();
  std::vector<int64_t> candidates = scan.complete;
  for (const auto& [s, why] : scan.unreadable) candidates.push_back(s);
  std::sort(candidates.rbegin(), candidates.rend());
  if (tier_) {
    // Memory first when it holds a step at least as new as the root's newest: every rank
    // decides alike (CompleteSteps is collective).
    const auto in_memory = tier_->CompleteSteps();
    if (!in_memory.empty() && (candidates.empty() || in_memory.back() >= candidates.front())) {
      try {
        if (auto step = tier_->Restore(state, options)) {
          restore_source_ = "memory";
          last_step_ = std::max(last_step_, *step);
          return step;
        }
      } catch (const CollectiveError& e) {
        if (comm_->poisoned()) throw;
        restore_fallbacks_.push_back("memory tier: " + std::string(e.what()));
      }
    }
  }
  std::exception_ptr newest_error;
  for (int64_t step : candidates) {
    try {
      dcp::Load(state, PathFor(step), *comm_, options);
      restore_source_ = "durable";
      if (!restore_fallbacks_.empty()) {
        std::fprintf(stderr, "dcp: CheckpointManager restored step %lld of %s instead of %s\n",
                     static_cast<long long>(step), root_.c_str(),
                     restore_fallbacks_.front().c_str());
      }
      return step;
    } catch (const CollectiveError& e) {
      if (!newest_error) newest_error = std::current_exception();
      if (comm_->poisoned()) std::rethrow_exception(newest_error);
      restore_fallbacks_.push_back("step " + std::to_string(step) + ": " + e.what());
    }
  }
  if (newest_error) std::rethrow_exception(newest_error);
  return std::nullopt;
}

void CheckpointManager::ReplaceCommunicator(Communicator& comm,
                                            std::unique_ptr<Communicator> background_comm) {
  if (closed_) throw InvalidArgumentError("CheckpointManager is closed");
  if (saver_ && !background_comm) {
    throw InvalidArgumentError(
        "ReplaceCommunicator: this manager saves asynchronously and needs a new background "
        "communicator too");
  }
  // The preemption handler drains from the tier about to be replaced: it ends here (a drain
  // under way first) and HandlePreemption takes the new communicators' one.
  StopPreemptionHandler();
  preemption_.reset();
  in_flight_.reset();  // its outcome is the old saver's to report, below
  in_flight_step_ = -1;
  in_flight_in_tier_ = false;
  comm_ = &comm;
  if (tier_) {
    // The tier is bound to its communicators: a new one over the new communicators, on the
    // same shared memory (the old one's steps stay; its save in flight ends first).
    tier_.reset();
    tier_ = std::make_unique<MemoryTier>(comm, *options_.memory_tier, std::move(background_comm),
                                         options_.async);
  }
  std::exception_ptr error;
  if (saver_) {
    std::unique_ptr<AsyncCheckpointer> old = std::move(saver_);
    saver_ = std::make_unique<AsyncCheckpointer>(std::move(background_comm), options_.async);
    try {
      old->Close();
    } catch (...) {
      error = std::current_exception();
    }
  }
  // The new communicator's first collective: every rank has switched.
  comm_->Barrier("manager/replace-communicator");
  if (error) std::rethrow_exception(error);
}

void CheckpointManager::CloseOrThrow() {
  if (closed_) return;
  closed_ = true;
  StopPreemptionHandler();  // a drain under way ends first (by its deadline)
  std::exception_ptr error;
  try {
    Wait();
  } catch (...) {
    error = std::current_exception();
  }
  if (saver_) {
    try {
      saver_->Close();
    } catch (...) {
      if (!error) error = std::current_exception();  // the save's own error comes first
    }
  }
  if (tier_ && !comm_->poisoned()) {
    try {
      tier_->Close();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

// Every rank: stop the tier's commits, wait for one under way, agree on the newest committed
// step, and copy it to the root unless a drain already did. A step with an index entry and no
// metadata at the root (a drain that failed midway) is what a crashed save leaves: retention
// removes it later.
void CheckpointManager::DrainOnPreemption(Communicator& comm,
                                          std::chrono::steady_clock::time_point commits_until,
                                          std::chrono::steady_clock::time_point deadline,
                                          PreemptionReport& report) {
  const int64_t before = tier_->BeginPreemption(commits_until);
  if (commits_until > std::chrono::steady_clock::now()) {
    tier_->WaitForCommitAfter(before, commits_until);  // the next step boundary's commit
  }
  MemoryTier::SettledStep mine = tier_->SettleForPreemption(deadline);
  comm.set_timeout(Left(deadline));
  const std::string said =
      !mine.settled ? std::string("unsettled")
                    : std::to_string(mine.step) + (mine.drained_to.empty() ? ",0" : ",1");
  const std::vector<std::string> all = comm.AllGather(said, "manager/preempt");
  std::vector<RankFailure> disagreement;
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    if (all[r] == "unsettled") {
      disagreement.push_back({r, ErrorCode::kTimeout,
                              "a commit or drain of the memory tier did not end within the "
                              "grace period",
                              false});
    } else if (all[r] != all[0]) {
      disagreement.push_back(
          {r, ErrorCode::kInternal,
           "reports newest committed step " + all[r] + " where rank 0 reports " + all[0], false});
    }
  }
  if (!disagreement.empty()) throw CollectiveError("manager/preempt", std::move(disagreement));
  // Every rank settled on no step of its own: the job has not restored from memory yet (or its
  // restore began too late to count), and the newest step the tier holds may be newer than any
  // durable one.
  if (mine.step < 0) mine = tier_->AdoptNewestHeld(comm);
  report.step = mine.step;
  if (mine.step < 0) return;
  report.where = PathFor(mine.step);
  if (!mine.drained_to.empty()) return;
  // Rank 0 enters the step in the root's index first, as every managed save does; a root that
  // already holds this step or a newer one complete (an earlier run got further, or the job
  // restored from the root a step newer than memory's) is left alone, and the report names the
  // newest such step: the one a restart restores.
  const std::string durable = OnCoordinator(comm, "manager/preempt-begin", [&] {
    const std::vector<int64_t> known = KnownSteps();
    for (auto s = known.rbegin(); s != known.rend() && *s >= mine.step; ++s) {
      try {
        ReadMetadata(PathFor(*s));
        return std::to_string(*s);
      } catch (const Error&) {
      }
    }
    std::shared_ptr<Store> root = OpenStore(root_);
    root->CreateRoot();
    root->PublishAtomically(StepName(mine.step) + kMarkerSuffix, PathFor(mine.step) + "\n");
    return std::string();
  });
  if (!durable.empty()) {
    report.step = std::stoll(durable);
    report.where = PathFor(report.step);
    return;
  }
  StorageOptions storage = options_.save.storage;
  storage.overwrite = true;  // a failed earlier attempt of this step; never a complete one
  TierStats stats;
  comm.set_timeout(Left(deadline));
  tier_->DrainForPreemption(comm, mine.step, report.where, storage, stats);
  report.drained = true;
  report.bytes = stats.bytes_sent;
  if (comm.rank() == 0) {
    try {
      OpenStore(root_)->PublishAtomically("latest", std::to_string(mine.step) + "\n");
    } catch (const Error& e) {
      std::fprintf(stderr, "dcp: preemption: step %lld is committed; writing latest failed: %s\n",
                   static_cast<long long>(mine.step), e.what());
    }
  }
}

bool CheckpointManager::Close() noexcept {
  try {
    CloseOrThrow();
    return close_error_.empty();
  } catch (const std::exception& e) {
    close_error_ = e.what();
  } catch (...) {
    close_error_ = "unknown error";
  }
  std::fprintf(stderr, "dcp: CheckpointManager closed with a failed or unfinished save: %s\n",
               close_error_.c_str());
  return false;
}

}  // namespace dcp
