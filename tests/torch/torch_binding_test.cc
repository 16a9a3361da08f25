// A state dict built once follows its module, optimizer and scheduler (issue 14): the normal
// fine-tuning order (build the state dict, then torch::load weights or move the module, then
// save) saves the current values and never reads freed memory (these scenarios read freed memory
// before views were bound: run them under ASan, tools/setup.sh's torch ASan stage); optimizer
// param-group options and a scheduler's step count resume exactly.
#define CATCH_CONFIG_PREFIX_ALL
#include <catch2/catch.hpp>
#include <sstream>
#include <type_traits>

#include "dcp/dcp.h"
#include "dcp/storage/backends/mem_store.h"
#include "dcp/torch_adapter.h"
#include "support/test_support.h"

using namespace dcp;

namespace {

// The state entry of parameter p in a LibTorch optimizer. Optimizer::state() is keyed by the
// parameter's TensorImpl pointer in LibTorch 2.x and by that pointer printed as a string in 1.13.
template <typename State, typename Optimizer>
State& ParamState(Optimizer& opt, const torch::Tensor& p) {
  using Key = typename std::decay_t<decltype(opt.state())>::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream key;
    key << p.unsafeGetTensorImpl();
    return static_cast<State&>(*opt.state().at(key.str()));
  } else {
    return static_cast<State&>(*opt.state().at(static_cast<Key>(p.unsafeGetTensorImpl())));
  }
}

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(4, 8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

float Step(Net& net, torch::optim::Optimizer& opt, int i) {
  torch::manual_seed(1000 + i);
  torch::Tensor x = torch::randn({16, 4}, net.fc1->weight.options()),
                y = torch::randn({16, 2}, net.fc1->weight.options());
  opt.zero_grad();
  torch::Tensor loss = torch::mse_loss(net.forward(x), y);
  loss.backward();
  opt.step();
  return loss.item<float>();
}

// Every tensor of a checkpoint, by name (no model needed).
std::map<std::string, torch::Tensor> Saved(const std::string& uri) {
  InProcessGroup one(1);
  return LoadAllTensors(uri, one.communicator(0));
}

}  // namespace

CATCH_TEST_CASE("torch: a state dict built before torch::load saves the loaded weights",
                "[torch][binding]") {
  const std::string name = "bind-torch-load";
  ClearMemStore(name);
  testing::TempDir dir("bind");
  torch::manual_seed(1);
  auto trained = std::make_shared<Net>();
  torch::save(trained, dir / "trained.pt");
  torch::manual_seed(2);
  auto net = std::make_shared<Net>();
  StateDict sd;
  AddModuleState(*net, sd);              // built once, before the weights arrive
  torch::load(net, dir / "trained.pt");  // set_(): every parameter gets new storage
  Save(sd, "mem://" + name);
  auto saved = Saved("mem://" + name);
  for (const auto& p : net->named_parameters()) {
    CATCH_CHECK(torch::equal(saved.at(p.key()), p.value()));
    CATCH_CHECK(torch::equal(saved.at(p.key()), trained->named_parameters()[p.key()]));
  }
  // Loading writes into the current parameters too.
  for (auto& p : net->parameters()) {
    torch::NoGradGuard g;
    p.zero_();
  }
  Load(sd, "mem://" + name);
  for (const auto& p : net->named_parameters()) {
    CATCH_CHECK(torch::equal(p.value(), trained->named_parameters()[p.key()]));
  }
  ClearMemStore(name);
}

CATCH_TEST_CASE("torch: a state dict built before module->to() follows the new dtype",
                "[torch][binding]") {
  const std::string name = "bind-to";
  ClearMemStore(name);
  torch::manual_seed(3);
  auto net = std::make_shared<Net>();
  StateDict sd;
  AddModuleState(*net, sd);
  net->to(torch::kFloat64);  // set_data(): new storage and dtype under the same tensors
  {
    torch::NoGradGuard g;
    net->fc1->weight.add_(1.0);
  }
  const Metadata md = Save(sd, "mem://" + name).metadata;
  CATCH_CHECK(std::get<TensorMetadata>(md.entries.at("fc1.weight")).dtype == DType::kFloat64);
  auto saved = Saved("mem://" + name);
  CATCH_CHECK(torch::equal(saved.at("fc1.weight"), net->fc1->weight));
  ClearMemStore(name);
}

CATCH_TEST_CASE("torch: a state dict follows a replaced submodule and buffers by name",
                "[torch][binding]") {
  const std::string name = "bind-replace";
  ClearMemStore(name);
  torch::manual_seed(7);
  auto net = std::make_shared<Net>();
  torch::nn::BatchNorm1d bn(8);
  net->register_module("bn", bn);
  StateDict sd;
  AddModuleState(*net, sd);
  // A new head (new tensors under the old names) and a buffer given new memory.
  net->fc2 = net->replace_module("fc2", torch::nn::Linear(8, 2));
  bn->running_mean.set_data(torch::full({8}, 3.0));
  Save(sd, "mem://" + name);
  auto saved = Saved("mem://" + name);
  CATCH_CHECK(torch::equal(saved.at("fc2.weight"), net->fc2->weight));
  CATCH_CHECK(torch::equal(saved.at("bn.running_mean"), torch::full({8}, 3.0)));
  ClearMemStore(name);
}

