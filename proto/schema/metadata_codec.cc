// Metadata as protobuf bytes (the metadata file's payload), streamed one entry at a time.
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/wire_format_lite.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dcp/proto/schema/codec.h"
#include "dcp/proto/schema/codec_internal.h"
#include "schema/dcp.pb.h"  // generated from proto/schema/dcp.proto

namespace dcp {

using internal::FromPb;
using internal::FromShape;
using internal::ToDType;
using internal::ToPb;
using internal::ToShape;

// Metadata grows with ranks x tensors (hundreds of MiB at thousands of ranks), so it is encoded
// and decoded one entry and one stored item at a time through a reused message, never as one
// protobuf object beside the native one. The bytes are those of the whole message serialized
// deterministically (fields in number order, map entries sorted).
namespace {

constexpr uint32_t kVersionTag = (1 << 3) | 0;  // Metadata.format_version, varint
constexpr uint32_t kEntriesTag = (7 << 3) | 2;  // Metadata.entries, length-delimited
constexpr uint32_t kItemsTag = (8 << 3) | 2;    // Metadata.items

template <typename Msg>
void WriteSubmessage(google::protobuf::io::CodedOutputStream& out, uint32_t tag, const Msg& m) {
  const size_t size = m.ByteSizeLong();
  if (size > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    throw InvalidArgumentError("a metadata entry of " + std::to_string(size) +
                               " bytes is too large to encode");
  }
  out.WriteTag(tag);
  out.WriteVarint32(static_cast<uint32_t>(size));
  m.SerializeWithCachedSizes(&out);
}

// Output in fixed blocks, then one exact copy: a string grown by doubling holds up to three
// times the metadata while it grows (old and new buffer), and the metadata is hundreds of MiB at
// thousands of ranks. Each block is freed as soon as it is copied.
class BlockOutputStream : public google::protobuf::io::ZeroCopyOutputStream {
 public:
  // Blocks grow from 64 KiB to 4 MiB, and are not zero-filled: a small metadata touches a few
  // pages instead of faulting in (and clearing) 4 MiB, which made a process's first save ~15 ms
  // slower than the next.
  static constexpr int kFirstBlock = 64 << 10, kMaxBlock = 4 << 20;
  bool Next(void** data, int* size) override {
    const int n = next_block_;
    next_block_ = std::min(kMaxBlock, 2 * next_block_);
    blocks_.push_back(std::make_unique_for_overwrite<char[]>(static_cast<size_t>(n)));
    used_.push_back(n);
    *data = blocks_.back().get();
    *size = n;
    total_ += n;
    return true;
  }
  void BackUp(int count) override {
    used_.back() -= count;
    total_ -= count;
  }
  int64_t ByteCount() const override { return total_; }
  // The bytes written, after `prefix` zero bytes; frees the blocks.
  std::string Take(size_t prefix) {
    std::string out;
    out.reserve(prefix + static_cast<size_t>(total_));
    out.append(prefix, '\0');
    for (size_t i = 0; i < blocks_.size(); ++i) {
      out.append(blocks_[i].get(), static_cast<size_t>(used_[i]));
      blocks_[i].reset();
    }
    blocks_.clear();
    used_.clear();
    total_ = 0;
    next_block_ = kFirstBlock;
    return out;
  }

