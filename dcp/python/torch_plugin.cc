// dcp.torch's C++ half: a torch.distributed.checkpoint StorageWriter and StorageReader on dcp's
// storage (dcp/python/dcp/torch.py holds the Python half and the contract).
//
// torch plans, gathers and scatters; these classes do what torch hands its storage layer, with
// dcp's checkpoint protocol doing the I/O: the writer is dcp's Store writer in the PyTorch DCP
// layout (the lock from set-up to commit, data files named by the save, the metadata published
// only if the location still holds what set-up saw, the clean-up of dead files), the reader is
// dcp's reader of any format it detects (dcp, PyTorch DCP, safetensors), every CRC checked.
// Tensors cross as addresses of memory the Python half keeps alive for the call, as in
// module.cc; the GIL is released around every read and write.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dcp/dcp.h"
#include "dcp/planner/planner.h"
#include "dcp/proto/random_name.h"
#include "dcp/python/bindings.h"
#include "dcp/storage/format/torch_dcp.h"
#include "dcp/storage/registry.h"

namespace dcp_python {
namespace {

dcp::Shape ShapeOf(const py::handle& h) {
  if (h.is_none()) return {};
  return h.cast<std::vector<int64_t>>();
}

dcp::DType DTypeOrThrow(const std::string& name, const std::string& fqn) {
  const auto dtype = dcp::DTypeFromName(name);
  if (!dtype) {
    throw dcp::UnsupportedError("dcp.torch: tensor '" + fqn + "' has dtype " + name +
                                ", which dcp does not store");
  }
  return *dtype;
}

// (address, dtype name, shape, strides) of host memory the caller keeps alive.
dcp::TensorView HostView(const py::tuple& t, const std::string& fqn) {
  dcp::TensorView v;
  v.data = reinterpret_cast<void*>(t[0].cast<uintptr_t>());
  v.dtype = DTypeOrThrow(t[1].cast<std::string>(), fqn);
  v.shape = ShapeOf(t[2]);
  v.strides = ShapeOf(t[3]);
  return v;
}

dcp::StorageContext ContextOf(int rank, int world, bool coordinator) {
  dcp::StorageContext ctx;
  ctx.rank = rank;
  ctx.world_size = world;
  ctx.is_coordinator = coordinator;
  return ctx;
}

// The data of a save's items, resolved by torch's planner on the Python side before the write.
class ResolvedItems final : public dcp::SavePlanner {
 public:
  void Add(const dcp::MetadataIndex& index, dcp::ResolvedData data) {
    data_.emplace(index, std::move(data));
  }
  dcp::ResolvedData ResolveData(const dcp::WriteItem& item) const override {
    auto it = data_.find(item.index);
    if (it == data_.end()) {
      throw dcp::InternalError("dcp.torch: no data for " + item.index.ToString());
    }
    return it->second;
  }
  void SetUp(const dcp::StateDict&, const dcp::PlannerContext&) override { Unused(); }
  dcp::SavePlan CreateLocalPlan() override { Unused(); }
  std::pair<std::vector<dcp::SavePlan>, dcp::Metadata> CreateGlobalPlan(
      std::vector<dcp::SavePlan>) override {
    Unused();
  }
  dcp::SavePlan FinishPlan(dcp::SavePlan) override { Unused(); }

 private:
  [[noreturn]] static void Unused() {
    throw dcp::InternalError("dcp.torch: torch's planner plans; this one only resolves data");
  }
  std::map<dcp::MetadataIndex, dcp::ResolvedData> data_;
};

class TorchWriter {
 public:
  TorchWriter(const std::string& uri, bool overwrite, const std::string& format) {
    Call([&] {
      dcp::StorageOptions options;
      options.overwrite = overwrite;
      options.format = dcp::ParseCheckpointFormat(format);
      if (options.format != dcp::CheckpointFormat::kTorchDcp &&
          options.format != dcp::CheckpointFormat::kTorchDcp113) {
        throw dcp::InvalidArgumentError("dcp.torch.Writer writes PyTorch DCP checkpoints, not " +
                                        format);
      }
      writer_ = dcp::OpenStorageWriter(uri, options);
    });
  }

