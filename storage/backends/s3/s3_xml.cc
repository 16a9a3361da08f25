// The s3:// backend's reading of S3's XML answers, with tinyxml2 (Debian's libtinyxml2-dev):
// small, no dependencies, no DTD or external entities (so no entity expansion to bound), and a
// nesting limit of its own.
#include "dcp/storage/backends/s3/s3_xml.h"

#include <tinyxml2.h>

#include <algorithm>

#include "dcp/proto/error.h"

namespace dcp::s3 {

namespace {

using tinyxml2::XMLDocument;
using tinyxml2::XMLElement;

// At most `n` bytes of `s`, for messages that quote the server.
std::string Clip(std::string s, size_t n = 64) {
  if (s.size() > n) s = s.substr(0, n) + "...";
  return s;
}

// The root element of `body` parsed into `doc` when it is named `root` (any name when null);
// otherwise null, with why not in `why`.
const XMLElement* Root(XMLDocument& doc, std::string_view body, const char* root,
                       std::string* why) {
  if (body.size() > kMaxXmlBytes) {
    *why = "it is " + std::to_string(body.size()) + " bytes, more than the " +
           std::to_string(kMaxXmlBytes) + " an answer may have";
    return nullptr;
  }
  const size_t tags = static_cast<size_t>(std::count(body.begin(), body.end(), '<'));
  if (tags > kMaxXmlTags) {
    *why = "it has " + std::to_string(tags) + " tags, more than the " +
           std::to_string(kMaxXmlTags) + " an answer may have";
    return nullptr;
  }
  if (doc.Parse(body.data(), body.size()) != tinyxml2::XML_SUCCESS) {
    // The error's name and line only: tinyxml2's full text quotes the offending element's name.
    const int line = doc.ErrorLineNum();
    *why = std::string("it is not well-formed XML: ") + doc.ErrorName() +
           (line > 0 ? " at line " + std::to_string(line) : "");
    return nullptr;
  }
  const XMLElement* e = doc.RootElement();
  if (e == nullptr) {
    *why = "it has no root element";
    return nullptr;
  }
  if (root != nullptr && std::string_view(e->Name()) != root) {
    *why = "its root element is <" + Clip(e->Name()) + ">, not <" + root + ">";
    return nullptr;
  }
  return e;
}

// The decoded text of `parent`'s first child element `name`; "" when it has none.
std::string ChildText(const XMLElement& parent, const char* name) {
  const XMLElement* e = parent.FirstChildElement(name);
  const char* text = e == nullptr ? nullptr : e->GetText();
  return text == nullptr ? std::string() : std::string(text);
}

[[noreturn]] void ListingFailed(const std::string& what, const char* root, const std::string& why) {
  throw CorruptionError("listing " + what + ": the server's answer is not a " + root + " (" + why +
                        "); the listing was abandoned");
}

}  // namespace

S3ErrorBody ParseS3Error(std::string_view body) {
  XMLDocument doc;
  std::string why;
  const XMLElement* e = Root(doc, body, "Error", &why);
  if (e == nullptr) return {};
  return {ChildText(*e, "Code"), ChildText(*e, "Message")};
}

bool IsS3ErrorBody(std::string_view body) {
  if (body.find_first_not_of(" \t\r\n") == std::string_view::npos) return false;
  XMLDocument doc;
  std::string why;
  const XMLElement* e = Root(doc, body, nullptr, &why);
  return e == nullptr || std::string_view(e->Name()) == "Error";
}

std::string ParseInitiateMultipartUpload(std::string_view body, const std::string& what) {
  XMLDocument doc;
  std::string why;
  const XMLElement* e = Root(doc, body, "InitiateMultipartUploadResult", &why);
  const std::string id = e == nullptr ? std::string() : ChildText(*e, "UploadId");
  if (id.empty()) {
    throw IoError("s3: CreateMultipartUpload of " + what + " returned no UploadId" +
                      (why.empty() ? "" : " (" + why + ")"),
                  true);
  }
  return id;
}

ListObjectsPage ParseListObjectsV2(std::string_view body, const std::string& what) {
  static constexpr const char* kRoot = "ListBucketResult";
  XMLDocument doc;
  std::string why;
  const XMLElement* root = Root(doc, body, kRoot, &why);
  if (root == nullptr) ListingFailed(what, kRoot, why);
  ListObjectsPage page;
  for (const XMLElement* c = root->FirstChildElement("Contents"); c != nullptr;
       c = c->NextSiblingElement("Contents")) {
    page.keys.push_back(ChildText(*c, "Key"));
    // <Size>: decimal digits, or unknown (-1) when it is anything else.
    const std::string size = ChildText(*c, "Size");
    int64_t n = size.empty() || size.size() > 18 ? -1 : 0;
    for (char ch : size) {
      if (n < 0) break;
      n = ch >= '0' && ch <= '9' ? n * 10 + (ch - '0') : -1;
    }
    page.sizes.push_back(n);
  }
  page.truncated = ChildText(*root, "IsTruncated") == "true";
  page.next_token = ChildText(*root, "NextContinuationToken");
  return page;
}

ListUploadsPage ParseListMultipartUploads(std::string_view body, const std::string& what) {
  static constexpr const char* kRoot = "ListMultipartUploadsResult";
  XMLDocument doc;
  std::string why;
  const XMLElement* root = Root(doc, body, kRoot, &why);
  if (root == nullptr) ListingFailed(what, kRoot, why);
  ListUploadsPage page;
  for (const XMLElement* u = root->FirstChildElement("Upload"); u != nullptr;
       u = u->NextSiblingElement("Upload")) {
    page.keys.push_back(ChildText(*u, "Key"));
    page.upload_ids.push_back(ChildText(*u, "UploadId"));
  }
  page.truncated = ChildText(*root, "IsTruncated") == "true";
  page.next_key_marker = ChildText(*root, "NextKeyMarker");
  page.next_upload_id_marker = ChildText(*root, "NextUploadIdMarker");
  return page;
}

std::vector<DeleteFailure> ParseDeleteResult(std::string_view body, const std::string& what) {
  static constexpr const char* kRoot = "DeleteResult";
  XMLDocument doc;
  std::string why;
  const XMLElement* root = Root(doc, body, kRoot, &why);
  if (root == nullptr) {
    throw CorruptionError("removing objects under " + what + ": the server's answer is not a " +
                          kRoot + " (" + why + ")");
  }
  std::vector<DeleteFailure> failed;
  for (const XMLElement* e = root->FirstChildElement("Error"); e != nullptr;
       e = e->NextSiblingElement("Error")) {
    failed.push_back({ChildText(*e, "Key"), ChildText(*e, "Code"), ChildText(*e, "Message")});
  }
  return failed;
}

}  // namespace dcp::s3
