// Checking a node's copy of a step's data file before a restore trusts it (DamageIn).
#include <algorithm>
#include <string>
#include <vector>

#include "dcp/proto/checksum.h"
#include "dcp/proto/error.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/proto/staging.h"
#include "dcp/storage/format/dcp_index.h"
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
  std::string name;  // for the message: the entry and its chunk
};

// The name of the entry whose FqnHash is `hash`, for a message ("?" if none: the file index
// and the metadata disagree, which ReadFileIndex's callers report elsewhere).
std::string EntryNamed(const Metadata& md, uint64_t hash) {
  for (const auto& [fqn, entry] : md.entries) {
    if (FqnHash(fqn) == hash) return fqn;
  }
  return "?";
}

std::vector<CheckedItem> ItemsOf(Store& store, const Metadata& md, const std::string& name) {
  std::vector<CheckedItem> items;
  if (md.format_version >= 2) {
    auto f = std::find_if(md.files.begin(), md.files.end(),
                          [&](const DataFile& d) { return d.name == name; });
    if (f == md.files.end()) return items;  // not the step's: nothing a load reads
    for (const FileIndexItem& it : ReadFileIndex(store, *f)) {
      if (!it.crc32c) continue;
      items.push_back({it.offset, it.length, *it.crc32c,
                       "'" + EntryNamed(md, it.fqn_hash) + "' chunk " + std::to_string(it.chunk)});
    }
  } else {
    for (const auto& [index, info] : md.storage) {
      if (info.relative_path != name || !info.crc32c) continue;
      items.push_back({info.offset, info.length, *info.crc32c, index.ToString()});
    }
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
