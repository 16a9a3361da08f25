#include "dcp/storage/format/dcp_index.h"

#include <algorithm>
#include <bit>
#include <mutex>

#include "dcp/proto/checksum.h"
#include "dcp/proto/error.h"
#include "dcp/proto/executor.h"
#include "dcp/storage/format/zstd_transform.h"

namespace dcp {

namespace {
// Index reads in flight: on an object store each is a round trip.
constexpr size_t kIndexReadsInFlight = 16;
}  // namespace

uint64_t DataEnd(const DataFile& f) {
  return f.block_table_length <= f.index_offset ? f.index_offset - f.block_table_length : 0;
}

namespace {

// The index bytes of data file `f`, checked against the file table's CRC32C.
std::string ReadFileIndexBytes(Store& store, const DataFile& f) {
  const std::string where = store.uri() + "/" + f.name;
  std::unique_ptr<ReadableObject> in;
  try {
    in = store.OpenKnownSize(f.name, f.size);  // the table's size: no size query
  } catch (const NotFoundError&) {
    throw NotFoundError("data file '" + where + "' is missing: the items its index lists " +
                        "cannot be read");
  }
  if (in->size() < f.size) {
    throw CorruptionError("truncated data file '" + where + "' (" + std::to_string(in->size()) +
                          " bytes, the metadata records " + std::to_string(f.size) + ")");
  }
  std::string bytes(static_cast<size_t>(f.index_length), '\0');
  in->ReadAt(f.index_offset, bytes.data(), bytes.size());
  if (Crc32c(0, bytes.data(), bytes.size()) != f.index_crc32c) {
    throw CorruptionError("index of data file '" + where + "' does not match its checksum");
  }
  return bytes;
}

}  // namespace

std::vector<uint64_t> ReferenceSizes(const DataFile& f) {
  std::vector<uint64_t> sizes;
  sizes.reserve(f.references.size());
  for (const DataFileReference& r : f.references) sizes.push_back(r.size);
  return sizes;
}

DataFile ReferencedDataFile(const DataFileReference& r) {
  DataFile f;
  f.name = r.name;
  f.size = r.size;
  f.index_offset = r.index_offset;
  f.index_length = r.index_length;
  f.index_crc32c = r.index_crc32c;
  f.block_table_offset = r.block_table_offset;
  f.block_table_length = r.block_table_length;
  f.block_table_crc32c = r.block_table_crc32c;
  return f;
}

DataFileReference ReferenceTo(const std::string& name, const DataFile& f) {
  DataFileReference r;
  r.name = name;
  r.size = f.size;
  if (f.block_table_length != 0) {
    r.index_offset = f.index_offset;
    r.index_length = f.index_length;
    r.index_crc32c = f.index_crc32c;
    r.block_table_offset = f.block_table_offset;
    r.block_table_length = f.block_table_length;
    r.block_table_crc32c = f.block_table_crc32c;
  }
  return r;
}

std::vector<FileIndexItem> ReadReferencedIndex(Store& store, const DataFile& f) {
  return DecodeFileIndex(ReadFileIndexBytes(store, f), DataEnd(f), store.uri() + "/" + f.name, 3,
                         {}, /*references_unknown=*/true);
}

std::vector<FileIndexItem> ReadFileIndex(Store& store, const DataFile& f, uint32_t format_version) {
  return DecodeFileIndex(ReadFileIndexBytes(store, f), DataEnd(f), store.uri() + "/" + f.name,
                         format_version, ReferenceSizes(f));
}

FileIndexResolver::FileIndexResolver(Store& store, const Metadata& md)
    : FileIndexResolver(store, md, /*use_copies=*/true) {}

FileIndexResolver::FileIndexResolver(Store& store, const Metadata& md, bool use_copies)
    : store_(store), md_(md), use_copies_(use_copies) {
  for (const DataFile& f : md.files) files_by_writer_[f.writer].push_back(&f);
}

void FileIndexResolver::LoadWriters(const std::vector<int32_t>& writers, bool tolerate_lost_files) {
  std::vector<const DataFile*> todo;
  for (int32_t w : writers) {
    if (loaded_[w]) continue;
    loaded_[w] = true;
    auto it = files_by_writer_.find(w);
    if (it != files_by_writer_.end()) todo.insert(todo.end(), it->second.begin(), it->second.end());
  }
  std::vector<std::vector<FileIndexItem>> indexes(todo.size());
  std::vector<char> lost(todo.size(), 0);
  ParallelFor(
      todo.size(),
      [&](size_t i) {
        if (tolerate_lost_files) {
          const auto size = store_.Size(todo[i]->name);
          if (!size || *size < todo[i]->size) {
            lost[i] = 1;
            return;
          }
        }
        const DataFile& f = *todo[i];
        if (use_copies_ && !f.index_copy.empty()) {
          // The file's presence and size were judged with the file table (CheckFileTable).
          const std::string where = store_.uri() + "/" + f.name;
          if (f.index_copy.size() != f.index_length ||
              Crc32c(0, f.index_copy.data(), f.index_copy.size()) != f.index_crc32c) {
            throw CorruptionError("the metadata's copy of the index of data file '" + where +
                                  "' does not match its checksum");
          }
          indexes[i] = DecodeFileIndex(f.index_copy, DataEnd(f), where, md_.format_version,
                                       ReferenceSizes(f));
          return;
        }
        const std::string bytes = ReadFileIndexBytes(store_, f);
        // A load resolves items through the metadata's copy of an index, so a copy that says
        // other than the file's own index is corruption, found here (dcp verify, ReadMetadata):
        // whatever verify accepts loads the bytes it checked. (Its CRC32C matching proves
        // nothing: a CRC can be forged.)
        if (!f.index_copy.empty() && f.index_copy != bytes) {
          throw CorruptionError("the metadata's copy of the index of data file '" + store_.uri() +
                                "/" + f.name +
                                "' differs from the file's own index (a load would read what "
                                "the copy says): the metadata is damaged or forged");
        }
        indexes[i] = DecodeFileIndex(bytes, DataEnd(f), store_.uri() + "/" + f.name,
                                     md_.format_version, ReferenceSizes(f));
      },
      std::min<size_t>(std::max<size_t>(todo.size(), 1), kIndexReadsInFlight));
  for (size_t i = 0; i < todo.size(); ++i) {
    if (lost[i]) lost_.try_emplace(todo[i]->writer, todo[i]);
  }
  // One sorted vector (half a map's memory, and an all-to-all reshard reads every index): the
  // new entries are sorted and merged in, and a key listed twice is refused.
  const size_t before = items_.size();
  for (size_t i = 0; i < todo.size(); ++i) {
    for (const FileIndexItem& item : indexes[i]) items_.push_back(Located{todo[i], item});
    std::vector<FileIndexItem>().swap(indexes[i]);
  }
  auto less = [](const Located& a, const Located& b) {
    return a.item.fqn_hash != b.item.fqn_hash ? a.item.fqn_hash < b.item.fqn_hash
                                              : a.item.chunk < b.item.chunk;
  };
  std::sort(items_.begin() + static_cast<std::ptrdiff_t>(before), items_.end(), less);
  std::inplace_merge(items_.begin(), items_.begin() + static_cast<std::ptrdiff_t>(before),
                     items_.end(), less);
  for (size_t i = 1; i < items_.size(); ++i) {
    if (!less(items_[i - 1], items_[i])) {
      throw CorruptionError("item " + std::to_string(items_[i].item.fqn_hash) + "/" +
                            std::to_string(items_[i].item.chunk) +
                            " is listed by the indexes of both '" + items_[i - 1].file->name +
                            "' and '" + items_[i].file->name + "' in " + store_.uri());
    }
  }
}

const FileIndexResolver::Located* FileIndexResolver::Find(uint64_t hash, uint32_t chunk) const {
  auto it = std::lower_bound(items_.begin(), items_.end(), std::make_pair(hash, chunk),
                             [](const Located& a, const std::pair<uint64_t, uint32_t>& key) {
                               return a.item.fqn_hash != key.first ? a.item.fqn_hash < key.first
                                                                   : a.item.chunk < key.second;
                             });
  if (it == items_.end() || it->item.fqn_hash != hash || it->item.chunk != chunk) return nullptr;
  return &*it;
}

StorageInfo FileIndexResolver::InfoFor(const MetadataIndex& index, const std::string& fqn,
                                       const EntryMetadata& entry) {
  uint32_t chunk = 0;
  int32_t writer = -1;
  uint64_t raw = 0;
  const auto* t = std::get_if<TensorMetadata>(&entry);
  if (t != nullptr) {
    const auto k = ChunkOrdinal(*t, index.offset, index.index);
    if (!k) {
      throw CorruptionError(store_.uri() + ": metadata has no chunk " + index.ToString());
    }
    chunk = static_cast<uint32_t>(*k);
    writer = ChunkWriter(*t, *k);
    raw = static_cast<uint64_t>(ChunkAt(*t, *k).numel()) * ElementSize(t->dtype);
  } else {
    writer = std::get<BytesMetadata>(entry).writer;
    raw = std::get<BytesMetadata>(entry).size;
  }
  const Located* found = Find(FqnHash(fqn), chunk);
  if (found == nullptr && lost_.count(writer)) {
    const DataFile* f = lost_.at(writer);
    StorageInfo info;
    info.relative_path = f->name;
    info.offset = f->size;
    info.length = raw;
    info.raw_length = raw;
    return info;
  }
  if (found == nullptr) {
    std::string searched;
    auto files = files_by_writer_.find(writer);
    if (files != files_by_writer_.end()) {
      for (const DataFile* f : files->second)
        searched += (searched.empty() ? "'" : ", '") + f->name + "'";
    }
    throw CorruptionError(store_.uri() + ": " + index.ToString() + " (chunk " +
                          std::to_string(chunk) + ", written by rank " + std::to_string(writer) +
                          ") is in no index of that rank's data files (" +
                          (searched.empty() ? std::string("it has none") : searched) + ")");
  }
  const FileIndexItem& item = found->item;
  if (item.raw_length != raw) {
    throw CorruptionError("index of data file '" + store_.uri() + "/" + found->file->name +
                          "': " + index.ToString() + " should hold " + std::to_string(raw) +
                          " bytes but its index records " + std::to_string(item.raw_length));
  }
  StorageInfo info;
  info.relative_path =
      item.ref == 0 ? found->file->name : found->file->references[item.ref - 1].name;
  info.content_hash = item.hash;
  info.offset = item.offset;
  info.length = item.length;
  info.raw_length = item.raw_length;
  info.crc32c = item.crc32c;
  if (item.zstd) info.transforms = {kZstdTransform};
  return info;
}

void FileIndexResolver::Resolve(const std::vector<MetadataIndex>& wanted,
                                std::map<MetadataIndex, StorageInfo>& out) {
  std::vector<int32_t> writers;
  std::vector<std::pair<const MetadataIndex*, decltype(md_.entries.begin())>> todo;
  for (const MetadataIndex& index : wanted) {
    if (out.count(index)) continue;
    auto e = md_.entries.find(index.fqn);
    if (e == md_.entries.end()) {
      throw CorruptionError(store_.uri() + ": metadata has no entry " + ClippedName(index.fqn));
    }
    int32_t writer;
    if (const auto* t = std::get_if<TensorMetadata>(&e->second)) {
      const auto k = ChunkOrdinal(*t, index.offset, index.index);
      if (!k) throw CorruptionError(store_.uri() + ": metadata has no chunk " + index.ToString());
      writer = ChunkWriter(*t, *k);
    } else {
      writer = std::get<BytesMetadata>(e->second).writer;
    }
    if (!loaded_.count(writer)) writers.push_back(writer);
    todo.emplace_back(&index, e);
  }
  std::sort(writers.begin(), writers.end());
  writers.erase(std::unique(writers.begin(), writers.end()), writers.end());
  LoadWriters(writers);
  for (const auto& [index, e] : todo) {
    if (out.count(*index)) continue;
    out.emplace(*index, InfoFor(*index, e->first, e->second));
  }
}

void FileIndexResolver::ResolveAll(Store& store, Metadata& md) { Resolve(store, md, false); }

void FileIndexResolver::ResolveAvailable(Store& store, Metadata& md) { Resolve(store, md, true); }

void FileIndexResolver::Resolve(Store& store, Metadata& md, bool tolerate_lost_files) {
  if (md.format_version < 2) return;
  FileIndexResolver resolver(store, md, /*use_copies=*/false);
  std::vector<int32_t> writers;
  for (const auto& [w, files] : resolver.files_by_writer_) writers.push_back(w);
  resolver.LoadWriters(writers, tolerate_lost_files);
  resolver.CheckBlockTables();
  std::map<MetadataIndex, StorageInfo> storage;
  size_t wanted = 0;
  for (const auto& [fqn, entry] : md.entries) {
    if (const auto* t = std::get_if<TensorMetadata>(&entry)) {
      ForEachChunk(*t, [&](size_t k, const ChunkMeta& c) {
        MetadataIndex index{fqn, c.offsets, static_cast<int32_t>(k)};
        storage.emplace(index, resolver.InfoFor(index, fqn, entry));
        ++wanted;
      });
    } else {
      MetadataIndex index{fqn, {}, 0};
      storage.emplace(index, resolver.InfoFor(index, fqn, entry));
      ++wanted;
    }
  }
  if (resolver.lost_.empty() && resolver.items_.size() != wanted) {
    throw CorruptionError(store.uri() + ": the data files' indexes list " +
                          std::to_string(resolver.items_.size()) + " items, the metadata " +
                          std::to_string(wanted));
  }
  md.storage = std::move(storage);
}

// The chunk ordinal is the index's key beside the fqn hash: without it no reader could tell a
// tensor's chunks apart.
DataFile AppendFileIndex(WritableObject& out, const std::string& name,
                         const std::vector<WriteResult>& results, int32_t rank,
                         uint64_t block_bytes, uint32_t format_version) {
  std::vector<std::pair<FileIndexItem, const std::vector<uint32_t>*>> index;
  index.reserve(results.size());
  DataFile f;
  std::map<std::string, uint32_t> reference_of;  // name -> its reference number (from 1)
  for (const WriteResult& r : results) {
    if (!r.index.index || *r.index.index < 0) {
      throw InvalidArgumentError(
          "save plan item " + r.index.ToString() +
          " has no chunk ordinal, which version-2 metadata needs (a planner's FinishPlan "
          "dropped the coordinator's index hints?); save with metadata_version 1");
    }
    FileIndexItem it;
    it.fqn_hash = FqnHash(r.index.fqn);
    it.chunk = static_cast<uint32_t>(*r.index.index);
    it.offset = r.storage.offset;
    it.length = r.storage.length;
    it.raw_length = r.storage.raw_length;
    it.crc32c = r.storage.crc32c;
    if (r.storage.transforms.size() > 1 ||
        (r.storage.transforms.size() == 1 && r.storage.transforms[0] != kZstdTransform)) {
      throw InternalError("item " + r.index.ToString() + ": a transform an index cannot record");
    }
    it.zstd = !r.storage.transforms.empty();
    it.hash = r.storage.content_hash;
    if (r.storage.relative_path != name) {
      // An item an incremental save kept where an earlier step stored it (and its size as
      // the writer found it: the reader's bound for the item).
      if (format_version < 3 || !IsSiblingReference(r.storage.relative_path) ||
          r.reference.name != r.storage.relative_path || !r.storage.block_crc32c.empty()) {
        throw InternalError("item " + r.index.ToString() + " of data file '" + name +
                            "' lies in '" + r.storage.relative_path +
                            "', which its index cannot record");
      }
      auto [ref, added] = reference_of.try_emplace(r.storage.relative_path,
                                                   static_cast<uint32_t>(f.references.size() + 1));
      if (added) f.references.push_back(r.reference);
      it.ref = ref->second;
    }
    index.emplace_back(it, &r.storage.block_crc32c);
  }
  // The block table lists the items' blocks in index order (EncodeFileIndex's).
  std::sort(index.begin(), index.end(), [](const auto& a, const auto& b) {
    return a.first.fqn_hash != b.first.fqn_hash ? a.first.fqn_hash < b.first.fqn_hash
                                                : a.first.chunk < b.first.chunk;
  });
  f.name = name;
  f.writer = rank;
  if (block_bytes != 0) {
    const auto log2 = static_cast<uint32_t>(std::countr_zero(block_bytes));
    std::vector<uint32_t> crcs;
    bool complete = true;  // every item the table lists came with its blocks
    for (const auto& [it, blocks] : index) {
      const uint64_t n = TableBlocksOf(it, log2);
      complete &= blocks->size() == n;
      crcs.insert(crcs.end(), blocks->begin(), blocks->end());
    }
    if (!complete) {
      throw InternalError("data file '" + name + "': an item's block CRCs do not match the " +
                          std::to_string(block_bytes) + "-byte blocks of its length");
    }
    const std::string table = EncodeBlockTable(log2, crcs);
    f.block_table_offset = out.size();
    f.block_table_length = table.size();
    f.block_table_crc32c = Crc32c(0, table.data(), table.size());
    out.Append(table.data(), table.size());
  }
  std::vector<FileIndexItem> items;
  items.reserve(index.size());
  for (const auto& entry : index) items.push_back(entry.first);
  const std::string bytes = EncodeFileIndex(std::move(items), format_version);
  f.index_offset = out.size();
  f.index_length = bytes.size();
  f.index_crc32c = Crc32c(0, bytes.data(), bytes.size());
  out.Append(bytes.data(), bytes.size());
  f.size = out.size();
  f.index_copy = bytes;  // kept for the metadata if small (StorageWriter::TakeDataFiles)
  return f;
}

std::unique_ptr<ItemLocator> NewItemLocator(Store& store, const Metadata& md) {
  if (md.format_version < 2) return nullptr;
  return std::make_unique<FileIndexResolver>(store, md);
}

void ReadAllStoredItems(Store& store, Metadata& md) {
  if (md.format_version < 2) return;
  FileIndexResolver::ResolveAll(store, md);
}

}  // namespace dcp
