// Crafted torch.save tensor records (issue 22): sizes, strides and storage offsets come from the
// file, so an extent that wraps around 2^64 must be refused, never read (it loaded heap bytes or
// the zip header as tensor values, or crashed). The records are built here byte by byte: a
// protocol-2 pickle in a stored zip, as torch.save writes it.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdio>
#include <cstring>
#include <map>

#include "dcp/proto/error.h"
#include "dcp/storage/format/torch_dcp.h"

using namespace dcp;
using Catch::Matchers::Contains;

namespace {

uint32_t ZipCrc32(std::string_view s) {
  uint32_t c = 0xffffffffu;
  for (unsigned char b : s) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
  }
  return ~c;
}

void Le(std::string& out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// A zip of stored entries, as torch.save writes it.
std::string StoredZip(const std::vector<std::pair<std::string, std::string>>& entries) {
  std::string out, central;
  for (const auto& [name, data] : entries) {
    const uint64_t at = out.size();
    const uint32_t crc = ZipCrc32(data);
    Le(out, 0x04034b50, 4);
    Le(out, 20, 2), Le(out, 0, 2), Le(out, 0, 2), Le(out, 0, 2), Le(out, 0, 2);
    Le(out, crc, 4), Le(out, data.size(), 4), Le(out, data.size(), 4);
    Le(out, name.size(), 2), Le(out, 0, 2);
    out += name + data;
    Le(central, 0x02014b50, 4);
    Le(central, 20, 2), Le(central, 20, 2), Le(central, 0, 2), Le(central, 0, 2);
    Le(central, 0, 2), Le(central, 0, 2);
    Le(central, crc, 4), Le(central, data.size(), 4), Le(central, data.size(), 4);
    Le(central, name.size(), 2), Le(central, 0, 2), Le(central, 0, 2), Le(central, 0, 2);
    Le(central, 0, 2), Le(central, 0, 4), Le(central, at, 4);
    central += name;
  }
  const uint64_t cd_at = out.size();
  out += central;
  Le(out, 0x06054b50, 4);
  Le(out, 0, 2), Le(out, 0, 2), Le(out, entries.size(), 2), Le(out, entries.size(), 2);
  Le(out, central.size(), 4), Le(out, cd_at, 4), Le(out, 0, 2);
  return out;
}

// The same zip with every size and offset in zip64 extra fields (0xffffffff in the 32-bit fields
// and zip64 end records), as writers do for entries of 4 GiB or more. Debian's minizip 1.1 never
// read a zip64 size on 64-bit Linux (it compared to (unsigned long)-1): it saw a 4294967295-byte
// entry. Each local header also carries an extra field of `local_pad` bytes that the central
// directory lacks, so where the data starts is known from the local header only.
std::string StoredZip64(const std::vector<std::pair<std::string, std::string>>& entries,
                        size_t local_pad) {
  std::string out, central;
  for (const auto& [name, data] : entries) {
    const uint64_t at = out.size();
    const uint32_t crc = ZipCrc32(data);
    Le(out, 0x04034b50, 4);
    Le(out, 45, 2), Le(out, 0, 2), Le(out, 0, 2), Le(out, 0, 2), Le(out, 0, 2);
    Le(out, crc, 4), Le(out, 0xffffffffu, 4), Le(out, 0xffffffffu, 4);
    Le(out, name.size(), 2), Le(out, 20 + 4 + local_pad, 2);
    out += name;
    Le(out, 1, 2), Le(out, 16, 2), Le(out, data.size(), 8), Le(out, data.size(), 8);
    Le(out, 0xcafe, 2), Le(out, local_pad, 2), out += std::string(local_pad, 'p');
    out += data;
    Le(central, 0x02014b50, 4);
    Le(central, 45, 2), Le(central, 45, 2), Le(central, 0, 2), Le(central, 0, 2);
    Le(central, 0, 2), Le(central, 0, 2);
    Le(central, crc, 4), Le(central, 0xffffffffu, 4), Le(central, 0xffffffffu, 4);
    Le(central, name.size(), 2), Le(central, 28, 2), Le(central, 0, 2), Le(central, 0, 2);
    Le(central, 0, 2), Le(central, 0, 4), Le(central, 0xffffffffu, 4);
    central += name;
    Le(central, 1, 2), Le(central, 24, 2);
    Le(central, data.size(), 8), Le(central, data.size(), 8), Le(central, at, 8);
  }
  const uint64_t cd_at = out.size();
  out += central;
  const uint64_t eocd64_at = out.size();
  Le(out, 0x06064b50, 4), Le(out, 44, 8), Le(out, 45, 2), Le(out, 45, 2);
  Le(out, 0, 4), Le(out, 0, 4), Le(out, entries.size(), 8), Le(out, entries.size(), 8);
  Le(out, central.size(), 8), Le(out, cd_at, 8);
  Le(out, 0x07064b50, 4), Le(out, 0, 4), Le(out, eocd64_at, 8), Le(out, 1, 4);
  Le(out, 0x06054b50, 4);
  Le(out, 0, 2), Le(out, 0, 2), Le(out, 0xffff, 2), Le(out, 0xffff, 2);
  Le(out, 0xffffffffu, 4), Le(out, 0xffffffffu, 4), Le(out, 0, 2);
  return out;
}

std::string PickleStr(const std::string& s) {
  std::string out = "X";
  Le(out, s.size(), 4);
  return out + s;
}
std::string PickleInt(int64_t v) {
  std::string out = "\x8a\x08";
  Le(out, static_cast<uint64_t>(v), 8);
  return out;
}
std::string PickleInts(const std::vector<int64_t>& v) {
  std::string out = "(";
  for (int64_t x : v) out += PickleInt(x);
  return out + "t";
}

// torch._utils._rebuild_tensor_v2(storage, offset, sizes, strides, False, OrderedDict()) over a
// FloatStorage of `numel` elements holding `storage`.
std::string TensorPickle(int64_t offset, const std::vector<int64_t>& sizes,
                         const std::vector<int64_t>& strides, const std::string& storage,
                         const std::string& storage_class = "FloatStorage", size_t esize = 4) {
  std::string pkl = "\x80\x02";
  pkl += "ctorch._utils\n_rebuild_tensor_v2\n(";
  pkl += "(" + PickleStr("storage") + "ctorch\n" + storage_class + "\n" + PickleStr("0") +
         PickleStr("cpu") + PickleInt(static_cast<int64_t>(storage.size() / esize)) + "tQ";
  pkl += PickleInt(offset) + PickleInts(sizes) + PickleInts(strides) + "\x89";
  pkl += "ccollections\nOrderedDict\n)R";
  pkl += "tR.";
  return pkl;
}
std::string TensorRecord(int64_t offset, const std::vector<int64_t>& sizes,
                         const std::vector<int64_t>& strides, const std::string& storage,
                         const std::string& storage_class = "FloatStorage", size_t esize = 4) {
  return StoredZip(
      {{"archive/data.pkl", TensorPickle(offset, sizes, strides, storage, storage_class, esize)},
       {"archive/data/0", storage}});
}

class Bytes : public ReadableObject {
 public:
  explicit Bytes(std::string s) : s_(std::move(s)) {}
  void ReadAt(uint64_t offset, void* dst, size_t n) override {
    if (offset > s_.size() || n > s_.size() - offset) throw CorruptionError("short read");
    std::memcpy(dst, s_.data() + offset, n);
  }
  uint64_t size() const override { return s_.size(); }

 private:
  std::string s_;
};

// Counts the reads a reader makes (each one a ranged GET on s3://).
class CountingBytes : public Bytes {
 public:
  using Bytes::Bytes;
  void ReadAt(uint64_t offset, void* dst, size_t n) override {
    ++reads;
    Bytes::ReadAt(offset, dst, n);
  }
  int reads = 0;
};

TorchTensorRecord Resolve(const std::string& record) {
  Bytes in(record);
  return ResolveTorchTensorRecord(in, 0, record.size(), "crafted record");
}

}  // namespace

