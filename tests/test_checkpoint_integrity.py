"""A damaged checkpoint is refused, naming the file and the tensor (issue 43).

The index must tile each tensor exactly: counting elements let a chunk moved onto another load the
gap's uninitialized memory silently. Each chunk carries the crc32 of its bytes, computed by the
worker that wrote it and checked where it is read: a flipped bit, a swapped file and a truncated
file are refused at the load call, naming the file (and the key and the chunk); verify=False skips
the check, and a checkpoint from before checksums loads unchecked."""
import json
import os
import zlib

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from dtorch.checkpoint import to_torch_state_dict
from dtorch.checkpoint.sharded_format import index_checksum, tiling_problem
from dtorch.checkpoint.safetensors_header import CheckpointError, read_header, read_header_and_metadata
from dtorch.runtime.worker.file_shards import NO_CHECKSUM, read_region

pytestmark = pytest.mark.timeout(300)

INDEX = "checkpoint.json"


def _saved(mesh, directory) -> dict:
    values = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    dtorch.checkpoint.save({"w": dtorch.tensor(values, device_mesh=mesh, placements=[Shard(0)])}, directory)
    with open(os.path.join(directory, INDEX)) as file:
        return json.load(file)


def _rewrite(directory, index, keep_checksum: bool = False) -> None:
    """The index edited as a faulty writer would leave it: with a crc32 that matches (so the
    checks behind the index's own checksum are what refuses it), or with the save's crc32."""
    if not keep_checksum and "crc32" in index:
        index = dict(index, crc32=index_checksum(index))
    with open(os.path.join(directory, INDEX), "w") as file:
        json.dump(index, file)


def _load(mesh, directory, placements=(Replicate(),), **options):
    target = {"w": dtorch.zeros(8, 4, device_mesh=mesh, placements=list(placements))}
    return dtorch.checkpoint.load(target, directory, **options)


def test_an_undamaged_checkpoint_loads(mesh4, tmp_path):
    _saved(mesh4, tmp_path)
    assert torch.equal(_load(mesh4, tmp_path)["w"].to_torch(), torch.arange(32.0).reshape(8, 4))


def test_a_chunk_moved_onto_another_is_refused(mesh4, tmp_path):
    """The defect: offsets [4, 0] -> [0, 0] loaded rows 4-7 as uninitialized memory."""
    index = _saved(mesh4, tmp_path)
    chunks = index["tensors"]["w"]["chunks"]
    moved = next(chunk for chunk in chunks if chunk["offsets"][0] > 0)
    moved["offsets"] = [0, 0]
    _rewrite(tmp_path, index)
    with pytest.raises(CheckpointError, match=rf"{INDEX}: the chunks of 'w' do not tile its shape \[8, 4\]: "
                                              r"two chunks overlap"):
        _load(mesh4, tmp_path)


def test_an_index_edited_after_the_save_is_refused_by_its_own_checksum(mesh4, tmp_path):
    """Two chunks' offsets swapped: every check of tiling and chunk bytes passes, and the rows
    would load in each other's place; a plain value edited: it would load as edited."""
    index = _saved(mesh4, tmp_path)
    first, second = index["tensors"]["w"]["chunks"][:2]
    first["offsets"], second["offsets"] = second["offsets"], first["offsets"]
    _rewrite(tmp_path, index, keep_checksum=True)
    with pytest.raises(CheckpointError, match=rf"{INDEX}: the index does not match the crc32 it was saved with"):
        _load(mesh4, tmp_path)
    swapped = _load(mesh4, tmp_path, verify=False)["w"].to_torch()   # the switch: loaded unchecked
    assert not torch.equal(swapped, torch.arange(32.0).reshape(8, 4))
    directory = tmp_path / "values"
    dtorch.checkpoint.save({"step": 7, "lr": 0.5}, str(directory))
    plain = json.loads((directory / INDEX).read_text())
    plain["values"]["step"]["value"] = 8
    _rewrite(directory, plain, keep_checksum=True)
    with pytest.raises(CheckpointError, match="edited or damaged after the save"):
        dtorch.checkpoint.load({"step": 0, "lr": 0.0}, str(directory))


def test_a_missing_chunk_is_refused(mesh4, tmp_path):
    index = _saved(mesh4, tmp_path)
    index["tensors"]["w"]["chunks"].pop()
    _rewrite(tmp_path, index)
    with pytest.raises(CheckpointError, match="no chunk holds the elements at"):
        _load(mesh4, tmp_path)


@pytest.mark.parametrize("shape, boxes, problem", [
    ((8, 4), [((0, 0), (4, 4)), ((4, 0), (4, 4))], None),
    ((8, 4), [((0, 0), (8, 2)), ((0, 2), (4, 2)), ((4, 2), (4, 2))], None),
    ((8, 4), [((0, 0), (4, 4)), ((0, 0), (4, 4))], "two chunks overlap at [0, 0]"),
    ((8, 4), [((0, 0), (8, 2)), ((0, 2), (4, 2)), ((3, 2), (5, 2))], "two chunks overlap at [3, 2]"),
    ((8, 4), [((0, 0), (4, 4))], "no chunk holds the elements at [4, 0]"),
    ((8,), [((6,), (4,))], "reaches outside it"),
    ((8,), [((0,), (4,)), ((4,), (4,)), ((2,), (0,))], None),   # an empty shard
    ((), [((), ())], None),
    ((0, 3), [], None),
])
def test_tiling_is_exact(shape, boxes, problem):
    found = tiling_problem(shape, boxes)
    assert found == problem if problem is None else problem in found


