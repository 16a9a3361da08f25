// `dcp verify`: read every stored item of a checkpoint and check it as a load would.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <tuple>

#include "dcp/proto/checksum.h"
#include "dcp/proto/error.h"
#include "dcp/storage/format/dcp_layout.h"
#include "dcp/storage/format/torch_dcp.h"
#include "tools/cli/cli_common.h"
#include "tools/cli/commands.h"

namespace dcp::cli {
namespace {

using nlohmann::ordered_json;

constexpr size_t kPiece = size_t{8} << 20;
// Stray files are named one by one (each costs a HEAD on s3://) up to a bound, then counted:
// a listing of 700k crafted names must not cost 700k requests and lines.
constexpr size_t kNamedStrays = 20;

struct Item {
  const MetadataIndex* index;
  const StorageInfo* info;
};

// One finding: `kind` and the file and item it concerns for --json, `message` for both.
struct Finding {
  std::string kind, file;
  const MetadataIndex* index;
  std::string message;
  int exit = kOk;
  // For --json: the size of a named file; the items or files a counting warning stands for.
  std::optional<uint64_t> bytes{}, count{};
};

std::string ItemName(const MetadataIndex& i) {
  return "'" + i.fqn + "'" + (i.offset.empty() ? "" : " chunk " + ShapeToString(i.offset));
}

// Each data file's items, by offset.
std::map<std::string, std::vector<Item>> ItemsByFile(const Metadata& md) {
  std::map<std::string, std::vector<Item>> by_file;
  for (const auto& [idx, info] : md.storage) by_file[info.relative_path].push_back({&idx, &info});
  for (auto& [f, items] : by_file) {
    std::sort(items.begin(), items.end(),
              [](const Item& a, const Item& b) { return a.info->offset < b.info->offset; });
  }
  return by_file;
}

ordered_json FindingJson(const Finding& f) {
  ordered_json j = {{"kind", f.kind}};
  j["file"] = f.file.empty() ? ordered_json() : ordered_json(f.file);
  j["entry"] = f.index ? ordered_json(f.index->fqn) : ordered_json();
  // A tensor chunk's offsets; null for a blob or a finding about a whole file.
  j["chunk"] = f.index && !f.index->offset.empty() ? ordered_json(f.index->offset) : ordered_json();
  if (f.exit != kOk) j["category"] = ExitCategory(f.exit);
  if (f.bytes) j["bytes"] = *f.bytes;
  if (f.count) j["count"] = *f.count;
  j["message"] = f.message;
  return j;
}

// Verify applies load's rules without decompressing: sizes before reads, the CRC32C of every
// item that has one, transforms this build can read, a zstd frame header that declares the
// item's raw_length. Each problem carries the ErrorCode load would raise for it, so the exit
// code (ExitCodeFor, shared with convert and diff) is the same for the same damage: an
// unreadable transform (6) outranks damage (1). With `json`, the same findings (the text
// lines' wording as each one's message) go out as one document instead of lines.
class Verifier {
 public:
  explicit Verifier(const Checkpoint& c)
      : c_(c), md_(c.md), store_(*c.store), by_file_(ItemsByFile(c.md)) {}

  int Run(bool json) {
    CheckAllItems();
    WarnUnchecked();
    FindStrayFiles();
    const std::string summary = Summary();
    if (json) {
      PrintJson(summary);
      return exit_;
    }
    // Messages quote names from the checkpoint: shown through Printable.
    for (const auto& w : warnings_) {
      std::printf("warning: %s\n", Printable(w.message, true).c_str());
    }
    for (const auto& p : problems_) {
      std::printf("error: %s\n", Printable(p.message, true).c_str());
    }
    std::printf("%s\n", Printable(summary, true).c_str());
    return exit_;
  }

 private:
  void Problem(ErrorCode code, std::string kind, const std::string& file,
               const MetadataIndex* index, const std::string& what) {
    const int e = ExitCodeFor(code);
    problems_.push_back({std::move(kind), file, index, what, e});
    if (exit_ == kOk || e == kUnsupported) exit_ = e;
  }

  void CheckAllItems() {
    Progress progress("verify", md_.TotalStoredBytes());
    for (const auto& [file, items] : by_file_) CheckFile(file, items, progress);
    CheckFileTable();
  }

