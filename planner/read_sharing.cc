#include "dcp/planner/read_sharing.h"

#include <algorithm>
#include <map>
#include <string>
#include <unordered_map>

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
    if (it == metadata.storage.end()) return 0;
    return it->second.transforms.empty() ? it->second.length : it->second.raw_length;
  }
  auto it = metadata.entries.find(item.storage_index.fqn);
  if (it == metadata.entries.end()) return 0;
  const auto* t = std::get_if<TensorMetadata>(&it->second);
  if (t == nullptr) return 0;
  return static_cast<uint64_t>(NumElements(item.lengths)) * ElementSize(t->dtype);
}

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
      if (!can_share[r] || sizes[r][i] == 0 || sizes[r][i] > max_batch_bytes) continue;
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
  for (auto& g : groups) {
    const Holder* best = &g.holders[0];
    for (const auto& h : g.holders) {
      if (load[h.rank] < load[best->rank]) best = &h;
    }
    g.root = best->rank;
    load[best->rank] += g.bytes;
  }
  // 3. Each root's groups in batches of at most max_batch_bytes; batches of all roots taken in
  //    turns (root 0's first, root 1's first, ..., root 0's second, ...), so that no root's
  //    reads wait behind all of another's.
  std::map<int, std::vector<std::vector<const Group*>>> by_root;
  for (const auto& g : groups) {
    auto& batches = by_root[g.root];
    uint64_t used = 0;
    if (!batches.empty()) {
      for (const Group* x : batches.back()) used += x->bytes;
    }
    if (batches.empty() || used + g.bytes > max_batch_bytes) batches.emplace_back();
    batches.back().push_back(&g);
  }
  for (size_t round = 0;; ++round) {
    bool any = false;
    for (const auto& [root, batches] : by_root) {
      if (round >= batches.size()) continue;
      any = true;
      for (int r = 0; r < n; ++r) out[r].push_back(SharedReadBatch{root, {}, {}, {}, 0});
      uint64_t bytes = 0;
      int32_t segment = 0;
      for (const Group* g : batches[round]) {
        for (const auto& h : g->holders) {
          SharedReadBatch& b = out[h.rank].back();
          if (h.rank == root) {
            b.send_items.push_back(h.item);
          } else {
            b.recv_segments.push_back(segment);
            b.recv_items.push_back(h.item);
          }
        }
        bytes += g->bytes;
        ++segment;
      }
      for (int r = 0; r < n; ++r) out[r].back().bytes = bytes;
    }
    if (!any) break;
  }
  return out;
}

}  // namespace dcp
