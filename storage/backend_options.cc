#include "dcp/storage/registry.h"

#include <charconv>

#include "dcp/proto/error.h"

namespace dcp {

BackendOptionReader::BackendOptionReader(std::string backend, const BackendOptionMap& options)
    : backend_(std::move(backend)), options_(options) {}

std::optional<std::string> BackendOptionReader::Take(const std::string& key) {
  asked_.insert(key);
  auto it = options_.find(key);
  if (it == options_.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string> BackendOptionReader::String(const std::string& key) { return Take(key); }

std::optional<bool> BackendOptionReader::Bool(const std::string& key) {
  auto v = Take(key);
  if (!v) return std::nullopt;
  if (*v == "1" || *v == "true" || *v == "yes" || *v == "on") return true;
  if (*v == "0" || *v == "false" || *v == "no" || *v == "off") return false;
  throw InvalidArgumentError(backend_ + " option " + key + "='" + *v +
                             "' is not a boolean (use 1/0, true/false, yes/no, on/off)");
}

std::optional<int64_t> BackendOptionReader::Int(const std::string& key, int64_t min, int64_t max) {
  auto v = Take(key);
  if (!v) return std::nullopt;
  int64_t x = 0;
  const char* end = v->data() + v->size();
  auto [p, ec] = std::from_chars(v->data(), end, x);
  if (ec != std::errc() || p != end || x < min || x > max) {
    throw InvalidArgumentError(backend_ + " option " + key + "='" + *v +
                               "' must be an integer from " + std::to_string(min) + " to " +
                               std::to_string(max));
  }
  return x;
}

void BackendOptionReader::Done() const {
  std::string unknown, known;
  for (const auto& [key, value] : options_) {
    if (!asked_.count(key)) unknown += (unknown.empty() ? "" : ", ") + key;
  }
  if (unknown.empty()) return;
  for (const auto& key : asked_) known += (known.empty() ? "" : ", ") + key;
  throw InvalidArgumentError("unknown " + backend_ + " option(s): " + unknown +
                             (known.empty() ? " (it takes none)" : " (known: " + known + ")"));
}

}  // namespace dcp
