// AWS SigV4, kept small and in one place so that it can be checked against AWS's published
// vectors. The only subtle points are in the canonical form:
//  * S3 signs the path exactly as sent (other services normalise and double-encode it), so the
//    caller encodes object keys once (UriEncode(key, keep_slash=true)) and we take it as is.
//  * Query names and values are encoded with '/' as %2F and sorted by encoded name.
//  * Header values are trimmed and runs of spaces inside collapse to one.
#include "dcp/storage/backends/s3/s3_sigv4.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/sha.h>

#include <algorithm>
#include <cctype>
#include <ctime>

#include "dcp/proto/error.h"

namespace dcp::sigv4 {

std::string Hex(std::string_view raw) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  out.reserve(raw.size() * 2);
  for (unsigned char c : raw) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

std::string Md5Base64(std::string_view data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  if (EVP_Digest(data.data(), data.size(), md, &n, EVP_md5(), nullptr) != 1) {
    throw InternalError("s3: MD5 failed");
  }
  unsigned char out[4 * ((EVP_MAX_MD_SIZE + 2) / 3) + 1];
  const int len = EVP_EncodeBlock(out, md, static_cast<int>(n));
  return std::string(reinterpret_cast<const char*>(out), static_cast<size_t>(len));
}

std::string Sha256Hex(std::string_view data) {
  unsigned char md[SHA256_DIGEST_LENGTH];
  if (::SHA256(reinterpret_cast<const unsigned char*>(data.data()), data.size(), md) == nullptr) {
    throw InternalError("SHA256 failed (libcrypto)");
  }
  return Hex(std::string_view(reinterpret_cast<const char*>(md), sizeof md));
}

std::string HmacSha256(std::string_view key, std::string_view data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (::HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
             reinterpret_cast<const unsigned char*>(data.data()), data.size(), md,
             &len) == nullptr) {
    throw InternalError("HMAC-SHA256 failed (libcrypto)");
  }
  return std::string(reinterpret_cast<const char*>(md), len);
}

std::string UriEncode(std::string_view s, bool keep_slash) {
  static const char* digits = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size());
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~' ||
        (c == '/' && keep_slash)) {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(digits[c >> 4]);
      out.push_back(digits[c & 15]);
    }
  }
  return out;
}

std::string CanonicalQuery(const std::vector<std::pair<std::string, std::string>>& query) {
  std::vector<std::pair<std::string, std::string>> enc;
  enc.reserve(query.size());
  for (const auto& [k, v] : query) enc.emplace_back(UriEncode(k, false), UriEncode(v, false));
  std::sort(enc.begin(), enc.end());
  std::string out;
  for (const auto& [k, v] : enc) {
    if (!out.empty()) out += '&';
    out += k;
    out += '=';
    out += v;
  }
  return out;
}

namespace {

std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

// Trim, and collapse inner runs of spaces to one (the canonical header value).
std::string CanonicalValue(const std::string& v) {
  std::string out;
  bool space = false;
  for (char c : v) {
    if (c == ' ' || c == '\t') {
      space = !out.empty();
      continue;
    }
    if (space) out += ' ';
    space = false;
    out += c;
  }
  return out;
}

// Lowercased names with canonical values, sorted by name; repeated names join with ','.
std::vector<std::pair<std::string, std::string>> CanonicalHeaders(const Request& r) {
  std::vector<std::pair<std::string, std::string>> h;
  for (const auto& [k, v] : r.headers) {
    const std::string name = Lower(k);
    const std::string value = CanonicalValue(v);
    auto it = std::find_if(h.begin(), h.end(), [&](const auto& p) { return p.first == name; });
    if (it != h.end()) {
      it->second += "," + value;
    } else {
      h.emplace_back(name, value);
    }
  }
  std::sort(h.begin(), h.end());
  return h;
}

}  // namespace

std::string SignedHeaders(const Request& request) {
  std::string out;
  for (const auto& [k, v] : CanonicalHeaders(request)) {
    if (!out.empty()) out += ';';
    out += k;
  }
  return out;
}

std::string CanonicalRequest(const Request& request) {
  std::string out = request.method + "\n" +
                    (request.encoded_path.empty() ? "/" : request.encoded_path) + "\n" +
                    CanonicalQuery(request.query) + "\n";
  for (const auto& [k, v] : CanonicalHeaders(request)) out += k + ":" + v + "\n";
  out += "\n" + SignedHeaders(request) + "\n" + request.payload_hash;
  return out;
}

std::string Scope(const std::string& date, const std::string& region, const std::string& service) {
  return date + "/" + region + "/" + service + "/aws4_request";
}

std::string StringToSign(const std::string& canonical_request, const std::string& amz_date,
                         const std::string& scope) {
  return "AWS4-HMAC-SHA256\n" + amz_date + "\n" + scope + "\n" + Sha256Hex(canonical_request);
}

std::string SigningKey(const std::string& secret, const std::string& date,
                       const std::string& region, const std::string& service) {
  const std::string k_date = HmacSha256("AWS4" + secret, date);
  const std::string k_region = HmacSha256(k_date, region);
  const std::string k_service = HmacSha256(k_region, service);
  return HmacSha256(k_service, "aws4_request");
}

std::string Authorization(const Request& request, const Credentials& credentials,
                          const std::string& region, const std::string& service,
                          const std::string& amz_date) {
  const std::string date = amz_date.substr(0, 8);
  const std::string scope = Scope(date, region, service);
  const std::string to_sign = StringToSign(CanonicalRequest(request), amz_date, scope);
  const std::string signature =
      Hex(HmacSha256(SigningKey(credentials.secret_access_key, date, region, service), to_sign));
  return "AWS4-HMAC-SHA256 Credential=" + credentials.access_key_id + "/" + scope +
         ", SignedHeaders=" + SignedHeaders(request) + ", Signature=" + signature;
}

std::string AmzDateNow() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%dT%H%M%SZ", &tm);
  return buf;
}

}  // namespace dcp::sigv4