def _dead_pid() -> int:
    import subprocess
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_a_save_removes_what_a_killed_save_to_the_same_target_left(mesh4, tmp_path):
    """The defect: a `.saving-` directory from a killed save was never removed."""
    import socket
    target = tmp_path / "ckpt"
    dead = tmp_path / f".ckpt.saving-{socket.gethostname()}-{_dead_pid()}-abc123"
    alive = tmp_path / f".ckpt.saving-{socket.gethostname()}-{os.getpid()}-def456"   # a save in progress
    other_host = tmp_path / f".ckpt.saving-another-host-{_dead_pid()}-ghi789"       # not ours to judge
    for leftover in (dead, alive, other_host):
        leftover.mkdir()
    _saved(mesh4, target)
    assert not dead.exists() and alive.exists() and other_host.exists()
    assert torch.equal(_load(mesh4, target)["w"].to_torch(), torch.arange(32.0).reshape(8, 4))


def test_saving_onto_a_symlink_keeps_the_link(mesh4, tmp_path):
    """The defect: saving onto a symlinked target replaced the link with a directory."""
    real, link = tmp_path / "real" / "ckpt", tmp_path / "latest"
    real.parent.mkdir()
    os.symlink(real, link)
    _saved(mesh4, link)          # the link points nowhere yet: the checkpoint is made where it points
    _saved(mesh4, link)          # and replaced there
    assert os.path.islink(link) and os.path.isfile(real / INDEX)
    assert torch.equal(_load(mesh4, link)["w"].to_torch(), torch.arange(32.0).reshape(8, 4))


# --- checksums ------------------------------------------------------------------------------------
SAVED = torch.arange(32, dtype=torch.float32).reshape(8, 4)   # _saved: S(0) on 4 ranks, rows 2r, 2r + 1 in __r_0


def _flip_a_bit(path, element: int = 1) -> None:
    """Flip the lowest bit of the first byte of one element of the chunk of 'w' in `path`."""
    at = read_header(str(path))["w"].data_offset + 4 * element
    with open(path, "r+b") as file:
        file.seek(at)
        byte = file.read(1)[0]
        file.seek(at)
        file.write(bytes([byte ^ 1]))


def test_each_chunk_records_the_crc32_of_its_bytes(mesh4, tmp_path):
    index = _saved(mesh4, tmp_path)
    for chunk in index["tensors"]["w"]["chunks"]:
        path = str(tmp_path / chunk["file"])
        stored, metadata = read_header_and_metadata(path)
        with open(path, "rb") as file:
            file.seek(stored["w"].data_offset)
            data = file.read(stored["w"].nbytes)
        assert chunk["crc32"] == zlib.crc32(data) == int(metadata["crc32:w"])


@pytest.mark.parametrize("placements", [[Replicate()], [Shard(0)], [Shard(1)]], ids=["R", "S(0)", "S(1)"])
def test_a_flipped_bit_is_refused_at_the_load_call(mesh4, tmp_path, placements):
    """R: every rank reads the damaged chunk whole; S(0): only its own rank; S(1): each rank one
    column of it, and rank 0 (which holds its first element) reads the rest to check it."""
    _saved(mesh4, tmp_path)
    _flip_a_bit(tmp_path / "__1_0.safetensors")
    state = {"w": dtorch.zeros(8, 4, device_mesh=mesh4, placements=placements)}
    before = state["w"]
    with pytest.raises(CheckpointError) as refused:
        dtorch.checkpoint.load(state, tmp_path)
    message = str(refused.value)
    for part in ("__1_0.safetensors", "tensor 'w'", "the chunk at offsets [2, 0] of shape [2, 4]",
                 "verify=False"):
        assert part in message, message
    assert state["w"] is before   # nothing loaded into the state
    assert torch.equal(before.to_torch(), torch.zeros(8, 4))


def test_verify_false_loads_a_flipped_bit_unchecked(mesh4, tmp_path):
    _saved(mesh4, tmp_path)
    _flip_a_bit(tmp_path / "__1_0.safetensors", element=1)   # element (2, 1) of the tensor
    loaded = _load(mesh4, tmp_path, verify=False)["w"].to_torch()
    differs = (loaded != SAVED).nonzero().tolist()
    assert differs == [[2, 1]], differs


