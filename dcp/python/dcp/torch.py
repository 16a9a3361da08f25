"""torch.distributed.checkpoint's storage layer on dcp: a StorageWriter and a StorageReader.

    import torch.distributed.checkpoint as tdc      # torch 1.13: torch.distributed._shard.checkpoint
    import dcp.torch
    tdc.save(state_dict, storage_writer=dcp.torch.Writer("s3://bucket/run/step-100"))
    tdc.load(state_dict, storage_reader=dcp.torch.Reader("s3://bucket/run/step-100"))

torch plans (its planners, its process group); dcp stores. ``Writer`` writes PyTorch DCP's own
format (``.metadata`` + ``__<rank>_<n>.distcp``, readable by torch's FileSystemReader) through any
dcp store (a path, file://, s3://, a registered plug-in) with dcp's checkpoint protocol: one writer
per location (a lock held from set-up to the commit), data files named by the save so a failed save
never touches the checkpoint it would replace, the metadata published atomically and on s3:// only
if the location still holds what set-up saw, a zip CRC-32 on every record, and the files of dead
saves removed after the commit. ``Reader`` loads whatever dcp reads (dcp's format, PyTorch DCP of
torch 1.13 and 2.x, safetensors) into torch's load, resharded by torch's planner, every checksum
checked.

Neither needs ``dcp.init()``: the collectives are torch's. Tensors are written from their own
memory (CPU tensors: no copy; others are copied to the CPU first) and read into their
destination's memory (CPU destinations, strided or not; others through a CPU copy). The GIL is
released during I/O. A Writer or Reader serves one save or load at a time, like torch's own.

Errors raise dcp's exception classes (``dcp.AlreadyExistsError`` when a checkpoint is already at
the location and ``overwrite`` is off, ``dcp.CorruptionError`` naming the item and its file, ...);
torch reports a failure on any rank as its CheckpointException on every rank. A save that failed
before its commit leaves no checkpoint: a rank whose write failed removes its files at once; the
coordinator's files and lock go at the writer's next save or its deletion (torch never tells a
storage layer that a save failed elsewhere); other ranks' files, which only the coordinator can
know to be dead, go with the next save at that location.
"""

import copy as _copy
import dataclasses as _dataclasses
import io as _io

import torch as _torch
import torch.distributed as _dist

from . import _dcp


def _import_torch_dcp():
    # torch 2.x: torch.distributed.checkpoint. torch 1.13: torch.distributed._shard.checkpoint,
    # whose dataclasses Python 3.11 refuses (a mutable default) unless this shim lets them be.
    try:
        import torch.distributed.checkpoint as api
        if hasattr(api, "StorageWriter"):
            return api, 2
    except ImportError:
        pass
    orig = _dataclasses._get_field

    def get_field(cls, a_name, a_type, *rest):
        d = cls.__dict__.get(a_name, _dataclasses.MISSING)
        val = d.default if isinstance(d, _dataclasses.Field) else d
        if (val is not _dataclasses.MISSING and _dataclasses.is_dataclass(val)
                and type(val).__hash__ is None):
            setattr(cls, a_name, _dataclasses.field(default_factory=lambda v=val: _copy.deepcopy(v)))
        return orig(cls, a_name, a_type, *rest)

    _dataclasses._get_field = get_field
    try:
        import torch.distributed._shard.checkpoint as api
    finally:
        _dataclasses._get_field = orig
    return api, 1


_api, _TORCH_MAJOR = _import_torch_dcp()
_metadata = _api.metadata
_planner = _api.planner
_WriteResult = _api.storage.WriteResult
try:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
except ImportError:
    from torch.distributed._shard.checkpoint.filesystem import _StorageInfo
try:
    from torch.distributed.checkpoint.metadata import TensorProperties as _TensorProperties
except ImportError:
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as _TensorProperties

# The flavour of PyTorch DCP the running torch reads and writes.
FORMAT = "torchdcp" if _TORCH_MAJOR == 2 else "torchdcp113"

__all__ = ["Writer", "Reader", "FORMAT"]


