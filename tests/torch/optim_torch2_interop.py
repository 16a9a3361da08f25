"""The torch 2.x optimizer layout, the way back: C++ saves an AdamW, torch loads it.

1. dcp_torch_tests' hidden case "torch2 layout: export an AdamW checkpoint for torch 1.13" saves
   the model of make_fixtures.py and a LibTorch AdamW (AddOptimizerState, OptimizerLayout::kTorch2)
   through torchdcp113:// (every value a known pattern, see FillPattern there).
2. Its structure is the one torch 2.11 wrote (model_adamw.json): the same keys, tensors of the
   same dtype and shape, byte entries whose Python objects have the same repr (field for field;
   the options are torch's defaults on both sides).
3. torch 1.13's DCP load_state_dict reads it; the optimizer state is rebuilt in the form
   torch.optim.Optimizer.state_dict() has (parameters by position, found through
   param_groups.<i>.params), AdamW.load_state_dict takes it, and every value is the C++ one;
   then one AdamW step runs.
Usage: optim_torch2_interop.py --tests DCP_TORCH_TESTS --fixtures DIR --workdir DIR
(exits 77 when this python has no torch, or its torch has no torch.distributed._shard.checkpoint).
"""
import argparse, ast, json, os, shutil, subprocess, sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from torch113_dcp import torch, tdcp  # noqa: E402 (exits 77 without them)

ap = argparse.ArgumentParser()
ap.add_argument("--tests", required=True)
ap.add_argument("--fixtures", required=True)
ap.add_argument("--workdir", required=True)
args = ap.parse_args()
shutil.rmtree(args.workdir, ignore_errors=True)
os.makedirs(args.workdir)
ckpt = os.path.join(args.workdir, "adamw")

# 1. C++ writes the checkpoint.
r = subprocess.run([args.tests, "torch2 layout: export an AdamW checkpoint for torch 1.13"],
                   env=dict(os.environ, DCP_TORCH2_EXPORT_DIR=ckpt), capture_output=True, text=True)
if r.returncode != 0:
    sys.exit("the export failed (%d): %s%s" % (r.returncode, r.stdout, r.stderr))

# 2. Its structure against torch 2.11's, field for field.
ref = json.load(open(os.path.join(args.fixtures, "model_adamw.json")))["entries"]
md = tdcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
assert sorted(md) == sorted(ref), (sorted(set(md) ^ set(ref)))
flat = {}
for fqn, m in md.items():
    want = ref[fqn]
    if want["kind"] == "tensor":
        assert isinstance(m, tdcp.TensorStorageMetadata), (fqn, m)
        assert str(m.properties.dtype) == want["dtype"], (fqn, m.properties.dtype, want["dtype"])
        assert list(m.size) == want["shape"], (fqn, list(m.size), want["shape"])
        flat[fqn] = torch.zeros(list(m.size), dtype=m.properties.dtype)
    else:
        assert isinstance(m, tdcp.BytesStorageMetadata), (fqn, m)
        flat[fqn] = None
tdcp.load_state_dict(flat, tdcp.FileSystemReader(ckpt), no_dist=True)
for fqn, want in ref.items():
    if want["kind"] == "bytes":
        got = flat[fqn]
        assert repr(got) == want["python_repr"], (fqn, repr(got), want["python_repr"])
        assert type(got) is type(ast.literal_eval(want["python_repr"])), fqn
print("structure equals torch 2.11's: %d entries (%d byte entries, same Python values)"
      % (len(ref), sum(1 for v in ref.values() if v["kind"] == "bytes")))

# 3. Into a torch 1.13 AdamW, through the optimizer's own state_dict form.
model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.LayerNorm(16),
                            torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 50))
opt = torch.optim.AdamW(model.parameters(), lr=0.5, betas=(0.1, 0.2), eps=1.0, weight_decay=0.3)
model.load_state_dict({k[len("model."):]: v for k, v in flat.items() if k.startswith("model.")})
groups, state, index = [], {}, 0
g = 0
while "optim.param_groups.%d.params" % g in flat:
    prefix = "optim.param_groups.%d." % g
    group = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}
    names = group.pop("params")
    group["params"] = list(range(index, index + len(names)))
    for name in names:
        s = "optim.state.%s." % name
        state[index] = {k[len(s):]: v for k, v in flat.items() if k.startswith(s)}
        index += 1
    groups.append(group)
    g += 1
assert g == 1 and index == 7, (g, index)
opt.load_state_dict({"state": state, "param_groups": groups})

def pattern(like, k):
    i = torch.arange(like.numel(), dtype=torch.int64)
    return (((i * 7 + k) % 61 - 30).to(torch.float32) / 16).reshape(like.shape)

pg = opt.param_groups[0]
assert pg["lr"] == 0.001 and pg["betas"] == (0.9, 0.999) and pg["eps"] == 1e-8, pg
assert pg["weight_decay"] == 0.01 and pg["amsgrad"] is False, pg
for k, (name, p) in enumerate(model.named_parameters()):
    assert torch.equal(p.detach(), pattern(p, k)), name
    st = opt.state[p]
    assert torch.equal(st["exp_avg"], pattern(p, k + 100)), name
    assert torch.equal(st["exp_avg_sq"], pattern(p, k + 200).abs()), name
    assert st["step"].dtype == torch.float32 and st["step"].dim() == 0 and st["step"].item() == 3.0
before = [p.detach().clone() for p in model.parameters()]
model(torch.randint(0, 50, (8, 5))).logsumexp(-1).mean().backward()
opt.step()
assert all(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
assert opt.state[next(model.parameters())]["step"].item() == 4.0
print("torch %s loaded the C++ AdamW: 7 parameters' state and the group options exact; "
      "a step ran" % torch.__version__)
