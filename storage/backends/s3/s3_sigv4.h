// AWS Signature Version 4 request signing, for the s3:// backend (storage/backends/s3/s3_store.cc).
//
// The one place where requests are signed: the canonical request, the string to sign, the
// signing key and the Authorization header, as AWS specifies them
// (https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_sigv-create-signed-request.html).
// Tested against AWS's published vectors (tests/unit/s3_sigv4_test.cc). HMAC and SHA-256 come
// from OpenSSL (libcrypto).
//
// Pure functions: thread-safe, no I/O, no clock (the caller passes the time). Errors: none but
// std::bad_alloc (and InternalError if libcrypto itself fails).
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dcp::sigv4 {

/// Lowercase hex SHA-256 of `data` (the payload hash; "e3b0c442..." for empty).
std::string Sha256Hex(std::string_view data);
/// Raw (32-byte) HMAC-SHA256 of `data` under `key`.
std::string HmacSha256(std::string_view key, std::string_view data);
/// Lowercase hex of raw bytes.
std::string Hex(std::string_view raw);
/// Base64 of the MD5 of `data`: the Content-MD5 header a multi-object delete must carry.
std::string Md5Base64(std::string_view data);

/// RFC 3986 percent-encoding as SigV4 wants it: unreserved characters (A-Z a-z 0-9 - . _ ~)
/// stay, every other byte becomes %XX (uppercase); '/' stays when `keep_slash` (object keys in
/// a path), becomes %2F otherwise (query names and values).
std::string UriEncode(std::string_view s, bool keep_slash);

struct Request {
  std::string method;  // "GET", "PUT", ...
  /// The path as sent, already percent-encoded (S3: "/" + bucket + "/" + UriEncode(key, true));
  /// S3 signs it as is (no second encoding, no normalisation).
  std::string encoded_path;
  /// Query parameters, not encoded ("uploadId" -> "2~abc"); a flag such as "uploads" has an
  /// empty value. Sorted and encoded by the canonical form.
  std::vector<std::pair<std::string, std::string>> query;
  /// Headers to sign, names in any case (Host and X-Amz-Date must be among them). Values are
  /// trimmed and inner runs of spaces collapsed, as the canonical form requires.
  std::vector<std::pair<std::string, std::string>> headers;
  /// Hex SHA-256 of the body, or "UNSIGNED-PAYLOAD" (S3 only).
  std::string payload_hash;
};

struct Credentials {
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;  // empty unless temporary credentials (x-amz-security-token)
};

/// The canonical query string: names and values encoded, sorted by name then value, "&"-joined.
std::string CanonicalQuery(const std::vector<std::pair<std::string, std::string>>& query);
/// "host;range;x-amz-date": the lowercase names of the signed headers, sorted, ";"-joined.
std::string SignedHeaders(const Request& request);
/// The canonical request (the six lines AWS hashes).
std::string CanonicalRequest(const Request& request);
/// "AWS4-HMAC-SHA256\n<amz_date>\n<scope>\n<hex sha256 of canonical request>".
std::string StringToSign(const std::string& canonical_request, const std::string& amz_date,
                         const std::string& scope);
/// "<yyyymmdd>/<region>/<service>/aws4_request".
std::string Scope(const std::string& date, const std::string& region, const std::string& service);
/// The derived key: HMAC chain "AWS4"+secret -> date -> region -> service -> "aws4_request".
std::string SigningKey(const std::string& secret, const std::string& date,
                       const std::string& region, const std::string& service);
/// The value of the Authorization header for `request` signed at `amz_date`
/// ("yyyymmddThhmmssZ", which must equal the X-Amz-Date header's value).
std::string Authorization(const Request& request, const Credentials& credentials,
                          const std::string& region, const std::string& service,
                          const std::string& amz_date);
/// The current time as "yyyymmddThhmmssZ" (UTC), for X-Amz-Date.
std::string AmzDateNow();

}  // namespace dcp::sigv4
