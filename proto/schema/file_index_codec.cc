// Version 2's file index (the byte layout at the end of each data file): encode, and decode
// with every check an untrusted index needs.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "dcp/proto/error.h"
#include "dcp/proto/schema/codec.h"

namespace dcp {

namespace {

void PutLe64(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t GetLe64(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}
constexpr char kIndexMagic[8] = {'D', 'C', 'P', 'I', 'D', 'X', '0', '1'};
constexpr char kIndexMagicV3[8] = {'D', 'C', 'P', 'I', 'D', 'X', '0', '2'};
constexpr char kBlockMagic[8] = {'D', 'C', 'P', 'B', 'L', 'K', '0', '1'};

}  // namespace

uint64_t FqnHash(std::string_view fqn) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : fqn) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ull;
  }
  h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
  h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
  return h ^ (h >> 31);
}

bool IsPlainObjectName(std::string_view p) {
  return !p.empty() && p != "." && p != ".." && p.find('/') == std::string_view::npos &&
         p.find('\\') == std::string_view::npos && p.find('\0') == std::string_view::npos;
}

bool IsSiblingReference(std::string_view p) {
  if (p.substr(0, 3) != "../") return false;
  p.remove_prefix(3);
  const size_t slash = p.find('/');
  return slash != std::string_view::npos && IsPlainObjectName(p.substr(0, slash)) &&
         IsPlainObjectName(p.substr(slash + 1));
}

std::string SiblingReference(std::string_view checkpoint, std::string_view file) {
  return "../" + std::string(checkpoint) + "/" + std::string(file);
}

std::string EncodeFileIndex(std::vector<FileIndexItem> items, uint32_t format_version) {
  const bool v3 = format_version >= 3;
  std::sort(items.begin(), items.end(), [](const FileIndexItem& a, const FileIndexItem& b) {
    return a.fqn_hash != b.fqn_hash ? a.fqn_hash < b.fqn_hash : a.chunk < b.chunk;
  });
  std::string out(v3 ? kIndexMagicV3 : kIndexMagic, sizeof(kIndexMagic));
  PutLe64(out, items.size(), 4);
  PutLe64(out, 0, 4);
  out.reserve(kFileIndexHeaderBytes + items.size() * FileIndexItemBytes(format_version));
  for (size_t i = 0; i < items.size(); ++i) {
    const FileIndexItem& it = items[i];
    if (i > 0 && it.fqn_hash == items[i - 1].fqn_hash && it.chunk == items[i - 1].chunk) {
      throw InternalError("file index: two items with key " + std::to_string(it.fqn_hash) + "/" +
                          std::to_string(it.chunk));
    }
    PutLe64(out, it.fqn_hash, 8);
    PutLe64(out, it.chunk, 4);
    PutLe64(out, it.offset, 8);
    PutLe64(out, it.length, 8);
    PutLe64(out, it.raw_length, 8);
    PutLe64(out, it.crc32c.value_or(0), 4);
    PutLe64(out, (it.crc32c ? 1u : 0u) | (it.zstd ? 2u : 0u), 1);
    if (!v3) {
      if (it.ref != 0) throw InternalError("file index: a reference needs format version 3");
      continue;
    }
    if (!it.hash) throw InternalError("file index: a version-3 item without its content hash");
    PutLe64(out, it.ref, 4);
    PutLe64(out, it.hash->low, 8);
    PutLe64(out, it.hash->high, 8);
  }
  return out;
}

