#include "dcp/planner/read_sharing.h"

#include <algorithm>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "dcp/proto/error.h"

namespace dcp {

namespace {

// Items that ask for the same bytes have equal keys: the stored item and the box within it.
std::string ShareKey(const ReadItem& item) {
  std::string key = item.type == ReadItemType::kBytes ? "b|" : "t|";
  key += item.storage_index.fqn;
  auto add = [&key](const Shape& s) {
    key += '|';
    for (int64_t v : s) key += std::to_string(v) + ',';
  };
  add(item.storage_index.offset);
  add(item.storage_offsets);
  add(item.lengths);
  return key;
}

struct Holder {
  int rank;
  int32_t item;
};

struct Group {
  const std::string* key;
  uint64_t bytes;
  std::vector<Holder> holders;
  int root = -1;
};

}  // namespace

uint64_t ReadItemBytes(const ReadItem& item, const Metadata& metadata) {
  if (item.type == ReadItemType::kBytes) {
    auto it = metadata.storage.find(item.storage_index);
    if (it == metadata.storage.end()) {
      // Version 2: the size is in the entry (where it lies is in a data file's index).
      auto e = metadata.entries.find(item.storage_index.fqn);
      if (e == metadata.entries.end()) return 0;
      const auto* b = std::get_if<BytesMetadata>(&e->second);
      return b ? b->size : 0;
    }
    return it->second.transforms.empty() ? it->second.length : it->second.raw_length;
  }
  auto it = metadata.entries.find(item.storage_index.fqn);
  if (it == metadata.entries.end()) return 0;
  const auto* t = std::get_if<TensorMetadata>(&it->second);
  if (t == nullptr) return 0;
  return static_cast<uint64_t>(NumElements(item.lengths)) * ElementSize(t->dtype);
}

namespace {

// The scheduler both ways of finding shared reads use. `groups` (sorted: largest first, then a
// deterministic key) each name the ranks that asked (holders, one per rank, in rank order) and
// their bytes; `load` is what each rank reads from storage beside the shared items. Each group
// goes to its least-loaded holder; each root's groups fill batches of at most `max_batch_bytes`;
// batches of all roots are taken in turns (root 0's first, root 1's first, ..., root 0's second,
// ...), so that no root's reads wait behind all of another's. Returns the batches in broadcast
// order: a root and the indices of its groups.
std::vector<std::pair<int, std::vector<size_t>>> ScheduleGroups(std::vector<Group>& groups,
                                                                std::vector<uint64_t>& load,
                                                                uint64_t max_batch_bytes) {
  for (auto& g : groups) {
    const Holder* best = &g.holders[0];
    for (const auto& h : g.holders) {
      if (load[h.rank] < load[best->rank]) best = &h;
    }
    g.root = best->rank;
    load[best->rank] += g.bytes;
  }
  std::map<int, std::vector<std::vector<size_t>>> by_root;
  std::map<int, uint64_t> used;
  for (size_t i = 0; i < groups.size(); ++i) {
    const Group& g = groups[i];
    auto& batches = by_root[g.root];
    if (batches.empty() || used[g.root] + g.bytes > max_batch_bytes) {
      batches.emplace_back();
      used[g.root] = 0;
    }
    batches.back().push_back(i);
    used[g.root] += g.bytes;
  }
  std::vector<std::pair<int, std::vector<size_t>>> out;
  for (size_t round = 0;; ++round) {
    bool any = false;
    for (auto& [root, batches] : by_root) {
      if (round >= batches.size()) continue;
      any = true;
      out.emplace_back(root, std::move(batches[round]));
    }
    if (!any) break;
  }
  return out;
}

void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}
void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}

