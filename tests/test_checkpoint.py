"""dtorch.checkpoint: safetensors files and sharded directories load into DTensors on every mesh
and placement, each worker reading its own block; bad checkpoints fail before anything is sent,
and a worker that cannot read its part fails at the next read, never with a wrong value."""
from __future__ import annotations

import io
import json
import os
import random
import tempfile

import pytest
import torch
from safetensors.torch import save_file

import dtorch
from dtorch.checkpoint import CheckpointError, IncompatibleKeys, TensorTarget, load_state_dict, load_tensors
from dtorch.checkpoint.loading import _load_shard
from dtorch.nn.progress import ProgressBar
from dtorch.checkpoint.safetensors_header import read_checkpoint, read_header
from dtorch.spec.placements import Partial, Replicate, Shard, init_device_mesh
from dtorch.errors import RemoteError
from dtorch.runtime.worker import file_shards

pytestmark = pytest.mark.timeout(300)

# uneven on purpose: 7 rows over 2 or 4 ranks, 5 and 9 columns, a 3-D and a 0-D tensor
SAVED = {
    "embed.weight": torch.randn(7, 5, generator=torch.Generator().manual_seed(0)),
    "layers.0.proj.weight": torch.randn(9, 6, generator=torch.Generator().manual_seed(1)),
    "layers.0.proj.bias": torch.randn(11, generator=torch.Generator().manual_seed(2)),
    "layers.1.conv": torch.randn(5, 3, 6, generator=torch.Generator().manual_seed(3)),
    "scale": torch.tensor(1.25),
}


@pytest.fixture(scope="module")
def mesh2(session):
    return init_device_mesh("cpu", (2,), mesh_dim_names=["dp"])


@pytest.fixture(scope="module")
def checkpoint_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("single") / "model.safetensors"
    save_file(SAVED, str(path))
    return path


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    """A transformers-style directory: two shard files and model.safetensors.index.json."""
    folder = tmp_path_factory.mktemp("sharded")
    names = sorted(SAVED)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for file, members in shards.items():
        save_file({n: SAVED[n] for n in members}, str(folder / file))
    weight_map = {n: file for file, members in shards.items() for n in members}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def placements_for(mesh, ndim: int, choice: int):
    """A spread of layouts: on a 1-D mesh S(0), S(1), R, P(sum); on a 2-D mesh nested and mixed."""
    one_d = [[Shard(0)], [Shard(ndim - 1)], [Replicate()], [Partial()]]
    two_d = [[Shard(0), Shard(ndim - 1)], [Shard(ndim - 1), Shard(0)], [Shard(0), Shard(0)],
             [Replicate(), Shard(ndim - 1)], [Partial(), Shard(0)], [Shard(ndim - 1), Partial("max")]]
    options = one_d if mesh.ndim == 1 else two_d
    chosen = options[choice % len(options)]
    return [Replicate() if (p.is_shard() and ndim == 0) else p for p in chosen]


def targets_for(mesh, dtype, choice: int):
    return {name: TensorTarget(tuple(t.shape), dtype, mesh, placements_for(mesh, t.ndim, choice + i))
            for i, (name, t) in enumerate(sorted(SAVED.items()))}


def assert_loaded_exactly(loaded, dtype):
    assert set(loaded) == set(SAVED)
    for name, value in loaded.items():
        expected = SAVED[name].to(dtype)
        got = value.to_torch()
        assert got.dtype == dtype and torch.equal(got, expected), (name, value.placements)


# --- the header, read on the controller --------------------------------------------------------
def test_header_gives_each_tensors_dtype_shape_and_bytes(checkpoint_file):
    stored = read_header(str(checkpoint_file))
    assert set(stored) == set(SAVED)
    raw = checkpoint_file.read_bytes()
    for name, entry in stored.items():
        assert entry.shape == tuple(SAVED[name].shape) and entry.dtype == torch.float32
        data = raw[entry.data_offset:entry.data_offset + entry.nbytes]
        assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(entry.shape), SAVED[name])


def test_a_sharded_directory_maps_every_tensor_to_its_shard(sharded_dir):
    stored = read_checkpoint(str(sharded_dir))
    assert set(stored) == set(SAVED)
    assert len({entry.path for entry in stored.values()}) == 2
    assert read_checkpoint(str(sharded_dir / "model.safetensors.index.json")) == stored


def test_a_truncated_file_is_refused_before_anything_is_sent(tmp_path, mesh4):
    path = tmp_path / "model.safetensors"
    save_file(SAVED, str(path))
    path.write_bytes(path.read_bytes()[:-10])   # cut inside the data
    before = dtorch.stats()["checkpoint_tensors_loaded"]
    with pytest.raises(CheckpointError, match="truncated"):
        load_tensors(path, targets_for(mesh4, torch.float32, 0))
    assert dtorch.stats()["checkpoint_tensors_loaded"] == before


