// The store reader's ItemStreamer (store_checkpoint.h): how the owner of a stored item reads it
// once, front to back, for a cooperative load (planner/coop_reads.h).
#include <algorithm>

#include "dcp/proto/checksum.h"
#include "dcp/proto/error.h"
#include "dcp/proto/staging.h"
#include "dcp/storage/checkpoint/store_checkpoint.h"
#include "dcp/storage/format/layout.h"

namespace dcp {

namespace {

// Slabs land in steps of this size, each CRC'd while it is still in the CPU cache.
constexpr size_t kHotStepBytes = size_t{1} << 20;

class StoreItemStreamer : public ItemStreamer {
 public:
  explicit StoreItemStreamer(const StoreItemSource& src) : src_(src) {}

  uint64_t StreamableLength(const MetadataIndex& index) override {
    auto e = src_.metadata.entries.find(index.fqn);
    if (e == src_.metadata.entries.end()) return 0;
    const auto* t = std::get_if<TensorMetadata>(&e->second);
    if (t == nullptr) return 0;
    const auto k = ChunkOrdinal(*t, index.offset, index.index);
    if (!k) return 0;
    const ChunkMeta chunk = ChunkAt(*t, *k);
    const uint64_t raw = static_cast<uint64_t>(chunk.numel()) * ElementSize(t->dtype);
    if (src_.locator) src_.locator->Resolve({index}, src_.resolved);
    // Layouts whose items become plain byte ranges (a torch.save record's storage) say so here,
    // as they do before a read.
    LoadPlan one;
    ReadItem item;
    item.storage_index = index;
    item.dest_index = index;
    item.storage_offsets = Shape(chunk.sizes.size(), 0);
    item.dest_offsets = item.storage_offsets;
    item.lengths = chunk.sizes;
    one.items.push_back(std::move(item));
    for (auto& decoder : src_.decoders) decoder->Prepare(one, src_.resolved);
    const StorageInfo* info = Find(index);
    if (info == nullptr || !info->transforms.empty() || info->length != raw) return 0;
    return raw;
  }

  void StreamItem(const MetadataIndex& index, uint64_t slab_bytes,
                  const std::function<void(uint64_t, const char*, size_t)>& on_slab) override {
    const StorageInfo* found = Find(index);
    if (found == nullptr || !found->transforms.empty()) {
      throw InternalError("cooperative read: " + index.ToString() + " cannot be streamed");
    }
    const StorageInfo& info = *found;
    const std::string& name = info.relative_path;
    auto known = src_.file_sizes.find(name);
    std::unique_ptr<ReadableObject> in = known == src_.file_sizes.end()
                                             ? src_.store.Open(name)
                                             : src_.store.OpenKnownSize(name, known->second);
    in->LimitBuffers(src_.options.memory_budget_bytes / 4);
    const std::optional<uint32_t> stored = StoredCrc(info);
    const bool check = src_.options.verify_checksums && stored.has_value();
    const ChecksumKind kind = StoredCrcKind(info);
    slab_bytes = std::max<uint64_t>(slab_bytes, 1);
    HostBuffer buf(static_cast<size_t>(std::min(slab_bytes, std::max<uint64_t>(info.length, 1))));
    in->Prefetch(info.offset, info.length);
    const size_t step = std::min(kHotStepBytes, ScratchLimit(src_.options));
    uint32_t crc = 0;
    for (uint64_t pos = 0; pos < info.length;) {
      const size_t n = static_cast<size_t>(std::min(slab_bytes, info.length - pos));
      char* p = buf.data();
      // In steps of at most the scratch size, as every other partial read: each CRC'd hot.
      in->ReadAtStreaming(info.offset + pos, p, n, step, [&](size_t at, size_t len) {
        if (check) crc = ChecksumExtend(kind, crc, p + at, len);
      });
      // The last slab goes out only once the whole item has verified.
      if (pos + n == info.length && check && crc != *stored) {
        throw CorruptionError("checksum mismatch for " + index.ToString() + " in '" +
                              src_.store.uri() + "/" + name + "' at offset " +
                              std::to_string(info.offset) + " (" + std::to_string(info.length) +
                              " bytes): stored " + std::string(StoredCrcName(info)) + " " +
                              std::to_string(*stored) + ", computed " + std::to_string(crc));
      }
      on_slab(pos, p, n);
      pos += n;
    }
  }

 private:
  const StorageInfo* Find(const MetadataIndex& index) const {
    auto r = src_.resolved.find(index);
    if (r != src_.resolved.end()) return &r->second;
    auto s = src_.metadata.storage.find(index);
    return s == src_.metadata.storage.end() ? nullptr : &s->second;
  }

  StoreItemSource src_;
};

}  // namespace

std::unique_ptr<ItemStreamer> NewStoreItemStreamer(const StoreItemSource& source) {
  return std::make_unique<StoreItemStreamer>(source);
}

}  // namespace dcp
