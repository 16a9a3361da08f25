// Plans, write results and data-file lists as protobuf bytes (the wire), and the conversions
// between dcp's structs and their messages that the metadata codec shares (codec_internal.h).
#include "dcp/proto/schema/codec.h"

#include <google/protobuf/arena.h>
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/wire_format_lite.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <utility>

#include "dcp/proto/schema/codec_internal.h"
#include "schema/dcp.pb.h"  // generated from proto/schema/dcp.proto

namespace dcp {

namespace internal {

DType ToDType(int v, std::string_view source) {
  if (!IsValidDType(v)) {
    throw CorruptionError(std::string(source) + ": unknown dtype value " + std::to_string(v));
  }
  return static_cast<DType>(v);
}

void ToPb(const MetadataIndex& i, pb::MetadataIndex* p) {
  p->set_fqn(i.fqn);
  FromShape(i.offset, p->mutable_offset());
  p->set_index(i.index.value_or(-1));
}
MetadataIndex FromPb(const pb::MetadataIndex& p) {
  MetadataIndex i;
  i.fqn = p.fqn();
  i.offset = ToShape(p.offset());
  if (p.index() >= 0) i.index = p.index();
  return i;
}

void ToPb(const ChunkMeta& c, pb::Chunk* p) {
  FromShape(c.offsets, p->mutable_offsets());
  FromShape(c.sizes, p->mutable_sizes());
}
ChunkMeta FromPb(const pb::Chunk& p) { return {ToShape(p.offsets()), ToShape(p.sizes())}; }

void ToPb(const StorageInfo& s, pb::StorageInfo* p) {
  p->set_relative_path(s.relative_path);
  p->set_offset(s.offset);
  p->set_length(s.length);
  p->set_has_crc32c(s.crc32c.has_value());
  p->set_crc32c(s.crc32c.value_or(0));
  for (const auto& t : s.transforms) p->add_transforms(t);
  p->set_raw_length(s.raw_length);
}
StorageInfo FromPb(const pb::StorageInfo& p) {
  StorageInfo s;
  s.relative_path = p.relative_path();
  s.offset = p.offset();
  s.length = p.length();
  if (p.has_crc32c()) s.crc32c = p.crc32c();
  s.transforms.assign(p.transforms().begin(), p.transforms().end());
  s.raw_length = p.raw_length();
  return s;
}

void ToPb(const DataFile& f, pb::DataFile* out) {
  out->set_name(f.name);
  out->set_writer(f.writer);
  out->set_size(f.size);
  out->set_index_offset(f.index_offset);
  out->set_index_length(f.index_length);
  out->set_index_crc32c(f.index_crc32c);
  if (!f.index_copy.empty()) out->set_index(f.index_copy);
  if (f.block_table_length != 0) {
    out->set_block_table_offset(f.block_table_offset);
    out->set_block_table_length(f.block_table_length);
    out->set_block_table_crc32c(f.block_table_crc32c);
  }
  for (const DataFileReference& r : f.references) {
    pb::DataFileReference* ref = out->add_references();
    ref->set_name(r.name);
    ref->set_size(r.size);
    if (r.block_table_length != 0) {
      ref->set_index_offset(r.index_offset);
      ref->set_index_length(r.index_length);
      ref->set_index_crc32c(r.index_crc32c);
      ref->set_block_table_offset(r.block_table_offset);
      ref->set_block_table_length(r.block_table_length);
      ref->set_block_table_crc32c(r.block_table_crc32c);
    }
  }
}

DataFile FromPb(const pb::DataFile& f) {
  DataFile out{f.name(),         f.writer(),       f.size(), f.index_offset(),
               f.index_length(), f.index_crc32c(), f.index()};
  out.block_table_offset = f.block_table_offset();
  out.block_table_length = f.block_table_length();
  out.block_table_crc32c = f.block_table_crc32c();
  out.references.reserve(static_cast<size_t>(f.references_size()));
  for (const auto& r : f.references()) {
    out.references.push_back({r.name(), r.size(), r.index_offset(), r.index_length(),
                              r.index_crc32c(), r.block_table_offset(), r.block_table_length(),
                              r.block_table_crc32c()});
  }
  return out;
}

}  // namespace internal

using internal::FromPb;
using internal::FromShape;
using internal::ToDType;
using internal::ToPb;
using internal::ToShape;

namespace {

// Plans and metadata hold millions of small messages at scale (a 1,024-rank save plans ~3M
// items); building and parsing them on an arena turns a malloc/free pair per message into a
// pointer bump (the heap work was over half of the coordinator's planning time in
// dcp-scale-bench). Blocks grow to a few MiB so that huge messages use few of them.
//
// Not under ThreadSanitizer: with Debian's (uninstrumented) libprotobuf, any arena crashes a
// TSan build when it is destroyed (SerialArena::CleanupList frees a pointer TSan's allocator
// never returned; a ten-line program shows it). TSan builds use plain heap messages: same
// bytes, same behaviour, only slower.
#if defined(__SANITIZE_THREAD__)
#define DCP_CODEC_ARENA 0
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define DCP_CODEC_ARENA 0
#endif
#endif
#ifndef DCP_CODEC_ARENA
#define DCP_CODEC_ARENA 1
#endif

template <typename Msg>
class CodecMessage {
 public:
#if DCP_CODEC_ARENA
  CodecMessage() : arena_(Options()), msg_(google::protobuf::Arena::CreateMessage<Msg>(&arena_)) {}
  Msg& operator*() { return *msg_; }