TEST_CASE("torch record: honest layouts resolve with the span they view", "[torch_dcp][hostile]") {
  const std::string storage(24, '\x01');  // 6 floats
  TorchTensorRecord rows = Resolve(TensorRecord(0, {2, 3}, {3, 1}, storage));
  CHECK(rows.row_major());
  CHECK(rows.span_bytes == 24);
  TorchTensorRecord cols = Resolve(TensorRecord(0, {3, 2}, {1, 3}, storage));
  CHECK_FALSE(cols.row_major());
  CHECK(cols.span_bytes == 24);
  TorchTensorRecord tail = Resolve(TensorRecord(4, {2}, {1}, storage));
  CHECK(tail.span_bytes == 8);
  CHECK(tail.values_begin() == tail.storage_begin + 16);
  TorchTensorRecord none = Resolve(TensorRecord(0, {0, 3}, {3, 1}, storage));
  CHECK(none.span_bytes == 0);
}

TEST_CASE("torch record: sizes, strides and offsets whose extent wraps around are refused",
          "[torch_dcp][hostile]") {
  const std::string storage(8, '\x02');
  const int64_t big = int64_t{1} << 62;
  // A scalar whose storage offset times the element size wraps to a small number: its values
  // would be read from before the storage (the zip header).
  CHECK_THROWS_AS(Resolve(TensorRecord(big, {}, {}, storage)), CorruptionError);
  // A stride whose reach times the element size wraps: (2^61 + 1) * 8 = 8 (mod 2^64).
  CHECK_THROWS_AS(Resolve(TensorRecord(0, {2}, {int64_t{1} << 61}, storage, "DoubleStorage", 8)),
                  CorruptionError);
  // Reaches that add up past 2^64.
  CHECK_THROWS_AS(Resolve(TensorRecord(INT64_MAX, {2, 2}, {big, big}, storage)), CorruptionError);
  // An offset past the end of an empty view's storage.
  CHECK_THROWS_AS(Resolve(TensorRecord(1000, {0}, {1}, storage)), CorruptionError);
  // One element too many.
  CHECK_THROWS_WITH(Resolve(TensorRecord(1, {2}, {1}, storage)), Contains("beyond its storage"));
}