# --- loading on meshes and placements ----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_layout_loads_exactly(mesh, dtype):
    """Also run on cuda meshes by tests/test_cuda.py (hence its own file, no fixture but the mesh)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.safetensors")
        save_file(SAVED, path)
        before = dtorch.stats()
        for choice in range(6 if mesh.ndim == 2 else 4):
            assert_loaded_exactly(load_tensors(path, targets_for(mesh, dtype, choice)), dtype)
    after = dtorch.stats()
    assert after["checkpoint_bytes_via_controller"] == before["checkpoint_bytes_via_controller"]
    assert after["checkpoint_tensors_loaded"] > before["checkpoint_tensors_loaded"]


def test_every_layout_loads_exactly_on_two_ranks(mesh2):
    test_every_layout_loads_exactly(mesh2, torch.bfloat16)


def test_a_sharded_directory_loads_by_folder_or_index(mesh22, sharded_dir):
    for path in (sharded_dir, sharded_dir / "model.safetensors.index.json"):
        assert_loaded_exactly(load_tensors(path, targets_for(mesh22, torch.bfloat16, 1)), torch.bfloat16)


def test_the_controller_reads_no_tensor_bytes(mesh4, checkpoint_file):
    before = dtorch.stats()
    loaded = load_tensors(checkpoint_file, targets_for(mesh4, torch.float32, 2))
    dtorch.synchronize()
    after = dtorch.stats()
    # (a delta: the session's counter also holds earlier tests' via_controller loads)
    assert after["checkpoint_bytes_via_controller"] - before["checkpoint_bytes_via_controller"] == 0
    assert after["checkpoint_tensors_loaded"] - before["checkpoint_tensors_loaded"] == len(SAVED)
    # what the controller sent: commands, no tensor data (the saved tensors hold ~900 bytes)
    assert after["bytes_sent"] - before["bytes_sent"] < 4096
    assert_loaded_exactly(loaded, torch.float32)


def test_via_controller_loads_the_same_and_counts_its_bytes(mesh22, checkpoint_file):
    before = dtorch.stats()["checkpoint_bytes_via_controller"]
    loaded = load_tensors(checkpoint_file, targets_for(mesh22, torch.bfloat16, 3), via_controller=True)
    assert_loaded_exactly(loaded, torch.bfloat16)
    expected = sum(t.numel() * 4 for t in SAVED.values())
    assert dtorch.stats()["checkpoint_bytes_via_controller"] - before == expected


def test_integer_checkpoints_widen_and_narrow_like_torch(tmp_path, mesh2):
    path = tmp_path / "ints.safetensors"
    values = {"ids": torch.arange(-7, 8, dtype=torch.int64), "mask": torch.tensor([True, False, True])}
    save_file(values, str(path))
    loaded = load_tensors(path, {"ids": TensorTarget((15,), torch.int32, mesh2, [Shard(0)]),
                                 "mask": TensorTarget((3,), torch.float16, mesh2, [Shard(0)])})
    assert torch.equal(loaded["ids"].to_torch(), values["ids"].to(torch.int32))
    assert torch.equal(loaded["mask"].to_torch(), values["mask"].to(torch.float16))


def test_load_state_dict_replaces_a_dict_of_dtensors(mesh4, checkpoint_file):
    current = {name: dtorch.zeros(*t.shape, dtype=torch.bfloat16, device_mesh=mesh4,
                                  placements=placements_for(mesh4, t.ndim, 0)) for name, t in SAVED.items()}
    loaded = load_state_dict(current, checkpoint_file)
    assert all(loaded[n].placements == current[n].placements for n in SAVED)
    assert_loaded_exactly(loaded, torch.bfloat16)


def test_strict_false_returns_what_matched_and_lists_the_rest(mesh2, checkpoint_file):
    targets = targets_for(mesh2, torch.float32, 0)
    del targets["scale"]
    targets["extra.weight"] = TensorTarget((3,), torch.float32, mesh2, [Shard(0)])
    loaded = load_tensors(checkpoint_file, targets, strict=False)
    assert loaded.incompatible_keys == IncompatibleKeys(["extra.weight"], ["scale"])
    assert set(loaded) == set(SAVED) - {"scale"}
    kept = dtorch.ones(3, device_mesh=mesh2, placements=[Shard(0)])
    new = load_state_dict({"extra.weight": kept, "embed.weight": loaded["embed.weight"]}, checkpoint_file,
                          strict=False)
    assert new["extra.weight"] is kept and new.missing_keys == ["extra.weight"]


# --- errors on the controller: before anything is sent --------------------------------------------
def refused(path, targets, **options) -> str:
    before = dtorch.stats()["checkpoint_tensors_loaded"]
    with pytest.raises(CheckpointError) as info:
        load_tensors(path, targets, **options)
    assert dtorch.stats()["checkpoint_tensors_loaded"] == before, "something was loaded"
    return str(info.value)


def test_missing_and_unexpected_keys_are_one_error_listing_them(mesh2, checkpoint_file):
    targets = targets_for(mesh2, torch.float32, 0)
    del targets["scale"]
    targets["lm_head.weight"] = TensorTarget((3, 3), torch.float32, mesh2, [Shard(0)])
    message = refused(checkpoint_file, targets)
    assert "nothing was loaded" in message and "'lm_head.weight'" in message and "'scale'" in message


def test_a_shape_mismatch_names_the_parameter_and_both_shapes(mesh2, checkpoint_file):
    targets = targets_for(mesh2, torch.float32, 0)
    targets["embed.weight"] = TensorTarget((5, 7), torch.float32, mesh2, [Shard(0)])
    message = refused(checkpoint_file, targets)
    assert "'embed.weight'" in message and "[7, 5]" in message and "[5, 7]" in message


@pytest.mark.parametrize("target_dtype", [torch.int64, torch.bool])
def test_a_cast_that_would_lose_values_is_refused(mesh2, checkpoint_file, target_dtype):
    targets = targets_for(mesh2, torch.float32, 0)
    targets["layers.0.proj.bias"] = TensorTarget((11,), target_dtype, mesh2, [Shard(0)])
    message = refused(checkpoint_file, targets)
    assert "'layers.0.proj.bias'" in message and "torch.float32" in message and str(target_dtype) in message


def test_an_absent_path_is_refused(mesh2, tmp_path):
    assert "no such checkpoint" in refused(tmp_path / "nope.safetensors", {})
    assert "neither" in refused(tmp_path, {})


# --- errors on the workers: at the next read, never a hang or a wrong value ------------------------
def entry_and_target(path, mesh, name="embed.weight"):
    entry = read_header(str(path))[name]
    return entry, TensorTarget(entry.shape, torch.float32, mesh, [Shard(0)])


def test_a_file_cut_after_the_header_was_read_fails_at_the_read(tmp_path, mesh4):
    path = tmp_path / "model.safetensors"
    save_file(SAVED, str(path))
    entry, target = entry_and_target(path, mesh4)
    path.write_bytes(path.read_bytes()[:entry.data_offset + entry.nbytes // 2])   # the workers see this
    loaded = _load_shard(entry, target)
    with pytest.raises(RemoteError) as info:
        loaded.to_torch()
    message = str(info.value)
    assert str(path) in message and "'embed.weight'" in message and "rank" in message and "EOFError" in message
    healthy = dtorch.ones(4, device_mesh=mesh4, placements=[Shard(0)])   # the workers go on
    assert torch.equal(healthy.to_torch(), torch.ones(4))


def test_a_file_missing_on_the_workers_says_how_to_fix_it(tmp_path, mesh2):
    path = tmp_path / "model.safetensors"
    save_file(SAVED, str(path))
    entry, target = entry_and_target(path, mesh2)
    os.remove(path)
    with pytest.raises(RemoteError) as info:
        _load_shard(entry, target).to_torch()
    message = str(info.value)
    for expected in (str(path), "'embed.weight'", "rank", "shared", "via_controller=True"):
        assert expected in message, (expected, message)


# --- the worker's reader and the progress bar, without processes ----------------------------------
@pytest.mark.parametrize("gap_limit", [0, 1 << 40])   # one read per run / the covering range
def test_read_block_reads_any_box_exactly(tmp_path, monkeypatch, gap_limit):
    monkeypatch.setattr(file_shards, "GAP_LIMIT", gap_limit)
    monkeypatch.setattr(file_shards, "CHUNK_BYTES", 24)   # covering reads in several chunks
    rng = random.Random(0)
    path = tmp_path / "block.bin"
    for _ in range(200):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(0, 4)))
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64, torch.bool])
        value = (torch.randn(shape) * 10).to(dtype)
        prefix = rng.randint(0, 7)
        path.write_bytes(b"x" * prefix + value.reshape(-1).view(torch.uint8).numpy().tobytes())
        offset = [rng.randint(0, s - 1) for s in shape]
        box = [rng.randint(1, s - o) for s, o in zip(shape, offset)]
        got = file_shards.read_block(str(path), prefix, dtype, shape, offset, box, "t")
        assert torch.equal(got, value[tuple(slice(o, o + b) for o, b in zip(offset, box))]), (shape, offset, box)


def test_a_row_sharded_block_is_one_read():
    assert list(file_shards.block_runs((8, 4, 3), (2, 0, 0), (3, 4, 3))) == [(24, 1, 36, 36)]
    assert list(file_shards.block_runs((8, 6), (0, 3), (8, 3))) == [(3, 8, 6, 3)]   # S(1): 8 runs of 3


def test_the_progress_bar_draws_only_where_asked():
    shown = io.StringIO()
    bar = ProgressBar(3, 3 << 30, enabled=True, stream=shown)
    bar.advance(3, 3 << 30)
    bar.close()
    assert "3/3 tensors" in shown.getvalue() and "3.00/3.00 GiB" in shown.getvalue()
    quiet = io.StringIO()
    bar = ProgressBar(3, 10, stream=quiet)   # StringIO is not a terminal
    bar.advance(3, 10)
    bar.close()
    assert quiet.getvalue() == "" and not bar.enabled


def test_progress_waits_for_the_workers_and_still_loads(mesh4, checkpoint_file, capsys):
    loaded = load_tensors(checkpoint_file, targets_for(mesh4, torch.float32, 1), progress=True)
    assert "5/5 tensors" in capsys.readouterr().err
    assert_loaded_exactly(loaded, torch.float32)
