// Hugging Face safetensors as a readable layout (storage/format/safetensors.h): the index and
// the file headers become dcp Metadata whose items are plain byte ranges, so the generic reader
// does every load, reshard and device copy. The layout's write side is the index (the commit
// marker); the data path is safetensors_writer.cc's, which replaces the per-rank item encoders.
#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string_view>
#include <vector>

#include "dcp/proto/error.h"
#include "dcp/proto/executor.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/storage/format/layout.h"
#include "dcp/storage/format/safetensors.h"
#include "dcp/storage/store.h"

namespace dcp {
namespace {

using Json = nlohmann::json;

// The blobs a `dcp convert` export or a safetensors save lists in __metadata__.
constexpr const char* kBlobsKey = kSafetensorsBlobsKey;
// Where the index of a dcp save records its save id (the Hub's "metadata" object holds
// "total_size" and whatever else a writer adds).
constexpr char kSaveIdKey[] = "dcp.save_id";
// Real headers nest three deep (root, tensor, shape) and shapes have a handful of dimensions;
// the bounds only keep a hostile header from costing the parser's memory or stack.
constexpr int kMaxJsonDepth = 8;
constexpr size_t kMaxArrayLength = 1024;

[[noreturn]] void Bad(const std::string& where, const std::string& what) {
  throw CorruptionError("safetensors file '" + where + "': " + what);
}

// ---- Untrusted JSON, parsed in one linear pass ----
//
// Headers and indexes (up to 100 MiB each) are parsed with nlohmann-json's SAX interface into
// only what is kept: each tensor's name, dtype, shape and offsets; the weight_map. No DOM is
// built. (nlohmann's callback parser, json::parse with a parser_callback_t, rescans an object's
// members each time one of them that is itself an object ends, so a header of N tensors cost
// O(N^2): 50,000 tensors, 4 MiB, took 161 s. A DOM also costs several times the text.)
//
// Every document is held to the same bounds while it is read: containers at most kMaxJsonDepth
// deep, arrays of at most `max_array` elements. A document that is not valid JSON or breaks a
// bound is refused as such; otherwise the first problem of its structure (a tensor without a
// dtype, a weight_map entry that is not a plain file name, ...) is recorded while parsing goes
// on without keeping anything more, and reported at the end.

// A JSON scalar as the SAX parser hands it over.
struct Scalar {
  enum Kind { kUnsigned, kNegative, kFloat, kString, kBool, kNull };
  Kind kind = kNull;
  uint64_t u = 0;                    // kUnsigned
  int64_t i = 0;                     // kNegative
  bool b = false;                    // kBool
  std::string* str = nullptr;        // kString: the parser's buffer (a handler may move it out)
  const std::string* lit = nullptr;  // kFloat: the number as written
  // The value as a message shows it (a string quoted and clipped).
  std::string Describe() const {
    switch (kind) {
      case kUnsigned:
        return std::to_string(u);
      case kNegative:
        return std::to_string(i);
      case kFloat:
        return lit->size() <= 40 ? *lit : lit->substr(0, 40) + "...";
      case kString:
        return ClippedName(*str);
      case kBool:
        return b ? "true" : "false";
      case kNull:
        break;
    }
    return "null";
  }
};

struct Refused {
  std::string why;
};

// What a document's structure got wrong: the error's kind and its message (without the file).
struct Problem {
  ErrorCode code = ErrorCode::kCorruption;
  std::string what;
};

// The bounds every document is held to, and the events a handler sees: the root value is at
// depth 0, a member or element of a container at depth d is at depth d + 1, and a key of an
// object at depth d comes at depth d + 1, before its value. The member functions without a
// capital are nlohmann::json_sax's (Json::sax_parse calls them).
class BoundedSax {
 public:
  explicit BoundedSax(size_t max_array) : max_array_(max_array) {}
  virtual ~BoundedSax() = default;

  bool null() {
    Scalar v;
    return Value(v);
  }
  bool boolean(bool b) {
    Scalar v;
    v.kind = Scalar::kBool;
    v.b = b;
    return Value(v);
  }
  bool number_integer(int64_t i) {
    if (i >= 0) return number_unsigned(static_cast<uint64_t>(i));
    Scalar v;
    v.kind = Scalar::kNegative;
    v.i = i;
    return Value(v);
  }
  bool number_unsigned(uint64_t u) {
    Scalar v;
    v.kind = Scalar::kUnsigned;
    v.u = u;
    return Value(v);
  }
  bool number_float(double, const std::string& literal) {
    Scalar v;
    v.kind = Scalar::kFloat;
    v.lit = &literal;
    return Value(v);
  }
  bool string(std::string& s) {
    Scalar v;
    v.kind = Scalar::kString;
    v.str = &s;
    return Value(v);
  }
  bool binary(Json::binary_t&) {  // not in JSON text
    Scalar v;
    return Value(v);
  }
  bool start_object(size_t) { return Open(false); }
  bool start_array(size_t) { return Open(true); }
  bool end_object() { return Close(); }
  bool end_array() { return Close(); }
  bool key(std::string& k) {
    OnKey(k, static_cast<int>(open_.size()));
    return true;
  }
  template <class Exception>
  bool parse_error(size_t, const std::string&, const Exception& e) {
    throw e;
  }

