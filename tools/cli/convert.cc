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
#include <set>

#include "dcp/checkpoint.h"
#include "dcp/proto/error.h"
#include "dcp/proto/state_dict.h"
#include "dcp/storage/format/safetensors.h"

namespace dcp::cli {

namespace {

using nlohmann::ordered_json;

constexpr char kBlobsKey[] = "dcp.blobs";

// The dtype names are the reader's (storage/format/safetensors.h), so that what an export
// writes loads back through the safetensors layout.
std::optional<std::string> SafetensorsDType(DType d) { return SafetensorsDTypeName(d); }

std::optional<DType> FromSafetensorsDType(const std::string& s) {
  return DTypeFromSafetensorsName(s);
}

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
  ordered_json header = ordered_json::object();
  ordered_json blobs = ordered_json::array();
  header["__metadata__"] = {
      {"format", "pt"}, {"dcp.checkpoint_id", md.checkpoint_id}, {"dcp.save_id", md.save_id}};
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
      header[fqn] = {
          {"dtype", *name}, {"shape", t->shape}, {"data_offsets", {offset, offset + bytes}}};
    } else {
      bytes = ItemInfo(md, fqn, {}).raw_length;  // the stored length when compressed differs
      header[fqn] = {{"dtype", "U8"},
                     {"shape", {static_cast<int64_t>(bytes)}},
                     {"data_offsets", {offset, offset + bytes}}};
      blobs.push_back(fqn);
    }
    offset += bytes;
  }
  header["__metadata__"][kBlobsKey] = blobs.dump();
  std::string text = header.dump();
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
  const int fd = ::open(in.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw MakeIoError("open", in, errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw MakeIoError("stat", in, e);
  }
  const size_t size = static_cast<size_t>(st.st_size);
  auto bad = [&](const std::string& why) {
    return CliError{kNotCheckpoint, "'" + in + "' is not a valid safetensors file: " + why};
  };
  if (size < 8) {
    ::close(fd);
    throw bad("shorter than its 8-byte header length");
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  if (map == MAP_FAILED) throw MakeIoError("mmap", in, map_errno);
  std::shared_ptr<void> mapping(map, [size](void* p) { ::munmap(p, size); });
  ::madvise(map, size, MADV_SEQUENTIAL);
  const auto* base = static_cast<const unsigned char*>(map);
  uint64_t hlen = 0;
  for (int i = 0; i < 8; ++i) hlen |= uint64_t{base[i]} << (8 * i);
  if (hlen > size - 8) throw bad("header length " + std::to_string(hlen) + " exceeds the file");
  ordered_json header;
  try {
    header = ordered_json::parse(base + 8, base + 8 + hlen);
  } catch (const nlohmann::json::exception& e) {
    throw bad(std::string("header is not JSON: ") + e.what());
  }
  if (!header.is_object()) throw bad("header is not a JSON object");
  const char* data = reinterpret_cast<const char*>(base + 8 + hlen);
  const uint64_t data_len = size - 8 - hlen;

  std::set<std::string> blob_names;
  if (header.contains("__metadata__") && header["__metadata__"].contains(kBlobsKey)) {
    try {
      for (const auto& n :
           ordered_json::parse(header["__metadata__"][kBlobsKey].get<std::string>())) {
        blob_names.insert(n.get<std::string>());
      }
    } catch (const nlohmann::json::exception& e) {
      throw bad(std::string("bad ") + kBlobsKey + ": " + e.what());
    }
  }
  StateDict sd;
  try {
    for (const auto& [name, spec] : header.items()) {
      if (name == "__metadata__") continue;
      const std::string dtype_name = spec.at("dtype").get<std::string>();
      const auto dtype = FromSafetensorsDType(dtype_name);
      if (!dtype)
        throw CliError{kUnsupported,
                       "tensor '" + name + "': dtype " + dtype_name + " is not supported"};
      const Shape shape = spec.at("shape").get<Shape>();
      const auto offs = spec.at("data_offsets").get<std::vector<uint64_t>>();
      if (offs.size() != 2 || offs[0] > offs[1] || offs[1] > data_len) {
        throw bad("tensor '" + name + "' has data_offsets outside the data buffer");
      }
      const uint64_t want = static_cast<uint64_t>(NumElements(shape)) * ElementSize(*dtype);
      if (offs[1] - offs[0] != want) {
        throw bad("tensor '" + name + "' has " + std::to_string(offs[1] - offs[0]) +
                  " bytes, its dtype and shape need " + std::to_string(want));
      }
      if (blob_names.count(name) && *dtype == DType::kUInt8 && shape.size() == 1) {
        InsertDotted(sd, name, Blob{std::string(data + offs[0], want)});
        continue;
      }
      TensorView v = TensorView::FromContiguous(const_cast<char*>(data + offs[0]), *dtype, shape);
      v.owner = mapping;
      InsertDotted(sd, name, v);
    }
  } catch (const nlohmann::json::exception& e) {
    throw bad(std::string("bad header entry: ") + e.what());
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
