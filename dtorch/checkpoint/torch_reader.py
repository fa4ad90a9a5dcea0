"""A dtorch checkpoint read by torch.distributed.checkpoint: DtorchStorageReader, a StorageReader
over a dtorch.checkpoint.save directory, for any torch process (one, or every rank of a process
group: each reads its own parts, as with torch's own readers); no dtorch worker is involved.

    import torch.distributed.checkpoint as dcp
    from dtorch.checkpoint import DtorchStorageReader
    dcp.load(state, storage_reader=DtorchStorageReader("ckpt/"))

The metadata it gives torch is the index's: each tensor with its chunks, and each plain value
flattened as torch flattens a state (`{"sched": {"last_epoch": 3}}` is "sched.last_epoch", a
small torch tensor a tensor), so the keys are those torch computes for the same state. Each read
takes only the bytes of the part asked for, with the block reader dtorch's workers use, and
checks a chunk's crc32 where it reads the whole chunk (verify=True). Plain values reach torch's
planner as torch.save bytes made here, in memory: the files hold no pickle.

Imports torch.distributed.checkpoint: dtorch.checkpoint imports this module on first use only.
"""
from __future__ import annotations

import io
import os

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint._traverse import traverse_state_dict
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   StorageMeta, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from ..runtime.worker.file_shards import NO_CHECKSUM, ChecksumError, read_region
from .safetensors_header import CheckpointError
from .sharded_format import INDEX_NAME, read_index

__all__ = ["DtorchStorageReader"]


class DtorchStorageReader(StorageReader):
    """torch.distributed.checkpoint's StorageReader for a checkpoint dtorch.checkpoint.save wrote."""

    def __init__(self, path: str | os.PathLike, *, verify: bool = True):
        super().__init__()
        self.path, self.verify = os.fspath(path), verify
        self.tensors: dict = {}    # key -> the index's SavedTensor
        self.values: dict = {}     # torch's key -> a plain value (a small tensor included)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.tensors, self.values = {}, {}

    def read_metadata(self, *args, **kwargs) -> Metadata:
        index = read_index(self.path, verify=self.verify)
        self.tensors, self.values = dict(index.tensors), {}
        entries, planned = {}, {}
        for key, saved in index.tensors.items():
            entries[key] = TensorStorageMetadata(TensorProperties(dtype=saved.dtype), torch.Size(saved.shape),
                                                 [ChunkStorageMetadata(torch.Size(c.offset), torch.Size(c.shape))
                                                  for c in saved.chunks])
            planned[key] = _torch_path(index.paths[key])
        for key, value in index.values.items():
            for path, leaf in _flattened(_torch_path(index.paths[key]), value):
                flat = ".".join(str(part) for part in path)
                self.values[flat], planned[flat] = leaf, path
                entries[flat] = (TensorStorageMetadata(TensorProperties(dtype=leaf.dtype), leaf.shape,
                                                       [ChunkStorageMetadata(torch.Size([0] * leaf.ndim), leaf.shape)])
                                 if isinstance(leaf, torch.Tensor) else BytesStorageMetadata())
        return Metadata(state_dict_metadata=entries, planner_data=planned, storage_data={},
                        storage_meta=StorageMeta(checkpoint_id=self.path))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        if not self.tensors and not self.values:   # a rank that did not read the metadata itself
            self.read_metadata()

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner) -> Future:
        for item in plan.items:
            key = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                data = io.BytesIO()
                torch.save(self.values[key], data)
                data.seek(0)
                planner.load_bytes(item, data)
                continue
            target = planner.resolve_tensor(item).detach()
            target.copy_(self._part(key, tuple(item.storage_index.offset or ()), item.storage_offsets, item.lengths))
            planner.commit_tensor(item, target)
        done: Future = Future()
        done.set_result(None)
        return done

    def _part(self, key: str, chunk_offset: tuple, offsets, lengths) -> torch.Tensor:
        """The part (offsets within the chunk at chunk_offset, lengths) of a saved tensor."""
        if key in self.values:
            value = self.values[key]
            return value[tuple([slice(o, o + n) for o, n in zip(offsets, lengths)])]
        saved = self.tensors[key]
        chunks = [c if self.verify else c._replace(checksum=NO_CHECKSUM) for c in saved.chunks
                  if tuple(c.offset) == chunk_offset]
        start = [c + o for c, o in zip(chunk_offset, offsets)]
        try:
            return read_region(chunks, start, list(lengths), saved.dtype, f"tensor {key!r}").to(saved.dtype)
        except (ChecksumError, EOFError) as error:
            raise CheckpointError(str(error)) from None

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return os.path.isfile(os.path.join(os.fspath(checkpoint_id), INDEX_NAME))


def _torch_path(path) -> tuple:
    """A saved path as torch's flattening writes it: every key a str (dtorch's ints are dict keys
    there, an optimizer's parameter indices)."""
    return tuple([str(part) for part in path])


def _flattened(path: tuple, value) -> list:
    """(path, leaf) of a plain value, as torch's traverse_state_dict walks it."""
    leaves: list = []
    traverse_state_dict({"_": value}, lambda found, leaf: leaves.append((path + tuple(found[1:]), leaf)))
    return leaves