  const std::optional<Problem>& problem() const { return problem_; }
  // The whole document has been read (valid JSON, within the bounds): what it lacks.
  virtual void OnDone() {}

 protected:
  virtual void OnScalar(Scalar& v, int depth) = 0;
  virtual void OnStart(bool array, int depth) = 0;
  virtual void OnEnd(bool array, int depth) = 0;
  virtual void OnKey(std::string& key, int depth) = 0;

  // Record the document's first structural problem (later ones are not looked for).
  void Fail(std::string what, ErrorCode code = ErrorCode::kCorruption) {
    if (!problem_) problem_ = Problem{code, std::move(what)};
  }
  bool failed() const { return problem_.has_value(); }

 private:
  void Count() {
    if (!open_.empty() && open_.back().first && ++open_.back().second > max_array_) {
      throw Refused{"an array longer than " + std::to_string(max_array_) + " elements"};
    }
  }
  bool Value(Scalar& v) {
    Count();
    OnScalar(v, static_cast<int>(open_.size()));
    return true;
  }
  bool Open(bool array) {
    Count();
    if (open_.size() >= static_cast<size_t>(kMaxJsonDepth)) {
      throw Refused{"nesting deeper than " + std::to_string(kMaxJsonDepth) + " levels"};
    }
    OnStart(array, static_cast<int>(open_.size()));
    open_.emplace_back(array, 0);
    return true;
  }
  bool Close() {
    const bool array = open_.back().first;
    open_.pop_back();
    OnEnd(array, static_cast<int>(open_.size()));
    return true;
  }

  const size_t max_array_;
  std::vector<std::pair<bool, size_t>> open_;  // (is an array, elements so far)
  std::optional<Problem> problem_;
};

// "0x7b ('{')", for a message.
std::string ByteName(char c) {
  static constexpr char kHex[] = "0123456789abcdef";
  const auto u = static_cast<unsigned char>(c);
  std::string s = {'0', 'x', kHex[u >> 4], kHex[u & 15]};
  if (u >= 0x20 && u < 0x7f) s += std::string(" ('") + c + "')";
  return s;
}

// A NUL byte (nlohmann's parser takes one for the end of its input, so "{...}\0<anything>"
// would parse) or a byte order mark (which it skips) is refused in any document; `rule` says
// what the document may hold.
void CheckJsonText(std::string_view text, const std::string& where, const char* what,
                   const char* rule) {
  if (text.substr(0, 3) == "\xEF\xBB\xBF") {
    throw CorruptionError("'" + where + "': " + what +
                          " begins with a UTF-8 byte order mark (EF BB BF): " + rule);
  }
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos) {
    throw CorruptionError("'" + where + "': " + what + " has a NUL byte at offset " +
                          std::to_string(nul) + ": " + rule);
  }
}

// Parse `text` with `sax` (bounds checked as it goes), then report its first problem.
void ParseBounded(std::string_view text, BoundedSax& sax, const std::string& kind,
                  const std::string& where, const char* what) {
  try {
    Json::sax_parse(text.begin(), text.end(), &sax);
  } catch (const Refused& r) {
    throw CorruptionError("'" + where + "': " + what + " has " + r.why);
  } catch (const Json::exception& e) {
    throw CorruptionError("'" + where + "': " + what + " is not valid JSON: " + e.what());
  }
  sax.OnDone();
  if (const auto& p = sax.problem()) {
    const std::string message = kind + " '" + where + "': " + p->what;
    if (p->code == ErrorCode::kUnsupported) throw UnsupportedError(message);
    throw CorruptionError(message);
  }
}

// One tensor of a header, checked.
struct TensorSpec {
  std::string name;
  DType dtype = DType::kUInt8;
  Shape shape;
  uint64_t begin = 0, end = 0;
  bool blob = false;
};

// A header: {"<tensor>": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, ...,
// "__metadata__": {"<key>": "<value>", ...}}, read into TensorSpecs checked against the
// `data_size` bytes after the header, and __metadata__["dcp.blobs"]. Other members of a tensor's
// object are skipped.
class HeaderSax : public BoundedSax {
 public:
  explicit HeaderSax(uint64_t data_size) : BoundedSax(kMaxArrayLength), data_size_(data_size) {}

