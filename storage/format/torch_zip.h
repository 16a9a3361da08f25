// Zip archives as torch.save writes them, for the PyTorch DCP format (storage/format/torch_dcp.h):
// read through libzip over a byte range of a ReadableObject (Archive), written here with stored
// entries only (ZipWriter). Internal to storage/format: not installed.
//
// Everything read is untrusted: the directories an archive claims are bounded before libzip
// parses them, inflation is bounded, and failures are CorruptionError or UnsupportedError naming
// the archive. One Archive or ZipWriter is used by one thread at a time.
#pragma once

#include <zip.h>  // libzip

#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "dcp/proto/error.h"
#include "dcp/storage/store.h"

namespace dcp::torch_internal {

// What one archive's central directories may claim (a PyTorch DCP record holds one tensor).
constexpr size_t kMaxEntries = 1024;
constexpr uint64_t kMaxDirectoryBytes = uint64_t{4} << 20;  // central directories, per record

// libzip reads a record a few bytes at a time (header fields, local headers before each entry's
// data) besides one read of the record's tail for its directories: each a ranged GET on s3://.
// Small reads are therefore served from one cached block: the block at the position asked for
// (the tail block when the position lies in it), up to four kept (a record's small entries sit at
// its head and its tail, and verify alternates between them). Other reads of a block or more go
// straight through.
struct Window {
  static constexpr uint64_t kBlock = 64 << 10;
  static constexpr size_t kBlocks = 4;
  struct Block {
    uint64_t at = 0;  // window offset of bytes[0]
    std::vector<char> bytes;
  };
  ReadableObject* in;
  uint64_t base, size, pos = 0;
  uint64_t last_read = 0;    // where libzip's latest read began (see Archive::DataOffset)
  std::exception_ptr error;  // what the ReadableObject threw, rethrown by Archive::Fail
  zip_error_t zerr;          // what the source reports to libzip
  std::vector<Block> cache;  // most recently used last

  Window(ReadableObject* in_, uint64_t base_, uint64_t size_) : in(in_), base(base_), size(size_) {
    zip_error_init(&zerr);
  }
  ~Window() { zip_error_fini(&zerr); }
  Window(const Window&) = delete;
  Window& operator=(const Window&) = delete;

  void Read(void* buf, uint64_t k);
};

// One central directory entry, as libzip read it (zip64 sizes and offsets included).
struct ZipEntry {
  zip_uint64_t index = 0;
  uint64_t size = 0;       // uncompressed
  uint64_t comp_size = 0;  // in the archive
  uint32_t crc = 0;
  uint16_t method = 0;  // 0 stored, 8 deflated
  bool encrypted = false;
};

class Archive {
 public:
  // `max_entries` and `max_directory_bytes` bound what the central directories may claim: a
  // PyTorch DCP record holds one tensor, a whole torch.save file (ReadTorchSaveFile) many.
  Archive(ReadableObject& in, uint64_t offset, uint64_t length, std::string what,
          size_t max_entries = kMaxEntries, uint64_t max_directory_bytes = kMaxDirectoryBytes);
  Archive(const Archive&) = delete;
  Archive& operator=(const Archive&) = delete;

  [[noreturn]] void Fail(const std::string& why) const {
    if (window_.error) std::rethrow_exception(window_.error);
    throw CorruptionError(what_ + " " + why);
  }
  const std::map<std::string, ZipEntry>& entries() const { return entries_; }
  // The folder every torch.save entry lives in ("archive/"), from its data.pkl.
  std::string Prefix() const;
  const ZipEntry* Find(const std::string& name) const {
    auto it = entries_.find(name);
    return it == entries_.end() ? nullptr : &it->second;
  }
  // A small entry, whole; libzip checks its CRC-32 and length when a read reaches its end.
  std::string ReadSmall(const std::string& name, size_t limit);
  // Where a stored (uncompressed) entry's data starts, relative to the archive. libzip 1.7 has no
  // call for it (the local header's name and extra field lengths decide it, and only the central
  // directory says where that header is), so it is observed: the first byte of the entry read
  // through libzip is read by the source at the data's start, which the source records.
  uint64_t DataOffset(const std::string& name);
  // Read a whole entry of any size (CRC-checked and its length checked at the end).
  void CheckEntry(const std::string& name);

 private:
  struct Discard {
    void operator()(zip_t* z) const { zip_discard(z); }
  };