  // Version 2: a load refuses a checkpoint whose file table lists a file that is missing or
  // shorter than recorded, whether or not an item lies in it, so verify does too.
  void CheckFileTable() {
    for (const DataFile& f : md_.files) {
      if (by_file_.count(f.name)) continue;  // its items were checked, and its presence
      std::optional<uint64_t> size;
      try {
        size = store_.Size(f.name);
      } catch (const Error& e) {
        Problem(e.code(), "stat_failed", f.name, nullptr,
                "cannot stat file '" + f.name + "': " + e.what());
        continue;
      }
      if (!size) {
        Problem(ErrorCode::kNotFound, "missing_file", f.name, nullptr,
                "missing file '" + f.name +
                    "': the metadata's file table lists it, and a load refuses the checkpoint "
                    "without it");
      } else if (*size < f.size) {
        Problem(ErrorCode::kCorruption, "truncated_file", f.name, nullptr,
                "truncated file '" + f.name + "' (" + std::to_string(*size) +
                    " bytes, the file table records " + std::to_string(f.size) + ")");
      }
    }
  }

  void CheckFile(const std::string& file, const std::vector<Item>& items, Progress& progress) {
    std::optional<uint64_t> size;
    try {
      size = store_.Size(file);
    } catch (const Error& e) {
      Problem(e.code(), "stat_failed", file, nullptr,
              "cannot stat file '" + file + "': " + e.what());
      return;
    }
    if (!size) {
      for (const Item& it : items) {
        Problem(ErrorCode::kNotFound, "missing_file", file, it.index,
                "missing file '" + file + "': " + ItemName(*it.index) + " (" +
                    std::to_string(it.info->length) + " bytes at offset " +
                    std::to_string(it.info->offset) + ") cannot be read");
        progress.Add(it.info->length);
      }
      return;
    }
    std::unique_ptr<ReadableObject> obj;
    for (const Item& it : items) CheckItem(file, *size, it, obj, progress);
  }

  // `obj`: the file, opened at its first item that is read.
  void CheckItem(const std::string& file, uint64_t size, const Item& it,
                 std::unique_ptr<ReadableObject>& obj, Progress& progress) {
    const StorageInfo& info = *it.info;
    if (info.offset > size || info.length > size - info.offset) {
      Problem(ErrorCode::kCorruption, "truncated_file", file, it.index,
              "truncated file '" + file + "' (" + std::to_string(size) + " bytes): " +
                  ItemName(*it.index) + " needs bytes [" + std::to_string(info.offset) + ", " +
                  std::to_string(info.offset + info.length) + ")");
      progress.Add(info.length);
      return;
    }
    const bool torch_record =
        info.transforms.size() == 1 && info.transforms[0] == kTorchSaveTransform;
    if (!info.transforms.empty() && !IsZstdItem(info) && !torch_record) {
      std::string t;
      for (const auto& x : info.transforms) t += (t.empty() ? "" : ",") + x;
      Problem(ErrorCode::kUnsupported, "unsupported_transform", file, it.index,
              ItemName(*it.index) + " in '" + file + "' uses transform '" + t +
                  "', which this build cannot read");
      progress.Add(info.length);
      return;
    }
    try {
      if (!obj) obj = store_.Open(file);
      if (torch_record) {
        CheckTorchRecord(*obj, file, it);
        ++checked_;
        progress.Add(info.length);
        return;
      }
      CheckStoredBytes(*obj, file, it, progress);
    } catch (const Error& e) {
      Problem(e.code(), "read_failed", file, it.index,
              "cannot read " + ItemName(*it.index) + " from '" + file + "' at offset " +
                  std::to_string(info.offset) + ": " + e.what());
    }
  }