// Reads little-endian integers from an untrusted message; every read is bounds-checked.
class Cursor {
 public:
  Cursor(std::string_view bytes, std::string what) : bytes_(bytes), what_(std::move(what)) {}
  uint64_t U64() { return Take(8); }
  uint32_t U32() { return static_cast<uint32_t>(Take(4)); }
  uint8_t U8() { return static_cast<uint8_t>(Take(1)); }
  std::string_view Rest(size_t n) {
    if (bytes_.size() - pos_ < n) Fail("truncated");
    auto v = bytes_.substr(pos_, n);
    pos_ += n;
    return v;
  }
  size_t left() const { return bytes_.size() - pos_; }
  void End() {
    if (pos_ != bytes_.size()) Fail(std::to_string(bytes_.size() - pos_) + " trailing bytes");
  }
  [[noreturn]] void Fail(const std::string& why) const {
    throw CorruptionError("read-once: " + what_ + " is malformed: " + why);
  }

 private:
  uint64_t Take(size_t n) {
    if (bytes_.size() - pos_ < n) Fail("truncated");
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) {
      v |= static_cast<uint64_t>(static_cast<unsigned char>(bytes_[pos_ + i])) << (8 * i);
    }
    pos_ += n;
    return v;
  }
  std::string_view bytes_;
  std::string what_;
  size_t pos_ = 0;
};

}  // namespace

std::vector<std::vector<SharedReadBatch>> PlanSharedReads(const std::vector<LoadPlan>& plans,
                                                          const Metadata& metadata,
                                                          const std::vector<bool>& can_share,
                                                          uint64_t max_batch_bytes) {
  const int n = static_cast<int>(plans.size());
  std::vector<std::vector<SharedReadBatch>> out(n);
  // 1. Who asks for what. A rank that asks for the same bytes twice shares the first only.
  std::unordered_map<std::string, std::vector<Holder>> askers;
  std::vector<uint64_t> load(n, 0);  // bytes each rank reads from storage
  std::vector<std::vector<uint64_t>> sizes(n);
  for (int r = 0; r < n; ++r) {
    const auto& items = plans[r].items;
    sizes[r].resize(items.size());
    for (size_t i = 0; i < items.size(); ++i) {
      sizes[r][i] = ReadItemBytes(items[i], metadata);
      load[r] += sizes[r][i];
      // A span is read piece by piece (ExpandChunkSpans): never shared whole.
      if (!can_share[r] || items[i].chunk_span > 1 || sizes[r][i] == 0 ||
          sizes[r][i] > max_batch_bytes) {
        continue;
      }
      auto& hs = askers[ShareKey(items[i])];
      if (hs.empty() || hs.back().rank != r) hs.push_back({r, static_cast<int32_t>(i)});
    }
  }
  // 2. Shared groups; each asker stops counting the item, which its root alone will read.
  std::vector<Group> groups;
  for (auto& [key, hs] : askers) {
    if (hs.size() < 2) continue;
    const uint64_t bytes = sizes[hs[0].rank][hs[0].item];
    for (const auto& h : hs) load[h.rank] -= sizes[h.rank][h.item];
    groups.push_back({&key, bytes, std::move(hs)});
  }
  if (groups.empty()) return out;
  std::sort(groups.begin(), groups.end(), [](const Group& a, const Group& b) {
    return a.bytes != b.bytes ? a.bytes > b.bytes : *a.key < *b.key;
  });
  // 3. Roots and batches; every rank gets every batch, with its own part.
  for (const auto& [root, members] : ScheduleGroups(groups, load, max_batch_bytes)) {
    for (int r = 0; r < n; ++r) out[r].push_back(SharedReadBatch{root, {}, {}, {}, 0});
    uint64_t bytes = 0;
    int32_t segment = 0;
    for (size_t gi : members) {
      const Group& g = groups[gi];
      for (const auto& h : g.holders) {
        SharedReadBatch& b = out[h.rank].back();
        if (h.rank == root) {
          b.send_items.push_back(h.item);
        } else {
          b.recv_segments.push_back(segment);
          b.recv_items.push_back(h.item);
        }
      }
      bytes += g.bytes;
      ++segment;
    }
    for (int r = 0; r < n; ++r) out[r].back().bytes = bytes;
  }
  return out;
}