  static std::string Hex32(uint32_t v) {
    char buf[16];
    std::snprintf(buf, sizeof(buf), "0x%08x", v);
    return buf;
  }
  static uint64_t Le(const unsigned char* p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
    return v;
  }
  // What libzip would parse, bounded before it does. zip_open tries every end-of-central-
  // directory signature in the record's last 64 KiB + 42 bytes: for each it allocates the
  // entries its (zip64) end record claims, up to one per 46 bytes of the record (a crafted
  // 4 GiB record: gigabytes), and parses every entry of its directory. So each candidate whose
  // directory libzip would read (it lies before the end record and starts with an entry's
  // signature) may claim at most 1024 entries, and together at most 4 MiB of directory.
  // Chance signatures in tensor data almost never pass for one; the bytes read are those
  // libzip reads first (then from the cache), plus 4 or 56 at what a candidate points to.
  void CheckDirectoryClaims();
  struct Close {
    void operator()(zip_file_t* f) const { zip_fclose(f); }
  };
  using File = std::unique_ptr<zip_file_t, Close>;

  const ZipEntry& Get(const std::string& name) const {
    const ZipEntry* e = Find(name);
    if (!e) Fail("has no entry " + name);
    return *e;
  }
  // A stored entry is read directly: its two sizes must agree.
  void CheckStored(const std::string& name, const ZipEntry& e) const;
  File Open(const std::string& name, const ZipEntry& e);
  [[noreturn]] void FailRead(const std::string& name, zip_file_t* f, uint64_t total = 0) const;

  Window window_;
  std::string what_;
  size_t max_entries_;
  uint64_t max_directory_bytes_;
  std::unique_ptr<zip_t, Discard> zip_;  // closed before window_ goes
  std::map<std::string, ZipEntry> entries_;
};

class StringObject : public ReadableObject {
 public:
  explicit StringObject(std::string_view s) : s_(s) {}
  void ReadAt(uint64_t offset, void* dst, size_t n) override {
    if (offset > s_.size() || n > s_.size() - offset) {
      throw CorruptionError("read past the end of an in-memory record");
    }
    std::memcpy(dst, s_.data() + offset, n);
  }
  uint64_t size() const override { return s_.size(); }

 private:
  std::string_view s_;
};

class ZipWriter {
 public:
  ZipWriter(WritableObject& out) : out_(out), base_(out.size()) {}

  void AddSmall(const std::string& name, std::string_view content);
  // An entry whose bytes `write` appends (`size` of them, CRC-32 returned); its data starts at
  // a multiple of 64 from the archive's start, as torch aligns storages.
  void AddStreamed(const std::string& name, uint64_t size, const std::function<uint32_t()>& write);
  // The entry torch 2.x's writer adds last, ".data/serialization_id": 20 decimal digits of a
  // hash over the record names, then 20 of a hash over the entries' CRC-32s, combined as
  // PyTorchStreamWriter does (c10::hash_combine over std::hash of each name, visited in an
  // unordered_set's order, and over the CRCs in write order), so dcp's records carry the id
  // torch would give the same entries (checked against the torch 2.11 fixtures).
  void AddSerializationId();
  uint64_t Finish();

 private:
  struct Entry {
    std::string name;
    uint32_t crc;
    uint64_t size;
    uint64_t offset;
    bool descriptor;
  };
  static void Put16(std::string& s, uint16_t v) {
    s += static_cast<char>(v & 0xff);
    s += static_cast<char>(v >> 8);
  }
  static void Put32(std::string& s, uint32_t v) {
    for (int i = 0; i < 4; ++i) s += static_cast<char>((v >> (8 * i)) & 0xff);
  }
  static void Put64(std::string& s, uint64_t v) {
    for (int i = 0; i < 8; ++i) s += static_cast<char>((v >> (8 * i)) & 0xff);
  }
  uint64_t Pos() const { return out_.size() - base_; }
  // `extra_len` bytes of padding extra field ("FB", as torch writes) when non-zero.
  void LocalHeader(const Entry& e, uint64_t extra_len);

  static size_t HashCombine(size_t seed, size_t value) {
    return seed ^ (value + 0x9e3779b9 + (seed << 6) + (seed >> 2));
  }
  void Written(const Entry& e) {
    entries_.push_back(e);
    crc_hash_ = HashCombine(crc_hash_, e.crc);
  }

  WritableObject& out_;
  uint64_t base_;
  std::vector<Entry> entries_;
  size_t crc_hash_ = 0;
};

class StringSink : public WritableObject {
 public:
  void Append(const void* data, size_t n) override { s.append(static_cast<const char*>(data), n); }
  void Sync() override {}
  void Close() override {}
  uint64_t size() const override { return s.size(); }
  std::string s;
};

}  // namespace dcp::torch_internal
