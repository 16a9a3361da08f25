"""Imports torch and torch 1.13's DCP (torch.distributed._shard.checkpoint) for the interop tests,
exiting 77 (skipped) when this python has no torch or its torch has no such module.

    sys.path.insert(0, <tests/support>); from torch113_dcp import torch, tdcp
"""
import copy, dataclasses, sys

try:
    import torch
except ImportError:
    print("skipped: this python has no torch")
    sys.exit(77)

# torch 1.13's DCP dataclasses fail to import on Python 3.11 without this shim.
_orig = dataclasses._get_field
def _get_field(cls, a_name, a_type, *rest):
    d = cls.__dict__.get(a_name, dataclasses.MISSING)
    val = d.default if isinstance(d, dataclasses.Field) else d
    if val is not dataclasses.MISSING and dataclasses.is_dataclass(val) and type(val).__hash__ is None:
        setattr(cls, a_name, dataclasses.field(default_factory=lambda v=val: copy.deepcopy(v)))
    return _orig(cls, a_name, a_type, *rest)
dataclasses._get_field = _get_field
try:
    import torch.distributed._shard.checkpoint as tdcp
except Exception as e:  # a torch without the 1.13 module (2.x) is not these tests' subject
    print("skipped: no torch.distributed._shard.checkpoint: %s" % e)
    sys.exit(77)
finally:
    dataclasses._get_field = _orig