CATCH_TEST_CASE("torch: optimizer views follow replaced state entries and options",
                "[torch][binding]") {
  const std::string name = "bind-optim";
  ClearMemStore(name);
  torch::manual_seed(4);
  Net net;
  torch::optim::Adam opt(net.parameters(), torch::optim::AdamOptions(1e-2));
  StateDict sd;
  AddOptimizerState(opt, net, sd);  // creates the state entries
  // The optimizer's state map is rebuilt (as its own load or a reset does): the entries the
  // state dict was built from are freed.
  opt.state().clear();
  for (int i = 0; i < 3; ++i) Step(net, opt, i);
  static_cast<torch::optim::AdamOptions&>(opt.param_groups()[0].options())
      .lr(0.25)
      .betas(std::make_tuple(0.8, 0.95))
      .eps(1e-6)
      .weight_decay(0.01);
  Save(sd, "mem://" + name);
  auto saved = Saved("mem://" + name);
  auto& st = ParamState<torch::optim::AdamParamState>(opt, net.fc1->weight);
  CATCH_CHECK(torch::equal(saved.at("state.fc1.weight.exp_avg"), st.exp_avg()));
  CATCH_CHECK(saved.at("state.fc1.weight.step").item<int64_t>() == 3);
  CATCH_CHECK(saved.at("param_groups.0.lr").item<double>() == 0.25);
  CATCH_CHECK(saved.at("param_groups.0.betas")[1].item<double>() == 0.95);
  CATCH_CHECK(saved.at("param_groups.0.eps").item<double>() == 1e-6);
  CATCH_CHECK(saved.at("param_groups.0.weight_decay").item<double>() == 0.01);
  CATCH_CHECK(saved.at("param_groups.0.amsgrad").item<bool>() == false);
  ClearMemStore(name);
}

CATCH_TEST_CASE("torch: param-group options and the scheduler resume exactly", "[torch][binding]") {
  const std::string name = "bind-resume";
  ClearMemStore(name);
  auto options = torch::optim::AdamWOptions(3e-2)
                     .betas(std::make_tuple(0.85, 0.97))
                     .eps(1e-7)
                     .weight_decay(0.05)
                     .amsgrad(true);
  torch::manual_seed(5);
  Net net;
  torch::optim::AdamW opt(net.parameters(), options);
  torch::optim::StepLR sched(opt, /*step_size=*/2, /*gamma=*/0.5);
  StateDict sd;
  AddModuleState(net, sd.Nested("model"));
  AddOptimizerState(opt, net, sd.Nested("optim"));
  AddSchedulerState(sched, sd.Nested("sched"));
  for (int i = 0; i < 5; ++i) {
    Step(net, opt, i);
    sched.step();
  }
  Save(sd, "mem://" + name);
  std::vector<torch::Tensor> at_save;
  for (const auto& p : net.parameters()) at_save.push_back(p.detach().clone());
  std::vector<float> expect;
  for (int i = 5; i < 9; ++i) {
    expect.push_back(Step(net, opt, i));
    sched.step();
  }

  // A fresh job with other hyper-parameters: everything comes from the checkpoint.
  torch::manual_seed(6);
  Net net2;
  // (amsgrad is structure, not a value: it must match, see below.)
  torch::optim::AdamW opt2(net2.parameters(), torch::optim::AdamWOptions(1.0).amsgrad(true));
  torch::optim::StepLR sched2(opt2, 2, 0.5);
  StateDict sd2;
  AddModuleState(net2, sd2.Nested("model"));
  AddOptimizerState(opt2, net2, sd2.Nested("optim"));
  AddSchedulerState(sched2, sd2.Nested("sched"));
  Load(sd2, "mem://" + name);
  const auto& o2 = static_cast<torch::optim::AdamWOptions&>(opt2.param_groups()[0].options());
  CATCH_CHECK(o2.lr() == 3e-2 * 0.25);  // two StepLR decays after 5 steps
  CATCH_CHECK(o2.betas() == std::make_tuple(0.85, 0.97));
  CATCH_CHECK(o2.eps() == 1e-7);
  CATCH_CHECK(o2.weight_decay() == 0.05);
  CATCH_CHECK(o2.amsgrad());
  {
    auto now = net2.parameters();
    for (size_t i = 0; i < now.size(); ++i) CATCH_CHECK(torch::equal(now[i], at_save[i]));
    auto& s1 = ParamState<torch::optim::AdamWParamState>(opt, net.fc1->weight);
    auto& s2 = ParamState<torch::optim::AdamWParamState>(opt2, net2.fc1->weight);
    CATCH_CHECK(s2.step() == 5);
    (void)s1;
  }
  for (int i = 5; i < 9; ++i) {
    CATCH_CHECK(Step(net2, opt2, i) == expect[static_cast<size_t>(i - 5)]);
    sched2.step();
  }
  auto p1 = net.parameters(), p2 = net2.parameters();
  for (size_t i = 0; i < p1.size(); ++i) CATCH_CHECK(torch::equal(p1[i], p2[i]));

  // An optimizer built without amsgrad would drop max_exp_avg_sq: refused, not resumed wrong.
  Net net3;
  torch::optim::AdamW opt3(net3.parameters(), torch::optim::AdamWOptions(1.0));
  StateDict sd3;
  AddOptimizerState(opt3, net3, sd3.Nested("optim"));
  LoadOptions partial;
  partial.allow_partial_load = true;
  CATCH_CHECK_THROWS_WITH(Load(sd3, "mem://" + name, partial),
                          Catch::Contains("amsgrad=true") && Catch::Contains("max_exp_avg_sq"));
  ClearMemStore(name);
}
