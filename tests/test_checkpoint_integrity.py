"""A damaged checkpoint index is refused, naming the file and the tensor (issue 43, item 3): the
chunks must tile each tensor exactly. Counting elements let a chunk moved onto another load the
gap's uninitialized memory silently."""
import json
import os

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from dtorch.checkpoint.sharded_format import tiling_problem
from dtorch.checkpoint.safetensors_header import CheckpointError

INDEX = "checkpoint.json"


def _saved(mesh, directory) -> dict:
    values = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    dtorch.checkpoint.save({"w": dtorch.tensor(values, device_mesh=mesh, placements=[Shard(0)])}, directory)
    with open(os.path.join(directory, INDEX)) as file:
        return json.load(file)


def _rewrite(directory, index) -> None:
    with open(os.path.join(directory, INDEX), "w") as file:
        json.dump(index, file)


def _load(mesh, directory):
    target = {"w": dtorch.zeros(8, 4, device_mesh=mesh, placements=[Replicate()])}
    return dtorch.checkpoint.load(target, directory)


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
