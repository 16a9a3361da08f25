"""A Python job as torchrun launches it, through `import dcp` (tests/python/python_check.sh).

    python_job.py save DIR     row-sharded "w", a replicated bf16 "b", a str and bytes, saved to
                               DIR, and in the background to DIR-async (the tensors are changed
                               right after the call returns: the save has its snapshot)
    python_job.py load DIR     at another world size: both loaded column-sharded, bit-exact;
                               load_all; a load of a missing checkpoint raises dcp.NotFoundError
                               on every process; a second save to DIR raises AlreadyExistsError
    python_job.py manager DIR  dcp.CheckpointManager with the memory tier (2 simulated nodes):
                               steps 1-4 in the background, every 2nd also under DIR; a second
                               manager restores step 4 from memory, bit-exact, then frees it
    python_job.py preempt DIR  the same with a preemption handler: SIGTERM after step 3 drains it
                               under DIR; a manager without the tier restores it, bit-exact
    python_job.py errors DIR   one process: wrong types and dtypes raise the named errors
"""
import os
import signal
import sys
import zlib

import torch

import dcp

ROWS, COLS = 301, 17


def share(n, rank, world):
    return n * rank // world, n * (rank + 1) // world


def expected():
    i = torch.arange(ROWS, dtype=torch.float32).reshape(ROWS, 1)
    j = torch.arange(COLS, dtype=torch.float32).reshape(1, COLS)
    return i * 64 + j + 0.25


def state(rank, world, by_rows, fill):
    full = expected()
    lo, hi = share(ROWS if by_rows else COLS, rank, world)
    piece = full[lo:hi] if by_rows else full[:, lo:hi]
    piece = piece.contiguous().clone() if fill else torch.zeros_like(piece).contiguous()
    b = torch.linspace(-1, 1, 9, dtype=torch.bfloat16) if fill else torch.zeros(9, dtype=torch.bfloat16)
    return {
        "model": {
            "w": dcp.Shard(piece, [ROWS, COLS], [lo, 0] if by_rows else [0, lo]),
            "b": b,
        },
        "note": "saved from Python" if fill else "",
        "rng": bytes(range(7)) if fill else b"",
    }


def check(sd, rank, world):
    lo, hi = share(COLS, rank, world)
    ok = torch.equal(sd["model"]["w"].tensor, expected()[:, lo:hi])
    ok = ok and torch.equal(sd["model"]["b"], torch.linspace(-1, 1, 9, dtype=torch.bfloat16))
    ok = ok and sd["note"] == "saved from Python" and sd["rng"] == bytes(range(7))
    return ok


def expect_error(cls, fn, what):
    try:
        fn()
    except cls as e:
        print("rank %d: %s raised %s: %s" % (dcp.rank(), what, type(e).__name__, str(e).splitlines()[0]))
        return True
    except Exception as e:  # noqa: BLE001
        print("rank %d: %s raised %s, not %s: %s" % (dcp.rank(), what, type(e).__name__, cls.__name__, e))
        return False
    print("rank %d: %s raised nothing" % (dcp.rank(), what))
    return False


