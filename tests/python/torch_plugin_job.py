"""torch.distributed.checkpoint with dcp.torch's Writer and Reader, as torchrun launches a job
(tests/python/python_check.sh). torch 1.13's DCP (torch.distributed._shard.checkpoint) here; the
same calls on torch 2.x (torch.distributed.checkpoint) where it is installed.

    torch_plugin_job.py save OUT NATIVE FIXTURES   at 4 processes:
        dcp.torch.Writer saves a row-sharded ShardedTensor, a replicated bf16 tensor, bytes, bytes
        holding a torch.save archive, and a dict; torch's FileSystemReader loads it bit-exact;
        torch's FileSystemWriter saves the same and dcp.torch.Reader loads it bit-exact; a second
        save without overwrite fails on every process (dcp.AlreadyExistsError) and one with it
        replaces the checkpoint and its files; dcp.torch.Reader loads NATIVE (a dcp checkpoint
        of python_job.py, saved at 4 with dcp.Shard) and torch 2.11's dist4_dtensor fixture
        into torch 1.13's load. With DCP_TEST_S3_ENDPOINT set, a save to s3:// and a load
        of it, column-sharded.
    torch_plugin_job.py load OUT                   at 2 processes: both checkpoints of `save`
        loaded column-sharded (resharded) by dcp.torch.Reader and torch's reader, bit-exact; a
        flipped byte in a copy fails the load with dcp.CorruptionError naming the file.
"""
import io
import json
import os
import shutil
import struct
import sys

import torch
import torch.distributed as dist

import dcp
import dcp.torch

tdc = dcp.torch._api  # torch.distributed.checkpoint, or torch 1.13's _shard.checkpoint
from torch.distributed._shard import sharded_tensor  # noqa: E402
from torch.distributed._shard.sharding_spec import ChunkShardingSpec  # noqa: E402

ROWS, COLS = 301, 17


def expected():
    i = torch.arange(ROWS, dtype=torch.float32).reshape(ROWS, 1)
    j = torch.arange(COLS, dtype=torch.float32).reshape(1, COLS)
    return i * 64 + j + 0.25


def archive_bytes():
    buf = io.BytesIO()
    torch.save({"x": 1}, buf)
    return buf.getvalue()


