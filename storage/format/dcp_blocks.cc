// Version 2's block tables on the read side (docs/FORMAT.md): read only for the files of items
// a load reads in part, and trusted only as far as they agree with the index, whose CRC32C the
// metadata's file table holds: every block count must match its file's items, and an item's
// blocks must combine to its crc32c, so a forged table (with a recomputed table CRC) cannot pass
// a corrupted block. Version 3: an item kept in a sibling's data file takes its blocks from that
// file's table, found through the reference (which records where the file's index and table
// lie), once that file's index agrees with this checkpoint's about where the item lies.
#include <algorithm>
#include <tuple>

#include "dcp/proto/checksum.h"
#include "dcp/proto/error.h"
#include "dcp/proto/executor.h"
#include "dcp/storage/format/dcp_index.h"

namespace dcp {

namespace {

constexpr size_t kTableReadsInFlight = 16;  // as index reads: on an object store, round trips

// The block table of data file `f` (of this checkpoint, or a sibling's through a reference),
// checked against its recorded CRC32C and decoded.
BlockTable ReadBlockTable(Store& store, const DataFile& f) {
  const std::string where = store.uri() + "/" + f.name;
  std::string bytes(static_cast<size_t>(f.block_table_length), '\0');
  store.OpenKnownSize(f.name, f.size)->ReadAt(f.block_table_offset, bytes.data(), bytes.size());
  if (Crc32c(0, bytes.data(), bytes.size()) != f.block_table_crc32c) {
    throw CorruptionError("block table of data file '" + where + "' does not match its checksum");
  }
  return DecodeBlockTable(bytes, where);
}

}  // namespace

void FileIndexResolver::LoadBlockTables(const std::vector<const DataFile*>& files) {
  std::vector<BlockTable> tables(files.size());
  ParallelFor(
      files.size(), [&](size_t i) { tables[i] = ReadBlockTable(store_, *files[i]); },
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

namespace {

// Check `item`'s blocks in `table` (read from `where`) against its crc32c and attach them to
// `info`: the blocks must combine to the item's CRC, which the index (checked against the
// metadata) records, so a forged table (with a recomputed table CRC) cannot pass a corrupted block.
void AttachBlocks(const MetadataIndex& index, StorageInfo& info, const FileIndexItem& item,
                  const BlockTable& table, const std::string& where) {
  const uint64_t count = TableBlocksOf(item, table.log2);
  if (count != 0) {
    const uint64_t block = uint64_t{1} << table.log2;
    const uint32_t* crcs = table.crcs.data() + item.first_block;
    uint32_t combined = 0;
    for (uint64_t j = 0; j < count; ++j) {
      combined = Crc32cCombine(combined, crcs[j], std::min(block, info.length - j * block));
    }
    if (combined != *info.crc32c) {
      throw CorruptionError("block table of data file '" + where +
                            "' disagrees with the crc32c of " + index.ToString() + " at offset " +
                            std::to_string(info.offset) + " (" + std::to_string(info.length) +
                            " bytes)");
    }
    info.blocks.crcs = crcs;
  }
  info.blocks.count = static_cast<uint32_t>(count);
  info.blocks.log2 = static_cast<uint8_t>(table.log2);
}

}  // namespace

void FileIndexResolver::LoadReferencedFiles(const std::vector<const DataFileReference*>& refs) {
  std::vector<ReferencedFile> files(refs.size());
  ParallelFor(
      refs.size(),
      [&](size_t i) {
        const DataFile f = ReferencedDataFile(*refs[i]);
        const std::string where = store_.uri() + "/" + f.name;
        ReferencedFile& rf = files[i];
        rf.items = ReadReferencedIndex(store_, f);
        rf.table = ReadBlockTable(store_, f);
        // The table lists the blocks of the index's items in index order.
        uint64_t next = 0;
        for (FileIndexItem& item : rf.items) {
          const uint64_t count = TableBlocksOf(item, rf.table.log2);
          if (count == 0) continue;
          item.first_block = static_cast<uint32_t>(std::min<uint64_t>(next, UINT32_MAX));
          next += count;
        }
        if (next != rf.table.crcs.size()) {
          throw CorruptionError("block table of data file '" + where + "' lists " +
                                std::to_string(rf.table.crcs.size()) +
                                " blocks, its index's items " + std::to_string(next));
        }
      },
      std::min<size_t>(std::max<size_t>(refs.size(), 1), kTableReadsInFlight));
  for (size_t i = 0; i < refs.size(); ++i) referenced_.emplace(refs[i]->name, std::move(files[i]));
}

void FileIndexResolver::ResolveBlocks(const std::vector<MetadataIndex>& partial,
                                      std::map<MetadataIndex, StorageInfo>& out) {
  if (by_name_.empty()) {
    for (const DataFile& f : md_.files) {
      by_name_.emplace(f.name, &f);
      for (const DataFileReference& r : f.references) references_by_name_.emplace(r.name, &r);
    }
  }
  // The items that may have blocks, and the tables not read yet: of this checkpoint's files,
  // and of the sibling files references point at.
  std::vector<std::tuple<const MetadataIndex*, StorageInfo*, const Located*>> todo;
  std::vector<std::tuple<const MetadataIndex*, StorageInfo*, const DataFileReference*>> in_siblings;
  std::vector<const DataFile*> load;
  std::vector<const DataFileReference*> load_siblings;
  for (const MetadataIndex& index : partial) {
    auto it = out.find(index);
    if (it == out.end()) continue;
    StorageInfo& info = it->second;
    if (info.blocks.log2 != 0 || !info.transforms.empty() || !info.crc32c || info.zip_crc32) {
      continue;
    }
    auto f = by_name_.find(info.relative_path);
    if (f == by_name_.end()) {
      auto r = references_by_name_.find(info.relative_path);
      if (r == references_by_name_.end() || r->second->block_table_length == 0) continue;
      in_siblings.emplace_back(&index, &info, r->second);
      if (!referenced_.count(r->first)) load_siblings.push_back(r->second);
      continue;
    }
    if (f->second->block_table_length == 0) continue;
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
    AttachBlocks(*index, *info, l->item, tables_.at(l->file), store_.uri() + "/" + l->file->name);
  }
  std::sort(load_siblings.begin(), load_siblings.end());
  load_siblings.erase(std::unique(load_siblings.begin(), load_siblings.end()), load_siblings.end());
  LoadReferencedFiles(load_siblings);
  for (auto& [index, info, r] : in_siblings) {
    const ReferencedFile& rf = referenced_.at(r->name);
    const std::string where = store_.uri() + "/" + r->name;
    // The sibling's index must hold the item where this checkpoint's index says it lies.
    auto e = md_.entries.find(index->fqn);
    const auto* t = e == md_.entries.end() ? nullptr : std::get_if<TensorMetadata>(&e->second);
    const auto k = t ? ChunkOrdinal(*t, index->offset, index->index) : std::nullopt;
    if (!k) continue;  // Resolve placed it, so it is a chunk of a tensor
    const uint64_t hash = FqnHash(index->fqn);
    auto item = std::lower_bound(rf.items.begin(), rf.items.end(), std::pair(hash, *k),
                                 [](const FileIndexItem& a, const std::pair<uint64_t, size_t>& b) {
                                   return std::pair<uint64_t, size_t>(a.fqn_hash, a.chunk) < b;
                                 });
    if (item == rf.items.end() || item->fqn_hash != hash || item->chunk != *k || item->ref != 0 ||
        item->offset != info->offset || item->length != info->length ||
        item->crc32c != info->crc32c || item->zstd) {
      throw CorruptionError("index of data file '" + where + "' does not hold " +
                            index->ToString() + " where this checkpoint's index records it (" +
                            std::to_string(info->offset) + ", +" + std::to_string(info->length) +
                            " bytes)");
    }
    AttachBlocks(*index, *info, *item, rf.table, where);
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
