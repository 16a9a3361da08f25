// kv://DIR — an example storage backend kept outside the core: a key-value object store in a
// directory, the shape of a remote object store (S3, GCS) reduced to local files.
//
// Layout: each object (key) lives at DIR/<2 hex digits of FNV-1a(key)>/<key>; writes are staged
// under DIR/.staging/ and renamed into place at Close (so an object is invisible until then and
// an abandoned write leaves nothing under its key); every rename is followed by an fsync of the
// file and of its directory. The checkpoint protocol (file names, checksums, atomic metadata
// commit) comes from the core's generic Store writer and reader.
//
// Use it either way:
//   * at run time:   dcp::LoadStoragePlugin("libdcp_kv_store.so")  (or `dcp --plugin ...`), which
//                    calls the exported dcp_register_storage();
//   * from code:     link dcp_kv_store and call dcp_kv::RegisterKvStore().
// docs/STORAGE_BACKENDS.md walks through this file as the tutorial.
#pragma once

#include <memory>
#include <string>

#include "dcp/storage/store.h"

namespace dcp_kv {

/// The store for the directory `root` (created by CreateRoot, not here).
std::shared_ptr<dcp::Store> MakeKvStore(const std::string& root);

/// Register the "kv" scheme with dcp's registry. Idempotent; never takes another scheme.
void RegisterKvStore();

}  // namespace dcp_kv

/// Entry point LoadStoragePlugin looks up; same as dcp_kv::RegisterKvStore().
extern "C" void dcp_register_storage();
