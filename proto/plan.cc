#include "dcp/proto/plan.h"

namespace dcp {

std::string MetadataIndex::ToString() const {
  return offset.empty() ? "'" + fqn + "'" : "'" + fqn + "' at " + ShapeToString(offset);
}

uint64_t Metadata::TotalStoredBytes() const {
  uint64_t total = 0;
  for (const auto& [index, info] : storage) total += info.length;
  return total;
}

}  // namespace dcp
