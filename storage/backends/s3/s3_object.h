// The s3:// backend's objects (internal): the multipart writer and the prefetching reader.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "dcp/storage/backends/s3/s3_http.h"
#include "dcp/storage/store.h"

namespace dcp::s3 {

// Store::Create: the object `key` appears at Close; destroyed without Close, it never does.
std::unique_ptr<WritableObject> MakeWritable(std::shared_ptr<Client> client, std::string key);

// Store::Open of the object `key` of `size` bytes.
std::unique_ptr<ReadableObject> MakeReadable(std::shared_ptr<Client> client, std::string key,
                                             uint64_t size);

}  // namespace dcp::s3
