"""README.md's Python section, run as written under torchrun by tests/python/python_check.sh
(the block between the markers is quoted in README.md; tests/readme/readme_build.py keeps the two
equal). Usage: readme_example.py CKPT_DIR."""
import sys

ckpt = sys.argv[1]
# [readme-python]
import torch
import dcp

dcp.init()  # under torchrun: every process of the job (without WORLD_SIZE: one process)
rank, world = dcp.rank(), dcp.world_size()

# Each process holds rows [lo, hi) of a 1024 x 256 weight, and the whole bias.
lo, hi = 1024 * rank // world, 1024 * (rank + 1) // world
w = torch.randn(hi - lo, 256)
state = {"model": {"w": dcp.Shard(w, [1024, 256], [lo, 0]), "b": torch.zeros(256)},
         "step": "1200"}
dcp.save(state, ckpt)                           # collective: every process calls it
dcp.save(state, ckpt + "-bg", async_save=True)  # returns once the state is copied aside
w.add_(1.0)                                     # ... training goes on meanwhile ...
dcp.wait()                                      # (or the next save waits)

# Load at any world size, in any sharding: here each process takes columns.
c0, c1 = 256 * rank // world, 256 * (rank + 1) // world
back = {"model": {"w": dcp.Shard(torch.empty(1024, c1 - c0), [1024, 256], [0, c0]),
                  "b": torch.empty(256)},
        "step": ""}
dcp.load(back, ckpt)
try:
    dcp.load(back, ckpt + "-missing")
except dcp.NotFoundError as e:  # dcp's errors by category, the same on every process
    print(e)
# [readme-python-end]
whole = dcp.load_all(ckpt + "-bg")["model.w"]
assert torch.equal(whole[lo:hi] + 1.0, w), "the background save holds the state of its call"
assert torch.equal(back["model"]["w"].tensor, dcp.load_all(ckpt)["model.w"][:, c0:c1])
assert back["step"] == "1200"
print("readme example: rank %d of %d OK" % (rank, world))
dcp.close()
