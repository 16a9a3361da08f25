// dcp: inspect, verify, diff and convert checkpoints from the command line.
//
//   dcp inspect PATH [--filter GLOB] [--json]
//   dcp verify PATH [--json]
//   dcp diff A B [--values] [--atol X] [--rtol Y] [--json]
//   dcp convert SRC DST [--from FMT] [--to FMT] [--overwrite] [--compress zstd] [--json]
//   --plugin LIB (repeatable) loads a storage backend before anything else.
//   --json prints one JSON document on stdout, with the same exit code as without it; an error
//   prints {"error": {"category", "exit_code", "message"}} there (and the message on stderr).
// Needs neither MPI nor LibTorch (only the torch.save conversion needs LibTorch).
#include <fnmatch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "dcp/checkpoint.h"
#include "dcp/proto/checksum.h"
#include "dcp/proto/error.h"
#include "dcp/storage/checkpoint/store_checkpoint.h"
#include "dcp/storage/format/torch_dcp.h"
#include "dcp/storage/registry.h"
#include "tools/cli/cli_common.h"
#include "tools/cli/convert.h"

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
  for (const auto& [idx, info] : md.storage) files.insert(info.relative_path);
  return files;
}

// ---- inspect ----

int Inspect(const std::string& path, const std::string& filter, bool json) {
  const Checkpoint c = OpenCheckpoint(path);
  const Metadata& md = c.md;
  size_t tensors = 0, blobs = 0;
  for (const auto& [fqn, e] : md.entries) {
    (std::holds_alternative<TensorMetadata>(e) ? tensors : blobs)++;
  }
  const size_t files = ReferencedFiles(md).size();
  auto selected = [&](const std::string& fqn) {
    return filter.empty() || ::fnmatch(filter.c_str(), fqn.c_str(), 0) == 0;
  };
  if (json) {
    ordered_json j = {{"uri", c.store->uri()},
                      {"format", c.format},
                      {"checkpoint_id", md.checkpoint_id},
                      {"save_id", md.save_id},
                      {"world_size", md.world_size},
                      {"created_unix_ns", md.created_unix_ns},
                      {"created", FormatTime(md.created_unix_ns)},
                      {"library_version", md.library_version},
                      {"format_version", md.format_version},
                      {"total_bytes", md.TotalStoredBytes()},
                      {"files", files},
                      {"tensors", tensors},
                      {"blobs", blobs}};
    ordered_json entries = ordered_json::array();
    for (const auto& [fqn, e] : md.entries) {
      if (!selected(fqn)) continue;
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
      }
      je["bytes"] = StoredBytesOf(md, fqn);
      je["transform"] = Transforms(md, fqn);
      je["chunks"] = std::move(items);
      entries.push_back(std::move(je));
    }
    j["entries"] = std::move(entries);
    std::cout << j.dump(2) << "\n";
    return kOk;
  }
  std::printf("checkpoint      %s\n", md.checkpoint_id.c_str());
  std::printf("location        %s\n", c.store->uri().c_str());
  std::printf("save id         %s\n", md.save_id.c_str());
  std::printf("world size      %d\n", md.world_size);
  std::printf("created         %s\n", FormatTime(md.created_unix_ns).c_str());
  std::printf("library         %s (format version %u)\n", md.library_version.c_str(),
              md.format_version);
  std::printf("stored          %s (%llu bytes) in %zu files\n",
              FormatBytes(md.TotalStoredBytes()).c_str(),
              static_cast<unsigned long long>(md.TotalStoredBytes()), files);
  std::printf("entries         %zu tensors, %zu blobs\n\n", tensors, blobs);
  std::vector<std::array<std::string, 6>> rows = {
      {"FQN", "DTYPE", "SHAPE", "CHUNKS", "BYTES", "TRANSFORM"}};
  for (const auto& [fqn, e] : md.entries) {
    if (!selected(fqn)) continue;
    if (const auto* t = std::get_if<TensorMetadata>(&e)) {
      rows.push_back({fqn, std::string(DTypeName(t->dtype)), ShapeToString(t->shape),
                      std::to_string(t->chunks.size()), std::to_string(StoredBytesOf(md, fqn)),
                      Transforms(md, fqn)});
    } else {
      rows.push_back(
          {fqn, "bytes", "-", "1", std::to_string(StoredBytesOf(md, fqn)), Transforms(md, fqn)});
    }
  }
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
  if (rows.size() == 1 && !filter.empty()) {
    std::printf("(no entry matches '%s')\n", filter.c_str());
  }
  return kOk;
}

// ---- verify ----