 private:
  std::vector<std::unique_ptr<char[]>> blocks_;
  std::vector<int> used_;
  int64_t total_ = 0;
  int next_block_ = kFirstBlock;
};

}  // namespace

namespace internal {

std::string EncodeMetadataAfter(const Metadata& md, size_t prefix) {
  const bool v2 = md.format_version >= 2;
  BlockOutputStream blocks;
  {
    google::protobuf::io::CodedOutputStream cos(&blocks);
    cos.SetSerializationDeterministic(true);
    {
      pb::Metadata head;  // fields 1-6
      head.set_format_version(md.format_version);
      head.set_checkpoint_id(md.checkpoint_id);
      head.set_save_id(md.save_id);
      head.set_world_size(md.world_size);
      head.set_created_unix_ns(md.created_unix_ns);
      head.set_library_version(md.library_version);
      head.SerializeToCodedStream(&cos);
    }
    pb::Entry e;
    for (const auto& [fqn, entry] : md.entries) {
      e.Clear();
      e.set_fqn(fqn);
      if (const auto* t = std::get_if<TensorMetadata>(&entry)) {
        auto* te = e.mutable_tensor();
        te->set_dtype(static_cast<pb::DType>(t->dtype));
        FromShape(t->shape, te->mutable_shape());
        if (t->regular && v2) {
          auto* rs = te->mutable_regular();
          rs->set_dim(t->regular->dim);
          rs->set_rule(t->regular->rule);
          rs->set_world(t->regular->world);
        } else {
          // Version 1 lists every chunk, a rule's too.
          te->mutable_chunks()->Reserve(static_cast<int>(ChunkCount(*t)));
          ForEachChunk(*t, [&](size_t, const ChunkMeta& c) { ToPb(c, te->add_chunks()); });
          // (ValidateMetadata refuses a version-2 list without a writer per chunk.)
          if (v2)
            te->mutable_chunk_writers()->Add(t->chunk_writers.begin(), t->chunk_writers.end());
        }
      } else {
        auto* be = e.mutable_bytes();
        if (v2) {
          be->set_writer(std::get<BytesMetadata>(entry).writer);
          be->set_size(std::get<BytesMetadata>(entry).size);
        }
      }
      WriteSubmessage(cos, kEntriesTag, e);
    }
    pb::StoredItem item;
    // Version 2 keeps where items lie in the data files' indexes, not here.
    if (!v2)
      for (const auto& [index, info] : md.storage) {
        item.Clear();
        ToPb(index, item.mutable_index());
        ToPb(info, item.mutable_info());
        WriteSubmessage(cos, kItemsTag, item);
      }
    pb::Metadata tail;  // fields 9-10 (maps: sorted by the deterministic stream)
    for (const auto& [fqn, path] : md.key_paths) {
      auto& kp = (*tail.mutable_key_paths())[fqn];
      for (const auto& k : path) kp.add_keys(k);
    }
    for (const auto& [k, v] : md.planner_data) (*tail.mutable_planner_data())[k] = v;
    if (v2) {
      for (const auto& f : md.files) ToPb(f, tail.add_files());
    }
    tail.SerializeToCodedStream(&cos);
    if (cos.HadError()) throw InternalError("cannot encode metadata");
  }
  return blocks.Take(prefix);
}

}  // namespace internal

std::string EncodeMetadata(const Metadata& md) { return internal::EncodeMetadataAfter(md, 0); }

namespace {

CorruptionError NotAProtobuf(const std::string& src, const std::string& what) {
  return CorruptionError(src + ": metadata payload is not a valid protobuf (" + what + ")");
}

// Reads a metadata payload field by field: entries and stored items go straight into a
// Metadata, one message at a time. Fields other than entries and items (small: scalars and
// maps) are copied out, to be parsed as one message.
class MetadataPayloadReader {
 public:
  MetadataPayloadReader(std::string_view bytes, std::string_view source, Metadata& md)
      : bytes_(bytes),
        source_(source),
        src_(source),
        md_(md),
        in_(reinterpret_cast<const uint8_t*>(bytes.data()), static_cast<int>(bytes.size())) {
    in_.SetRecursionLimit(64);
  }

  // Reads every field; returns the fields other than entries and items, serialized.
  std::string Read() {
    std::string rest;
    {  // the streams let go of `rest` before it is returned
      google::protobuf::io::StringOutputStream rest_stream(&rest);
      google::protobuf::io::CodedOutputStream rest_out(&rest_stream);
      for (uint32_t tag; (tag = in_.ReadTag()) != 0;) {
        if (tag == kVersionTag) {
          ReadVersion(tag, rest_out);
        } else if (tag == kEntriesTag) {
          ReadEntry();
        } else if (tag == kItemsTag) {
          ReadItem();
        } else if (!google::protobuf::internal::WireFormatLite::SkipField(&in_, tag, &rest_out)) {
          throw NotAProtobuf(src_, "truncated field " + std::to_string(tag >> 3));
        }
      }
      if (!in_.ConsumedEntireMessage()) throw NotAProtobuf(src_, "bad tag");
      rest_out.Trim();
    }
    return rest;
  }

 private:
  void ReadVersion(uint32_t tag, google::protobuf::io::CodedOutputStream& rest_out) {
    // Checked at once: a newer format's entries may not parse as this version's.
    uint32_t version = 0;
    if (!in_.ReadVarint32(&version)) throw NotAProtobuf(src_, "truncated format version");
    if (version > kFormatVersion) {
      throw UnsupportedError(src_ + ": checkpoint format version " + std::to_string(version) +
                             " is newer than this library's " + std::to_string(kFormatVersion) +
                             "; upgrade dcp to read it");
    }
    rest_out.WriteTag(tag);
    rest_out.WriteVarint32(version);
    version_ = version;
  }