 private:
  static google::protobuf::ArenaOptions Options() {
    google::protobuf::ArenaOptions o;
    o.start_block_size = 4096;
    o.max_block_size = 4 << 20;
    return o;
  }
  google::protobuf::Arena arena_;
  Msg* msg_;
#else
  Msg& operator*() { return msg_; }

 private:
  Msg msg_;
#endif
};

template <typename Msg>
void Parse(Msg* msg, std::string_view bytes, std::string_view what) {
  if (!msg->ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    throw CorruptionError("cannot parse " + std::string(what) + " (" +
                          std::to_string(bytes.size()) + " bytes)");
  }
}

}  // namespace

std::string EncodeSavePlan(const SavePlan& plan) {
  CodecMessage<pb::SavePlan> holder;
  auto& p = *holder;
  for (const auto& item : plan.items) {
    auto* w = p.add_items();
    ToPb(item.index, w->mutable_index());
    w->set_type(static_cast<pb::WriteItemType>(item.type));
    w->set_dtype(static_cast<pb::DType>(item.dtype));
    FromShape(item.global_shape, w->mutable_global_shape());
    ToPb(item.chunk, w->mutable_chunk());
    w->set_size_bytes(item.size_bytes);
  }
  p.set_storage_data(plan.storage_data);
  p.set_planner_data(plan.planner_data);
  for (const auto& [fqn, path] : plan.key_paths) {
    auto& kp = (*p.mutable_key_paths())[fqn];
    for (const auto& k : path) kp.add_keys(k);
  }
  // Deterministic (map entries sorted): equal plans encode to equal bytes, which plan caching
  // compares by hash (dcp/checkpoint.h, SavePlanCache).
  std::string out;
  {
    google::protobuf::io::StringOutputStream stream(&out);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    if (!p.SerializeToCodedStream(&coded)) throw InternalError("cannot encode a save plan");
  }
  return out;
}

SavePlan DecodeSavePlan(std::string_view bytes) {
  CodecMessage<pb::SavePlan> holder;
  auto& p = *holder;
  Parse(&p, bytes, "save plan");
  SavePlan plan;
  plan.items.reserve(p.items_size());
  for (const auto& w : p.items()) {
    WriteItem item;
    item.index = FromPb(w.index());
    item.type = static_cast<WriteItemType>(w.type());
    item.dtype = ToDType(w.dtype(), "save plan");
    item.global_shape = ToShape(w.global_shape());
    item.chunk = FromPb(w.chunk());
    item.size_bytes = w.size_bytes();
    plan.items.push_back(std::move(item));
  }
  plan.storage_data = p.storage_data();
  plan.planner_data = p.planner_data();
  for (const auto& [fqn, kp] : p.key_paths()) {
    plan.key_paths[fqn] = KeyPath(kp.keys().begin(), kp.keys().end());
  }
  return plan;
}

std::string EncodeLoadPlan(const LoadPlan& plan) {
  CodecMessage<pb::LoadPlan> holder;
  auto& p = *holder;
  for (const auto& item : plan.items) {
    auto* r = p.add_items();
    r->set_type(static_cast<pb::ReadItemType>(item.type));
    ToPb(item.dest_index, r->mutable_dest_index());
    FromShape(item.dest_offsets, r->mutable_dest_offsets());
    ToPb(item.storage_index, r->mutable_storage_index());
    FromShape(item.storage_offsets, r->mutable_storage_offsets());
    FromShape(item.lengths, r->mutable_lengths());
    if (item.chunk_span > 1) r->set_chunk_span(item.chunk_span);
  }
  p.set_storage_data(plan.storage_data);
  p.set_planner_data(plan.planner_data);
  return p.SerializeAsString();
}

LoadPlan DecodeLoadPlan(std::string_view bytes) {
  CodecMessage<pb::LoadPlan> holder;
  auto& p = *holder;
  Parse(&p, bytes, "load plan");
  LoadPlan plan;
  plan.items.reserve(p.items_size());
  for (const auto& r : p.items()) {
    ReadItem item;
    item.type = static_cast<ReadItemType>(r.type());
    item.dest_index = FromPb(r.dest_index());
    item.dest_offsets = ToShape(r.dest_offsets());
    item.storage_index = FromPb(r.storage_index());
    item.storage_offsets = ToShape(r.storage_offsets());
    item.lengths = ToShape(r.lengths());
    item.chunk_span = std::max<uint32_t>(r.chunk_span(), 1);
    plan.items.push_back(std::move(item));
  }
  plan.storage_data = p.storage_data();
  plan.planner_data = p.planner_data();
  return plan;
}

std::string EncodeLocalLoadPlan(const LoadPlan& plan, bool can_share) {
  pb::LocalLoadPlan p;
  p.set_plan(EncodeLoadPlan(plan));
  p.set_can_share(can_share);
  return p.SerializeAsString();
}

std::pair<LoadPlan, bool> DecodeLocalLoadPlan(std::string_view bytes) {
  pb::LocalLoadPlan p;
  Parse(&p, bytes, "local load plan");
  return {DecodeLoadPlan(p.plan()), p.can_share()};
}

std::string EncodeLoadAssignment(const LoadPlan& plan,
                                 const std::vector<SharedReadBatch>& batches) {
  pb::LoadAssignment p;
  p.set_plan(EncodeLoadPlan(plan));
  for (const auto& b : batches) {
    auto* q = p.add_batches();
    q->set_root(b.root);
    q->mutable_send_items()->Add(b.send_items.begin(), b.send_items.end());
    q->mutable_recv_segments()->Add(b.recv_segments.begin(), b.recv_segments.end());
    q->mutable_recv_items()->Add(b.recv_items.begin(), b.recv_items.end());
    q->set_bytes(b.bytes);
  }
  return p.SerializeAsString();
}

std::pair<LoadPlan, std::vector<SharedReadBatch>> DecodeLoadAssignment(std::string_view bytes) {
  pb::LoadAssignment p;
  Parse(&p, bytes, "load assignment");
  std::pair<LoadPlan, std::vector<SharedReadBatch>> out{DecodeLoadPlan(p.plan()), {}};
  const auto n = static_cast<int64_t>(out.first.items.size());
  auto in_plan = [&](int32_t i) {
    if (i < 0 || i >= n) {
      throw CorruptionError("load assignment names item " + std::to_string(i) + " of a plan of " +
                            std::to_string(n));
    }
    return i;
  };
  for (const auto& q : p.batches()) {
    SharedReadBatch b;
    b.root = q.root();
    for (int32_t i : q.send_items()) b.send_items.push_back(in_plan(i));
    for (int32_t i : q.recv_items()) b.recv_items.push_back(in_plan(i));
    b.recv_segments.assign(q.recv_segments().begin(), q.recv_segments().end());
    if (b.recv_segments.size() != b.recv_items.size()) {
      throw CorruptionError("load assignment: a batch's receive lists differ in length");
    }
    b.bytes = q.bytes();
    out.second.push_back(std::move(b));
  }
  return out;
}

std::string EncodeWriteResults(const std::vector<WriteResult>& results) {
  CodecMessage<pb::WriteResults> holder;
  auto& p = *holder;
  for (const auto& r : results) {
    auto* w = p.add_results();
    ToPb(r.index, w->mutable_index());
    w->set_size_in_bytes(r.size_in_bytes);
    ToPb(r.storage, w->mutable_info());
  }
  return p.SerializeAsString();
}

std::vector<WriteResult> DecodeWriteResults(std::string_view bytes) {
  CodecMessage<pb::WriteResults> holder;
  auto& p = *holder;
  Parse(&p, bytes, "write results");
  std::vector<WriteResult> out;
  out.reserve(p.results_size());
  for (const auto& w : p.results()) {
    out.push_back({FromPb(w.index()), w.size_in_bytes(), FromPb(w.info())});
  }
  return out;
}

// The coordinator of a save at thousands of ranks receives millions of write results. Decoding
// them all into vectors, then copying them into the metadata's storage map, held both forms at
// once (about 5x the encoded metadata). Here each rank's payload is read one result at a time
// and each result is moved into the map: a k-way merge by stored item, so results that each rank
// lists in order (what StoreWriter writes) are appended at the map's end without a tree walk.
// Out-of-order results still insert correctly, only slower.
namespace {

class WriteResultStream {
 public:
  WriteResultStream(std::string* bytes, int rank)
      : bytes_(bytes),
        in_(std::make_unique<google::protobuf::io::CodedInputStream>(
            reinterpret_cast<const uint8_t*>(bytes->data()), static_cast<int>(bytes->size()))),
        rank_(rank) {}

