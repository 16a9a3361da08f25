// The `dcp` commands that read checkpoints: inspect, verify and diff, and incomplete (main.cc parses the command
// line and calls one). Each returns the command's exit code (cli_common.h's Exit) and throws
// what ClassifyCurrentException maps to one.
#pragma once

#include <string>

namespace dcp::cli {

/// `dcp inspect`: a summary and a table (or, with `json`, one JSON document) of the entries of
/// `path` whose fqn matches the glob `filter` (empty: all).
int Inspect(const std::string& path, const std::string& filter, bool json);
/// `dcp verify`: read every stored item of `path`, checking sizes and checksums; list unreferenced
/// data files and leftover temporary metadata as warnings.
int Verify(const std::string& path, bool json);
/// `dcp diff`: the differences between checkpoints `pa` and `pb`: entries, kinds, dtypes,
/// shapes, chunking, and values (by element with `values`, within `atol` + `rtol` * |b|;
/// else by stored checksum).
int Diff(const std::string& pa, const std::string& pb, bool values, double atol, double rtol,
         bool json);
/// `dcp incomplete`: list the writes left unfinished at `path` (Store::ListIncomplete: s3://
/// multipart uploads of a crashed save); with `abort`, discard them under the location's writer
/// lock (LockedError, exit 2, while a save holds it).
int Incomplete(const std::string& path, bool abort, bool json);

}  // namespace dcp::cli