  std::vector<TensorSpec> specs;
  std::optional<std::string> blobs;  // __metadata__["dcp.blobs"]

 protected:
  void OnKey(std::string& key, int depth) override {
    if (depth == 1) {
      key1_ = key;
    } else if (depth == 2) {
      key2_ = key;
      if (in_ == In::kTensor) {
        field_ = key == "dtype"          ? Field::kDtype
                 : key == "shape"        ? Field::kShape
                 : key == "data_offsets" ? Field::kOffsets
                                         : Field::kOther;
        if (field_ != Field::kOther && (seen_ & Bit(field_))) {
          Fail(Tensor() + "has \"" + key + "\" twice");
        }
        seen_ |= Bit(field_);
      }
    }
  }
  void OnScalar(Scalar& v, int depth) override {
    if (depth == 0) {
      Fail("the header is not a JSON object");
    } else if (depth == 1) {
      Member(nullptr);
    } else if (depth == 2 && in_ == In::kMetadata) {
      if (v.kind != Scalar::kString) {
        Fail("__metadata__ entry " + ClippedName(key2_) + " is not a string");
      } else if (key2_ == kBlobsKey && !failed()) {
        if (blobs) Fail("__metadata__ has \"" + std::string(kBlobsKey) + "\" twice");
        blobs = std::move(*v.str);
      }
    } else if (depth == 2 && in_ == In::kTensor) {
      if (field_ == Field::kDtype && v.kind == Scalar::kString) {
        dtype_name_ = *v.str;
        dtype_ok_ = true;
      }
    } else if (depth == 3 && collect_ == Field::kShape) {
      Dimension(&v);
    } else if (depth == 3 && collect_ == Field::kOffsets) {
      Offset(&v);
    }
  }
  void OnStart(bool array, int depth) override {
    if (depth == 0) {
      if (array) Fail("the header is not a JSON object");
    } else if (depth == 1) {
      Member(&array);
    } else if (depth == 2 && in_ == In::kMetadata) {
      Fail("__metadata__ entry " + ClippedName(key2_) + " is not a string");
    } else if (depth == 2 && in_ == In::kTensor && array) {
      if (field_ == Field::kShape) shape_ok_ = true;
      if (field_ == Field::kOffsets) offsets_ok_ = true;
      if (field_ == Field::kShape || field_ == Field::kOffsets) collect_ = field_;
    } else if (depth == 3 && collect_ == Field::kShape) {
      Dimension(nullptr);
    } else if (depth == 3 && collect_ == Field::kOffsets) {
      Offset(nullptr);
    }
  }
  void OnEnd(bool, int depth) override {
    if (depth == 2) collect_ = Field::kOther;
    if (depth != 1) return;
    if (in_ == In::kTensor) Finish();
    in_ = In::kNone;
  }

 private:
  enum class In { kNone, kMetadata, kTensor, kSkipped };
  enum class Field { kDtype, kShape, kOffsets, kOther };
  static unsigned Bit(Field f) { return 1u << static_cast<unsigned>(f); }
  std::string Tensor() const { return "tensor " + ClippedName(cur_.name) + ": "; }

