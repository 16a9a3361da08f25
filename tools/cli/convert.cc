// safetensors <-> dcp. The safetensors layout: u64 little-endian header length N, N bytes of
// JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}},
// then the data buffer; offsets are relative to the buffer, tensors are row-major little-endian.
#include "tools/cli/convert.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "dcp/checkpoint.h"
#include "dcp/proto/error.h"
#include "dcp/proto/state_dict.h"
#include "dcp/storage/format/safetensors.h"
#include "dcp/storage/registry.h"

namespace dcp::cli {

namespace {

using nlohmann::ordered_json;

constexpr char kBlobsKey[] = "dcp.blobs";

// The dtype names are the reader's (storage/format/safetensors.h), so that what an export
// writes loads back through the safetensors layout.
std::optional<std::string> SafetensorsDType(DType d) { return SafetensorsDTypeName(d); }

class OutFile {
 public:
  explicit OutFile(const std::string& path) : path_(path) {
    f_ = std::fopen(path.c_str(), "wb");
    if (!f_) throw MakeIoError("create", path, errno);
  }
  ~OutFile() {
    if (f_) std::fclose(f_);
  }
  void Write(const void* p, size_t n) {
    if (n && std::fwrite(p, 1, n, f_) != n) throw MakeIoError("write", path_, errno);
  }
  void Close() {
    if (std::fflush(f_) != 0 || ::fsync(::fileno(f_)) != 0) throw MakeIoError("sync", path_, errno);
    FILE* f = f_;
    f_ = nullptr;
    if (std::fclose(f) != 0) throw MakeIoError("close", path_, errno);
  }

 private:
  std::string path_;
  FILE* f_ = nullptr;
};

void RefuseExisting(const std::string& out, const ConvertOptions& o) {
  if (!o.overwrite && std::filesystem::exists(out)) {
    throw CliError{kUsage, "'" + out + "' exists; pass --overwrite to replace it"};
  }
}

}  // namespace

void ExportSafetensors(const Checkpoint& src, const std::string& out, const ConvertOptions& o) {
  RefuseExisting(out, o);
  const Metadata& md = src.md;
  // The header is written entry by entry: an ordered_json object looks each key up linearly,
  // which made a header of many entries quadratic. The names are unique (md.entries is a map).
  std::string entries_text;
  ordered_json blobs = ordered_json::array();
  auto add = [&](const std::string& fqn, const ordered_json& value) {
    entries_text += ',';
    entries_text += ordered_json(fqn).dump();
    entries_text += ':';
    entries_text += value.dump();
  };
  uint64_t offset = 0;
  for (const auto& [fqn, entry] : md.entries) {
    uint64_t bytes;
    if (const auto* t = std::get_if<TensorMetadata>(&entry)) {
      const auto name = SafetensorsDType(t->dtype);
      if (!name) {
        throw CliError{kUnsupported, "tensor '" + fqn + "' has dtype " +
                                         std::string(DTypeName(t->dtype)) +
                                         ", which safetensors cannot represent"};
      }
      bytes = static_cast<uint64_t>(NumElements(t->shape)) * ElementSize(t->dtype);
      add(fqn, {{"dtype", *name}, {"shape", t->shape}, {"data_offsets", {offset, offset + bytes}}});
    } else {
      bytes = ItemInfo(md, fqn, {}).raw_length;  // the stored length when compressed differs
      add(fqn, {{"dtype", "U8"},
                {"shape", {static_cast<int64_t>(bytes)}},
                {"data_offsets", {offset, offset + bytes}}});
      blobs.push_back(fqn);
    }
    offset += bytes;
  }
  const ordered_json metadata = {{"format", "pt"},
                                 {"dcp.checkpoint_id", md.checkpoint_id},
                                 {"dcp.save_id", md.save_id},
                                 {kBlobsKey, blobs.dump()}};
  std::string text = "{\"__metadata__\":" + metadata.dump() + entries_text + "}";
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');  // keep the data buffer 8-byte aligned

  const std::string tmp = out + ".tmp";
  OutFile f(tmp);
  try {
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(text.size() >> (8 * i));
    f.Write(len, 8);
    f.Write(text.data(), text.size());
    Progress progress("convert", offset);
    for (const auto& [fqn, entry] : md.entries) {
      if (std::holds_alternative<TensorMetadata>(entry)) {
        TensorStream stream(*src.store, md, fqn, o.budget_bytes);
        const char* data;
        size_t n;
        while (stream.Next(data, n)) {
          f.Write(data, n);
          progress.Add(n);
        }
      } else {
        const std::string blob = ReadBlob(*src.store, md, fqn);
        f.Write(blob.data(), blob.size());
        progress.Add(blob.size());
      }
    }
    f.Close();
    std::filesystem::rename(tmp, out);
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove(tmp, ec);
    throw;
  }
}

void ImportSafetensors(const std::string& in, const std::string& out_uri, const ConvertOptions& o) {
  // The header is read and checked by the safetensors reader, as verify, inspect and load read
  // it (its length bound, a bounded linear parse, every tensor's offsets against the file): a
  // file they refuse is refused here with the same message, before anything is mapped. A file
  // named otherwise (--from safetensors) is read through the same view of its directory.
  std::shared_ptr<Store> view;
  if (!IsSafetensorsName(in)) {
    const std::filesystem::path p(in);
    view = SafetensorsFileView(
        OpenStoreForReading(p.has_parent_path() ? p.parent_path().string() : "."),
        p.filename().string());
  }
  const Checkpoint c = OpenCheckpoint(in, view);
  CheckDataFiles(c);

  const int fd = ::open(in.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw MakeIoError("open", in, errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw MakeIoError("stat", in, e);
  }
  const size_t size = static_cast<size_t>(st.st_size);
  void* map = size == 0 ? MAP_FAILED : ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = size == 0 ? EINVAL : errno;
  ::close(fd);
  if (map == MAP_FAILED) throw MakeIoError("mmap", in, map_errno);
  std::shared_ptr<void> mapping(map, [size](void* p) { ::munmap(p, size); });
  ::madvise(map, size, MADV_SEQUENTIAL);
  char* base = static_cast<char*>(map);

  // Each entry straight from the mapping, where the reader placed it.
  StateDict sd;
  for (const auto& [index, info] : c.md.storage) {
    // The file may have changed since it was read: every item must still lie inside it.
    if (info.offset > size || info.length > size - info.offset) {
      throw CliError{ExitCodeFor(ErrorCode::kCorruption),
                     "damaged data: '" + in +
                         "' changed while being converted: " + index.ToString() +
                         " needs bytes up to " + std::to_string(info.offset + info.length) +
                         ", the file has " + std::to_string(size)};
    }
    const EntryMetadata& entry = c.md.entries.at(index.fqn);
    if (const auto* t = std::get_if<TensorMetadata>(&entry)) {
      TensorView v = TensorView::FromContiguous(base + info.offset, t->dtype, t->shape);
      v.owner = mapping;
      InsertDotted(sd, index.fqn, v);
    } else {
      InsertDotted(sd, index.fqn, Blob{std::string(base + info.offset, info.length)});
    }
  }
  SaveConverted(sd, out_uri, o);
}

void SaveConverted(const StateDict& sd, const std::string& out_uri, const ConvertOptions& o) {
  SaveOptions so;
  so.storage.overwrite = o.overwrite;
  if (o.compress == "zstd") so.storage.compression = Compression::kZstd;
  so.storage.compression_level = o.compress_level;
  so.storage.metadata_version = o.metadata_version;
  Save(sd, out_uri, so);
}

}  // namespace dcp::cli
