// SigV4 signing (storage/backends/s3/s3_sigv4.h) against AWS's published vectors: the SigV4 test suite
// (credentials AKIDEXAMPLE, 20150830T123600Z, region us-east-1, service "service") and the
// worked S3 examples of the S3 API reference (AKIAIOSFODNN7EXAMPLE, 20130524T000000Z). The
// expected signatures are AWS's, not computed by this code. Runs without any server.
#include "dcp/storage/backends/s3/s3_sigv4.h"

#include <catch2/catch.hpp>

#include "support/s3_test_support.h"

#ifdef DCP_HAVE_S3
using namespace dcp::sigv4;

namespace {

const std::string kEmptySha = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

Credentials SuiteCredentials() {
  return {"AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", ""};
}
Credentials S3Credentials() {
  return {"AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", ""};
}

Request SuiteRequest(const std::string& method) {
  Request r;
  r.method = method;
  r.encoded_path = "/";
  r.headers = {{"Host", "example.amazonaws.com"}, {"X-Amz-Date", "20150830T123600Z"}};
  r.payload_hash = Sha256Hex("");
  return r;
}

std::string SignatureOf(const std::string& authorization) {
  return authorization.substr(authorization.rfind('=') + 1);
}

}  // namespace

TEST_CASE("sigv4: hashes and the derived key", "[s3][sigv4]") {
  CHECK(Sha256Hex("") == kEmptySha);
  CHECK(Sha256Hex("Welcome to Amazon S3.") ==
        "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072");
  // The suite's signing key (AWS: "derived signing key").
  CHECK(Hex(SigningKey("wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "20150830", "us-east-1",
                       "service")) ==
        "938127b5336810ddb6a5d6af445fcac9e371f9ed418ed386b022aed82901be75");
  CHECK(UriEncode("a b/ü~.-_*", true) == "a%20b/%C3%BC~.-_%2A");
  CHECK(UriEncode("a/b=c", false) == "a%2Fb%3Dc");
}

TEST_CASE("sigv4: AWS test suite get-vanilla", "[s3][sigv4]") {
  const Request r = SuiteRequest("GET");
  CHECK(CanonicalRequest(r) ==
        "GET\n/\n\nhost:example.amazonaws.com\nx-amz-date:20150830T123600Z\n\n"
        "host;x-amz-date\n" +
            kEmptySha);
  CHECK(StringToSign(CanonicalRequest(r), "20150830T123600Z",
                     Scope("20150830", "us-east-1", "service")) ==
        "AWS4-HMAC-SHA256\n20150830T123600Z\n20150830/us-east-1/service/aws4_request\n"
        "bb579772317eb040ac9ed261061d46c1f17a8133879d6129b6e1c25292927e63");
  CHECK(Authorization(r, SuiteCredentials(), "us-east-1", "service", "20150830T123600Z") ==
        "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, "
        "SignedHeaders=host;x-amz-date, "
        "Signature=5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31");
}

TEST_CASE("sigv4: AWS test suite query order and post-vanilla", "[s3][sigv4]") {
  Request q = SuiteRequest("GET");
  q.query = {{"Param2", "value2"}, {"Param1", "value1"}};  // sorted by the canonical form
  CHECK(CanonicalQuery(q.query) == "Param1=value1&Param2=value2");
  CHECK(SignatureOf(
            Authorization(q, SuiteCredentials(), "us-east-1", "service", "20150830T123600Z")) ==
        "b97d918cfa904a5beff61c982a1b6f458b799221646efd99d3219ec94cdf2500");
  const Request p = SuiteRequest("POST");
  CHECK(SignatureOf(
            Authorization(p, SuiteCredentials(), "us-east-1", "service", "20150830T123600Z")) ==
        "5da7c1a2acd57cee7505fc6676e4e544621c30862966e37dddb68e92efbe5d6b");
}

TEST_CASE("sigv4: the S3 API reference examples", "[s3][sigv4]") {
  // GET Object with a Range header.
  Request get;
  get.method = "GET";
  get.encoded_path = "/test.txt";
  get.headers = {{"Host", "examplebucket.s3.amazonaws.com"},
                 {"Range", "bytes=0-9"},
                 {"x-amz-content-sha256", kEmptySha},
                 {"x-amz-date", "20130524T000000Z"}};
  get.payload_hash = kEmptySha;
  CHECK(Authorization(get, S3Credentials(), "us-east-1", "s3", "20130524T000000Z") ==
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");

  // PUT Object: a signed payload, a key with '$' (encoded once, in the path).
  Request put;
  put.method = "PUT";
  put.encoded_path = "/" + UriEncode("test$file.text", true);
  CHECK(put.encoded_path == "/test%24file.text");
  put.payload_hash = Sha256Hex("Welcome to Amazon S3.");
  put.headers = {{"Date", "Fri, 24 May 2013 00:00:00 GMT"},
                 {"Host", "examplebucket.s3.amazonaws.com"},
                 {"x-amz-content-sha256", put.payload_hash},
                 {"x-amz-date", "20130524T000000Z"},
                 {"x-amz-storage-class", "REDUCED_REDUNDANCY"}};
  CHECK(StringToSign(CanonicalRequest(put), "20130524T000000Z",
                     Scope("20130524", "us-east-1", "s3")) ==
        "AWS4-HMAC-SHA256\n20130524T000000Z\n20130524/us-east-1/s3/aws4_request\n"
        "9e0e90d9c76de8fa5b200d8c849cd5b8dc7a3be3951ddb7f6a76b4158342019d");
  CHECK(Authorization(put, S3Credentials(), "us-east-1", "s3", "20130524T000000Z") ==
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        "SignedHeaders=date;host;x-amz-content-sha256;x-amz-date;x-amz-storage-class, "
        "Signature=98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd");
  // The same request without the Date header (signed headers change, so does the signature).
  put.headers.erase(put.headers.begin());
  CHECK(SignatureOf(Authorization(put, S3Credentials(), "us-east-1", "s3", "20130524T000000Z")) ==
        "1ee3a9a719bf9cd67d34043a52b3d1f8b674e378dc99c0748019b43f49b5b9bb");

  // GET Bucket (List Objects) with query parameters.
  Request list;
  list.method = "GET";
  list.encoded_path = "/";
  list.query = {{"max-keys", "2"}, {"prefix", "J"}};
  list.headers = {{"Host", "examplebucket.s3.amazonaws.com"},
                  {"x-amz-content-sha256", kEmptySha},
                  {"x-amz-date", "20130524T000000Z"}};
  list.payload_hash = kEmptySha;
  CHECK(SignatureOf(Authorization(list, S3Credentials(), "us-east-1", "s3", "20130524T000000Z")) ==
        "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7");

  // A changed byte anywhere changes the signature (the test can fail).
  Request other = get;
  other.headers[1].second = "bytes=0-8";
  CHECK(SignatureOf(Authorization(other, S3Credentials(), "us-east-1", "s3", "20130524T000000Z")) !=
        "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
  CHECK(AmzDateNow().size() == 16);
}
#else
TEST_CASE("sigv4: AWS test suite", "[s3][sigv4]") {
  dcp::testing::SkipTestCase(dcp::testing::S3SkipReason());
}
#endif
