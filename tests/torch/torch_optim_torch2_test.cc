// The PyTorch 2.x optimizer layout (OptimizerLayout::kTorch2): a checkpoint torch 2.11 wrote
// (get_state_dict of a small model + AdamW) loads into a LibTorch AdamW bit for bit, and what the
// adapter saves has that checkpoint's keys, dtypes, shapes and pickled group options, field for
// field. tests/torch/optim_torch2_interop.py takes the way back: torch 1.13 reads what this file's
// hidden export case writes into a torch.optim.AdamW.
#define CATCH_CONFIG_PREFIX_ALL
#include <catch2/catch.hpp>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <set>
#include <sstream>
#include <type_traits>

#include "dcp/dcp.h"
#include "dcp/storage/format/pickle.h"
#include "dcp/storage/format/torch_dcp.h"
#include "dcp/storage/format/torch_dcp.h"
#include "dcp/torch_adapter.h"
#include "support/test_support.h"

using namespace dcp;

namespace {

const std::string kFixture = std::string(DCP_TORCH_DCP_FIXTURES) + "/model_adamw";

// The model of make_fixtures.py: its parameters are 0.weight, 1.weight, 1.bias, 2.weight, ...
torch::nn::Sequential FixtureModel() {
  return torch::nn::Sequential(
      torch::nn::Embedding(50, 16), torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})),
      torch::nn::Linear(16, 32), torch::nn::GELU(), torch::nn::Linear(32, 50));
}

OptimizerStateOptions Torch2() {
  OptimizerStateOptions o;
  o.layout = OptimizerLayout::kTorch2;
  return o;
}

StateDict Bind(torch::nn::Module& model, torch::optim::Optimizer& opt) {
  StateDict sd;
  AddModuleState(model, sd.Nested("model"));
  AddOptimizerState(opt, model, sd, Torch2());
  return sd;
}

// The key of `p` in Optimizer::state(): its TensorImpl (LibTorch 2.x) or that pointer printed
// (1.13).
template <typename Key>
Key StateKey(const torch::Tensor& p) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream os;
    os << p.unsafeGetTensorImpl();
    return os.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

torch::optim::AdamWParamState& AdamWState(torch::optim::Optimizer& opt, const torch::Tensor& p) {
  auto& state = opt.state();
  using Key = typename std::decay_t<decltype(state)>::key_type;
  return static_cast<torch::optim::AdamWParamState&>(*state.at(StateKey<Key>(p)));
}

std::string Bytes(const torch::Tensor& t) {
  const torch::Tensor c = t.detach().contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

torch::optim::AdamWOptions& Group(torch::optim::Optimizer& opt) {
  return static_cast<torch::optim::AdamWOptions&>(opt.param_groups().at(0).options());
}

// Every entry of a checkpoint: tensors by dtype and shape, byte entries by their Python value
// (pickle::Dump of the value the restricted unpickler reads, so equal strings mean equal Python
// objects).
std::map<std::string, std::string> Describe(const std::string& uri) {
  std::map<std::string, std::string> out;
  const StateDict all = LoadAll(uri);
  for (const auto& [fqn, entry] : FlattenStateDict(all)) {
    if (const auto* t = std::get_if<TensorView>(entry.value)) {
      out[fqn] = std::string(DTypeName(t->dtype)) + ShapeToString(t->shape);
    } else if (const auto* b = std::get_if<Blob>(entry.value)) {
      out[fqn] = "python " + pickle::Dump(*TorchSaveObject(b->bytes, fqn));
    }
  }
  return out;
}

// Fill the model and its AdamW state with values a Python test can recompute:
// element i of the flattened tensor number k is ((i * 7 + k) % 61 - 30) / 16 (its absolute value
// for exp_avg_sq), exact in float32; every step is 3.
void FillPattern(torch::nn::Module& model, torch::optim::Optimizer& opt) {
  torch::NoGradGuard no_grad;
  auto pattern = [](const torch::Tensor& like, int k) {
    torch::Tensor i = torch::arange(like.numel(), torch::kInt64);
    return ((i * 7 + k).remainder(61) - 30).to(torch::kFloat32).div(16).reshape(like.sizes());
  };
  int k = 0;
  for (const auto& item : model.named_parameters()) {
    torch::Tensor p = item.value();
    p.copy_(pattern(p, k));
    auto& st = AdamWState(opt, p);
    st.exp_avg().copy_(pattern(p, k + 100));
    st.exp_avg_sq().copy_(pattern(p, k + 200).abs());
    st.step(3);
    ++k;
  }
}

}  // namespace

