// Optimizer state by parameter name, load-all with map_location, and the sharding helpers.
// LibTorch brings glog, whose CHECK macro would shadow Catch's: use the CATCH_ prefixed macros.
#define CATCH_CONFIG_PREFIX_ALL
#include <catch2/catch.hpp>
#include <functional>
#include <thread>

#include "dcp/dcp.h"
#include "dcp/storage/backends/mem_store.h"
#include "dcp/torch_adapter.h"
#include "support/test_support.h"

using namespace dcp;

namespace {

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(4, 8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

using OptFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;

float Step(Net& net, torch::optim::Optimizer& opt, int i) {
  torch::manual_seed(1000 + i);
  torch::Tensor x = torch::randn({16, 4}), y = torch::randn({16, 2});
  opt.zero_grad();
  torch::Tensor loss = torch::mse_loss(net.forward(x), y);
  loss.backward();
  opt.step();
  return loss.item<float>();
}

StateDict Bind(Net& net, torch::optim::Optimizer& opt) {
  StateDict sd;
  AddModuleState(net, sd.Nested("model"));
  AddOptimizerState(opt, net, sd.Nested("optim"));
  return sd;
}

void RoundTrip(const std::string& name, const OptFactory& make) {
  ClearMemStore(name);
  torch::manual_seed(1);
  Net net;
  auto opt = make(net.parameters());
  for (int i = 0; i < 3; ++i) Step(net, *opt, i);
  StateDict sd = Bind(net, *opt);
  Save(sd, "mem://" + name);
  // The uninterrupted run continues.
  const float expect_loss = Step(net, *opt, 3);
  std::vector<torch::Tensor> expect_params;
  for (const auto& p : net.parameters()) expect_params.push_back(p.detach().clone());

  // A fresh model and optimizer, the parameters handed to the optimizer in reverse order.
  torch::manual_seed(2);
  Net net2;
  auto params = net2.parameters();
  std::reverse(params.begin(), params.end());
  auto opt2 = make(params);
  StateDict sd2 = Bind(net2, *opt2);
  std::vector<void*> ptrs;
  for (const auto& p : net2.parameters()) ptrs.push_back(p.data_ptr());
  Load(sd2, "mem://" + name);
  auto after = net2.parameters();
  for (size_t i = 0; i < after.size(); ++i) CATCH_CHECK(after[i].data_ptr() == ptrs[i]);
  // One more step: same loss and same parameters as the uninterrupted run, bit for bit.
  CATCH_CHECK(Step(net2, *opt2, 3) == expect_loss);
  for (size_t i = 0; i < after.size(); ++i) CATCH_CHECK(torch::equal(after[i], expect_params[i]));
  ClearMemStore(name);
}

using dcp::testing::RunRanks;

}  // namespace

CATCH_TEST_CASE("torch: module and optimizer state round trip by name, training continues",
                "[torch][optim]") {
  CATCH_SECTION("Adam") {
    RoundTrip("torch-adam", [](std::vector<torch::Tensor> p) {
      return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-2));
    });
  }
  CATCH_SECTION("Adam amsgrad") {
    RoundTrip("torch-adam-ams", [](std::vector<torch::Tensor> p) {
      return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-2).amsgrad(true));
    });
  }
  CATCH_SECTION("AdamW") {
    RoundTrip("torch-adamw", [](std::vector<torch::Tensor> p) {
      return std::make_unique<torch::optim::AdamW>(
          p, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    });
  }
  CATCH_SECTION("SGD with momentum") {
    RoundTrip("torch-sgd", [](std::vector<torch::Tensor> p) {
      return std::make_unique<torch::optim::SGD>(
          p, torch::optim::SGDOptions(1e-1).momentum(0.9).nesterov(true));
    });
  }
}

