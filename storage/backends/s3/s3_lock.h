// The s3:// writer lock (internal): a lock object holding a lease, renewed while held.
#pragma once

#include <memory>
#include <string>

#include "dcp/storage/backends/s3/s3_http.h"
#include "dcp/storage/store.h"

namespace dcp::s3 {

// Store::TryLock of the store at `location` (for messages): takes the lock object `key` for
// `holder`, or an expired one over, or (Store::TryLockOver) one whose holder is `gone_holder`
// while its lease runs. LockedError while another job's lease runs.
std::unique_ptr<StoreLock> AcquireLock(std::shared_ptr<Client> client, const std::string& location,
                                       const std::string& key, const std::string& holder,
                                       const std::string& gone_holder = {});

}  // namespace dcp::s3