def sharded(dim, fill, shift=0.0):
    world = dist.get_world_size()
    spec = ChunkShardingSpec(dim=dim, placements=["rank:%d/cpu" % r for r in range(world)])
    st = sharded_tensor.zeros(spec, ROWS, COLS)
    for shard in st.local_shards():
        (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        if fill:
            shard.tensor.copy_(expected()[r0:r0 + nr, c0:c0 + nc] + shift)
    return st


def state(dim, fill, shift=0.0):
    return {
        "w": sharded(dim, fill, shift),
        "b": torch.linspace(-1, 1, 9, dtype=torch.bfloat16) if fill else torch.zeros(9, dtype=torch.bfloat16),
        "blob": bytes(range(7)) if fill else b"",
        "archive": archive_bytes() if fill else b"",
        "extra": {"step": 7, "lr": 0.5} if fill else {},
    }


def check(sd, shift=0.0):
    for shard in sd["w"].local_shards():
        (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        if not torch.equal(shard.tensor, expected()[r0:r0 + nr, c0:c0 + nc] + shift):
            return "w differs at %s" % ([r0, c0],)
    if not torch.equal(sd["b"], torch.linspace(-1, 1, 9, dtype=torch.bfloat16)):
        return "b differs"
    if sd["blob"] != bytes(range(7)):
        return "blob is %r" % (sd["blob"],)
    if sd["archive"] != archive_bytes():
        return "archive is %r" % (sd["archive"][:40],)
    if sd["extra"] != {"step": 7, "lr": 0.5}:
        return "extra is %r" % (sd["extra"],)
    return None


def say(what):
    print("rank %d: %s" % (dist.get_rank(), what), flush=True)


def require(problem, what):
    if problem:
        raise SystemExit("rank %d: %s: %s" % (dist.get_rank(), what, problem))
    say(what)


def dcp_error(e):
    # torch reports every rank's failure in one CheckpointException; its failures hold
    # (exception, traceback) per failing rank.
    return [pair[0] if isinstance(pair, tuple) else pair for pair in e.failures.values()]


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        b, e = t["data_offsets"]
        dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                 "I64": torch.int64}[t["dtype"]]
        raw = bytearray(data[8 + n + b:8 + n + e])
        out[name] = torch.frombuffer(raw, dtype=dtype).reshape(t["shape"]) if raw else \
            torch.empty(t["shape"], dtype=dtype)
    return out


def save_mode(out, native, fixtures):
    plugin, theirs = os.path.join(out, "plugin"), os.path.join(out, "torch")
    sd = state(0, True)
    # [readme-python-torch]
    writer = dcp.torch.Writer(plugin)  # a path, file://, s3://...: any store dcp has
    tdc.save_state_dict(sd, storage_writer=writer)  # torch 2.x: tdc.save(sd, storage_writer=writer)
    back = state(0, False)
    tdc.load_state_dict(back, storage_reader=tdc.FileSystemReader(plugin))  # torch's own reader
    # [readme-python-torch-end]
    require(check(back), "torch's FileSystemReader loaded dcp.torch.Writer's checkpoint bit-exact")

    tdc.save_state_dict(sd, storage_writer=tdc.FileSystemWriter(theirs))
    back = state(0, False)
    tdc.load_state_dict(back, storage_reader=dcp.torch.Reader(theirs))
    require(check(back), "dcp.torch.Reader loaded torch's FileSystemWriter checkpoint bit-exact")

    try:
        tdc.save_state_dict(sd, storage_writer=dcp.torch.Writer(plugin))
        raise SystemExit("a second save without overwrite succeeded")
    except tdc.CheckpointException as e:
        errors = dcp_error(e)
        require(None if errors and all(isinstance(x, dcp.AlreadyExistsError) for x in errors)
                else "raised %r" % (errors,), "a save over it without overwrite raised AlreadyExistsError")
    before = sorted(f for f in os.listdir(plugin) if f.endswith(".distcp"))
    tdc.save_state_dict(state(0, True, shift=1.0), storage_writer=dcp.torch.Writer(plugin, overwrite=True))
    back = state(0, False)
    tdc.load_state_dict(back, storage_reader=tdc.FileSystemReader(plugin))
    after = sorted(f for f in os.listdir(plugin) if f.endswith(".distcp"))
    require(check(back, shift=1.0) or (None if len(after) == 4 and not set(before) & set(after)
                                       else "files before %s, after %s" % (before, after)),
            "overwrite=True replaced the checkpoint and its files")
    tdc.save_state_dict(sd, storage_writer=dcp.torch.Writer(plugin, overwrite=True))

    # The same through dcp's s3:// store, when the test server is up (python_check.sh says which).
    if os.environ.get("DCP_TEST_S3_ENDPOINT"):
        uri = "s3://dcp-python/plugin-%s" % os.environ["MASTER_PORT"]
        tdc.save_state_dict(sd, storage_writer=dcp.torch.Writer(uri))
        back = state(1, False)
        tdc.load_state_dict(back, storage_reader=dcp.torch.Reader(uri))
        require(check(back), "s3://: dcp.torch.Writer's checkpoint loaded column-sharded, bit-exact")

    # A dcp checkpoint (python_job.py save: dcp.Shard rows at 4, str, bytes) into torch's load.
    spec = ChunkShardingSpec(dim=1, placements=["rank:%d/cpu" % r for r in range(dist.get_world_size())])
    nat = {"model.w": sharded_tensor.zeros(spec, ROWS, COLS),
           "model.b": torch.zeros(9, dtype=torch.bfloat16), "note": None, "rng": None}
    tdc.load_state_dict(nat, storage_reader=dcp.torch.Reader(native))
    problem = None
    for shard in nat["model.w"].local_shards():
        (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        if not torch.equal(shard.tensor, expected()[r0:r0 + nr, c0:c0 + nc]):
            problem = "model.w differs"
    if nat["note"] != b"saved from Python" or nat["rng"] != bytes(range(7)):
        problem = "blobs are %r, %r" % (nat["note"], nat["rng"])
    require(problem or (None if torch.equal(nat["model.b"], torch.linspace(-1, 1, 9, dtype=torch.bfloat16))
                        else "model.b differs"),
            "dcp.torch.Reader loaded a dcp checkpoint into torch's load, resharded, bit-exact")

    # torch 2.11's DTensor checkpoint (4 processes) into torch 1.13's load.
    want = read_safetensors(os.path.join(fixtures, "dist4_dtensor.expected.safetensors"))
    got = {name: torch.zeros_like(t) for name, t in want.items()}
    got["per_rank_step"] = None
    tdc.load_state_dict(got, storage_reader=dcp.torch.Reader(os.path.join(fixtures, "dist4_dtensor")))
    bad = [n for n, t in want.items() if not torch.equal(got[n], t)]
    require(("differ: %s" % bad if bad else None) or (None if got["per_rank_step"] == 7
                                                      else "per_rank_step is %r" % (got["per_rank_step"],)),
            "dcp.torch.Reader loaded torch 2.11's DTensor checkpoint into this torch, bit-exact")


def load_mode(out):
    for name in ("plugin", "torch"):
        path = os.path.join(out, name)
        for reader in (dcp.torch.Reader(path), tdc.FileSystemReader(path)):
            back = state(1, False)
            tdc.load_state_dict(back, storage_reader=reader)
            require(check(back), "%s's checkpoint loaded column-sharded at 2 by %s, bit-exact"
                    % (name, type(reader).__module__ + "." + type(reader).__name__))
    # A flipped byte in a copy: the load fails on every process, naming the damaged file.
    damaged = os.path.join(out, "damaged")
    if dist.get_rank() == 0:
        shutil.copytree(os.path.join(out, "plugin"), damaged)
        name = sorted(f for f in os.listdir(damaged) if f.endswith(".distcp"))[1]
        with open(os.path.join(damaged, name), "r+b") as f:
            f.seek(os.path.getsize(os.path.join(damaged, name)) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x10]))
    dist.barrier()
    try:
        tdc.load_state_dict(state(1, False), storage_reader=dcp.torch.Reader(damaged))
        raise SystemExit("a load of a damaged checkpoint succeeded")
    except tdc.CheckpointException as e:
        errors = dcp_error(e)
        require(None if errors and all(isinstance(x, dcp.CorruptionError) and ".distcp" in str(x)
                                       for x in errors) else "raised %r" % (errors,),
                "a flipped byte failed the load with CorruptionError naming the file")


def main():
    dist.init_process_group("gloo")
    mode = sys.argv[1]
    if mode == "save":
        save_mode(*sys.argv[2:5])
    elif mode == "load":
        load_mode(sys.argv[2])
    else:
        raise SystemExit("unknown mode " + mode)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