  // A save begins. On the coordinator, a save of this writer that never reached finish()
  // (another rank failed, torch raised) did not commit: it is aborted first (its files, its
  // lock). Other ranks have nothing left to abort by then (see Write).
  void SetUp(int rank, int world, bool coordinator) {
    Call([&] {
      if (in_progress_) writer_->Abort();
      in_progress_ = true;
      ctx_ = ContextOf(rank, world, coordinator);
      ctx_.save_id = coordinator ? dcp::RandomHex(8) : std::string();
      writer_->SetUp(ctx_);
    });
  }

  // Coordinator: each rank's file prefix (the plans' storage_data).
  std::vector<std::string> FilePrefixes(int world) {
    return Call([&] {
      std::vector<dcp::SavePlan> plans(static_cast<size_t>(world));
      plans = writer_->PrepareGlobalPlan(std::move(plans));
      std::vector<std::string> prefixes;
      for (const auto& p : plans) prefixes.push_back(p.storage_data);
      return prefixes;
    });
  }

  // Writes the items (fqn, offset, kind, dtype, global shape, chunk offsets, chunk sizes,
  // data); returns, in the same order, (item bytes, relative path, offset, length): torch's
  // WriteResult carries the item's bytes as its size_in_bytes to finish().
  py::list Write(const std::string& prefix, const py::list& items) {
    dcp::SavePlan plan;
    plan.storage_data = prefix;
    ResolvedItems resolved;
    try {
      for (const auto& h : items) ToWriteItem(h.cast<py::tuple>(), plan, resolved);
    } catch (const dcp::Error& e) {
      RaiseAsPython(e);
    }
    const std::vector<dcp::WriteResult> results =
        Call([&] { return writer_->WriteData(plan, resolved).get(); });
    // Whether the save commits is the coordinator's finish() to decide, and torch tells no
    // other rank: from here this rank's files are the checkpoint's if it commits, so nothing of
    // this rank may remove them. (A save that does not commit leaves them unreferenced: the
    // next locked save there removes them.) A failed write is aborted by the Python half.
    if (!ctx_.is_coordinator) in_progress_ = false;
    std::map<dcp::MetadataIndex, const dcp::WriteResult*> by_index;
    for (const auto& r : results) by_index[r.index] = &r;
    py::list out;
    for (const auto& item : plan.items) {
      auto it = by_index.find(item.index);
      if (it == by_index.end()) {
        RaiseAsPython(
            dcp::InternalError("dcp.torch: no write result for " + item.index.ToString()));
      }
      const dcp::WriteResult& r = *it->second;
      out.append(py::make_tuple(r.storage.raw_length, r.storage.relative_path, r.storage.offset,
                                r.storage.length));
    }
    return out;
  }

  // Coordinator: commits the metadata of `entries` ((fqn, "tensor", dtype, shape, [(offsets,
  // sizes)]) or (fqn, "bytes")) with every rank's `results` ((fqn, offset, kind, size, path,
  // offset in file, length)), then removes the files of dead saves.
  void Finish(const std::string& checkpoint_id, const py::list& entries, const py::dict& key_paths,
              const py::list& results) {
    dcp::Metadata md;
    std::vector<std::vector<dcp::WriteResult>> all(1);
    try {
      md = MetadataOf(entries, key_paths);
      md.checkpoint_id = checkpoint_id;
      for (const auto& h : results) all[0].push_back(ToWriteResult(h.cast<py::tuple>()));
    } catch (const dcp::Error& e) {
      RaiseAsPython(e);
    }
    md.save_id = ctx_.save_id;
    md.world_size = ctx_.world_size;
    md.created_unix_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
    md.library_version = DCP_VERSION_STRING;
    Call([&] {
      try {
        writer_->Finish(md, all);
      } catch (const dcp::CommitError&) {
        in_progress_ = false;  // committed or unknown: nothing may be removed
        throw;
      }
      in_progress_ = false;
      writer_->AfterCommitDelivered();
    });
  }

