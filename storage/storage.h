// Storage interfaces: storage decides *where and how* bytes are kept.
//
// Save (C = coordinator, rank 0): every rank SetUp -> PrepareLocalPlan; C PrepareGlobalPlan;
// every rank WriteData (returns a future); C Finish writes the Metadata, whose atomic appearance
// is what makes the checkpoint exist. After a failure that is known to have committed nothing,
// every rank calls Abort; a rank whose outcome is unknown, or a save that failed after its
// commit, removes nothing (docs/PROTOCOL.md).
// Load: C ReadMetadata (broadcast by the orchestrator); every rank SetUp -> PrepareLocalPlan;
// C PrepareGlobalPlan; every rank ReadData.
//
// A writer or reader object serves one save or load at a time and is used from one thread,
// except that the futures it returns complete on threads of its own. Errors are dcp::Error:
// thrown directly, or carried by the returned futures.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "dcp/planner/planner.h"
#include "dcp/proto/plan.h"

namespace dcp {

/// Per-item compression of stored bytes on save (see StorageOptions::compression).
enum class Compression : uint8_t { kNone = 0, kZstd = 1 };

/// How a checkpoint is laid out (docs/FORMAT.md, docs/TORCH_DCP.md). Any format can be written
/// to any Store-based backend; a reader detects the format of what it finds.
enum class CheckpointFormat : uint8_t {
  kDcp,          // dcp's own (docs/FORMAT.md)
  kTorchDcp,     // torch.distributed.checkpoint as torch 2.x writes it
  kTorchDcp113,  // torch 1.13's torch.distributed._shard.checkpoint
  kSafetensors,  // Hugging Face safetensors (docs/SAFETENSORS.md): whole tensors, each file
                 // written by one rank from shards the ranks exchange (StorageContext::exchange)
};
/// "dcp", "torchdcp", "torchdcp113", "safetensors": the names URIs (`?format=`) and the CLI use.
std::string_view CheckpointFormatName(CheckpointFormat format);
/// The format named `name`; InvalidArgumentError listing the names otherwise.
CheckpointFormat ParseCheckpointFormat(std::string_view name);

/// Staging one writer of the generic Store protocol may hold at once (see memory_budget_bytes).
constexpr size_t kWriterStagingBytes = size_t{80} << 20;

/// Options every backend understands; settings of one backend go in `backend`.

struct StorageOptions {
  /// Replace an existing checkpoint at the same location (atomically: the old one stays
  /// loadable until the new metadata is in place). Without it, saving over one is refused.
  bool overwrite = false;
  /// Data files per rank, written in parallel; items are balanced across them by size.
  int files_per_rank = 1;
  /// Make data and metadata durable (fsync) before reporting success.
  bool sync = true;
  /// Verify the CRC32C of every item read (on by default).
  bool verify_checksums = true;
  /// Threads a rank uses for reading.
  int read_threads = 2;
  /// Upper bound on the scratch memory one read thread uses (bytes; at least 64 are used).
  /// Items that land whole in a contiguous destination, or whose overlap is one byte range
  /// read into a dense destination, are read straight into it; everything else (resharding,
  /// strided destinations) is read in pieces of at most this size (slabs of whole rows of the
  /// stored chunk, narrowed to deeper dimensions when one row is too big) and copied. Never a
  /// whole-tensor or whole-checkpoint buffer.
  size_t max_scratch_bytes = 32 << 20;
  /// A read that covers only part of a stored item cannot check the item's CRC32C from the
  /// bytes it needs. With this set (and verify_checksums), a partial read of an item with block
  /// CRCs (checksum_block_bytes) verifies the blocks it touches, reading at most a block more at
  /// each end of each contiguous run; one of an item without them streams the whole stored item
  /// through the scratch buffer once per rank to verify it (extra I/O, bounded memory). Without
  /// it, partial reads are not verified. Whole-item reads are always verified.
  bool verify_partial_reads = true;
  /// Writers of the dcp format, metadata version 2: the block size of the per-block CRC32Cs each
  /// data file records for its raw items longer than one block (its block table,
  /// docs/FORMAT.md), computed in the same pass as the item's CRC32C. A power of two from 4 KiB
  /// to 1 GiB (InvalidArgumentError otherwise); 0 writes no table, and partial reads of the
  /// checkpoint then verify whole items (verify_partial_reads). Readers ignore it.
  uint64_t checksum_block_bytes = uint64_t{1} << 20;
  /// Peak extra host memory one rank's save or load may use for staging (bytes). Each
  /// concurrent writer (one per data file) costs up to kWriterStagingBytes: a store's write
  /// buffers (file://: 2 x 16 MiB), a 16 MiB gather buffer for strided tensors and 2 x 16 MiB
  /// page-locked pieces for device tensors. Each read thread costs max_scratch_bytes plus the
  /// same device pieces. Files and read threads beyond what fits are processed one after
  /// another; at least one always runs. Buffers are pooled, so after the first save or load no
  /// staging memory is allocated again.
  size_t memory_budget_bytes = 256 << 20;
  /// Compress items on save with zstd (the "zstd" transform of docs/FORMAT.md), item by item:
  /// items under `compression_min_bytes` and items that do not shrink to at most
  /// `compression_max_ratio` of their raw size are stored raw, so a checkpoint may hold a mix.
  /// Items over 8 MiB are judged on their first 8 MiB (storage/format/zstd_transform.h). Loads read
  /// any mix of compressed and raw items whatever this says. A compressed item's crc32c covers
  /// its stored (compressed) bytes; zstd's own checksum covers the raw bytes and is always
  /// checked on load. Whole-item reads into dense tensors decompress straight into them; other
  /// reads of a compressed item go through the scratch buffer and need zstd's window too (up
  /// to 8 MiB for levels up to 19, 128 MiB for 20-22); all use an input buffer of at most
  /// min(max_scratch_bytes, 1 MiB). A partial (resharding) read of a compressed item
  /// decompresses it from its start to the end of the box, or to its end when it is verified.
  Compression compression = Compression::kNone;
  /// zstd level: 1 (fastest) to 19 (smallest; 20 to 22 need far more memory), negative levels
  /// for zstd's fast modes. 3 is zstd's default.
  int compression_level = 3;
  /// zstd worker threads per data file; 0 compresses on the thread writing the file.
  int compression_threads = 0;
  /// Items with fewer raw bytes than this are stored raw.
  uint64_t compression_min_bytes = 4096;
  /// An item stays compressed only when its compressed size is at most this fraction of its
  /// raw size (in (0, 1]); otherwise it is stored raw.
  double compression_max_ratio = 0.9;
  /// Writers: the layout to write (Store-based backends write every format; a backend with its
  /// own writer refuses one it cannot write). Readers detect the format and ignore this. A
  /// URI's `?format=` query sets it too (registry.h).
  CheckpointFormat format = CheckpointFormat::kDcp;
  /// Writers of the dcp format: the metadata version to write (docs/FORMAT.md). 2 (the default)
  /// records regularly sharded tensors as rules and keeps where each item lies in an index at
  /// the end of each data file, so the metadata grows with tensors + files, not tensors x ranks;
  /// 1 lists every stored item in the metadata (what dcp before version 2 reads). Other formats
  /// and readers ignore it (a reader reads both versions).
  uint32_t metadata_version = 2;
  /// Writers of the dcp format, metadata version 2: record each item's XXH3-128 (of its raw
  /// bytes, computed in the pass that computes its CRC32C) in the data files' indexes, which
  /// makes the checkpoint format version 3 (docs/FORMAT.md, section 5b; dcp before it refuses
  /// to read one). What incremental saves compare items by: a checkpoint that a later save
  /// names as its incremental_base needs them. Implied by incremental_base.
  bool content_hashes = false;
  /// Incremental save: a committed checkpoint beside this one (the same parent location; its
  /// name, e.g. "step_0000000100" for ".../run/step_0000000200") whose items this save may
  /// keep where they are instead of writing them again. An item is kept when the base holds it
  /// (same entry, same chunk, same dtype and raw size, stored raw unless compression is on,
  /// with a content hash) and its bytes hash the same, or without hashing when its key is
  /// under one of `frozen_prefixes`. The new checkpoint's indexes then point at the base's
  /// files (or at the files the base itself shares), so removing the base by hand breaks it:
  /// CheckpointManager counts these references in its retention (docs/GUIDE.md). Empty: a
  /// self-contained checkpoint. InvalidArgumentError for a name that is not a plain name;
  /// a base that is absent, unreadable or saved without content hashes shares nothing (said
  /// on stderr once per save by rank 0). The dcp format, metadata version 2, only.
  std::string incremental_base;
  /// Incremental saves: state-dict keys (an entry's fqn or a prefix ending at a key boundary,
  /// "model.base" covers "model.base.w" but not "model.baseline") whose items are kept from
  /// incremental_base without hashing them again, when the base holds them as above. Declare
  /// only what the job never changes (frozen weights): a changed frozen item is not noticed.
  std::vector<std::string> frozen_prefixes;
  /// Settings of the URI's backend, as key -> value strings (registry.h lists the built-in
  /// ones: file:// and s3://). A URI's query (`s3://bucket/ckpt?part_size_mib=16`) adds to
  /// them. A key the backend does not know fails the save or load with InvalidArgumentError
  /// naming it: nothing here is silently ignored.
  std::map<std::string, std::string> backend;
};

/// Collective byte exchange among the ranks of one save, for writers whose files hold data of
/// several ranks (safetensors: whole tensors). dcp::Save provides one over its Communicator
/// (storage cannot depend on dcp/). Called by every rank in the same order, from the thread that
/// called WriteData; failures are dcp::Error (a peer that does not answer: CollectiveError).
class RankExchange {
 public:
  virtual ~RankExchange() = default;
  /// Send `to[r]` to rank r (to.size() == world size); returns what every rank sent this rank
  /// (index = sender). `what` names the step in errors.
  virtual std::vector<std::string> AllToAll(std::vector<std::string> to, std::string_view what) = 0;
};

struct StorageContext {
  int rank = 0;
  int world_size = 1;
  bool is_coordinator = true;
  /// Saves: this save's id (the same on every rank); it names the data files and is recorded in
  /// the committed metadata, so a rank can tell whether the metadata in place is this save's.
  std::string save_id;
  /// Saves: the exchange among the ranks (null where the caller has none: a writer that needs it
  /// refuses a save of more than one rank).
  RankExchange* exchange = nullptr;
};

class StorageWriter {
 public:
  virtual ~StorageWriter() = default;
  /// Where this writer writes (a URI), for messages.
  virtual std::string uri() const = 0;
  /// Called on every rank first. The coordinator refuses (AlreadyExistsError) when a checkpoint
  /// exists and overwrite is off.
  virtual void SetUp(const StorageContext& ctx) = 0;
  virtual SavePlan PrepareLocalPlan(SavePlan plan) = 0;
  /// Coordinator only: e.g. give each rank's plan its file names (in storage_data).
  virtual std::vector<SavePlan> PrepareGlobalPlan(std::vector<SavePlan> plans) = 0;
  /// True when PrepareGlobalPlan changes nothing but each plan's storage_data, whatever the
  /// items (StoreWriter: it names each rank's files). The protocol may then plan regularly
  /// sharded tensors compactly (planner/compact_plan.h) and hand PrepareGlobalPlan only each
  /// rank's other items. Default false: every plan in full.
  virtual bool GlobalPlanOnlyNamesFiles() const { return false; }
  /// Write every item of `plan`, fetching bytes from `planner.ResolveData`. The future yields
  /// one WriteResult per item. `plan` and `planner` must outlive the future.
  virtual std::future<std::vector<WriteResult>> WriteData(const SavePlan& plan,
                                                          const SavePlanner& planner) = 0;
  /// Coordinator only, after every rank's writes succeeded: record where each item lives in
  /// `metadata` and commit it durably and atomically. A failure once the metadata may be
  /// visible must be a CommitError (kCommitted, or kUnknown when it cannot be told): the
  /// protocol then removes nothing; any other exception means nothing was committed.
  ///
  /// When FinishTakesFilledStorage() is true, the protocol may instead pass `results` with no
  /// item at all and `metadata.storage` already filled with every rank's results
  /// (FillStorageFromEncoded): at thousands of ranks, the results held decoded beside the
  /// metadata they fill would be most of the coordinator's memory.
  virtual void Finish(Metadata& metadata, const std::vector<std::vector<WriteResult>>& results) = 0;
  /// Whether Finish accepts `metadata.storage` filled and `results` empty (see Finish). Default
  /// false: Finish gets every rank's results decoded.
  virtual bool FinishTakesFilledStorage() const { return false; }
  /// Coordinator only, after a successful Finish and after every rank was sent the verdict
  /// (the committed metadata): housekeeping that must not delay the verdict, e.g. removing the
  /// files of dead saves. Its failures are reported (not thrown): the save is committed
  /// whatever happens here. Default: nothing.
  virtual void AfterCommitDelivered() noexcept {}
  /// Discard what this rank wrote in the current save. Called only when the save is known not to
  /// be committed. Never throws; idempotent.
  virtual void Abort() noexcept = 0;
  /// True when this writer writes version-2 metadata (docs/FORMAT.md): each data file ends in an
  /// index of its items, written by the rank that wrote it, and the coordinator needs only the
  /// files (TakeDataFiles), not every item's WriteResult. The metadata passed to Finish then has
  /// format_version 2, `files` filled and `storage` empty. It must answer alike on every rank.
  /// Declared last, like the readers' additions, so that writers built against an earlier
  /// header keep their vtable layout. Default false.
  virtual bool WritesFileIndexes() const { return false; }
  /// With WritesFileIndexes, after WriteData's future completed: the files this rank wrote in
  /// this save, their indexes written (moved out). A file's `index_copy` goes into the
  /// metadata as it is: a writer fills it only within its share of kMetadataIndexCopyBytes
  /// (proto/schema/codec.h), or leaves it empty.
  virtual std::vector<DataFile> TakeDataFiles() { return {}; }
  /// With WritesFileIndexes: the format version of the indexes this writer writes, 2, or 3 when
  /// they record content hashes and references (StorageOptions::content_hashes); the commit
  /// records it as the metadata's. It must answer alike on every rank. Default 2.
  virtual uint32_t FileIndexFormatVersion() const { return 2; }
};

/// Cooperative reads (planner/coop_reads.h): how the owner of a stored item reads it once,
/// front to back, to scatter its parts. Used from the thread running the load, while no ReadData
/// of the same reader is in progress.
class ItemStreamer {
 public:
  virtual ~ItemStreamer() = default;
  /// The raw bytes of tensor chunk `index` when this reader can stream it (resolving where it
  /// lies, which may read an index), else 0 (a transformed item, an unknown one): its readers
  /// then read it themselves. Errors as ReadData's for the indexes it reads.
  virtual uint64_t StreamableLength(const MetadataIndex& index) = 0;
  /// Read the item StreamableLength accepted in slabs of `slab_bytes` (the last may be shorter):
  /// on_slab(offset in the item, bytes, n) once per slab, in order, the buffer valid only during
  /// the call. The item's checksum (when verify_checksums and it has one) is checked before the
  /// last slab is delivered: a mismatch throws CorruptionError naming the item and its file, and
  /// the last slab is never delivered. Exceptions of on_slab propagate.
  virtual void StreamItem(const MetadataIndex& index, uint64_t slab_bytes,
                          const std::function<void(uint64_t, const char*, size_t)>& on_slab) = 0;
};

class StorageReader {
 public:
  virtual ~StorageReader() = default;
  virtual std::string uri() const = 0;
  /// Read and validate the metadata. NotFoundError when there is no checkpoint (the message
  /// says whether data files without metadata, i.e. an unfinished save, are present);
  /// CorruptionError or UnsupportedError for a damaged or newer metadata file.
  virtual Metadata ReadMetadata() = 0;
  virtual void SetUp(const Metadata& metadata, const StorageContext& ctx) = 0;
  virtual LoadPlan PrepareLocalPlan(LoadPlan plan) = 0;
  virtual std::vector<LoadPlan> PrepareGlobalPlan(std::vector<LoadPlan> plans) = 0;
  /// Read every item of `plan` into the planner's destinations. `plan` and `planner` must
  /// outlive the future. Checksum mismatches and truncated data fail with CorruptionError naming
  /// the fqn, the file and the offset.
  virtual std::future<void> ReadData(const LoadPlan& plan, LoadPlanner& planner) = 0;
  /// True when PrepareGlobalPlan returns the plans it is given unchanged (StoreReader). With the
  /// default planner, whose global step changes nothing either, dcp::Load then plans on every
  /// rank alone and no rank sends its plan (docs/PROTOCOL.md, "Load"). Default false: the
  /// coordinator gathers every plan and runs both global steps. Declared last, so that readers
  /// built against an earlier header keep their vtable layout.
  virtual bool GlobalPlanChangesNothing() const { return false; }
  /// The wire encoding (EncodeMetadata) of the metadata ReadMetadata last returned, moved out,
  /// when the reader holds it as read (StoreReader on the dcp format: the metadata file's
  /// payload); empty otherwise. dcp::Load broadcasts it instead of encoding the metadata again:
  /// at thousands of ranks, encoding it again takes seconds of the coordinator's time that every
  /// rank waits for. Declared last, like GlobalPlanChangesNothing.
  virtual std::string TakeEncodedMetadata() { return {}; }
  /// After SetUp: this reader's item streamer for cooperative reads, owned by the reader and
  /// valid until the next SetUp, or nullptr (the default) when it has none: its loads then read
  /// no stored item for another rank. Declared last, like GlobalPlanChangesNothing.
  virtual ItemStreamer* item_streamer() { return nullptr; }
};

}  // namespace dcp
