// A Store on a POSIX directory. Writes go through pwrite, reads through pread; PublishAtomically
// writes "<name>.tmp.<random>", fsyncs it, renames it over <name> and fsyncs the directory.
#pragma once

#include <memory>
#include <string>

#include "storage/store.h"

namespace dcp {

std::shared_ptr<Store> MakeFileStore(const std::string& directory);

}  // namespace dcp