  void ReadEntry() {
    ParseSub(e_, "entry");
    if (md_.entries.count(e_.fqn()))
      throw CorruptionError(src_ + ": duplicate entry '" + e_.fqn() + "'");
    if (e_.has_tensor()) {
      TensorMetadata t;
      t.dtype = ToDType(e_.tensor().dtype(), source_);
      t.shape = ToShape(e_.tensor().shape());
      t.chunks.reserve(e_.tensor().chunks_size());
      for (const auto& c : e_.tensor().chunks()) t.chunks.push_back(FromPb(c));
      if (e_.tensor().has_regular()) {
        // Checked by ValidateMetadata before use; the rule value is kept as read.
        const auto& rs = e_.tensor().regular();
        t.regular = RegularLayout{
            rs.dim(), static_cast<RegularRule>(rs.rule() <= 0xff ? rs.rule() : 0), rs.world()};
      }
      t.chunk_writers.assign(e_.tensor().chunk_writers().begin(),
                             e_.tensor().chunk_writers().end());
      md_.entries.emplace(e_.fqn(), std::move(t));
    } else if (e_.has_bytes()) {
      md_.entries.emplace(e_.fqn(), BytesMetadata{e_.bytes().writer(), e_.bytes().size()});
    } else {
      throw CorruptionError(src_ + ": entry '" + e_.fqn() + "' has no kind");
    }
  }

  void ReadItem() {
    ParseSub(item_, "stored item");
    if (version_ >= 2) {
      throw CorruptionError(src_ + ": version-2 metadata lists a stored item (" +
                            FromPb(item_.index()).ToString() +
                            "); version 2 keeps them in the data files' indexes");
    }
    MetadataIndex index = FromPb(item_.index());
    auto [it, inserted] = md_.storage.try_emplace(std::move(index));
    if (!inserted) throw CorruptionError(src_ + ": duplicate stored item " + it->first.ToString());
    it->second = FromPb(item_.info());
  }

  // A length-delimited submessage into msg (cleared first).
  template <typename Msg>
  void ParseSub(Msg& msg, const char* what) {
    uint32_t length = 0;
    if (!in_.ReadVarint32(&length) || length > bytes_.size() - in_.CurrentPosition()) {
      throw NotAProtobuf(src_, std::string("truncated ") + what);
    }
    const auto limit = in_.PushLimit(static_cast<int>(length));
    msg.Clear();
    if (!msg.MergePartialFromCodedStream(&in_) || !in_.ConsumedEntireMessage()) {
      throw NotAProtobuf(src_, std::string("bad ") + what);
    }
    in_.PopLimit(limit);
  }

  std::string_view bytes_;
  std::string_view source_;
  std::string src_;
  Metadata& md_;
  google::protobuf::io::CodedInputStream in_;
  pb::Entry e_;  // reused by every entry, and item_ by every stored item
  pb::StoredItem item_;
  uint32_t version_ = 0;  // as read so far (the encoder writes it first)
};

// The fields other than entries and items (`rest`, one serialized pb::Metadata), into md.
void ReadMetadataHeader(const std::string& rest, const std::string& src, Metadata& md) {
  pb::Metadata p;
  if (!p.ParseFromString(rest)) throw NotAProtobuf(src, "bad header");
  if (p.format_version() > kFormatVersion) {
    throw UnsupportedError(src + ": checkpoint format version " +
                           std::to_string(p.format_version()) + " is newer than this library's " +
                           std::to_string(kFormatVersion) + "; upgrade dcp to read it");
  }
  if (p.format_version() == 0) {
    throw CorruptionError(src + ": metadata has no format version");
  }
  md.format_version = p.format_version();
  md.checkpoint_id = p.checkpoint_id();
  md.save_id = p.save_id();
  md.world_size = p.world_size();
  md.created_unix_ns = p.created_unix_ns();
  md.library_version = p.library_version();
  for (const auto& [fqn, kp] : p.key_paths()) {
    md.key_paths[fqn] = KeyPath(kp.keys().begin(), kp.keys().end());
  }
  for (const auto& [k, v] : p.planner_data()) md.planner_data[k] = v;
  md.files.reserve(static_cast<size_t>(p.files_size()));
  for (const auto& f : p.files()) md.files.push_back(FromPb(f));
}

}  // namespace

Metadata DecodeMetadata(std::string_view bytes, std::string_view source) {
  const std::string src(source);
  if (bytes.size() > static_cast<size_t>(std::numeric_limits<int>::max())) {
    throw NotAProtobuf(src, "larger than 2 GiB");
  }
  Metadata md;
  const std::string rest = MetadataPayloadReader(bytes, source, md).Read();
  ReadMetadataHeader(rest, src, md);
  return md;
}

}  // namespace dcp