TEST_CASE("torch record: its directories are read in a few reads, not byte by byte",
          "[torch_dcp][hostile]") {
  // A small record (all of it in one block) and one whose storage is larger than a block.
  for (size_t storage_bytes : {size_t{64}, size_t{1} << 20}) {
    const std::string storage(storage_bytes, '\x03');
    CountingBytes in(TensorRecord(0, {static_cast<int64_t>(storage_bytes / 4)}, {1}, storage));
    TorchTensorRecord rec = ResolveTorchTensorRecord(in, 0, in.size(), "record");
    CHECK(rec.span_bytes == storage_bytes);
    INFO("storage of " << storage_bytes << " bytes: " << in.reads << " reads");
    CHECK(in.reads <= 4);
    // Verify's check of every entry resolves the record from the same directory read.
    CountingBytes v(TensorRecord(0, {static_cast<int64_t>(storage_bytes / 4)}, {1}, storage));
    TorchTensorRecord checked;
    CheckTorchArchiveCrcs(v, 0, v.size(), "record", &checked);
    CHECK(checked.storage_begin == rec.storage_begin);
    INFO("verify: " << v.reads << " reads");
    CHECK(v.reads <= 3);  // the blocks at its tail and head, then the storage in one read
  }
}

namespace {

// A zip whose entries are deflated (method 8), each `copies` times in the central directory and
// all pointing at one local header: the data of each copy is one stored deflate block holding
// `data`, and each claims `claimed` uncompressed bytes (data.size() when honest).
std::string DeflatedZip(const std::string& name, const std::string& data, size_t copies,
                        uint64_t claimed) {
  std::string deflated = "\x01";  // BFINAL, a stored block
  Le(deflated, data.size(), 2), Le(deflated, ~data.size() & 0xffff, 2);
  deflated += data;
  const uint32_t crc = ZipCrc32(data);
  std::string out, central;
  Le(out, 0x04034b50, 4);
  Le(out, 20, 2), Le(out, 0, 2), Le(out, 8, 2), Le(out, 0, 2), Le(out, 0, 2);
  Le(out, crc, 4), Le(out, deflated.size(), 4), Le(out, claimed, 4);
  Le(out, name.size(), 2), Le(out, 0, 2);
  out += name + deflated;
  for (size_t i = 0; i < copies; ++i) {
    const std::string n = copies == 1 ? name : name + std::to_string(i);
    Le(central, 0x02014b50, 4);
    Le(central, 20, 2), Le(central, 20, 2), Le(central, 0, 2), Le(central, 8, 2);
    Le(central, 0, 2), Le(central, 0, 2);
    Le(central, crc, 4), Le(central, deflated.size(), 4), Le(central, claimed, 4);
    Le(central, n.size(), 2), Le(central, 0, 2), Le(central, 0, 2), Le(central, 0, 2);
    Le(central, 0, 2), Le(central, 0, 4), Le(central, 0, 4);
    central += n;
  }
  const uint64_t cd_at = out.size();
  out += central;
  Le(out, 0x06054b50, 4);
  Le(out, 0, 2), Le(out, 0, 2), Le(out, copies, 2), Le(out, copies, 2);
  Le(out, central.size(), 4), Le(out, cd_at, 4), Le(out, 0, 2);
  return out;
}

}  // namespace