def _rank_and_world():
    if _dist.is_available() and _dist.is_initialized():
        return _dist.get_rank(), _dist.get_world_size()
    return 0, 1


def _dtype_name(dtype):
    name = str(dtype)
    return name[6:] if name.startswith("torch.") else name


def _shape(s):
    return None if s is None else [int(d) for d in s]


class Writer(_api.StorageWriter):
    """Writes a torch.distributed.checkpoint save to ``uri`` (a path, file://, s3://...) in
    PyTorch DCP's format, through dcp's store for it. ``overwrite`` replaces a checkpoint already
    there (atomically: the old one stays loadable until the new metadata is in place); without it
    such a save fails with ``dcp.AlreadyExistsError`` before any rank writes."""

    def __init__(self, uri, overwrite=False):
        super().__init__()
        self._uri = str(uri)
        self._overwrite = bool(overwrite)
        self._w = _dcp.TorchWriter(self._uri, self._overwrite, FORMAT)

    @property
    def uri(self):
        return self._uri

    # torch 2.x: the checkpoint_id of dcp.save(..., checkpoint_id=) replaces the location.
    def reset(self, checkpoint_id=None):
        if checkpoint_id is not None and str(checkpoint_id) != self._uri:
            self._w.abort()
            self._uri = str(checkpoint_id)
            self._w = _dcp.TorchWriter(self._uri, self._overwrite, FORMAT)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return isinstance(checkpoint_id, str) and bool(checkpoint_id)

    def storage_meta(self):
        return None

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        self.init(is_coordinator)

    def init(self, is_coordinator):
        rank, world = _rank_and_world()
        self._w.set_up(rank, world, bool(is_coordinator))

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        prefixes = self._w.file_prefixes(len(plans))
        return [_dataclasses.replace(p, storage_data=prefix) for p, prefix in zip(plans, prefixes)]

    def write_data(self, plan, planner):
        entries, keep = [], []
        for item in plan.items:
            data = planner.resolve_data(item)
            fqn, offset = item.index.fqn, _shape(item.index.offset)
            if item.type == _planner.WriteItemType.BYTE_IO:
                payload = data.getvalue() if isinstance(data, _io.BytesIO) else bytes(data)
                keep.append(payload)
                entries.append((fqn, offset, "bytes", None, None, None, None, payload))
                continue
            t = data.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            keep.append(t)
            td = item.tensor_data
            kind = "shard" if item.type == _planner.WriteItemType.SHARD else "tensor"
            entries.append((fqn, offset, kind, _dtype_name(t.dtype), _shape(td.size),
                            _shape(td.chunk.offsets), _shape(td.chunk.sizes),
                            (t.data_ptr(), _dtype_name(t.dtype), list(t.shape), list(t.stride()))))
        try:
            written = self._w.write(plan.storage_data, entries)
        except BaseException:
            self._w.abort()
            raise
        results = [_WriteResult(index=item.index, size_in_bytes=size,
                                    storage_data=_StorageInfo(path, offset, length))
                   for item, (size, path, offset, length) in zip(plan.items, written)]
        fut = _torch.futures.Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata, results):
        entries = []
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, _metadata.TensorStorageMetadata):
                entries.append((fqn, "tensor", _dtype_name(md.properties.dtype), _shape(md.size),
                                [(_shape(c.offsets), _shape(c.sizes)) for c in md.chunks]))
            else:
                entries.append((fqn, "bytes"))
        # torch 2.x's DefaultSavePlanner records each entry's key path (nested state dicts).
        key_paths = {}
        if isinstance(metadata.planner_data, dict):
            for fqn, path in metadata.planner_data.items():
                if isinstance(fqn, str) and isinstance(path, (tuple, list)):
                    key_paths[fqn] = [str(p) for p in path]
        flat = []
        for rank_results in results:
            for r in rank_results:
                info = r.storage_data
                kind = "bytes" if r.index.offset is None else "tensor"
                flat.append((r.index.fqn, _shape(r.index.offset), kind, int(r.size_in_bytes),
                             info.relative_path, int(info.offset), int(info.length)))
        self._w.finish(self._uri, entries, key_paths, flat)


