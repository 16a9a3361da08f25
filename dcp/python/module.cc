// dcp._dcp: the C++ half of the Python package `dcp` (dcp/python/dcp/__init__.py holds the
// Python half and the API's documentation).
//
// Tensors cross as (address, dtype name, shape, device) that the Python half reads from each
// torch.Tensor: the views alias the tensors' own memory (no copy) and this module needs no
// torch Python headers, so it works with whatever torch the interpreter has loaded, as long as
// the process's LibTorch is the one dcp_torch was built against (ConnectTorchrun's c10d Gloo).
// The Python half keeps every tensor alive across a call. Every call that does I/O or a
// collective releases the GIL; no thread of dcp calls into Python.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dcp/async_checkpointer.h"
#include "dcp/checkpoint.h"
#include "dcp/checkpoint_manager.h"
#include "dcp/proto/error.h"
#include "dcp/python/bindings.h"
#include "dcp/torch_adapter.h"

namespace py = pybind11;

namespace dcp_python {

[[noreturn]] void RaiseAsPython(const dcp::Error& e) {
  py::gil_scoped_acquire gil;
  py::module_ errors = py::module_::import("dcp");
  py::object raise = errors.attr("_raise");
  py::list failures;
  std::string phase;
  if (const auto* c = dynamic_cast<const dcp::CollectiveError*>(&e)) {
    phase = c->phase();
    for (const auto& f : c->failures()) {
      failures.append(py::make_tuple(f.rank, dcp::ErrorCodeName(f.code), f.message));
    }
  }
  raise(dcp::ErrorCodeName(e.code()), e.what(), phase, failures);
  throw py::error_already_set();  // _raise raises; reached only if it returned
}

}  // namespace dcp_python

namespace {

using dcp_python::Call;
using dcp_python::RaiseAsPython;

// The process's communicators (ConnectTorchrun, or a one-process group) and its background
// saver. Guarded by the GIL: every entry point holds it when it touches this.
struct Session {
  std::optional<dcp::TorchrunGroup> group;  // under torchrun: makes more communicators
  std::unique_ptr<dcp::Communicator> comm;
  std::unique_ptr<dcp::AsyncCheckpointer> saver;
  std::unique_ptr<dcp::Communicator> background;  // until the first async save takes it

