// Settings of one storage backend as strings: from a URI's query
// (`s3://bucket/ckpt?part_size_mib=16&parts_in_flight=8`) or StorageOptions::backend. A backend
// reads the keys it knows through BackendOptionReader and calls Done(), which refuses every key
// it did not read: a misspelt option fails instead of being ignored.
//
// Not thread-safe; used while a backend is opened.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>

namespace dcp {

using BackendOptionMap = std::map<std::string, std::string>;

class BackendOptionReader {
 public:
  /// `backend` names the backend in messages ("s3://").
  BackendOptionReader(std::string backend, const BackendOptionMap& options);

  std::optional<std::string> String(const std::string& key);
  /// "1", "true", "yes", "on" / "0", "false", "no", "off"; InvalidArgumentError otherwise.
  std::optional<bool> Bool(const std::string& key);
  /// A decimal integer in [min, max]; InvalidArgumentError naming the key otherwise.
  std::optional<int64_t> Int(const std::string& key, int64_t min, int64_t max);
  /// InvalidArgumentError naming every key that was not read, and the keys that were asked for.
  void Done() const;

 private:
  std::optional<std::string> Take(const std::string& key);
  std::string backend_;
  const BackendOptionMap& options_;
  std::set<std::string> asked_;
};

}  // namespace dcp
