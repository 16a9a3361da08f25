#include "dcp/proto/plan.h"

#include <algorithm>

#include "dcp/proto/checksum.h"
#include "dcp/proto/error.h"

namespace dcp {

std::string MetadataIndex::ToString() const {
  return offset.empty() ? "'" + fqn + "'" : "'" + fqn + "' at " + ShapeToString(offset);
}

uint64_t Metadata::TotalStoredBytes() const {
  uint64_t total = 0;
  for (const auto& [index, info] : storage) total += info.length;
  return total;
}

void FillStorage(Metadata& md, const std::vector<std::vector<WriteResult>>& results) {
  std::vector<const WriteResult*> order;
  size_t n = 0;
  for (const auto& rank_results : results) n += rank_results.size();
  order.reserve(n);
  for (const auto& rank_results : results) {
    for (const auto& r : rank_results) order.push_back(&r);
  }
  std::sort(order.begin(), order.end(),
            [](const WriteResult* a, const WriteResult* b) { return a->index < b->index; });
  md.storage.clear();
  for (size_t i = 0; i < order.size(); ++i) {
    if (i > 0 && order[i]->index == order[i - 1]->index) {
      throw InternalError("item " + order[i]->index.ToString() + " was written twice");
    }
    md.storage.emplace_hint(md.storage.end(), order[i]->index, order[i]->storage);
  }
}

std::optional<uint32_t> StoredCrc(const StorageInfo& info) {
  return info.zip_crc32 ? info.zip_crc32 : info.crc32c;
}

uint32_t ItemCrc(const StorageInfo& info, uint32_t crc, const void* data, size_t n) {
  return info.zip_crc32 ? Crc32(crc, data, n) : Crc32c(crc, data, n);
}

std::string ClippedName(const std::string& name) {
  if (name.size() <= 200) return "'" + name + "'";
  return "'" + name.substr(0, 120) + "...' (" + std::to_string(name.size()) + " bytes)";
}

}  // namespace dcp
