// Reading a record goes through libzip (Debian's libzip-dev 1.7): it parses the archive's
// central directory, zip64 sizes and offsets included (Debian's minizip 1.1 never reads the zip64
// size on 64-bit Linux, so entries of 4 GiB or more failed), and reads the small entries with
// their CRC-32 checked. A stored entry's values are read with dcp's own reader straight into
// their destination, from where libzip finds its data. Writing is done here: libzip's writer
// seeks back to patch each local header, which stores that only append cannot take, whereas a
// stored entry with a data descriptor streams front to back; the few
// structures involved (local header, data descriptor, central directory, zip64 end records) are
// written below and every archive we write is read back by libzip, Python's zipfile and
// torch.load in tests.
#include "dcp/storage/format/torch_zip.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <unordered_set>

#include "dcp/proto/checksum.h"

namespace dcp::torch_internal {
namespace {

constexpr uint64_t kMaxInflatedBytes = uint64_t{64} << 20;  // deflated entries, per record

// A read-only, seekable libzip source (zip_source_function_create) over a Window. Exceptions
// must not cross libzip's C frames: the ReadableObject's is kept and reported as a read error.
zip_int64_t WindowSource(void* state, void* data, zip_uint64_t len, zip_source_cmd_t cmd) {
  auto* w = static_cast<Window*>(state);
  switch (cmd) {
    case ZIP_SOURCE_OPEN:
      w->pos = 0;
      return 0;
    case ZIP_SOURCE_READ: {
      const uint64_t k = std::min<uint64_t>(len, w->size - std::min(w->pos, w->size));
      if (k == 0) return 0;
      try {
        w->last_read = w->pos;
        w->Read(data, k);
      } catch (...) {
        w->error = std::current_exception();
        zip_error_set(&w->zerr, ZIP_ER_READ, EIO);
        return -1;
      }
      w->pos += k;
      return static_cast<zip_int64_t>(k);
    }
    case ZIP_SOURCE_CLOSE:
    case ZIP_SOURCE_FREE:  // the Window belongs to its Archive
      return 0;
    case ZIP_SOURCE_STAT: {
      auto* st = ZIP_SOURCE_GET_ARGS(zip_stat_t, data, len, &w->zerr);
      if (!st) return -1;
      zip_stat_init(st);
      st->size = w->size;
      st->valid |= ZIP_STAT_SIZE;
      return sizeof(zip_stat_t);
    }
    case ZIP_SOURCE_ERROR:
      return zip_error_to_data(&w->zerr, data, len);
    case ZIP_SOURCE_SEEK: {
      const zip_int64_t at = zip_source_seek_compute_offset(w->pos, w->size, data, len, &w->zerr);
      if (at < 0) return -1;
      w->pos = static_cast<uint64_t>(at);
      return 0;
    }
    case ZIP_SOURCE_TELL:
      return static_cast<zip_int64_t>(w->pos);
    case ZIP_SOURCE_SUPPORTS:
      return ZIP_SOURCE_SUPPORTS_SEEKABLE;
    default:
      zip_error_set(&w->zerr, ZIP_ER_OPNOTSUPP, 0);
      return -1;
  }
}

}  // namespace

void Window::Read(void* buf, uint64_t k) {
  if (k == 0) return;  // libzip asks for nothing at times (an empty record): no buffer then
  for (size_t i = 0; i < cache.size(); ++i) {
    Block& b = cache[i];
    if (pos >= b.at && pos + k <= b.at + b.bytes.size()) {
      std::memcpy(buf, b.bytes.data() + (pos - b.at), k);
      std::rotate(cache.begin() + static_cast<std::ptrdiff_t>(i),
                  cache.begin() + static_cast<std::ptrdiff_t>(i) + 1, cache.end());
      return;
    }
  }
  // libzip's first read is the record's last 64 KiB + 42 bytes (where the directories are):
  // kept, as later small reads near the tail (local headers of the last entries) fall in it.
  const bool tail_read = pos + k == size && k <= 2 * kBlock;
  if (k >= kBlock && !tail_read) {
    in->ReadAt(base + pos, buf, k);
    return;
  }
  if (cache.size() == kBlocks) cache.erase(cache.begin());
  Block& b = cache.emplace_back();
  const uint64_t tail = size > kBlock ? size - kBlock : 0;
  b.at = k >= kBlock || pos < tail ? pos : tail;
  b.bytes.resize(std::max(k, std::min(kBlock, size - b.at)));
  in->ReadAt(base + b.at, b.bytes.data(), b.bytes.size());
  std::memcpy(buf, b.bytes.data() + (pos - b.at), k);
}

Archive::Archive(ReadableObject& in, uint64_t offset, uint64_t length, std::string what,
                 size_t max_entries, uint64_t max_directory_bytes)
    : window_(&in, offset, length),
      what_(std::move(what)),
      max_entries_(max_entries),
      max_directory_bytes_(max_directory_bytes) {
  CheckDirectoryClaims();
  zip_error_t err;
  zip_error_init(&err);
  zip_source_t* src = zip_source_function_create(WindowSource, &window_, &err);
  if (src) {
    zip_.reset(zip_open_from_source(src, ZIP_RDONLY, &err));
    if (!zip_) zip_source_free(src);  // zip_open_from_source owns it only on success
  }
  if (!zip_) {
    const std::string why = zip_error_strerror(&err);
    zip_error_fini(&err);
    Fail("is not a zip archive (a torch.save record): " + why);
  }
  zip_error_fini(&err);
  const zip_int64_t n = zip_get_num_entries(zip_.get(), 0);
  if (n < 0) Fail("has a damaged central directory");
  if (static_cast<uint64_t>(n) > max_entries_) {
    Fail("has more than " + std::to_string(max_entries_) + " entries");
  }
  for (zip_uint64_t i = 0; i < static_cast<zip_uint64_t>(n); ++i) {
    zip_stat_t st;
    zip_stat_init(&st);
    if (zip_stat_index(zip_.get(), i, ZIP_FL_ENC_RAW, &st) != 0 || !st.name) {
      Fail("has an unreadable central directory entry");
    }
    constexpr zip_uint64_t kNeeded = ZIP_STAT_SIZE | ZIP_STAT_COMP_SIZE | ZIP_STAT_CRC |
                                     ZIP_STAT_COMP_METHOD | ZIP_STAT_ENCRYPTION_METHOD;
    if ((st.valid & kNeeded) != kNeeded) Fail("has an unreadable central directory entry");
    ZipEntry e;
    e.index = i;
    e.size = st.size;
    e.comp_size = st.comp_size;
    e.crc = st.crc;
    e.method = st.comp_method;
    e.encrypted = st.encryption_method != ZIP_EM_NONE;
    entries_.emplace(st.name, e);  // a duplicate name: the first entry, as zip readers do
  }
  // Inflation is bounded: torch.save stores tensor data uncompressed (DataOffset refuses it
  // otherwise), so only small entries may be deflated. Entries sharing one deflate stream (a
  // zip bomb) could otherwise claim far more than deflate's 1032:1 of the record.
  uint64_t inflated = 0;
  for (const auto& [name, e] : entries_) {
    if (e.method != 0) inflated += std::min<uint64_t>(e.size, kMaxInflatedBytes + 1);
  }
  if (inflated > kMaxInflatedBytes || inflated / 1032 > length) {
    Fail("has compressed entries that claim " + std::to_string(inflated) +
         " bytes inflated from a " + std::to_string(length) +
         "-byte record (limit: 1032 times the record, at most 64 MiB)");
  }
}

std::string Archive::Prefix() const {
  std::string prefix;
  int found = 0;
  for (const auto& [name, e] : entries_) {
    const size_t n = name.size();
    if (n >= 8 && name.compare(n - 8, 8, "data.pkl") == 0 && name.find('/') == n - 9) {
      prefix = name.substr(0, n - 8);
      ++found;
    }
  }
  if (found != 1) Fail("has no single <name>/data.pkl (not a torch.save archive)");
  return prefix;
}

std::string Archive::ReadSmall(const std::string& name, size_t limit) {
  const ZipEntry& e = Get(name);
  if (e.size > limit) {
    Fail("entry " + name + " claims " + std::to_string(e.size) + " bytes (limit " +
         std::to_string(limit) + ")");
  }
  File f = Open(name, e);
  std::string out(e.size, '\0');
  const zip_int64_t n = out.empty() ? 0 : zip_fread(f.get(), out.data(), out.size());
  char extra;
  const zip_int64_t tail = n < 0 ? -1 : zip_fread(f.get(), &extra, 1);  // the end: checks
  if (n < 0 || tail < 0) FailRead(name, f.get());
  if (static_cast<uint64_t>(n) != out.size()) Fail("entry " + name + " is truncated");
  if (tail != 0) {
    Fail("entry " + name + " holds more bytes than the " + std::to_string(e.size) + " it claims");
  }
  // libzip checks nothing of an entry of no bytes: its CRC-32 must still be that of nothing.
  if (e.size == 0 && e.crc != 0) Fail("entry " + name + " fails its CRC-32");
  return out;
}

uint64_t Archive::DataOffset(const std::string& name) {
  const ZipEntry& e = Get(name);
  if (e.method != 0) {
    throw UnsupportedError(what_ + " entry " + name + " is compressed (method " +
                           std::to_string(e.method) +
                           "); torch.save stores tensor data uncompressed");
  }
  CheckStored(name, e);
  if (e.size == 0) return 0;  // nothing is read from it
  File f = Open(name, e);
  window_.last_read = window_.size;
  char first;
  if (zip_fread(f.get(), &first, 1) != 1) FailRead(name, f.get());
  const uint64_t pos = window_.last_read;
  if (pos > window_.size || e.size > window_.size - pos) {
    Fail("entry " + name + " lies outside the record");
  }
  // The byte read through libzip is the one at pos: libzip read it there (were it ever to read
  // ahead from elsewhere, this refuses the record rather than read the wrong bytes).
  char at;
  window_.pos = pos;
  window_.Read(&at, 1);
  if (at != first) {
    throw UnsupportedError(what_ + " entry " + name + ": cannot locate its data (libzip " +
                           zip_libzip_version() + " read it from an unexpected place)");
  }
  return pos;
}

void Archive::CheckEntry(const std::string& name) {
  const ZipEntry& e = Get(name);
  if (e.method == 0) {
    // A stored entry (all tensor data): its bytes in large reads straight from the record, not
    // through libzip's (each a ranged GET on s3://).
    const uint64_t at = DataOffset(name), n = e.size;
    std::vector<char> buf(std::min<uint64_t>(n, uint64_t{8} << 20));
    uint32_t crc = 0;
    for (uint64_t pos = 0; pos < n;) {
      const uint64_t k = std::min<uint64_t>(buf.size(), n - pos);
      window_.pos = at + pos;
      window_.Read(buf.data(), k);  // small ones from the cached block, large ones directly
      crc = Crc32(crc, buf.data(), k);
      pos += k;
    }
    if (crc != e.crc) {
      Fail("entry " + name + " fails its CRC-32 (the zip records " + Hex32(e.crc) + ", its " +
           std::to_string(n) + " bytes have " + Hex32(crc) + ")");
    }
    return;
  }
  File f = Open(name, e);
  std::vector<char> buf(1 << 20);
  uint64_t total = 0;
  for (;;) {
    // Never more than one byte past the claim: a deflate stream may inflate to far more.
    const uint64_t want = std::min<uint64_t>(buf.size(), e.size - std::min(total, e.size) + 1);
    const zip_int64_t n = zip_fread(f.get(), buf.data(), want);
    if (n < 0) FailRead(name, f.get(), total);
    if (n == 0) break;  // the end, where libzip checked the CRC-32 and the length
    total += static_cast<uint64_t>(n);
    if (total > e.size) {
      Fail("entry " + name + " holds more bytes than the " + std::to_string(e.size) + " it claims");
    }
  }
  if (total != e.size) {
    Fail("entry " + name + " holds " + std::to_string(total) + " bytes but claims " +
         std::to_string(e.size));
  }
}

void Archive::CheckDirectoryClaims() {
  constexpr uint64_t kTail = 65536 + 22 + 20;  // libzip's CDBUFSIZE
  const uint64_t n = std::min(window_.size, kTail), start = window_.size - n;
  std::vector<unsigned char> tail(n);
  auto read = [&](uint64_t at, void* dst, uint64_t k) {
    window_.pos = at;
    try {
      window_.Read(dst, k);
    } catch (...) {
      window_.error = std::current_exception();
      Fail("cannot be read");
    }
  };
  read(start, tail.data(), n);
  uint64_t claimed = 0;
  for (uint64_t i = 0; i + 22 <= n; ++i) {
    const unsigned char* e = tail.data() + i;
    if (std::memcmp(e, "PK\x05\x06", 4) != 0) continue;
    uint64_t entries = Le(e + 10, 2), size = Le(e + 12, 4), offset = Le(e + 16, 4);
    uint64_t end = start + i;  // the directory must end before this
    if (i >= 20 && std::memcmp(e - 20, "PK\x06\x07", 4) == 0) {
      const uint64_t at = Le(e - 20 + 8, 8);  // the zip64 end record
      unsigned char r[56];
      if (at > end - 20 || end - 20 - at < sizeof(r)) continue;  // before the locator
      read(at, r, sizeof(r));
      if (std::memcmp(r, "PK\x06\x06", 4) != 0) continue;
      entries = Le(r + 32, 8), size = Le(r + 40, 8), offset = Le(r + 48, 8);
    }
    if (size == 0 || offset > end || size > end - offset) continue;  // libzip stops there
    unsigned char sig[4];
    read(offset, sig, 4);
    if (std::memcmp(sig, "PK\x01\x02", 4) != 0) continue;
    if (entries > max_entries_ && entries <= size / 46) {
      Fail("claims " + std::to_string(entries) + " entries (limit " + std::to_string(max_entries_) +
           ")");
    }
    claimed += size;
    if (claimed > max_directory_bytes_) {
      Fail("has central directories of more than " + std::to_string(max_directory_bytes_) +
           " bytes");
    }
  }
}

void Archive::CheckStored(const std::string& name, const ZipEntry& e) const {
  if (e.encrypted) {
    throw UnsupportedError(what_ + " entry " + name + " is encrypted");
  }
  if (e.comp_size != e.size) {
    Fail("entry " + name + " is stored in " + std::to_string(e.comp_size) + " bytes but claims " +
         std::to_string(e.size));
  }
}

Archive::File Archive::Open(const std::string& name, const ZipEntry& e) {
  if (e.encrypted) throw UnsupportedError(what_ + " entry " + name + " is encrypted");
  if (e.method != 0 && e.method != 8) {
    throw UnsupportedError(what_ + " entry " + name + " is compressed with zip method " +
                           std::to_string(e.method) + " (torch.save stores or deflates)");
  }
  if (e.method == 0) CheckStored(name, e);
  File f(zip_fopen_index(zip_.get(), e.index, 0));
  if (!f) {
    Fail("entry " + name + " cannot be opened (" + zip_error_strerror(zip_get_error(zip_.get())) +
         ")");
  }
  return f;
}

void Archive::FailRead(const std::string& name, zip_file_t* f, uint64_t total) const {
  zip_error_t* err = zip_file_get_error(f);
  switch (zip_error_code_zip(err)) {
    case ZIP_ER_CRC:
      Fail("entry " + name + " fails its CRC-32");
    case ZIP_ER_INCONS:
    case ZIP_ER_EOF:
      Fail("entry " + name + " is truncated (" +
           (total ? "holds " + std::to_string(total) + " bytes, " : std::string()) +
           "fewer than it claims)");
    default:
      Fail("entry " + name + " cannot be read (libzip: " + zip_error_strerror(err) + ")");
  }
}

void ZipWriter::AddSmall(const std::string& name, std::string_view content) {
  Entry e{name, Crc32(0, content.data(), content.size()), content.size(), Pos(), false};
  LocalHeader(e, 0);
  out_.Append(content.data(), content.size());
  Written(e);
}

void ZipWriter::AddStreamed(const std::string& name, uint64_t size,
                            const std::function<uint32_t()>& write) {
  Entry e{name, 0, size, Pos(), true};
  const uint64_t data_at = Pos() + 30 + name.size();
  uint64_t pad = (64 - (data_at + 4) % 64) % 64;
  LocalHeader(e, pad + 4);
  e.crc = write();
  std::string d;
  Put32(d, 0x08074b50);
  Put32(d, e.crc);
  if (size >= 0xffffffffu) {
    Put64(d, size);
    Put64(d, size);
  } else {
    Put32(d, static_cast<uint32_t>(size));
    Put32(d, static_cast<uint32_t>(size));
  }
  out_.Append(d.data(), d.size());
  Written(e);
}

void ZipWriter::AddSerializationId() {
  std::unordered_set<std::string> names;
  for (const Entry& e : entries_) names.insert(e.name.substr(e.name.find('/') + 1));
  size_t name_hash = 0;
  for (const std::string& name : names) {
    name_hash = HashCombine(name_hash, std::hash<std::string>{}(name));
  }
  char id[41];
  std::snprintf(id, sizeof(id), "%020zu%020zu", name_hash, crc_hash_);
  AddSmall("archive/.data/serialization_id", std::string_view(id, 40));
}

uint64_t ZipWriter::Finish() {
  const uint64_t cd_at = Pos();
  std::string cd;
  bool zip64 = false;
  for (const Entry& e : entries_) {
    const bool big_size = e.size >= 0xffffffffu;
    const bool big_off = e.offset >= 0xffffffffu;
    std::string extra;
    if (big_size || big_off) {
      zip64 = true;
      std::string body;
      if (big_size) {
        Put64(body, e.size);
        Put64(body, e.size);
      }
      if (big_off) Put64(body, e.offset);
      Put16(extra, 0x0001);
      Put16(extra, static_cast<uint16_t>(body.size()));
      extra += body;
    }
    Put32(cd, 0x02014b50);
    Put16(cd, big_size || big_off ? 45 : 20);  // made by
    Put16(cd, big_size || big_off ? 45 : 20);  // needed
    Put16(cd, e.descriptor ? 0x0008 : 0);
    Put16(cd, 0);     // stored
    Put16(cd, 0);     // time
    Put16(cd, 0x21);  // date: 1980-01-01
    Put32(cd, e.crc);
    Put32(cd, big_size ? 0xffffffffu : static_cast<uint32_t>(e.size));
    Put32(cd, big_size ? 0xffffffffu : static_cast<uint32_t>(e.size));
    Put16(cd, static_cast<uint16_t>(e.name.size()));
    Put16(cd, static_cast<uint16_t>(extra.size()));
    Put16(cd, 0);  // comment
    Put16(cd, 0);  // disk
    Put16(cd, 0);  // internal attributes
    Put32(cd, 0);  // external attributes
    Put32(cd, big_off ? 0xffffffffu : static_cast<uint32_t>(e.offset));
    cd += e.name;
    cd += extra;
  }
  const uint64_t cd_size = cd.size();
  if (cd_at >= 0xffffffffu) zip64 = true;
  std::string end;
  if (zip64) {
    const uint64_t rec_at = cd_at + cd_size;
    Put32(end, 0x06064b50);
    Put64(end, 44);
    Put16(end, 45);
    Put16(end, 45);
    Put32(end, 0);
    Put32(end, 0);
    Put64(end, entries_.size());
    Put64(end, entries_.size());
    Put64(end, cd_size);
    Put64(end, cd_at);
    Put32(end, 0x07064b50);  // locator
    Put32(end, 0);
    Put64(end, rec_at);
    Put32(end, 1);
  }
  Put32(end, 0x06054b50);
  Put16(end, 0);
  Put16(end, 0);
  Put16(end, static_cast<uint16_t>(entries_.size()));
  Put16(end, static_cast<uint16_t>(entries_.size()));
  Put32(end, cd_size >= 0xffffffffu ? 0xffffffffu : static_cast<uint32_t>(cd_size));
  Put32(end, zip64 ? 0xffffffffu : static_cast<uint32_t>(cd_at));
  Put16(end, 0);
  cd += end;
  out_.Append(cd.data(), cd.size());
  return Pos();
}

void ZipWriter::LocalHeader(const Entry& e, uint64_t extra_len) {
  std::string h;
  Put32(h, 0x04034b50);
  Put16(h, e.descriptor && e.size >= 0xffffffffu ? 45 : 20);
  Put16(h, e.descriptor ? 0x0008 : 0);
  Put16(h, 0);
  Put16(h, 0);
  Put16(h, 0x21);
  // With a data descriptor the CRC and sizes follow the data (APPNOTE 4.4.4).
  Put32(h, e.descriptor ? 0 : e.crc);
  Put32(h, e.descriptor ? 0 : static_cast<uint32_t>(e.size));
  Put32(h, e.descriptor ? 0 : static_cast<uint32_t>(e.size));
  Put16(h, static_cast<uint16_t>(e.name.size()));
  Put16(h, static_cast<uint16_t>(extra_len));
  h += e.name;
  if (extra_len) {
    Put16(h, 0x4246);  // "FB"
    Put16(h, static_cast<uint16_t>(extra_len - 4));
    h.append(extra_len - 4, 'Z');
  }
  out_.Append(h.data(), h.size());
}

}  // namespace dcp::torch_internal