std::vector<MetadataIndex> ShareCandidates(const Metadata& metadata) {
  std::vector<MetadataIndex> out;
  for (const auto& [fqn, entry] : metadata.entries) {
    if (std::holds_alternative<BytesMetadata>(entry)) {
      out.push_back({fqn, {}, std::nullopt});
      continue;
    }
    const auto& t = std::get<TensorMetadata>(entry);
    if (ChunkCount(t) != 1) continue;
    const ChunkMeta only = ChunkAt(t, 0);
    if (only.sizes == t.shape &&
        std::all_of(only.offsets.begin(), only.offsets.end(), [](int64_t v) { return v == 0; })) {
      out.push_back({fqn, only.offsets, std::nullopt});
    }
  }
  return out;
}

std::vector<int32_t> CandidateItems(const LoadPlan& plan,
                                    const std::vector<MetadataIndex>& candidates,
                                    const Metadata& metadata) {
  std::vector<int32_t> out(candidates.size(), -1);
  std::unordered_map<std::string_view, size_t> by_fqn;
  for (size_t c = 0; c < candidates.size(); ++c) by_fqn.emplace(candidates[c].fqn, c);
  const std::string* last_fqn = nullptr;  // items of one entry are adjacent: one lookup a run
  size_t c = candidates.size();
  for (size_t i = 0; i < plan.items.size(); ++i) {
    const ReadItem& item = plan.items[i];
    if (last_fqn == nullptr || *last_fqn != item.storage_index.fqn) {
      auto it = by_fqn.find(item.storage_index.fqn);
      c = it == by_fqn.end() ? candidates.size() : it->second;
      last_fqn = &item.storage_index.fqn;
    }
    if (c == candidates.size() || out[c] >= 0) continue;
    const MetadataIndex& cand = candidates[c];
    if (!(item.storage_index.offset == cand.offset)) continue;
    auto entry = metadata.entries.find(cand.fqn);
    if (entry == metadata.entries.end()) continue;
    bool whole = false;
    if (const auto* t = std::get_if<TensorMetadata>(&entry->second)) {
      // The candidate's one chunk is the whole tensor: a whole read starts at its origin and
      // spans its shape.
      whole = item.type == ReadItemType::kTensor && item.chunk_span == 1 &&
              item.lengths == t->shape &&
              std::all_of(item.storage_offsets.begin(), item.storage_offsets.end(),
                          [](int64_t v) { return v == 0; });
    } else {
      whole = item.type == ReadItemType::kBytes;
    }
    if (whole) out[c] = static_cast<int32_t>(i);
  }
  return out;
}

ReadRequestSummary SummarizeRequest(const LoadPlan& plan, const std::vector<int32_t>& items,
                                    const Metadata& metadata, bool can_share) {
  ReadRequestSummary s;
  s.can_share = can_share;
  // Items of one entry are adjacent in a plan (an all-to-all reshard has ranks x tensors of
  // them): look each entry up once per run, not once per item.
  const std::string* last_fqn = nullptr;
  const EntryMetadata* entry = nullptr;
  for (const auto& item : plan.items) {
    if (item.type == ReadItemType::kBytes) {
      s.plan_bytes += ReadItemBytes(item, metadata);
      continue;
    }
    if (last_fqn == nullptr || *last_fqn != item.storage_index.fqn) {
      auto it = metadata.entries.find(item.storage_index.fqn);
      entry = it == metadata.entries.end() ? nullptr : &it->second;
      last_fqn = &item.storage_index.fqn;
    }
    const auto* t = entry ? std::get_if<TensorMetadata>(entry) : nullptr;
    if (t) s.plan_bytes += static_cast<uint64_t>(NumElements(item.lengths)) * ElementSize(t->dtype);
  }
  if (can_share) {
    s.reads.resize(items.size());
    for (size_t c = 0; c < items.size(); ++c) s.reads[c] = items[c] >= 0;
  }
  return s;
}