// Verify applies load's rules without decompressing: sizes before reads, the CRC32C of every
// item that has one, transforms this build can read, a zstd frame header that declares the
// item's raw_length. Each problem carries the ErrorCode load would raise for it, so the exit
// code (ExitCodeFor, shared with convert and diff) is the same for the same damage: an
// unreadable transform (6) outranks damage (1). With `json`, the same findings (the text
// lines' wording as each one's message) go out as one document instead of lines.
int Verify(const std::string& path, bool json) {
  const Checkpoint c = OpenCheckpoint(path);
  const Metadata& md = c.md;
  Store& store = *c.store;
  struct Item {
    const MetadataIndex* index;
    const StorageInfo* info;
  };
  std::map<std::string, std::vector<Item>> by_file;
  for (const auto& [idx, info] : md.storage) by_file[info.relative_path].push_back({&idx, &info});
  for (auto& [f, items] : by_file) {
    std::sort(items.begin(), items.end(),
              [](const Item& a, const Item& b) { return a.info->offset < b.info->offset; });
  }
  // One finding: `kind` and the file and item it concerns for --json, `message` for both.
  struct Finding {
    std::string kind, file;
    const MetadataIndex* index;
    std::string message;
    int exit = kOk;
    // For --json: the size of a named file; the items or files a counting warning stands for.
    std::optional<uint64_t> bytes{}, count{};
  };
  std::vector<Finding> problems, warnings;
  int exit = kOk;
  auto problem = [&](ErrorCode code, std::string kind, const std::string& file,
                     const MetadataIndex* index, const std::string& what) {
    const int e = ExitCodeFor(code);
    problems.push_back({std::move(kind), file, index, what, e});
    if (exit == kOk || e == kUnsupported) exit = e;
  };
  auto name = [](const MetadataIndex& i) {
    return "'" + i.fqn + "'" + (i.offset.empty() ? "" : " chunk " + ShapeToString(i.offset));
  };
  size_t unchecked = 0, checked = 0;
  uint64_t bytes_read = 0;
  constexpr size_t kPiece = size_t{8} << 20;
  std::vector<char> buf;
  {
    Progress progress("verify", md.TotalStoredBytes());
    for (const auto& [file, items] : by_file) {
      std::optional<uint64_t> size;
      try {
        size = store.Size(file);
      } catch (const Error& e) {
        problem(e.code(), "stat_failed", file, nullptr,
                "cannot stat file '" + file + "': " + e.what());
        continue;
      }
      if (!size) {
        for (const Item& it : items) {
          problem(ErrorCode::kNotFound, "missing_file", file, it.index,
                  "missing file '" + file + "': " + name(*it.index) + " (" +
                      std::to_string(it.info->length) + " bytes at offset " +
                      std::to_string(it.info->offset) + ") cannot be read");
          progress.Add(it.info->length);
        }
        continue;
      }
      std::unique_ptr<ReadableObject> obj;
      for (const Item& it : items) {
        const StorageInfo& info = *it.info;
        if (info.offset > *size || info.length > *size - info.offset) {
          problem(ErrorCode::kCorruption, "truncated_file", file, it.index,
                  "truncated file '" + file + "' (" + std::to_string(*size) + " bytes): " +
                      name(*it.index) + " needs bytes [" + std::to_string(info.offset) + ", " +
                      std::to_string(info.offset + info.length) + ")");
          progress.Add(info.length);
          continue;
        }
        const bool torch_record =
            info.transforms.size() == 1 && info.transforms[0] == kTorchSaveTransform;
        if (!info.transforms.empty() && !IsZstdItem(info) && !torch_record) {
          std::string t;
          for (const auto& x : info.transforms) t += (t.empty() ? "" : ",") + x;
          problem(ErrorCode::kUnsupported, "unsupported_transform", file, it.index,
                  name(*it.index) + " in '" + file + "' uses transform '" + t +
                      "', which this build cannot read");
          progress.Add(info.length);
          continue;
        }
        try {
          if (!obj) obj = store.Open(file);
          if (torch_record) {
            // A torch.save archive: minizip reads every entry and checks its CRC-32; a tensor
            // record must hold the dtype and shape the metadata gives its chunk.
            const std::string what =
                name(*it.index) + " in '" + file + "' at offset " + std::to_string(info.offset);
            const bool tensor = !it.index->offset.empty() || std::holds_alternative<TensorMetadata>(
                                                                 md.entries.at(it.index->fqn));
            TorchTensorRecord rec;  // resolved from the same read of the record's directory
            CheckTorchArchiveCrcs(*obj, info.offset, info.length, what, tensor ? &rec : nullptr);
            bytes_read += info.length;
            if (tensor) {
              const auto& tm = std::get<TensorMetadata>(md.entries.at(it.index->fqn));
              Shape sizes;
              for (const auto& c : tm.chunks) {
                if (c.offsets == it.index->offset) sizes = c.sizes;
              }
              if (rec.dtype != tm.dtype || rec.sizes != sizes) {
                problem(ErrorCode::kCorruption, "record_mismatch", file, it.index,
                        what + " holds " + std::string(DTypeName(rec.dtype)) +
                            ShapeToString(rec.sizes) + ", the metadata says " +
                            std::string(DTypeName(tm.dtype)) + ShapeToString(sizes));
              }
            }
            ++checked;
            progress.Add(info.length);
            continue;
          }
          if (IsZstdItem(info)) {
            ZstdItemReader(*obj, info, false, 64, name(*it.index) + " in '" + file + "'")
                .CheckFrameHeader();
          }
          uint32_t crc = 0;
          for (uint64_t done = 0; done < info.length;) {
            const size_t n = static_cast<size_t>(std::min<uint64_t>(kPiece, info.length - done));
            buf.resize(n);
            obj->ReadAt(info.offset + done, buf.data(), n);
            crc = Crc32c(crc, buf.data(), n);
            done += n;
            bytes_read += n;
            progress.Add(n);
          }
          if (!info.crc32c) {
            ++unchecked;
          } else if (crc != *info.crc32c) {
            char line[160];
            std::snprintf(line, sizeof line,
                          " in file '%s' at offset %llu (%llu bytes): stored crc32c %08x, "
                          "computed %08x",
                          file.c_str(), static_cast<unsigned long long>(info.offset),
                          static_cast<unsigned long long>(info.length), *info.crc32c, crc);
            problem(ErrorCode::kCorruption, "checksum_mismatch", file, it.index,
                    "checksum mismatch: " + name(*it.index) + line);
          } else {
            ++checked;
          }
        } catch (const Error& e) {
          problem(e.code(), "read_failed", file, it.index,
                  "cannot read " + name(*it.index) + " from '" + file + "' at offset " +
                      std::to_string(info.offset) + ": " + e.what());
        }
      }
    }
  }
  if (unchecked) {
    warnings.push_back({"no_checksum", "", nullptr,
                        std::to_string(unchecked) + " of " + std::to_string(md.storage.size()) +
                            " items carried no checksum: their contents were not verified",
                        kOk, std::nullopt, unchecked});
  }
  // Stray files are named one by one (each costs a HEAD on s3://) up to a bound, then counted:
  // a listing of 700k crafted names must not cost 700k requests and lines.
  constexpr size_t kNamedStrays = 20;
  size_t strays = 0;
  try {
    for (const auto& n : store.List()) {
      if ((IsDataObjectName(n) || IsTorchDcpDataName(n)) && !by_file.count(n)) {
        if (++strays > kNamedStrays) continue;
        const auto size = store.Size(n);
        warnings.push_back({"unreferenced_file", n, nullptr,
                            "unreferenced data file '" + n + "' (" +
                                std::to_string(size.value_or(0)) +
                                " bytes; left by an interrupted or replaced save, safe to delete)",
                            kOk, size.value_or(0), std::nullopt});
      } else if (n.rfind(std::string(kMetadataName) + ".tmp.", 0) == 0 ||
                 n.rfind(std::string(kTorchDcpMetadataName) + ".tmp.", 0) == 0) {
        // A commit's temporary metadata that never became metadata.dcp (the save died between
        // writing and renaming it): not part of the checkpoint, so a warning, not damage.
        const auto size = store.Size(n);
        warnings.push_back({"leftover_temporary_metadata", n, nullptr,
                            "leftover temporary metadata file '" + n + "' (" +
                                std::to_string(size.value_or(0)) +
                                " bytes; left by an interrupted commit, safe to delete)",
                            kOk, size.value_or(0), std::nullopt});
      }
    }
    if (strays > kNamedStrays) {
      warnings.push_back(
          {"more_unreferenced_files", "", nullptr,
           "... and " + std::to_string(strays - kNamedStrays) + " more unreferenced data files",
           kOk, std::nullopt, strays - kNamedStrays});
    }
  } catch (const Error& e) {
    warnings.push_back({"list_failed", "", nullptr,
                        std::string("cannot list the checkpoint's objects: ") + e.what()});
  }
  std::string summary;
  if (!problems.empty()) {
    summary = "FAILED: " + c.store->uri() + ": " + std::to_string(problems.size()) +
              " problem(s) in " + std::to_string(md.storage.size()) + " stored items";
  } else {
    const std::string checksums =
        unchecked == 0
            ? "checksums (CRC32C, or zip CRC-32 for PyTorch DCP records), sizes and chunk "
              "tiling verified"
        : checked == 0
            ? "sizes and chunk tiling verified; NO item carried a checksum, so no "
              "contents were verified"
            : "sizes and chunk tiling verified; checksums verified for " + std::to_string(checked) +
                  " items, " + std::to_string(unchecked) + " carried none";
    summary = "OK: " + c.store->uri() + ": " + std::to_string(md.entries.size()) + " entries, " +
              std::to_string(md.storage.size()) + " stored items, " +
              FormatBytes(md.TotalStoredBytes()) + " in " + std::to_string(by_file.size()) +
              " files; " + checksums;
  }
  if (json) {
    auto finding = [](const Finding& f) {
      ordered_json j = {{"kind", f.kind}};
      j["file"] = f.file.empty() ? ordered_json() : ordered_json(f.file);
      j["entry"] = f.index ? ordered_json(f.index->fqn) : ordered_json();
      // A tensor chunk's offsets; null for a blob or a finding about a whole file.
      j["chunk"] =
          f.index && !f.index->offset.empty() ? ordered_json(f.index->offset) : ordered_json();
      if (f.exit != kOk) j["category"] = ExitCategory(f.exit);
      if (f.bytes) j["bytes"] = *f.bytes;
      if (f.count) j["count"] = *f.count;
      j["message"] = f.message;
      return j;
    };
    ordered_json jp = ordered_json::array(), jw = ordered_json::array();
    for (const auto& p : problems) jp.push_back(finding(p));
    for (const auto& w : warnings) jw.push_back(finding(w));
    const ordered_json j = {{"ok", problems.empty()},
                            {"exit_code", exit},
                            {"checkpoint", c.store->uri()},
                            {"format", c.format},
                            {"entries", md.entries.size()},
                            {"items", md.storage.size()},
                            {"files", by_file.size()},
                            {"stored_bytes", md.TotalStoredBytes()},
                            {"bytes_read", bytes_read},
                            {"items_checksum_verified", checked},
                            {"items_without_checksum", unchecked},
                            {"unreferenced_files", strays},
                            {"problems", std::move(jp)},
                            {"warnings", std::move(jw)},
                            {"summary", summary}};
    std::cout << j.dump(2) << "\n";
    return exit;
  }
  for (const auto& w : warnings) std::printf("warning: %s\n", w.message.c_str());
  for (const auto& p : problems) std::printf("error: %s\n", p.message.c_str());
  std::printf("%s\n", summary.c_str());
  return exit;
}

