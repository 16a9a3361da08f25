"""dcp-python-bench: what a background dcp save costs a Python compute loop (issue 47).

    PYTHONPATH=build/python python3 tools/python/dcp_python_bench.py --mib 256 --repeats 5 --dir /tmp/x

A compute loop (torch matmuls on one thread, as a training step's CPU work) is timed alone and
while dcp.save(..., async_save=True) writes --mib of state in the background (the snapshot is
taken before the timed loop starts: what the loop pays is the background write's share of the
machine), and again counting the call's blocking snapshot. Prints the medians of --repeats pairs
(alone/with, alternating). One process (no torchrun needed).
"""
import argparse
import shutil
import statistics
import time

import torch

import dcp


def loop(a, b, seconds):
    # As many steps as fit in `seconds`; returns (steps, elapsed seconds).
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(a, b)
        steps += 1
    return steps, time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", default="/tmp/dcp-python-bench")
    p.add_argument("--seconds", type=float, default=0.0, help="loop length (0: the save's time)")
    args = p.parse_args()
    torch.set_num_threads(1)
    dcp.init()
    n = args.mib * (1 << 20) // 4 // 8
    state = {"layer%d" % i: torch.rand(n) for i in range(8)}
    a, b = torch.rand(384, 384), torch.rand(384, 384)
    shutil.rmtree(args.dir, ignore_errors=True)
    t0 = time.perf_counter()
    dcp.save(state, args.dir + "/warm", async_save=True)
    dcp.wait()
    save_s = time.perf_counter() - t0
    seconds = args.seconds or max(0.5, save_s)
    ratios, with_call = [], []
    for r in range(args.repeats):
        rate, blocking = {}, 0.0
        for mode in (("alone", "with") if r % 2 == 0 else ("with", "alone")):
            if mode == "with":
                t0 = time.perf_counter()
                dcp.save(state, "%s/s%d" % (args.dir, r), async_save=True)
                blocking = time.perf_counter() - t0
            steps, elapsed = loop(a, b, seconds)
            rate[mode] = steps / elapsed
            if mode == "with":
                dcp.wait()
                rate["with_call"] = steps / (elapsed + blocking)
        ratios.append(rate["alone"] / rate["with"])
        with_call.append(rate["alone"] / rate["with_call"])
    shutil.rmtree(args.dir, ignore_errors=True)
    print("dcp-python-bench: %d MiB, background save %.3f s, loop %.2f s, %d pairs"
          % (args.mib, save_s, seconds, args.repeats))
    print("  compute loop slowdown during a background save: %.3fx (median; 1.000 = none)"
          % statistics.median(ratios))
    print("  ... counting the save call's blocking snapshot too:   %.3fx" % statistics.median(with_call))
    dcp.close()


if __name__ == "__main__":
    main()