  // One more communicator over the job's processes (collective).
  std::unique_ptr<dcp::Communicator> Another() {
    if (group) return group->Connect();
    return std::make_unique<dcp::LocalCommunicator>();
  }
};
// Shared with the managers, which use its communicator: it lives until the last of them.
std::shared_ptr<Session> session;

Session& Require() {
  if (!session) {
    RaiseAsPython(dcp::InvalidArgumentError("dcp: not initialised (call dcp.init() first)"));
  }
  return *session;
}

// One entry of the flattened state dict the Python half hands over:
// (key, kind, payload) with kind "tensor" (address, dtype, shape, device type, device index),
// "shard" (the same plus global shape and offsets) or "blob" (bytes).
dcp::TensorView View(const py::tuple& t, const std::string& key) {
  const auto address = t[0].cast<uintptr_t>();
  const auto dtype_name = t[1].cast<std::string>();
  const auto shape = t[2].cast<std::vector<int64_t>>();
  const auto device_type = t[3].cast<std::string>();
  const auto device_index = t[4].cast<int>();
  const auto dtype = dcp::DTypeFromName(dtype_name);
  if (!dtype) {
    throw dcp::UnsupportedError("dcp: tensor '" + key + "' has dtype " + dtype_name +
                                ", which dcp does not store");
  }
  dcp::Device device;
  if (device_type == "cuda") {
    device.type = dcp::Device::Type::kCUDA;
    device.index = device_index;
  } else if (device_type != "cpu") {
    throw dcp::UnsupportedError("dcp: tensor '" + key + "' is on a " + device_type +
                                " device; dcp takes CPU and CUDA tensors");
  }
  return dcp::TensorView::FromContiguous(reinterpret_cast<void*>(address), *dtype, shape, device);
}

dcp::StateDict ToStateDictOrRaise(const py::list& entries);
py::dict BlobsOf(const dcp::StateDict& sd);

dcp::StateDict ToStateDict(const py::list& entries) {
  dcp::StateDict sd;
  for (const auto& item : entries) {
    const auto entry = item.cast<py::tuple>();
    const auto key = entry[0].cast<std::string>();
    const auto kind = entry[1].cast<std::string>();
    if (kind == "tensor") {
      sd.Set(key, View(entry[2].cast<py::tuple>(), key));
    } else if (kind == "shard") {
      const auto payload = entry[2].cast<py::tuple>();
      dcp::TensorView v = View(payload, key);
      dcp::ShardedTensor st{v.dtype, payload[5].cast<std::vector<int64_t>>(), {}};
      st.local_shards.push_back({v, payload[6].cast<std::vector<int64_t>>()});
      sd.Set(key, std::move(st));
    } else if (kind == "blob") {
      sd.Set(key, dcp::Blob{entry[2].cast<std::string>()});
    } else {
      throw dcp::InvalidArgumentError("dcp: entry '" + key + "' of unknown kind " + kind);
    }
  }
  return sd;
}

void Init(double timeout_s) {
  if (session) return;
  auto s = std::make_shared<Session>();
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  Call([&] {
    if (std::getenv("WORLD_SIZE") != nullptr) {
      s->group = dcp::ConnectTorchrun(timeout);
      s->comm = std::move(s->group->comm);
      s->background = std::move(s->group->background);
    } else {
      s->comm = std::make_unique<dcp::LocalCommunicator>();
      s->background = std::make_unique<dcp::LocalCommunicator>();
    }
  });
  session = std::move(s);
}

void Close() {
  if (!session) return;
  std::shared_ptr<Session> s = std::move(session);
  Call([&] {
    if (s->saver) s->saver->Close();
    s->saver.reset();
  });
}

py::dict Save(const py::list& entries, const std::string& uri, bool overwrite, bool async_save) {
  Session& s = Require();
  dcp::StateDict sd = ToStateDictOrRaise(entries);
  dcp::SaveOptions options;
  options.storage.overwrite = overwrite;
  py::dict out;
  if (async_save) {
    Call([&] {
      if (!s.saver) {
        s.saver = std::make_unique<dcp::AsyncCheckpointer>(std::move(s.background));
      }
      s.saver->Save(sd, uri, options);  // the snapshot is taken: the tensors may change
    });
    out["async"] = true;
    return out;
  }
  const auto t0 = std::chrono::steady_clock::now();
  Call([&] { return dcp::Save(sd, uri, *s.comm, options).stats.plan_rounds; });
  out["async"] = false;
  out["seconds"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

void Wait() {
  Session& s = Require();
  if (s.saver) Call([&] { s.saver->Wait(); });
}

// Loads into the views; returns the blobs' loaded bytes by key.
py::dict Load(const py::list& entries, const std::string& uri) {
  Session& s = Require();
  dcp::StateDict sd = ToStateDictOrRaise(entries);
  Call([&] { dcp::Load(sd, uri, *s.comm); });
  return BlobsOf(sd);
}

// A loaded tensor's memory as a writable byte buffer (Python's buffer protocol); owns the view,
// whose owner keeps the memory.
struct LoadedBytes {
  dcp::TensorView view;
};

// Every stored item of the checkpoint, whole: key -> (dtype name, shape, LoadedBytes) or bytes
// (blobs).
py::dict LoadAll(const std::string& uri) {
  Session& s = Require();
  dcp::StateDict sd = Call([&] { return dcp::LoadAll(uri, *s.comm); });
  py::dict out;
  std::vector<std::pair<std::string, const dcp::StateDict*>> stack{{"", &sd}};
  while (!stack.empty()) {
    auto [prefix, dict] = stack.back();
    stack.pop_back();
    for (const auto& [key, value] : dict->items()) {
      const std::string name = prefix.empty() ? key : prefix + "." + key;
      if (const auto* v = std::get_if<dcp::TensorView>(&value)) {
        // The loaded memory itself (LoadAll's own, contiguous, host): the Python half views it
        // as a tensor (torch.frombuffer), which keeps this object, and so the memory, alive.
        out[py::str(name)] =
            py::make_tuple(std::string(dcp::DTypeName(v->dtype)), v->shape, LoadedBytes{*v});
      } else if (const auto* b = std::get_if<dcp::Blob>(&value)) {
        out[py::str(name)] = py::bytes(b->bytes);
      } else if (const auto* d = std::get_if<std::shared_ptr<dcp::StateDict>>(&value)) {
        stack.emplace_back(name, d->get());
      }
    }
  }
  return out;
}

py::dict BlobsOf(const dcp::StateDict& sd) {
  py::dict blobs;
  for (const auto& [key, value] : sd.items()) {
    if (const auto* b = std::get_if<dcp::Blob>(&value)) blobs[py::str(key)] = py::bytes(b->bytes);
  }
  return blobs;
}

// dcp.CheckpointManager's C++ half: a CheckpointManager on the session's communicator (kept
// alive with the session), its background saves on a communicator of its own.
class Manager {
 public:
  Manager(const std::string& root, const py::dict& o) : session_(session) {
    if (!session_) Require();
    dcp::ManagerOptions options;
    options.keep_last = o["keep_last"].cast<int>();
    options.keep_every = o["keep_every"].cast<int>();
    options.incremental = o["incremental"].cast<bool>();
    options.save.storage.frozen_prefixes = o["frozen"].cast<std::vector<std::string>>();
    if (!o["memory_tier"].is_none()) {
      dcp::MemoryTierOptions tier;
      tier.name = o["memory_tier"].cast<std::string>();
      tier.shm_root = o["shm_root"].cast<std::string>();
      tier.ranks_per_node = o["ranks_per_node"].cast<int>();
      tier.free_on_close = o["free_on_close"].cast<bool>();
      options.memory_tier = tier;
      options.memory_every = o["memory_every"].cast<int>();
      options.durable_every = o["durable_every"].cast<int>();
    }
    const bool async_save = o["async_save"].cast<bool>();
    Call([&] {
      std::unique_ptr<dcp::Communicator> background;
      if (async_save) background = session_->Another();
      manager_ = std::make_unique<dcp::CheckpointManager>(root, *session_->comm,
                                                          std::move(background), options);
    });
  }
  ~Manager() {
    if (manager_) {
      py::gil_scoped_release release;
      manager_->Close();  // never throws; an unfinished save is reported on stderr
    }
  }

  void Save(int64_t step, const py::list& entries) {
    dcp::StateDict sd = ToStateDictOrRaise(entries);
    Call([&] { Open().Save(step, sd); });
  }
  void Wait() {
    Call([&] { Open().Wait(); });
  }
  py::object Restore(const py::list& entries) {
    dcp::StateDict sd = ToStateDictOrRaise(entries);
    const std::optional<int64_t> step = Call([&] { return Open().Restore(sd); });
    if (!step) return py::none();
    return py::make_tuple(*step, BlobsOf(sd));
  }
  py::object LatestStep() {
    const std::optional<int64_t> step = Call([&] { return Open().LatestStep(); });
    return step ? py::cast(*step) : py::none();
  }
  std::string RestoreSource() { return Open().restore_source(); }
  void HandlePreemption(double grace_s, bool on_sigterm, double next_step_s) {
    dcp::PreemptionOptions po;
    po.grace_period = std::chrono::milliseconds(static_cast<int64_t>(grace_s * 1000));
    po.next_step_within = std::chrono::milliseconds(static_cast<int64_t>(next_step_s * 1000));
    po.on_sigterm = on_sigterm;
    Call([&] { Open().HandlePreemption(session_->Another(), po); });
  }
  bool Preempted() { return Open().preempted(); }
  py::dict WaitForPreemption(double timeout_s) {
    const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
    const dcp::PreemptionReport r = Call([&] { return Open().WaitForPreemption(timeout); });
    py::dict out;
    out["noticed"] = r.noticed;
    out["done"] = r.done;
    out["step"] = r.step;
    out["drained"] = r.drained;
    out["where"] = r.where;
    out["bytes"] = r.bytes;
    out["seconds"] = r.seconds;
    out["window_left_s"] = r.window_left_s;
    out["error"] = r.error;
    return out;
  }
  void Close() {
    if (!manager_) return;
    Call([&] { manager_->CloseOrThrow(); });
    manager_.reset();
  }

 private:
  dcp::CheckpointManager& Open() {
    if (!manager_) throw dcp::InvalidArgumentError("dcp: CheckpointManager used after close()");
    return *manager_;
  }
  std::shared_ptr<Session> session_;
  std::unique_ptr<dcp::CheckpointManager> manager_;
};

dcp::StateDict ToStateDictOrRaise(const py::list& entries) {
  try {
    return ToStateDict(entries);
  } catch (const dcp::Error& e) {
    RaiseAsPython(e);
  }
}

}  // namespace

PYBIND11_MODULE(_dcp, m) {
  m.doc() = "dcp's C++ half; use the package `dcp`";
  m.def("init", &Init, py::arg("timeout_s"));
  m.def("close", &Close);
  m.def("initialized", [] { return session != nullptr; });
  m.def("rank", [] { return Require().comm->rank(); });
  m.def("world_size", [] { return Require().comm->size(); });
  m.def("save", &Save, py::arg("entries"), py::arg("uri"), py::arg("overwrite"),
        py::arg("async_save"));
  m.def("wait", &Wait);
  m.def("load", &Load, py::arg("entries"), py::arg("uri"));
  m.def("load_all", &LoadAll, py::arg("uri"));
  m.def("notify_preemption", [] { dcp::NotifyPreemption(); });
  dcp_python::BindTorchPlugin(m);
  py::class_<LoadedBytes>(m, "LoadedBytes", py::buffer_protocol())
      .def_buffer([](LoadedBytes& b) {
        return py::buffer_info(b.view.data, 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.view.nbytes())}, {py::ssize_t{1}});
      })
      .def("__len__", [](const LoadedBytes& b) { return b.view.nbytes(); });
  py::class_<Manager>(m, "Manager")
      .def(py::init<const std::string&, const py::dict&>())
      .def("save", &Manager::Save)
      .def("wait", &Manager::Wait)
      .def("restore", &Manager::Restore)
      .def("latest_step", &Manager::LatestStep)
      .def("restore_source", &Manager::RestoreSource)
      .def("handle_preemption", &Manager::HandlePreemption)
      .def("preempted", &Manager::Preempted)
      .def("wait_for_preemption", &Manager::WaitForPreemption)
      .def("close", &Manager::Close);
}
