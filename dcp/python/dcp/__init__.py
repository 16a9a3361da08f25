"""dcp from Python: save and load torch state dicts with dcp's runtime.

    import dcp
    dcp.init()                          # under torchrun: the job's processes; else one process
    dcp.save({"model": model.state_dict(), "step": b"1200"}, "/ckpt/step-1200")
    dcp.load(state, "/ckpt/step-1200")  # into the tensors of `state`, in place, resharded
    dcp.close()

State dicts are (nested) dicts whose values are torch tensors (every rank holds the same
tensor: stored once), ``dcp.Shard`` (this rank's piece of a tensor sharded across the job),
``bytes``/``str`` (stored as is) or dicts of those. Keys are joined with "." as in
torch.distributed.checkpoint. Tensors must be contiguous, on the CPU or a CUDA device; dcp reads
and writes their own memory (no copy) and keeps them alive for the call.

Processes: ``init`` connects the processes torchrun started (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT from the environment) over c10d's Gloo, beside any torch.distributed process group
the job has; every call below is collective over them, and every process must make it. Without
WORLD_SIZE, one process.

Errors raise ``dcp.Error`` subclasses by category (``NotFoundError``, ``CorruptionError``,
``CollectiveError`` with ``phase`` and ``failures``, ...), the same on every process. The GIL is
released while dcp does I/O or waits for other processes.

Thread safety: one thread of a process calls dcp at a time.
"""

import atexit as _atexit

from . import _dcp

__all__ = [
    "init", "close", "rank", "world_size", "Shard", "save", "wait", "load", "load_all",
    "CheckpointManager", "notify_preemption",
    "Error", "InvalidArgumentError", "NotFoundError", "AlreadyExistsError", "CorruptionError",
    "IoError", "UnsupportedError", "CollectiveError", "TimeoutError", "InternalError",
    "DeviceError", "ResourceExhaustedError", "PreemptedError",
]


class Error(RuntimeError):
    """A dcp error. ``code`` names its category (dcp::ErrorCode)."""

    code = "Internal"

    def __init__(self, message, phase="", failures=()):
        super().__init__(message)
        self.phase = phase
        self.failures = list(failures)


class InvalidArgumentError(Error, ValueError):
    code = "InvalidArgument"


class NotFoundError(Error, FileNotFoundError):
    code = "NotFound"


class AlreadyExistsError(Error, FileExistsError):
    code = "AlreadyExists"


class CorruptionError(Error):
    code = "Corruption"


class IoError(Error, OSError):
    code = "Io"


class UnsupportedError(Error):
    code = "Unsupported"


class CollectiveError(Error):
    """One or more processes failed. ``failures``: (rank, code, message) of each;
    ``failed_ranks``: their ranks."""

    code = "Collective"

    @property
    def failed_ranks(self):
        return sorted({f[0] for f in self.failures})


class TimeoutError(Error):  # noqa: A001 (dcp's category, as in C++)
    code = "Timeout"


class InternalError(Error):
    code = "Internal"


class DeviceError(Error):
    code = "Device"


class ResourceExhaustedError(Error, MemoryError):
    code = "ResourceExhausted"


class PreemptedError(Error):
    code = "Preempted"


_BY_CODE = {c.code: c for c in (
    InvalidArgumentError, NotFoundError, AlreadyExistsError, CorruptionError, IoError,
    UnsupportedError, CollectiveError, TimeoutError, InternalError, DeviceError,
    ResourceExhaustedError, PreemptedError)}


_COLLECTIVE_OF = {}


def _raise(code, message, phase, failures):
    # Called by the C++ half. A collective failure whose ranks all failed alike is also of their
    # category: ``except dcp.NotFoundError`` catches a load of a missing checkpoint on every rank.
    cls = _BY_CODE.get(code, Error)
    codes = {f[1] for f in failures}
    if cls is CollectiveError and len(codes) == 1:
        (common,) = codes
        if common in _BY_CODE and common != "Collective":
            if common not in _COLLECTIVE_OF:
                _COLLECTIVE_OF[common] = type("Collective" + _BY_CODE[common].__name__,
                                              (CollectiveError, _BY_CODE[common]),
                                              {"code": common})
            cls = _COLLECTIVE_OF[common]
    raise cls(message, phase, failures)


