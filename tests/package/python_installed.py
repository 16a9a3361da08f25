"""The installed Python package, imported from the prefix alone (tests/package/run_consumer.cmake):
`import dcp` and `import dcp.torch` come from PREFIX, dcp's libraries too, and a save and a
load_all work. Usage: python_installed.py PREFIX CKPT_DIR."""
import os
import sys

prefix, ckpt = os.path.realpath(sys.argv[1]), sys.argv[2]
import torch  # noqa: E402

import dcp  # noqa: E402
import dcp.torch  # noqa: E402,F401

for module in (dcp, dcp._dcp, dcp.torch):
    assert os.path.realpath(module.__file__).startswith(prefix + "/"), module.__file__
with open("/proc/self/maps") as maps:
    libs = {line.split()[-1] for line in maps if "libdcp" in line}
assert libs and all(os.path.realpath(lib).startswith(prefix + "/") for lib in libs), libs
dcp.init()
dcp.save({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "note": b"installed"}, ckpt,
         overwrite=True)
back = dcp.load_all(ckpt)
assert torch.equal(back["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3)), back
assert back["note"] == b"installed"
dcp.close()
print("installed package: dcp and dcp.torch from %s, %d libdcp libraries from there, a save "
      "and a load_all" % (prefix, len(libs)))
