// Store's defaults: what a backend that overrides only the seven required methods gets.
#include "dcp/storage/store.h"

#include <algorithm>

#include "dcp/proto/error.h"
#include "dcp/proto/executor.h"

namespace dcp {

std::string Store::ReadAll(
    const std::string& name, uint64_t max_bytes,
    const std::function<void(std::string_view head, uint64_t size)>& check_head) {
  constexpr uint64_t kHead = uint64_t{1} << 20;
  uint64_t size = 0;
  std::string bytes = ReadPrefix(name, std::min(kHead, max_bytes), &size);
  if (check_head) check_head(bytes, size);
  if (size > max_bytes) {
    throw CorruptionError("'" + uri() + "/" + name + "' has " + std::to_string(size) +
                          " bytes, over the limit of " + std::to_string(max_bytes) +
                          " for what it holds; it was not read");
  }
  if (bytes.size() >= size) return bytes;
  auto in = OpenKnownSize(name, size);
  constexpr uint64_t kPiece = uint64_t{64} << 20;
  for (uint64_t at = bytes.size(); at < size;) {
    const uint64_t n = std::min(kPiece, size - at);
    bytes.resize(at + n);
    in->ReadAt(at, bytes.data() + at, n);
    at += n;
  }
  return bytes;
}

// ReadAt in steps, after the hint that the whole range is coming (store.h).
void ReadableObject::ReadAtStreaming(uint64_t offset, void* dst, size_t n, size_t step,
                                     const std::function<void(size_t, size_t)>& landed) {
  step = std::max<size_t>(step, 1);
  if (n > step) Prefetch(offset, n);
  char* p = static_cast<char*>(dst);
  for (size_t pos = 0; pos < n; pos += step) {
    const size_t k = std::min(step, n - pos);
    ReadAt(offset + pos, p + pos, k);
    landed(pos, k);
  }
}

void ReadableObject::ReadManyStreaming(const std::vector<ReadTarget>& targets, size_t step,
                                       const std::function<void(size_t, size_t, size_t)>& landed) {
  for (size_t t = 0; t < targets.size(); ++t) {
    ReadAtStreaming(targets[t].offset, targets[t].dst, targets[t].n, step,
                    [&](size_t pos, size_t len) { landed(t, pos, len); });
  }
}

std::unique_ptr<ReadableObject> Store::OpenKnownSize(const std::string& name, uint64_t) {
  return Open(name);
}

std::string Store::ReadPrefix(const std::string& name, uint64_t max_bytes, uint64_t* size) {
  auto obj = Open(name);
  *size = obj->size();
  std::string out(static_cast<size_t>(std::min(*size, max_bytes)), '\0');
  obj->ReadAt(0, out.data(), out.size());
  return out;
}

std::optional<std::vector<std::pair<std::string, uint64_t>>> Store::ListSizes(size_t) {
  return std::nullopt;
}

void Store::RemoveMany(const std::vector<std::string>& names) {
  std::vector<std::exception_ptr> errors(names.size());
  ParallelFor(
      names.size(),
      [&](size_t i) {
        try {
          Remove(names[i]);
        } catch (...) {
          errors[i] = std::current_exception();
        }
      },
      std::min<size_t>(std::max<size_t>(names.size(), 1), 16));
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// No conditional create by default: the writer lock is the exclusion (store.h).
void Store::PublishNew(const std::string& name, std::string_view bytes) {
  PublishAtomically(name, bytes);
}

// No versions by default: the writer lock is the exclusion (store.h).
std::optional<uint64_t> Store::SizeAndVersion(const std::string& name, std::string* version) {
  if (version != nullptr) version->clear();
  return Size(name);
}

void Store::PublishReplacing(const std::string& name, std::string_view bytes, const std::string&) {
  PublishAtomically(name, bytes);
}

// No primitive by default: the writer then runs without exclusion (documented in store.h).
std::unique_ptr<StoreLock> Store::TryLock(const std::string&) { return nullptr; }

std::unique_ptr<StoreLock> Store::TryLockOver(const std::string& holder, const std::string&) {
  return TryLock(holder);
}

// No write of these backends outlives its process unseen (store.h).
std::vector<std::string> Store::ListIncomplete() { return {}; }
void Store::DiscardIncomplete(const std::string&) {}

}  // namespace dcp