  // A rank whose save ended without a commit (the Python half calls it when a step raised).
  void Abort() {
    Call([&] {
      if (in_progress_) writer_->Abort();
      in_progress_ = false;
    });
  }

  ~TorchWriter() {
    if (writer_ && in_progress_) {
      py::gil_scoped_release release;
      writer_->Abort();
    }
  }

 private:
  static void ToWriteItem(const py::tuple& t, dcp::SavePlan& plan, ResolvedItems& resolved) {
    dcp::WriteItem item;
    item.index.fqn = t[0].cast<std::string>();
    item.index.offset = ShapeOf(t[1]);
    const auto kind = t[2].cast<std::string>();
    dcp::ResolvedData data;
    if (kind == "bytes") {
      item.type = dcp::WriteItemType::kBytes;
      data.bytes = PyBytesView(t[7]);
      data.bytes_are_torch_record = dcp::IsTorchSaveArchive(data.bytes);
      item.size_bytes = data.bytes.size();
    } else {
      item.type = kind == "shard" ? dcp::WriteItemType::kShard : dcp::WriteItemType::kTensor;
      data.tensor = HostView(t[7].cast<py::tuple>(), item.index.fqn);
      item.dtype = DTypeOrThrow(t[3].cast<std::string>(), item.index.fqn);
      item.global_shape = ShapeOf(t[4]);
      item.chunk.offsets = ShapeOf(t[5]);
      item.chunk.sizes = ShapeOf(t[6]);
      item.size_bytes = data.tensor.nbytes();
    }
    resolved.Add(item.index, std::move(data));
    plan.items.push_back(std::move(item));
  }

  // The bytes object's own buffer: the Python half keeps it alive until the write returns.
  static std::string_view PyBytesView(const py::handle& h) {
    char* data = nullptr;
    Py_ssize_t size = 0;
    if (PyBytes_AsStringAndSize(h.ptr(), &data, &size) != 0) throw py::error_already_set();
    return {data, static_cast<size_t>(size)};
  }

  static dcp::Metadata MetadataOf(const py::list& entries, const py::dict& key_paths) {
    dcp::Metadata md;
    md.format_version = 1;
    for (const auto& h : entries) {
      const auto t = h.cast<py::tuple>();
      const auto fqn = t[0].cast<std::string>();
      if (t[1].cast<std::string>() == "bytes") {
        md.entries[fqn] = dcp::BytesMetadata{};
        continue;
      }
      dcp::TensorMetadata tm(DTypeOrThrow(t[2].cast<std::string>(), fqn), ShapeOf(t[3]));
      for (const auto& c : t[4]) {
        const auto chunk = c.cast<py::tuple>();
        tm.chunks.push_back({ShapeOf(chunk[0]), ShapeOf(chunk[1])});
      }
      md.entries[fqn] = std::move(tm);
    }
    for (const auto& [fqn, path] : key_paths) {
      dcp::KeyPath kp;
      for (const auto& p : path) kp.push_back(py::str(p).cast<std::string>());
      if (kp.size() > 1) md.key_paths[fqn.cast<std::string>()] = std::move(kp);
    }
    return md;
  }

  static dcp::WriteResult ToWriteResult(const py::tuple& t) {
    dcp::WriteResult r;
    r.index.fqn = t[0].cast<std::string>();
    r.index.offset = ShapeOf(t[1]);
    r.size_in_bytes = t[3].cast<uint64_t>();
    r.storage.relative_path = t[4].cast<std::string>();
    r.storage.offset = t[5].cast<uint64_t>();
    r.storage.length = t[6].cast<uint64_t>();
    r.storage.transforms = {dcp::kTorchSaveTransform};
    r.storage.raw_length = r.size_in_bytes;
    return r;
  }