// ---- diff ----

struct ValueDiff {
  double max_abs = 0, max_rel = 0;
  uint64_t differing = 0, compared = 0;
  bool numeric = true;
};

void CompareValues(DType dtype, const char* a, const char* b, size_t nbytes, double atol,
                   double rtol, ValueDiff& d) {
  const size_t esize = ElementSize(dtype);
  const int comps = ComponentsPerElement(dtype);
  const size_t csize = esize / comps;
  const size_t n = nbytes / esize;
  for (size_t i = 0; i < n; ++i) {
    ++d.compared;
    if (std::memcmp(a + i * esize, b + i * esize, esize) == 0) continue;
    bool differs = false;
    for (int k = 0; k < comps; ++k) {
      const size_t ci = i * comps + k;
      double x, y;
      if (!ElementAsDouble(dtype, a, ci, x) || !ElementAsDouble(dtype, b, ci, y)) {
        d.numeric = false;
        differs = true;
        continue;
      }
      if (std::memcmp(a + ci * csize, b + ci * csize, csize) == 0) continue;
      double abs = std::fabs(x - y);
      if (std::isnan(abs)) abs = INFINITY;  // NaN against a number
      const double scale = std::max(std::fabs(x), std::fabs(y));
      const double rel = abs == 0 ? 0 : (scale == 0 || std::isinf(abs) ? INFINITY : abs / scale);
      d.max_abs = std::max(d.max_abs, abs);
      d.max_rel = std::max(d.max_rel, rel);
      if (IsIntegral(dtype) ? abs != 0 : abs > atol + rtol * std::fabs(y)) differs = true;
    }
    if (differs) ++d.differing;
  }
}

