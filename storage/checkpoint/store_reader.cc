// The read path of the checkpoint protocol over a Store: the metadata (whatever layout wrote
// it, storage/format/layout.h), then each rank's items, file by file, with every item's checksum
// verified as its bytes land: large whole items split into pieces that all read threads share,
// device destinations through pinned pieces, resharding reads through bounded scratch, and
// transformed items (zstd, torch.save records) read by their layout's ItemDecoder
// (storage/format/layout.h).
#include <algorithm>
#include <atomic>
#include <future>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>

#include "dcp/proto/checksum.h"
#include "dcp/proto/device/device.h"
#include "dcp/proto/error.h"
#include "dcp/proto/executor.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/proto/slab_copy.h"
#include "dcp/proto/staging.h"
#include "dcp/storage/checkpoint/box_read.h"
#include "dcp/storage/checkpoint/store_checkpoint.h"
#include "dcp/storage/format/layout.h"

namespace dcp {

namespace {

// Large whole items are read in pieces so that all read threads have work (device
// destinations in pieces of kDevicePieceBytes, the size of a reader's pinned buffer): host
// pieces of at least this size, and no more pieces than the readers can take (HostPieceBytes).
constexpr uint64_t kReadPieceBytes = uint64_t{32} << 20;

// A verified read lands in steps of this size, each CRC'd at once while its bytes are still in
// the CPU cache: a second pass over a large piece would stream it from memory again, which is
// what held warm (page-cache) loads below the speed of a plain read.
constexpr size_t kHotReadBytes = size_t{1} << 20;

// Items of a file run smaller than this are announced to the store (PrefetchRanges) so that a
// remote one fetches them in a few large requests instead of one each.
constexpr uint64_t kCoalesceBelowBytes = uint64_t{8} << 20;

// A location listed for its sizes (ListSizes) while the metadata is read: at most this many
// objects (5 pages on s3://, one after another), past which each data file's size is asked for
// instead. A location holds one checkpoint, so many objects there are its data files, whose
// size queries (16 at a time) would take far longer.
constexpr size_t kMaxListedObjects = 5000;

// The running checksum of one item as it is read, of the kind the item stores (StoredCrcKind),
// so that every load path checks each kind.
struct RunningCrc {
  ChecksumKind kind = ChecksumKind::kCrc32c;
  uint32_t value = 0;
  void Add(const void* p, size_t n) { value = ChecksumExtend(kind, value, p, n); }
};

// The bytes of an item at `base` of `in`, read as asked; with `crc`, CRC'd in order of reading.
struct PlainItemBytes : ItemBytes {
  PlainItemBytes(ReadableObject& in, uint64_t base, RunningCrc* crc)
      : in(in), base(base), crc(crc) {}
  void Read(uint64_t at, void* dst, size_t n) override {
    in.ReadAt(base + at, dst, n);
    if (crc) crc->Add(dst, n);
  }
  ReadableObject& in;
  uint64_t base;
  RunningCrc* crc;
};

bool HasCrc(const StorageInfo& info) { return StoredCrc(info).has_value(); }
RunningCrc NewCrc(const StorageInfo& info) { return {StoredCrcKind(info), 0}; }

// Read n bytes at `offset` of `in` into dst; with `crc`, fold each step into *crc as it lands.
void ReadHot(ReadableObject& in, uint64_t offset, void* dst, size_t n, RunningCrc* crc) {
  if (crc == nullptr) {
    in.ReadAt(offset, dst, n);
    return;
  }
  // Each piece is CRC'd as it lands: in small steps (cache-hot) by default, a backend's own
  // pieces where it has them (s3://: one per ranged GET, the others still in flight).
  const char* p = static_cast<const char*>(dst);
  in.ReadAtStreaming(offset, dst, n, kHotReadBytes,
                     [&](size_t pos, size_t k) { crc->Add(p + pos, k); });
}

// A reader thread's way into device memory: two pinned pieces, each with its own stream, so
// the host-to-device copy of one piece runs while the thread reads the next from storage.
// A piece's completion (verify, commit) is deferred until its copy is known to have finished:
// when its slot is needed again, or at Drain. Not thread-safe: one per reader thread.
class DeviceStaging {
 public:
  DeviceStaging(Device device, const std::string& what) : device_(device) {
    auto backend = DeviceBackendFor(device, what);
    for (Slot& s : slots_) {
      s.buffer = PinnedBuffer(backend, kDevicePieceBytes);
      s.stream = backend->NewStream(device.index);
    }
  }
  DeviceStaging(const DeviceStaging&) = delete;
  DeviceStaging& operator=(const DeviceStaging&) = delete;
  // Only reached with copies in flight when an error is already on its way out: wait for them
  // (the pinned buffers go back to the pool, and a later load may refill them), and drop their
  // completions, whose tensors are not committed.
  ~DeviceStaging() {
    for (Slot& s : slots_) {
      if (!s.in_flight) continue;
      try {
        s.stream->Synchronize();
      } catch (...) {  // the error that brought us here is the one reported
      }
    }
  }

  const Device& device() const { return device_; }