CATCH_TEST_CASE("torch2 layout: the torch 2.11 AdamW checkpoint loads into a LibTorch AdamW",
                "[torch][optim][torch2]") {
  if (!std::filesystem::exists(kFixture + "/.metadata")) {
    CATCH_WARN("no torch 2.11 fixture at " + kFixture + "; not checked");
    return;
  }
  torch::manual_seed(5);
  auto model = FixtureModel();
  // Other options than the checkpoint's: the load must set them.
  torch::optim::AdamW opt(
      model->parameters(),
      torch::optim::AdamWOptions(0.5).betas({0.1, 0.2}).eps(1).weight_decay(0.3));
  StateDict sd = Bind(*model, opt);
  Load(sd, "torchdcp://" + kFixture);

  const auto expected = testing::ReadSafetensors(kFixture + ".expected.safetensors");
  size_t compared = 0;
  for (const auto& item : model->named_parameters()) {
    const std::string name = item.key();
    CATCH_INFO(name);
    CATCH_CHECK(Bytes(item.value()) == expected.at("model." + name));
    auto& st = AdamWState(opt, item.value());
    CATCH_CHECK(Bytes(st.exp_avg()) == expected.at("optim.state." + name + ".exp_avg"));
    CATCH_CHECK(Bytes(st.exp_avg_sq()) == expected.at("optim.state." + name + ".exp_avg_sq"));
    float step = 0;
    const std::string& step_bytes = expected.at("optim.state." + name + ".step");
    CATCH_REQUIRE(step_bytes.size() == sizeof(float));
    std::memcpy(&step, step_bytes.data(), sizeof(float));
    CATCH_CHECK(step == 3.0f);
    CATCH_CHECK(st.step() == 3);
    compared += 4;
  }
  CATCH_CHECK(compared == expected.size());  // every tensor the fixture has
  const auto& g = Group(opt);
  CATCH_CHECK(g.lr() == 0.001);
  CATCH_CHECK(std::get<0>(g.betas()) == 0.9);
  CATCH_CHECK(std::get<1>(g.betas()) == 0.999);
  CATCH_CHECK(g.eps() == 1e-8);
  CATCH_CHECK(g.weight_decay() == 0.01);
  CATCH_CHECK_FALSE(g.amsgrad());

  // The loaded state trains on: one more step changes the parameters and counts 4.
  torch::Tensor x = torch::randint(0, 50, {8, 5});
  opt.zero_grad();
  model->forward(x).logsumexp(-1).mean().backward();
  opt.step();
  CATCH_CHECK(AdamWState(opt, model->named_parameters()["0.weight"]).step() == 4);
}

