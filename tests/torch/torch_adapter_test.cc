// LibTorch brings glog, whose CHECK macro would shadow Catch's: use the CATCH_ prefixed macros.
#define CATCH_CONFIG_PREFIX_ALL
#include "dcp/torch_adapter.h"

#include <catch2/catch.hpp>

#include "dcp/dcp.h"
#include "dcp/storage/backends/mem_store.h"

using namespace dcp;

CATCH_TEST_CASE("torch: dtype mapping round trips for every dtype LibTorch has", "[torch]") {
  int mapped = 0;
  for (DType dt : AllDTypes()) {
    c10::ScalarType st;
    try {
      st = ToTorchDType(dt);
    } catch (const UnsupportedError& e) {
      // Not in this LibTorch (fp8 before 2.1, uint16/32/64 before 2.3); the message says so.
      CATCH_CHECK_THAT(e.what(), Catch::Matchers::Contains(std::string(DTypeName(dt))));
      continue;
    }
    CATCH_CHECK(FromTorchDType(st) == dt);
    CATCH_CHECK(c10::elementSize(st) == ElementSize(dt));
    ++mapped;
  }
  CATCH_CHECK(mapped >= 13);
  CATCH_CHECK_THROWS_AS(FromTorchDType(c10::ScalarType::QInt8), UnsupportedError);
}

CATCH_TEST_CASE("torch: a module's parameters save and load in place, keeping identity",
                "[torch]") {
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Linear(8, 16), torch::nn::BatchNorm1d(16),
                            torch::nn::Linear(16, 4));
  net->forward(torch::randn({5, 8}));  // moves BatchNorm running stats
  ClearMemStore("torch-module");
  StateDict sd;
  AddModuleState(*net, sd);
  CATCH_CHECK(sd.size() >= 8);
  Save(sd, "mem://torch-module");

  std::vector<torch::Tensor> before;
  std::vector<void*> ptrs;
  for (const auto& p : net->parameters()) {
    before.push_back(p.detach().clone());
    ptrs.push_back(p.data_ptr());
  }
  {
    torch::NoGradGuard g;
    for (auto& p : net->parameters()) p.uniform_();
  }
  StateDict back;
  AddModuleState(*net, back);
  Load(back, "mem://torch-module");
  auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    CATCH_CHECK(params[i].data_ptr() == ptrs[i]);  // same storage: loaded in place
    CATCH_CHECK(torch::equal(params[i], before[i]));
  }
}

CATCH_TEST_CASE("torch: non-contiguous tensors and ToTorch aliasing", "[torch]") {
  torch::Tensor base = torch::arange(24, torch::kFloat64).reshape({4, 6});
  torch::Tensor t = base.t();  // non-contiguous
  TensorView v = FromTorch(t);
  CATCH_CHECK_FALSE(v.is_contiguous());
  ClearMemStore("torch-nc");
  StateDict sd;
  sd.Set("t", v);
  Save(sd, "mem://torch-nc");
  torch::Tensor out = torch::zeros({6, 4}, torch::kFloat64);
  StateDict back;
  back.Set("t", FromTorch(out));
  Load(back, "mem://torch-nc");
  CATCH_CHECK(torch::equal(out, t));
  torch::Tensor alias = ToTorch(FromTorch(out));
  CATCH_CHECK(alias.data_ptr() == out.data_ptr());
}
