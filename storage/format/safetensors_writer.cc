// Writing Hugging Face safetensors checkpoints (storage/format/safetensors.h, docs/SAFETENSORS.md).
//
// safetensors files hold whole tensors, while each rank holds shards. The coordinator assigns
// every tensor to one file and every file to one owner rank (PrepareGlobalPlan: files balanced
// by bytes, largest tensor first onto the lightest file; file f belongs to rank f % N). The
// assignment travels in every rank's plan (storage_data), so each rank derives the same
// schedule from it: each file's tensors, in name order, are cut into units of whole rows (dim 0)
// of at most `round_bytes`, and the units are packed into rounds of at most `round_bytes` per
// file. In round k every rank sends each owner the parts of its shards that fall in the owner's
// round-k units, in one all-to-all (StorageContext::exchange); each owner assembles the units and
// appends them to its files on a pool thread while the next round is exchanged. So no rank ever
// holds more than a round of each file it owns (plus what it sends), never the model.
//
// The save protocol is the generic one (storage/checkpoint/store_writer.cc): this writer wraps
// it and only replaces the global plan, the data path and the shape of the metadata it commits
// (the index, model.safetensors.index.json, published atomically last by the coordinator under
// the writer lock; data files carry the save id, so an overwrite never touches the old files).
//
// Failures: a rank that fails keeps taking part in the exchange and sends an error instead of
// data in the next round; every rank receives every rank's message each round, so all stop in
// the same round and the collective sequence stays aligned (no peer waits for a timeout).
#include <algorithm>
#include <cstring>
#include <future>
#include <map>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "dcp/planner/default_planner.h"
#include "dcp/proto/device/device.h"
#include "dcp/proto/error.h"
#include "dcp/proto/executor.h"
#include "dcp/proto/random_name.h"
#include "dcp/proto/staging.h"
#include "dcp/storage/format/layout.h"
#include "dcp/storage/format/safetensors.h"