CATCH_TEST_CASE("torch2 layout: what the adapter saves has the keys and values torch 2.11 saves",
                "[torch][optim][torch2]") {
  if (!std::filesystem::exists(kFixture + "/.metadata")) {
    CATCH_WARN("no torch 2.11 fixture at " + kFixture + "; not checked");
    return;
  }
  torch::manual_seed(6);
  auto model = FixtureModel();
  torch::optim::AdamW opt(model->parameters(),
                          torch::optim::AdamWOptions(1e-3));  // torch's defaults
  StateDict sd = Bind(*model, opt);
  testing::TempDir dir("torch2-optim");
  Save(sd, "torchdcp://" + dir.path() + "/ckpt");

  // Field for field: the same keys, tensors of the same dtype and shape, and byte entries
  // holding equal Python objects (params, betas, foreach=None, decoupled_weight_decay=True, ...).
  const auto theirs = Describe("torchdcp://" + kFixture);
  const auto ours = Describe("torchdcp://" + dir.path() + "/ckpt");
  CATCH_CHECK(ours == theirs);
  std::set<std::string> blobs;
  for (const auto& [fqn, what] : ours) {
    if (what.rfind("python ", 0) == 0) blobs.insert(fqn);
  }
  CATCH_CHECK(blobs.size() == 12);
  CATCH_CHECK(blobs.count("optim.param_groups.0.params") == 1);
  CATCH_CHECK(ours.at("optim.state.0.weight.step") == "float32[]");

  // Back into another AdamW: state and options restored.
  FillPattern(*model, opt);
  Group(opt).lr(0.0025).betas({0.85, 0.995}).eps(1e-7).weight_decay(0.02);
  Save(sd, "torchdcp://" + dir.path() + "/filled");
  torch::manual_seed(7);
  auto model2 = FixtureModel();
  torch::optim::AdamW opt2(model2->parameters());
  StateDict sd2 = Bind(*model2, opt2);
  Load(sd2, "torchdcp://" + dir.path() + "/filled");
  for (const auto& item : model->named_parameters()) {
    const torch::Tensor p2 = model2->named_parameters()[item.key()];
    CATCH_CHECK(torch::equal(item.value(), p2));
    CATCH_CHECK(
        torch::equal(AdamWState(opt, item.value()).exp_avg(), AdamWState(opt2, p2).exp_avg()));
    CATCH_CHECK(torch::equal(AdamWState(opt, item.value()).exp_avg_sq(),
                             AdamWState(opt2, p2).exp_avg_sq()));
    CATCH_CHECK(AdamWState(opt2, p2).step() == 3);
  }
  CATCH_CHECK(Group(opt2).lr() == 0.0025);
  CATCH_CHECK(std::get<0>(Group(opt2).betas()) == 0.85);
  CATCH_CHECK(std::get<1>(Group(opt2).betas()) == 0.995);
  CATCH_CHECK(Group(opt2).eps() == 1e-7);
  CATCH_CHECK(Group(opt2).weight_decay() == 0.02);
}