TEST_CASE("torch record: deflated entries cannot claim more than deflate's ratio of the record",
          "[torch_dcp][hostile]") {
  // An honest deflated entry is read and its CRC-32 checked.
  const std::string honest = DeflatedZip("archive/version", "3\n", 1, 2);
  Bytes in(honest);
  CHECK_NOTHROW(CheckTorchArchiveCrcs(in, 0, honest.size(), "honest"));
  // 1,000 entries sharing one deflate stream, each claiming 1 GiB: ~1 TiB to inflate from a
  // record of a few dozen KiB. Refused from the directory alone, before any inflation.
  const std::string bomb = DeflatedZip("archive/x", std::string(64, '\0'), 1000, uint64_t{1} << 30);
  Bytes b(bomb);
  CHECK_THROWS_WITH(
      CheckTorchArchiveCrcs(b, 0, bomb.size(), "bomb"),
      Contains("bomb has compressed entries that claim") && Contains("1032 times the record"));
  // Within the budget but lying about the size: the reader inflates no more than the claim, and the
  // entry then fails its length or CRC.
  const std::string liar = DeflatedZip("archive/version", "3\n", 1, 4096);
  Bytes l(liar);
  CHECK_THROWS_AS(CheckTorchArchiveCrcs(l, 0, liar.size(), "liar"), CorruptionError);
}