namespace dcp {
namespace {

using Json = nlohmann::json;

struct PlannedTensor {
  std::string name;
  bool blob = false;  // a byte entry, written as a 1-d U8 tensor
  DType dtype = DType::kUInt8;
  Shape shape;
  uint64_t bytes = 0;
};

struct PlannedFile {
  std::string name;
  int owner = 0;
  std::vector<uint32_t> tensors;  // indexes into Assignment::tensors, in name order
};

// What the coordinator decides and every rank receives (encoded as JSON in storage_data).
struct Assignment {
  uint64_t round_bytes = 1;
  std::vector<PlannedTensor> tensors;  // in name order
  std::vector<PlannedFile> files;
};

// Rows [row0, row0 + rows) of a tensor (all of a 0-d or empty tensor or a blob), assembled by
// the owner of `file` in round `round`.
struct Unit {
  uint32_t tensor = 0;
  uint32_t file = 0;
  uint32_t round = 0;
  int64_t row0 = 0, rows = 0;
  uint64_t bytes = 0;
};

ChunkMeta UnitBox(const PlannedTensor& t, const Unit& u) {
  ChunkMeta box{Shape(t.shape.size(), 0), t.shape};
  if (!t.shape.empty()) {
    box.offsets[0] = u.row0;
    box.sizes[0] = u.rows;
  }
  return box;
}

std::string EncodeAssignment(const Assignment& a) {
  Json tensors = Json::array();
  for (const auto& t : a.tensors) {
    tensors.push_back({t.name, t.blob, std::string(DTypeName(t.dtype)), t.shape});
  }
  Json files = Json::array();
  for (const auto& f : a.files) files.push_back({f.name, f.owner, f.tensors});
  return Json{{"round_bytes", a.round_bytes}, {"tensors", tensors}, {"files", files}}.dump();
}

// Trusted (the coordinator's own output), but checked as cheaply as it is read.
Assignment DecodeAssignment(const std::string& text) {
  Assignment a;
  try {
    const Json j = Json::parse(text);
    a.round_bytes = std::max<uint64_t>(j.at("round_bytes").get<uint64_t>(), 1);
    for (const auto& t : j.at("tensors")) {
      PlannedTensor p;
      p.name = t.at(0).get<std::string>();
      p.blob = t.at(1).get<bool>();
      const auto dtype = DTypeFromName(t.at(2).get<std::string>());
      if (!dtype) throw InternalError("unknown dtype");
      p.dtype = *dtype;
      p.shape = t.at(3).get<Shape>();
      p.bytes = static_cast<uint64_t>(NumElements(p.shape)) * ElementSize(p.dtype);
      a.tensors.push_back(std::move(p));
    }
    for (const auto& f : j.at("files")) {
      PlannedFile p{f.at(0).get<std::string>(), f.at(1).get<int>(),
                    f.at(2).get<std::vector<uint32_t>>()};
      for (uint32_t t : p.tensors) {
        if (t >= a.tensors.size()) throw InternalError("tensor index out of range");
      }
      a.files.push_back(std::move(p));
    }
  } catch (const Json::exception& e) {
    throw InternalError(std::string("unreadable safetensors save plan: ") + e.what());
  }
  return a;
}

// The schedule every rank derives alike: units in file order, and the number of rounds.
std::vector<Unit> Schedule(const Assignment& a, uint32_t* rounds) {
  std::vector<Unit> units;
  *rounds = 0;
  for (uint32_t f = 0; f < a.files.size(); ++f) {
    uint32_t round = 0;
    uint64_t in_round = 0;
    auto add = [&](uint32_t t, int64_t row0, int64_t rows, uint64_t bytes) {
      if (in_round > 0 && in_round + bytes > a.round_bytes) {
        ++round;
        in_round = 0;
      }
      units.push_back(Unit{t, f, round, row0, rows, bytes});
      in_round += bytes;
    };
    for (uint32_t t : a.files[f].tensors) {
      const PlannedTensor& p = a.tensors[t];
      if (p.blob || p.shape.empty() || p.bytes == 0) {
        add(t, 0, p.shape.empty() ? 0 : p.shape[0], p.bytes);
        continue;
      }
      const uint64_t row_bytes = p.bytes / static_cast<uint64_t>(p.shape[0]);
      const int64_t per = static_cast<int64_t>(std::max<uint64_t>(1, a.round_bytes / row_bytes));
      for (int64_t r0 = 0; r0 < p.shape[0]; r0 += per) {
        const int64_t rows = std::min(per, p.shape[0] - r0);
        add(t, r0, rows, static_cast<uint64_t>(rows) * row_bytes);
      }
    }
    if (!a.files[f].tensors.empty()) *rounds = std::max(*rounds, round + 1);
  }
  return units;
}

// A file's first bytes: the 8-byte little-endian header length and the JSON header, padded with
// spaces to a multiple of 8 (as the safetensors library does, so the data is aligned). `begins`
// gets each tensor's offset in the data section.
std::string FileHeader(const Assignment& a, const PlannedFile& f, std::vector<uint64_t>* begins) {
  Json header = Json::object();
  Json blobs = Json::array();
  uint64_t at = 0;
  for (uint32_t t : f.tensors) {
    const PlannedTensor& p = a.tensors[t];
    header[p.name] = {{"dtype", *SafetensorsDTypeName(p.dtype)},
                      {"shape", p.shape},
                      {"data_offsets", Json::array({Json(at), Json(at + p.bytes)})}};
    begins->push_back(at);
    at += p.bytes;
    if (p.blob) blobs.push_back(p.name);
  }
  Json meta = {{"format", "pt"}};
  if (!blobs.empty()) meta[kSafetensorsBlobsKey] = blobs.dump();
  header["__metadata__"] = meta;
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');
  if (json.size() > kMaxSafetensorsHeaderBytes) {
    throw UnsupportedError("the safetensors header of '" + f.name + "' would have " +
                           std::to_string(json.size()) + " bytes, over the limit of " +
                           std::to_string(kMaxSafetensorsHeaderBytes) +
                           " (too many tensors in one file: use more files_per_rank)");
  }
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((json.size() >> (8 * i)) & 0xff);
  return out + json;
}

// A piece on the wire: [u32 unit][u64 bytes][i64 offset, i64 size per dimension][bytes], in the
// host's byte order (every rank of a job runs on the same architecture).
template <class T>
void Put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(v));
}
template <class T>
T Get(const std::string& s, size_t& at, const char* what) {
  if (s.size() - at < sizeof(T)) throw InternalError(std::string("truncated exchange ") + what);
  T v;
  std::memcpy(&v, s.data() + at, sizeof(T));
  at += sizeof(T);
  return v;
}