CATCH_TEST_CASE("torch2 layout: group options that do not fit are refused by name",
                "[torch][optim][torch2]") {
  torch::manual_seed(8);
  auto model = FixtureModel();
  torch::optim::AdamW opt(model->parameters());
  StateDict sd = Bind(*model, opt);
  testing::TempDir dir("torch2-bad");
  Save(sd, "torchdcp://" + dir.path() + "/good");
  // The saved checkpoint with one group option replaced (or removed).
  auto with = [&](const std::string& key, pickle::ValuePtr value) {
    StateDict all = LoadAll("torchdcp://" + dir.path() + "/good");
    StateDict& g = all.Nested("optim").Nested("param_groups").Nested("0");
    if (value) {
      g.Set(key, Blob{TorchSaveOfPickle(pickle::Dump(*value))});
    } else {
      g.items().erase(key);
    }
    const std::string uri = "torchdcp://" + dir.path() + "/" + key + (value ? "" : "-gone");
    Save(all, uri);
    return uri;
  };
  auto error_of = [&](const std::string& uri) -> std::string {
    try {
      Load(sd, uri);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  using Catch::Contains;
  // Extra options torch may write, and foreach/fused/capturable in any value: accepted.
  {
    StateDict all = LoadAll("torchdcp://" + dir.path() + "/good");
    StateDict& g = all.Nested("optim").Nested("param_groups").Nested("0");
    g.Set("initial_lr", Blob{TorchSaveOfPickle(pickle::Dump(*pickle::Float(0.1)))});
    g.Set("foreach", Blob{TorchSaveOfPickle(pickle::Dump(*pickle::Bool(true)))});
    g.Set("fused", Blob{TorchSaveOfPickle(pickle::Dump(*pickle::Bool(false)))});
    g.Set("lr", Blob{TorchSaveOfPickle(pickle::Dump(*pickle::Int(1)))});  // an int is a float
    Save(all, "torchdcp://" + dir.path() + "/extra");
    Load(sd, "torchdcp://" + dir.path() + "/extra");
    CATCH_CHECK(Group(opt).lr() == 1.0);
  }
  CATCH_CHECK_THAT(error_of(with("lr", pickle::Str("fast"))),
                   Contains("optim.param_groups.0.lr") && Contains("a float"));
  CATCH_CHECK_THAT(error_of(with("betas", pickle::Tuple({pickle::Float(0.9)}))),
                   Contains("optim.param_groups.0.betas"));
  CATCH_CHECK_THAT(error_of(with("amsgrad", pickle::Bool(true))),
                   Contains("optim.param_groups.0.amsgrad"));
  CATCH_CHECK_THAT(error_of(with("decoupled_weight_decay", pickle::Bool(false))),
                   Contains("optim.param_groups.0.decoupled_weight_decay"));
  CATCH_CHECK_THAT(error_of(with("params", pickle::List({pickle::Str("0.weight")}))),
                   Contains("optim.param_groups.0.params"));
  CATCH_CHECK_THROWS_AS(Load(sd, with("maximize", pickle::Bool(true))), UnsupportedError);
  CATCH_CHECK_THROWS_AS(Load(sd, with("eps", pickle::Str("x"))), InvalidArgumentError);
  // A required option the checkpoint lacks: the load names it.
  CATCH_CHECK_THAT(error_of(with("weight_decay", nullptr)),
                   Contains("optim.param_groups.0.weight_decay"));
}

// Hidden: writes, for tests/torch/optim_torch2_interop.py, the fixture's model and an AdamW in the
// torch 2 layout through torchdcp113:// to $DCP_TORCH2_EXPORT_DIR (values: FillPattern).
CATCH_TEST_CASE("torch2 layout: export an AdamW checkpoint for torch 1.13", "[.torch2_export]") {
  const char* out = std::getenv("DCP_TORCH2_EXPORT_DIR");
  CATCH_REQUIRE(out != nullptr);
  torch::manual_seed(9);
  auto model = FixtureModel();
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  StateDict sd = Bind(*model, opt);  // creates the state entries
  FillPattern(*model, opt);
  Save(sd, std::string("torchdcp113://") + out);
}

namespace {

using OptFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;

float TrainStep(torch::nn::Sequential& model, torch::optim::Optimizer& opt, int i) {
  torch::manual_seed(2000 + i);
  const torch::Tensor x = torch::randint(0, 50, {8, 5});
  opt.zero_grad();
  torch::Tensor loss = model->forward(x).logsumexp(-1).mean();
  loss.backward();
  opt.step();
  return loss.item<float>();
}

// Saves after 2 steps in the torch 2 layout, loads into a fresh model and optimizer (other
// options), and checks the next step equals the uninterrupted run's; returns the saved entries.
std::map<std::string, std::string> Torch2RoundTrip(const OptFactory& make,
                                                   const OptFactory& make_other) {
  torch::manual_seed(11);
  auto model = FixtureModel();
  auto opt = make(model->parameters());
  for (int i = 0; i < 2; ++i) TrainStep(model, *opt, i);
  testing::TempDir dir("torch2-rt");
  const std::string uri = "torchdcp://" + dir.path() + "/ckpt";
  StateDict sd = Bind(*model, *opt);
  Save(sd, uri);
  const float expect = TrainStep(model, *opt, 2);
  torch::manual_seed(12);
  auto model2 = FixtureModel();
  auto opt2 = make_other(model2->parameters());
  StateDict sd2 = Bind(*model2, *opt2);
  Load(sd2, uri);
  CATCH_CHECK(TrainStep(model2, *opt2, 2) == expect);
  for (const auto& item : model->named_parameters()) {
    CATCH_CHECK(torch::equal(item.value(), model2->named_parameters()[item.key()]));
  }
  return Describe(uri);
}

std::set<std::string> GroupKeys(const std::map<std::string, std::string>& entries) {
  std::set<std::string> keys;
  const std::string prefix = "optim.param_groups.0.";
  for (const auto& [fqn, what] : entries) {
    if (fqn.rfind(prefix, 0) == 0) keys.insert(fqn.substr(prefix.size()));
  }
  return keys;
}

}  // namespace

CATCH_TEST_CASE("torch2 layout: Adam and SGD round trip and training continues",
                "[torch][optim][torch2]") {
  CATCH_SECTION("Adam amsgrad") {
    const auto entries = Torch2RoundTrip(
        [](std::vector<torch::Tensor> p) {
          return std::make_unique<torch::optim::Adam>(
              p, torch::optim::AdamOptions(1e-2).amsgrad(true).weight_decay(0.05));
        },
        [](std::vector<torch::Tensor> p) {
          return std::make_unique<torch::optim::Adam>(p,
                                                      torch::optim::AdamOptions(0.5).amsgrad(true));
        });
    CATCH_CHECK(GroupKeys(entries) ==
                std::set<std::string>{"amsgrad", "betas", "capturable", "decoupled_weight_decay",
                                      "differentiable", "eps", "foreach", "fused", "lr", "maximize",
                                      "params", "weight_decay"});
    CATCH_CHECK(entries.at("optim.param_groups.0.decoupled_weight_decay") ==
                "python " + pickle::Dump(*pickle::Bool(false)));
    CATCH_CHECK(entries.at("optim.state.2.weight.max_exp_avg_sq") == "float32[32, 16]");
    CATCH_CHECK(entries.at("optim.state.2.weight.step") == "float32[]");
  }
  CATCH_SECTION("SGD with momentum") {
    const auto entries = Torch2RoundTrip(
        [](std::vector<torch::Tensor> p) {
          return std::make_unique<torch::optim::SGD>(
              p, torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true));
        },
        [](std::vector<torch::Tensor> p) {
          return std::make_unique<torch::optim::SGD>(p,
                                                     torch::optim::SGDOptions(0.3).momentum(0.5));
        });
    CATCH_CHECK(GroupKeys(entries) == std::set<std::string>{"dampening", "differentiable",
                                                            "foreach", "fused", "lr", "maximize",
                                                            "momentum", "nesterov", "params",
                                                            "weight_decay"});
    CATCH_CHECK(entries.at("optim.state.4.bias.momentum_buffer") == "float32[50]");
  }
  CATCH_SECTION("SGD without momentum has no state entries") {
    const auto entries = Torch2RoundTrip(
        [](std::vector<torch::Tensor> p) {
          return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1));
        },
        [](std::vector<torch::Tensor> p) {
          return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.7));
        });
    for (const auto& [fqn, what] : entries) CATCH_CHECK(fqn.rfind("optim.state.", 0) != 0);
  }
}