  std::unique_ptr<dcp::StorageWriter> writer_;
  dcp::StorageContext ctx_;
  bool in_progress_ = false;
};

// The destinations of a load's items, resolved by torch's planner on the Python side; the
// bytes of its byte entries, as reads deliver them (from read threads: distinct slots).
class ResolvedDestinations final : public dcp::LoadPlanner {
 public:
  using Key = std::tuple<dcp::MetadataIndex, dcp::Shape, dcp::MetadataIndex, dcp::Shape>;
  static Key KeyOf(const dcp::ReadItem& item) {
    return {item.dest_index, item.dest_offsets, item.storage_index, item.storage_offsets};
  }
  void Add(const dcp::ReadItem& item, dcp::TensorView view) {
    slots_.emplace(KeyOf(item), views_.size());
    views_.push_back(std::move(view));
  }
  void Finalize() { bytes_.resize(views_.size()); }
  std::optional<std::string>& bytes(size_t i) { return bytes_[i]; }

  dcp::TensorView ResolveTensor(const dcp::ReadItem& item) override { return views_[Slot(item)]; }
  void CommitTensor(const dcp::ReadItem&, const dcp::TensorView&) override {}
  void LoadBytes(const dcp::ReadItem& item, std::string bytes) override {
    bytes_[Slot(item)] = std::move(bytes);
  }
  void SetUp(dcp::StateDict&, const dcp::Metadata&, const dcp::PlannerContext&) override {
    Unused();
  }
  dcp::LoadPlan CreateLocalPlan() override { Unused(); }
  std::vector<dcp::LoadPlan> CreateGlobalPlan(std::vector<dcp::LoadPlan>) override { Unused(); }
  dcp::LoadPlan FinishPlan(dcp::LoadPlan) override { Unused(); }

 private:
  size_t Slot(const dcp::ReadItem& item) const {
    auto it = slots_.find(KeyOf(item));
    if (it == slots_.end()) {
      throw dcp::InternalError("dcp.torch: no destination for " + item.dest_index.ToString());
    }
    return it->second;
  }
  [[noreturn]] static void Unused() {
    throw dcp::InternalError("dcp.torch: torch's planner plans; this one only resolves");
  }
  std::map<Key, size_t> slots_;
  std::vector<dcp::TensorView> views_;
  std::vector<std::optional<std::string>> bytes_;
};

class TorchReader {
 public:
  explicit TorchReader(const std::string& uri) {
    Call([&] { reader_ = dcp::OpenStorageReader(uri); });
  }

  // {"entries": [(fqn, "tensor", dtype, shape, [(offsets, sizes)]) or (fqn, "bytes")],
  //  "key_paths": {fqn: [keys]}}.
  py::dict ReadMetadata() {
    auto md = std::make_shared<dcp::Metadata>(Call([&] { return reader_->ReadMetadata(); }));
    metadata_ = md;
    torch_records_ = md->library_version.rfind("torch.distributed", 0) == 0;
    py::list entries;
    for (const auto& [fqn, entry] : md->entries) {
      if (std::holds_alternative<dcp::BytesMetadata>(entry)) {
        entries.append(py::make_tuple(fqn, "bytes"));
        continue;
      }
      const auto& t = std::get<dcp::TensorMetadata>(entry);
      py::list chunks;
      dcp::ForEachChunk(t, [&](size_t, const dcp::ChunkMeta& c) {
        chunks.append(py::make_tuple(c.offsets, c.sizes));
      });
      entries.append(
          py::make_tuple(fqn, "tensor", std::string(dcp::DTypeName(t.dtype)), t.shape, chunks));
    }
    py::dict out;
    out["entries"] = entries;
    out["key_paths"] = md->key_paths;
    return out;
  }