  // A member of the root: `array` says which container begins (nullptr: a scalar).
  void Member(const bool* array) {
    in_ = array ? In::kSkipped : In::kNone;
    if (key1_ == "__metadata__") {
      if (seen_metadata_) Fail("__metadata__ appears twice");
      seen_metadata_ = true;
      if (!array || *array) {
        Fail("__metadata__ is not a JSON object");
      } else {
        in_ = In::kMetadata;
      }
      return;
    }
    if (!array || *array) {
      Fail("tensor " + ClippedName(key1_) + ": not a JSON object");
      return;
    }
    in_ = In::kTensor;
    cur_ = TensorSpec{};
    cur_.name = key1_;
    seen_ = 0;
    collect_ = Field::kOther;
    dtype_ok_ = shape_ok_ = offsets_ok_ = false;
    bad_dim_.clear();
    offsets_.clear();
  }
  // An element of "shape" (nullptr: a container).
  void Dimension(const Scalar* v) {
    if (v && v->kind == Scalar::kUnsigned &&
        v->u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      if (!failed()) cur_.shape.push_back(static_cast<int64_t>(v->u));
    } else if (bad_dim_.empty()) {
      bad_dim_ = v ? v->Describe() : std::string("a container");
    }
  }
  // An element of "data_offsets" (nullptr: a container).
  void Offset(const Scalar* v) {
    if (offsets_.size() >= 3) return;  // three are already not a pair
    Scalar kept;
    std::string text = v ? v->Describe() : std::string("a container");
    if (v && v->kind == Scalar::kUnsigned) kept = *v;
    kept.str = nullptr;
    offsets_.emplace_back(kept, std::move(text));
  }
  std::string OffsetsText() const {
    std::string s = "[";
    for (size_t i = 0; i < offsets_.size(); ++i) s += (i ? ", " : "") + offsets_[i].second;
    return s + "]";
  }
  // The tensor's object has ended: check it against the data section, as the format requires.
  void Finish() {
    // Messages are built only when a check fails (most tensors pass every one).
    const auto fail = [this](const std::string& why, ErrorCode code = ErrorCode::kCorruption) {
      Fail(Tensor() + why, code);
    };
    if (!dtype_ok_) return fail("no \"dtype\" string");
    if (!shape_ok_) return fail("no \"shape\" list");
    if (!offsets_ok_ || offsets_.size() != 2) return fail("no \"data_offsets\" pair");
    const std::optional<DType> dtype = DTypeFromSafetensorsName(dtype_name_);
    if (!dtype) {
      return fail("has dtype " + ClippedName(dtype_name_) + ", which dcp does not support",
                  ErrorCode::kUnsupported);
    }
    if (!bad_dim_.empty()) {
      return fail("shape has a dimension " + bad_dim_ + ", which is not a non-negative int64");
    }
    if (failed()) return;  // nothing more is kept
    int64_t numel = 0;
    try {
      numel = NumElements(cur_.shape);
    } catch (const InvalidArgumentError&) {
      return fail("shape " + ShapeToString(cur_.shape) + " has more elements than int64 holds");
    }
    const uint64_t esize = ElementSize(*dtype);
    if (static_cast<uint64_t>(numel) > std::numeric_limits<uint64_t>::max() / esize) {
      return fail("shape " + ShapeToString(cur_.shape) + " is too large");
    }
    const uint64_t bytes = static_cast<uint64_t>(numel) * esize;
    const Scalar& b = offsets_[0].first;
    const Scalar& e = offsets_[1].first;
    if (b.kind != Scalar::kUnsigned || e.kind != Scalar::kUnsigned || b.u > e.u) {
      return fail("data_offsets " + OffsetsText() + " are not a range");
    }
    if (e.u > data_size_) {
      return fail("data_offsets " + OffsetsText() + " reach past the file's " +
                  std::to_string(data_size_) + " data bytes");
    }
    if (e.u - b.u != bytes) {
      return fail("data_offsets " + OffsetsText() + " hold " + std::to_string(e.u - b.u) +
                  " bytes, its dtype " + dtype_name_ + " and shape " + ShapeToString(cur_.shape) +
                  " need " + std::to_string(bytes));
    }
    cur_.dtype = *dtype;
    cur_.begin = b.u;
    cur_.end = e.u;
    specs.push_back(std::move(cur_));
  }

  const uint64_t data_size_;
  std::string key1_, key2_;
  In in_ = In::kNone;
  bool seen_metadata_ = false;
  // The tensor being read.
  TensorSpec cur_;
  Field field_ = Field::kOther, collect_ = Field::kOther;
  unsigned seen_ = 0;
  std::string dtype_name_;
  bool dtype_ok_ = false, shape_ok_ = false, offsets_ok_ = false;
  std::string bad_dim_;                                  // the first bad dimension, described
  std::vector<std::pair<Scalar, std::string>> offsets_;  // (value, described)
};

// __metadata__["dcp.blobs"]: a JSON list of names; each that names one of `specs` (sorted by
// name) marks it. Names of no tensor are ignored. The list may be as long as its text: nothing
// of it is kept.
class BlobListSax : public BoundedSax {
 public:
  explicit BlobListSax(std::vector<TensorSpec>& specs)
      : BoundedSax(std::numeric_limits<size_t>::max()), specs_(specs) {}

 protected:
  void OnKey(std::string&, int) override {}
  void OnScalar(Scalar& v, int depth) override {
    if (depth == 0) return Fail(kWhat + " is not a JSON list");
    if (depth != 1) return;
    if (v.kind != Scalar::kString) return Fail(kWhat + " lists a non-string");
    auto it = std::lower_bound(
        specs_.begin(), specs_.end(), *v.str,
        [](const TensorSpec& s, const std::string& name) { return s.name < name; });
    if (it != specs_.end() && it->name == *v.str) it->blob = true;
  }
  void OnStart(bool array, int depth) override {
    if (depth == 0 && !array) Fail(kWhat + " is not a JSON list");
    if (depth == 1) Fail(kWhat + " lists a non-string");
  }
  void OnEnd(bool, int) override {}