TEST_CASE("torch record: zip64 sizes and offsets are read (minizip 1.1 saw 4294967295 bytes)",
          "[torch_dcp][hostile]") {
  std::string storage(4 * 24, '\0');
  for (size_t i = 0; i < storage.size(); ++i) storage[i] = static_cast<char>(i * 7 + 1);
  const std::string pkl = TensorPickle(0, {4, 6}, {6, 1}, storage);
  for (size_t pad : {size_t{0}, size_t{37}}) {
    INFO("a local extra field of " << pad << " bytes");
    const std::string zip = StoredZip64({{"archive/data.pkl", pkl},
                                         {"archive/byteorder", "little"},
                                         {"archive/data/0", storage},
                                         {"archive/version", "3\n"}},
                                        pad);
    // At an offset inside a larger object, as records lie in a .distcp file.
    const std::string file = std::string(1000, 'x') + zip + std::string(10, 'y');
    Bytes in(file);
    const TorchTensorRecord rec = ResolveTorchTensorRecord(in, 1000, zip.size(), "zip64 record");
    CHECK(rec.storage_bytes == storage.size());
    CHECK(rec.zip_crc32 == ZipCrc32(storage));
    CHECK(rec.row_major());
    REQUIRE(rec.storage_begin + storage.size() <= file.size());
    CHECK(file.compare(rec.storage_begin, storage.size(), storage) == 0);
    TorchTensorRecord checked;
    CHECK_NOTHROW(CheckTorchArchiveCrcs(in, 1000, zip.size(), "zip64 record", &checked));
    CHECK(checked.storage_begin == rec.storage_begin);
    CHECK(ReadTorchRecordStorage(in, rec, "zip64 record", true) ==
          std::vector<char>(storage.begin(), storage.end()));
    // A flipped byte of the storage fails verify's CRC-32, naming the entry.
    std::string bad = zip;
    bad[rec.storage_begin - 1000 + 5] ^= 1;
    Bytes b(bad);
    CHECK_THROWS_WITH(CheckTorchArchiveCrcs(b, 0, bad.size(), "zip64 record"),
                      Contains("zip64 record entry archive/data/0 fails its CRC-32"));
  }
  // A zip64 size that lies (one element more than the storage holds): the pickle disagrees.
  std::string lying = StoredZip64({{"archive/data.pkl", pkl}, {"archive/data/0", storage}}, 0);
  const std::string needle = std::string("archive/data/0") + "\x01\x00\x18\x00";
  const size_t at = lying.rfind(needle);
  REQUIRE(at != std::string::npos);
  for (size_t k = 0; k < 2; ++k) lying[at + needle.size() + 8 * k] += 4;  // both sizes + 4
  Bytes l(lying);
  CHECK_THROWS_AS(ResolveTorchTensorRecord(l, 0, lying.size(), "liar"), CorruptionError);
  CHECK_THROWS_AS(CheckTorchArchiveCrcs(l, 0, lying.size(), "liar"), CorruptionError);
}

namespace {

// A large object of zeros but for a few patches, that costs no memory.
class SparseObject : public ReadableObject {
 public:
  SparseObject(uint64_t size, std::map<uint64_t, std::string> patches)
      : size_(size), patches_(std::move(patches)) {}
  void ReadAt(uint64_t offset, void* dst, size_t n) override {
    if (offset > size_ || n > size_ - offset) throw CorruptionError("short read");
    ++reads;
    read_bytes += n;
    std::memset(dst, 0, n);
    for (const auto& [at, bytes] : patches_) {
      const uint64_t lo = std::max(at, offset), hi = std::min(at + bytes.size(), offset + n);
      if (lo < hi)
        std::memcpy(static_cast<char*>(dst) + (lo - offset), bytes.data() + (lo - at), hi - lo);
    }
  }
  uint64_t size() const override { return size_; }
  int reads = 0;
  uint64_t read_bytes = 0;

 private:
  uint64_t size_;
  std::map<uint64_t, std::string> patches_;
};

// End records claiming a central directory of `entries` entries, `cd_size` bytes at offset 0
// (where an entry's signature is), zip64 when `zip64`.
SparseObject ClaimingDirectory(uint64_t entries, uint64_t cd_size, bool zip64) {
  std::string tail;
  const uint64_t at = cd_size;  // the end records follow the directory
  if (zip64) {
    Le(tail, 0x06064b50, 4), Le(tail, 44, 8), Le(tail, 45, 2), Le(tail, 45, 2);
    Le(tail, 0, 4), Le(tail, 0, 4), Le(tail, entries, 8), Le(tail, entries, 8);
    Le(tail, cd_size, 8), Le(tail, 0, 8);
    Le(tail, 0x07064b50, 4), Le(tail, 0, 4), Le(tail, at, 8), Le(tail, 1, 4);
  }
  Le(tail, 0x06054b50, 4);
  Le(tail, 0, 2), Le(tail, 0, 2);
  Le(tail, zip64 ? 0xffff : entries, 2), Le(tail, zip64 ? 0xffff : entries, 2);
  Le(tail, zip64 ? 0xffffffffu : cd_size, 4), Le(tail, zip64 ? 0xffffffffu : 0, 4), Le(tail, 0, 2);
  std::string first;
  Le(first, 0x02014b50, 4);
  return SparseObject(at + tail.size(), {{0, first}, {at, tail}});
}

}  // namespace