  void SetUp(int rank, int world, bool coordinator) {
    if (!metadata_) RaiseAsPython(dcp::InternalError("dcp.torch: set_up before read_metadata"));
    Call([&] { reader_->SetUp(*metadata_, ContextOf(rank, world, coordinator)); });
  }

  // Reads the items ("tensor" | "bytes", dest fqn, dest offset, dest offsets, storage fqn,
  // storage offset, storage offsets, lengths, destination (address, dtype, shape, strides) or
  // None); returns each byte entry's record (a torch.save archive) in item order, None for
  // tensors.
  py::list Read(const py::list& items) {
    dcp::LoadPlan plan;
    ResolvedDestinations dest;
    try {
      for (const auto& h : items) {
        const auto t = h.cast<py::tuple>();
        dcp::ReadItem item;
        item.type = t[0].cast<std::string>() == "bytes" ? dcp::ReadItemType::kBytes
                                                        : dcp::ReadItemType::kTensor;
        item.dest_index = {t[1].cast<std::string>(), ShapeOf(t[2]), std::nullopt};
        item.dest_offsets = ShapeOf(t[3]);
        item.storage_index = {t[4].cast<std::string>(), ShapeOf(t[5]), std::nullopt};
        item.storage_offsets = ShapeOf(t[6]);
        item.lengths = ShapeOf(t[7]);
        dest.Add(item, item.type == dcp::ReadItemType::kTensor
                           ? HostView(t[8].cast<py::tuple>(), item.dest_index.fqn)
                           : dcp::TensorView{});
        plan.items.push_back(std::move(item));
      }
    } catch (const dcp::Error& e) {
      RaiseAsPython(e);
    }
    dest.Finalize();
    Call([&] { reader_->ReadData(plan, dest).get(); });
    py::list out;
    for (size_t i = 0; i < plan.items.size(); ++i) {
      if (plan.items[i].type != dcp::ReadItemType::kBytes) {
        out.append(py::none());
        continue;
      }
      std::optional<std::string>& b = dest.bytes(i);
      if (!b) {
        RaiseAsPython(dcp::InternalError("dcp.torch: byte entry '" + plan.items[i].dest_index.fqn +
                                         "' was not read"));
      }
      out.append(py::bytes(AsTorchRecord(plan.items[i], std::move(*b))));
    }
    return out;
  }

 private:
  // torch's planner torch.load()s a byte entry. A PyTorch DCP record comes back as stored,
  // except that one of a Python bytes object comes back as its payload (shorter than the
  // record): that, and every blob of another format, becomes the record of a bytes object.
  std::string AsTorchRecord(const dcp::ReadItem& item, std::string bytes) const {
    if (torch_records_) {
      auto it = metadata_->storage.find(item.storage_index);
      if (it != metadata_->storage.end() && it->second.length == bytes.size() &&
          dcp::IsTorchSaveArchive(bytes)) {
        return bytes;
      }
    }
    return dcp::TorchSaveOfBytes(bytes);
  }

  std::unique_ptr<dcp::StorageReader> reader_;
  std::shared_ptr<const dcp::Metadata> metadata_;
  bool torch_records_ = false;
};

}  // namespace

void BindTorchPlugin(py::module_& m) {
  py::class_<TorchWriter>(m, "TorchWriter")
      .def(py::init<const std::string&, bool, const std::string&>())
      .def("set_up", &TorchWriter::SetUp)
      .def("file_prefixes", &TorchWriter::FilePrefixes)
      .def("write", &TorchWriter::Write)
      .def("finish", &TorchWriter::Finish)
      .def("abort", &TorchWriter::Abort);
  py::class_<TorchReader>(m, "TorchReader")
      .def(py::init<const std::string&>())
      .def("read_metadata", &TorchReader::ReadMetadata)
      .def("set_up", &TorchReader::SetUp)
      .def("read", &TorchReader::Read);
}

}  // namespace dcp_python