def test_a_swapped_file_is_refused_naming_it(mesh4, tmp_path):
    """Two files exchanged: same names inside, same shapes (an even S(0)), other bytes."""
    _saved(mesh4, tmp_path)
    first, second = tmp_path / "__0_0.safetensors", tmp_path / "__1_0.safetensors"
    first_bytes, second_bytes = first.read_bytes(), second.read_bytes()
    first.write_bytes(second_bytes)
    second.write_bytes(first_bytes)
    with pytest.raises(CheckpointError, match=r"__0_0\.safetensors: the index records crc32 .* for the chunk of 'w' "
                                              r"at offsets \[0, 0\], the file records .*swapped"):
        _load(mesh4, tmp_path)
    swapped = _load(mesh4, tmp_path, verify=False)["w"].to_torch()   # the switch: the rows come back exchanged
    assert torch.equal(swapped, torch.cat([SAVED[2:4], SAVED[0:2], SAVED[4:]]))


def test_a_swapped_file_without_its_own_checksums_is_refused_where_it_is_read(mesh4, tmp_path):
    """A file whose metadata says nothing (rewritten by another tool): the workers' check finds it."""
    _saved(mesh4, tmp_path)
    index = json.loads((tmp_path / INDEX).read_text())
    crcs = {chunk["file"]: chunk["crc32"] for chunk in index["tensors"]["w"]["chunks"]}
    first, second = tmp_path / "__0_0.safetensors", tmp_path / "__1_0.safetensors"
    first_bytes, second_bytes = first.read_bytes(), second.read_bytes()
    first.write_bytes(_without_checksums(second_bytes))
    second.write_bytes(_without_checksums(first_bytes))
    with pytest.raises(CheckpointError) as refused:
        _load(mesh4, tmp_path, placements=[Shard(0)])
    # ranks 0 and 1 both find theirs; the message is the one that arrived first
    expected = [f"__{rank}_0.safetensors: the chunk at offsets [{2 * rank}, 0] of shape [2, 4] has crc32 "
                f"{crcs[f'__{1 - rank}_0.safetensors']:#010x}, the index recorded "
                f"{crcs[f'__{rank}_0.safetensors']:#010x}"
                for rank in (0, 1)]
    assert any(line in str(refused.value) for line in expected), str(refused.value)


def _without_checksums(data: bytes) -> bytes:
    """The same safetensors file with "crc32:" entries blanked out of its header (same length)."""
    length = int.from_bytes(data[:8], "little")
    return data[:8] + data[8:8 + length].replace(b'"crc32:', b'"other:') + data[8 + length:]


def test_a_truncated_file_is_refused_naming_it(mesh4, tmp_path):
    _saved(mesh4, tmp_path)
    victim = tmp_path / "__2_0.safetensors"
    victim.write_bytes(victim.read_bytes()[:-3])
    with pytest.raises(CheckpointError, match=r"__2_0\.safetensors: the file has \d+ bytes, but tensor 'w' ends at "
                                              r"byte \d+ \(truncated"):
        _load(mesh4, tmp_path)


def test_a_file_cut_after_its_header_was_read_is_refused_where_it_is_read(mesh4, tmp_path):
    """The reader's own check (the file changed between the controller's look and the read)."""
    _saved(mesh4, tmp_path)
    path = tmp_path / "__2_0.safetensors"
    offset = read_header(str(path))["w"].data_offset
    path.write_bytes(path.read_bytes()[:-3])
    chunk = (str(path), offset, torch.float32, (4, 0), (2, 4), NO_CHECKSUM)
    with pytest.raises(EOFError, match=r"__2_0\.safetensors has \d+ bytes, but the tensor's data ends"):
        read_region([chunk], (4, 0), (2, 4), torch.float32, "tensor 'w'")


def test_the_converter_checks_the_checksums_too(mesh4, tmp_path):
    _saved(mesh4, tmp_path)
    _flip_a_bit(tmp_path / "__3_0.safetensors")
    with pytest.raises(CheckpointError, match=r"__3_0\.safetensors: the chunk at offsets \[6, 0\]"):
        to_torch_state_dict(tmp_path)
    assert (to_torch_state_dict(tmp_path, verify=False)["w"] != SAVED).sum() == 1


def test_a_checkpoint_without_checksums_still_loads(mesh4, tmp_path):
    """As one saved before checksums: nothing recorded, nothing to verify."""
    index = _saved(mesh4, tmp_path)
    for chunk in index["tensors"]["w"]["chunks"]:
        del chunk["crc32"]
    _rewrite(tmp_path, index)
    assert torch.equal(_load(mesh4, tmp_path)["w"].to_torch(), SAVED)
    assert torch.equal(_load(mesh4, tmp_path, placements=[Shard(1)])["w"].to_torch(), SAVED)
    assert torch.equal(to_torch_state_dict(tmp_path)["w"], SAVED)


def test_a_damaged_checksum_in_the_index_is_refused(mesh4, tmp_path):
    index = _saved(mesh4, tmp_path)
    index["tensors"]["w"]["chunks"][0]["crc32"] = "12"
    _rewrite(tmp_path, index)
    with pytest.raises(CheckpointError, match=rf"{INDEX}: a damaged index \(TypeError: the crc32 of a chunk of 'w'"):
        _load(mesh4, tmp_path)