TEST_CASE("torch record: a directory claiming millions of entries is refused before it is read",
          "[torch_dcp][hostile]") {
  // A zip64 end record claiming 10^8 entries of a 4.6 GB directory: libzip would allocate and
  // initialise 3.2 GB of entries before reading the first. Refused from the end records.
  SparseObject many = ClaimingDirectory(100000000, uint64_t{46} * 100000000, true);
  CHECK_THROWS_WITH(ResolveTorchTensorRecord(many, 0, many.size(), "crafted"),
                    Contains("crafted claims 100000000 entries (limit 1024)"));
  CHECK(many.read_bytes < (1 << 20));
  // A 5 MiB directory of few entries (libzip would parse every entry it holds).
  SparseObject big = ClaimingDirectory(3, uint64_t{5} << 20, false);
  CHECK_THROWS_WITH(CheckTorchArchiveCrcs(big, 0, big.size(), "crafted"),
                    Contains("crafted has central directories of more than 4194304 bytes"));
  // End-record signatures in tensor data (here the last bytes of the storage) are no directory.
  std::string storage(64, '\0');
  std::memcpy(storage.data() + 20, "PK\x05\x06", 4);
  Bytes in(TensorRecord(0, {16}, {1}, storage));
  CHECK(ResolveTorchTensorRecord(in, 0, in.size(), "record").storage_bytes == 64);
}

// Crafted torch.save files (issue 44, case 6): a dict of entries, as torch.save(state_dict)
// writes it, with the pickle and storages made here.
namespace {

// The body of a tensor pickle (TensorPickle without PROTO and STOP), to nest in a dict.
std::string TensorBody(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
                       const std::string& storage) {
  const std::string pkl = TensorPickle(0, sizes, strides, storage);
  return pkl.substr(2, pkl.size() - 3);
}

std::string DictPickle(const std::vector<std::pair<std::string, std::string>>& entries) {
  std::string pkl = "\x80\x02}(";
  for (const auto& [key, body] : entries) pkl += PickleStr(key) + body;
  return pkl + "u.";
}

std::string TorchSaveFile(const std::string& pkl, const std::string& storage = "") {
  std::vector<std::pair<std::string, std::string>> entries = {{"archive/data.pkl", pkl}};
  if (!storage.empty()) entries.emplace_back("archive/data/0", storage);
  return StoredZip(entries);
}

std::vector<TorchSaveLeaf> ReadFile(const std::string& file) {
  Bytes in(file);
  return ReadTorchSaveFile(in, file.size(), "'crafted.pt'");
}

// {"a": d, "b": d} nested `levels` times over d = {"k": 1}, each level a memo reference to the
// one below: a pickle of a few hundred bytes whose tree has 2^levels leaves.
std::string SharedDictPickle(int levels) {
  std::string pkl = std::string("\x80\x02}q") + '\0' + "(" + PickleStr("k") + "K\x01u";
  for (int i = 1; i <= levels; ++i) {
    const char prev = static_cast<char>(i - 1), self = static_cast<char>(i);
    pkl += std::string("0}q") + self + "(" + PickleStr("a") + "h" + prev + PickleStr("b") + "h" +
           prev + "u";
  }
  return pkl + ".";
}

}  // namespace

