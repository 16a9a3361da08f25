// S3's XML answers (storage/backends/s3/s3_xml.h): the documents the s3:// backend reads, as AWS
// and RGW write them, and bodies that are not what they should be (malformed, cut short, hostile),
// which must end in a dcp error, never a crash or an unbounded allocation. Runs without any server.
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "dcp/proto/error.h"
#include "support/s3_test_support.h"

#ifdef DCP_HAVE_S3
#include "dcp/storage/backends/s3/s3_xml.h"

using namespace dcp;
using namespace dcp::s3;
using Catch::Matchers::Contains;

namespace {

const std::string kDecl = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
const std::string kNs = " xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"";

std::string ListPage(const std::string& inner) {
  return kDecl + "<ListBucketResult" + kNs + "><Name>bkt</Name><Prefix>p/</Prefix>" + inner +
         "</ListBucketResult>";
}

// The message of the CorruptionError that listing `body` ends in ("" when it does not).
std::string ListingError(const std::string& body) {
  try {
    ParseListObjectsV2(body, "s3://bkt/p");
  } catch (const CorruptionError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("s3 xml: an error body gives its code and message", "[s3][xml]") {
  const S3ErrorBody aws = ParseS3Error(
      kDecl +
      "<Error><Code>NoSuchKey</Code><Message>The resource you requested does not exist</Message>"
      "<Resource>/mybucket/myfoto.jpg</Resource><RequestId>4442587FB7D0A2F9</RequestId></Error>");
  CHECK(aws.code == "NoSuchKey");
  CHECK(aws.message == "The resource you requested does not exist");
  // RGW sends no Message for some errors.
  const S3ErrorBody rgw = ParseS3Error(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>NoSuchBucket</Code>"
      "<BucketName>b</BucketName><RequestId>tx0</RequestId><HostId>h</HostId></Error>");
  CHECK(rgw.code == "NoSuchBucket");
  CHECK(rgw.message.empty());
  CHECK(ParseS3Error("<Error><Code>SlowDown</Code><Message>a &amp; b</Message></Error>").message ==
        "a & b");
  // No error document: nothing, and no exception (the status alone tells what failed).
  for (const char* body :
       {"", "   ", "<html><body>502 Bad Gateway</body></html>", "<Error><Code>X</Code>",
        "not xml at all", "<ListBucketResult><Code>X</Code></ListBucketResult>"}) {
    const S3ErrorBody none = ParseS3Error(body);
    CHECK(none.code.empty());
    CHECK(none.message.empty());
  }
  // A 2xx answer whose body is an error (CompleteMultipartUpload failing after its 200 OK), or
  // is cut short; a result or a blank body is none.
  CHECK(IsS3ErrorBody(kDecl + "\n\n<Error><Code>InternalError</Code></Error>"));
  CHECK(IsS3ErrorBody(kDecl + "<CompleteMultipartUploadResult><Location>x</Location>"));
  CHECK_FALSE(IsS3ErrorBody(kDecl + "<CompleteMultipartUploadResult" + kNs +
                            "><Bucket>b</Bucket><Key>k</Key><ETag>\"3858f62230ac3c915f300c66431"
                            "2c11f-9\"</ETag></CompleteMultipartUploadResult>"));
  CHECK_FALSE(IsS3ErrorBody(""));
  CHECK_FALSE(IsS3ErrorBody(" \r\n "));
}

TEST_CASE("s3 xml: InitiateMultipartUploadResult gives the upload id", "[s3][xml]") {
  CHECK(ParseInitiateMultipartUpload(
            kDecl + "<InitiateMultipartUploadResult" + kNs +
                "><Bucket>example-bucket</Bucket><Key>example-object</Key>"
                "<UploadId>VXBsb2FkIElEIGZvciA2aWWpbmcncyBteS1tb3ZpZS5tMnRzIHVwbG9hZA</UploadId>"
                "</InitiateMultipartUploadResult>",
            "s3://b/k") == "VXBsb2FkIElEIGZvciA2aWWpbmcncyBteS1tb3ZpZS5tMnRzIHVwbG9hZA");
  CHECK(ParseInitiateMultipartUpload("<InitiateMultipartUploadResult><UploadId>2~a&amp;b"
                                     "</UploadId></InitiateMultipartUploadResult>",
                                     "s3://b/k") == "2~a&b");
  // No id, or no such document: a retryable IoError naming the object.
  for (const std::string& body :
       {std::string("<InitiateMultipartUploadResult><Key>k</Key></InitiateMultipartUploadResult>"),
        std::string("<InitiateMultipartUploadResult><UploadId></UploadId>"
                    "</InitiateMultipartUploadResult>"),
        std::string(""), std::string("<InitiateMultipartUploadResult><UploadId>x</UploadId>"),
        std::string("<Other><UploadId>x</UploadId></Other>")}) {
    try {
      ParseInitiateMultipartUpload(body, "s3://b/k");
      FAIL("no IoError for: " << body);
    } catch (const IoError& e) {
      CHECK_THAT(e.what(), Contains("s3://b/k") && Contains("returned no UploadId"));
      CHECK(e.retryable());
    }
  }
  CHECK_THROWS_WITH(ParseInitiateMultipartUpload("<InitiateMultipartUploadResult>", "s3://b/k"),
                    Contains("not well-formed XML"));
  CHECK_THROWS_WITH(ParseInitiateMultipartUpload("<Other/>", "s3://b/k"),
                    Contains("<Other>, not <InitiateMultipartUploadResult>"));
}

TEST_CASE("s3 xml: a ListObjectsV2 page decodes escaped keys", "[s3][xml]") {
  const ListObjectsPage page = ParseListObjectsV2(
      ListPage("<KeyCount>5</KeyCount><MaxKeys>1000</MaxKeys><Delimiter>/</Delimiter>"
               "<IsTruncated>false</IsTruncated>"
               "<Contents><Key>p/a&amp;b</Key><LastModified>2024-01-01T00:00:00.000Z"
               "</LastModified><ETag>&quot;d41d8cd98f00b204e9800998ecf8427e&quot;</ETag>"
               "<Size>0</Size><StorageClass>STANDARD</StorageClass></Contents>"
               "<Contents><Key>p/&lt;x&gt; &apos;y&apos; &quot;z&quot;</Key></Contents>"
               "<Contents><Key>p/caf&#233; &#x1F600; &#65;&#x42;</Key></Contents>"
               "<Contents><Key>p/ spaced  key </Key></Contents>"
               "<Contents><Key><![CDATA[p/<raw>&]]></Key></Contents>"
               "<CommonPrefixes><Prefix>p/sub/</Prefix></CommonPrefixes>"),
      "s3://bkt/p");
  REQUIRE(page.keys.size() == 5);
  CHECK(page.keys[0] == "p/a&b");
  CHECK(page.keys[1] == "p/<x> 'y' \"z\"");
  CHECK(page.keys[2] == "p/caf\xC3\xA9 \xF0\x9F\x98\x80 AB");
  CHECK(page.keys[3] == "p/ spaced  key ");
  CHECK(page.keys[4] == "p/<raw>&");
  CHECK_FALSE(page.truncated);
  CHECK(page.next_token.empty());
  // Each key's <Size>; -1 where there is none.
  CHECK(page.sizes == std::vector<int64_t>{0, -1, -1, -1, -1});
}

TEST_CASE("s3 xml: a ListObjectsV2 page gives each key's size and no size for a bad one",
          "[s3][xml]") {
  const ListObjectsPage page = ParseListObjectsV2(
      ListPage("<IsTruncated>false</IsTruncated>"
               "<Contents><Key>a</Key><Size>12583274</Size></Contents>"
               "<Contents><Key>b</Key><Size>-3</Size></Contents>"
               "<Contents><Key>c</Key><Size>12x</Size></Contents>"
               "<Contents><Key>d</Key><Size>99999999999999999999999</Size></Contents>"
               "<Contents><Key>e</Key><Size></Size></Contents>"),
      "s3://bkt/p");
  REQUIRE(page.keys.size() == 5);
  CHECK(page.sizes == std::vector<int64_t>{12583274, -1, -1, -1, -1});
}

TEST_CASE("s3 xml: a truncated ListObjectsV2 page gives its continuation token", "[s3][xml]") {
  const ListObjectsPage page = ParseListObjectsV2(
      ListPage("<Contents><Key>p/data-0</Key></Contents><Contents><Key>p/data-1</Key></Contents>"
               "<IsTruncated>true</IsTruncated>"
               "<NextContinuationToken>1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=&amp;x"
               "</NextContinuationToken>"),
      "s3://bkt/p");
  CHECK(page.keys == std::vector<std::string>{"p/data-0", "p/data-1"});
  CHECK(page.truncated);
  CHECK(page.next_token == "1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=&x");
  // Truncated without a token: the caller stops there (as before).
  const ListObjectsPage no_token =
      ParseListObjectsV2(ListPage("<IsTruncated>true</IsTruncated>"), "s3://bkt/p");
  CHECK(no_token.truncated);
  CHECK(no_token.next_token.empty());
  // Only "true" continues.
  CHECK_FALSE(
      ParseListObjectsV2(ListPage("<IsTruncated>TRUE</IsTruncated>"), "s3://bkt/p").truncated);
}

TEST_CASE("s3 xml: an empty listing has no keys", "[s3][xml]") {
  for (const std::string& body :
       {ListPage("<KeyCount>0</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>"),
        std::string("<ListBucketResult/>"),
        kDecl + "<ListBucketResult" + kNs + "></ListBucketResult>"}) {
    const ListObjectsPage page = ParseListObjectsV2(body, "s3://bkt/p");
    CHECK(page.keys.empty());
    CHECK_FALSE(page.truncated);
  }
}

TEST_CASE("s3 xml: a ListMultipartUploads page gives its keys and markers", "[s3][xml]") {
  const ListUploadsPage page = ParseListMultipartUploads(
      kDecl + "<ListMultipartUploadsResult" + kNs +
          "><Bucket>b</Bucket><KeyMarker></KeyMarker><UploadIdMarker></UploadIdMarker>"
          "<NextKeyMarker>p/b&amp;c</NextKeyMarker><NextUploadIdMarker>2~xyz</NextUploadIdMarker>"
          "<MaxUploads>1000</MaxUploads><IsTruncated>true</IsTruncated>"
          "<Upload><Key>p/a</Key><UploadId>2~abc</UploadId><Initiator><ID>u</ID></Initiator>"
          "</Upload><Upload><Key>p/b&amp;c</Key><UploadId>2~xyz</UploadId></Upload>"
          "</ListMultipartUploadsResult>",
      "s3://b/p (incomplete uploads)");
  CHECK(page.keys == std::vector<std::string>{"p/a", "p/b&c"});
  CHECK(page.truncated);
  CHECK(page.next_key_marker == "p/b&c");
  CHECK(page.next_upload_id_marker == "2~xyz");
  CHECK_THROWS_WITH(
      ParseListMultipartUploads(ListPage(""), "s3://b/p (incomplete uploads)"),
      Contains("s3://b/p (incomplete uploads)") && Contains("not <ListMultipartUploadsResult>"));
}

TEST_CASE("s3 xml: a malformed listing is a CorruptionError naming the location", "[s3][xml]") {
  static const char kWithNul[] = "<ListBucketResult>\0<Contents/></ListBucketResult>";
  for (const std::string& body : {
           std::string(""),
           std::string("   "),
           ListPage("<Contents><Key>p/a</Contents>"),                      // mismatched
           ListPage("<Contents><Key>p/a</Key></Contents>").substr(0, 90),  // cut short
           std::string("<ListBucketResult><Contents><Key>p/a</Key></Contents>"),
           std::string("<html><body>Service Unavailable</body></html>"),
           std::string("<ListBucketResult attr=unquoted></ListBucketResult>"),
           std::string("\x01\x02\xff\xfe garbage"),
           std::string(kWithNul, sizeof(kWithNul) - 1),
           std::string("<Error><Code>AccessDenied</Code></Error>"),
       }) {
    const std::string why = ListingError(body);
    CHECK_THAT(why, Contains("listing s3://bkt/p") && Contains("not a ListBucketResult") &&
                        Contains("the listing was abandoned"));
  }
  CHECK_THAT(ListingError("<ListBucketResult><Key>"), Contains("not well-formed XML"));
  CHECK_THAT(ListingError("<Error/>"), Contains("<Error>, not <ListBucketResult>"));
}

TEST_CASE("s3 xml: hostile bodies are refused without a crash", "[s3][xml][hostile]") {
  // Nested far deeper than any answer: tinyxml2's depth limit, not the stack, ends it.
  std::string deep;
  for (int i = 0; i < 500000; ++i) deep += "<a>";
  CHECK_THAT(ListingError(deep), Contains("XML_ELEMENT_DEPTH_EXCEEDED"));
  CHECK_THAT(ListingError("<ListBucketResult>" + deep), Contains("XML_ELEMENT_DEPTH_EXCEEDED"));
  CHECK(ParseS3Error("<Error>" + deep).code.empty());
  CHECK(IsS3ErrorBody(deep));

  // More bytes than the client keeps of an answer.
  std::string huge = ListPage("<Contents><Key>p/");
  huge.resize(kMaxXmlBytes + 1, 'x');
  CHECK_THAT(ListingError(huge), Contains("more than the 67108864"));
  CHECK(ParseS3Error(huge).code.empty());

  // Millions of tiny elements (a few bytes each, gigabytes as tinyxml2 nodes).
  std::string many = "<ListBucketResult>";
  for (size_t i = 0; i <= kMaxXmlTags; ++i) many += "<a/>";
  many += "</ListBucketResult>";
  CHECK(many.size() < kMaxXmlBytes);
  CHECK_THAT(ListingError(many), Contains("tags, more than the 1048576"));

  // Large but within bounds: a 16 MiB key and a page of 100,000 keys parse.
  const std::string big_key = "p/" + std::string(16 << 20, 'k');
  const ListObjectsPage big =
      ParseListObjectsV2(ListPage("<Contents><Key>" + big_key + "</Key></Contents>"), "s3://b/p");
  REQUIRE(big.keys.size() == 1);
  CHECK(big.keys[0] == big_key);
  std::string keys;
  for (int i = 0; i < 100000; ++i)
    keys += "<Contents><Key>p/" + std::to_string(i) + "</Key></Contents>";
  CHECK(ParseListObjectsV2(ListPage(keys), "s3://b/p").keys.size() == 100000);

  // Entities: no DTD is expanded (no "billion laughs"); character references out of range, and
  // unknown or unterminated entities, do not crash.
  const std::string laughs =
      "<?xml version=\"1.0\"?><!DOCTYPE lolz [<!ENTITY lol \"lol\"><!ENTITY lol2 "
      "\"&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;\">]>"
      "<ListBucketResult><Contents><Key>&lol2;</Key></Contents></ListBucketResult>";
  try {
    const ListObjectsPage page = ParseListObjectsV2(laughs, "s3://b/p");
    REQUIRE(page.keys.size() == 1);
    CHECK(page.keys[0].size() < 100);
  } catch (const CorruptionError& e) {
    CHECK_THAT(e.what(), Contains("listing s3://b/p"));
  }
  const ListObjectsPage odd = ParseListObjectsV2(
      ListPage("<Contents><Key>&#x110000;&#99999999999999999999;&#xFFFFFFFFFFFFFFFFFFFF;&#0;"
               "&#;&#x;&nosuch;&amp</Key></Contents>"),
      "s3://b/p");
  CHECK(odd.keys.size() == 1);
}

TEST_CASE("s3 xml: a DeleteResult lists the keys that failed", "[s3][xml]") {
  const auto failed = ParseDeleteResult(
      "<?xml version=\"1.0\"?><DeleteResult><Deleted><Key>a</Key></Deleted>"
      "<Error><Key>b&amp;c</Key><Code>AccessDenied</Code><Message>no</Message></Error>"
      "</DeleteResult>",
      "s3://b/p");
  REQUIRE(failed.size() == 1);
  CHECK(failed[0].key == "b&c");
  CHECK(failed[0].code == "AccessDenied");
  CHECK(failed[0].message == "no");
  CHECK(ParseDeleteResult("<DeleteResult/>", "s3://b/p").empty());
  CHECK_THROWS_AS(ParseDeleteResult("<ListBucketResult/>", "s3://b/p"), CorruptionError);
  CHECK_THROWS_AS(ParseDeleteResult("<DeleteResult><Error>", "s3://b/p"), CorruptionError);
}
#else
TEST_CASE("s3 xml: S3's XML answers", "[s3][xml]") {
  dcp::testing::SkipTestCase(dcp::testing::S3SkipReason());
}
#endif