// Without --values, the stored checksums of an entry's items stand in for its values: items
// stored raw on both sides with a CRC32C compare by it (equal CRCs: equal bytes, but for a 2^-32
// chance). Anything else (compressed items, PyTorch records, no checksum) cannot be compared so.
enum class CrcVerdict { kEqual, kDiffer, kUnknown };

// Why `info` (of side A or B) has no checksum that stands for its values.
std::string NoComparableCrc(const StorageInfo& info, const char* side) {
  if (IsZstdItem(info)) return std::string("compressed (zstd) in ") + side;
  if (info.transforms.size() == 1 && info.transforms[0] == kTorchSaveTransform) {
    return std::string("a PyTorch DCP record in ") + side;
  }
  if (!info.transforms.empty()) return std::string("stored with a transform in ") + side;
  return std::string("no stored checksum in ") + side;
}

// On kUnknown, `why` says which item of which side has no comparable checksum.
CrcVerdict CompareByCrc(const Metadata& ma, const Metadata& mb, const std::string& fqn,
                        const std::vector<Shape>& offsets, size_t* differing, std::string* why) {
  CrcVerdict verdict = CrcVerdict::kEqual;
  for (const Shape& at : offsets) {
    const auto ia = ma.storage.lower_bound(MetadataIndex{fqn, at, {}});
    const auto ib = mb.storage.lower_bound(MetadataIndex{fqn, at, {}});
    if (ia == ma.storage.end() || ib == mb.storage.end() || ia->first.fqn != fqn ||
        ib->first.fqn != fqn || ia->first.offset != at || ib->first.offset != at) {
      *why = "no stored item for chunk " + ShapeToString(at);
      return CrcVerdict::kUnknown;
    }
    const StorageInfo &a = ia->second, &b = ib->second;
    if (!a.transforms.empty() || !a.crc32c) {
      *why = NoComparableCrc(a, "A");
      return CrcVerdict::kUnknown;
    }
    if (!b.transforms.empty() || !b.crc32c) {
      *why = NoComparableCrc(b, "B");
      return CrcVerdict::kUnknown;
    }
    if (*a.crc32c != *b.crc32c) {
      verdict = CrcVerdict::kDiffer;
      ++*differing;
    }
  }
  return verdict;
}