def run(mode, where, rank, world):
    if mode == "save":
        sd = state(rank, world, by_rows=True, fill=True)
        dcp.save(sd, where)
        dcp.save(sd, where + "-async", async_save=True)
        sd["model"]["w"].tensor.fill_(-7)  # after the snapshot: must not reach the checkpoint
        sd["model"]["b"].fill_(-7)
        dcp.wait()
        print("rank %d of %d: saved %s and %s-async" % (rank, world, where, where))
    elif mode == "load":
        ok = True
        for source in (where, where + "-async"):
            sd = state(rank, world, by_rows=False, fill=False)
            dcp.load(sd, source)
            if not check(sd, rank, world):
                print("rank %d: %s loaded other values" % (rank, source))
                ok = False
        whole = dcp.load_all(where)
        ok = ok and torch.equal(whole["model.w"], expected()) and whole["rng"] == bytes(range(7))
        ok = expect_error(dcp.NotFoundError,
                          lambda: dcp.load(state(rank, world, False, False), where + "-missing"),
                          "a load of a missing checkpoint") and ok
        ok = expect_error(dcp.AlreadyExistsError,
                          lambda: dcp.save(state(rank, world, False, True), where),
                          "a save over a checkpoint") and ok
        if ok:
            print("rank %d of %d: loaded bit-exact, resharded" % (rank, world))
        return 0 if ok else 1
    elif mode == "manager":
        tier = "pyjob-%08x" % (zlib.crc32(where.encode()))
        opts = dict(keep_last=2, memory_tier=tier, ranks_per_node=2, durable_every=2)
        sd = state(rank, world, by_rows=True, fill=True)
        with dcp.CheckpointManager(where, **opts) as m:
            first = m.restore(sd)
            for step in range(1, 5):
                sd["model"]["w"].tensor.add_(1.0)
                sd["note"] = "step %d" % step
                m.save(step, sd)
        back = state(rank, world, by_rows=True, fill=False)
        with dcp.CheckpointManager(where, free_on_close=True, **opts) as m:
            step = m.restore(back)
            source = m.restore_source
        ok = first is None and step == 4 and source == "memory" and back["note"] == "step 4"
        ok = ok and torch.equal(back["model"]["w"].tensor, sd["model"]["w"].tensor)
        # Incremental steps: a frozen 4 MiB tensor is written once; steps 2-3 write the rest.
        inc = where + "-incremental"
        frozen = torch.arange(1 << 20, dtype=torch.float32)
        sd["frozen"] = frozen
        with dcp.CheckpointManager(inc, keep_last=1, incremental=True, frozen=["frozen"],
                                   async_save=False) as m:
            for inc_step in range(1, 4):
                sd["model"]["w"].tensor.add_(1.0)
                m.save(inc_step, sd)
        sizes = {}
        for d in sorted(os.listdir(inc)):
            if os.path.isdir(os.path.join(inc, d)):
                sizes[d] = sum(os.path.getsize(os.path.join(inc, d, f))
                               for f in os.listdir(os.path.join(inc, d)))
        back = state(rank, world, by_rows=True, fill=False)
        back["frozen"] = torch.zeros(1 << 20)
        with dcp.CheckpointManager(inc, keep_last=1, incremental=True) as m:
            inc_step = m.restore(back)
        inc_ok = inc_step == 3 and torch.equal(back["frozen"], frozen)
        inc_ok = inc_ok and torch.equal(back["model"]["w"].tensor, sd["model"]["w"].tensor)
        # Step 1 keeps only the data step 3 shares (the frozen tensor), step 3 the rest.
        step1, step3 = sizes.get("step-0000000001", 0), sizes.get("step-0000000003", 0)
        inc_ok = inc_ok and step1 >= frozen.numel() * 4 and step3 < step1 and len(sizes) == 2
        ok = ok and inc_ok
        print("rank %d of %d: manager restored step %s from %s%s; incremental step %s%s"
              % (rank, world, step, source, ", bit-exact" if ok else ", NOT as saved", inc_step,
                 " restored bit-exact (sizes %s)" % sizes if inc_ok else " WRONG (sizes %s)" % sizes))
        return 0 if ok else 1
    elif mode == "preempt":
        # Steps only to memory; SIGTERM to every process after step 3: the handler drains step 3
        # under DIR, and a manager without a tier restores it from there.
        tier = "pyjob-%08x" % (zlib.crc32(where.encode()))
        opts = dict(keep_last=2, memory_tier=tier, ranks_per_node=2, durable_every=1000,
                    free_on_close=True)
        sd = state(rank, world, by_rows=True, fill=True)
        saved = None
        with dcp.CheckpointManager(where, **opts) as m:
            m.handle_preemption(grace_s=60)
            for step in range(1, 10):
                # Not `if m.preempted(): break`: that is this process's notice only, and the
                # others would save without it. The save after a notice fails on every process.
                sd["model"]["w"].tensor.add_(1.0)
                sd["note"] = "step %d" % step
                try:
                    m.save(step, sd)
                except dcp.PreemptedError:
                    break
                if step == 3:
                    m.wait()
                    saved = sd["model"]["w"].tensor.clone()
                    os.kill(os.getpid(), signal.SIGTERM)
            report = m.wait_for_preemption(120)
        back = state(rank, world, by_rows=True, fill=False)
        with dcp.CheckpointManager(where, keep_last=2) as m:
            step = m.restore(back)
        ok = report["done"] and report["step"] == 3 and report["drained"] and not report["error"]
        ok = ok and step == 3 and back["note"] == "step 3"
        ok = ok and torch.equal(back["model"]["w"].tensor, saved)
        print("rank %d of %d: preempted, step %s drained in %.2f s (%.1f s of the window left), "
              "restored %s%s" % (rank, world, report["step"], report["seconds"],
                                 report["window_left_s"], step, ", bit-exact" if ok else ", NOT as saved"))
        return 0 if ok else 1
    elif mode == "errors":
        ok = expect_error(dcp.InvalidArgumentError, lambda: dcp.save({"x": 3}, where), "an int value")
        ok = expect_error(dcp.InvalidArgumentError,
                          lambda: dcp.save({"x": torch.zeros(4, 4).t()}, where),
                          "a transposed tensor") and ok
        ok = expect_error(dcp.InvalidArgumentError,
                          lambda: dcp.Shard(torch.zeros(2), [4, 4], [0]), "a shard of another rank") and ok
        dcp.save({"x": torch.ones(3)}, where)
        ok = expect_error(dcp.Error, lambda: dcp.load({"x": torch.zeros(4)}, where),
                          "a load into another shape") and ok
        print("errors: %s" % ("as named" if ok else "NOT as named"))
        return 0 if ok else 1
    return 0


def main():
    # MODE may join several with "+" (one launch: torch's import is most of a process's start).
    modes, where = sys.argv[1], sys.argv[2]
    dcp.init(timeout_s=100)
    rank, world = dcp.rank(), dcp.world_size()
    rc = 0
    for mode in modes.split("+"):
        rc = rc or run(mode, where if "+" not in modes else where + "/" + mode, rank, world)
    dcp.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
