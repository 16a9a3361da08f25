// A Store on a POSIX directory. Writes go through pwrite, reads through pread; PublishAtomically
// writes "<name>.tmp.<random>", fsyncs it, renames it over <name> and fsyncs the directory.
//
// Data objects (Create) are written with O_DIRECT where the filesystem accepts it: appends are
// staged in two reused 16 MiB 4 KiB-aligned buffers (one written in the background while the
// other fills), whole blocks bypass the page cache, and the last partial block is written
// through the page cache at Sync/Close, so sizes are exact. When open(O_DIRECT) or an aligned
// write fails with EINVAL the object is written through the page cache instead.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "dcp/storage/store.h"

namespace dcp {

struct FileStoreOptions {
  /// Write data objects with O_DIRECT where possible (falls back to buffered writes).
  bool direct_io = true;
};

/// A store with default options; DCP_DIRECT_IO=0 in the environment turns direct I/O off (this
/// is the store behind file:// URIs).
std::shared_ptr<Store> MakeFileStore(const std::string& directory);
std::shared_ptr<Store> MakeFileStore(const std::string& directory, FileStoreOptions options);

/// Why flock() on `directory` would not exclude writers on other machines, from the mount that
/// holds it (/proc/self/mountinfo), or "" when nothing says so: NFS mounted with
/// local_lock=flock, local_lock=all or nolock (locks kept by the client, invisible to other
/// clients), Lustre with localflock. The file:// store's TryLock refuses such a directory with
/// UnsupportedError unless DCP_FILE_LOCK=node-local is set (every writer on one machine), since
/// its lock would promise an exclusion it cannot give. Never throws.
std::string NodeLocalLockReason(const std::string& directory);
/// The same decision from one mount's filesystem type and its mount and superblock options
/// (comma-separated, as in mountinfo).
std::string NodeLocalLockReason(std::string_view fs_type, std::string_view options);

}  // namespace dcp