// With `json`, the differences (each with its text line as message), the entries the stored
// checksums could not compare and a summary go out as one document instead of lines.
int Diff(const std::string& pa, const std::string& pb, bool values, double atol, double rtol,
         bool json) {
  const Checkpoint a = OpenCheckpoint(pa);
  const Checkpoint b = OpenCheckpoint(pb);
  ordered_json jdiffs = ordered_json::array(), jnotes = ordered_json::array(),
               jnot_compared = ordered_json::array();
  int differences = 0;
  auto report = [&](const char* kind, const std::string& fqn, const std::string& s,
                    ordered_json details = ordered_json::object()) {
    if (json) {
      jdiffs.push_back(
          {{"entry", fqn}, {"kind", kind}, {"details", std::move(details)}, {"message", s}});
    } else {
      std::printf("%s\n", s.c_str());
    }
    ++differences;
  };
  std::vector<std::string> common;
  for (const auto& [fqn, e] : a.md.entries) {
    if (!b.md.entries.count(fqn)) {
      report("only_in_a", fqn, "only in A: " + fqn);
    } else {
      common.push_back(fqn);
    }
  }
  for (const auto& [fqn, e] : b.md.entries) {
    if (!a.md.entries.count(fqn)) report("only_in_b", fqn, "only in B: " + fqn);
  }
  size_t compared = 0, by_crc = 0, not_compared = 0;
  auto uncompared = [&](const std::string& fqn, const std::string& why) {
    ++not_compared;
    jnot_compared.push_back({{"entry", fqn}, {"reason", why}});
  };
  auto kind_name = [](bool tensor) { return tensor ? "tensor" : "bytes"; };
  for (const auto& fqn : common) {
    const auto& ea = a.md.entries.at(fqn);
    const auto& eb = b.md.entries.at(fqn);
    const auto* ta = std::get_if<TensorMetadata>(&ea);
    const auto* tb = std::get_if<TensorMetadata>(&eb);
    if (!ta != !tb) {
      report("kind", fqn,
             std::string("kind differs: ") + fqn + ": " + kind_name(ta) + " vs " + kind_name(tb),
             {{"a", kind_name(ta)}, {"b", kind_name(tb)}});
      continue;
    }
    if (!ta) {  // blobs
      const uint64_t la = ItemInfo(a.md, fqn, {}).raw_length;
      const uint64_t lb = ItemInfo(b.md, fqn, {}).raw_length;
      if (values) {
        if (compared == 0) CheckDataFiles(a), CheckDataFiles(b);  // before the first value read
        ++compared;
        if (ReadBlob(*a.store, a.md, fqn) != ReadBlob(*b.store, b.md, fqn)) {
          report("values", fqn, "bytes differ: " + fqn, {{"bytes_a", la}, {"bytes_b", lb}});
        }
      } else if (la != lb) {
        // Raw lengths: the same blob may be stored compressed in one and raw in the other.
        report("size", fqn,
               "size differs: " + fqn + ": " + std::to_string(la) + " vs " + std::to_string(lb) +
                   " bytes",
               {{"bytes_a", la}, {"bytes_b", lb}});
      } else {
        size_t differing = 0;
        std::string why;
        const CrcVerdict v = CompareByCrc(a.md, b.md, fqn, {Shape{}}, &differing, &why);
        if (v == CrcVerdict::kDiffer) {
          report("checksum", fqn, "bytes differ: " + fqn + " (stored checksums)",
                 {{"differing_items", 1}, {"items", 1}});
        }
        if (v == CrcVerdict::kUnknown) {
          uncompared(fqn, why);
        } else {
          ++by_crc;
        }
      }
      continue;
    }
    bool comparable = true;
    if (ta->dtype != tb->dtype) {
      report("dtype", fqn,
             "dtype differs: " + fqn + ": " + std::string(DTypeName(ta->dtype)) + " vs " +
                 std::string(DTypeName(tb->dtype)),
             {{"a", DTypeName(ta->dtype)}, {"b", DTypeName(tb->dtype)}});
      comparable = false;
    }
    if (ta->shape != tb->shape) {
      report("shape", fqn,
             "shape differs: " + fqn + ": " + ShapeToString(ta->shape) + " vs " +
                 ShapeToString(tb->shape),
             {{"a", ta->shape}, {"b", tb->shape}});
      comparable = false;
    }
    auto sorted = [](std::vector<ChunkMeta> v) {
      std::sort(v.begin(), v.end(),
                [](const ChunkMeta& x, const ChunkMeta& y) { return x.offsets < y.offsets; });
      return v;
    };
    const bool same_chunks = sorted(ta->chunks) == sorted(tb->chunks);
    if (comparable && !same_chunks) {
      const std::string s = "chunking differs: " + fqn + ": " + std::to_string(ta->chunks.size()) +
                            " vs " + std::to_string(tb->chunks.size()) + " chunks";
      const ordered_json details = {{"chunks_a", ta->chunks.size()},
                                    {"chunks_b", tb->chunks.size()}};
      if (values) {
        // Layout only: the values are compared below, so not a difference of its own.
        if (json) {
          jnotes.push_back(
              {{"entry", fqn}, {"kind", "chunking"}, {"details", details}, {"message", s}});
        } else {
          std::printf("%s (layout only; values compared below)\n", s.c_str());
        }
      } else {
        report("chunking", fqn, s, details);
      }
    }
    if (!values && comparable && same_chunks) {
      std::vector<Shape> offsets;
      for (const auto& c : ta->chunks) offsets.push_back(c.offsets);
      size_t differing = 0;
      std::string why;
      const CrcVerdict v = CompareByCrc(a.md, b.md, fqn, offsets, &differing, &why);
      if (v == CrcVerdict::kDiffer) {
        report("checksum", fqn,
               "values differ: " + fqn + ": " + std::to_string(differing) + " of " +
                   std::to_string(offsets.size()) +
                   " chunks by stored checksum (--values for the elements)",
               {{"differing_chunks", differing}, {"chunks", offsets.size()}});
      }
      if (v == CrcVerdict::kUnknown) {
        uncompared(fqn, why);
      } else {
        ++by_crc;
      }
    }
    if (!values || !comparable) continue;
    if (compared == 0) CheckDataFiles(a), CheckDataFiles(b);  // before the first value read
    ++compared;
    TensorStream sa(*a.store, a.md, fqn), sb(*b.store, b.md, fqn);
    ValueDiff d;
    const char *pa_, *pb_;
    size_t na, nb;
    while (sa.Next(pa_, na) && sb.Next(pb_, nb)) {
      CompareValues(ta->dtype, pa_, pb_, std::min(na, nb), atol, rtol, d);
    }
    if (d.differing) {
      char line[256];
      ordered_json details = {{"differing_elements", d.differing},
                              {"compared_elements", d.compared}};
      if (d.numeric) {
        std::snprintf(line, sizeof line,
                      "values differ: %s: %llu of %llu elements, max abs diff %.6g, max rel diff "
                      "%.6g",
                      fqn.c_str(), static_cast<unsigned long long>(d.differing),
                      static_cast<unsigned long long>(d.compared), d.max_abs, d.max_rel);
        // JSON has no infinity (NaN against a number, a difference from 0): null stands for it.
        details["max_abs_diff"] = std::isinf(d.max_abs) ? ordered_json() : ordered_json(d.max_abs);
        details["max_rel_diff"] = std::isinf(d.max_rel) ? ordered_json() : ordered_json(d.max_rel);
      } else {
        std::snprintf(line, sizeof line, "values differ: %s: %llu of %llu elements (bytewise)",
                      fqn.c_str(), static_cast<unsigned long long>(d.differing),
                      static_cast<unsigned long long>(d.compared));
        details["bytewise"] = true;
      }
      report("values", fqn, line, std::move(details));
    }
  }
  std::string summary;
  if (differences) {
    summary = std::to_string(differences) + " difference(s)";
  } else if (values) {
    summary = "no differences (" + std::to_string(a.md.entries.size()) + " entries, " +
              std::to_string(compared) + " compared by value)";
  } else if (not_compared == 0) {
    summary = "no differences (" + std::to_string(a.md.entries.size()) +
              " entries, compared by stored checksum)";
  } else {
    summary = "no differences in layout or stored checksums (" +
              std::to_string(a.md.entries.size()) + " entries); " + std::to_string(not_compared) +
              " entries have no comparable checksums (compressed, PyTorch records, none stored): "
              "--values compares them";
  }
  const int exit = differences ? kFailed : kOk;
  if (!json) {
    std::printf("%s\n", summary.c_str());
    return exit;
  }
  ordered_json j = {{"identical", differences == 0},
                    {"exit_code", exit},
                    {"a", a.store->uri()},
                    {"b", b.store->uri()},
                    {"mode", values ? "values" : "checksums"}};
  if (values) j["tolerances"] = {{"atol", atol}, {"rtol", rtol}};
  j["differences"] = std::move(jdiffs);
  if (values) j["layout_notes"] = std::move(jnotes);
  j["not_compared"] = std::move(jnot_compared);
  j["summary"] = {{"entries_a", a.md.entries.size()}, {"entries_b", b.md.entries.size()},
                  {"common_entries", common.size()},  {"differences", differences},
                  {"compared_by_value", compared},    {"compared_by_checksum", by_crc},
                  {"not_compared", not_compared},     {"message", summary}};
  std::cout << j.dump(2) << "\n";
  return exit;
}