std::string EncodeReadRequestSummary(const ReadRequestSummary& summary) {
  const bool all =
      std::all_of(summary.reads.begin(), summary.reads.end(), [](bool b) { return b; });
  std::string out;
  const bool coop = summary.coop_waste > 0;
  const bool rule = summary.rule_hash != 0;
  const bool ceil = summary.rule_hash_ceil_first != summary.rule_hash;  // sent only if another
  out.push_back(static_cast<char>((summary.can_share ? 1 : 0) | (all ? 2 : 0) | (coop ? 4 : 0) |
                                  (rule ? 8 : 0) | (ceil ? 16 : 0)));
  PutU64(out, summary.plan_bytes);
  if (coop) PutU64(out, summary.coop_waste);
  if (rule) PutU64(out, summary.rule_hash);
  if (ceil) PutU64(out, summary.rule_hash_ceil_first);
  if (summary.can_share && !all) {
    std::string bits((summary.reads.size() + 7) / 8, '\0');
    for (size_t c = 0; c < summary.reads.size(); ++c) {
      if (summary.reads[c]) bits[c / 8] = static_cast<char>(bits[c / 8] | (1 << (c % 8)));
    }
    out += bits;
  }
  return out;
}

ReadRequestSummary DecodeReadRequestSummary(std::string_view bytes, size_t candidates, int rank) {
  Cursor in(bytes, "the load request of rank " + std::to_string(rank));
  ReadRequestSummary s;
  const uint8_t flags = in.U8();
  if (flags > 31) in.Fail("unknown flags");
  s.can_share = (flags & 1) != 0;
  s.plan_bytes = in.U64();
  if ((flags & 4) != 0) s.coop_waste = in.U64();
  if ((flags & 8) != 0) s.rule_hash = in.U64();
  s.rule_hash_ceil_first = (flags & 16) != 0 ? in.U64() : s.rule_hash;
  if (s.can_share) {
    s.reads.assign(candidates, true);
    if ((flags & 2) == 0) {
      const std::string_view bits = in.Rest((candidates + 7) / 8);
      for (size_t c = 0; c < candidates; ++c) s.reads[c] = (bits[c / 8] >> (c % 8)) & 1;
    }
  }
  in.End();
  return s;
}

std::vector<uint64_t> CandidateBytes(const std::vector<MetadataIndex>& candidates,
                                     const Metadata& metadata) {
  std::vector<uint64_t> out(candidates.size(), 0);
  for (size_t c = 0; c < candidates.size(); ++c) {
    const MetadataIndex& cand = candidates[c];
    auto it = metadata.entries.find(cand.fqn);
    if (it == metadata.entries.end()) continue;
    ReadItem whole;
    if (const auto* t = std::get_if<TensorMetadata>(&it->second)) {
      whole.type = ReadItemType::kTensor;
      whole.lengths = t->shape;
    } else {
      whole.type = ReadItemType::kBytes;
    }
    whole.storage_index = cand;
    out[c] = ReadItemBytes(whole, metadata);
  }
  return out;
}

ShareSchedule ScheduleCandidates(const std::vector<ReadRequestSummary>& summaries,
                                 const std::vector<uint64_t>& candidate_bytes,
                                 uint64_t max_batch_bytes) {
  const int n = static_cast<int>(summaries.size());
  std::vector<uint64_t> load(n, 0);
  for (int r = 0; r < n; ++r) load[r] = summaries[r].plan_bytes;
  std::vector<Group> groups;
  std::vector<std::string> keys(candidate_bytes.size());
  for (size_t c = 0; c < candidate_bytes.size(); ++c) {
    const uint64_t bytes = candidate_bytes[c];
    if (bytes == 0 || bytes > max_batch_bytes) continue;
    std::vector<Holder> hs;
    for (int r = 0; r < n; ++r) {
      if (summaries[r].can_share && c < summaries[r].reads.size() && summaries[r].reads[c]) {
        hs.push_back({r, static_cast<int32_t>(c)});
      }
    }
    if (hs.size() < 2) continue;
    for (const auto& h : hs) load[h.rank] -= std::min(load[h.rank], bytes);
    keys[c] = std::to_string(c);
    groups.push_back({&keys[c], bytes, std::move(hs)});
  }
  ShareSchedule out;
  if (groups.empty()) return out;
  std::stable_sort(groups.begin(), groups.end(),
                   [](const Group& a, const Group& b) { return a.bytes > b.bytes; });
  for (const auto& [root, members] : ScheduleGroups(groups, load, max_batch_bytes)) {
    ShareSchedule::Batch batch;
    batch.root = root;
    for (size_t gi : members) {
      batch.candidates.push_back(groups[gi].holders[0].item);
      batch.bytes += groups[gi].bytes;
    }
    out.batches.push_back(std::move(batch));
  }
  return out;
}