  // A torch.save archive: every entry is read and its CRC-32 checked (zip64 included); a tensor
  // record must hold the dtype and shape the metadata gives its chunk.
  void CheckTorchRecord(ReadableObject& obj, const std::string& file, const Item& it) {
    const StorageInfo& info = *it.info;
    const std::string what =
        ItemName(*it.index) + " in '" + file + "' at offset " + std::to_string(info.offset);
    const bool tensor = !it.index->offset.empty() ||
                        std::holds_alternative<TensorMetadata>(md_.entries.at(it.index->fqn));
    // Items may share one record (crafted metadata can point thousands at one): each record is
    // read and checked once, its outcome reused (a failure is reported for every item in it).
    const RecordKey key{file, info.offset, info.length, tensor};
    auto known = records_.find(key);
    if (known == records_.end()) {
      CheckedRecord checked;
      try {
        // rec is resolved from the same read of the record's directory
        CheckTorchArchiveCrcs(obj, info.offset, info.length, what, tensor ? &checked.rec : nullptr);
      } catch (const Error&) {
        checked.error = std::current_exception();
      }
      bytes_read_ += info.length;
      known = records_.emplace(key, std::move(checked)).first;
    }
    if (known->second.error) std::rethrow_exception(known->second.error);
    const TorchTensorRecord& rec = known->second.rec;
    if (!tensor) return;
    const auto& tm = std::get<TensorMetadata>(md_.entries.at(it.index->fqn));
    Shape sizes;
    for (const auto& c : tm.chunks) {
      if (c.offsets == it.index->offset) sizes = c.sizes;
    }
    if (rec.dtype != tm.dtype || rec.sizes != sizes) {
      Problem(ErrorCode::kCorruption, "record_mismatch", file, it.index,
              what + " holds " + std::string(DTypeName(rec.dtype)) + ShapeToString(rec.sizes) +
                  ", the metadata says " + std::string(DTypeName(tm.dtype)) + ShapeToString(sizes));
    }
  }

  // A plain or zstd item: its stored bytes against their CRC32C (a zstd item's frame header
  // first).
  void CheckStoredBytes(ReadableObject& obj, const std::string& file, const Item& it,
                        Progress& progress) {
    const StorageInfo& info = *it.info;
    if (IsZstdItem(info)) {
      ZstdItemReader(obj, info, false, 64, ItemName(*it.index) + " in '" + file + "'")
          .CheckFrameHeader();
    }
    uint32_t crc = 0;
    for (uint64_t done = 0; done < info.length;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(kPiece, info.length - done));
      buf_.resize(n);
      obj.ReadAt(info.offset + done, buf_.data(), n);
      crc = Crc32c(crc, buf_.data(), n);
      done += n;
      bytes_read_ += n;
      progress.Add(n);
    }
    if (!info.crc32c) {
      ++unchecked_;
    } else if (crc != *info.crc32c) {
      char line[160];
      std::snprintf(line, sizeof line,
                    " in file '%s' at offset %llu (%llu bytes): stored crc32c %08x, "
                    "computed %08x",
                    file.c_str(), static_cast<unsigned long long>(info.offset),
                    static_cast<unsigned long long>(info.length), *info.crc32c, crc);
      Problem(ErrorCode::kCorruption, "checksum_mismatch", file, it.index,
              "checksum mismatch: " + ItemName(*it.index) + line);
    } else {
      ++checked_;
    }
  }

  void WarnUnchecked() {
    if (!unchecked_) return;
    warnings_.push_back({"no_checksum", "", nullptr,
                         std::to_string(unchecked_) + " of " + std::to_string(md_.storage.size()) +
                             " items carried no checksum: their contents were not verified",
                         kOk, std::nullopt, unchecked_});
  }

