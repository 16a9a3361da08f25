// `dcp inspect`: a checkpoint's summary and its entries, as a table or one JSON document.
#include <fnmatch.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "tools/cli/cli_common.h"
#include "tools/cli/commands.h"

namespace dcp::cli {
namespace {

using nlohmann::ordered_json;

std::string Transforms(const Metadata& md, const std::string& fqn) {
  std::set<std::string> all;
  for (auto it = md.storage.lower_bound(MetadataIndex{fqn, {}, {}});
       it != md.storage.end() && it->first.fqn == fqn; ++it) {
    std::string t;
    for (const auto& x : it->second.transforms) t += (t.empty() ? "" : "+") + x;
    all.insert(t.empty() ? "raw" : t);
  }
  std::string s;
  for (const auto& t : all) s += (s.empty() ? "" : ",") + t;
  return s.empty() ? "raw" : s;
}

std::set<std::string> ReferencedFiles(const Metadata& md) {
  std::set<std::string> files;
  for (const auto& [idx, info] : md.storage) {
    if (info.relative_path.rfind("../", 0) != 0) files.insert(info.relative_path);  // own
  }
  return files;
}

// Version 3 (incremental saves): what the checkpoint keeps in earlier checkpoints' files, by
// checkpoint: items and stored bytes.
struct Shared {
  size_t items = 0;
  uint64_t bytes = 0;
};
std::map<std::string, Shared> SharedWith(const Metadata& md) {
  std::map<std::string, Shared> out;
  for (const auto& [idx, info] : md.storage) {
    const std::string& p = info.relative_path;
    if (p.rfind("../", 0) != 0) continue;
    Shared& s = out[p.substr(3, p.find('/', 3) - 3)];
    ++s.items;
    s.bytes += info.length;
  }
  return out;
}

std::string HashHex(const std::optional<ContentHash>& h) {
  if (!h) return "";
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%016llx%016llx", static_cast<unsigned long long>(h->high),
                static_cast<unsigned long long>(h->low));
  return buf;
}

bool Selected(const std::string& filter, const std::string& fqn) {
  return filter.empty() || ::fnmatch(filter.c_str(), fqn.c_str(), 0) == 0;
}

struct Counts {
  size_t tensors = 0, blobs = 0, files = 0;
};

Counts CountEntries(const Metadata& md) {
  Counts n;
  for (const auto& [fqn, e] : md.entries) {
    (std::holds_alternative<TensorMetadata>(e) ? n.tensors : n.blobs)++;
  }
  n.files = ReferencedFiles(md).size();
  return n;
}

// One entry of the JSON document: its kind, dtype and shape, and where each chunk is stored.
ordered_json EntryJson(const Metadata& md, const std::string& fqn, const EntryMetadata& e) {
  ordered_json je = {{"fqn", fqn}};
  ordered_json items = ordered_json::array();
  if (const auto* t = std::get_if<TensorMetadata>(&e)) {
    je["kind"] = "tensor";
    je["dtype"] = DTypeName(t->dtype);
    je["shape"] = t->shape;
    for (const auto& ch : t->chunks) {
      const StorageInfo& info = ItemInfo(md, fqn, ch.offsets);
      items.push_back({{"offsets", ch.offsets},
                       {"sizes", ch.sizes},
                       {"file", info.relative_path},
                       {"offset", info.offset},
                       {"length", info.length},
                       {"crc32c", info.crc32c ? ordered_json(*info.crc32c) : ordered_json()},
                       {"raw_length", info.raw_length},
                       {"transforms", info.transforms}});
      if (info.content_hash) items.back()["xxh3_128"] = HashHex(info.content_hash);
    }
  } else {
    je["kind"] = "bytes";
    const StorageInfo info = ItemInfo(md, fqn, {});  // a copy: {} is a temporary
    items.push_back({{"file", info.relative_path},
                     {"offset", info.offset},
                     {"length", info.length},
                     {"crc32c", info.crc32c ? ordered_json(*info.crc32c) : ordered_json()},
                     {"raw_length", info.raw_length},
                     {"transforms", info.transforms}});
    if (info.content_hash) items.back()["xxh3_128"] = HashHex(info.content_hash);
  }
  je["bytes"] = StoredBytesOf(md, fqn);
  je["transform"] = Transforms(md, fqn);
  je["chunks"] = std::move(items);
  return je;
}

// dcp records the world size; PyTorch DCP's is read off its data file names (__<rank>_<n>);
// safetensors has none (one per file is shown).
std::string WorldSizeSource(const Checkpoint& c) {
  if (c.format == "torchdcp" || c.format == "torchdcp113") return "data file names";
  if (c.format == "safetensors") return "file count";
  return "metadata";
}

void PrintJson(const Checkpoint& c, const Counts& n, const std::string& filter) {
  const Metadata& md = c.md;
  ordered_json j = {
      {"uri", c.store->uri()},
      {"format", c.format},
      {"checkpoint_id", md.checkpoint_id},
      {"save_id", md.save_id},
      {"world_size", md.world_size},
      {"world_size_source", WorldSizeSource(c)},
      {"created_unix_ns", md.created_unix_ns},
      {"created", md.created_unix_ns != 0 ? ordered_json(FormatTime(md.created_unix_ns))
                                          : ordered_json(nullptr)},
      {"library_version", md.library_version},
      {"format_version", md.format_version},
      {"total_bytes", md.TotalStoredBytes()},
      {"files", n.files},
      {"tensors", n.tensors},
      {"blobs", n.blobs}};
  ordered_json shared = ordered_json::array();
  for (const auto& [name, sh] : SharedWith(md)) {
    shared.push_back({{"checkpoint", name}, {"items", sh.items}, {"bytes", sh.bytes}});
  }
  j["shared"] = std::move(shared);
  ordered_json entries = ordered_json::array();
  for (const auto& [fqn, e] : md.entries) {
    if (Selected(filter, fqn)) entries.push_back(EntryJson(md, fqn, e));
  }
  j["entries"] = std::move(entries);
  std::cout << DumpJson(j) << "\n";
}

// Every string from the checkpoint is shown through Printable (a name may hold escape codes).
void PrintSummary(const Checkpoint& c, const Counts& n) {
  const Metadata& md = c.md;
  std::printf("checkpoint      %s\n", Printable(md.checkpoint_id).c_str());
  std::printf("location        %s\n", Printable(c.store->uri()).c_str());
  std::printf("save id         %s\n", Printable(md.save_id).c_str());
  const std::string source = WorldSizeSource(c);
  std::printf("world size      %d%s\n", md.world_size,
              source == "metadata" ? "" : (" (from " + source + ")").c_str());
  std::printf("created         %s\n", md.created_unix_ns != 0
                                          ? FormatTime(md.created_unix_ns).c_str()
                                          : "not recorded (this format keeps no date)");
  std::printf("library         %s (format version %u)\n", Printable(md.library_version).c_str(),
              md.format_version);
  std::printf("stored          %s (%llu bytes) in %zu files\n",
              FormatBytes(md.TotalStoredBytes()).c_str(),
              static_cast<unsigned long long>(md.TotalStoredBytes()), n.files);
  for (const auto& [name, sh] : SharedWith(md)) {
    std::printf("shared          %s (%zu items) in the files of the earlier checkpoint %s\n",
                FormatBytes(sh.bytes).c_str(), sh.items, Printable(name).c_str());
  }
  std::printf("entries         %zu tensors, %zu blobs\n\n", n.tensors, n.blobs);
}

using Row = std::array<std::string, 6>;

// The table's rows: a header, then one per selected entry.
std::vector<Row> EntryRows(const Metadata& md, const std::string& filter) {
  std::vector<Row> rows = {{"FQN", "DTYPE", "SHAPE", "CHUNKS", "BYTES", "TRANSFORM"}};
  for (const auto& [fqn, e] : md.entries) {
    if (!Selected(filter, fqn)) continue;
    if (const auto* t = std::get_if<TensorMetadata>(&e)) {
      rows.push_back({Printable(fqn), std::string(DTypeName(t->dtype)), ShapeToString(t->shape),
                      std::to_string(t->chunks.size()), std::to_string(StoredBytesOf(md, fqn)),
                      Transforms(md, fqn)});
    } else {
      rows.push_back({Printable(fqn), "bytes", "-", "1", std::to_string(StoredBytesOf(md, fqn)),
                      Transforms(md, fqn)});
    }
  }
  return rows;
}

// Columns padded to their widest cell; the counts (CHUNKS, BYTES) right-aligned.
void PrintTable(const std::vector<Row>& rows) {
  std::array<size_t, 6> width{};
  for (const auto& r : rows) {
    for (size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
  }
  for (const auto& r : rows) {
    std::string line;
    for (size_t i = 0; i < r.size(); ++i) {
      std::string cell = r[i];
      const bool right = i == 3 || i == 4;
      const std::string pad(width[i] - cell.size(), ' ');
      line += right ? pad + cell : cell + pad;
      if (i + 1 < r.size()) line += "  ";
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    std::printf("%s\n", line.c_str());
  }
}

}  // namespace

int Inspect(const std::string& path, const std::string& filter, bool json) {
  const Checkpoint c = OpenCheckpoint(path);
  const Counts n = CountEntries(c.md);
  if (json) {
    PrintJson(c, n, filter);
    return kOk;
  }
  PrintSummary(c, n);
  const std::vector<Row> rows = EntryRows(c.md, filter);
  PrintTable(rows);
  if (rows.size() == 1 && !filter.empty()) {
    std::printf("(no entry matches '%s')\n", Printable(filter).c_str());
  }
  return kOk;
}

}  // namespace dcp::cli
