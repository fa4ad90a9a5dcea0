"""A dtorch.checkpoint.save directory as a plain torch state dict, read here on the controller
without any worker (that is the point of a converter):

    python -m dtorch.checkpoint.convert CHECKPOINT_DIR OUT.pt

or `to_torch_state_dict(CHECKPOINT_DIR)` for the nested dict itself: the state as it was saved,
each DTensor a full torch tensor (dict keys as saved, ints included; a list that held DTensors
comes back as a dict of its indices). Each chunk's crc32 is checked as it is read (`--no-verify`,
`verify=False`: not checked); a mismatch is a CheckpointError naming the file, the key and the chunk.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from .sharded_format import read_index, read_whole

__all__ = ["to_torch_state_dict", "convert", "main"]


def to_torch_state_dict(directory, *, verify: bool = True) -> dict:
    """The saved state, nested as it was, with every tensor read whole from its chunks (each
    chunk's checksum checked, unless verify=False)."""
    index = read_index(directory, verify=verify)
    state: dict = {}
    for key, saved in index.tensors.items():
        _put(state, index.paths[key], read_whole(saved, key, verify=verify))
    for key, value in index.values.items():
        _put(state, index.paths[key], value)
    return state


def convert(directory, out_path, *, verify: bool = True) -> None:
    """Write the checkpoint at `directory` as one torch.save file."""
    torch.save(to_torch_state_dict(directory, verify=verify), os.fspath(out_path))


def _put(state: dict, path: tuple, value) -> None:
    node = state
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtorch.checkpoint.convert",
                                     description="Convert a dtorch.checkpoint.save directory to a torch.save file.")
    parser.add_argument("directory", help="the checkpoint directory (holds checkpoint.json)")
    parser.add_argument("out", help="the .pt file to write")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="do not check the chunks' checksums (read a damaged checkpoint anyway)")
    args = parser.parse_args(argv)
    convert(args.directory, args.out, verify=args.verify)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