  // Read [offset, offset + n) of `in` into the contiguous device tensor `dst` at byte `at`
  // (n <= kDevicePieceBytes), CRC-ing into *crc as it lands. `on_copied` runs on this thread
  // once the copy has finished (at a later call or at Drain).
  void Read(ReadableObject& in, uint64_t offset, const TensorView& dst, uint64_t at, size_t n,
            RunningCrc* crc, std::function<void()> on_copied) {
    Slot& s = slots_[next_];
    Finish(s);  // the slot's previous copy, issued two pieces ago
    next_ ^= 1;
    ReadHot(in, offset, s.buffer.data(), n, crc);
    const TensorView to = TensorView::FromContiguous(
        static_cast<char*>(dst.data) + at, DType::kUInt8, {static_cast<int64_t>(n)}, dst.device);
    CopyTensorAsync(
        to, TensorView::FromContiguous(s.buffer.data(), DType::kUInt8, {static_cast<int64_t>(n)}),
        *s.stream);
    s.in_flight = true;
    s.on_copied = std::move(on_copied);
  }

  // Wait for both copies in flight, older first, and run their completions.
  void Drain() {
    Finish(slots_[next_]);
    Finish(slots_[next_ ^ 1]);
  }

 private:
  struct Slot {
    PinnedBuffer buffer;
    std::unique_ptr<DeviceStream> stream;
    bool in_flight = false;
    std::function<void()> on_copied;
  };
  void Finish(Slot& s) {
    if (!s.in_flight) return;
    s.in_flight = false;
    auto done = std::move(s.on_copied);
    s.on_copied = nullptr;
    s.stream->Synchronize();
    if (done) done();
  }

  Device device_;
  Slot slots_[2];
  int next_ = 0;
};

// The units of a load's work. Large whole items bound for contiguous memory are split into
// pieces that any reader reads into place (host) or through its pinned piece (device), each
// CRC'd on its own (the CRCs combine), so every read thread streams one big file; everything
// else is read file run by file run.
struct Split {
  size_t item;
  TensorView dst;
  uint64_t piece_bytes;
  std::vector<RunningCrc> crcs;
  std::atomic<size_t> remaining{0};
};
struct ReadTask {
  size_t file;
  std::vector<size_t> items;  // a run of items for ReadFile, or
  Split* split = nullptr;     // one piece of a split item
  uint64_t begin = 0, length = 0;
  size_t piece = 0;
  uint64_t bytes = 0;  // to read
};

// A load's tasks, in file order, and the split items their pieces belong to.
struct ReadWork {
  std::vector<std::unique_ptr<Split>> splits;
  std::vector<ReadTask> tasks;
};

// Add a split item's pieces (of file f) to the work, one task each.
void AddSplitItem(ReadWork& work, size_t f, size_t i, const StorageInfo& info,
                  const TensorView& dst, uint64_t piece_bytes) {
  auto& sp = work.splits.emplace_back(std::make_unique<Split>());
  sp->item = i;
  sp->dst = dst;
  sp->piece_bytes = piece_bytes;
  const size_t pieces = (info.length + piece_bytes - 1) / piece_bytes;
  sp->crcs.assign(pieces, NewCrc(info));
  sp->remaining = pieces;
  for (size_t k = 0; k < pieces; ++k) {
    const uint64_t b = k * piece_bytes, n = std::min<uint64_t>(piece_bytes, info.length - b);
    work.tasks.push_back({f, {}, sp.get(), b, n, k, n});
  }
}

// Hands a load's tasks out to its readers, until they are done or one has failed.
//
// Each reader owns a stripe: a contiguous run of the tasks (in file order) of about equal
// bytes, read front to back through one open object per file, so the kernel sees one
// sequential stream per reader. Its readahead then ramps up to large page-cache folios,
// and a later warm load pays per folio: readers handed alternate pieces, each through a
// fresh open file, left ~20x more folios and a ~20% slower warm load (measured here).
// A reader whose stripe is done takes tasks from the back of the fullest other stripe.
class TaskQueue {
 public:
  TaskQueue(const std::vector<ReadTask>& tasks, size_t nreaders) {
    uint64_t total = 0, done = 0;
    for (const ReadTask& t : tasks) total += t.bytes;
    size_t begin = 0;
    for (size_t i = 0; i < tasks.size(); ++i) {
      done += tasks[i].bytes;
      if (stripes_.size() + 1 < nreaders && done * nreaders >= total * (stripes_.size() + 1)) {
        stripes_.push_back({begin, i + 1});
        begin = i + 1;
      }
    }
    stripes_.push_back({begin, tasks.size()});
    while (stripes_.size() < nreaders) stripes_.push_back({tasks.size(), tasks.size()});
  }

  // The next task for `reader`; none once every task is taken or a reader has failed.
  std::optional<size_t> Take(size_t reader) {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return std::nullopt;
    Stripe& own = stripes_[reader];
    if (own.front < own.back) return own.front++;
    Stripe* fullest = nullptr;
    for (Stripe& s : stripes_) {
      if (s.front < s.back && (!fullest || s.back - s.front > fullest->back - fullest->front)) {
        fullest = &s;
      }
    }
    if (!fullest) return std::nullopt;
    return --fullest->back;
  }

  // Called in a catch block: keeps the first error, and stops handing out work.
  void Fail() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!first_error_) first_error_ = std::current_exception();
    stopped_ = true;
  }

  // Once every reader is done.
  void RethrowFirstError() const {
    if (first_error_) std::rethrow_exception(first_error_);
  }

 private:
  struct Stripe {
    size_t front, back;
  };
  std::vector<Stripe> stripes_;
  std::mutex mu_;
  bool stopped_ = false;
  std::exception_ptr first_error_;
};