// The zero-element tensors `storage_data` names: a local plan's declarations (a JSON list of
// [fqn, dtype, shape]) or a prepared plan's assignment (its zero-byte tensors).
std::vector<PlannedTensor> EmptyDeclared(const std::string& storage_data) {
  std::vector<PlannedTensor> out;
  if (storage_data.empty()) return out;
  if (storage_data[0] == '{') {
    for (auto& t : DecodeAssignment(storage_data).tensors) {
      if (!t.blob && t.bytes == 0) out.push_back(std::move(t));
    }
    return out;
  }
  try {
    for (const auto& d : Json::parse(storage_data)) {
      PlannedTensor t;
      t.name = d.at(0).get<std::string>();
      const auto dtype = DTypeFromName(d.at(1).get<std::string>());
      if (!dtype) throw InternalError("unknown dtype");
      t.dtype = *dtype;
      t.shape = d.at(2).get<Shape>();
      out.push_back(std::move(t));
    }
  } catch (const Json::exception& e) {
    throw InternalError(std::string("unreadable safetensors local plan: ") + e.what());
  }
  return out;
}

std::string Describe(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown error";
  }
}

bool IsHexId(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
  });
}

std::string Digits5(size_t v) {
  std::string s = std::to_string(v);
  return std::string(s.size() < 5 ? 5 - s.size() : 0, '0') + s;
}

class SafetensorsWriter : public StorageWriter {
 public:
  SafetensorsWriter(std::unique_ptr<StorageWriter> protocol, std::shared_ptr<Store> store,
                    const StorageOptions& options)
      : protocol_(std::move(protocol)), store_(std::move(store)), options_(options) {}

  std::string uri() const override { return protocol_->uri(); }

  void SetUp(const StorageContext& ctx) override {
    ctx_ = ctx;
    created_.clear();
    if (ctx.world_size > 1 && ctx.exchange == nullptr) {
      throw UnsupportedError("a safetensors save of " + std::to_string(ctx.world_size) +
                             " ranks to " + uri() +
                             " needs the exchange among ranks that dcp::Save provides");
    }
    protocol_->SetUp(ctx);
    // The protocol checks for the index; a lone model.safetensors is a checkpoint too (the
    // reader loads it when there is no index), so it is not silently shadowed. Abort releases
    // the lock taken above.
    if (ctx.is_coordinator && !options_.overwrite && !store_->Size(kSafetensorsIndexName) &&
        store_->Size(kSafetensorsSingleName)) {
      throw AlreadyExistsError("a checkpoint already exists at " + uri() + " (it has " +
                               kSafetensorsSingleName + "); pass overwrite to replace it");
    }
  }

  // Every rank refuses what the format cannot hold before anything is written. A zero-element
  // sharded tensor of which no rank holds a shard has no item on any rank; DefaultSavePlanner
  // declares it in its planner_data (which the global plan no longer carries), so this rank
  // passes its zero-element declarations to the coordinator in storage_data, and the files
  // list the tensor too.
  SavePlan PrepareLocalPlan(SavePlan plan) override {
    for (const auto& item : plan.items) CheckStorable(item);
    std::vector<SaveDeclaration> declared;
    try {
      declared = DecodeSaveDeclarations(plan.planner_data);
    } catch (const CorruptionError&) {
      // Another planner's data: it declares nothing this writer can use.
    }
    Json empty = Json::array();
    for (const auto& d : declared) {
      if (NumElements(d.shape) != 0) continue;  // some rank holds its elements: it has items
      if (!SafetensorsDTypeName(d.dtype)) {
        CheckStorable(WriteItem{{d.fqn, {}, {}}, WriteItemType::kShard, d.dtype, d.shape, {}, 0});
      }
      empty.push_back({d.fqn, std::string(DTypeName(d.dtype)), d.shape});
    }
    plan.storage_data = empty.empty() ? std::string() : empty.dump();
    return protocol_->PrepareLocalPlan(std::move(plan));
  }