CATCH_TEST_CASE("torch: optimizer state is keyed by name and loads in place", "[torch][optim]") {
  ClearMemStore("torch-optim-keys");
  torch::manual_seed(3);
  Net net;
  torch::optim::Adam opt(net.parameters(), torch::optim::AdamOptions(1e-3));
  Step(net, opt, 0);
  StateDict sd = Bind(net, opt);
  const Metadata md = Save(sd, "mem://torch-optim-keys").metadata;
  CATCH_CHECK(md.entries.count("optim.state.fc1.weight.exp_avg") == 1);
  CATCH_CHECK(md.entries.count("optim.state.fc2.bias.step") == 1);
  CATCH_CHECK(md.entries.count("optim.param_groups.0.lr") == 1);
  // Change the live state, then load: the same tensors get the saved values back.
  auto& st = static_cast<torch::optim::AdamParamState&>(
      *opt.state().begin()->second);  // any parameter's state
  torch::Tensor exp_avg = st.exp_avg();
  const torch::Tensor saved = exp_avg.clone();
  const int64_t saved_step = st.step();
  {
    torch::NoGradGuard g;
    exp_avg.fill_(7);
  }
  st.step(99);
  static_cast<torch::optim::AdamOptions&>(opt.param_groups()[0].options()).lr(0.5);
  StateDict back = Bind(net, opt);
  Load(back, "mem://torch-optim-keys");
  CATCH_CHECK(st.exp_avg().data_ptr() == exp_avg.data_ptr());
  CATCH_CHECK(torch::equal(exp_avg, saved));
  CATCH_CHECK(st.step() == saved_step);
  CATCH_CHECK(static_cast<torch::optim::AdamOptions&>(opt.param_groups()[0].options()).lr() ==
              1e-3);
  torch::optim::RMSprop rms(net.parameters());
  StateDict x;
  CATCH_CHECK_THROWS_AS(AddOptimizerState(rms, net, x), UnsupportedError);
  ClearMemStore("torch-optim-keys");
}

CATCH_TEST_CASE("torch: ShardOf, MakeShardedTensor, Unshard and LoadAllTensors", "[torch]") {
  torch::Tensor full = torch::arange(7 * 5, torch::kFloat32).reshape({7, 5});
  for (int64_t dim : {0, 1}) {
    for (int world : {1, 3, 4}) {
      std::vector<torch::Tensor> pieces;
      for (int r = 0; r < world; ++r) pieces.push_back(ShardOf(full, dim, r, world));
      CATCH_CHECK(torch::equal(Unshard(pieces, dim), full));
    }
  }
  CATCH_CHECK(ShardRange(2, 3, 4) == std::make_pair<int64_t, int64_t>(2, 2));  // uneven: empty
  CATCH_CHECK_THROWS_AS(MakeShardedTensor(full, {7, 5}, 0, 0, 2), InvalidArgumentError);

  // Saved sharded along columns at 3 ranks (one rank holds nothing of the 2-column tensor), then
  // loaded whole without a model.
  const std::string name = "torch-shard-loadall";
  ClearMemStore(name);
  torch::Tensor narrow = torch::arange(14, torch::kInt64).reshape({7, 2});
  auto errors = RunRanks(3, [&](int r, Communicator& comm) {
    StateDict sd;
    sd.Set("w", MakeShardedTensor(ShardOf(full, 1, r, 3).contiguous(), {7, 5}, 1, r, 3));
    sd.Set("n", MakeShardedTensor(ShardOf(narrow, 1, r, 3), {7, 2}, 1, r, 3));
    sd.Set("meta", Blob{"hello"});
    Save(sd, "mem://" + name, comm);
  });
  for (auto& e : errors) CATCH_REQUIRE_FALSE(e);
  InProcessGroup one(1);
  std::map<std::string, std::string> blobs;
  auto tensors = LoadAllTensors("mem://" + name, one.communicator(0), torch::kCPU, &blobs);
  CATCH_REQUIRE(tensors.size() == 2);
  CATCH_CHECK(torch::equal(tensors.at("w"), full));
  CATCH_CHECK(torch::equal(tensors.at("n"), narrow));
  CATCH_CHECK(blobs.at("meta") == "hello");
  ClearMemStore(name);
}