  // Parse the next result into current(); false (and the payload freed) at the end.
  bool Advance() {
    for (uint32_t tag; (tag = in_->ReadTag()) != 0;) {
      if (tag != kResultsTag) {
        if (!google::protobuf::internal::WireFormatLite::SkipField(in_.get(), tag)) Corrupt();
        continue;
      }
      uint32_t length = 0;
      if (!in_->ReadVarint32(&length) || length > bytes_->size() - in_->CurrentPosition()) {
        Corrupt();
      }
      const auto limit = in_->PushLimit(static_cast<int>(length));
      msg_.Clear();
      if (!msg_.MergePartialFromCodedStream(in_.get()) || !in_->ConsumedEntireMessage()) {
        Corrupt();
      }
      in_->PopLimit(limit);
      current_.index = FromPb(msg_.index());
      current_.size_in_bytes = msg_.size_in_bytes();
      current_.storage = FromPb(msg_.info());
      return true;
    }
    if (!in_->ConsumedEntireMessage()) Corrupt();
    in_.reset();
    std::string().swap(*bytes_);
    return false;
  }
  WriteResult& current() { return current_; }

 private:
  // Field 1 of WriteResults, length-delimited.
  static constexpr uint32_t kResultsTag = (1u << 3) | 2u;
  [[noreturn]] void Corrupt() const {
    throw CorruptionError("cannot parse the write results of rank " + std::to_string(rank_));
  }
  std::string* bytes_;
  std::unique_ptr<google::protobuf::io::CodedInputStream> in_;
  int rank_;
  pb::WriteResult msg_;
  WriteResult current_;
};

}  // namespace

void FillStorageFromEncoded(Metadata& md, std::vector<std::string>& encoded_results) {
  md.storage.clear();
  for (const auto& bytes : encoded_results) {
    if (bytes.size() > static_cast<size_t>(std::numeric_limits<int>::max())) {
      throw CorruptionError("write results of one rank larger than 2 GiB");
    }
  }
  std::vector<std::unique_ptr<WriteResultStream>> streams;
  streams.reserve(encoded_results.size());
  std::vector<uint32_t> heap;  // streams with a current result, min-heap by stored item
  for (size_t r = 0; r < encoded_results.size(); ++r) {
    streams.push_back(
        std::make_unique<WriteResultStream>(&encoded_results[r], static_cast<int>(r)));
    if (streams.back()->Advance()) heap.push_back(static_cast<uint32_t>(r));
  }
  auto later = [&](uint32_t a, uint32_t b) {
    const MetadataIndex& x = streams[a]->current().index;
    const MetadataIndex& y = streams[b]->current().index;
    return y < x || (!(x < y) && b < a);  // ties by rank, so a duplicate names both in order
  };
  std::make_heap(heap.begin(), heap.end(), later);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const uint32_t r = heap.back();
    WriteResult& cur = streams[r]->current();
    if (md.storage.empty() || md.storage.rbegin()->first < cur.index) {
      md.storage.emplace_hint(md.storage.end(), std::move(cur.index), std::move(cur.storage));
    } else {
      auto [it, inserted] = md.storage.try_emplace(std::move(cur.index));
      if (!inserted) {
        throw InternalError("item " + it->first.ToString() + " was written twice (again by rank " +
                            std::to_string(r) + ")");
      }
      it->second = std::move(cur.storage);
    }
    if (streams[r]->Advance()) {
      std::push_heap(heap.begin(), heap.end(), later);
    } else {
      heap.pop_back();
      streams[r].reset();
    }
  }
}

std::string EncodeDataFiles(const std::vector<DataFile>& files) {
  pb::Metadata p;
  for (const auto& f : files) ToPb(f, p.add_files());
  return p.SerializeAsString();
}

std::vector<DataFile> DecodeDataFiles(std::string_view bytes, int rank) {
  pb::Metadata p;
  if (!p.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    throw CorruptionError("rank " + std::to_string(rank) +
                          " sent a malformed list of data files (do all ranks save with the "
                          "same metadata_version?)");
  }
  std::vector<DataFile> out;
  out.reserve(static_cast<size_t>(p.files_size()));
  for (const auto& f : p.files()) {
    if (f.writer() != rank) {
      throw CorruptionError("rank " + std::to_string(rank) + " reported data file '" + f.name() +
                            "' as written by rank " + std::to_string(f.writer()));
    }
    out.push_back(FromPb(f));
  }
  return out;
}

}  // namespace dcp
