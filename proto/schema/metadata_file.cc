// The metadata file: the envelope (magic, format version, CRC32C, length) around the protobuf
// payload, and the payload size limit a save checks before committing.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <string>

#include "dcp/proto/checksum.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/proto/schema/codec_internal.h"

namespace dcp {

namespace {

constexpr char kMagic[8] = {'D', 'C', 'P', 'M', 'E', 'T', 'A', '1'};

void PutLe(std::string* out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t GetLe(const char* p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i)
    v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

std::atomic<uint64_t> g_metadata_limit_for_testing{0};

}  // namespace

uint64_t MetadataPayloadLimit() {
  const uint64_t lowered = g_metadata_limit_for_testing.load();
  return lowered != 0 ? lowered : static_cast<uint64_t>(std::numeric_limits<int>::max());
}

void SetMetadataPayloadLimitForTesting(uint64_t bytes) { g_metadata_limit_for_testing = bytes; }

void CheckMetadataPayloadSize(uint64_t bytes, std::string_view where) {
  const uint64_t limit = MetadataPayloadLimit();
  if (bytes <= limit) return;
  throw InvalidArgumentError(
      std::string(where) + ": the checkpoint's metadata would be " + std::to_string(bytes) +
      " bytes (" + std::to_string(bytes >> 20) + " MiB), above the " + std::to_string(limit) +
      "-byte limit of protobuf, so no reader could decode it; nothing was committed. Save fewer, "
      "larger entries or chunks (e.g. fewer ranks per tensor, or tensors merged)");
}

std::string EncodeMetadataFile(const Metadata& md) {
  // The envelope is written in front of the payload in place: no second copy of it.
  std::string out = internal::EncodeMetadataAfter(md, kMetadataHeaderSize);
  const size_t n = out.size() - kMetadataHeaderSize;
  std::string head(kMagic, sizeof(kMagic));
  PutLe(&head, md.format_version, 4);
  PutLe(&head, Crc32c(0, out.data() + kMetadataHeaderSize, n), 4);
  PutLe(&head, n, 8);
  if (head.size() != kMetadataHeaderSize) throw InternalError("metadata envelope size");
  out.replace(0, kMetadataHeaderSize, head);
  return out;
}

void CheckMetadataFileHeader(std::string_view bytes, uint64_t file_size, std::string_view source) {
  const std::string src(source);
  if (bytes.size() < kMetadataHeaderSize || std::memcmp(bytes.data(), kMagic, 4) != 0) {
    throw CorruptionError(src + ": not a dcp metadata file (bad magic or too short: " +
                          std::to_string(file_size) + " bytes)");
  }
  if (std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    throw UnsupportedError(src + ": unsupported metadata envelope '" +
                           std::string(bytes.substr(0, 8)) + "'");
  }
  const uint32_t version = static_cast<uint32_t>(GetLe(bytes.data() + 8, 4));
  const uint64_t len = GetLe(bytes.data() + 16, 8);
  if (version > kFormatVersion) {
    throw UnsupportedError(src + ": checkpoint format version " + std::to_string(version) +
                           " is newer than this library's " + std::to_string(kFormatVersion) +
                           "; upgrade dcp to read it");
  }
  if (file_size < kMetadataHeaderSize || len != file_size - kMetadataHeaderSize) {
    throw CorruptionError(
        src + ": metadata payload length " + std::to_string(len) + " does not match the file (" +
        std::to_string(file_size - std::min<uint64_t>(file_size, kMetadataHeaderSize)) +
        " bytes follow the header); the file is truncated or damaged");
  }
}

Metadata DecodeMetadataFile(std::string_view bytes, std::string_view source) {
  const std::string src(source);
  CheckMetadataFileHeader(bytes, bytes.size(), source);
  const uint32_t version = static_cast<uint32_t>(GetLe(bytes.data() + 8, 4));
  const uint32_t crc = static_cast<uint32_t>(GetLe(bytes.data() + 12, 4));
  const std::string_view payload = bytes.substr(kMetadataHeaderSize);
  const uint32_t actual = Crc32c(0, payload.data(), payload.size());
  if (actual != crc) {
    throw CorruptionError(src + ": metadata checksum mismatch (stored " + std::to_string(crc) +
                          ", computed " + std::to_string(actual) + "); the file is damaged");
  }
  Metadata md = DecodeMetadata(payload, source);
  if (version == 0 || md.format_version != version) {
    throw CorruptionError(src + ": the header says format version " + std::to_string(version) +
                          " but the payload says " + std::to_string(md.format_version));
  }
  ValidateMetadata(md, source);
  return md;
}

}  // namespace dcp