// ---- convert ----

std::string GuessFormat(const std::string& path) {
  auto ends = [&](const char* s) {
    const std::string e(s);
    return path.size() >= e.size() && path.compare(path.size() - e.size(), e.size(), e) == 0;
  };
  if (ends(".safetensors")) return "safetensors";
  if (ends(".pt") || ends(".pth") || ends(".bin")) return "torch";
  const ParsedUri uri = ParseUri(path);
  if (uri.scheme == "torchdcp" || uri.scheme == "torchdcp113") return "torchdcp";
  if (auto f = uri.query.find("format"); f != uri.query.end()) {
    return f->second == "dcp" ? "dcp" : "torchdcp";  // torchdcp or torchdcp113
  }
  std::error_code ec;
  if (path.find("://") == std::string::npos &&
      std::filesystem::exists(std::filesystem::path(path) / kTorchDcpMetadataName, ec) &&
      !std::filesystem::exists(std::filesystem::path(path) / kMetadataName, ec)) {
    return "torchdcp";
  }
  return "dcp";
}

// Between checkpoint formats (dcp and PyTorch DCP, either direction, or re-layout within one):
// a load of everything, then a save. Holds the whole checkpoint in memory.
void ConvertCheckpoint(const std::string& src, std::string dst, const std::string& to,
                       const ConvertOptions& o) {
  // Diagnosed as every other command does (a missing source is "not a checkpoint", 3), before
  // the load, whose own error would say only "not found".
  CheckDataFiles(OpenCheckpoint(src));
  const StateDict sd = LoadAll(src);
  SaveOptions so;
  // PyTorch DCP's layout on any store: a path becomes torchdcp://, a URI gets the format unless
  // it names one itself (torchdcp113://, ?format=).
  if (to == "torchdcp" && dst.find("://") == std::string::npos) dst = "torchdcp://" + dst;
  const ParsedUri d = ParseUri(dst);
  if (to == "torchdcp" && d.scheme != "torchdcp" && d.scheme != "torchdcp113" &&
      !d.query.count("format")) {
    so.storage.format = CheckpointFormat::kTorchDcp;
  }
  so.storage.overwrite = o.overwrite;
  if (o.compress == "zstd") so.storage.compression = Compression::kZstd;
  so.storage.compression_level = o.compress_level;
  Save(sd, dst, so);
}