class Reader(_api.StorageReader):
    """Reads the checkpoint at ``uri`` (any format dcp reads: dcp's, PyTorch DCP, safetensors)
    into torch.distributed.checkpoint's load. Byte entries of formats other than PyTorch DCP load
    as Python ``bytes``."""

    def __init__(self, uri):
        super().__init__()
        self._uri = str(uri)
        self._r = _dcp.TorchReader(self._uri)

    @property
    def uri(self):
        return self._uri

    def reset(self, checkpoint_id=None):
        if checkpoint_id is not None and str(checkpoint_id) != self._uri:
            self._uri = str(checkpoint_id)
            self._r = _dcp.TorchReader(self._uri)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return isinstance(checkpoint_id, str) and bool(checkpoint_id)

    def read_metadata(self):
        md = self._r.read_metadata()
        sdm = {}
        for entry in md["entries"]:
            fqn = entry[0]
            if entry[1] == "bytes":
                sdm[fqn] = _metadata.BytesStorageMetadata()
                continue
            _, _, dtype, shape, chunks = entry
            if not hasattr(_torch, dtype):
                from . import UnsupportedError
                raise UnsupportedError("dcp.torch: tensor '%s' of %s has dtype %s, which this torch "
                                       "lacks" % (fqn, self._uri, dtype))
            sdm[fqn] = _metadata.TensorStorageMetadata(
                properties=_TensorProperties(dtype=getattr(_torch, dtype)),
                size=_torch.Size(shape),
                chunks=[_metadata.ChunkStorageMetadata(offsets=_torch.Size(o), sizes=_torch.Size(s))
                        for o, s in chunks])
        planner_data = None
        if _TORCH_MAJOR == 2:
            # DefaultSavePlanner's form: every fqn's key path (ints where a list held it).
            planner_data = {}
            for fqn in sdm:
                path = md["key_paths"].get(fqn, [fqn])
                planner_data[fqn] = tuple(int(p) if p.isascii() and p.isdigit() and len(p) <= 18 and (p == "0" or p[0] != "0")
                                          else p for p in path)
        return _metadata.Metadata(state_dict_metadata=sdm, planner_data=planner_data,
                                  storage_data={})

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        self.init(metadata, is_coordinator)

    def init(self, metadata, is_coordinator):
        rank, world = _rank_and_world()
        self._r.set_up(rank, world, bool(is_coordinator))

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner):
        items, targets = [], []
        for req in plan.items:
            if req.type == _planner.LoadItemType.BYTE_IO:
                targets.append(None)
                dest = None
                kind = "bytes"
            else:
                kind = "tensor"
                target = planner.resolve_tensor(req).detach()
                if list(target.shape) != _shape(req.lengths):
                    from . import InvalidArgumentError
                    raise InvalidArgumentError(
                        "dcp.torch: the destination of %s is %s, the read is %s"
                        % (req.dest_index.fqn, list(target.shape), _shape(req.lengths)))
                staged = target if target.device.type == "cpu" else \
                    _torch.empty(target.shape, dtype=target.dtype)
                targets.append((target, staged))
                dest = (staged.data_ptr(), _dtype_name(staged.dtype), list(staged.shape),
                        list(staged.stride()))
            items.append((kind, req.dest_index.fqn, _shape(req.dest_index.offset),
                          _shape(req.dest_offsets), req.storage_index.fqn,
                          _shape(req.storage_index.offset), _shape(req.storage_offsets),
                          _shape(req.lengths), dest))
        records = self._r.read(items)
        for req, target, record in zip(plan.items, targets, records):
            if target is None:
                planner.load_bytes(req, _io.BytesIO(record))
                continue
            tensor, staged = target
            if staged is not tensor:
                tensor.copy_(staged)
            planner.commit_tensor(req, tensor)
        fut = _torch.futures.Future()
        fut.set_result(None)
        return fut
