// A Store in process memory, named by mem://<name>. Every rank (thread) of the process that opens
// the same name sees the same objects. The tutorial backend: see mem_store.cc.
#pragma once

#include <memory>
#include <string>

#include "dcp/storage/store.h"

namespace dcp {

std::shared_ptr<Store> MakeMemStore(const std::string& name);
/// Forget every object under a mem:// name (for tests).
void ClearMemStore(const std::string& name);

}  // namespace dcp
