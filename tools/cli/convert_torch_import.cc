// torch.save files into dcp checkpoints, without LibTorch: the file is memory-mapped, its
// structure read by dcp's own restricted unpickler (storage/format/torch_dcp.h,
// ReadTorchSaveFile) and every tensor saved straight from the mapping. LibTorch's unpickler is
// not used: 1.13's rejects ordinary torch.save(model.state_dict()) files (an OrderedDict with
// `_metadata`, and SETITEM for a dict of one entry), and it would run the pickle's code paths.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <set>

#include "dcp/checkpoint.h"
#include "dcp/proto/error.h"
#include "dcp/proto/state_dict.h"
#include "dcp/storage/format/torch_dcp.h"
#include "tools/cli/convert.h"

namespace dcp::cli {

namespace {

// The key under which `dcp convert` to .pt lists byte entries stored as uint8 tensors.
constexpr char kBlobsKey[] = "__dcp_blobs__";

class MappedObject : public ReadableObject {
 public:
  MappedObject(const char* data, uint64_t size) : data_(data), size_(size) {}
  void ReadAt(uint64_t offset, void* dst, size_t n) override {
    if (offset > size_ || n > size_ - offset) {
      throw IoError("read past the end of the mapped file", false);
    }
    std::memcpy(dst, data_ + offset, n);
  }
  uint64_t size() const override { return size_; }

 private:
  const char* data_;
  uint64_t size_;
};

}  // namespace

void ImportTorch(const std::string& in, const std::string& out_uri, const ConvertOptions& o) {
  const int fd = ::open(in.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw MakeIoError("open", in, errno);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw MakeIoError("stat", in, e);
  }
  const auto size = static_cast<size_t>(st.st_size);
  if (size == 0) {
    ::close(fd);
    throw CliError{kNotCheckpoint, "'" + in + "' is empty, not a torch.save file"};
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  if (map == MAP_FAILED) throw MakeIoError("mmap", in, map_errno);
  std::shared_ptr<void> mapping(map, [size](void* p) { ::munmap(p, size); });
  const char* base = static_cast<const char*>(map);
  MappedObject object(base, size);

  std::vector<TorchSaveLeaf> leaves;
  try {
    leaves = ReadTorchSaveFile(object, size, "'" + in + "'");
  } catch (const CorruptionError& e) {
    throw CliError{kNotCheckpoint, std::string("not a valid torch.save file: ") + e.what()};
  }
  std::set<std::string> blob_names;  // what an export to .pt listed
  for (const auto& leaf : leaves) {
    if (leaf.fqn != kBlobsKey || !leaf.value || leaf.value->kind != pickle::Kind::kList) continue;
    for (const auto& name : leaf.value->items) {
      if (name->kind == pickle::Kind::kStr) blob_names.insert(name->str);
    }
  }
  StateDict sd;
  for (const auto& leaf : leaves) {
    if (leaf.fqn == kBlobsKey) continue;
    if (leaf.tensor) {
      const TorchTensorRecord& rec = *leaf.tensor;
      char* values = const_cast<char*>(base) + rec.values_begin();
      if (blob_names.count(leaf.fqn) && rec.dtype == DType::kUInt8 && rec.sizes.size() == 1 &&
          rec.row_major()) {
        InsertDotted(sd, leaf.fqn, Blob{std::string(values, static_cast<size_t>(rec.sizes[0]))});
        continue;
      }
      TensorView v = TensorView::FromContiguous(values, rec.dtype, rec.sizes);
      if (!rec.row_major()) v.strides = rec.strides;
      v.owner = mapping;
      InsertDotted(sd, leaf.fqn, v);
    } else {
      InsertDotted(sd, leaf.fqn, Blob{leaf.is_bytes ? leaf.bytes : leaf.record});
    }
  }
  SaveConverted(sd, out_uri, o);
}

}  // namespace dcp::cli