// The object a reader has open, reused across its tasks while they are in one file.
// Each object is told `buffer_limit`, the reader's share of the memory budget for the store's
// read-ahead buffers.
// `sizes`: the files whose sizes the checkpoint records (version 2's file table), opened
// without a size query (Store::OpenKnownSize); the metadata's reader checked them.
class OpenObject {
 public:
  OpenObject(Store& store, size_t buffer_limit,
             const std::unordered_map<std::string, uint64_t>& sizes)
      : store_(store), buffer_limit_(buffer_limit), sizes_(sizes) {}
  ReadableObject& Get(const std::string& name) {
    if (!in_ || name_ != name) {
      in_.reset();
      auto known = sizes_.find(name);
      in_ = known == sizes_.end() ? store_.Open(name) : store_.OpenKnownSize(name, known->second);
      in_->LimitBuffers(buffer_limit_);
      name_ = name;
    }
    return *in_;
  }

 private:
  Store& store_;
  size_t buffer_limit_;
  const std::unordered_map<std::string, uint64_t>& sizes_;
  std::string name_;
  std::unique_ptr<ReadableObject> in_;
};

class StoreReader : public StorageReader {
 public:
  StoreReader(std::shared_ptr<Store> store, StorageOptions options)
      : store_(std::move(store)), options_(std::move(options)) {}

  std::string uri() const override { return store_->uri(); }

  Metadata ReadMetadata() override {
    // The common case first, without asking whether it is there (on an object store the
    // question is a round trip of its own): dcp's metadata, which DetectLayout would pick first.
    // Meanwhile the location is listed where a listing states sizes (ListSizes): the data
    // files' check then needs no size query of its own (one round trip, or thousands at scale).
    Listed listed;
    {
      std::optional<Metadata> md;
      ParallelFor(
          2,
          [&](size_t i) {
            if (i == 1) {
              listed = ListDataSizes();
              return;
            }
            try {
              md = LayoutFor(CheckpointFormat::kDcp).ReadMetadata(*store_, &encoded_);
            } catch (const NotFoundError&) {
              // Not a dcp checkpoint (or none): the layouts are asked below.
            }
          },
          2);
      if (md) {
        CheckDataFiles(*md, listed);
        return std::move(*md);
      }
    }
    if (const CheckpointLayout* layout = DetectLayout(*store_)) {
      Metadata md = layout->ReadMetadata(*store_, &encoded_);
      CheckDataFiles(md, listed);
      return md;
    }
    const auto names = store_->List();
    // Messages name dcp's own commit marker: the format a save writes unless told otherwise.
    const std::string& marker = LayoutFor(CheckpointFormat::kDcp).metadata_name();
    if (std::any_of(names.begin(), names.end(), IsAnyDataFile)) {
      throw NotFoundError("incomplete checkpoint at " + store_->uri() +
                          ": data files are present but " + marker +
                          " is missing (the save did not finish)");
    }
    throw NotFoundError("no checkpoint at " + store_->uri() + " (" + marker + " not found)");
  }

  void SetUp(const Metadata& metadata, const StorageContext& ctx) override {
    metadata_ = &metadata;
    ctx_ = ctx;
    resolved_.clear();
    decoders_ = NewItemDecoders(LoadContext{*store_, metadata, options_});
    index_resolver_.reset();
    file_sizes_.clear();
    if (metadata.format_version >= 2) {
      index_resolver_ = NewItemLocator(*store_, metadata);
      for (const DataFile& f : metadata.files) file_sizes_[f.name] = f.size;
    }
    streamer_ = NewStoreItemStreamer(
        {*store_, options_, metadata, index_resolver_.get(), resolved_, decoders_, file_sizes_});
  }
  ItemStreamer* item_streamer() override { return streamer_.get(); }

  LoadPlan PrepareLocalPlan(LoadPlan plan) override { return plan; }
  std::vector<LoadPlan> PrepareGlobalPlan(std::vector<LoadPlan> plans) override { return plans; }
  bool GlobalPlanChangesNothing() const override { return true; }
  std::string TakeEncodedMetadata() override { return std::exchange(encoded_, {}); }

  std::future<void> ReadData(const LoadPlan& plan, LoadPlanner& planner) override {
    if (index_resolver_) {
      // Version 2: where the planned items lie, from the indexes of their writers' files only.
      std::vector<MetadataIndex> wanted;
      wanted.reserve(plan.items.size());
      for (const ReadItem& item : plan.items) wanted.push_back(item.storage_index);
      index_resolver_->Resolve(wanted, resolved_);
      // The block CRCs of items read in part: only their files' block tables are read.
      std::vector<MetadataIndex> partial;
      for (const ReadItem& item : plan.items) {
        if (VerifiesPartial() && ReadsPart(item)) partial.push_back(item.storage_index);
      }
      if (!partial.empty()) index_resolver_->ResolveBlocks(partial, resolved_);
    }
    for (auto& decoder : decoders_) decoder->Prepare(plan, resolved_);
    FileItems files = ItemsByFile(plan);
    return Spawn([this, &plan, &planner, files = std::move(files)] {
             ReadWork work = PlanReadWork(plan, planner, files, HostPieceBytes(plan));
             const size_t nthreads = ReaderCount(work.tasks.size());
             TaskQueue queue(work.tasks, nthreads);
             {
               std::vector<Task<void>> readers;  // their destructors wait, also on a throw
               // Half of each reader's share of the budget for the store's read-ahead (the
               // rest: its scratch and device pieces).
               const size_t buffer_limit = options_.memory_budget_bytes / nthreads / 2;
               for (size_t t = 1; t < nthreads; ++t) {
                 readers.push_back(Spawn([&, t] {
                   RunReader(plan, planner, files, work.tasks, queue, t, buffer_limit);
                 }));
               }
               RunReader(plan, planner, files, work.tasks, queue, 0, buffer_limit);
               for (auto& r : readers) r.get();
             }
             queue.RethrowFirstError();
           })
        .ToFuture();
  }