std::vector<FileIndexItem> DecodeFileIndex(std::string_view bytes, uint64_t index_offset,
                                           const std::string& file, uint32_t format_version,
                                           const std::vector<uint64_t>& reference_sizes,
                                           bool references_unknown) {
  auto fail = [&](const std::string& what) -> CorruptionError {
    return CorruptionError("index of data file '" + file + "': " + what);
  };
  const bool v3 = format_version >= 3;
  const uint64_t item_bytes = FileIndexItemBytes(format_version);
  if (bytes.size() < kFileIndexHeaderBytes ||
      std::memcmp(bytes.data(), v3 ? kIndexMagicV3 : kIndexMagic, sizeof(kIndexMagic)) != 0) {
    throw fail("bad magic or too short (" + std::to_string(bytes.size()) + " bytes) for format " +
               "version " + std::to_string(format_version));
  }
  const uint64_t count = GetLe64(bytes.data() + 8, 4);
  if (GetLe64(bytes.data() + 12, 4) != 0) throw fail("reserved bytes are not zero");
  if (bytes.size() != kFileIndexHeaderBytes + count * item_bytes) {
    throw fail(std::to_string(count) + " items in " + std::to_string(bytes.size()) + " bytes");
  }
  std::vector<FileIndexItem> items(static_cast<size_t>(count));
  const char* p = bytes.data() + kFileIndexHeaderBytes;
  for (size_t i = 0; i < items.size(); ++i, p += item_bytes) {
    FileIndexItem& it = items[i];
    it.fqn_hash = GetLe64(p, 8);
    it.chunk = static_cast<uint32_t>(GetLe64(p + 8, 4));
    it.offset = GetLe64(p + 12, 8);
    it.length = GetLe64(p + 20, 8);
    it.raw_length = GetLe64(p + 28, 8);
    const uint32_t crc = static_cast<uint32_t>(GetLe64(p + 36, 4));
    const uint8_t flags = static_cast<uint8_t>(p[40]);
    if (flags & ~3u) throw fail("item " + std::to_string(i) + " has unknown flags");
    if (flags & 1u) it.crc32c = crc;
    it.zstd = (flags & 2u) != 0;
    if (i > 0) {
      const FileIndexItem& prev = items[i - 1];
      if (prev.fqn_hash > it.fqn_hash || (prev.fqn_hash == it.fqn_hash && prev.chunk >= it.chunk)) {
        throw fail("items are not sorted by key, or repeat one (item " + std::to_string(i) + ")");
      }
    }
    uint64_t end = index_offset;  // where the bytes of the item's file end
    if (v3) {
      it.ref = static_cast<uint32_t>(GetLe64(p + 41, 4));
      it.hash = ContentHash{GetLe64(p + 45, 8), GetLe64(p + 53, 8)};
      if (!references_unknown && it.ref > reference_sizes.size()) {
        throw fail("item " + std::to_string(i) + " points at reference " + std::to_string(it.ref) +
                   " of " + std::to_string(reference_sizes.size()));
      }
      if (it.ref != 0) end = references_unknown ? UINT64_MAX : reference_sizes[it.ref - 1];
    }
    if (it.offset > end || it.length > end - it.offset) {
      throw fail("item " + std::to_string(i) + " [" + std::to_string(it.offset) + ", +" +
                 std::to_string(it.length) + ") runs past the data (" + std::to_string(end) +
                 " bytes" + (it.ref != 0 ? " of its reference" : "") + ")");
    }
    if (!it.zstd && it.raw_length != it.length) {
      throw fail("item " + std::to_string(i) + " is raw but records " +
                 std::to_string(it.raw_length) + " raw bytes for " + std::to_string(it.length));
    }
    if (it.zstd && it.raw_length / kMaxZstdExpansion > it.length) {
      throw fail("item " + std::to_string(i) + " claims " + std::to_string(it.raw_length) +
                 " raw bytes from a " + std::to_string(it.length) + "-byte zstd frame");
    }
  }
  // No two items share bytes (a lying index could make two chunks read one range).
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  spans.reserve(items.size());
  for (const auto& it : items) {
    if (it.length > 0 && it.ref == 0) spans.emplace_back(it.offset, it.length);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i - 1].first + spans[i - 1].second > spans[i].first) {
      throw fail("two items overlap at byte " + std::to_string(spans[i].first));
    }
  }
  return items;
}

uint64_t TableBlocksOf(const FileIndexItem& item, uint32_t log2) {
  const uint64_t block = uint64_t{1} << log2;
  if (item.zstd || !item.crc32c || item.ref != 0 || item.length <= block) return 0;
  return (item.length + block - 1) >> log2;
}

std::string EncodeBlockTable(uint32_t log2, const std::vector<uint32_t>& crcs) {
  std::string out(kBlockMagic, sizeof(kBlockMagic));
  out.reserve(kBlockTableHeaderBytes + 4 * crcs.size());
  PutLe64(out, log2, 4);
  PutLe64(out, crcs.size(), 4);
  for (uint32_t c : crcs) PutLe64(out, c, 4);
  return out;
}

BlockTable DecodeBlockTable(std::string_view bytes, const std::string& file) {
  auto fail = [&](const std::string& what) -> CorruptionError {
    return CorruptionError("block table of data file '" + file + "': " + what);
  };
  if (bytes.size() < kBlockTableHeaderBytes ||
      std::memcmp(bytes.data(), kBlockMagic, sizeof(kBlockMagic)) != 0) {
    throw fail("bad magic or too short (" + std::to_string(bytes.size()) + " bytes)");
  }
  BlockTable t;
  const uint64_t log2 = GetLe64(bytes.data() + 8, 4);
  if (log2 < kMinBlockLog2 || log2 > kMaxBlockLog2) {
    throw fail("block size 2^" + std::to_string(log2) + " is out of range");
  }
  t.log2 = static_cast<uint32_t>(log2);
  const uint64_t count = GetLe64(bytes.data() + 12, 4);
  if (bytes.size() != kBlockTableHeaderBytes + 4 * count) {
    throw fail(std::to_string(count) + " blocks in " + std::to_string(bytes.size()) + " bytes");
  }
  t.crcs.resize(static_cast<size_t>(count));
  for (size_t i = 0; i < t.crcs.size(); ++i) {
    t.crcs[i] = static_cast<uint32_t>(GetLe64(bytes.data() + kBlockTableHeaderBytes + 4 * i, 4));
  }
  return t;
}

}  // namespace dcp
