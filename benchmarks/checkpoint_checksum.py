"""What the chunks' crc32 costs dtorch.checkpoint.save and load (issue 43), per GB (1e9 bytes).

    python -m benchmarks.checkpoint_checksum [--workers 2] [--mib 256] [--turns 3]

Measured in turns (a run of each variant, then again), medians over the turns:
  checksums       zlib.crc32 over a --mib buffer in this process: the checksum alone, in GB/s;
                  beside it the standard library's other candidates (zlib.adler32, hashlib's
                  md5, sha1, sha256, blake2b), to show that crc32 is the one to use
  write_safetensors
                  the writer each worker runs for a SaveShard (runtime/worker/file_shards.py), in this
                  process, into a fresh file with its fsync: as it is (the crc32 of each block
                  first) and with the checksum replaced by a constant (what a save cost before)
  save            dtorch.checkpoint.save of 8 float32 matrices (--mib in all), S(0) on --workers
                  workers, end to end (each worker computes its blocks' crc32; the controller
                  copies them from the files' headers into the index)
  load            dtorch.checkpoint.load of that checkpoint (from the page cache), verify=True
                  against verify=False, each followed by dtorch.synchronize(): into S(0) (each rank
                  reads its own chunks whole: the check costs only the crc32) and into S(1) (each
                  rank reads a column block of every chunk; the rank holding a chunk's first
                  element reads the rest of it to check it)

Save times include fsync, so they depend on the disk; the files are removed after each save.
The 1-minute load average is printed before and after: other work on the machine inflates
every time, the ratios less (the variants alternate).
docs/design/checkpoint.md ("Checksums") has the figures of this project's machine.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import zlib

from . import dtorch_session
from .timing import interleaved, median, stopwatch

MATRICES = 8
GB = 1e9
CHECKSUMS = {"crc32": zlib.crc32, "adler32": zlib.adler32,
             **{name: (lambda data, name=name: hashlib.new(name, data).digest())
                for name in ("md5", "sha1", "sha256", "blake2b")}}


def checksum_seconds(function, buffer) -> float:
    elapsed = stopwatch()
    function(buffer)
    return elapsed()


def write_seconds(blocks: list, directory: str, with_checksum: bool) -> float:
    """One worker's write of `blocks` ([(name, tensor)]), the crc32 computed or not."""
    from dtorch.runtime.worker import file_shards
    real = file_shards.checksum
    if not with_checksum:
        file_shards.checksum = lambda data: 0
    path = os.path.join(directory, "__0_0.safetensors")
    try:
        elapsed = stopwatch()
        file_shards.write_safetensors(path, blocks)
        return elapsed()
    finally:
        file_shards.checksum = real
        os.unlink(path)


def save_seconds(dtorch, state: dict, directory: str) -> float:
    dtorch.synchronize()
    elapsed = stopwatch()
    dtorch.checkpoint.save(state, directory)
    seconds = elapsed()
    shutil.rmtree(directory)
    return seconds


def load_seconds(dtorch, make_target, directory: str, verify: bool) -> float:
    target = make_target()
    dtorch.synchronize()
    elapsed = stopwatch()
    dtorch.checkpoint.load(target, directory, verify=verify)
    dtorch.synchronize()
    return elapsed()


def _line(label: str, seconds: list, nbytes: int, against: list | None = None) -> str:
    text = f"{label:44s} {median(seconds) * GB / nbytes:7.3f} s/GB ({median(seconds) * 1e3:7.1f} ms)"
    return text + (f"  {median(seconds) / median(against):.2f}x" if against else "")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint_checksum", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--mib", type=int, default=256, help="the checkpoint's size (8 float32 matrices)")
    parser.add_argument("--turns", type=int, default=3)
    args = parser.parse_args(argv)
    import torch
    nbytes = args.mib << 20
    print(f"load average before: {os.getloadavg()[0]:.1f}", flush=True)
    rows = nbytes // (MATRICES * 4 * 4096)

    buffer = memoryview(bytearray(os.urandom(1 << 20)) * args.mib)
    rates = interleaved({name: (lambda f=function: checksum_seconds(f, buffer))
                         for name, function in CHECKSUMS.items()}, args.turns)
    print(f"checksums over {args.mib} MiB in memory (zlib {zlib.ZLIB_RUNTIME_VERSION}), GB/s: "
          + ", ".join(f"{name} {nbytes / median(seconds) / GB:.2f}" for name, seconds in rates.items()), flush=True)
    buffer = None   # frees it; a lambda above closes over the name, so it is rebound, not deleted

    scratch = tempfile.mkdtemp(prefix="checkpoint_checksum-")
    try:
        per_worker = nbytes // args.workers
        blocks = [(f"w{i}", torch.randn(rows // args.workers, 4096)) for i in range(MATRICES)]
        writes = interleaved({checked: (lambda checked=checked: write_seconds(blocks, scratch, checked))
                              for checked in (True, False)}, args.turns)
        print(_line(f"write_safetensors, one worker's {per_worker >> 20} MiB, crc32", writes[True], per_worker,
                    writes[False]), flush=True)
        print(_line("write_safetensors, no checksum", writes[False], per_worker), flush=True)
        blocks = None   # as buffer above
        _save_and_load(torch, args.workers, rows, nbytes, args.turns, scratch)
        print(f"load average after: {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        dtorch_session.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def _save_and_load(torch, workers: int, rows: int, nbytes: int, turns: int, scratch: str) -> None:
    import dtorch
    from dtorch.spec.placements import Shard
    mesh = dtorch_session.mesh((workers,), ("dp",))
    state = {f"w{i}": dtorch.randn(rows, 4096, device_mesh=mesh, placements=[Shard(0)]) for i in range(MATRICES)}
    saves = interleaved({"save": lambda: save_seconds(dtorch, state, os.path.join(scratch, "saved"))}, turns)
    print(_line(f"save, {nbytes >> 20} MiB on {workers} workers (crc32 on)", saves["save"], nbytes), flush=True)
    directory = os.path.join(scratch, "ckpt")
    dtorch.checkpoint.save(state, directory)
    for dim in (0, 1):
        make_target = lambda: {f"w{i}": dtorch.zeros(rows, 4096, device_mesh=mesh, placements=[Shard(dim)])  # noqa: E731
                               for i in range(MATRICES)}
        loads = interleaved({verify: (lambda verify=verify: load_seconds(dtorch, make_target, directory, verify))
                             for verify in (True, False)}, turns)
        print(_line(f"load into S({dim}), verify=True", loads[True], nbytes, loads[False]), flush=True)
        print(_line(f"load into S({dim}), verify=False", loads[False], nbytes), flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
