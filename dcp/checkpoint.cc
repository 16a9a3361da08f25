#include "dcp/checkpoint.h"

#include <exception>
#include <memory>
#include <utility>
#include <variant>

#include "dcp/proto/error.h"
#include "dcp/protocol/load.h"
#include "dcp/protocol/save.h"
#include "dcp/storage/format/layout.h"
#include "dcp/storage/registry.h"
#include "dcp_version.h"

namespace dcp {

const char* LibraryVersion() { return DCP_VERSION_STRING; }

void SavePlanCache::Clear() { entry = Entry{}; }

SaveResult Save(const StateDict& state_dict, StorageWriter& writer, Communicator& comm,
                const SaveOptions& options) {
  // Views bound to memory that may have moved (LibTorch parameters, optimizer fields): save
  // what they are now.
  if (HasBindings(state_dict)) return Save(ResolveBindings(state_dict), writer, comm, options);
  return protocol::RunSave(state_dict, writer, comm, options);
}

namespace {

// Loads tensors only: a copy of the state dict's structure without its blobs. Its views alias
// the caller's memory, so loading into it still happens in place.
StateDict WithoutBlobs(const StateDict& state) {
  StateDict out;
  for (const auto& [key, value] : state.items()) {
    if (std::holds_alternative<Blob>(value)) continue;
    if (const auto* nested = std::get_if<std::shared_ptr<StateDict>>(&value)) {
      StateDict child = WithoutBlobs(**nested);
      if (!child.empty()) out.Set(key, std::make_shared<StateDict>(std::move(child)));
      continue;
    }
    out.Set(key, value);
  }
  return out;
}

void CheckLoadOptions(const LoadOptions& options, bool load_all) {
  if (options.planner && options.allow_partial_load) {
    throw InvalidArgumentError(
        "LoadOptions::allow_partial_load applies to the default planner; a custom planner "
        "decides what a missing key means");
  }
  if (options.planner && options.cast_dtypes) {
    throw InvalidArgumentError(
        "LoadOptions::cast_dtypes applies to the default planner; a custom planner resolves "
        "destinations itself");
  }
  if (options.planner && load_all) {
    throw InvalidArgumentError("LoadAll allocates through the default planner; pass no planner");
  }
}

LoadResult LoadInto(StateDict& state_dict, StorageReader& reader, Communicator& comm,
                    const LoadOptions& options, bool load_all) {
  CheckLoadOptions(options, load_all);
  if (!load_all && options.weights_only) {
    StateDict tensors = WithoutBlobs(state_dict);
    LoadOptions rest = options;
    rest.weights_only = false;
    return LoadInto(tensors, reader, comm, rest, false);
  }
  if (!load_all && HasBindings(state_dict)) {
    // Load into what the bound views are now, then let each binding take its value back.
    StateDict resolved = ResolveBindings(state_dict);
    LoadResult result = LoadInto(resolved, reader, comm, options, false);
    FinishBoundLoad(state_dict, resolved);
    return result;
  }
  LoadResult result = protocol::RunLoad(state_dict, reader, comm, options, load_all);
  if (load_all && options.weights_only) state_dict = WithoutBlobs(state_dict);
  return result;
}

}  // namespace

LoadResult Load(StateDict& state_dict, StorageReader& reader, Communicator& comm,
                const LoadOptions& options) {
  return LoadInto(state_dict, reader, comm, options, /*load_all=*/false);
}

StateDict LoadAll(StorageReader& reader, Communicator& comm, const LoadOptions& options) {
  StateDict state;
  LoadInto(state, reader, comm, options, /*load_all=*/true);
  return state;
}

// A backend factory can fail on some ranks only (a custom scheme, a permission problem). These
// stand-ins carry such a failure into the protocol's first phase, so every rank reports it.
class FailedWriter : public StorageWriter {
 public:
  FailedWriter(std::string uri, std::exception_ptr e) : uri_(std::move(uri)), e_(e) {}
  std::string uri() const override { return uri_; }
  void SetUp(const StorageContext&) override { std::rethrow_exception(e_); }
  SavePlan PrepareLocalPlan(SavePlan) override { std::rethrow_exception(e_); }
  std::vector<SavePlan> PrepareGlobalPlan(std::vector<SavePlan>) override {
    std::rethrow_exception(e_);
  }
  std::future<std::vector<WriteResult>> WriteData(const SavePlan&, const SavePlanner&) override {
    std::rethrow_exception(e_);
  }
  void Finish(Metadata&, const std::vector<std::vector<WriteResult>>&) override {
    std::rethrow_exception(e_);
  }
  void Abort() noexcept override {}

