"""A worker's checkpoint commands: each rank reads its own block of a tensor from the files
(LoadShard, LoadChunks) and writes its own blocks into one file of its own (SaveShard), so no
tensor byte passes through the controller (runtime/worker/file_shards.py holds the file format).

CheckpointCommands is a component of the Worker (worker.py), which owns one: it takes the rank's
LocalShards (shards.py), whose tensors it reads and writes, on its device.
"""
from __future__ import annotations

import os
import socket

import torch

from ...spec.placements import holds_partial_sum_value, local_region
from .. import protocol as wire
from .file_shards import read_block, read_region, shard_file_name, write_safetensors
from .poisoned import Poisoned
from .shards import LocalShards

__all__ = ["CheckpointCommands"]


class CheckpointCommands:
    def __init__(self, shards: LocalShards):
        self.shards, self.rank, self.device = shards, shards.rank, shards.device

    def handle_load_shard(self, command: wire.LoadShard) -> None:
        """Read this rank's block of a tensor straight from a checkpoint file, cast it, keep it."""
        stored = wire.dtype_from_name(command.stored_dtype)
        self._load_block(command, lambda offset, shape, what: read_block(
            command.path, command.data_offset, stored, command.shape, offset, shape, what))

    def _load_block(self, command, read) -> None:
        """A checkpoint read's common part (LoadShard, LoadChunks): `read(offset, shape, what)`
        gives this rank's block as stored; it is cast where the tensor lives (on a GPU after the
        upload). Under P(sum) only one rank per group holds the value (as an upload would): the
        others hold zeros and read nothing."""
        mesh = self.shards.member(command.mesh_id)
        if mesh is None:
            return
        coordinate = mesh.coordinate_of(self.rank)
        offset, shape = local_region(command.shape, mesh, command.placements, coordinate)
        dtype = wire.dtype_from_name(command.dtype)
        if not holds_partial_sum_value(command.placements, coordinate):
            self.shards.tensors[command.out_id] = torch.zeros(shape, dtype=dtype, device=self.device.torch_device)
            return
        try:
            block = read(offset, shape, f"tensor {command.name!r}, rank {self.rank} on host {socket.gethostname()}")
        except FileNotFoundError as missing:   # the usual multi-host mistake: say the ways out
            raise FileNotFoundError(f"{missing}. Every worker reads its own block from the path the controller "
                                    "gave: put the checkpoint on a shared filesystem every host mounts at that path "
                                    "(or load with via_controller=True)") from None
        on_device = block if block.device == self.device.torch_device else self.device.from_host(block)
        self.shards.tensors[command.out_id] = on_device.to(dtype)

    def handle_save_shard(self, command: wire.SaveShard) -> None:
        """Write this rank's blocks of the tensors naming it into one new safetensors file, fsynced
        (runtime/worker/file_shards.py). A tensor that failed earlier fails the save, naming its key: a
        checkpoint is never written with a hole."""
        mine = [(tensor_id, name) for rank, tensor_id, name in command.writes if rank == self.rank]
        if not mine:
            return
        blocks = []
        for tensor_id, name in mine:
            try:
                blocks.append((name, self.shards.tensor(tensor_id).cpu()))
            except Poisoned as poisoned:   # reported (not only poisoned): this command has no output to carry it
                raise RuntimeError(f"cannot save {name!r}: it comes from command #{poisoned.origin}, "
                                   "which failed") from None
        path = os.path.join(command.directory, shard_file_name(self.rank, command.file_index))
        try:
            write_safetensors(path, blocks)
        except FileNotFoundError:   # the usual multi-host mistake: the controller's directory is not here
            raise FileNotFoundError(f"rank {self.rank} on host {socket.gethostname()} cannot create {path}: its "
                                    "directory does not exist on this host. Every worker writes into the directory "
                                    "the controller made: save to a filesystem every host mounts there") from None

    def handle_load_chunks(self, command: wire.LoadChunks) -> None:
        """Read this rank's block of a tensor saved as chunks (a sharded checkpoint, any layout):
        only the parts of the chunks that overlap it, each chunk's crc32 checked by the ranks
        holding its first element (file_shards.read_region)."""
        chunks = [(path, data_offset, wire.dtype_from_name(stored), chunk_offset, chunk_shape, crc)
                  for path, data_offset, stored, chunk_offset, chunk_shape, crc in command.chunks]
        dtype = wire.dtype_from_name(command.dtype)
        self._load_block(command, lambda offset, shape, what: read_region(chunks, offset, shape, dtype, what))