 private:
  // Each file's items (indices into the plan), by file name.
  using FileItems = std::vector<std::pair<std::string, std::vector<size_t>>>;

  // The plan's items grouped by file and sorted by offset, so each file is read front to back.
  FileItems ItemsByFile(const LoadPlan& plan) const {
    std::map<std::string, std::vector<size_t>> by_file;
    for (size_t i = 0; i < plan.items.size(); ++i) {
      by_file[Info(plan.items[i]).relative_path].push_back(i);
    }
    FileItems files(by_file.begin(), by_file.end());
    for (auto& [name, items] : files) {
      std::stable_sort(items.begin(), items.end(), [&](size_t a, size_t b) {
        return Info(plan.items[a]).offset < Info(plan.items[b]).offset;
      });
    }
    return files;
  }

  // The load cut into tasks (see Split and ReadTask): split items piece by piece, runs of the
  // others.
  // Pieces beyond what the readers take in parallel only cut a reader's stream: a remote store
  // keeps several requests in flight within one read (s3://: read_ahead_parts ranged GETs) and
  // drains them at every piece's end. A rank with one reader reads an item whole.
  uint64_t HostPieceBytes(const LoadPlan& plan) const {
    uint64_t total = 0;
    for (const ReadItem& item : plan.items) total += Info(item).length;
    const uint64_t readers = ReaderCount(SIZE_MAX);
    return std::max<uint64_t>(kReadPieceBytes, (total + readers - 1) / readers);
  }

  ReadWork PlanReadWork(const LoadPlan& plan, LoadPlanner& planner, const FileItems& files,
                        uint64_t host_piece_bytes) const {
    ReadWork work;
    for (size_t f = 0; f < files.size(); ++f) {
      std::vector<size_t> run;
      uint64_t run_bytes = 0;
      auto end_run = [&] {
        if (!run.empty()) work.tasks.push_back({f, std::move(run), nullptr, 0, 0, 0, run_bytes});
        run.clear();
        run_bytes = 0;
      };
      for (size_t i : files[f].second) {
        const ReadItem& item = plan.items[i];
        const StorageInfo& info = Info(item);
        TensorView dst;
        uint64_t piece_bytes = host_piece_bytes;
        if (!IsSplit(planner, item, info, &dst, &piece_bytes)) {
          // Runs of smaller items are cut into pieces too, so that every read thread has work
          // even when a rank's items sit in one file.
          run.push_back(i);
          run_bytes += info.length;
          if (run_bytes >= host_piece_bytes) end_run();
          continue;
        }
        end_run();
        AddSplitItem(work, f, i, info, dst, piece_bytes);
      }
      end_run();
    }
    return work;
  }

  // Whether an item is read in pieces: a whole raw tensor item larger than a piece, whose
  // destination is contiguous. If so, *dst is that destination and *piece_bytes the piece size
  // (kDevicePieceBytes for a device destination).
  bool IsSplit(LoadPlanner& planner, const ReadItem& item, const StorageInfo& info, TensorView* dst,
               uint64_t* piece_bytes) const {
    if (item.type == ReadItemType::kBytes || !info.transforms.empty() ||
        info.length <= kDevicePieceBytes || item.lengths != StoredChunk(item).sizes) {
      return false;
    }
    *dst = planner.ResolveTensor(item);
    if (!dst->device.is_cpu()) *piece_bytes = kDevicePieceBytes;
    return dst->is_contiguous() && dst->nbytes() == info.length && info.length > *piece_bytes;
  }

  // As many readers as asked for, work units, and the memory budget allow.
  size_t ReaderCount(size_t tasks) const {
    const size_t per_reader = ScratchLimit() + 2 * kDevicePieceBytes;
    return std::clamp<size_t>(
        std::min<size_t>(options_.read_threads, options_.memory_budget_bytes / per_reader), 1,
        std::max<size_t>(tasks, 1));
  }

  // One read thread: the tasks `queue` hands it, through its own scratch buffer, open object
  // and (for device pieces) pinned pieces. Errors go to the queue.
  void RunReader(const LoadPlan& plan, LoadPlanner& planner, const FileItems& files,
                 const std::vector<ReadTask>& tasks, TaskQueue& queue, size_t reader,
                 size_t buffer_limit) {
    HostBuffer scratch;  // from the process-wide pool (proto/staging.h), returned at the end
    OpenObject open(*store_, buffer_limit, file_sizes_);
    std::optional<DeviceStaging> staging;  // made at this thread's first device piece
    while (const std::optional<size_t> t = queue.Take(reader)) {
      const ReadTask& task = tasks[*t];
      try {
        ReadableObject& in = open.Get(files[task.file].first);
        if (task.split == nullptr) {
          ReadFile(plan, planner, files[task.file].first, in, task.items, scratch);
        } else {
          ReadPiece(plan, planner, in, task, staging);
        }
      } catch (...) {
        queue.Fail();
      }
    }
    try {
      if (staging) staging->Drain();
    } catch (...) {
      queue.Fail();
    }
  }

