// `dcp diff`: the differences between two checkpoints, by stored checksum or by value.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>

#include "dcp/storage/format/torch_dcp.h"
#include "tools/cli/cli_common.h"
#include "tools/cli/commands.h"

namespace dcp::cli {
namespace {

using nlohmann::ordered_json;

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

const char* KindName(bool tensor) { return tensor ? "tensor" : "bytes"; }

// With `json`, the differences (each with its text line as message), the entries the stored
// checksums could not compare and a summary go out as one document instead of lines.
class Differ {
 public:
  Differ(const std::string& pa, const std::string& pb, bool values, double atol, double rtol,
         bool json)
      : a_(OpenCheckpoint(pa)),
        b_(OpenCheckpoint(pb)),
        values_(values),
        atol_(atol),
        rtol_(rtol),
        json_(json) {}

  int Run() {
    CompareEntryNames();
    for (const auto& fqn : common_) CompareEntry(fqn);
    const std::string summary = Summary();
    const int exit = differences_ ? kFailed : kOk;
    if (!json_) {
      std::printf("%s\n", Printable(summary, true).c_str());
      return exit;
    }
    PrintJson(summary, exit);
    return exit;
  }

 private:
  void Report(const char* kind, const std::string& fqn, const std::string& s,
              ordered_json details = ordered_json::object()) {
    if (json_) {
      jdiffs_.push_back(
          {{"entry", fqn}, {"kind", kind}, {"details", std::move(details)}, {"message", s}});
    } else {
      std::printf("%s\n", Printable(s, true).c_str());  // it quotes names from the checkpoints
    }
    ++differences_;
  }

  void Uncompared(const std::string& fqn, const std::string& why) {
    ++not_compared_;
    jnot_compared_.push_back({{"entry", fqn}, {"reason", why}});
  }

  // Counts a value comparison; the data files are checked before the first value read.
  void StartValueComparison() {
    if (compared_ == 0) CheckDataFiles(a_), CheckDataFiles(b_);
    ++compared_;
  }

  // Entries only in one checkpoint are differences; the others are compared below.
  void CompareEntryNames() {
    for (const auto& [fqn, e] : a_.md.entries) {
      if (!b_.md.entries.count(fqn)) {
        Report("only_in_a", fqn, "only in A: " + fqn);
      } else {
        common_.push_back(fqn);
      }
    }
    for (const auto& [fqn, e] : b_.md.entries) {
      if (!a_.md.entries.count(fqn)) Report("only_in_b", fqn, "only in B: " + fqn);
    }
  }

  void CompareEntry(const std::string& fqn) {
    const auto* ta = std::get_if<TensorMetadata>(&a_.md.entries.at(fqn));
    const auto* tb = std::get_if<TensorMetadata>(&b_.md.entries.at(fqn));
    if (!ta != !tb) {
      Report("kind", fqn,
             std::string("kind differs: ") + fqn + ": " + KindName(ta) + " vs " + KindName(tb),
             {{"a", KindName(ta)}, {"b", KindName(tb)}});
      return;
    }
    if (!ta) {
      CompareBlob(fqn);
    } else {
      CompareTensor(fqn, *ta, *tb);
    }
  }

  void CompareBlob(const std::string& fqn) {
    const uint64_t la = ItemInfo(a_.md, fqn, {}).raw_length;
    const uint64_t lb = ItemInfo(b_.md, fqn, {}).raw_length;
    if (values_) {
      StartValueComparison();
      if (ReadBlob(*a_.store, a_.md, fqn) != ReadBlob(*b_.store, b_.md, fqn)) {
        Report("values", fqn, "bytes differ: " + fqn, {{"bytes_a", la}, {"bytes_b", lb}});
      }
    } else if (la != lb) {
      // Raw lengths: the same blob may be stored compressed in one and raw in the other.
      Report("size", fqn,
             "size differs: " + fqn + ": " + std::to_string(la) + " vs " + std::to_string(lb) +
                 " bytes",
             {{"bytes_a", la}, {"bytes_b", lb}});
    } else {
      size_t differing = 0;
      std::string why;
      const CrcVerdict v = CompareByCrc(a_.md, b_.md, fqn, {Shape{}}, &differing, &why);
      if (v == CrcVerdict::kDiffer) {
        Report("checksum", fqn, "bytes differ: " + fqn + " (stored checksums)",
               {{"differing_items", 1}, {"items", 1}});
      }
      if (v == CrcVerdict::kUnknown) {
        Uncompared(fqn, why);
      } else {
        ++by_crc_;
      }
    }
  }

  void CompareTensor(const std::string& fqn, const TensorMetadata& ta, const TensorMetadata& tb) {
    bool comparable = true;
    if (ta.dtype != tb.dtype) {
      Report("dtype", fqn,
             "dtype differs: " + fqn + ": " + std::string(DTypeName(ta.dtype)) + " vs " +
                 std::string(DTypeName(tb.dtype)),
             {{"a", DTypeName(ta.dtype)}, {"b", DTypeName(tb.dtype)}});
      comparable = false;
    }
    if (ta.shape != tb.shape) {
      Report("shape", fqn,
             "shape differs: " + fqn + ": " + ShapeToString(ta.shape) + " vs " +
                 ShapeToString(tb.shape),
             {{"a", ta.shape}, {"b", tb.shape}});
      comparable = false;
    }
    auto sorted = [](std::vector<ChunkMeta> v) {
      std::sort(v.begin(), v.end(),
                [](const ChunkMeta& x, const ChunkMeta& y) { return x.offsets < y.offsets; });
      return v;
    };
    const bool same_chunks = sorted(ta.chunks) == sorted(tb.chunks);
    if (comparable && !same_chunks) ReportChunking(fqn, ta, tb);
    if (!values_ && comparable && same_chunks) CompareTensorByCrc(fqn, ta);
    if (!values_ || !comparable) return;
    StartValueComparison();
    CompareTensorValues(fqn, ta.dtype);
  }