CATCH_TEST_CASE("torch2 layout: the prefix places the entries", "[torch][optim][torch2]") {
  auto model = FixtureModel();
  torch::optim::AdamW opt(model->parameters());
  OptimizerStateOptions o = Torch2();
  o.prefix = "run.optimizer";
  StateDict sd;
  AddOptimizerState(opt, *model, sd, o);
  const auto flat = FlattenStateDict(sd);
  CATCH_CHECK(flat.count("run.optimizer.param_groups.0.lr") == 1);
  CATCH_CHECK(flat.count("run.optimizer.state.0.weight.exp_avg") == 1);
  o.prefix = "";
  StateDict top;
  AddOptimizerState(opt, *model, top, o);
  CATCH_CHECK(FlattenStateDict(top).count("param_groups.0.betas") == 1);
  o.prefix = "a..b";
  StateDict bad;
  CATCH_CHECK_THROWS_AS(AddOptimizerState(opt, *model, bad, o), InvalidArgumentError);
}

CATCH_TEST_CASE("torch2 layout: a checkpoint without the options LibTorch lacks loads without them",
                "[torch][optim][torch2]") {
  torch::manual_seed(13);
  auto model = FixtureModel();
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(0.125));
  testing::TempDir dir("torch2-older");
  {
    StateDict sd = Bind(*model, opt);
    Save(sd, "torchdcp://" + dir.path() + "/full");
  }
  // As an older torch's AdamW groups would be: no decoupled_weight_decay, no fused.
  StateDict all = LoadAll("torchdcp://" + dir.path() + "/full");
  StateDict& g = all.Nested("optim").Nested("param_groups").Nested("0");
  g.items().erase("decoupled_weight_decay");
  g.items().erase("fused");
  Save(all, "torchdcp://" + dir.path() + "/older");
  torch::optim::AdamW opt2(model->parameters(), torch::optim::AdamWOptions(0.5));
  StateDict with_extras = Bind(*model, opt2);
  try {
    Load(with_extras, "torchdcp://" + dir.path() + "/older");
    CATCH_FAIL("loaded without decoupled_weight_decay");
  } catch (const Error& e) {  // dcp's missing-key error (a CollectiveError around kNotFound)
    CATCH_CHECK_THAT(std::string(e.what()),
                     Catch::Contains("optim.param_groups.0.decoupled_weight_decay") &&
                         Catch::Contains("NotFound"));
  }
  OptimizerStateOptions o = Torch2();
  o.torch2_extra_options = false;
  StateDict without;
  AddModuleState(*model, without.Nested("model"));
  AddOptimizerState(opt2, *model, without, o);
  CATCH_CHECK(FlattenStateDict(without).count("optim.param_groups.0.maximize") == 0);
  Load(without, "torchdcp://" + dir.path() + "/older");
  CATCH_CHECK(Group(opt2).lr() == 0.125);
}