  // One piece of a split item: read into place (host), or through `staging` (device).
  void ReadPiece(const LoadPlan& plan, LoadPlanner& planner, ReadableObject& in,
                 const ReadTask& task, std::optional<DeviceStaging>& staging) const {
    Split& sp = *task.split;
    const ReadItem& item = plan.items[sp.item];
    const StorageInfo& info = Info(item);
    RunningCrc* crc = options_.verify_checksums ? &sp.crcs[task.piece] : nullptr;
    if (sp.dst.device.is_cpu()) {
      ReadHot(in, info.offset + task.begin, static_cast<char*>(sp.dst.data) + task.begin,
              task.length, crc);
      CompletePiece(plan, planner, sp);
      return;
    }
    if (staging && staging->device() != sp.dst.device) {
      staging->Drain();
      staging.reset();
    }
    if (!staging) staging.emplace(sp.dst.device, "tensor " + item.dest_index.ToString());
    // The piece completes once its copy has: while this thread reads the next piece.
    staging->Read(in, info.offset + task.begin, sp.dst, task.begin, task.length, crc,
                  [this, &plan, &planner, &sp] { CompletePiece(plan, planner, sp); });
  }

  // A piece of a split item is done. The last one combines the pieces' CRCs, verifies, hands
  // the tensor over.
  void CompletePiece(const LoadPlan& plan, LoadPlanner& planner, Split& sp) const {
    if (--sp.remaining != 0) return;
    const ReadItem& item = plan.items[sp.item];
    const StorageInfo& info = Info(item);
    uint32_t crc = sp.crcs[0].value;
    for (size_t k = 1; k < sp.crcs.size(); ++k) {
      const uint64_t n = std::min<uint64_t>(sp.piece_bytes, info.length - k * sp.piece_bytes);
      crc = ChecksumCombine(sp.crcs[k].kind, crc, sp.crcs[k].value, n);
    }
    VerifyCrc(item, info, crc);
    planner.CommitTensor(item, sp.dst);
  }

  // Whether a tensor item reads less than its stored item (by its raw bytes: no chunk copied).
  bool ReadsPart(const ReadItem& item) const {
    return item.type == ReadItemType::kTensor &&
           static_cast<uint64_t>(NumElements(item.lengths)) * ElementSize(Entry(item).dtype) <
               Info(item).raw_length;
  }

  const StorageInfo& Info(const ReadItem& item) const {
    if (!resolved_.empty()) {
      auto r = resolved_.find(item.storage_index);
      if (r != resolved_.end()) return r->second;
    }
    auto it = metadata_->storage.find(item.storage_index);
    if (it == metadata_->storage.end()) {
      throw CorruptionError(store_->uri() + ": metadata has no stored item " +
                            item.storage_index.ToString());
    }
    return it->second;
  }

  // Every data file must hold the bytes the metadata places in it, checked before a load (or
  // load_all) allocates anything the metadata claims: a blob claiming 8 GiB in a 266-byte file
  // fails here, at the cost of one Size() per file, not after an 8 GiB allocation.
  // What the location's listing says of each object's size (empty where the store has no
  // listing with sizes, or it failed: the check then asks each file's size).
  using Listed = std::unordered_map<std::string, uint64_t>;
  Listed ListDataSizes() const noexcept {
    Listed out;
    try {
      if (auto sizes = store_->ListSizes(kMaxListedObjects)) {
        for (auto& [name, size] : *sizes) out.emplace(std::move(name), size);
      }
    } catch (...) {
      // Only a shortcut: every size is then asked for.
    }
    return out;
  }

  // The sizes of `files`: the listing's where it shows at least `need[i]` bytes, else the
  // store's own answer (a listing may predate a write, so it only ever confirms).
  std::vector<std::optional<uint64_t>> SizesOf(const std::vector<const std::string*>& files,
                                               const std::vector<uint64_t>& need,
                                               const Listed& listed) const {
    std::vector<std::optional<uint64_t>> sizes(files.size());
    std::vector<size_t> ask;
    for (size_t i = 0; i < files.size(); ++i) {
      auto it = listed.find(*files[i]);
      if (it != listed.end() && it->second >= need[i]) {
        sizes[i] = it->second;
      } else {
        ask.push_back(i);
      }
    }
    // One size query per file; on an object store each is a round trip, so they go out
    // together (a 4,096-rank checkpoint has 4,096 files).
    ParallelFor(
        ask.size(), [&](size_t k) { sizes[ask[k]] = store_->Size(*files[ask[k]]); },
        std::min<size_t>(std::max<size_t>(ask.size(), 1), kStoreRequestsInFlight));
    return sizes;
  }

  void CheckDataFiles(const Metadata& md, const Listed& listed) const {
    if (md.format_version >= 2) return CheckFileTable(md, listed);
    std::map<std::string, std::pair<uint64_t, const MetadataIndex*>> need;  // file -> furthest
    for (const auto& [index, info] : md.storage) {
      auto& n = need.try_emplace(info.relative_path, 0, &index).first->second;
      if (info.offset + info.length > n.first) n = {info.offset + info.length, &index};
    }
    // Judged in file order.
    std::vector<const std::string*> files;
    std::vector<uint64_t> needed;
    for (const auto& [file, n] : need) {
      files.push_back(&file);
      needed.push_back(n.first);
    }
    const std::vector<std::optional<uint64_t>> sizes = SizesOf(files, needed, listed);
    size_t i = 0;
    for (const auto& [file, n] : need) {
      const std::optional<uint64_t>& size = sizes[i++];
      if (!size) {
        throw NotFoundError("data file '" + store_->uri() + "/" + file + "' is missing: " +
                            n.second->ToString() + " and the other items it holds cannot be read");
      }
      if (*size < n.first) {
        throw CorruptionError("truncated data file '" + store_->uri() + "/" + file + "' (" +
                              std::to_string(*size) + " bytes): " + n.second->ToString() +
                              " needs bytes up to " + std::to_string(n.first));
      }
    }
  }

