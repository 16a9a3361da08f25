// Device backends, the pinned-buffer pool and the piecewise host<->device pipelines.
//
// Why pieces: a synchronous save of a 10 GiB GPU tensor must not need 10 GiB of host memory,
// and the disk should be busy while the next piece crosses PCIe. Two pinned buffers, each with
// its own stream, give that overlap with the simplest possible ordering: a buffer is refilled
// only after its previous contents were consumed, and consumed only after its stream finished.
#include "dcp/proto/device/device.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "dcp/proto/error.h"
#include "dcp/proto/staging.h"
#include "dcp/proto/tensor_layout.h"

namespace dcp {

#ifdef DCP_HAVE_CUDA
std::shared_ptr<DeviceBackend> MakeCudaBackend();  // proto/device/cuda_device.cc
#endif

namespace {

struct Registry {
  std::mutex mu;
  std::map<Device::Type, std::shared_ptr<DeviceBackend>> overrides;
  std::shared_ptr<DeviceBackend> cuda;  // built-in, created on first use
};

Registry& GetRegistry() {
  static Registry* r = new Registry;  // never destroyed: backends may be used during exit
  return *r;
}

const char* TypeName(Device::Type t) { return t == Device::Type::kCUDA ? "cuda" : "cpu"; }

}  // namespace

bool BuiltWithCuda() {
#ifdef DCP_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

std::shared_ptr<DeviceBackend> FindDeviceBackend(Device::Type type) {
  if (type == Device::Type::kCPU) return nullptr;
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (auto it = r.overrides.find(type); it != r.overrides.end()) return it->second;
#ifdef DCP_HAVE_CUDA
  if (type == Device::Type::kCUDA) {
    if (!r.cuda) r.cuda = MakeCudaBackend();
    return r.cuda;
  }
#endif
  return nullptr;
}

std::shared_ptr<DeviceBackend> DeviceBackendFor(const Device& device, const std::string& what) {
  auto backend = FindDeviceBackend(device.type);
  if (!backend) {
    throw UnsupportedError(what + " lives on " + device.ToString() +
                           ", but this build of dcp has " + "no " + TypeName(device.type) +
                           " support (configure with DCP_WITH_CUDA=ON where the CUDA runtime is "
                           "installed)");
  }
  const int n = backend->device_count();
  if (device.index < 0 || device.index >= n) {
    std::string why = n == 0 ? ": " + backend->unavailable_reason()
                             : " (" + std::to_string(n) + " device(s) visible)";
    throw UnsupportedError(what + " lives on " + device.ToString() + ", which this process " +
                           "cannot use" + why);
  }
  return backend;
}

std::shared_ptr<DeviceBackend> SetDeviceBackend(Device::Type type,
                                                std::shared_ptr<DeviceBackend> backend) {
  if (type == Device::Type::kCPU) throw InvalidArgumentError("the CPU has no device backend");
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::shared_ptr<DeviceBackend> previous;
  if (auto it = r.overrides.find(type); it != r.overrides.end()) previous = it->second;
  if (backend) {
    r.overrides[type] = std::move(backend);
  } else {
    r.overrides.erase(type);
  }
  return previous;
}

// ---- copies ----------------------------------------------------------------------------------

namespace {

// cudaMemcpy2D wants pitches >= width; a broadcast (stride 0) or overlapping side cannot be
// expressed that way, so such copies are issued row by row.
void Emit(DeviceStream& stream, CopyKind kind, const Copy2D& c) {
  if (c.width == 0 || c.height == 0) return;
  if (c.height == 1 || (c.dst_pitch >= c.width && c.src_pitch >= c.width)) {
    stream.CopyAsync(c, kind);
    return;
  }
  for (size_t i = 0; i < c.height; ++i) {
    Copy2D row{static_cast<char*>(c.dst) + i * c.dst_pitch,
               c.width,
               static_cast<const char*>(c.src) + i * c.src_pitch,
               c.width,
               c.width,
               1};
    stream.CopyAsync(row, kind);
  }
}

}  // namespace

void CopyTensorAsync(const TensorView& dst, const TensorView& src, DeviceStream& stream) {
  if (dst.shape != src.shape || dst.dtype != src.dtype) {
    throw InvalidArgumentError("copy from " + src.ToString() + " into " + dst.ToString() +
                               ": shape or dtype differs");
  }
  if (src.numel() == 0) return;
  const bool src_host = src.device.is_cpu(), dst_host = dst.device.is_cpu();
  if (src_host && dst_host) {
    throw InvalidArgumentError("CopyTensorAsync needs a device side, got " + src.ToString() +
                               " -> " + dst.ToString());
  }
  const CopyKind kind = src_host   ? CopyKind::kHostToDevice
                        : dst_host ? CopyKind::kDeviceToHost
                                   : CopyKind::kDeviceToDevice;
  // A view tagged as device memory must be device memory: the runtime would otherwise copy a
  // host buffer without complaint (or fail with an opaque error).
  for (const TensorView* v : {&src, &dst}) {
    if (v->device.is_cpu()) continue;
    DeviceBackendFor(v->device, "tensor " + v->ToString())
        ->CheckDevicePointer(v->data, v->device.index, "tensor " + v->ToString());
  }
  const Shape ds = dst.effective_strides(), ss = src.effective_strides();
  for (size_t i = 0; i < ds.size(); ++i) {
    if (ds[i] < 0 || ss[i] < 0) {
      throw InvalidArgumentError("negative strides are not supported: " + src.ToString() + " -> " +
                                 dst.ToString());
    }
  }
  const size_t es = ElementSize(src.dtype);
  const internal::Layout l = internal::Coalesce(src.shape, ds, ss);
  char* dbase = static_cast<char*>(dst.data);
  const char* sbase = static_cast<const char*>(src.data);
  if (l.sizes.empty()) {  // one element
    Emit(stream, kind, Copy2D{dbase, es, sbase, es, es, 1});
    return;
  }
  // The innermost one or two coalesced dims become one 2-D copy; the rest are iterated.
  const size_t nd = l.sizes.size();
  const bool inner_contig = l.dst_strides.back() == 1 && l.src_strides.back() == 1;
  Copy2D shape;
  size_t outer;  // number of leading dims iterated on the host
  if (inner_contig) {
    shape.width = static_cast<size_t>(l.sizes.back()) * es;
    if (nd >= 2) {
      shape.height = static_cast<size_t>(l.sizes[nd - 2]);
      shape.dst_pitch = static_cast<size_t>(l.dst_strides[nd - 2]) * es;
      shape.src_pitch = static_cast<size_t>(l.src_strides[nd - 2]) * es;
      outer = nd - 2;
    } else {
      shape.dst_pitch = shape.src_pitch = shape.width;
      outer = 0;
    }
  } else {
    shape.width = es;
    shape.height = static_cast<size_t>(l.sizes.back());
    shape.dst_pitch = static_cast<size_t>(l.dst_strides.back()) * es;
    shape.src_pitch = static_cast<size_t>(l.src_strides.back()) * es;
    outer = nd - 1;
  }
  std::vector<int64_t> idx(outer, 0);
  while (true) {
    int64_t doff = 0, soff = 0;
    for (size_t i = 0; i < outer; ++i) {
      doff += idx[i] * l.dst_strides[i];
      soff += idx[i] * l.src_strides[i];
    }
    Copy2D c = shape;
    c.dst = dbase + doff * static_cast<int64_t>(es);
    c.src = sbase + soff * static_cast<int64_t>(es);
    Emit(stream, kind, c);
    size_t k = outer;
    while (k > 0) {
      --k;
      if (++idx[k] < l.sizes[k]) break;
      idx[k] = 0;
      if (k == 0) return;
    }
    if (outer == 0) return;
  }
}

void CopyTensorThroughDevice(const TensorView& dst, const TensorView& src) {
  const Device& dev = src.device.is_cpu() ? dst.device : src.device;
  auto backend = DeviceBackendFor(dev, "tensor " + src.ToString());
  auto stream = backend->NewStream(dev.index);
  CopyTensorAsync(dst, src, *stream);
  stream->Synchronize();
}

// CopyTensor (proto/tensor.h) is defined here, beside the device copies it dispatches to, so that
// proto/tensor.cc needs nothing from proto/device/.
void CopyTensor(const TensorView& dst, const TensorView& src) {
  if (dst.shape != src.shape || dst.dtype != src.dtype) {
    throw InvalidArgumentError("copy from " + src.ToString() + " into " + dst.ToString() +
                               ": shape or dtype differs");
  }
  if (src.numel() == 0) return;
  if (!dst.device.is_cpu() || !src.device.is_cpu()) {
    CopyTensorThroughDevice(dst, src);
    return;
  }
  internal::CopyHostTensor(dst, src);
}

// ---- splitting -------------------------------------------------------------------------------

namespace {

TensorView Flat(const TensorView& v) {
  TensorView f = v;
  f.shape = {v.numel()};
  f.strides.clear();
  return f;
}

void Split(const TensorView& v, size_t max_bytes, std::vector<TensorView>& out) {
  const size_t es = ElementSize(v.dtype);
  if (v.nbytes() <= max_bytes || v.dim() == 0) {
    out.push_back(v);
    return;
  }
  if (IsDense(v)) {  // one byte range: split it flat
    const TensorView f = Flat(v);
    const int64_t per = static_cast<int64_t>(std::max<size_t>(1, max_bytes / es));
    for (int64_t i = 0; i < f.shape[0]; i += per) {
      out.push_back(f.Narrow({i}, {std::min(per, f.shape[0] - i)}));
    }
    return;
  }
  const size_t row_bytes = v.nbytes() / static_cast<size_t>(v.shape[0]);
  Shape off(v.shape.size(), 0), len = v.shape;
  if (row_bytes <= max_bytes) {  // whole rows per piece
    const int64_t per = static_cast<int64_t>(max_bytes / std::max<size_t>(row_bytes, 1));
    for (int64_t r = 0; r < v.shape[0]; r += per) {
      off[0] = r;
      len[0] = std::min(per, v.shape[0] - r);
      out.push_back(v.Narrow(off, len));
    }
    return;
  }
  // A single row is too big: split each row, as a view one dimension lower.
  const Shape st = v.effective_strides();
  for (int64_t r = 0; r < v.shape[0]; ++r) {
    off[0] = r;
    len[0] = 1;
    TensorView row = v.Narrow(off, len);
    row.shape.erase(row.shape.begin());
    row.strides.assign(st.begin() + 1, st.end());
    Split(row, max_bytes, out);
  }
}

}  // namespace

std::vector<TensorView> SplitRowMajor(const TensorView& view, size_t max_bytes) {
  std::vector<TensorView> out;
  if (view.numel() == 0) return out;
  Split(view, std::max<size_t>(max_bytes, 1), out);
  return out;
}

// ---- pinned pool -----------------------------------------------------------------------------

namespace {

struct PinnedPool {
  std::mutex mu;
  struct Idle {
    std::shared_ptr<DeviceBackend> backend;
    void* data;
    size_t size;
  };
  std::vector<Idle> idle;
  uint64_t allocated = 0;
  // Enough for a few concurrent writers' double buffers; more idle buffers are freed.
  static constexpr size_t kMaxIdle = 16;
};

PinnedPool& Pool() {
  static PinnedPool* p = new PinnedPool;  // never destroyed (see Registry)
  return *p;
}

}  // namespace

PinnedBuffer::PinnedBuffer(std::shared_ptr<DeviceBackend> backend, size_t bytes)
    : backend_(std::move(backend)) {
  PinnedPool& pool = Pool();
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    auto best = pool.idle.end();
    for (auto it = pool.idle.begin(); it != pool.idle.end(); ++it) {
      if (it->backend == backend_ && it->size >= bytes &&
          (best == pool.idle.end() || it->size < best->size)) {
        best = it;
      }
    }
    if (best != pool.idle.end()) {
      data_ = best->data;
      size_ = best->size;
      pool.idle.erase(best);
      return;
    }
  }
  size_ = std::max<size_t>(bytes, 4096);
  data_ = backend_->AllocPinned(size_);
  std::lock_guard<std::mutex> lock(pool.mu);
  pool.allocated += size_;
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept
    : backend_(std::move(o.backend_)), data_(o.data_), size_(o.size_) {
  o.data_ = nullptr;
  o.size_ = 0;
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    Release();
    backend_ = std::move(o.backend_);
    data_ = o.data_;
    size_ = o.size_;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

PinnedBuffer::~PinnedBuffer() { Release(); }

void PinnedBuffer::Release() noexcept {
  if (data_ == nullptr) return;
  PinnedPool& pool = Pool();
  PinnedPool::Idle evicted{nullptr, nullptr, 0};
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    pool.idle.push_back({backend_, data_, size_});
    if (pool.idle.size() > PinnedPool::kMaxIdle) {  // drop the smallest
      auto smallest = std::min_element(
          pool.idle.begin(), pool.idle.end(),
          [](const PinnedPool::Idle& a, const PinnedPool::Idle& b) { return a.size < b.size; });
      evicted = *smallest;
      pool.idle.erase(smallest);
    }
  }
  if (evicted.data) evicted.backend->FreePinned(evicted.data);
  data_ = nullptr;
  size_ = 0;
  backend_.reset();
}

uint64_t PinnedBytesAllocated() {
  std::lock_guard<std::mutex> lock(Pool().mu);
  return Pool().allocated;
}

void TrimPinnedPool() {
  std::vector<PinnedPool::Idle> idle;
  {
    std::lock_guard<std::mutex> lock(Pool().mu);
    idle.swap(Pool().idle);
  }
  for (auto& b : idle) b.backend->FreePinned(b.data);
}

// ---- pipelines -------------------------------------------------------------------------------

namespace {

// A pinned buffer with its own stream. The stream is declared last so it is destroyed first:
// its destructor waits for queued copies before the buffer goes back to the pool.
struct Slot {
  PinnedBuffer buffer;
  std::unique_ptr<DeviceStream> stream;
  size_t bytes = 0;  // bytes of the piece in flight, 0 when idle
};

// Both slots of a pipeline over the device tensor `v`: a pinned buffer of one piece (or the
// whole tensor, when smaller) and a stream on v's device.
void InitSlots(Slot (&slots)[2], const TensorView& v, size_t limit) {
  auto backend = DeviceBackendFor(v.device, "tensor " + v.ToString());
  for (auto& s : slots) {
    s.buffer = PinnedBuffer(backend, std::min(limit, v.nbytes()));
    s.stream = backend->NewStream(v.device.index);
  }
}

size_t PieceLimit(const TensorView& v, size_t piece_bytes) {
  const size_t es = ElementSize(v.dtype);
  return std::max(es, piece_bytes / es * es);
}

}  // namespace

void StreamToHost(const TensorView& src, size_t piece_bytes,
                  const std::function<void(const void*, size_t)>& consume) {
  if (src.numel() == 0) return;
  const size_t limit = PieceLimit(src, piece_bytes);
  if (src.device.is_cpu()) {
    if (IsDense(src)) {
      const char* p = static_cast<const char*>(src.data);
      for (size_t pos = 0, n = src.nbytes(); pos < n; pos += limit) {
        consume(p + pos, std::min(limit, n - pos));
      }
      return;
    }
    HostBuffer staging(std::min(limit, src.nbytes()));  // pooled: no allocation when warm
    for (const TensorView& piece : SplitRowMajor(src, limit)) {
      CopyTensor(TensorView::FromContiguous(staging.data(), piece.dtype, piece.shape), piece);
      consume(staging.data(), piece.nbytes());
    }
    return;
  }
  const std::vector<TensorView> pieces = SplitRowMajor(src, limit);
  Slot slots[2];
  InitSlots(slots, src, limit);
  auto issue = [&](size_t i) {
    Slot& s = slots[i % 2];
    const TensorView& piece = pieces[i];
    CopyTensorAsync(TensorView::FromContiguous(s.buffer.data(), piece.dtype, piece.shape), piece,
                    *s.stream);
    s.bytes = piece.nbytes();
  };
  issue(0);
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (i + 1 < pieces.size()) issue(i + 1);  // the other slot was consumed last iteration
    Slot& s = slots[i % 2];
    s.stream->Synchronize();
    consume(s.buffer.data(), s.bytes);
    s.bytes = 0;
  }
}

void StreamFromHost(const TensorView& dst, size_t piece_bytes,
                    const std::function<void(void*, size_t)>& produce) {
  if (dst.numel() == 0) return;
  const size_t limit = PieceLimit(dst, piece_bytes);
  if (dst.device.is_cpu()) {
    if (IsDense(dst)) {
      char* p = static_cast<char*>(dst.data);
      for (size_t pos = 0, n = dst.nbytes(); pos < n; pos += limit) {
        produce(p + pos, std::min(limit, n - pos));
      }
      return;
    }
    HostBuffer staging(std::min(limit, dst.nbytes()));
    for (const TensorView& piece : SplitRowMajor(dst, limit)) {
      produce(staging.data(), piece.nbytes());
      CopyTensor(piece, TensorView::FromContiguous(staging.data(), piece.dtype, piece.shape));
    }
    return;
  }
  const std::vector<TensorView> pieces = SplitRowMajor(dst, limit);
  Slot slots[2];
  InitSlots(slots, dst, limit);
  for (size_t i = 0; i < pieces.size(); ++i) {
    Slot& s = slots[i % 2];
    if (s.bytes) s.stream->Synchronize();  // piece i-2 has left this buffer
    const TensorView& piece = pieces[i];
    produce(s.buffer.data(), piece.nbytes());
    CopyTensorAsync(piece, TensorView::FromContiguous(s.buffer.data(), piece.dtype, piece.shape),
                    *s.stream);
    s.bytes = piece.nbytes();
  }
  for (auto& s : slots) {
    if (s.bytes) s.stream->Synchronize();
  }
}

}  // namespace dcp