 private:
  inline static const std::string kWhat = "__metadata__[\"" + std::string(kBlobsKey) + "\"]";
  std::vector<TensorSpec>& specs_;
};

// model.safetensors.index.json: {"metadata": {...}, "weight_map": {"<tensor>": "<file>", ...}}.
// Kept: the weight_map, its file names checked to be plain names in the checkpoint (the index is
// untrusted), and "metadata"'s dcp save id. Other members are skipped.
class IndexSax : public BoundedSax {
 public:
  IndexSax() : BoundedSax(kMaxArrayLength) {}

  std::map<std::string, std::string> map;
  std::string save_id;

  void OnDone() override {
    if (!seen_map_) Fail("no \"weight_map\" object");
    if (seen_map_ && map.empty() && !failed()) {
      Fail(
          "the \"weight_map\" is empty (an index maps every tensor of the checkpoint to its "
          "file)");
    }
  }

 protected:
  void OnKey(std::string& key, int depth) override {
    if (depth == 1) key1_ = key;
    if (depth == 2) key2_ = key;
  }
  void OnScalar(Scalar& v, int depth) override {
    if (depth == 0) return Fail("not a JSON object");
    if (depth == 1) return Member(nullptr);
    if (depth != 2) return;
    if (in_ == In::kMetadata && key2_ == kSaveIdKey && v.kind == Scalar::kString &&
        v.str->size() <= 64) {
      save_id = *v.str;
    } else if (in_ == In::kMap) {
      if (v.kind != Scalar::kString) return Fail(Tensor() + " maps to a non-string");
      Map(*v.str);
    }
  }
  void OnStart(bool array, int depth) override {
    if (depth == 0 && array) return Fail("not a JSON object");
    if (depth == 1) return Member(&array);
    if (depth == 2 && in_ == In::kMap) Fail(Tensor() + " maps to a non-string");
  }
  void OnEnd(bool, int depth) override {
    if (depth == 1) in_ = In::kNone;
  }

 private:
  enum class In { kNone, kMetadata, kMap };
  std::string Tensor() const { return "tensor " + ClippedName(key2_); }
  void Member(const bool* array) {
    in_ = In::kNone;
    if (key1_ == "weight_map") {
      if (seen_map_) return Fail("\"weight_map\" appears twice");
      seen_map_ = true;
      if (!array || *array) return Fail("no \"weight_map\" object");
      in_ = In::kMap;
    } else if (key1_ == "metadata" && array && !*array) {
      in_ = In::kMetadata;
    }
  }
  void Map(std::string& f) {
    // Names relative to the checkpoint, never outside it.
    if (f.empty() || f == "." || f.find('/') != std::string::npos ||
        f.find('\\') != std::string::npos || f.find("..") != std::string::npos ||
        f.find('\0') != std::string::npos) {
      return Fail(Tensor() + " maps to " + ClippedName(f) +
                  ", which is not a plain file name in the checkpoint");
    }
    if (failed()) return;
    if (!map.emplace(key2_, std::move(f)).second) Fail(Tensor() + " is mapped twice");
  }

