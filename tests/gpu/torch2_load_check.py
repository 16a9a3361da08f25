"""torch 2.x's own DCP loader reads what dcp writes in the PyTorch DCP layout (torchdcp://).

Run on a machine whose python3 has torch 2.x and safetensors (the GPU machine, docs/GPU.md):
  torch2_load_check.py --dcp build/tools/dcp --fixtures tests/fixtures/pytorch-dcp-2.11 \
      --workdir /tmp/t2 [--extra dist4_dtensor=DIR ...]
For each fixture (written by torch 2.11), dcp converts it to its own format and back to torchdcp://
(so the bytes torch reads are dcp's own writing), then torch.distributed.checkpoint.load reads it
into freshly allocated tensors without a process group; every tensor must equal the fixture's
expected values bit for bit and every byte entry must unpickle to the fixture's Python value.
`--extra CASE=DIR` checks a torchdcp:// directory dcp wrote elsewhere (a multi-rank save) against
CASE's expected values. Exits 0 when every check passes, 1 otherwise, 77 without torch 2.x.
"""
import argparse, io, json, os, shutil, subprocess, sys

try:
    import torch
    import torch.distributed.checkpoint as tdcp
    from safetensors.torch import load_file
except Exception as e:  # not the GPU machine's python
    print("skipped: needs torch 2.x with torch.distributed.checkpoint and safetensors: %s" % e)
    sys.exit(77)

ap = argparse.ArgumentParser()
ap.add_argument("--dcp", required=True)
ap.add_argument("--fixtures", required=True)
ap.add_argument("--workdir", required=True)
ap.add_argument("--extra", action="append", default=[])
args = ap.parse_args()
shutil.rmtree(args.workdir, ignore_errors=True)
os.makedirs(args.workdir)
print("torch", torch.__version__)


def run_dcp(*a):
    r = subprocess.run([args.dcp, *a], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit("dcp %s failed (%d): %s%s" % (" ".join(a), r.returncode, r.stdout, r.stderr))


def as_bytes(t):
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def check(case, directory):
    entries = json.load(open(os.path.join(args.fixtures, case + ".json")))["entries"]
    want = load_file(os.path.join(args.fixtures, case + ".expected.safetensors"))
    sd = {}
    for fqn, e in entries.items():
        if e["kind"] == "tensor":
            sd[fqn] = torch.full(e["shape"], 0, dtype=getattr(torch, e["dtype"].split(".")[1]))
        else:
            sd[fqn] = io.BytesIO()
    tdcp.load(sd, checkpoint_id=directory)
    failures = 0
    for fqn, e in entries.items():
        if e["kind"] == "tensor":
            ok = torch.equal(as_bytes(sd[fqn]), as_bytes(want[fqn]))
        else:
            ok = repr(sd[fqn]) == e["python_repr"]
        if not ok:
            failures += 1
            print("  MISMATCH %s: %s" % (fqn, repr(sd[fqn])[:200]))
    print("%s: %s: %d entries, %d mismatches" % (case, directory, len(entries), failures))
    return failures


failures = 0
for case in ("single_dtypes", "model_adamw", "dist4_dtensor"):
    native = os.path.join(args.workdir, case + ".dcp")
    written = os.path.join(args.workdir, case + ".torchdcp")
    run_dcp("convert", os.path.join(args.fixtures, case), native)
    run_dcp("convert", native, "torchdcp://" + written)
    failures += check(case, written)
for extra in args.extra:
    case, directory = extra.split("=", 1)
    failures += check(case, directory)
print("torch2_load_check:", "PASS" if failures == 0 else "FAIL (%d mismatches)" % failures)
sys.exit(1 if failures else 0)
