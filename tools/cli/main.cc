// dcp: inspect, verify, diff and convert checkpoints from the command line.
//
//   dcp inspect PATH [--filter GLOB] [--json]
//   dcp verify PATH
//   dcp diff A B [--values] [--atol X] [--rtol Y]
//   dcp convert SRC DST [--from FMT] [--to FMT] [--overwrite] [--compress zstd]
//   --plugin LIB (repeatable) loads a storage backend before anything else.
// Needs neither MPI nor LibTorch (only the torch.save conversion needs LibTorch).
#include <fnmatch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "dcp/checkpoint.h"
#include "dcp/proto/checksum.h"
#include "dcp/proto/error.h"
#include "dcp/storage/registry.h"
#include "dcp/storage/store_checkpoint.h"
#include "dcp/storage/torch_dcp.h"
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
// unreadable transform (6) outranks damage (1).
int Verify(const std::string& path) {
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
  std::vector<std::string> problems, warnings;
  int exit = kOk;
  auto problem = [&](ErrorCode code, const std::string& what) {
    problems.push_back(what);
    const int e = ExitCodeFor(code);
    if (exit == kOk || e == kUnsupported) exit = e;
  };
  auto name = [](const MetadataIndex& i) {
    return "'" + i.fqn + "'" + (i.offset.empty() ? "" : " chunk " + ShapeToString(i.offset));
  };
  size_t unchecked = 0, checked = 0;
  constexpr size_t kPiece = size_t{8} << 20;
  std::vector<char> buf;
  {
    Progress progress("verify", md.TotalStoredBytes());
    for (const auto& [file, items] : by_file) {
      std::optional<uint64_t> size;
      try {
        size = store.Size(file);
      } catch (const Error& e) {
        problem(e.code(), "cannot stat file '" + file + "': " + e.what());
        continue;
      }
      if (!size) {
        for (const Item& it : items) {
          problem(ErrorCode::kNotFound, "missing file '" + file + "': " + name(*it.index) + " (" +
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
          problem(ErrorCode::kCorruption,
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
          problem(ErrorCode::kUnsupported, name(*it.index) + " in '" + file + "' uses transform '" +
                                               t + "', which this build cannot read");
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
            const bool tensor =
                !it.index->offset.empty() ||
                std::holds_alternative<TensorMetadata>(md.entries.at(it.index->fqn));
            TorchTensorRecord rec;  // resolved from the same read of the record's directory
            CheckTorchArchiveCrcs(*obj, info.offset, info.length, what, tensor ? &rec : nullptr);
            if (tensor) {
              const auto& tm = std::get<TensorMetadata>(md.entries.at(it.index->fqn));
              Shape sizes;
              for (const auto& c : tm.chunks) {
                if (c.offsets == it.index->offset) sizes = c.sizes;
              }
              if (rec.dtype != tm.dtype || rec.sizes != sizes) {
                problem(ErrorCode::kCorruption,
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
            problem(ErrorCode::kCorruption, "checksum mismatch: " + name(*it.index) + line);
          } else {
            ++checked;
          }
        } catch (const Error& e) {
          problem(e.code(), "cannot read " + name(*it.index) + " from '" + file + "' at offset " +
                                std::to_string(info.offset) + ": " + e.what());
        }
      }
    }
  }
  if (unchecked) {
    warnings.push_back(std::to_string(unchecked) + " of " + std::to_string(md.storage.size()) +
                       " items carried no checksum: their contents were not verified");
  }
  try {
    // Stray files are named one by one (each costs a HEAD on s3://) up to a bound, then counted:
    // a listing of 700k crafted names must not cost 700k requests and lines.
    constexpr size_t kNamedStrays = 20;
    size_t strays = 0;
    for (const auto& n : store.List()) {
      if ((IsDataObjectName(n) || IsTorchDcpDataName(n)) && !by_file.count(n)) {
        if (++strays > kNamedStrays) continue;
        const auto size = store.Size(n);
        warnings.push_back("unreferenced data file '" + n + "' (" +
                           std::to_string(size.value_or(0)) +
                           " bytes; left by an interrupted or replaced save, safe to delete)");
      } else if (n.rfind(std::string(kMetadataName) + ".tmp.", 0) == 0 ||
                 n.rfind(std::string(kTorchDcpMetadataName) + ".tmp.", 0) == 0) {
        // A commit's temporary metadata that never became metadata.dcp (the save died between
        // writing and renaming it): not part of the checkpoint, so a warning, not damage.
        const auto size = store.Size(n);
        warnings.push_back("leftover temporary metadata file '" + n + "' (" +
                           std::to_string(size.value_or(0)) +
                           " bytes; left by an interrupted commit, safe to delete)");
      }
    }
    if (strays > kNamedStrays) {
      warnings.push_back("... and " + std::to_string(strays - kNamedStrays) +
                         " more unreferenced data files");
    }
  } catch (const Error& e) {
    warnings.push_back(std::string("cannot list the checkpoint's objects: ") + e.what());
  }
  for (const auto& w : warnings) std::printf("warning: %s\n", w.c_str());
  if (!problems.empty()) {
    for (const auto& p : problems) std::printf("error: %s\n", p.c_str());
    std::printf("FAILED: %s: %zu problem(s) in %zu stored items\n", c.store->uri().c_str(),
                problems.size(), md.storage.size());
    return exit;
  }
  const std::string checksums =
      unchecked == 0 ? "checksums (CRC32C, or zip CRC-32 for PyTorch DCP records), sizes and chunk "
                       "tiling verified"
      : checked == 0
          ? "sizes and chunk tiling verified; NO item carried a checksum, so no "
            "contents were verified"
          : "sizes and chunk tiling verified; checksums verified for " + std::to_string(checked) +
                " items, " + std::to_string(unchecked) + " carried none";
  std::printf("OK: %s: %zu entries, %zu stored items, %s in %zu files; %s\n",
              c.store->uri().c_str(), md.entries.size(), md.storage.size(),
              FormatBytes(md.TotalStoredBytes()).c_str(), by_file.size(), checksums.c_str());
  return kOk;
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

CrcVerdict CompareByCrc(const Metadata& ma, const Metadata& mb, const std::string& fqn,
                        const std::vector<Shape>& offsets, size_t* differing) {
  CrcVerdict verdict = CrcVerdict::kEqual;
  for (const Shape& at : offsets) {
    const auto ia = ma.storage.lower_bound(MetadataIndex{fqn, at, {}});
    const auto ib = mb.storage.lower_bound(MetadataIndex{fqn, at, {}});
    if (ia == ma.storage.end() || ib == mb.storage.end() || ia->first.fqn != fqn ||
        ib->first.fqn != fqn || ia->first.offset != at || ib->first.offset != at) {
      return CrcVerdict::kUnknown;
    }
    const StorageInfo &a = ia->second, &b = ib->second;
    if (!a.transforms.empty() || !b.transforms.empty() || !a.crc32c || !b.crc32c) {
      return CrcVerdict::kUnknown;
    }
    if (*a.crc32c != *b.crc32c) {
      verdict = CrcVerdict::kDiffer;
      ++*differing;
    }
  }
  return verdict;
}

int Diff(const std::string& pa, const std::string& pb, bool values, double atol, double rtol) {
  const Checkpoint a = OpenCheckpoint(pa);
  const Checkpoint b = OpenCheckpoint(pb);
  int differences = 0;
  auto report = [&](const std::string& s) {
    std::printf("%s\n", s.c_str());
    ++differences;
  };
  std::vector<std::string> common;
  for (const auto& [fqn, e] : a.md.entries) {
    if (!b.md.entries.count(fqn)) {
      report("only in A: " + fqn);
    } else {
      common.push_back(fqn);
    }
  }
  for (const auto& [fqn, e] : b.md.entries) {
    if (!a.md.entries.count(fqn)) report("only in B: " + fqn);
  }
  size_t compared = 0, not_compared = 0;
  for (const auto& fqn : common) {
    const auto& ea = a.md.entries.at(fqn);
    const auto& eb = b.md.entries.at(fqn);
    const auto* ta = std::get_if<TensorMetadata>(&ea);
    const auto* tb = std::get_if<TensorMetadata>(&eb);
    if (!ta != !tb) {
      report(std::string("kind differs: ") + fqn + ": " + (ta ? "tensor" : "bytes") + " vs " +
             (tb ? "tensor" : "bytes"));
      continue;
    }
    if (!ta) {  // blobs
      if (values) {
        if (compared == 0) CheckDataFiles(a), CheckDataFiles(b);  // before the first value read
        ++compared;
        if (ReadBlob(*a.store, a.md, fqn) != ReadBlob(*b.store, b.md, fqn)) {
          report("bytes differ: " + fqn);
        }
      } else if (ItemInfo(a.md, fqn, {}).raw_length != ItemInfo(b.md, fqn, {}).raw_length) {
        // Raw lengths: the same blob may be stored compressed in one and raw in the other.
        report("size differs: " + fqn + ": " + std::to_string(ItemInfo(a.md, fqn, {}).raw_length) +
               " vs " + std::to_string(ItemInfo(b.md, fqn, {}).raw_length) + " bytes");
      } else {
        size_t differing = 0;
        const CrcVerdict v = CompareByCrc(a.md, b.md, fqn, {Shape{}}, &differing);
        if (v == CrcVerdict::kDiffer) report("bytes differ: " + fqn + " (stored checksums)");
        if (v == CrcVerdict::kUnknown) ++not_compared;
      }
      continue;
    }
    bool comparable = true;
    if (ta->dtype != tb->dtype) {
      report("dtype differs: " + fqn + ": " + std::string(DTypeName(ta->dtype)) + " vs " +
             std::string(DTypeName(tb->dtype)));
      comparable = false;
    }
    if (ta->shape != tb->shape) {
      report("shape differs: " + fqn + ": " + ShapeToString(ta->shape) + " vs " +
             ShapeToString(tb->shape));
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
      if (values) {
        std::printf("%s (layout only; values compared below)\n", s.c_str());
      } else {
        report(s);
      }
    }
    if (!values && comparable && same_chunks) {
      std::vector<Shape> offsets;
      for (const auto& c : ta->chunks) offsets.push_back(c.offsets);
      size_t differing = 0;
      const CrcVerdict v = CompareByCrc(a.md, b.md, fqn, offsets, &differing);
      if (v == CrcVerdict::kDiffer) {
        report("values differ: " + fqn + ": " + std::to_string(differing) + " of " +
               std::to_string(offsets.size()) +
               " chunks by stored checksum (--values for the elements)");
      }
      if (v == CrcVerdict::kUnknown) ++not_compared;
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
      if (d.numeric) {
        std::snprintf(line, sizeof line,
                      "values differ: %s: %llu of %llu elements, max abs diff %.6g, max rel diff "
                      "%.6g",
                      fqn.c_str(), static_cast<unsigned long long>(d.differing),
                      static_cast<unsigned long long>(d.compared), d.max_abs, d.max_rel);
      } else {
        std::snprintf(line, sizeof line, "values differ: %s: %llu of %llu elements (bytewise)",
                      fqn.c_str(), static_cast<unsigned long long>(d.differing),
                      static_cast<unsigned long long>(d.compared));
      }
      report(line);
    }
  }
  if (differences) {
    std::printf("%d difference(s)\n", differences);
    return kFailed;
  }
  if (values) {
    std::printf("no differences (%zu entries, %zu compared by value)\n", a.md.entries.size(),
                compared);
  } else if (not_compared == 0) {
    std::printf("no differences (%zu entries, compared by stored checksum)\n",
                a.md.entries.size());
  } else {
    std::printf("no differences in layout or stored checksums (%zu entries); %zu entries have no "
                "comparable checksums (compressed, PyTorch records, none stored): --values compares "
                "them\n",
                a.md.entries.size(), not_compared);
  }
  return kOk;
}

// ---- convert ----

std::string GuessFormat(const std::string& path) {
  auto ends = [&](const char* s) {
    const std::string e(s);
    return path.size() >= e.size() && path.compare(path.size() - e.size(), e.size(), e) == 0;
  };
  if (ends(".safetensors")) return "safetensors";
  if (ends(".pt") || ends(".pth") || ends(".bin")) return "torch";
  const std::string scheme = SplitUri(path).first;
  if (scheme == "torchdcp" || scheme == "torchdcp113") return "torchdcp";
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
  StateDict sd;
  LoadOptions lo;
  lo.load_all = true;
  Load(sd, src, lo);
  if (to == "torchdcp" && dst.find("://") == std::string::npos) dst = "torchdcp://" + dst;
  SaveOptions so;
  so.storage.overwrite = o.overwrite;
  if (o.compress == "zstd") so.storage.compression = Compression::kZstd;
  so.storage.compression_level = o.compress_level;
  Save(sd, dst, so);
}

int Convert(const std::string& src, const std::string& dst, std::string from, std::string to,
            const ConvertOptions& o) {
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
  std::printf("converted %s (%s) -> %s (%s)\n", src.c_str(), from.c_str(), dst.c_str(), to.c_str());
  return kOk;
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

  bool values = false;
  double atol = 0, rtol = 0;
  auto* diff = app.add_subcommand("diff", "differences between two checkpoints");
  diff->add_option("A", path, "first checkpoint")->required();
  diff->add_option("B", other, "second checkpoint")->required();
  diff->add_flag("--values", values, "compare values too: per-tensor max abs and rel difference");
  diff->add_option("--atol", atol, "absolute tolerance for float values (default 0)");
  diff->add_option("--rtol", rtol, "relative tolerance for float values (default 0)");

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

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? kOk : kUsage;
  }
  try {
    for (const auto& p : plugins) LoadStoragePlugin(p);
    if (inspect->parsed()) return Inspect(path, filter, json);
    if (verify->parsed()) return Verify(path);
    if (diff->parsed()) return Diff(path, other, values, atol, rtol);
    if (convert->parsed()) {
      co.budget_bytes = budget_bytes ? budget_bytes : std::max<size_t>(1, budget_mib) << 20;
      return Convert(path, other, from, to, co);
    }
  } catch (...) {
    const CliError e = ClassifyCurrentException();
    std::fprintf(stderr, "dcp: error: %s\n", e.message.c_str());
    return e.code;
  }
  return kUsage;
}

}  // namespace
}  // namespace dcp::cli

int main(int argc, char** argv) { return dcp::cli::Main(argc, argv); }