  std::string key1_, key2_;
  In in_ = In::kNone;
  bool seen_map_ = false;
};

// The header length the first 8 bytes of a `file_size`-byte file claim, checked.
uint64_t HeaderLength(std::string_view head, uint64_t file_size, const std::string& where) {
  if (file_size < 8 || head.size() < 8) {
    Bad(where, "truncated: " + std::to_string(file_size) +
                   " bytes, shorter than the 8-byte header length");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(head[i]);
  if (n > kMaxSafetensorsHeaderBytes) {
    Bad(where, "header length " + std::to_string(n) + " exceeds the limit of " +
                   std::to_string(kMaxSafetensorsHeaderBytes) + " bytes");
  }
  if (n > file_size - 8) {
    Bad(where, "truncated: header length " + std::to_string(n) + " exceeds the " +
                   std::to_string(file_size - 8) + " bytes after it");
  }
  return n;
}

class SafetensorsFileViewImpl : public ForwardingStore {
 public:
  SafetensorsFileViewImpl(std::shared_ptr<Store> dir, std::string name)
      : ForwardingStore(std::move(dir)), name_(std::move(name)) {}

  const std::string& name() const { return name_; }

  void CreateRoot() override {}
  std::unique_ptr<WritableObject> Create(const std::string& name) override { Refuse(name); }
  std::unique_ptr<ReadableObject> Open(const std::string& name) override {
    if (name != name_) {
      throw NotFoundError("'" + uri() + "/" + name + "' does not exist (the URI names " + name_ +
                          " only)");
    }
    return target_->Open(name);
  }
  std::optional<uint64_t> Size(const std::string& name) override {
    if (name != name_) return std::nullopt;
    return target_->Size(name);
  }
  void PublishAtomically(const std::string& name, std::string_view) override { Refuse(name); }
  std::vector<std::string> List() override {
    if (target_->Size(name_)) return {name_};
    return {};
  }
  void Remove(const std::string& name) override { Refuse(name); }
  std::unique_ptr<StoreLock> TryLock(const std::string&) override { return nullptr; }
  void PublishNew(const std::string& name, std::string_view) override { Refuse(name); }
  std::optional<uint64_t> SizeAndVersion(const std::string& name, std::string* version) override {
    if (version != nullptr) version->clear();
    if (name != name_) return std::nullopt;
    return target_->SizeAndVersion(name, version);
  }
  void PublishReplacing(const std::string& name, std::string_view, const std::string&) override {
    Refuse(name);
  }

 private:
  [[noreturn]] void Refuse(const std::string& name) const {
    throw UnsupportedError("cannot write '" + name + "' through '" + uri() + "/" + name_ +
                           "': a URI naming a safetensors file is read-only");
  }
  std::string name_;
};

// The header of `file` in `store`: its first 8 + N bytes (bounded before anything is allocated).
std::string ReadHead(Store& store, const std::string& file, uint64_t* file_size) {
  const std::string where = store.uri() + "/" + file;
  auto in = store.Open(file);
  *file_size = in->size();
  std::string head(std::min<uint64_t>(*file_size, 8), '\0');
  in->ReadAt(0, head.data(), head.size());
  const uint64_t n = HeaderLength(head, *file_size, where);
  head.resize(8 + n);
  in->ReadAt(8, head.data() + 8, n);
  return head;
}

void AddFile(Store& store, const std::string& file, Metadata& md) {
  uint64_t size = 0;
  const std::string head = ReadHead(store, file, &size);
  AddSafetensorsFile(head, size, file, store.uri() + "/" + file, md);
}

// The file names an index's weight_map maps tensors to, checked, and the map itself.
std::map<std::string, std::string> ReadIndex(Store& store, const std::string& where,
                                             std::string* save_id) {
  const std::optional<uint64_t> size = store.Size(kSafetensorsIndexName);
  if (!size) throw NotFoundError("'" + where + "' does not exist");
  if (*size > kMaxSafetensorsHeaderBytes) {
    throw CorruptionError("safetensors index '" + where + "' has " + std::to_string(*size) +
                          " bytes, over the limit of " +
                          std::to_string(kMaxSafetensorsHeaderBytes));
  }
  const std::string text = store.ReadAll(kSafetensorsIndexName, kMaxSafetensorsHeaderBytes);
  CheckJsonText(text, where, "the index",
                "an index is JSON text (UTF-8 without a byte order mark, no NUL bytes)");
  IndexSax sax;
  ParseBounded(text, sax, "safetensors index", where, "the index");
  *save_id = std::move(sax.save_id);
  return std::move(sax.map);
}

const SafetensorsFileViewImpl* AsFileView(Store& store) {
  return dynamic_cast<const SafetensorsFileViewImpl*>(&store);
}

class SafetensorsLayoutImpl : public CheckpointLayout {
 public:
  CheckpointFormat format() const override { return CheckpointFormat::kSafetensors; }
  std::string_view display_name() const override { return "safetensors"; }
  const std::string& metadata_name() const override { return name_; }
  bool Detect(Store& store) const override {
    if (AsFileView(store) != nullptr) return true;
    // Both commit markers asked together: on an object store each question is a round trip.
    const std::string names[2] = {kSafetensorsIndexName, kSafetensorsSingleName};
    char found[2] = {0, 0};
    ParallelFor(
        2, [&](size_t i) { found[i] = store.Size(names[i]).has_value(); }, 2);
    return found[0] || found[1];
  }
  // Checked by the protocol's constructor (store_writer.cc), before anything is written.
  void CheckWriteOptions(const StorageOptions& options, const std::string& uri) const override {
    if (options.compression != Compression::kNone) {
      throw InvalidArgumentError("compression cannot be used for a safetensors checkpoint at " +
                                 uri + " (the format stores raw tensors only)");
    }
  }
  // The data path is safetensors_writer.cc's (WrapWriter): the protocol's per-rank files are
  // never used for this layout.
  std::string FilePrefix(const std::string&, size_t) const override { Unreachable(); }
  std::string DataFileName(const std::string&, size_t) const override { Unreachable(); }
  // Only names a dcp save creates (they carry its save id): a Hub download's
  // model-00001-of-00002.safetensors is never dcp's to remove.
  bool IsDataFile(const std::string& name) const override { return IsSafetensorsDataName(name); }
  // The index: the Hub's {"metadata": {"total_size"}, "weight_map"}, plus the save id.
  std::string EncodeMetadata(const Metadata& md, const std::string&) const override {
    Json weight_map = Json::object();
    uint64_t total = 0;
    for (const auto& [index, info] : md.storage) {
      weight_map[index.fqn] = info.relative_path;
      total += info.length;
    }
    Json index = {{"metadata", {{"total_size", total}, {kSaveIdKey, md.save_id}}},
                  {"weight_map", weight_map}};
    return index.dump(2) + "\n";
  }
  Metadata ReadMetadata(Store& store, std::string* encoded) const override {
    if (encoded) encoded->clear();
    return ReadSafetensorsMetadata(store);
  }
  // Whole tensors assembled across ranks: the protocol keeps the lock, the commit of the index
  // and the clean-up.
  std::unique_ptr<StorageWriter> WrapWriter(std::unique_ptr<StorageWriter> protocol,
                                            std::shared_ptr<Store> store,
                                            const StorageOptions& options) const override {
    return MakeSafetensorsWriter(std::move(protocol), std::move(store), options);
  }
  // A location naming one existing `*.safetensors` object (a Hugging Face file loads by its own
  // name). A bare name is a file of the current directory only for file://.
  std::shared_ptr<Store> OpenSingleObject(const StoreOpenFn& open, const std::string& scheme,
                                          const std::string& location) const override {
    const size_t slash = location.rfind('/');
    if (!IsSafetensorsName(location) || (slash == std::string::npos && scheme != "file")) {
      return nullptr;
    }
    const std::string name = slash == std::string::npos ? location : location.substr(slash + 1);
    const std::string parent = slash == std::string::npos ? std::string(".")
                               : slash == 0               ? std::string("/")
                                                          : location.substr(0, slash);
    std::shared_ptr<Store> dir;
    try {
      dir = open(parent);
      if (!IsSafetensorsName(name) || !dir->Size(name)) dir.reset();
    } catch (const Error&) {
      dir.reset();  // e.g. a directory named *.safetensors: opened as one by the reader
    }
    return dir ? SafetensorsFileView(std::move(dir), name) : nullptr;
  }

 private:
  [[noreturn]] static void Unreachable() {
    throw InternalError(
        "the safetensors layout has no per-rank data files (its writer is "
        "safetensors_writer.cc)");
  }
  const std::string name_ = kSafetensorsIndexName;
};

}  // namespace

std::optional<std::string> SafetensorsDTypeName(DType d) {
  switch (d) {
    case DType::kBool:
      return "BOOL";
    case DType::kUInt8:
      return "U8";
    case DType::kInt8:
      return "I8";
    case DType::kInt16:
      return "I16";
    case DType::kUInt16:
      return "U16";
    case DType::kInt32:
      return "I32";
    case DType::kUInt32:
      return "U32";
    case DType::kInt64:
      return "I64";
    case DType::kUInt64:
      return "U64";
    case DType::kFloat16:
      return "F16";
    case DType::kBFloat16:
      return "BF16";
    case DType::kFloat32:
      return "F32";
    case DType::kFloat64:
      return "F64";
    case DType::kComplex64:
      return "C64";
    case DType::kFloat8_e4m3fn:
      return "F8_E4M3";
    case DType::kFloat8_e5m2:
      return "F8_E5M2";
    case DType::kFloat8_e8m0fnu:
      return "F8_E8M0";
    default:
      return std::nullopt;
  }
}

std::optional<DType> DTypeFromSafetensorsName(std::string_view name) {
  for (DType d : AllDTypes()) {
    if (SafetensorsDTypeName(d) == name) return d;
  }
  return std::nullopt;
}

bool IsSafetensorsName(std::string_view name) {
  constexpr std::string_view ext = ".safetensors";
  return name.size() > ext.size() && name.substr(name.size() - ext.size()) == ext;
}

void AddSafetensorsFile(std::string_view head, uint64_t file_size, const std::string& file,
                        const std::string& where, Metadata& md) {
  const uint64_t n = HeaderLength(head, file_size, where);
  if (head.size() < 8 + n) Bad(where, "truncated header");
  const uint64_t data_begin = 8 + n, data_size = file_size - data_begin;
  const std::string_view text = head.substr(8, n);
  // The format: the header begins with '{' and may be padded with spaces (0x20) only.
  constexpr char kPadRule[] =
      "a safetensors header is JSON that begins with '{', padded with spaces (0x20) only";
  CheckJsonText(text, where, "the header", kPadRule);
  if (text.empty() || text[0] != '{') {
    Bad(where, "the header is not a JSON object: it must begin with '{' (" +
                   (text.empty() ? std::string("it is empty")
                                 : "it begins with byte " + ByteName(text[0])) +
                   ")");
  }
  HeaderSax sax(data_size);
  ParseBounded(text, sax, "safetensors file", where, "the header");
  std::vector<TensorSpec>& specs = sax.specs;
  std::sort(specs.begin(), specs.end(),
            [](const TensorSpec& a, const TensorSpec& b) { return a.name < b.name; });
  for (size_t i = 1; i < specs.size(); ++i) {
    if (specs[i].name == specs[i - 1].name) {
      Bad(where, "tensor " + ClippedName(specs[i].name) + " appears twice in the header");
    }
  }
  if (sax.blobs) {
    BlobListSax blobs(specs);
    ParseBounded(*sax.blobs, blobs, "safetensors file", where, "__metadata__[\"dcp.blobs\"]");
  }
  std::vector<std::pair<std::pair<uint64_t, uint64_t>, const std::string*>> ranges;
  for (TensorSpec& t : specs) {
    if (md.entries.count(t.name)) {
      auto s = md.storage.lower_bound(MetadataIndex{t.name, {}, {}});
      Bad(where,
          "tensor " + ClippedName(t.name) + ": is also in '" +
              (s != md.storage.end() && s->first.fqn == t.name ? s->second.relative_path : "?") +
              "'");
    }
    StorageInfo info;
    info.relative_path = file;
    info.offset = data_begin + t.begin;
    info.length = t.end - t.begin;
    info.raw_length = info.length;
    if (t.blob && t.dtype == DType::kUInt8 && t.shape.size() == 1) {
      md.storage.emplace(MetadataIndex{t.name, {}, {}}, std::move(info));
      md.entries.emplace(t.name, BytesMetadata{});
    } else {
      const Shape zeros(t.shape.size(), 0);
      md.storage.emplace(MetadataIndex{t.name, zeros, 0}, std::move(info));
      md.entries.emplace(t.name, TensorMetadata{t.dtype, t.shape, {ChunkMeta{zeros, t.shape}}});
    }
    if (t.end > t.begin) ranges.push_back({{t.begin, t.end}, &t.name});
  }
  // The format forbids overlapping tensors; a reader would only read the same bytes twice, but
  // a header that claims it is not one a safetensors writer made.
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first.first < ranges[i - 1].first.second) {
      Bad(where, "tensor " + ClippedName(*ranges[i - 1].second) + " overlaps tensor " +
                     ClippedName(*ranges[i].second));
    }
  }
}

