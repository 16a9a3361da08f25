// Version 2's block tables on the read side (docs/FORMAT.md): read only for the files of items
// a load reads in part, and trusted only as far as they agree with the index, whose CRC32C the
// metadata's file table holds: every block count must match its file's items, and an item's
// blocks must combine to its crc32c, so a forged table (with a recomputed table CRC) cannot pass
// a corrupted block.
#include <algorithm>
#include <tuple>

#include "dcp/proto/checksum.h"
#include "dcp/proto/error.h"
#include "dcp/proto/executor.h"
#include "dcp/storage/format/dcp_index.h"

namespace dcp {

namespace {
constexpr size_t kTableReadsInFlight = 16;  // as index reads: on an object store, round trips
}  // namespace

void FileIndexResolver::LoadBlockTables(const std::vector<const DataFile*>& files) {
  std::vector<BlockTable> tables(files.size());
  ParallelFor(
      files.size(),
      [&](size_t i) {
        const DataFile& f = *files[i];
        const std::string where = store_.uri() + "/" + f.name;
        std::string bytes(static_cast<size_t>(f.block_table_length), '\0');
        store_.OpenKnownSize(f.name, f.size)
            ->ReadAt(f.block_table_offset, bytes.data(), bytes.size());
        if (Crc32c(0, bytes.data(), bytes.size()) != f.block_table_crc32c) {
          throw CorruptionError("block table of data file '" + where +
                                "' does not match its checksum");
        }
        tables[i] = DecodeBlockTable(bytes, where);
      },
      std::min<size_t>(std::max<size_t>(files.size(), 1), kTableReadsInFlight));
  // Each item's first block: the tables list the items' blocks in index order, which is the
  // (hash, chunk) order of items_ restricted to one file.
  std::unordered_map<const DataFile*, std::pair<const BlockTable*, uint64_t>> next;
  for (size_t i = 0; i < files.size(); ++i) next[files[i]] = {&tables[i], 0};
  for (Located& l : items_) {
    auto n = next.find(l.file);
    if (n == next.end()) continue;
    const uint64_t count = TableBlocksOf(l.item, n->second.first->log2);
    if (count == 0) continue;
    l.item.first_block = static_cast<uint32_t>(std::min<uint64_t>(n->second.second, UINT32_MAX));
    n->second.second += count;
  }
  for (size_t i = 0; i < files.size(); ++i) {
    const uint64_t listed = next[files[i]].second;
    if (listed != tables[i].crcs.size()) {
      throw CorruptionError("block table of data file '" + store_.uri() + "/" + files[i]->name +
                            "' lists " + std::to_string(tables[i].crcs.size()) +
                            " blocks, its index's items " + std::to_string(listed));
    }
    tables_.emplace(files[i], std::move(tables[i]));
  }
}

void FileIndexResolver::ResolveBlocks(const std::vector<MetadataIndex>& partial,
                                      std::map<MetadataIndex, StorageInfo>& out) {
  if (by_name_.empty()) {
    for (const DataFile& f : md_.files) by_name_.emplace(f.name, &f);
  }
  // The items that may have blocks, and the tables not read yet.
  std::vector<std::tuple<const MetadataIndex*, StorageInfo*, const Located*>> todo;
  std::vector<const DataFile*> load;
  for (const MetadataIndex& index : partial) {
    auto it = out.find(index);
    if (it == out.end()) continue;
    StorageInfo& info = it->second;
    if (info.blocks.log2 != 0 || !info.transforms.empty() || !info.crc32c || info.zip_crc32) {
      continue;
    }
    auto f = by_name_.find(info.relative_path);
    if (f == by_name_.end() || f->second->block_table_length == 0) continue;
    auto e = md_.entries.find(index.fqn);
    const auto* t = e == md_.entries.end() ? nullptr : std::get_if<TensorMetadata>(&e->second);
    if (t == nullptr) continue;
    const auto k = ChunkOrdinal(*t, index.offset, index.index);
    const Located* l = k ? Find(FqnHash(index.fqn), static_cast<uint32_t>(*k)) : nullptr;
    if (l == nullptr || l->file != f->second) continue;  // not from an index (lost file)
    todo.emplace_back(&index, &info, l);
    if (!tables_.count(l->file)) load.push_back(l->file);
  }
  std::sort(load.begin(), load.end());
  load.erase(std::unique(load.begin(), load.end()), load.end());
  LoadBlockTables(load);
  for (auto& [index, info, l] : todo) {
    const BlockTable& table = tables_.at(l->file);
    const uint64_t count = TableBlocksOf(l->item, table.log2);
    if (count != 0) {
      // The blocks must combine to the item's CRC, which the index (checked against the
      // metadata) records.
      const uint64_t block = uint64_t{1} << table.log2;
      const uint32_t* crcs = table.crcs.data() + l->item.first_block;
      uint32_t combined = 0;
      for (uint64_t j = 0; j < count; ++j) {
        combined = Crc32cCombine(combined, crcs[j], std::min(block, info->length - j * block));
      }
      if (combined != *info->crc32c) {
        throw CorruptionError("block table of data file '" + store_.uri() + "/" + l->file->name +
                              "' disagrees with the crc32c of " + index->ToString() +
                              " at offset " + std::to_string(info->offset) + " (" +
                              std::to_string(info->length) + " bytes)");
      }
      info->blocks.crcs = crcs;
    }
    info->blocks.count = static_cast<uint32_t>(count);
    info->blocks.log2 = static_cast<uint8_t>(table.log2);
  }
}

void FileIndexResolver::CheckBlockTables() {
  std::vector<const DataFile*> files;
  std::unordered_map<const DataFile*, bool> lost;
  for (const auto& [w, f] : lost_) lost[f] = true;
  for (const DataFile& f : md_.files) {
    if (f.block_table_length != 0 && !lost.count(&f) && !tables_.count(&f)) files.push_back(&f);
  }
  LoadBlockTables(files);
  for (const Located& l : items_) {
    auto t = tables_.find(l.file);
    if (t == tables_.end()) continue;
    const uint64_t count = TableBlocksOf(l.item, t->second.log2);
    if (count == 0) continue;
    const uint64_t block = uint64_t{1} << t->second.log2;
    uint32_t combined = 0;
    for (uint64_t j = 0; j < count; ++j) {
      combined = Crc32cCombine(combined, t->second.crcs[l.item.first_block + j],
                               std::min(block, l.item.length - j * block));
    }
    if (combined != *l.item.crc32c) {
      throw CorruptionError("block table of data file '" + store_.uri() + "/" + l.file->name +
                            "' disagrees with the crc32c of the item at offset " +
                            std::to_string(l.item.offset) + " (" + std::to_string(l.item.length) +
                            " bytes)");
    }
  }
}

}  // namespace dcp
