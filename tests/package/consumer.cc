// A downstream program built against the installed package: saves and loads through mem://.
#include <dcp/dcp.h>
#include <dcp/proto/device/device.h>  // every public header lives under the dcp/ prefix; these two are
#include <dcp/storage/store.h>  // the installed ones dcp.h does not include

#include <cstdio>
#include <vector>

int main() {
  std::vector<float> w(64, 1.5f), back(64, 0.f);
  dcp::StateDict sd, out;
  sd.Set("w", dcp::TensorView::FromContiguous(w.data(), dcp::DType::kFloat32, {8, 8}));
  out.Set("w", dcp::TensorView::FromContiguous(back.data(), dcp::DType::kFloat32, {8, 8}));
  const dcp::SaveResult saved = dcp::Save(sd, "mem://consumer");
  const dcp::LoadResult loaded = dcp::Load(out, "mem://consumer");
  if (back != w || saved.metadata.save_id != loaded.metadata.save_id) return 1;
  std::printf("consumer ok (dcp %s)\n", dcp::LibraryVersion());
  return 0;
}