class Shard:
    """This process's piece of a tensor sharded across the job: ``tensor`` holds the elements
    of the global tensor (shape ``global_shape``) that start at ``offsets``."""

    __slots__ = ("tensor", "global_shape", "offsets")

    def __init__(self, tensor, global_shape, offsets):
        if len(global_shape) != tensor.dim() or len(offsets) != tensor.dim():
            raise InvalidArgumentError(
                "dcp.Shard: global_shape %s and offsets %s need %d dimensions, as the tensor"
                % (list(global_shape), list(offsets), tensor.dim()))
        self.tensor = tensor
        self.global_shape = [int(d) for d in global_shape]
        self.offsets = [int(o) for o in offsets]


def init(timeout_s=1800.0):
    """Connect this process to the job (collective; idempotent). ``timeout_s`` bounds connecting
    and every later collective: a process that does not answer in time fails the call on every
    process, naming it."""
    _dcp.init(float(timeout_s))


def close():
    """Wait for a background save, then disconnect (collective). Called at exit too."""
    _dcp.close()


def rank():
    return _dcp.rank()


def world_size():
    return _dcp.world_size()


def _tensor_entry(key, t):
    if not t.is_contiguous():
        raise InvalidArgumentError("dcp: tensor '%s' is not contiguous (call .contiguous())" % key)
    dtype = str(t.dtype)
    return (t.data_ptr(), dtype[6:] if dtype.startswith("torch.") else dtype, list(t.shape),
            t.device.type, t.device.index if t.device.index is not None else 0)


def _flatten(state, prefix, entries, keep):
    import torch

    for key, value in state.items():
        if not isinstance(key, str):
            raise InvalidArgumentError("dcp: key %r under '%s' is not a str" % (key, prefix))
        name = prefix + key
        if isinstance(value, dict):
            _flatten(value, name + ".", entries, keep)
        elif isinstance(value, torch.Tensor):
            keep.append(value)
            entries.append((name, "tensor", _tensor_entry(name, value)))
        elif isinstance(value, Shard):
            keep.append(value.tensor)
            entries.append((name, "shard", _tensor_entry(name, value.tensor)
                            + (value.global_shape, value.offsets)))
        elif isinstance(value, (bytes, bytearray)):
            entries.append((name, "blob", bytes(value)))
        elif isinstance(value, str):
            entries.append((name, "blob", value.encode()))
        else:
            raise InvalidArgumentError(
                "dcp: '%s' is a %s; dcp stores tensors, dcp.Shard, bytes and str"
                % (name, type(value).__name__))
    return entries


def save(state_dict, uri, overwrite=False, async_save=False):
    """Save ``state_dict`` to ``uri`` (a path, file://, s3://, ...). Collective. With
    ``async_save`` the call returns once the state is copied aside; the write goes on in the
    background (``wait()``; its error, if any, raises at the next save or wait). ``overwrite``
    replaces a checkpoint already at ``uri``."""
    keep = []
    entries = _flatten(state_dict, "", [], keep)
    return _dcp.save(entries, str(uri), bool(overwrite), bool(async_save))


def wait():
    """Wait for the background save; raises its error."""
    _dcp.wait()


def load(state_dict, uri):
    """Load the checkpoint at ``uri`` into ``state_dict``'s tensors and shards in place,
    resharded from whatever layout and world size saved it; bytes and str values are replaced
    by what was saved (str stays str). Collective."""
    keep = []
    entries = _flatten(state_dict, "", [], keep)
    blobs = _dcp.load(entries, str(uri))
    _put_blobs(state_dict, "", blobs)


def _put_blobs(state, prefix, blobs):
    for key, value in state.items():
        name = prefix + key
        if isinstance(value, dict):
            _put_blobs(value, name + ".", blobs)
        elif name in blobs:
            state[key] = blobs[name].decode() if isinstance(value, str) else blobs[name]


def load_all(uri):
    """Every item of the checkpoint at ``uri``, whole, on the CPU, on every process: a flat dict
    of key -> torch.Tensor (or bytes). The tensors are the memory dcp loaded into (no copy).
    Collective."""
    import torch

    out = {}
    for key, value in _dcp.load_all(str(uri)).items():
        if isinstance(value, bytes):
            out[key] = value
            continue
        dtype, shape, data = value
        # The memory dcp loaded into, not a copy: the tensor keeps it alive.
        t = torch.frombuffer(data, dtype=getattr(torch, dtype)) if len(data) else \
            torch.empty(0, dtype=getattr(torch, dtype))
        out[key] = t.reshape(shape)
    return out


