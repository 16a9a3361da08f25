// The input of the fuzz targets that take a document with the files it names: the document's
// bytes, then for each file a separator line "\n==> NAME\n" followed by the file's bytes.
#pragma once

#include <map>
#include <string>
#include <string_view>

namespace dcp::fuzz {

inline constexpr std::string_view kFileSeparator = "\n==> ";

// Splits `in` into the document (returned in *document) and its files, name -> bytes. Names a
// store itself refuses (empty, over 200 bytes, with '/' or NUL, "." and "..") are dropped: they
// are not what these targets are about. A later file of the same name wins.
inline std::map<std::string, std::string_view> SplitFiles(std::string_view in,
                                                          std::string_view* document) {
  size_t at = in.find(kFileSeparator);
  *document = in.substr(0, at);
  std::map<std::string, std::string_view> files;
  while (at != std::string_view::npos) {
    const size_t name_begin = at + kFileSeparator.size();
    const size_t eol = in.find('\n', name_begin);
    if (eol == std::string_view::npos) break;
    at = in.find(kFileSeparator, eol + 1);
    const std::string_view body =
        in.substr(eol + 1, at == std::string_view::npos ? at : at - eol - 1);
    const std::string name(in.substr(name_begin, eol - name_begin));
    if (name.empty() || name.size() > 200 || name.find('/') != std::string::npos ||
        name.find('\0') != std::string::npos || name == "." || name == "..") {
      continue;
    }
    files[name] = body;
  }
  return files;
}

}  // namespace dcp::fuzz
