// dcp: inspect, verify, diff and convert checkpoints from the command line.
//
//   dcp inspect PATH [--filter GLOB] [--json]
//   dcp verify PATH [--json]
//   dcp diff A B [--values] [--atol X] [--rtol Y] [--json]
//   dcp convert SRC DST [--from FMT] [--to FMT] [--overwrite] [--compress zstd] [--json]
//   dcp incomplete PATH [--abort] [--json]
//   --plugin LIB (repeatable) loads a storage backend before anything else.
//   --json prints one JSON document on stdout, with the same exit code as without it; an error
//   prints {"error": {"category", "exit_code", "message"}} there (and the message on stderr).
// Needs neither MPI nor LibTorch (only the torch.save conversion needs LibTorch).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "dcp/checkpoint.h"
#include "dcp/proto/error.h"
#include "dcp/storage/format/dcp_layout.h"
#include "dcp/storage/format/safetensors.h"
#include "dcp/storage/format/torch_dcp.h"
#include "dcp/storage/registry.h"
#include "tools/cli/cli_common.h"
#include "tools/cli/commands.h"
#include "tools/cli/convert.h"

namespace dcp::cli {
namespace {

using nlohmann::ordered_json;

// ---- convert ----

// A path the file conversions (one safetensors or torch.save file) read or write as it is: no
// scheme and no query. Anything else is a location that may carry a query (a plain path takes
// one as its file:// form does, storage/registry.h), read and written as a checkpoint.
bool IsLocalFilePath(const std::string& path) {
  return path.find("://") == std::string::npos && path.find('?') == std::string::npos;
}

std::string GuessFormat(const std::string& path) {
  auto ends = [&](const char* s) {
    const std::string e(s);
    return path.size() >= e.size() && path.compare(path.size() - e.size(), e.size(), e) == 0;
  };
  if (ends(".safetensors")) return "safetensors";
  if (ends(".pt") || ends(".pth") || ends(".bin")) return "torch";
  const ParsedUri uri = ParseUri(path);
  if (uri.scheme == "torchdcp" || uri.scheme == "torchdcp113") return "torchdcp";
  if (auto f = uri.query.find("format"); f != uri.query.end()) {
    if (f->second == "dcp" || f->second == "safetensors") return f->second;
    return "torchdcp";  // torchdcp or torchdcp113
  }
  std::error_code ec;
  const std::filesystem::path p(uri.location);  // a plain path's, without its query
  if (path.find("://") == std::string::npos && !std::filesystem::exists(p / kMetadataName, ec)) {
    if (std::filesystem::exists(p / kTorchDcpMetadataName, ec)) return "torchdcp";
    // A Hugging Face directory (storage/format/safetensors.h).
    if (std::filesystem::exists(p / kSafetensorsIndexName, ec) ||
        std::filesystem::exists(p / kSafetensorsSingleName, ec)) {
      return "safetensors";
    }
  }
  return "dcp";
}

// Between checkpoint formats (dcp and PyTorch DCP, either direction, or re-layout within one;
// from a safetensors directory or file): a load of everything, then a save. Holds the whole
// checkpoint in memory.
void ConvertCheckpoint(const std::string& src, std::string dst, const std::string& to,
                       const ConvertOptions& o) {
  // Diagnosed as every other command does (a missing source is "not a checkpoint", 3), before
  // the load, whose own error would say only "not found".
  CheckDataFiles(OpenCheckpoint(src));
  const StateDict sd = LoadAll(src);
  SaveOptions so;
  // PyTorch DCP's layout on any store: a path becomes torchdcp://, a URI gets the format unless
  // it names one itself (torchdcp113://, ?format=).
  if (to == "torchdcp" && dst.find("://") == std::string::npos) dst = "torchdcp://" + dst;
  const ParsedUri d = ParseUri(dst);
  if (to == "torchdcp" && d.scheme != "torchdcp" && d.scheme != "torchdcp113" &&
      !d.query.count("format")) {
    so.storage.format = CheckpointFormat::kTorchDcp;
  }
  // Hugging Face's sharded layout (a directory), as dcp::Save writes it for ?format=safetensors.
  if (to == "safetensors" && !d.query.count("format")) {
    so.storage.format = CheckpointFormat::kSafetensors;
  }
  so.storage.overwrite = o.overwrite;
  if (o.compress == "zstd") so.storage.compression = Compression::kZstd;
  so.storage.compression_level = o.compress_level;
  so.storage.metadata_version = o.metadata_version;
  Save(sd, dst, so);
}

int Convert(const std::string& src, const std::string& dst, std::string from, std::string to,
            const ConvertOptions& o, bool json) {
  if (from.empty()) from = GuessFormat(src);
  if (to.empty()) to = GuessFormat(dst);
  if (o.compress != "none" && to != "dcp") {
    throw CliError{kUsage, "--compress applies to conversions to dcp"};
  }
  // One safetensors file on the local disk converts to dcp straight from its mapping; any other
  // safetensors source (a sharded directory, a URI) is read as a checkpoint through its layout.
  std::error_code ec;
  const bool local_file = IsLocalFilePath(src) && std::filesystem::is_regular_file(src, ec);
  const bool ckpt_from = from == "dcp" || from == "torchdcp" || from == "safetensors";
  // safetensors to a plain path is one file; to a URI or a path with a query (?format=
  // safetensors), Hugging Face's sharded layout through dcp::Save, as the library writes it.
  const bool ckpt_to =
      to == "dcp" || to == "torchdcp" || (to == "safetensors" && !IsLocalFilePath(dst));
  if (from == "safetensors" && to == "dcp" && local_file) {
    ImportSafetensors(src, dst, o);
  } else if (ckpt_from && ckpt_to) {
    ConvertCheckpoint(src, dst, to, o);
  } else if (ckpt_from && to == "safetensors") {
    const Checkpoint c = OpenCheckpoint(src);
    CheckDataFiles(c);  // before anything the metadata claims is allocated or read
    ExportSafetensors(c, dst, o);
  } else if (ckpt_from && to == "torch") {
    ConvertTorch(true, src, dst, o);
  } else if (from == "torch" && to == "dcp") {
    ConvertTorch(false, src, dst, o);
  } else {
    throw CliError{kUsage, "cannot convert " + from + " to " + to +
                               " (supported: dcp or torchdcp <-> safetensors, safetensors "
                               "directory -> dcp or torchdcp, dcp <-> torchdcp, dcp or torchdcp "
                               "-> torch, torch -> dcp)"};
  }
  // What was written, read back from the result: a checkpoint's metadata (its data bytes), or
  // the file's size and the source checkpoint's entry count (a file's entries are its source's).
  size_t entries = 0;
  uint64_t bytes = 0;
  if (ckpt_to) {
    const Checkpoint out = OpenCheckpoint(
        to == "torchdcp" && dst.find("://") == std::string::npos ? "torchdcp://" + dst : dst);
    entries = out.md.entries.size();
    bytes = out.md.TotalStoredBytes();
  } else {
    entries = OpenCheckpoint(src).md.entries.size();
    bytes = std::filesystem::file_size(dst);
  }
  if (json) {
    const ordered_json j = {{"ok", true},
                            {"source", src},
                            {"destination", dst},
                            {"from", from},
                            {"to", to},
                            {"compression", o.compress},
                            {"overwrite", o.overwrite},
                            {"entries", entries},
                            {"bytes_written", bytes}};
    std::cout << DumpJson(j) << "\n";
  } else {
    std::printf("converted %s (%s) -> %s (%s): %zu entries, %llu bytes\n", Printable(src).c_str(),
                from.c_str(), Printable(dst).c_str(), to.c_str(), entries,
                static_cast<unsigned long long>(bytes));
  }
  return kOk;
}

// For --json: an error as one JSON document on stdout (the message stays on stderr too, for a
// person watching), with the exit code it has without --json.
void PrintJsonError(const CliError& e) {
  const ordered_json j = {
      {"error",
       {{"category", ExitCategory(e.code)}, {"exit_code", e.code}, {"message", e.message}}}};
  std::cout << DumpJson(j) << "\n";
}

int Main(int argc, char** argv) {
  CLI::App app{
      "dcp: inspect, verify, diff and convert dcp checkpoints.\n"
      "PATH is a directory, file://DIR, mem://NAME or a URI of a registered scheme."};
  app.footer(ExitCodeHelp());
  app.set_version_flag("--version", std::string("dcp ") + LibraryVersion());
  app.require_subcommand(1);
  app.fallthrough();
  std::vector<std::string> plugins;
  app.add_option("--plugin", plugins,
                 "load a storage backend plugin (a shared library) before opening PATH")
      ->type_name("LIB");

  std::string path, filter, other;
  bool json = false;
  auto* inspect = app.add_subcommand("inspect", "summary and table of a checkpoint's entries");
  inspect->add_option("PATH", path, "checkpoint location")->required();
  inspect->add_option("--filter", filter, "only entries whose fqn matches this glob")
      ->type_name("GLOB");
  inspect->add_flag("--json", json, "print one JSON document");

  auto* verify = app.add_subcommand(
      "verify", "read every stored item; check checksums, sizes and chunk tiling");
  verify->add_option("PATH", path, "checkpoint location")->required();
  verify->add_flag("--json", json, "print one JSON document (problems, warnings, counts)");

  bool values = false;
  double atol = 0, rtol = 0;
  auto* diff = app.add_subcommand("diff", "differences between two checkpoints");
  diff->add_option("A", path, "first checkpoint")->required();
  diff->add_option("B", other, "second checkpoint")->required();
  diff->add_flag("--values", values, "compare values too: per-tensor max abs and rel difference");
  diff->add_option("--atol", atol, "absolute tolerance for float values (default 0)");
  diff->add_option("--rtol", rtol, "relative tolerance for float values (default 0)");
  diff->add_flag("--json", json, "print one JSON document (differences, entries not compared)");

  std::string from, to;
  ConvertOptions co;
  auto* convert = app.add_subcommand(
      "convert",
      "convert between dcp, PyTorch DCP directories (torchdcp), safetensors, and torch.save "
      "files (with LibTorch)");
  convert->add_option("SRC", path, "source")->required();
  convert->add_option("DST", other, "destination")->required();
  convert->add_option("--from", from, "source format (default: from the name)")
      ->check(CLI::IsMember({"dcp", "torchdcp", "safetensors", "torch"}));
  convert
      ->add_option("--to", to,
                   "destination format (default: from the name: *.safetensors, "
                   "*.pt/*.pth/*.bin = torch, torchdcp:// or torchdcp113:// = torchdcp, "
                   "?format=FMT on a path or URI, else dcp; safetensors is one file at a plain "
                   "path, Hugging Face's sharded layout at a URI or a path with a query)")
      ->check(CLI::IsMember({"dcp", "torchdcp", "safetensors", "torch"}));
  convert->add_flag("--overwrite", co.overwrite, "replace an existing destination");
  convert
      ->add_option("--compress", co.compress,
                   "compress the items of a dcp destination (safetensors -> dcp): none (default) "
                   "or zstd; items that do not shrink by 10% are stored raw")
      ->check(CLI::IsMember({"none", "zstd"}));
  convert->add_option("--compress-level", co.compress_level, "zstd level (default 3)");
  convert
      ->add_option("--metadata-version", co.metadata_version,
                   "metadata version of a dcp destination: 2 (default: rules, a file table and "
                   "per-file indexes) or 1 (every item listed, for readers before version 2)")
      ->check(CLI::IsMember({1u, 2u}));
  size_t budget_mib = 64, budget_bytes = 0;
  convert->add_option("--piece-mib", budget_mib, "memory bound per streamed piece (default 64)");
  convert->add_option("--piece-bytes", budget_bytes, "the same in bytes (overrides --piece-mib)");
  convert->add_flag("--json", json, "print one JSON document (formats, entries, bytes written)");

  bool abort_incomplete = false;
  auto* incomplete = app.add_subcommand(
      "incomplete",
      "list writes left unfinished at a location (s3:// multipart uploads of a crashed save); "
      "--abort discards them under the location's writer lock");
  incomplete->add_option("PATH", path, "location")->required();
  incomplete->add_flag("--abort", abort_incomplete, "discard them (refused while a save runs)");
  incomplete->add_flag("--json", json, "print one JSON document");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    // A bad command line may not have parsed --json itself: it counts where it was given.
    if (rc != 0 && std::any_of(argv + 1, argv + argc,
                               [](const char* a) { return std::strcmp(a, "--json") == 0; })) {
      PrintJsonError({kUsage, e.what()});
    }
    return rc == 0 ? kOk : kUsage;
  }
  try {
    for (const auto& p : plugins) LoadStoragePlugin(p);
    if (inspect->parsed()) return Inspect(path, filter, json);
    if (verify->parsed()) return Verify(path, json);
    if (diff->parsed()) return Diff(path, other, values, atol, rtol, json);
    if (incomplete->parsed()) return Incomplete(path, abort_incomplete, json);
    if (convert->parsed()) {
      co.budget_bytes = budget_bytes ? budget_bytes : std::max<size_t>(1, budget_mib) << 20;
      return Convert(path, other, from, to, co, json);
    }
  } catch (...) {
    const CliError e = ClassifyCurrentException();
    // The message may quote names from a checkpoint (a hostile one's escape codes included).
    std::fprintf(stderr, "dcp: error: %s\n", Printable(e.message, true).c_str());
    if (json) PrintJsonError(e);
    return e.code;
  }
  return kUsage;
}

}  // namespace
}  // namespace dcp::cli

int main(int argc, char** argv) { return dcp::cli::Main(argc, argv); }
