// The kv:// backend registered from user code (linked, no plugin loading): save, load, compare.
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "dcp/dcp.h"
#include "kv_store.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  std::filesystem::remove_all(argv[1]);
  dcp_kv::RegisterKvStore();
  dcp_kv::RegisterKvStore();  // idempotent
  const std::string uri = std::string("kv://") + argv[1];
  dcp::TensorView src = dcp::TensorView::Allocate(dcp::DType::kFloat32, {16, 3});
  for (int i = 0; i < 48; ++i) static_cast<float*>(src.data)[i] = static_cast<float>(i) * 0.5f;
  dcp::StateDict sd;
  sd.Nested("model").Set("w", src);
  sd.Set("note", dcp::Blob{"kv"});
  dcp::Save(sd, uri);
  dcp::TensorView dst = dcp::TensorView::Allocate(dcp::DType::kFloat32, {16, 3});
  dcp::StateDict back;
  back.Nested("model").Set("w", dst);
  back.Set("note", dcp::Blob{});
  dcp::Load(back, uri);
  if (std::memcmp(src.data, dst.data, src.nbytes()) != 0) {
    std::fprintf(stderr, "values differ after a kv:// round trip\n");
    return 1;
  }
  std::printf("kv:// round trip ok at %s\n", uri.c_str());
  return 0;
}