TEST_CASE("torch.save file: shared pickle structures are bounded as the tree they expand to",
          "[torch_dcp][hostile]") {
  // The reader itself: 2^40 leaves from 500 bytes are refused while the pickle is read.
  CHECK_THROWS_WITH(pickle::Load(SharedDictPickle(40), nullptr, "dag"),
                    Contains("dag: invalid pickle at byte") &&
                        Contains("shared references (memo GETs) expand it to more than 16777216 "
                                 "values"));
  // A torch.save file: its bound is a multiple of its pickle (the walk into names would not end).
  CHECK_THROWS_WITH(ReadFile(TorchSaveFile(SharedDictPickle(40))),
                    Contains("'crafted.pt' archive/data.pkl: invalid pickle") &&
                        Contains("expand it to more than"));
  CHECK_THROWS_AS(ReadFile(TorchSaveFile(SharedDictPickle(20))), CorruptionError);
  // Modest sharing (a memoised string or dict used a few times) reads as before.
  CHECK(ReadFile(TorchSaveFile(SharedDictPickle(3))).size() == 8);
  // A 64 KiB string referenced 1024 times in a list: 64 MiB once expanded (each leaf value is
  // pickled again as its own record): refused by its bytes.
  std::string pkl = "\x80\x02}(" + PickleStr("list") + "]q" + '\0' + "(" +
                    PickleStr(std::string(64 << 10, 's')) + "q\x01";
  for (int i = 0; i < 1023; ++i) pkl += "h\x01";
  pkl += "eu.";
  CHECK_THROWS_WITH(ReadFile(TorchSaveFile(pkl)),
                    Contains("expand it to more than") && Contains("bytes of strings"));
}

TEST_CASE("torch.save file: an expanded tensor or storages viewed too often are refused",
          "[torch_dcp][hostile]") {
  const std::string one(4, '\x01');
  // A stride-0 view of one float as 2^20 elements: 4 MiB written from a 4-byte storage.
  CHECK_THROWS_WITH(
      ReadFile(TorchSaveFile(DictPickle({{"w", TensorBody({1 << 20}, {0}, one)}}), one)),
      Contains("'crafted.pt': tensor 'w' views 4194304 bytes of a storage of 4") &&
          Contains("an expanded tensor"));
  // Overlapping strides: 3 x 4 elements over 6.
  const std::string six(24, '\x02');
  CHECK_THROWS_WITH(
      ReadFile(TorchSaveFile(DictPickle({{"o", TensorBody({3, 4}, {1, 1}, six)}}), six)),
      Contains("tensor 'o' views 48 bytes of a storage of 24"));
  // A view of at most its storage reads (a slice, a transposed view, a tied weight).
  CHECK(ReadFile(TorchSaveFile(DictPickle({{"t", TensorBody({3, 2}, {1, 3}, six)},
                                           {"s", TensorBody({2}, {2}, six)},
                                           {"tied", TensorBody({6}, {1}, six)}}),
                               six))
            .size() == 3);
  // 32 tensors each viewing one 64 KiB storage: 2 MiB from a 70 KiB file.
  const std::string big(64 << 10, '\x03');
  std::vector<std::pair<std::string, std::string>> many;
  for (int i = 0; i < 32; ++i) {
    many.emplace_back("t" + std::to_string(i), TensorBody({16 << 10}, {1}, big));
  }
  CHECK_THROWS_WITH(ReadFile(TorchSaveFile(DictPickle(many), big)),
                    Contains("'crafted.pt': its tensors view more than") &&
                        Contains("8 times the file's") && Contains("(reached at tensor 't"));
}

TEST_CASE("torch.save file: a storage failing its zip CRC-32 is refused, checked once",
          "[torch_dcp][hostile]") {
  std::string storage(4096, '\0');
  for (size_t i = 0; i < storage.size(); ++i) storage[i] = static_cast<char>(i * 7 + 1);
  std::vector<std::pair<std::string, std::string>> tensors;
  for (int i = 0; i < 4; ++i) {
    tensors.emplace_back("w" + std::to_string(i), TensorBody({1024}, {1}, storage));
  }
  const std::string file = TorchSaveFile(DictPickle(tensors), storage);
  {  // Honest: read whole once, however many tensors view it.
    CountingBytes in(file);
    CHECK(ReadTorchSaveFile(in, file.size(), "'ok.pt'").size() == 4);
  }
  std::string damaged = file;
  const size_t at = damaged.find(storage);
  REQUIRE(at != std::string::npos);
  damaged[at + 100] ^= 0x10;
  CHECK_THROWS_WITH(ReadFile(damaged),
                    Contains("'crafted.pt' entry archive/data/0 fails its CRC-32 (the zip records "
                             "0x") &&
                        Contains("its 4096 bytes have 0x"));
}

