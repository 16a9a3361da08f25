// Makes the small checkpoints the CLI tests work on: 2 ranks (threads of one process), a
// row-sharded, a column-sharded and a middle-dimension-sharded tensor, a replicated one, mixed
// dtypes, a scalar, a blob. Values follow simple formulas that tests/cli/cli_test.py recomputes
// independently.
//
//   dcp_cli_fixture DIR [--changed] [--zstd]
//   --changed: model.w[1][2] += 0.5; --zstd: compress every item that gets smaller (a mix)
#include <cstring>
#include <iostream>
#include <thread>

#include "dcp/dcp.h"

using namespace dcp;

namespace {

uint16_t ToHalf(float f) {  // exact for the small multiples of 1/8 used here
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  if ((x & 0x7fffffff) == 0) return static_cast<uint16_t>(sign);
  const int exp = static_cast<int>((x >> 23) & 0xff) - 127 + 15;
  return static_cast<uint16_t>(sign | (exp << 10) | ((x >> 13) & 0x3ff));
}

uint16_t ToBFloat16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  return static_cast<uint16_t>(x >> 16);
}

struct Globals {
  TensorView w = TensorView::Allocate(DType::kFloat32, {6, 5});
  TensorView c = TensorView::Allocate(DType::kFloat32, {4, 6});
  TensorView h = TensorView::Allocate(DType::kFloat16, {3, 4});
  TensorView bf = TensorView::Allocate(DType::kBFloat16, {5});
  TensorView step = TensorView::Allocate(DType::kInt64, {});
  TensorView mask = TensorView::Allocate(DType::kBool, {7});
  TensorView i8 = TensorView::Allocate(DType::kInt8, {2, 3});
  TensorView k = TensorView::Allocate(DType::kFloat64, {2, 3, 4});
};

void Fill(Globals& g, bool changed) {
  auto* w = static_cast<float*>(g.w.data);
  for (int i = 0; i < 6; ++i)
    for (int j = 0; j < 5; ++j) w[i * 5 + j] = i * 10 + j + 0.25f;
  if (changed) w[1 * 5 + 2] += 0.5f;
  auto* c = static_cast<float*>(g.c.data);
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 6; ++j) c[i * 6 + j] = (i - j) * 0.5f;
  auto* h = static_cast<uint16_t*>(g.h.data);
  for (int i = 0; i < 12; ++i) h[i] = ToHalf(i / 8.0f);
  auto* bf = static_cast<uint16_t*>(g.bf.data);
  for (int i = 0; i < 5; ++i) bf[i] = ToBFloat16(i - 2.5f);
  *static_cast<int64_t*>(g.step.data) = 1234567890123;
  auto* mask = static_cast<uint8_t*>(g.mask.data);
  for (int i = 0; i < 7; ++i) mask[i] = i % 2 == 0;
  auto* i8 = static_cast<int8_t*>(g.i8.data);
  for (int i = 0; i < 6; ++i) i8[i] = static_cast<int8_t>(i - 3);
  auto* k = static_cast<double*>(g.k.data);
  for (int i = 0; i < 24; ++i) k[i] = (i / 12) * 100 + (i / 4 % 3) * 10 + i % 4;
}

StateDict RankState(Globals& g, int rank) {
  StateDict sd;
  // model.w: rows 0-3 on rank 0, 3-6 on rank 1. model.c: columns 0-2 / 2-6 (strided views).
  const int64_t r0 = rank == 0 ? 0 : 3, c0 = rank == 0 ? 0 : 2, cn = rank == 0 ? 2 : 4;
  sd.Nested("model")
      .Set("w", ShardedTensor{DType::kFloat32, {6, 5}, {{g.w.Narrow({r0, 0}, {3, 5}), {r0, 0}}}})
      .Set("c", ShardedTensor{DType::kFloat32, {4, 6}, {{g.c.Narrow({0, c0}, {4, cn}), {0, c0}}}})
      .Set("h", g.h)  // replicated: written once
      .Set("bf", g.bf)
      // model.k: a 3-d tensor sharded along its middle dimension (1 / 2 of 3 on ranks 0 / 1).
      .Set("k", ShardedTensor{DType::kFloat64,
                              {2, 3, 4},
                              {{g.k.Narrow({0, rank, 0}, {2, rank + 1, 4}), {0, rank, 0}}}});
  sd.Set("step", g.step).Set("mask", g.mask).Set("i8", g.i8);
  sd.Set("rng", Blob{std::string("\x00\x01\xffstate", 8)});
  return sd;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: dcp_cli_fixture DIR [--changed] [--zstd]\n";
    return 2;
  }
  const std::string dir = argv[1];
  bool changed = false;
  SaveOptions so;
  for (int i = 2; i < argc; ++i) {
    if (std::strcmp(argv[i], "--changed") == 0) {
      changed = true;
    } else if (std::strcmp(argv[i], "--zstd") == 0) {
      so.storage.compression = Compression::kZstd;
      so.storage.compression_min_bytes = 0;  // the items are tiny: compress whatever shrinks
      so.storage.compression_max_ratio = 1;
    } else {
      std::cerr << "unknown option " << argv[i] << "\n";
      return 2;
    }
  }
  Globals g;
  Fill(g, changed);
  InProcessGroup group(2);
  std::vector<std::exception_ptr> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        StateDict sd = RankState(g, r);
        Save(sd, dir, group.communicator(r), so);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) {
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& ex) {
        std::cerr << "save failed: " << ex.what() << "\n";
        return 1;
      }
    }
  }
  return 0;
}
