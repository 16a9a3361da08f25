// The s3:// backend's reading of S3's XML answers.
#include "dcp/storage/s3/s3_xml.h"

#include <cstdlib>

namespace dcp::s3 {

std::string XmlValue(const std::string& xml, const std::string& tag, size_t* pos) {
  const std::string open = "<" + tag + ">", close = "</" + tag + ">";
  const size_t from = pos ? *pos : 0;
  const size_t a = xml.find(open, from);
  if (a == std::string::npos) {
    if (pos) *pos = std::string::npos;
    return {};
  }
  const size_t b = xml.find(close, a + open.size());
  if (b == std::string::npos) {
    if (pos) *pos = std::string::npos;
    return {};
  }
  if (pos) *pos = b + close.size();
  return xml.substr(a + open.size(), b - a - open.size());
}

std::string XmlUnescape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '&') {
      out += s[i];
      continue;
    }
    const size_t semi = s.find(';', i);
    if (semi == std::string::npos) {
      out += s[i];
      continue;
    }
    const std::string ent = s.substr(i + 1, semi - i - 1);
    if (ent == "amp")
      out += '&';
    else if (ent == "lt")
      out += '<';
    else if (ent == "gt")
      out += '>';
    else if (ent == "quot")
      out += '"';
    else if (ent == "apos")
      out += '\'';
    else if (!ent.empty() && ent[0] == '#') {
      const long c = ent.size() > 1 && (ent[1] == 'x' || ent[1] == 'X')
                         ? std::strtol(ent.c_str() + 2, nullptr, 16)
                         : std::strtol(ent.c_str() + 1, nullptr, 10);
      if (c < 0x80) {
        out += static_cast<char>(c);
      } else {  // UTF-8 of the code point (keys are UTF-8)
        if (c < 0x800) {
          out += static_cast<char>(0xC0 | (c >> 6));
        } else {
          if (c < 0x10000) {
            out += static_cast<char>(0xE0 | (c >> 12));
          } else {
            out += static_cast<char>(0xF0 | (c >> 18));
            out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
          }
          out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
        }
        out += static_cast<char>(0x80 | (c & 0x3F));
      }
    } else {
      out += s.substr(i, semi - i + 1);
    }
    i = semi;
  }
  return out;
}

}  // namespace dcp::s3