TEST_CASE("torch.save file: names too long or of too many dotted parts are refused",
          "[torch_dcp][hostile]") {
  // Each dot nests the name one level deeper where the checkpoint is written.
  std::string dots;
  for (int i = 0; i < 30000; ++i) dots += "a.";
  CHECK_THROWS_WITH(ReadFile(TorchSaveFile(DictPickle({{dots + "w", "K\x01"}}))),
                    Contains("'crafted.pt': the name 'a.a.a.") &&
                        Contains("...' has 60001 bytes in 30001 dotted parts (limits: 65536 "
                                 "bytes, 256 parts)"));
  CHECK_THROWS_WITH(ReadFile(TorchSaveFile(DictPickle({{std::string(70000, 'n'), "K\x01"}}))),
                    Contains("has 70000 bytes in 1 dotted parts"));
  // Nested dicts count too.
  std::string nested = "\x80\x02";
  for (int i = 0; i < 60; ++i) nested += "}(" + PickleStr(std::string(1200, 'k'));
  nested += "K\x01";
  for (int i = 0; i < 60; ++i) nested += "u";
  CHECK_THROWS_WITH(ReadFile(TorchSaveFile(nested + ".")), Contains("bytes in 55 dotted parts"));
  // Real names read.
  CHECK(ReadFile(TorchSaveFile(DictPickle({{"model.layers.0.self_attn.q_proj.bias", "K\x01"}})))
            .size() == 1);
}

TEST_CASE("torch.save file: a long key above many entries is bounded by the names it makes",
          "[torch_dcp][hostile]") {
  // A 60 KiB key over a dict of 1000 entries: 60 MB of names from a 70 KB pickle.
  std::string pkl = "\x80\x02}(" + PickleStr(std::string(60000, 'k')) + "}(";
  for (int i = 0; i < 1000; ++i) pkl += PickleStr("e" + std::to_string(i)) + "K\x01";
  pkl += "uu.";
  CHECK_THROWS_WITH(
      ReadFile(TorchSaveFile(pkl)),
      Contains("'crafted.pt': its keys make names of more than") && Contains("bytes in all"));
}

TEST_CASE("torch.save file: the number of entries is bounded by the pickle before any is made",
          "[torch_dcp][hostile]") {
  // d = {"a": None, "b": None, "c": None, "d": None}, referenced under 25000 keys: 100000
  // entries (each a torch.save record of its own once converted) from a 175 KB pickle.
  std::string pkl = std::string("\x80\x02}q") + '\0' + "(";
  for (char k : std::string("abcd")) pkl += std::string("\x8c\x01") + k + "N";
  pkl += "u0}(";
  for (int i = 0; i < 25000; ++i) {
    char key[8];
    std::snprintf(key, sizeof(key), "%05d", i);
    pkl += std::string("\x8c\x05") + key + "h" + '\0';
  }
  pkl += "u.";
  CHECK_THROWS_WITH(ReadFile(TorchSaveFile(pkl)),
                    Contains("'crafted.pt' holds more than") &&
                        Contains("entries (one per 8 bytes of its pickle, plus 65536)"));
  // The same shared dict under 1000 keys reads.
  pkl = pkl.substr(0, pkl.find("u0}(") + 4);
  for (int i = 0; i < 1000; ++i)
    pkl += std::string("\x8c\x05") + "k" + std::to_string(10000 + i).substr(1) + "h" + '\0';
  pkl += "u.";
  CHECK(ReadFile(TorchSaveFile(pkl)).size() == 4000);
}
