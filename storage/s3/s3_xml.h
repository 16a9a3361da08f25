// The s3:// backend's reading of S3's XML answers (internal).
#pragma once

#include <cstddef>
#include <string>

namespace dcp::s3 {

// The text of <tag>...</tag> from `pos` on; npos-safe. S3's XML is flat enough for this.
std::string XmlValue(const std::string& xml, const std::string& tag, size_t* pos = nullptr);

std::string XmlUnescape(const std::string& s);

}  // namespace dcp::s3