  // Version 2: every file of the table exists with the size it records, and what the entries
  // claim is backed by the stored bytes (every tensor's elements fit in what the files hold, at
  // zstd's most): a load_all allocates the shapes before reading.
  void CheckFileTable(const Metadata& md, const Listed& listed) const {
    std::vector<const std::string*> files;
    std::vector<uint64_t> needed;
    std::vector<int32_t> writers;
    // Version 3: the files of earlier checkpoints that items point at, each once.
    std::set<std::string_view> references;
    for (const DataFile& f : md.files) {
      files.push_back(&f.name);
      needed.push_back(f.size);
      writers.push_back(f.writer);
      for (const DataFileReference& r : f.references) {
        if (!references.insert(r.name).second) continue;
        files.push_back(&r.name);
        needed.push_back(r.size);
        writers.push_back(f.writer);
      }
    }
    const std::vector<std::optional<uint64_t>> sizes = SizesOf(files, needed, listed);
    uint64_t stored = 0;
    for (size_t i = 0; i < files.size(); ++i) {
      const std::string& name = *files[i];
      const bool shared = IsSiblingReference(name);
      const std::string what =
          "data file '" + store_->uri() + "/" + name + "'" +
          (shared ? " (of the earlier checkpoint '" + name.substr(3, name.find('/', 3) - 3) +
                        "', which this one shares)"
                  : "");
      if (!sizes[i]) {
        throw NotFoundError(what + " is missing: the items of rank " + std::to_string(writers[i]) +
                            " it holds cannot be read");
      }
      if (*sizes[i] < needed[i]) {
        throw CorruptionError("truncated " + what + " (" + std::to_string(*sizes[i]) +
                              " bytes, the metadata records " + std::to_string(needed[i]) + ")");
      }
      stored += needed[i];
    }
    const uint64_t most =
        stored > UINT64_MAX / kMaxZstdExpansion ? UINT64_MAX : stored * kMaxZstdExpansion;
    uint64_t claimed = 0;
    for (const auto& [fqn, entry] : md.entries) {
      const auto* t = std::get_if<TensorMetadata>(&entry);
      const uint64_t add = t ? static_cast<uint64_t>(NumElements(t->shape)) * ElementSize(t->dtype)
                             : std::get<BytesMetadata>(entry).size;
      claimed = add > UINT64_MAX - claimed ? UINT64_MAX : claimed + add;
      if (claimed > most) {
        throw CorruptionError(store_->uri() + ": the entries claim more bytes (" +
                              std::to_string(claimed) + " by " + ClippedName(fqn) +
                              ") than its data files can hold");
      }
    }
  }

  ChunkMeta StoredChunk(const ReadItem& item) const {
    return dcp::StoredChunk(*metadata_, item, store_->uri());
  }

  void Verify(const ReadItem& item, const StorageInfo& info, const void* data, size_t n) const {
    if (!options_.verify_checksums || !HasCrc(info)) return;
    RunningCrc crc = NewCrc(info);
    crc.Add(data, n);
    VerifyCrc(item, info, crc.value);
  }

  const TensorMetadata& Entry(const ReadItem& item) const { return StoredEntry(*metadata_, item); }

  size_t ScratchLimit() const { return dcp::ScratchLimit(options_); }
  bool VerifiesPartial() const {
    return options_.verify_partial_reads && options_.verify_checksums;
  }

  void EnsureScratch(HostBuffer& scratch, size_t n) const {
    if (n > ScratchLimit()) throw InternalError("scratch request over the limit");
    scratch.Reserve(n);
  }

  void VerifyCrc(const ReadItem& item, const StorageInfo& info, uint32_t actual) const {
    const std::optional<uint32_t> stored = StoredCrc(info);
    if (!options_.verify_checksums || !stored || actual == *stored) return;
    throw CorruptionError("checksum mismatch for " + item.storage_index.ToString() + " in '" +
                          store_->uri() + "/" + info.relative_path + "' at offset " +
                          std::to_string(info.offset) + " (" + std::to_string(info.length) +
                          " bytes): stored " + std::string(StoredCrcName(info)) + " " +
                          std::to_string(*stored) + ", computed " + std::to_string(actual));
  }

  // The byte ranges of `in` that reading `items` (in order) starts with, of the items under
  // kCoalesceBelowBytes: a whole item's bytes, the rows a partial item's box touches (widened to
  // the blocks they touch when it has block CRCs; without them a verified partial read may then
  // stream the whole item again, a large read of its own). Larger items
  // are left out: they are large requests already, and a streamed read lands them in place.
  std::vector<ByteRange> RangesOf(const LoadPlan& plan, const std::vector<size_t>& items) const {
    std::vector<ByteRange> ranges;
    for (size_t i : items) {
      const ReadItem& item = plan.items[i];
      const StorageInfo& info = Info(item);
      if (!info.transforms.empty()) {  // read by a decoder: as one range, or in its own way
        const ItemDecoder* decoder = DecoderOf(info);
        if (!decoder || !decoder->ReadsStoredRange()) continue;
      }
      ByteRange r{info.offset, info.length};
      if (item.type == ReadItemType::kTensor && info.transforms.empty()) {
        const ChunkMeta& chunk = StoredChunk(item);
        const size_t esize = ElementSize(Entry(item).dtype);
        if (item.lengths != chunk.sizes && !item.lengths.empty() &&
            chunk.sizes.size() == item.lengths.size() &&
            info.length == static_cast<uint64_t>(chunk.numel()) * esize) {
          // The rows (indices of the first dimension) the box touches: ReadBox reads whole
          // rows through scratch, and at most them.
          const uint64_t row = static_cast<uint64_t>(ContiguousStrides(chunk.sizes)[0]) * esize;
          if (std::find(item.lengths.begin(), item.lengths.end(), 0) != item.lengths.end()) {
            continue;
          }
          uint64_t lo = static_cast<uint64_t>(item.storage_offsets[0]) * row;
          uint64_t hi = lo + static_cast<uint64_t>(item.lengths[0]) * row;
          if (info.blocks.log2 != 0 && VerifiesPartial()) {  // and the blocks they touch
            const uint64_t b = info.blocks.count ? uint64_t{1} << info.blocks.log2
                                                 : std::max<uint64_t>(info.length, 1);
            lo -= lo % b;
            hi = std::min(info.length, (hi + b - 1) / b * b);
          }
          r = {info.offset + lo, hi - lo};
        }
      }
      if (r.length < kCoalesceBelowBytes) ranges.push_back(r);
    }
    return ranges;
  }