 private:
  std::string uri_;
  std::exception_ptr e_;
};

class FailedReader : public StorageReader {
 public:
  FailedReader(std::string uri, std::exception_ptr e) : uri_(std::move(uri)), e_(e) {}
  std::string uri() const override { return uri_; }
  Metadata ReadMetadata() override { std::rethrow_exception(e_); }
  void SetUp(const Metadata&, const StorageContext&) override { std::rethrow_exception(e_); }
  LoadPlan PrepareLocalPlan(LoadPlan) override { std::rethrow_exception(e_); }
  std::vector<LoadPlan> PrepareGlobalPlan(std::vector<LoadPlan>) override {
    std::rethrow_exception(e_);
  }
  std::future<void> ReadData(const LoadPlan&, LoadPlanner&) override { std::rethrow_exception(e_); }

 private:
  std::string uri_;
  std::exception_ptr e_;
};

namespace {
std::unique_ptr<StorageWriter> WriterFor(const std::string& uri, const StorageOptions& options) {
  try {
    return OpenStorageWriter(uri, options);
  } catch (...) {
    return std::make_unique<FailedWriter>(uri, std::current_exception());
  }
}
std::unique_ptr<StorageReader> ReaderFor(const std::string& uri, const StorageOptions& options) {
  try {
    return OpenStorageReader(uri, options);
  } catch (...) {
    return std::make_unique<FailedReader>(uri, std::current_exception());
  }
}
}  // namespace

SaveResult Save(const StateDict& state_dict, const std::string& uri, Communicator& comm,
                const SaveOptions& options) {
  return Save(state_dict, *WriterFor(uri, options.storage), comm, options);
}

LoadResult Load(StateDict& state_dict, const std::string& uri, Communicator& comm,
                const LoadOptions& options) {
  return Load(state_dict, *ReaderFor(uri, options.storage), comm, options);
}

StateDict LoadAll(const std::string& uri, Communicator& comm, const LoadOptions& options) {
  return LoadAll(*ReaderFor(uri, options.storage), comm, options);
}

SaveResult Save(const StateDict& state_dict, const std::string& uri, const SaveOptions& options) {
  LocalCommunicator comm;
  return Save(state_dict, uri, comm, options);
}

LoadResult Load(StateDict& state_dict, const std::string& uri, const LoadOptions& options) {
  LocalCommunicator comm;
  return Load(state_dict, uri, comm, options);
}

StateDict LoadAll(const std::string& uri, const LoadOptions& options) {
  LocalCommunicator comm;
  return LoadAll(uri, comm, options);
}

Metadata ReadMetadata(const std::string& uri, const StorageOptions& options) {
  Metadata md = OpenStorageReader(uri, options)->ReadMetadata();
  ReadStoredItems(uri, md, options);
  return md;
}

void ReadStoredItems(const std::string& uri, Metadata& md, const StorageOptions& options) {
  if (md.format_version < 2) return;
  ReadAllStoredItems(*OpenStoreForReading(uri, options.backend), md);
}

PyValuePtr PythonValue(const Blob& blob, const std::string& what) {
  return ReadPythonValue(blob.bytes, what);
}

}  // namespace dcp
