"""torch.distributed.checkpoint through dcp.torch against torch's own FileSystemWriter/Reader, in
one process, the same state, alternating, each save to a fresh directory (both fsync their
files), each load warm into preallocated tensors. Prints each side's median and dcp.torch's
time over torch's (below 1: dcp.torch is faster).

    PYTHONPATH=build/python python3 tools/python/dcp_torch_plugin_bench.py --mib 256 --repeats 5
"""
import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

import dcp.torch

tdc = dcp.torch._api


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256, help="state size (8 fp32 tensors)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    a = ap.parse_args()
    root = a.dir or tempfile.mkdtemp(prefix="dcp-torch-plugin-bench-")
    os.makedirs(root, exist_ok=True)
    n = a.mib * (1 << 20) // 4 // 8
    state = {"t%d" % i: torch.randn(n) for i in range(8)}
    back = {k: torch.empty_like(v) for k, v in state.items()}
    kw = {"no_dist": True}
    times = {"torch save": [], "dcp.torch save": [], "torch load": [], "dcp.torch load": []}
    for r in range(a.repeats):
        sides = [("torch", lambda p: tdc.FileSystemWriter(p), lambda p: tdc.FileSystemReader(p)),
                 ("dcp.torch", lambda p: dcp.torch.Writer(p), lambda p: dcp.torch.Reader(p))]
        if r % 2:
            sides.reverse()
        for name, writer, reader in sides:
            path = os.path.join(root, "%s-%d" % (name, r))
            t0 = time.perf_counter()
            tdc.save_state_dict(state, storage_writer=writer(path), **kw)
            times[name + " save"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            tdc.load_state_dict(back, storage_reader=reader(path), **kw)
            times[name + " load"].append(time.perf_counter() - t0)
            assert all(torch.equal(back[k], v) for k, v in state.items()), name
            shutil.rmtree(path)
    med = {k: statistics.median(v) for k, v in times.items()}
    gib = a.mib / 1024
    for op in ("save", "load"):
        t, d = med["torch " + op], med["dcp.torch " + op]
        print("%s %d MiB: torch %.3f s (%.2f GiB/s), dcp.torch %.3f s (%.2f GiB/s): dcp.torch/torch "
              "%.2fx (median of %d)" % (op, a.mib, t, gib / t, d, gib / d, d / t, a.repeats))
    if not a.dir:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