class CheckpointManager:
    """Checkpoints of a training loop under one root (dcp::CheckpointManager): numbered steps,
    retention, and a restore of the newest complete one, optionally through the memory tier.

        manager = dcp.CheckpointManager("/ckpt/run1", keep_last=3, memory_tier="run1")
        step = manager.restore(state)   # None: nothing saved yet; else the step loaded
        for step in range(start, end):
            train_step()
            manager.save(step, state)   # in the background (async_save=True): returns once
                                        # the state is copied aside
        manager.close()

    ``memory_tier``: a name (one per job) to keep each step in node-local shared memory with a
    replica on another node (``shm_root``, ``ranks_per_node`` to simulate nodes on one host),
    every ``memory_every``-th step there and every ``durable_every``-th also under ``root``;
    ``free_on_close`` frees the tier's memory at close (else the next run restores from it).
    ``incremental=True``: each step writes only the items whose bytes changed since the step
    before it and shares the rest with it (ManagerOptions::incremental; not with
    ``memory_tier``); ``frozen``: key prefixes ("model.base") kept from the previous step
    without even hashing them (declare only what never changes).
    Steps must increase, across restarts too. Every method is collective; errors raise as for
    ``dcp.save``. Needs ``dcp.init()`` first.
    """

    def __init__(self, root, keep_last=3, keep_every=0, async_save=True, memory_tier=None,
                 memory_every=1, durable_every=1, shm_root="/dev/shm", ranks_per_node=0,
                 free_on_close=False, incremental=False, frozen=()):
        self._m = _dcp.Manager(str(root), {
            "incremental": bool(incremental), "frozen": [str(p) for p in frozen],
            "keep_last": int(keep_last), "keep_every": int(keep_every),
            "async_save": bool(async_save), "memory_tier": memory_tier,
            "memory_every": int(memory_every), "durable_every": int(durable_every),
            "shm_root": str(shm_root), "ranks_per_node": int(ranks_per_node),
            "free_on_close": bool(free_on_close)})

    def save(self, step, state_dict):
        """Save ``state_dict`` as ``step`` (waits for the previous save first, raising its
        error)."""
        keep = []
        self._m.save(int(step), _flatten(state_dict, "", [], keep))

    def wait(self):
        """Wait for the save in flight; raises its error."""
        self._m.wait()

    def restore(self, state_dict):
        """Load the newest complete step into ``state_dict`` (as ``dcp.load``): from memory when
        the tier holds it intact, else from ``root``. Returns the step, or None when there is
        none."""
        keep = []
        got = self._m.restore(_flatten(state_dict, "", [], keep))
        if got is None:
            return None
        step, blobs = got
        _put_blobs(state_dict, "", blobs)
        return step

    def latest_step(self):
        """The newest complete step under ``root``, or None."""
        return self._m.latest_step()

    @property
    def restore_source(self):
        """Where the last restore read its step from: "memory" or "durable"."""
        return self._m.restore_source()

    def handle_preemption(self, grace_s=30.0, on_sigterm=True, next_step_s=0.0):
        """On SIGTERM (``on_sigterm``; the previous disposition returns at close) or
        ``dcp.notify_preemption()``, every process agrees on the newest step the memory tier
        committed and copies it under ``root`` within ``grace_s``, on a thread and a
        communicator of its own. Afterwards ``save`` raises ``PreemptedError`` on every process
        alike: stop training then (not on ``preempted()``, which is this process's notice only:
        the others would go on to save without it). With ``next_step_s`` the next save may still
        commit within that many seconds of the notice, and is the step drained (the drain then
        has what is left of ``grace_s``). Needs ``memory_tier``. Collective."""
        self._m.handle_preemption(float(grace_s), bool(on_sigterm), float(next_step_s))

    def preempted(self):
        """True once a preemption notice reached this process (not a collective decision)."""
        return self._m.preempted()

    def wait_for_preemption(self, timeout_s=60.0):
        """What the preemption handler did, once it ended or after ``timeout_s``: a dict with
        noticed, done, step (-1: none), drained, where, bytes, seconds, window_left_s, error."""
        return self._m.wait_for_preemption(float(timeout_s))

    def close(self):
        """Wait for the save in flight and stop; raises its error. Idempotent."""
        self._m.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def notify_preemption():
    """Start the preemption drain of every CheckpointManager of this process that handles
    preemption, as SIGTERM does (for a job with its own signal handling)."""
    _dcp.notify_preemption()


_atexit.register(close)