  std::vector<SavePlan> PrepareGlobalPlan(std::vector<SavePlan> plans) override {
    const std::string save = ctx_.save_id.empty() ? RandomHex(8) : ctx_.save_id;
    std::map<std::string, PlannedTensor> by_name;
    for (const auto& plan : plans) {
      for (const auto& item : plan.items) {
        CheckStorable(item);
        auto [it, fresh] = by_name.try_emplace(item.index.fqn);
        PlannedTensor& t = it->second;
        if (fresh) {
          t.name = item.index.fqn;
          t.blob = !item.is_tensor();
          if (item.is_tensor()) {
            t.dtype = item.dtype;
            t.shape = item.global_shape;
            t.bytes = static_cast<uint64_t>(NumElements(t.shape)) * ElementSize(t.dtype);
          } else {
            t.bytes = item.size_bytes;
            t.shape = {static_cast<int64_t>(item.size_bytes)};
          }
        } else if (t.blob || !item.is_tensor() || t.dtype != item.dtype ||
                   t.shape != item.global_shape) {
          throw InternalError("entry " + ClippedName(t.name) +
                              " is planned differently by two ranks");
        }
      }
    }
    // Zero-element tensors no rank has items of: the ranks' declarations (PrepareLocalPlan), or,
    // for plans this writer already prepared (a plan cache hit), the previous assignment's.
    for (const auto& plan : plans) {
      for (PlannedTensor& t : EmptyDeclared(plan.storage_data)) {
        if (by_name.count(t.name) == 0) by_name.emplace(t.name, std::move(t));
      }
    }
    // An index maps at least one tensor: the reader refuses an empty weight_map (a hostile index
    // must not pass for an empty model), so an empty save is refused before anything is written.
    if (by_name.empty()) {
      throw InvalidArgumentError("a safetensors checkpoint holds at least one entry: the state " +
                                 std::string("dict saved to ") + uri() +
                                 " is empty (save it as dcp or torchdcp)");
    }
    Assignment a;
    a.round_bytes = std::clamp<uint64_t>(options_.memory_budget_bytes / 4, uint64_t{1} << 20,
                                         uint64_t{256} << 20);
    for (auto& [name, t] : by_name) a.tensors.push_back(std::move(t));
    const size_t n = plans.size();
    const size_t nfiles =
        std::min(a.tensors.size(), n * static_cast<size_t>(options_.files_per_rank));
    std::vector<uint32_t> order(a.tensors.size());
    for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](uint32_t x, uint32_t y) {
      return a.tensors[x].bytes > a.tensors[y].bytes;
    });
    a.files.resize(nfiles);
    std::vector<uint64_t> load(nfiles, 0);
    for (uint32_t t : order) {
      const size_t f = std::min_element(load.begin(), load.end()) - load.begin();
      a.files[f].tensors.push_back(t);
      load[f] += a.tensors[t].bytes;
    }
    for (size_t f = 0; f < nfiles; ++f) {
      std::sort(a.files[f].tensors.begin(), a.files[f].tensors.end());  // name order
      a.files[f].name =
          "model-" + Digits5(f + 1) + "-of-" + Digits5(nfiles) + "-" + save + ".safetensors";
      a.files[f].owner = static_cast<int>(f % n);
    }
    const std::string encoded = EncodeAssignment(a);
    for (auto& plan : plans) plan.storage_data = encoded;
    return plans;
  }

  std::future<std::vector<WriteResult>> WriteData(const SavePlan& plan,
                                                  const SavePlanner& planner) override {
    // On the calling thread: the exchange uses the save's communicator, which belongs to it.
    std::promise<std::vector<WriteResult>> done;
    try {
      done.set_value(Write(plan, planner));
    } catch (...) {
      done.set_exception(std::current_exception());
    }
    return done.get_future();
  }

  // The planner's metadata lists each rank's shards; the files hold whole tensors, so each
  // tensor becomes one chunk, as a reader of the files sees it. Then the generic commit.
  void Finish(Metadata& md, const std::vector<std::vector<WriteResult>>& results) override {
    // (A zero-element tensor of which no rank holds a shard has no item and no chunk: it stays
    // so, and is in no file.)
    for (const auto& rank_results : results) {
      for (const auto& r : rank_results) {
        auto it = md.entries.find(r.index.fqn);
        if (it == md.entries.end()) continue;  // validation names it
        if (auto* t = std::get_if<TensorMetadata>(&it->second)) {
          t->chunks = {ChunkMeta{Shape(t->shape.size(), 0), t->shape}};
          t->regular.reset();
          t->chunk_writers.clear();
        }
      }
    }
    FillStorage(md, results);
    protocol_->Finish(md, {});
  }

  void AfterCommitDelivered() noexcept override { protocol_->AfterCommitDelivered(); }

  void Abort() noexcept override {
    for (const auto& name : created_) {
      try {
        store_->Remove(name);
      } catch (...) {
        // After the real error; an unreferenced file is removed by the next locked save.
      }
    }
    created_.clear();
    protocol_->Abort();
  }

 private:
  static void CheckStorable(const WriteItem& item) {
    if (item.index.fqn == "__metadata__") {
      throw UnsupportedError(
          "entry '__metadata__' cannot be saved as safetensors: the format reserves the name");
    }
    if (item.is_tensor() && !SafetensorsDTypeName(item.dtype)) {
      throw UnsupportedError("tensor " + ClippedName(item.index.fqn) + " has dtype " +
                             std::string(DTypeName(item.dtype)) +
                             ", which safetensors cannot store; save it as dcp or torchdcp, "
                             "or convert it first");
    }
  }

  struct OpenFile {
    std::unique_ptr<WritableObject> out;
    std::string name;
  };

  std::vector<WriteResult> Write(const SavePlan& plan, const SavePlanner& planner) {
    const int me = ctx_.rank, n = ctx_.world_size;
    std::exception_ptr failed;  // this rank's first failure: its peers learn it next round
    auto attempt = [&](auto&& step) {
      if (failed) return;
      try {
        step();
      } catch (...) {
        failed = std::current_exception();
      }
    };
    Assignment a;
    std::vector<Unit> units;
    uint32_t rounds = 0;
    attempt([&] {
      a = DecodeAssignment(plan.storage_data);
      units = Schedule(a, &rounds);
    });
    // Per round: the (item, unit) pairs this rank sends, and the units it assembles.
    std::vector<std::vector<std::pair<size_t, uint32_t>>> sends(rounds);
    std::vector<std::vector<uint32_t>> assembles(rounds);
    std::vector<OpenFile> files(a.files.size());
    std::vector<WriteResult> results;
    attempt([&] {
      std::unordered_map<std::string_view, uint32_t> id;
      for (uint32_t t = 0; t < a.tensors.size(); ++t) id.emplace(a.tensors[t].name, t);
      std::vector<std::vector<uint32_t>> units_of(a.tensors.size());
      for (uint32_t u = 0; u < units.size(); ++u) units_of[units[u].tensor].push_back(u);
      for (size_t i = 0; i < plan.items.size(); ++i) {
        const WriteItem& item = plan.items[i];
        auto it = id.find(item.index.fqn);
        if (it == id.end()) {
          throw InternalError("item " + item.index.ToString() + " is not in the save's files");
        }
        for (uint32_t u : units_of[it->second]) {
          const PlannedTensor& t = a.tensors[units[u].tensor];
          if (units[u].bytes == 0) continue;  // nothing to send
          if (item.is_tensor() && !Intersect(item.chunk, UnitBox(t, units[u]))) continue;
          sends[units[u].round].emplace_back(i, u);
        }
      }
      for (uint32_t u = 0; u < units.size(); ++u) {
        if (a.files[units[u].file].owner == me) assembles[units[u].round].push_back(u);
      }
      // This rank's files: created with their headers now, filled round by round. A quarter of
      // the budget is the round being assembled; another quarter is the files' store buffers.
      const size_t mine = static_cast<size_t>(std::count_if(
          a.files.begin(), a.files.end(), [&](const auto& file) { return file.owner == me; }));
      for (uint32_t f = 0; f < a.files.size(); ++f) {
        if (a.files[f].owner != me) continue;
        std::vector<uint64_t> begins;
        const std::string header = FileHeader(a, a.files[f], &begins);
        files[f].name = a.files[f].name;
        created_.push_back(files[f].name);
        files[f].out = store_->Create(files[f].name);
        files[f].out->LimitBuffers(options_.memory_budget_bytes / 4 / std::max<size_t>(mine, 1));
        files[f].out->Append(header.data(), header.size());
        for (size_t j = 0; j < begins.size(); ++j) {
          const PlannedTensor& t = a.tensors[a.files[f].tensors[j]];
          WriteResult r;
          r.index = t.blob ? MetadataIndex{t.name, {}, std::nullopt}
                           : MetadataIndex{t.name, Shape(t.shape.size(), 0), 0};
          r.size_in_bytes = t.bytes;
          r.storage.relative_path = files[f].name;
          r.storage.offset = header.size() + begins[j];
          r.storage.length = t.bytes;
          r.storage.raw_length = t.bytes;
          results.push_back(std::move(r));
        }
      }
    });
    Task<void> pending;  // the previous round's appends (declared after `files`: waits first)
    for (uint32_t k = 0; k < rounds; ++k) {
      std::vector<std::string> to(static_cast<size_t>(n));
      attempt([&] { to = Pieces(plan, planner, a, units, sends[k]); });
      if (failed) {
        const std::string why = "E" + Describe(failed);
        for (auto& m : to) m = why;
      }
      std::vector<std::string> got =
          ctx_.exchange ? ctx_.exchange->AllToAll(std::move(to), "save/safetensors-exchange")
                        : std::move(to);
      if (failed) {
        pending.Wait();
        std::rethrow_exception(failed);
      }
      for (size_t r = 0; r < got.size(); ++r) {
        if (!got[r].empty() && got[r][0] == 'E') {
          pending.Wait();
          throw Error(ErrorCode::kCollective, "rank " + std::to_string(r) +
                                                  " failed while the ranks exchanged shards for "
                                                  "the safetensors files: " +
                                                  got[r].substr(1));
        }
      }
      attempt([&] {
        Round round = Assemble(a, units, assembles[k], std::move(got));
        if (pending.valid()) pending.get();
        pending = Spawn([&files, &units, list = assembles[k], round = std::move(round)] {
          for (size_t j = 0; j < list.size(); ++j) {
            for (const auto& [data, n] : round.spans[j]) {
              files[units[list[j]].file].out->Append(data, n);
            }
          }
        });
      });
    }
    // After the last exchange nobody waits for this rank: a failure is reported in the phase.
    if (pending.valid()) attempt([&] { pending.get(); });
    if (failed) std::rethrow_exception(failed);
    for (auto& f : files) {
      if (!f.out) continue;
      if (options_.sync) f.out->Sync();
      f.out->Close();
    }
    return results;
  }

  // This round's messages: to[r] holds the parts of this rank's items that fall in rank r's
  // units, as pieces, after the 'D' (data) tag.
  std::vector<std::string> Pieces(const SavePlan& plan, const SavePlanner& planner,
                                  const Assignment& a, const std::vector<Unit>& units,
                                  const std::vector<std::pair<size_t, uint32_t>>& sends) const {
    const size_t n = static_cast<size_t>(ctx_.world_size);
    struct Piece {
      size_t item;
      uint32_t unit;
      ChunkMeta box;  // in the tensor's coordinates
      uint64_t bytes;
    };
    std::vector<std::vector<Piece>> by_dest(n);
    std::vector<size_t> reserve(n, 1);
    for (const auto& [i, u] : sends) {
      const WriteItem& item = plan.items[i];
      const PlannedTensor& t = a.tensors[units[u].tensor];
      Piece p{i, u, {}, item.size_bytes};
      if (item.is_tensor()) {
        p.box = *Intersect(item.chunk, UnitBox(t, units[u]));
        p.bytes = static_cast<uint64_t>(p.box.numel()) * ElementSize(t.dtype);
      }
      const size_t dest = static_cast<size_t>(a.files[units[u].file].owner);
      reserve[dest] += 12 + 16 * p.box.offsets.size() + p.bytes;
      by_dest[dest].push_back(std::move(p));
    }
    std::vector<std::string> to(n);
    for (size_t d = 0; d < n; ++d) {
      std::string& m = to[d];
      m.reserve(reserve[d]);
      m.push_back('D');
      for (const Piece& p : by_dest[d]) {
        const WriteItem& item = plan.items[p.item];
        const ResolvedData data = planner.ResolveData(item);
        Put<uint32_t>(m, p.unit);
        Put<uint64_t>(m, p.bytes);
        if (!item.is_tensor()) {
          if (data.bytes.size() != item.size_bytes) {
            throw InvalidArgumentError("entry " + ClippedName(item.index.fqn) +
                                       " changed during the save: planned with " +
                                       std::to_string(item.size_bytes) + " bytes, now has " +
                                       std::to_string(data.bytes.size()));
          }
          m.append(data.bytes.data(), data.bytes.size());
          continue;
        }
        CheckUnchanged(item, data);
        Shape rel(p.box.offsets.size());
        for (size_t d2 = 0; d2 < rel.size(); ++d2) {
          Put<int64_t>(m, p.box.offsets[d2]);
          Put<int64_t>(m, p.box.sizes[d2]);
          rel[d2] = p.box.offsets[d2] - item.chunk.offsets[d2];
        }
        const size_t before = m.size();
        try {
          StreamToHost(data.tensor.Narrow(rel, p.box.sizes), kDevicePieceBytes,
                       [&](const void* bytes, size_t len) {
                         m.append(static_cast<const char*>(bytes), len);
                       });
        } catch (const DeviceError& e) {
          throw DeviceError("tensor '" + item.index.fqn + "': " + e.what());
        }
        if (m.size() - before != p.bytes) {
          throw InternalError("tensor " + ClippedName(item.index.fqn) + " delivered " +
                              std::to_string(m.size() - before) + " bytes for a piece of " +
                              std::to_string(p.bytes));
        }
      }
    }
    return to;
  }

  // One round of this rank's units, ready to append: for each unit (in the order of `mine`),
  // the byte spans that make it, in file order. Spans point into `got` (the received messages)
  // or into `bufs`; both move with the Round without moving the bytes.
  struct Round {
    std::vector<std::string> got;
    std::vector<HostBuffer> bufs;
    std::vector<std::vector<std::pair<const char*, size_t>>> spans;
  };

  // This rank's units of the round from every rank's pieces (`got`, by sender). A unit whose
  // pieces are whole rows (the common row-sharded case) is appended straight from the messages;
  // any other (column or block shards) is assembled into a pooled buffer first. Every byte of
  // every unit must arrive exactly once.
  static Round Assemble(const Assignment& a, const std::vector<Unit>& units,
                        const std::vector<uint32_t>& mine, std::vector<std::string> got) {
    struct Piece {
      const char* data;
      uint64_t bytes;
      ChunkMeta box;  // in the tensor's coordinates (empty for a blob)
    };
    Round round;
    round.got = std::move(got);  // the strings stay where they are: pieces may point into them
    std::unordered_map<uint32_t, size_t> slot;
    for (size_t j = 0; j < mine.size(); ++j) slot.emplace(mine[j], j);
    std::vector<std::vector<Piece>> pieces(mine.size());
    for (const std::string& m : round.got) {
      size_t at = 1;  // after the 'D' tag
      while (at < m.size()) {
        const uint32_t u = Get<uint32_t>(m, at, "piece");
        const uint64_t bytes = Get<uint64_t>(m, at, "piece");
        auto s = slot.find(u);
        if (s == slot.end()) throw InternalError("a piece of a unit this rank does not assemble");
        const PlannedTensor& t = a.tensors[units[u].tensor];
        Piece p{nullptr, bytes, {}};
        if (!t.blob) {
          p.box = ChunkMeta{Shape(t.shape.size()), Shape(t.shape.size())};
          for (size_t d = 0; d < t.shape.size(); ++d) {
            p.box.offsets[d] = Get<int64_t>(m, at, "piece");
            p.box.sizes[d] = Get<int64_t>(m, at, "piece");
          }
          if (bytes != static_cast<uint64_t>(p.box.numel()) * ElementSize(t.dtype)) {
            throw InternalError("tensor " + ClippedName(t.name) + ": a malformed piece");
          }
        }
        if (m.size() - at < bytes) {
          throw InternalError("tensor " + ClippedName(t.name) + ": a truncated piece");
        }
        p.data = m.data() + at;
        at += bytes;
        pieces[s->second].push_back(std::move(p));
      }
    }
    round.spans.resize(mine.size());
    for (size_t j = 0; j < mine.size(); ++j) {
      const Unit& unit = units[mine[j]];
      const PlannedTensor& t = a.tensors[unit.tensor];
      auto& ps = pieces[j];
      uint64_t filled = 0;
      for (const Piece& p : ps) filled += p.bytes;
      if (filled != unit.bytes) {
        throw InternalError(
            "tensor " + ClippedName(t.name) + " rows [" + std::to_string(unit.row0) + ", " +
            std::to_string(unit.row0 + unit.rows) + "): the ranks' pieces hold " +
            std::to_string(filled) + " of its " + std::to_string(unit.bytes) + " bytes");
      }
      if (unit.bytes == 0) continue;
      // Whole rows: sorted by their first row they must tile the unit end to end.
      bool rows = !t.blob && !t.shape.empty();
      for (const Piece& p : ps) {
        for (size_t d = 1; rows && d < t.shape.size(); ++d) {
          rows = p.box.offsets[d] == 0 && p.box.sizes[d] == t.shape[d];
        }
      }
      if (rows) {
        std::sort(ps.begin(), ps.end(), [](const Piece& x, const Piece& y) {
          return x.box.offsets[0] < y.box.offsets[0];
        });
        int64_t next = unit.row0;
        for (const Piece& p : ps) {
          if (p.box.offsets[0] != next) {
            throw InternalError("tensor " + ClippedName(t.name) + ": rows from " +
                                std::to_string(next) + " are missing or sent twice");
          }
          next += p.box.sizes[0];
          if (p.bytes > 0) round.spans[j].emplace_back(p.data, p.bytes);
        }
        continue;
      }
      if (t.blob || t.shape.empty()) {  // one piece: the whole value
        if (ps.size() != 1) throw InternalError(ClippedName(t.name) + " arrived in pieces");
        round.spans[j].emplace_back(ps[0].data, ps[0].bytes);
        continue;
      }
      // Column or block shards: assembled into a buffer (a piece sent twice would have made the
      // byte count above differ unless another is missing, which the count catches too).
      round.bufs.emplace_back(unit.bytes);
      char* dst = round.bufs.back().data();
      const ChunkMeta ubox = UnitBox(t, unit);
      for (const Piece& p : ps) {
        Shape rel(t.shape.size());
        for (size_t d = 0; d < rel.size(); ++d) rel[d] = p.box.offsets[d] - ubox.offsets[d];
        CopyTensor(TensorView::FromContiguous(dst, t.dtype, ubox.sizes).Narrow(rel, p.box.sizes),
                   TensorView::FromContiguous(const_cast<char*>(p.data), t.dtype, p.box.sizes));
      }
      round.spans[j].emplace_back(dst, unit.bytes);
    }
    return round;
  }

  std::unique_ptr<StorageWriter> protocol_;  // the generic protocol: lock, commit, clean-up
  std::shared_ptr<Store> store_;
  StorageOptions options_;
  StorageContext ctx_;
  std::vector<std::string> created_;  // this rank's files of the current save
};

}  // namespace

bool IsSafetensorsDataName(const std::string& name) {
  // model-<5+ digits>-of-<5+ digits>-<hex save id>.safetensors
  constexpr std::string_view prefix = "model-", ext = ".safetensors";
  if (name.size() <= prefix.size() + ext.size() || name.rfind(prefix, 0) != 0 ||
      !IsSafetensorsName(name)) {
    return false;
  }
  std::string_view mid(name);
  mid = mid.substr(prefix.size(), mid.size() - prefix.size() - ext.size());
  const size_t of = mid.find("-of-");
  const size_t dash = mid.rfind('-');
  if (of == std::string_view::npos || dash <= of + 3) return false;
  auto digits = [](std::string_view s) {
    return s.size() >= 5 &&
           std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  return digits(mid.substr(0, of)) && digits(mid.substr(of + 4, dash - of - 4)) &&
         IsHexId(mid.substr(dash + 1));
}

std::unique_ptr<StorageWriter> MakeSafetensorsWriter(std::unique_ptr<StorageWriter> protocol,
                                                     std::shared_ptr<Store> store,
                                                     const StorageOptions& options) {
  return std::make_unique<SafetensorsWriter>(std::move(protocol), std::move(store), options);
}

}  // namespace dcp