  // Whole items that land straight in dense host destinations are read as one stream
  // (ReadManyStreaming), so that a remote store keeps its requests going from one item into
  // the next; each is verified and committed when its last byte has landed.
  struct Landing {
    size_t item;
    TensorView dst;
    RunningCrc crc;
    bool check;
  };

  void ReadFile(const LoadPlan& plan, LoadPlanner& planner, const std::string& name,
                ReadableObject& in, const std::vector<size_t>& items, HostBuffer& scratch) {
    std::set<MetadataIndex> verified;  // stored items whose CRC a partial read already checked
    // A run of items, often small and adjacent: say what is coming so that a remote store can
    // fetch it in a few large requests rather than one per item (store.h).
    if (items.size() > 1) {
      const std::vector<ByteRange> ranges = RangesOf(plan, items);
      if (ranges.size() > 1) in.PrefetchRanges(ranges);
    }
    std::vector<Landing> stream;
    for (size_t i : items) {
      const ReadItem& item = plan.items[i];
      const StorageInfo& info = Info(item);
      if (!info.transforms.empty()) {
        ReadLandings(plan, planner, in, stream);
        ReadTransformed(planner, item, info, in, name, scratch, verified);
        continue;
      }
      if (item.type == ReadItemType::kBytes) {
        ReadLandings(plan, planner, in, stream);
        ReadBytesItem(planner, item, info, in, name);
        continue;
      }
      const ChunkMeta& chunk = StoredChunk(item);
      const auto& entry = Entry(item);
      TensorView dst = CheckedDestination(planner, item, entry);
      if (item.lengths == chunk.sizes && dst.is_contiguous() && dst.device.is_cpu() &&
          info.length == dst.nbytes() && info.length > 0) {
        // The common case: the stored chunk lands directly in its destination.
        stream.push_back({i, dst, NewCrc(info), options_.verify_checksums && HasCrc(info)});
        continue;
      }
      ReadLandings(plan, planner, in, stream);
      ReadTensorItem(item, info, chunk, entry, dst, in, name, scratch, verified);
      planner.CommitTensor(item, dst);
    }
    ReadLandings(plan, planner, in, stream);
  }

  // Read the items of `stream` (Landing), verify and commit each; leaves `stream` empty.
  void ReadLandings(const LoadPlan& plan, LoadPlanner& planner, ReadableObject& in,
                    std::vector<Landing>& stream) const {
    if (stream.size() == 1) {  // one item: as ReadHot reads it (one ReadAt when unchecked)
      Landing& l = stream[0];
      const ReadItem& item = plan.items[l.item];
      const StorageInfo& info = Info(item);
      ReadHot(in, info.offset, l.dst.data, info.length, l.check ? &l.crc : nullptr);
      if (l.check) VerifyCrc(item, info, l.crc.value);
      planner.CommitTensor(item, l.dst);
      stream.clear();
    }
    if (stream.empty()) return;
    std::vector<ReadTarget> targets;
    targets.reserve(stream.size());
    for (const Landing& l : stream) {
      targets.push_back({Info(plan.items[l.item]).offset, l.dst.data, l.dst.nbytes()});
    }
    in.ReadManyStreaming(targets, kHotReadBytes, [&](size_t t, size_t pos, size_t len) {
      Landing& l = stream[t];
      const ReadItem& item = plan.items[l.item];
      const StorageInfo& info = Info(item);
      if (l.check) l.crc.Add(static_cast<const char*>(l.dst.data) + pos, len);
      if (pos + len < info.length) return;
      if (l.check) VerifyCrc(item, info, l.crc.value);
      planner.CommitTensor(item, l.dst);
    });
    stream.clear();
  }

  // A raw blob, read whole and verified.
  void ReadBytesItem(LoadPlanner& planner, const ReadItem& item, const StorageInfo& info,
                     ReadableObject& in, const std::string& name) const {
    std::string bytes = AllocateOrThrow(
        [&] { return std::string(info.length, '\0'); },
        item.storage_index.ToString() + " from '" + store_->uri() + "/" + name + "'", info.length);
    in.ReadAt(info.offset, bytes.data(), bytes.size());
    Verify(item, info, bytes.data(), bytes.size());
    planner.LoadBytes(item, std::move(bytes));
  }

