// An incremental save reads its base's metadata and the indexes of the files that hold this
// rank's items (the base's layout is usually this save's, so that is the base's file of the same
// rank), and keeps an item where the base stored it when its bytes hash the same. References
// are always to the file that holds the bytes: an item the base itself kept from an earlier step
// is pointed at that step's file, so no chain of checkpoints is ever walked.
#include <unordered_map>

#include "dcp/proto/checksum.h"
#include "dcp/proto/device/device.h"
#include "dcp/proto/error.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/storage/format/dcp_index.h"
#include "dcp/storage/format/layout.h"
#include "dcp/storage/sibling_store.h"

namespace dcp {

IncrementalBase::IncrementalBase(Store& store, const StorageOptions& options, const SavePlan& plan)
    : frozen_(options.frozen_prefixes) {
  try {
    Read(store, options, plan);
  } catch (const Error& e) {
    items_.clear();
    why_not_ = e.what();
  }
}

void IncrementalBase::Read(Store& store, const StorageOptions& options, const SavePlan& plan) {
  const std::string& name = options.incremental_base;
  std::shared_ptr<Store> base = SiblingOf(store, name);
  const CheckpointLayout& layout = LayoutFor(CheckpointFormat::kDcp);
  if (!layout.Detect(*base)) {
    why_not_ = "no dcp checkpoint at " + base->uri();
    return;
  }
  const Metadata md = layout.ReadMetadata(*base);
  if (md.format_version < 3) {
    why_not_ = base->uri() + " was saved without content hashes (format version " +
               std::to_string(md.format_version) + ")";
    return;
  }
  // The plan's items the base holds alike, keyed as the base's metadata keys them.
  std::vector<MetadataIndex> wanted;
  std::vector<size_t> of;  // plan item of each wanted
  for (size_t i = 0; i < plan.items.size(); ++i) {
    const WriteItem& item = plan.items[i];
    auto e = md.entries.find(item.index.fqn);
    if (e == md.entries.end()) continue;
    if (item.is_tensor()) {
      const auto* t = std::get_if<TensorMetadata>(&e->second);
      if (t == nullptr || t->dtype != item.dtype || t->shape != item.global_shape) continue;
      const auto k = ChunkOrdinal(*t, item.chunk.offsets);
      if (!k || ChunkAt(*t, *k).sizes != item.chunk.sizes) continue;
      wanted.push_back(MetadataIndex{item.index.fqn, item.chunk.offsets, static_cast<int32_t>(*k)});
    } else {
      const auto* b = std::get_if<BytesMetadata>(&e->second);
      if (b == nullptr || b->size != item.size_bytes) continue;
      wanted.push_back(MetadataIndex{item.index.fqn, {}, 0});
    }
    of.push_back(i);
  }
  std::map<MetadataIndex, StorageInfo> found;
  FileIndexResolver resolver(*base, md);
  resolver.Resolve(wanted, found);
  // The items' first-block CRCs, where the base's files have block tables (one small read per
  // file): what tells most changed items apart without hashing them.
  resolver.ResolveBlocks(wanted, found);
  // The files the base's items lie in, as the new checkpoint references them: the base's own
  // (where their indexes and block tables lie, so that partial reads verify blocks), and the
  // base's references as it recorded them (siblings share the parent, so the names hold).
  std::unordered_map<std::string, DataFileReference> references;
  for (const DataFile& f : md.files) {
    const DataFileReference r = ReferenceTo(SiblingReference(name, f.name), f);
    references[r.name] = r;
    for (const DataFileReference& kept : f.references) references[kept.name] = kept;
  }
  items_.assign(plan.items.size(), std::nullopt);
  for (size_t w = 0; w < wanted.size(); ++w) {
    StorageInfo info = found.at(wanted[w]);
    if (!info.content_hash || !info.crc32c) continue;
    if (options.compression == Compression::kNone && !info.transforms.empty()) continue;
    if (!IsSiblingReference(info.relative_path)) {
      info.relative_path = SiblingReference(name, info.relative_path);
    }
    auto reference = references.find(info.relative_path);
    if (reference == references.end()) continue;
    BaseItem kept{std::move(info), reference->second};
    if (kept.info.blocks.crcs != nullptr && kept.info.blocks.count > 0) {
      kept.head_crc32c = kept.info.blocks.crcs[0];
      kept.head_bytes = uint64_t{1} << kept.info.blocks.log2;
    }
    kept.info.blocks = {};
    items_[of[w]] = std::move(kept);
  }
}

bool IncrementalBase::Frozen(const std::string& fqn) const {
  for (const std::string& p : frozen_) {
    if (fqn.size() >= p.size() && fqn.compare(0, p.size(), p) == 0 &&
        (fqn.size() == p.size() || fqn[p.size()] == '.' || p.empty() || p.back() == '.')) {
      return true;
    }
  }
  return false;
}

bool IncrementalBase::Unchanged(size_t i, const WriteItem& item, const ResolvedData& data,
                                std::optional<ContentHash>& hash) const {
  const BaseItem* kept = Find(i);
  if (kept == nullptr) return false;
  if (Frozen(item.index.fqn)) return true;
  // The head first, where it is one contiguous host range: most changed items differ there.
  if (kept->head_bytes != 0 && item.is_tensor() && data.tensor.device.is_cpu() &&
      data.tensor.is_contiguous() && data.tensor.nbytes() >= kept->head_bytes &&
      Crc32c(0, data.tensor.data, static_cast<size_t>(kept->head_bytes)) != kept->head_crc32c) {
    return false;
  }
  hash = HashItemBytes(item, data);
  return *hash == *kept->info.content_hash;
}

ContentHash HashItemBytes(const WriteItem& item, const ResolvedData& data) {
  ContentHasher hasher;
  if (item.is_tensor()) {
    StreamToHost(data.tensor, kDevicePieceBytes,
                 [&](const void* p, size_t n) { hasher.Add(p, n); });
  } else {
    hasher.Add(data.bytes.data(), data.bytes.size());
  }
  return hasher.Digest();
}

}  // namespace dcp
