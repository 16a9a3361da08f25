// Checking a node's copy of a step's data file before a restore trusts it (DamageIn).
#include <algorithm>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "dcp/proto/checksum.h"
#include "dcp/proto/error.h"
#include "dcp/proto/staging.h"
#include "dcp/storage/format/layout.h"
#include "dcp/tier/step_store.h"

namespace dcp::tier_detail {

namespace {

// Bytes checked per read: the pooled buffer's size (large enough that a read's cost is the
// bytes, small enough to stay in cache while its CRC is computed).
constexpr size_t kCheckPiece = size_t{4} << 20;

// One item of the file whose bytes carry a checksum.
struct CheckedItem {
  uint64_t offset = 0, length = 0;
  uint32_t crc = 0;
  std::string name;  // for the message: the entry and its chunk (MetadataIndex::ToString)
};

// The stored items of `md` its rank `writer` wrote (version 2: the metadata says who wrote
// each chunk and blob).
std::vector<MetadataIndex> WrittenBy(const Metadata& md, int32_t writer) {
  std::vector<MetadataIndex> out;
  for (const auto& [fqn, entry] : md.entries) {
    if (const auto* t = std::get_if<TensorMetadata>(&entry)) {
      ForEachChunk(*t, [&](size_t k, const ChunkMeta& c) {
        if (ChunkWriter(*t, k) == writer) out.push_back({fqn, c.offsets, static_cast<int32_t>(k)});
      });
    } else if (std::get<BytesMetadata>(entry).writer == writer) {
      out.push_back({fqn, {}, std::nullopt});
    }
  }
  return out;
}

// The items of data file `name` that carry a checksum, where a load finds them: version 2
// through the layout's locator (the indexes of the file's writer, as a load reads them),
// version 1 from the metadata.
std::vector<CheckedItem> ItemsOf(Store& store, const Metadata& md, const std::string& name) {
  std::vector<CheckedItem> items;
  auto add = [&](const MetadataIndex& index, const StorageInfo& info) {
    if (info.relative_path == name && info.crc32c) {
      items.push_back({info.offset, info.length, *info.crc32c, index.ToString()});
    }
  };
  if (md.format_version >= 2) {
    auto f = std::find_if(md.files.begin(), md.files.end(),
                          [&](const DataFile& d) { return d.name == name; });
    if (f == md.files.end()) return items;  // not the step's: nothing a load reads
    std::map<MetadataIndex, StorageInfo> located;
    if (auto locator = NewItemLocator(store, md)) {
      locator->Resolve(WrittenBy(md, f->writer), located);
    }
    for (const auto& [index, info] : located) add(index, info);
  } else {
    for (const auto& [index, info] : md.storage) add(index, info);
  }
  std::sort(items.begin(), items.end(),
            [](const CheckedItem& a, const CheckedItem& b) { return a.offset < b.offset; });
  return items;
}

}  // namespace

std::string DamageIn(const std::string& dir, const Metadata& md, const std::string& name) {
  try {
    auto store = StepStore(dir);
    const std::vector<CheckedItem> items = ItemsOf(*store, md, name);
    if (items.empty()) return "";
    auto in = store->Open(name);
    HostBuffer buffer(kCheckPiece);
    for (const CheckedItem& item : items) {
      uint32_t crc = 0;
      for (uint64_t done = 0; done < item.length;) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(buffer.size(), item.length - done));
        in->ReadAt(item.offset + done, buffer.data(), n);
        crc = Crc32c(crc, buffer.data(), n);
        done += n;
      }
      if (crc != item.crc) {
        return "item " + item.name + " (bytes " + std::to_string(item.offset) + ".." +
               std::to_string(item.offset + item.length) + ") does not match its CRC32C";
      }
    }
    return "";
  } catch (const std::exception& e) {
    // A copy that cannot be read (a damaged index, a file cut short) is no better than one
    // whose bytes are wrong.
    return e.what();
  }
}

}  // namespace dcp::tier_detail