std::string EncodeShareSchedule(const ShareSchedule& schedule) {
  std::string out;
  PutU32(out, static_cast<uint32_t>(schedule.batches.size()));
  for (const auto& b : schedule.batches) {
    PutU32(out, static_cast<uint32_t>(b.root));
    PutU64(out, b.bytes);
    PutU32(out, static_cast<uint32_t>(b.candidates.size()));
    for (int32_t c : b.candidates) PutU32(out, static_cast<uint32_t>(c));
  }
  // Absent: neither cooperative nor rule exchange; else bit 0 and bit 1 say which, and bit 2 that
  // rule exchange goes by the table found checking kRuleCeil first.
  if (schedule.cooperative || schedule.rule_exchange) {
    out.push_back(static_cast<char>((schedule.cooperative ? 1 : 0) |
                                    (schedule.rule_exchange ? 2 : 0) |
                                    (schedule.rule_exchange && schedule.rule_ceil_first ? 4 : 0)));
  }
  return out;
}

ShareSchedule DecodeShareSchedule(std::string_view bytes, size_t candidates) {
  Cursor in(bytes, "the read-once schedule");
  ShareSchedule s;
  const uint32_t nb = in.U32();
  if (nb > in.left() / 16) in.Fail("claims " + std::to_string(nb) + " batches");
  s.batches.resize(nb);
  for (auto& b : s.batches) {
    b.root = static_cast<int32_t>(in.U32());
    b.bytes = in.U64();
    const uint32_t nc = in.U32();
    if (nc > in.left() / 4) in.Fail("claims " + std::to_string(nc) + " items in a batch");
    b.candidates.resize(nc);
    for (auto& c : b.candidates) {
      const uint32_t v = in.U32();
      if (v >= candidates)
        in.Fail("names item " + std::to_string(v) + " of " + std::to_string(candidates));
      c = static_cast<int32_t>(v);
    }
  }
  if (in.left() > 0) {
    const uint8_t flags = in.U8();
    if (flags == 0 || flags > 7 || (flags & 6) == 4) in.Fail("unknown cooperative flags");
    s.cooperative = (flags & 1) != 0;
    s.rule_exchange = (flags & 2) != 0;
    s.rule_ceil_first = (flags & 4) != 0;
  }
  in.End();
  return s;
}

std::vector<SharedReadBatch> BatchesFor(const ShareSchedule& schedule,
                                        const ReadRequestSummary& mine,
                                        const std::vector<int32_t>& items, int rank) {
  std::vector<SharedReadBatch> out;
  out.reserve(schedule.batches.size());
  for (const auto& b : schedule.batches) {
    SharedReadBatch batch{b.root, {}, {}, {}, b.bytes};
    for (size_t k = 0; k < b.candidates.size(); ++k) {
      const auto c = static_cast<size_t>(b.candidates[k]);
      const bool asked = mine.can_share && c < items.size() && items[c] >= 0;
      if (b.root == rank) {
        if (!asked) {
          throw InternalError("read-once: rank " + std::to_string(rank) +
                              " was asked to read an item it does not read (candidate " +
                              std::to_string(c) + ")");
        }
        batch.send_items.push_back(items[c]);
      } else if (asked) {
        batch.recv_segments.push_back(static_cast<int32_t>(k));
        batch.recv_items.push_back(items[c]);
      }
    }
    out.push_back(std::move(batch));
  }
  return out;
}

}  // namespace dcp