int Convert(const std::string& src, const std::string& dst, std::string from, std::string to,
            const ConvertOptions& o, bool json) {
  if (from.empty()) from = GuessFormat(src);
  if (to.empty()) to = GuessFormat(dst);
  if (o.compress != "none" && to != "dcp") {
    throw CliError{kUsage, "--compress applies to conversions to dcp"};
  }
  const bool ckpt_from = from == "dcp" || from == "torchdcp";
  if (ckpt_from && (to == "dcp" || to == "torchdcp")) {
    ConvertCheckpoint(src, dst, to, o);
  } else if (ckpt_from && to == "safetensors") {
    const Checkpoint c = OpenCheckpoint(src);
    CheckDataFiles(c);  // before anything the metadata claims is allocated or read
    ExportSafetensors(c, dst, o);
  } else if (from == "safetensors" && to == "dcp") {
    ImportSafetensors(src, dst, o);
  } else if (ckpt_from && to == "torch") {
    ConvertTorch(true, src, dst, o);
  } else if (from == "torch" && to == "dcp") {
    ConvertTorch(false, src, dst, o);
  } else {
    throw CliError{kUsage, "cannot convert " + from + " to " + to +
                               " (supported: dcp or torchdcp <-> safetensors, dcp <-> "
                               "torchdcp, dcp or torchdcp -> torch, torch -> dcp)"};
  }
  // What was written, read back from the result: a checkpoint's metadata (its data bytes), or
  // the file's size and the source checkpoint's entry count (a file's entries are its source's).
  size_t entries = 0;
  uint64_t bytes = 0;
  if (to == "dcp" || to == "torchdcp") {
    const Checkpoint out = OpenCheckpoint(
        to == "torchdcp" && dst.find("://") == std::string::npos ? "torchdcp://" + dst : dst);
    entries = out.md.entries.size();
    bytes = out.md.TotalStoredBytes();
  } else {
    entries = OpenCheckpoint(src).md.entries.size();
    bytes = std::filesystem::file_size(dst);
  }
  if (json) {
    const ordered_json j = {{"ok", true},
                            {"source", src},
                            {"destination", dst},
                            {"from", from},
                            {"to", to},
                            {"compression", o.compress},
                            {"overwrite", o.overwrite},
                            {"entries", entries},
                            {"bytes_written", bytes}};
    std::cout << j.dump(2) << "\n";
  } else {
    std::printf("converted %s (%s) -> %s (%s): %zu entries, %llu bytes\n", src.c_str(),
                from.c_str(), dst.c_str(), to.c_str(), entries,
                static_cast<unsigned long long>(bytes));
  }
  return kOk;
}

