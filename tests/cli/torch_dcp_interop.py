"""Live interop with torch 1.13's DCP (torch.distributed._shard.checkpoint), through the dcp CLI.

1. torch 1.13 writes a DCP checkpoint; dcp reads it (`dcp verify`, `dcp convert` to safetensors),
   and every value and byte entry matches.
2. dcp writes torch 1.13's layout (`dcp convert ... torchdcp113://...`), from that checkpoint and
   from a dcp checkpoint with a raw blob; torch 1.13's load_state_dict reads every value exactly,
   and the raw blob comes back in Python as `bytes`.
Usage: torch_dcp_interop.py --dcp DCP --workdir DIR   (run by a python that has torch; exits 77
when it has none, or when its torch has no DCP).
"""
import argparse, copy, io, json, os, shutil, struct, subprocess, sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from torch113_dcp import torch, tdcp  # noqa: E402 (exits 77 without them)

ap = argparse.ArgumentParser()
ap.add_argument("--dcp", required=True)
ap.add_argument("--workdir", required=True)
args = ap.parse_args()
w = args.workdir
shutil.rmtree(w, ignore_errors=True)
os.makedirs(w)


def dcp(*a):
    r = subprocess.run([args.dcp, *a], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit("dcp %s failed (%d): %s%s" % (" ".join(a), r.returncode, r.stdout, r.stderr))
    return r.stdout


def read_safetensors(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    return {k: b[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]
            for k, v in h.items() if k != "__metadata__"}


torch.manual_seed(0)
state = {
    "w": torch.randn(6, 5),
    "d": torch.randn(3, 4, dtype=torch.float64),
    "i": torch.arange(-7, 13, dtype=torch.int64).reshape(4, 5),
    "h": torch.randn(8, dtype=torch.bfloat16),
    "b": torch.rand(7) > 0.5,
    "t": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),  # saved with its strides
    "s0": torch.tensor(3.5),
    "e": torch.zeros(0, 3),
    "step": 7,
    "name": "hello",
}
tensors = {k: v for k, v in state.items() if torch.is_tensor(v)}
src = os.path.join(w, "from_torch")
tdcp.save_state_dict(copy.deepcopy(state), tdcp.FileSystemWriter(src), no_dist=True)

# 1. dcp reads torch 1.13's checkpoint.
print(dcp("verify", src).strip())
dcp("convert", src, os.path.join(w, "a.safetensors"))
got = read_safetensors(os.path.join(w, "a.safetensors"))
for k, v in tensors.items():
    want = v.contiguous().numpy().tobytes() if v.dtype != torch.bfloat16 else v.view(torch.int16).contiguous().numpy().tobytes()
    assert got[k] == want, "tensor %s differs after dcp read torch 1.13's checkpoint" % k
assert torch.load(io.BytesIO(got["step"])) == 7
assert torch.load(io.BytesIO(got["name"])) == "hello"
print("dcp read torch 1.13's checkpoint: %d tensors and 2 byte entries exact" % len(tensors))

# 2. torch 1.13 reads what dcp writes in 1.13 mode.
out = os.path.join(w, "to_torch")
dcp("convert", src, "torchdcp113://" + out)
back = {k: torch.zeros_like(v.contiguous()) for k, v in tensors.items()}
back["step"] = None
back["name"] = None
tdcp.load_state_dict(back, tdcp.FileSystemReader(out), no_dist=True)
for k, v in tensors.items():
    assert torch.equal(back[k], v), "tensor %s differs after torch 1.13 read dcp's checkpoint" % k
assert back["step"] == 7 and back["name"] == "hello", (back["step"], back["name"])

# A raw dcp blob (not a torch.save stream) reaches Python as bytes.
raw = b"raw\x00bytes\xff"
hdr = {"__metadata__": {"dcp.blobs": json.dumps(["blob"])},
       "blob": {"dtype": "U8", "shape": [len(raw)], "data_offsets": [0, len(raw)]},
       "x": {"dtype": "F32", "shape": [2], "data_offsets": [len(raw), len(raw) + 8]}}
hb = json.dumps(hdr).encode()
with open(os.path.join(w, "in.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(hb)) + hb + raw + struct.pack("<2f", 1.5, -2.0))
dcp("convert", os.path.join(w, "in.safetensors"), os.path.join(w, "native"))
dcp("convert", os.path.join(w, "native"), "torchdcp113://" + os.path.join(w, "native_torch"))
got = {"blob": None, "x": torch.zeros(2)}
tdcp.load_state_dict(got, tdcp.FileSystemReader(os.path.join(w, "native_torch")), no_dist=True)
assert got["blob"] == raw, got["blob"]
assert got["x"].tolist() == [1.5, -2.0]
print("torch 1.13 read dcp's torchdcp113 output: %d tensors, byte entries and a raw blob exact"
      % len(tensors))
