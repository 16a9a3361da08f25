// S3Options::FromEnvironment: the s3:// backend's settings from the AWS_* and DCP_S3_*
// environment variables and the defaults (storage/backends/s3/s3_store.h lists them).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "dcp/proto/error.h"
#include "dcp/storage/backends/s3/s3_store.h"

namespace dcp {

namespace {

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

int64_t EnvInt(const char* name, int64_t fallback) {
  const std::string v = Env(name);
  if (v.empty()) return fallback;
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (end == v.c_str() || *end != '\0') {
    throw InvalidArgumentError(std::string(name) + "='" + v + "' is not an integer");
  }
  return x;
}

}  // namespace

S3Options S3Options::FromEnvironment(S3Options o) {
  if (o.region.empty()) o.region = Env("AWS_REGION");
  if (o.region.empty()) o.region = Env("AWS_DEFAULT_REGION");
  if (o.region.empty()) o.region = "us-east-1";
  if (o.endpoint.empty()) o.endpoint = Env("AWS_ENDPOINT_URL_S3");
  if (o.endpoint.empty()) o.endpoint = Env("AWS_ENDPOINT_URL");
  if (o.endpoint.empty()) o.endpoint = "https://s3." + o.region + ".amazonaws.com";
  while (!o.endpoint.empty() && o.endpoint.back() == '/') o.endpoint.pop_back();
  if (o.endpoint.find("://") == std::string::npos) o.endpoint = "https://" + o.endpoint;
  if (o.endpoint.find('/', o.endpoint.find("://") + 3) != std::string::npos ||
      o.endpoint.find('?') != std::string::npos) {
    throw InvalidArgumentError("S3 endpoint '" + o.endpoint +
                               "' must be scheme://host[:port] without a path (AWS_ENDPOINT_URL)");
  }
  if (o.access_key_id.empty()) o.access_key_id = Env("AWS_ACCESS_KEY_ID");
  if (o.secret_access_key.empty()) o.secret_access_key = Env("AWS_SECRET_ACCESS_KEY");
  if (o.session_token.empty()) o.session_token = Env("AWS_SESSION_TOKEN");
  if (o.access_key_id.empty() || o.secret_access_key.empty()) {
    throw InvalidArgumentError(
        "s3:// needs credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and "
        "AWS_ENDPOINT_URL for an S3-compatible server)");
  }
  if (o.target_gbps <= 0) {
    const std::string v = Env("DCP_S3_TARGET_GBPS");
    char* end = nullptr;
    o.target_gbps = v.empty() ? 10.0 : std::strtod(v.c_str(), &end);
    if (!v.empty() && (end == v.c_str() || *end != '\0' || !(o.target_gbps > 0))) {
      throw InvalidArgumentError("DCP_S3_TARGET_GBPS='" + v + "' is not a positive number");
    }
  }
  if (o.max_connections <= 0) {
    o.max_connections = static_cast<int>(EnvInt("DCP_S3_MAX_CONNECTIONS", 0));
  }
  if (o.max_connections <= 0) {
    // The CRT's rule: the target over what one connection carries.
    o.max_connections =
        static_cast<int>(std::clamp(std::ceil(o.target_gbps / kS3ConnectionGbps), 2.0, 64.0));
  }
  if (o.part_size == 0) {
    o.part_size = static_cast<uint64_t>(EnvInt("DCP_S3_PART_SIZE_MIB", 0)) << 20;
  }
  if (o.part_size == 0) {
    const double bytes =
        o.target_gbps / o.max_connections * 1e9 / 8 * kS3RequestSeconds / (1 << 20);
    o.part_size = static_cast<uint64_t>(std::clamp(std::round(bytes), 5.0, 64.0)) << 20;
  }
  if (o.part_size < (uint64_t{5} << 20) || o.part_size > (uint64_t{5} << 30)) {
    throw InvalidArgumentError("s3 part size must be 5 MiB to 5 GiB, not " +
                               std::to_string(o.part_size) + " bytes");
  }
  if (o.parts_in_flight <= 0)
    o.parts_in_flight = static_cast<int>(EnvInt("DCP_S3_PARTS_IN_FLIGHT", o.max_connections));
  if (o.read_ahead_parts <= 0)
    o.read_ahead_parts = static_cast<int>(EnvInt("DCP_S3_READ_AHEAD_PARTS", o.max_connections));
  if (o.parts_in_flight <= 0 || o.read_ahead_parts <= 0) {
    throw InvalidArgumentError("DCP_S3_PARTS_IN_FLIGHT and DCP_S3_READ_AHEAD_PARTS must be >= 1");
  }
  if (o.max_retries < 0) o.max_retries = static_cast<int>(EnvInt("DCP_S3_MAX_RETRIES", 4));
  if (o.lock_lease_seconds <= 0) o.lock_lease_seconds = EnvInt("DCP_S3_LOCK_LEASE_S", 60);
  if (o.lock_lease_seconds <= 0) {
    throw InvalidArgumentError("DCP_S3_LOCK_LEASE_S must be >= 1 (seconds)");
  }
  if (!o.sign_payload) o.sign_payload = EnvInt("DCP_S3_SIGN_PAYLOAD", 0) != 0;
  if (o.request_timeout_seconds <= 0) {
    o.request_timeout_seconds = EnvInt("DCP_S3_REQUEST_TIMEOUT_S", 60);
  }
  if (o.request_timeout_seconds <= 0) {
    throw InvalidArgumentError("DCP_S3_REQUEST_TIMEOUT_S must be >= 1 (seconds)");
  }
  return o;
}

}  // namespace dcp
