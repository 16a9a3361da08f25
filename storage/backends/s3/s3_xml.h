// The s3:// backend's reading of S3's XML answers (internal): tinyxml2 behind a few functions,
// one per kind of answer.
//
// A body that is not the expected document (not XML, cut short, nested deeper than tinyxml2's
// 100 levels, over the bounds below) is an error naming the request, never a crash: the answers
// come from a server we do not control.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dcp::s3 {

// The most of a body the client keeps (s3_http.cc) and the parser reads. S3's XML answers are
// small: a listing page of 1,000 keys is about 300 KiB.
inline constexpr size_t kMaxXmlBytes = size_t{64} << 20;
// The most tags ('<') a body may hold. tinyxml2 allocates a node of about 100 bytes per element
// and text, so 64 MiB of "<a/>" would take gigabytes; a page of 1,000 keys has about 20,000.
inline constexpr size_t kMaxXmlTags = size_t{1} << 20;

struct S3ErrorBody {
  std::string code;     // "NoSuchKey", "SlowDown", ...
  std::string message;  // free text
};

// The Code and Message of an <Error> document. Empty where the body is none (a HEAD answer has
// no body, a proxy may answer HTML): the HTTP status alone then tells what failed. Does not
// throw (but std::bad_alloc).
S3ErrorBody ParseS3Error(std::string_view body);

// Whether a 2xx answer's body reports a failure: an <Error> document, or a body that is not XML
// (an answer cut short). S3 can fail CompleteMultipartUpload after its 200 OK and then puts the
// error in the body. A blank body is no failure. Does not throw (but std::bad_alloc).
bool IsS3ErrorBody(std::string_view body);

// InitiateMultipartUploadResult's UploadId. A retryable IoError naming `what` (the object) when
// there is none or the body is not that document.
std::string ParseInitiateMultipartUpload(std::string_view body, const std::string& what);

// One page of ListObjectsV2 (ListBucketResult).
struct ListObjectsPage {
  std::vector<std::string> keys;  // every <Contents>'s <Key>, decoded, in the server's order
  std::vector<int64_t> sizes;     // and its <Size>, -1 where absent or not a number
  bool truncated = false;         // <IsTruncated>true</IsTruncated>
  std::string next_token;         // <NextContinuationToken>, "" when absent
};
// CorruptionError naming `what` (the location listed) when the body is not that document.
ListObjectsPage ParseListObjectsV2(std::string_view body, const std::string& what);

// One page of ListMultipartUploads (ListMultipartUploadsResult).
struct ListUploadsPage {
  std::vector<std::string> keys;        // every <Upload>'s <Key>
  std::vector<std::string> upload_ids;  // and its <UploadId>, in the same order
  bool truncated = false;
  std::string next_key_marker;        // <NextKeyMarker>
  std::string next_upload_id_marker;  // <NextUploadIdMarker>
};
// CorruptionError naming `what` when the body is not that document.
ListUploadsPage ParseListMultipartUploads(std::string_view body, const std::string& what);

// The objects a multi-object delete (DeleteResult, quiet) failed to delete: each <Error>'s
// <Key>, <Code> and <Message>. CorruptionError naming `what` when the body is not that document.
struct DeleteFailure {
  std::string key, code, message;
};
std::vector<DeleteFailure> ParseDeleteResult(std::string_view body, const std::string& what);

}  // namespace dcp::s3