  void ReportChunking(const std::string& fqn, const TensorMetadata& ta, const TensorMetadata& tb) {
    const std::string s = "chunking differs: " + fqn + ": " + std::to_string(ta.chunks.size()) +
                          " vs " + std::to_string(tb.chunks.size()) + " chunks";
    const ordered_json details = {{"chunks_a", ta.chunks.size()}, {"chunks_b", tb.chunks.size()}};
    if (!values_) {
      Report("chunking", fqn, s, details);
      return;
    }
    // Layout only: the values are compared below, so not a difference of its own.
    if (json_) {
      jnotes_.push_back(
          {{"entry", fqn}, {"kind", "chunking"}, {"details", details}, {"message", s}});
    } else {
      std::printf("%s (layout only; values compared below)\n", Printable(s, true).c_str());
    }
  }

  void CompareTensorByCrc(const std::string& fqn, const TensorMetadata& ta) {
    std::vector<Shape> offsets;
    for (const auto& c : ta.chunks) offsets.push_back(c.offsets);
    size_t differing = 0;
    std::string why;
    const CrcVerdict v = CompareByCrc(a_.md, b_.md, fqn, offsets, &differing, &why);
    if (v == CrcVerdict::kDiffer) {
      Report("checksum", fqn,
             "values differ: " + fqn + ": " + std::to_string(differing) + " of " +
                 std::to_string(offsets.size()) +
                 " chunks by stored checksum (--values for the elements)",
             {{"differing_chunks", differing}, {"chunks", offsets.size()}});
    }
    if (v == CrcVerdict::kUnknown) {
      Uncompared(fqn, why);
    } else {
      ++by_crc_;
    }
  }

  void CompareTensorValues(const std::string& fqn, DType dtype) {
    TensorStream sa(*a_.store, a_.md, fqn), sb(*b_.store, b_.md, fqn);
    ValueDiff d;
    const char *pa_, *pb_;
    size_t na, nb;
    while (sa.Next(pa_, na) && sb.Next(pb_, nb)) {
      CompareValues(dtype, pa_, pb_, std::min(na, nb), atol_, rtol_, d);
    }
    if (!d.differing) return;
    char line[256];
    ordered_json details = {{"differing_elements", d.differing}, {"compared_elements", d.compared}};
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
    Report("values", fqn, line, std::move(details));
  }

  std::string Summary() const {
    const size_t entries = a_.md.entries.size();
    if (differences_) return std::to_string(differences_) + " difference(s)";
    if (values_) {
      return "no differences (" + std::to_string(entries) + " entries, " +
             std::to_string(compared_) + " compared by value)";
    }
    if (not_compared_ == 0) {
      return "no differences (" + std::to_string(entries) +
             " entries, compared by stored checksum)";
    }
    return "no differences in layout or stored checksums (" + std::to_string(entries) +
           " entries); " + std::to_string(not_compared_) +
           " entries have no comparable checksums (compressed, PyTorch records, none stored): "
           "--values compares them";
  }

  void PrintJson(const std::string& summary, int exit) {
    ordered_json j = {{"identical", differences_ == 0},
                      {"exit_code", exit},
                      {"a", a_.store->uri()},
                      {"b", b_.store->uri()},
                      {"mode", values_ ? "values" : "checksums"}};
    if (values_) j["tolerances"] = {{"atol", atol_}, {"rtol", rtol_}};
    j["differences"] = std::move(jdiffs_);
    if (values_) j["layout_notes"] = std::move(jnotes_);
    j["not_compared"] = std::move(jnot_compared_);
    j["summary"] = {{"entries_a", a_.md.entries.size()}, {"entries_b", b_.md.entries.size()},
                    {"common_entries", common_.size()},  {"differences", differences_},
                    {"compared_by_value", compared_},    {"compared_by_checksum", by_crc_},
                    {"not_compared", not_compared_},     {"message", summary}};
    std::cout << DumpJson(j) << "\n";
  }

  const Checkpoint a_, b_;
  const bool values_;
  const double atol_, rtol_;
  const bool json_;
  std::vector<std::string> common_;  // entries in both
  ordered_json jdiffs_ = ordered_json::array(), jnotes_ = ordered_json::array(),
               jnot_compared_ = ordered_json::array();
  int differences_ = 0;
  size_t compared_ = 0, by_crc_ = 0, not_compared_ = 0;
};

}  // namespace

int Diff(const std::string& pa, const std::string& pb, bool values, double atol, double rtol,
         bool json) {
  return Differ(pa, pb, values, atol, rtol, json).Run();
}

}  // namespace dcp::cli