  // A raw tensor item that does not land as one range in dense host memory: an empty one, a
  // whole one bound for a device, or a box of the stored chunk (a resharding read), read into
  // `dst` and verified as far as its options ask.
  void ReadTensorItem(const ReadItem& item, const StorageInfo& info, const ChunkMeta& chunk,
                      const TensorMetadata& entry, const TensorView& dst, ReadableObject& in,
                      const std::string& name, HostBuffer& scratch,
                      std::set<MetadataIndex>& verified) const {
    const size_t esize = ElementSize(entry.dtype);
    const bool whole = item.lengths == chunk.sizes;
    if (whole && dst.is_contiguous() && dst.device.is_cpu() && info.length == dst.nbytes()) {
      return;  // empty: nothing to read
    }
    if (whole && !dst.device.is_cpu() && info.length == dst.nbytes()) {
      // A device destination: read piece by piece into pinned buffers, each piece's
      // host-to-device copy overlapping the next read (proto/device/device.h).
      RunningCrc crc = NewCrc(info);
      uint64_t pos = info.offset;
      StreamFromHost(dst, kDevicePieceBytes, [&](void* buf, size_t n) {
        ReadHot(in, pos, buf, n, &crc);
        pos += n;
      });
      VerifyCrc(item, info, crc.value);
      return;
    }
    if (info.length != static_cast<uint64_t>(chunk.numel()) * esize) {
      throw CorruptionError("stored item " + item.storage_index.ToString() + " in '" + name +
                            "' has " + std::to_string(info.length) + " bytes, expected " +
                            std::to_string(chunk.numel() * esize));
    }
    if (!whole && info.blocks.log2 != 0 && VerifiesPartial()) {
      // Block CRCs: every read of a box checks the blocks it touches (box_read.h).
      BlockVerifier v(in, info, item.storage_index.ToString(),
                      store_->uri() + "/" + info.relative_path, ScratchLimit());
      ReadBox(v, entry.dtype, chunk.sizes, item.storage_offsets, item.lengths, dst, scratch,
              ScratchLimit());
      return v.Finish();
    }
    RunningCrc crc = NewCrc(info);
    const bool verify_partial =
        !whole && VerifiesPartial() && HasCrc(info) && !verified.count(item.storage_index);
    // A box over every index of the first dimension (a column block of a row-major chunk)
    // is read through scratch as the whole chunk, front to back: its CRC comes with it, and
    // the verify pass below would read the same bytes a second time.
    const bool streams_whole =
        verify_partial && ReadsWholeChunk(chunk.sizes, item.storage_offsets, item.lengths, esize,
                                          dst, ScratchLimit());
    PlainItemBytes src(in, info.offset, whole || streams_whole ? &crc : nullptr);
    ReadBox(src, entry.dtype, chunk.sizes, item.storage_offsets, item.lengths, dst, scratch,
            ScratchLimit());
    if (whole) {
      VerifyCrc(item, info, crc.value);
    } else if (streams_whole) {
      verified.insert(item.storage_index);
      VerifyCrc(item, info, crc.value);
    } else if (verify_partial) {
      verified.insert(item.storage_index);
      VerifyStreamed(item, info, in, scratch);
    }
  }

  // Stream the whole stored item through the scratch buffer to check its CRC.
  void VerifyStreamed(const ReadItem& item, const StorageInfo& info, ReadableObject& in,
                      HostBuffer& scratch) const {
    RunningCrc c = NewCrc(info);
    for (uint64_t pos = 0; pos < info.length;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(ScratchLimit(), info.length - pos));
      EnsureScratch(scratch, n);
      in.ReadAt(info.offset + pos, scratch.data(), n);
      c.Add(scratch.data(), n);
      pos += n;
    }
    VerifyCrc(item, info, c.value);
  }

  // The decoder of a transformed item (nullptr: none reads it).
  ItemDecoder* DecoderOf(const StorageInfo& info) const {
    for (const auto& decoder : decoders_) {
      if (decoder->Decodes(info)) return decoder.get();
    }
    return nullptr;
  }

  // An item stored transformed: read by its layout's decoder.
  void ReadTransformed(LoadPlanner& planner, const ReadItem& item, const StorageInfo& info,
                       ReadableObject& in, const std::string& name, HostBuffer& scratch,
                       std::set<MetadataIndex>& verified) {
    ItemDecoder* decoder = DecoderOf(info);
    if (!decoder) {
      std::string t;
      for (const auto& x : info.transforms) t += (t.empty() ? "" : "+") + x;
      throw UnsupportedError("item " + item.storage_index.ToString() + " in '" + name +
                             "' uses transform '" + t + "', which this build cannot read");
    }
    decoder->Read({planner, item, info, in, name, scratch, verified});
  }

  std::shared_ptr<Store> store_;
  StorageOptions options_;
  const Metadata* metadata_ = nullptr;
  std::unique_ptr<ItemLocator> index_resolver_;  // version 2
  std::string encoded_;  // the last ReadMetadata's wire encoding, when its file held it
  StorageContext ctx_;
  std::unordered_map<std::string, uint64_t> file_sizes_;  // version 2: the file table's
  std::map<MetadataIndex, StorageInfo> resolved_;         // transformed items read as plain items
  std::vector<std::unique_ptr<ItemDecoder>> decoders_;    // this load's (SetUp)
  std::unique_ptr<ItemStreamer> streamer_;                // cooperative reads (SetUp)
};

}  // namespace

std::unique_ptr<StorageReader> MakeStoreReader(std::shared_ptr<Store> store,
                                               const StorageOptions& options) {
  return std::make_unique<StoreReader>(std::move(store), options);
}

}  // namespace dcp