  // Data files no item references, and temporary metadata a commit left: warnings.
  void FindStrayFiles() {
    try {
      for (const auto& n : store_.List()) {
        if ((IsDataObjectName(n) || IsTorchDcpDataName(n)) && !by_file_.count(n)) {
          if (++strays_ > kNamedStrays) continue;
          const auto size = store_.Size(n);
          warnings_.push_back({"unreferenced_file", n, nullptr,
                               "unreferenced data file '" + n + "' (" +
                                   std::to_string(size.value_or(0)) +
                                   " bytes; left by an interrupted or replaced save, safe to "
                                   "delete)",
                               kOk, size.value_or(0), std::nullopt});
        } else if (n.rfind(std::string(kMetadataName) + ".tmp.", 0) == 0 ||
                   n.rfind(std::string(kTorchDcpMetadataName) + ".tmp.", 0) == 0) {
          // A commit's temporary metadata that never became metadata.dcp (the save died between
          // writing and renaming it): not part of the checkpoint, so a warning, not damage.
          const auto size = store_.Size(n);
          warnings_.push_back({"leftover_temporary_metadata", n, nullptr,
                               "leftover temporary metadata file '" + n + "' (" +
                                   std::to_string(size.value_or(0)) +
                                   " bytes; left by an interrupted commit, safe to delete)",
                               kOk, size.value_or(0), std::nullopt});
        }
      }
      if (strays_ > kNamedStrays) {
        warnings_.push_back(
            {"more_unreferenced_files", "", nullptr,
             "... and " + std::to_string(strays_ - kNamedStrays) + " more unreferenced data files",
             kOk, std::nullopt, strays_ - kNamedStrays});
      }
      // Writes a killed save left unfinished (s3:// multipart uploads): invisible to a listing,
      // yet stored and billed.
      for (const auto& n : store_.ListIncomplete()) {
        warnings_.push_back({"unfinished_write", n, nullptr,
                             "unfinished write '" + n +
                                 "' (an upload a killed save left; `dcp incomplete --abort` "
                                 "discards it, as does the next save here)"});
      }
    } catch (const Error& e) {
      warnings_.push_back({"list_failed", "", nullptr,
                           std::string("cannot list the checkpoint's objects: ") + e.what()});
    }
  }

  std::string Summary() const {
    if (!problems_.empty()) {
      return "FAILED: " + store_.uri() + ": " + std::to_string(problems_.size()) +
             " problem(s) in " + std::to_string(md_.storage.size()) + " stored items";
    }
    const std::string checksums =
        unchecked_ == 0
            ? "checksums (CRC32C, or zip CRC-32 for PyTorch DCP records), sizes and chunk "
              "tiling verified"
        : checked_ == 0 ? std::string(
                              "sizes and chunk tiling verified; NO item carried a "
                              "checksum, so no contents were verified") +
                              (c_.format == "safetensors"
                                   ? " (safetensors stores none: headers, sizes and offsets only)"
                                   : "")
                        : "sizes and chunk tiling verified; checksums verified for " +
                              std::to_string(checked_) + " items, " + std::to_string(unchecked_) +
                              " carried none";
    return "OK: " + store_.uri() + ": " + std::to_string(md_.entries.size()) + " entries, " +
           std::to_string(md_.storage.size()) + " stored items, " +
           FormatBytes(md_.TotalStoredBytes()) + " in " + std::to_string(by_file_.size()) +
           " files; " + checksums;
  }

  void PrintJson(const std::string& summary) const {
    ordered_json jp = ordered_json::array(), jw = ordered_json::array();
    for (const auto& p : problems_) jp.push_back(FindingJson(p));
    for (const auto& w : warnings_) jw.push_back(FindingJson(w));
    const ordered_json j = {{"ok", problems_.empty()},
                            {"exit_code", exit_},
                            {"checkpoint", store_.uri()},
                            {"format", c_.format},
                            {"entries", md_.entries.size()},
                            {"items", md_.storage.size()},
                            {"files", by_file_.size()},
                            {"stored_bytes", md_.TotalStoredBytes()},
                            {"bytes_read", bytes_read_},
                            {"items_checksum_verified", checked_},
                            {"items_without_checksum", unchecked_},
                            {"unreferenced_files", strays_},
                            {"problems", std::move(jp)},
                            {"warnings", std::move(jw)},
                            {"summary", summary}};
    std::cout << DumpJson(j) << "\n";
  }

  const Checkpoint& c_;
  const Metadata& md_;
  Store& store_;
  const std::map<std::string, std::vector<Item>> by_file_;
  std::vector<Finding> problems_, warnings_;
  int exit_ = kOk;
  size_t unchecked_ = 0, checked_ = 0, strays_ = 0;
  uint64_t bytes_read_ = 0;
  std::vector<char> buf_;
  using RecordKey = std::tuple<std::string, uint64_t, uint64_t, bool>;  // file, offset, length
  struct CheckedRecord {
    TorchTensorRecord rec;
    std::exception_ptr error;
  };
  std::map<RecordKey, CheckedRecord> records_;  // torch records checked so far
};

}  // namespace

int Verify(const std::string& path, bool json) {
  const Checkpoint c = OpenCheckpoint(path);
  return Verifier(c).Run(json);
}

}  // namespace dcp::cli