Metadata ReadSafetensorsMetadata(Store& store) {
  Metadata md;
  md.format_version = 1;  // items listed in `storage`, as in version 1
  md.library_version = "safetensors";
  std::string source;
  std::set<std::string> files;
  if (const SafetensorsFileViewImpl* view = AsFileView(store)) {
    source = store.uri() + "/" + view->name();
    AddFile(store, view->name(), md);
    files.insert(view->name());
  } else if (store.Size(kSafetensorsIndexName)) {
    source = store.uri() + "/" + kSafetensorsIndexName;
    const std::map<std::string, std::string> map = ReadIndex(store, source, &md.save_id);
    for (const auto& [name, file] : map) files.insert(file);
    for (const std::string& file : files) {
      if (!store.Size(file)) {
        throw NotFoundError("data file '" + store.uri() + "/" + file + "' is missing: " + source +
                            " maps tensors to it");
      }
      AddFile(store, file, md);
    }
    for (const auto& [name, file] : map) {
      auto it = md.storage.lower_bound(MetadataIndex{name, {}, {}});
      if (it == md.storage.end() || it->first.fqn != name) {
        throw CorruptionError("safetensors index '" + source + "' maps tensor " +
                              ClippedName(name) + " to '" + file +
                              "', whose header does not have it");
      }
      if (it->second.relative_path != file) {
        throw CorruptionError("safetensors index '" + source + "' maps tensor " +
                              ClippedName(name) + " to '" + file + "', but it is in '" +
                              it->second.relative_path + "'");
      }
    }
  } else if (store.Size(kSafetensorsSingleName)) {
    source = store.uri() + "/" + kSafetensorsSingleName;
    AddFile(store, kSafetensorsSingleName, md);
    files.insert(kSafetensorsSingleName);
  } else {
    throw NotFoundError("no safetensors checkpoint at " + store.uri() + " (neither " +
                        kSafetensorsIndexName + " nor " + kSafetensorsSingleName + ")");
  }
  md.world_size = static_cast<int32_t>(std::max<size_t>(files.size(), 1));
  ValidateMetadata(md, source);
  return md;
}

std::shared_ptr<Store> SafetensorsFileView(std::shared_ptr<Store> dir, const std::string& name) {
  return std::make_shared<SafetensorsFileViewImpl>(std::move(dir), name);
}

const CheckpointLayout& SafetensorsLayout() {
  static const SafetensorsLayoutImpl layout;
  return layout;
}

}  // namespace dcp