// For --json: an error as one JSON document on stdout (the message stays on stderr too, for a
// person watching), with the exit code it has without --json.
void PrintJsonError(const CliError& e) {
  const ordered_json j = {
      {"error",
       {{"category", ExitCategory(e.code)}, {"exit_code", e.code}, {"message", e.message}}}};
  std::cout << j.dump(2) << "\n";
}

int Main(int argc, char** argv) {
  CLI::App app{
      "dcp: inspect, verify, diff and convert dcp checkpoints.\n"
      "PATH is a directory, file://DIR, mem://NAME or a URI of a registered scheme."};
  app.footer(ExitCodeHelp());
  app.set_version_flag("--version", std::string("dcp ") + LibraryVersion());
  app.require_subcommand(1);
  app.fallthrough();
  std::vector<std::string> plugins;
  app.add_option("--plugin", plugins,
                 "load a storage backend plugin (a shared library) before opening PATH")
      ->type_name("LIB");

  std::string path, filter, other;
  bool json = false;
  auto* inspect = app.add_subcommand("inspect", "summary and table of a checkpoint's entries");
  inspect->add_option("PATH", path, "checkpoint location")->required();
  inspect->add_option("--filter", filter, "only entries whose fqn matches this glob")
      ->type_name("GLOB");
  inspect->add_flag("--json", json, "print one JSON document");

  auto* verify = app.add_subcommand(
      "verify", "read every stored item; check checksums, sizes and chunk tiling");
  verify->add_option("PATH", path, "checkpoint location")->required();
  verify->add_flag("--json", json, "print one JSON document (problems, warnings, counts)");

  bool values = false;
  double atol = 0, rtol = 0;
  auto* diff = app.add_subcommand("diff", "differences between two checkpoints");
  diff->add_option("A", path, "first checkpoint")->required();
  diff->add_option("B", other, "second checkpoint")->required();
  diff->add_flag("--values", values, "compare values too: per-tensor max abs and rel difference");
  diff->add_option("--atol", atol, "absolute tolerance for float values (default 0)");
  diff->add_option("--rtol", rtol, "relative tolerance for float values (default 0)");
  diff->add_flag("--json", json, "print one JSON document (differences, entries not compared)");

  std::string from, to;
  ConvertOptions co;
  auto* convert = app.add_subcommand(
      "convert",
      "convert between dcp, PyTorch DCP directories (torchdcp), safetensors, and torch.save "
      "files (with LibTorch)");
  convert->add_option("SRC", path, "source")->required();
  convert->add_option("DST", other, "destination")->required();
  convert->add_option("--from", from, "source format (default: from the name)")
      ->check(CLI::IsMember({"dcp", "torchdcp", "safetensors", "torch"}));
  convert
      ->add_option("--to", to,
                   "destination format (default: from the name: *.safetensors, "
                   "*.pt/*.pth/*.bin = torch, torchdcp:// or torchdcp113:// = torchdcp, else "
                   "dcp)")
      ->check(CLI::IsMember({"dcp", "torchdcp", "safetensors", "torch"}));
  convert->add_flag("--overwrite", co.overwrite, "replace an existing destination");
  convert
      ->add_option("--compress", co.compress,
                   "compress the items of a dcp destination (safetensors -> dcp): none (default) "
                   "or zstd; items that do not shrink by 10% are stored raw")
      ->check(CLI::IsMember({"none", "zstd"}));
  convert->add_option("--compress-level", co.compress_level, "zstd level (default 3)");
  size_t budget_mib = 64, budget_bytes = 0;
  convert->add_option("--piece-mib", budget_mib, "memory bound per streamed piece (default 64)");
  convert->add_option("--piece-bytes", budget_bytes, "the same in bytes (overrides --piece-mib)");
  convert->add_flag("--json", json, "print one JSON document (formats, entries, bytes written)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    // A bad command line may not have parsed --json itself: it counts where it was given.
    if (rc != 0 && std::any_of(argv + 1, argv + argc,
                               [](const char* a) { return std::strcmp(a, "--json") == 0; })) {
      PrintJsonError({kUsage, e.what()});
    }
    return rc == 0 ? kOk : kUsage;
  }
  try {
    for (const auto& p : plugins) LoadStoragePlugin(p);
    if (inspect->parsed()) return Inspect(path, filter, json);
    if (verify->parsed()) return Verify(path, json);
    if (diff->parsed()) return Diff(path, other, values, atol, rtol, json);
    if (convert->parsed()) {
      co.budget_bytes = budget_bytes ? budget_bytes : std::max<size_t>(1, budget_mib) << 20;
      return Convert(path, other, from, to, co, json);
    }
  } catch (...) {
    const CliError e = ClassifyCurrentException();
    std::fprintf(stderr, "dcp: error: %s\n", e.message.c_str());
    if (json) PrintJsonError(e);
    return e.code;
  }
  return kUsage;
}

}  // namespace
}  // namespace dcp::cli

int main(int argc, char** argv) { return dcp::cli::Main(argc, argv); }
