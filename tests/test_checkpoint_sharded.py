"""dtorch.checkpoint.save / load: sharded checkpoints that every worker writes and reads in parallel,
and that load back onto any layout (saved on dp2 x tp2, loaded into fsdp4 or tp4). Values are
compared with torch bit for bit; the controller sees no tensor bytes; a save that fails or whose
worker is killed leaves no checkpoint at the target; bad loads name the key and both shapes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import dtorch
from dtorch import nn
from dtorch.checkpoint import CheckpointError, TensorTarget, load, save, to_torch_state_dict
from dtorch.checkpoint import saving
from dtorch.checkpoint.loading import _load_shard
from dtorch.checkpoint.safetensors_header import StoredTensor, read_header
from dtorch.spec.placements import Partial, Replicate, Shard
from dtorch.errors import DTorchError

from support import REPO, alive, placed, run_script

pytestmark = pytest.mark.timeout(300)


def values(seed: int, shape, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)
    return torch.randn(shape, generator=g).to(dtype)


# (name, shape, dtype): even, uneven, fewer rows than ranks (empty blocks), 0-D, 3-D, other dtypes
TENSORS = [("even", (8, 4), torch.float32), ("uneven", (7, 5), torch.float32), ("short", (3, 6), torch.float32),
           ("scalar", (), torch.float32), ("cube", (5, 3, 6), torch.bfloat16), ("ints", (9,), torch.int64),
           ("mask", (6, 2), torch.bool)]


def _fits(placements, ndim) -> bool:
    return all(not isinstance(p, Shard) or p.dim < ndim for p in placements)


def layout_of(placements, ndim):
    """The placements, with shards past a tensor's last dim replicated (a 0-D or 1-D tensor)."""
    return [p if _fits([p], ndim) else Replicate() for p in placements]


def upload_all(mesh, placements):
    expected = {name: values(i, shape, dtype) for i, (name, shape, dtype) in enumerate(TENSORS)}
    tensors = {name: dtorch.tensor(t, device_mesh=mesh, placements=layout_of(placements, t.ndim))
               for name, t in expected.items()}
    return expected, tensors


def empty_like_on(expected: dict, mesh, placements, dtype=None) -> dict:
    return {name: dtorch.zeros(*t.shape, dtype=dtype or t.dtype, device_mesh=mesh,
                               placements=layout_of(placements, t.ndim)) for name, t in expected.items()}


def assert_equal_exactly(state: dict, expected: dict) -> None:
    for name, want in expected.items():
        got = state[name].to_torch()
        assert got.dtype == want.dtype and torch.equal(got, want), name


SAVE_LAYOUTS = [("mesh4", [Shard(0)]), ("mesh4", [Shard(1)]), ("mesh4", [Replicate()]),
                ("mesh22", [Shard(0), Shard(1)]), ("mesh22", [Replicate(), Shard(0)]),
                ("mesh22", [Shard(0), Shard(0)]), ("mesh22", [Shard(1), Replicate()]), ("mesh1", [Replicate()])]


@pytest.mark.parametrize("mesh_name,placements", SAVE_LAYOUTS, ids=lambda v: str(v))
def test_round_trip_on_the_same_layout_is_exact(mesh_name, placements, request, tmp_path):
    mesh = request.getfixturevalue(mesh_name)
    expected, tensors = upload_all(mesh, placements)
    save({"model": tensors}, tmp_path / "ck")
    loaded = load({"model": empty_like_on(expected, mesh, placements)}, tmp_path / "ck")
    assert_equal_exactly(loaded["model"], expected)
    for name, tensor in loaded["model"].items():
        assert tensor.placements == tensors[name].placements and tensor.device_mesh == mesh


@pytest.mark.parametrize("target", [("mesh4", [Shard(0)]), ("mesh4", [Shard(1)]), ("mesh4", [Replicate()]),
                                    ("mesh22", [Shard(1), Shard(0)]), ("mesh1", [Replicate()])], ids=str)
def test_saved_on_dp2_tp2_loads_into_other_layouts(target, mesh22, request, tmp_path):
    expected, tensors = upload_all(mesh22, [Replicate(), Shard(0)])   # dp replicates, tp shards
    tensors.update({f"{name}_2d": dtorch.tensor(t, device_mesh=mesh22,
                                                placements=layout_of([Shard(0), Shard(1)], t.ndim))
                    for name, t in expected.items()})
    expected.update({f"{name}_2d": t for name, t in list(expected.items())})
    save({"model": tensors, "step": 3}, tmp_path / "ck")
    mesh = request.getfixturevalue(target[0])
    state = {"model": empty_like_on(expected, mesh, target[1]), "step": 0}
    loaded = load(state, tmp_path / "ck")
    assert loaded is state and state["step"] == 3
    assert_equal_exactly(state["model"], expected)
    assert all(t.device_mesh == mesh for t in state["model"].values())


def test_load_casts_to_the_target_dtype(mesh4, tmp_path):
    a = values(0, (6, 3))
    save({"a": dtorch.tensor(a, device_mesh=mesh4, placements=[Shard(0)])}, tmp_path / "ck")
    state = load({"a": dtorch.zeros(6, 3, dtype=torch.float64, device_mesh=mesh4, placements=[Shard(1)])},
                 tmp_path / "ck")
    assert state["a"].dtype == torch.float64 and torch.equal(state["a"].to_torch(), a.double())


def test_nested_optimizer_like_state_with_int_keys_and_plain_values(mesh22, mesh4, tmp_path):
    w, m, v = values(1, (7, 4)), values(2, (7, 4)), values(3, (7, 4))
    def on22(t):
        return dtorch.tensor(t, device_mesh=mesh22, placements=[Shard(0), Shard(1)])
    groups = [{"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
               "foreach": None, "name": "main", "params": [0]}]
    saved_state = {"model": {"w": on22(w)}, "step": 7, "rng": torch.tensor([1, 2, 3]),
                   "optim": {"state": {0: {"step": 7, "exp_avg": on22(m), "exp_avg_sq": on22(v)}},
                             "param_groups": groups}, "extra": {1: "one", "two": [1.5, float("inf")]}}
    save(saved_state, tmp_path / "ck")
    def fresh():
        return dtorch.zeros(7, 4, device_mesh=mesh4, placements=[Shard(0)])
    state = {"model": {"w": fresh()}, "step": 0, "rng": None, "extra": None,
             "optim": {"state": {0: {"step": 0, "exp_avg": fresh(), "exp_avg_sq": fresh()}}, "param_groups": []}}
    load(state, tmp_path / "ck")
    assert state["step"] == 7 and state["optim"]["state"][0]["step"] == 7
    assert state["optim"]["param_groups"] == groups and isinstance(state["optim"]["param_groups"][0]["betas"], tuple)
    assert state["extra"] == {1: "one", "two": [1.5, float("inf")]}
    assert torch.equal(state["rng"], torch.tensor([1, 2, 3]))
    for got, want in ((state["model"]["w"], w), (state["optim"]["state"][0]["exp_avg"], m),
                      (state["optim"]["state"][0]["exp_avg_sq"], v)):
        assert torch.equal(got.to_torch(), want) and got.placements == (Shard(0),)


def test_partial_tensors_are_reduced_before_saving(mesh22, mesh4, tmp_path):
    g = torch.Generator().manual_seed(5)
    a, b = values(6, (6, 5), torch.float64), values(7, (5, 3), torch.float64)
    x = placed(a, mesh22, [Partial(), Shard(0)], g)
    y = placed(b, mesh22, [Shard(1), Partial()], g)
    assert x.placements == (Partial(), Shard(0))
    save({"x": x, "y": y}, tmp_path / "ck")
    state = load({"x": dtorch.zeros(6, 5, dtype=torch.float64, device_mesh=mesh4, placements=[Replicate()]),
                  "y": dtorch.zeros(5, 3, dtype=torch.float64, device_mesh=mesh22, placements=[Partial(), Shard(1)])},
                 tmp_path / "ck")
    torch.testing.assert_close(state["x"].to_torch(), a, rtol=1e-12, atol=1e-12)
    assert state["y"].placements == (Partial(), Shard(1))
    torch.testing.assert_close(state["y"].to_torch(), b, rtol=1e-12, atol=1e-12)


def test_no_tensor_bytes_pass_through_the_controller(mesh22, mesh4, tmp_path):
    big = {f"w{i}": values(i, (256, 128)) for i in range(4)}     # 512 KiB in all
    tensors = {k: dtorch.tensor(t, device_mesh=mesh22, placements=[Shard(0), Shard(1)]) for k, t in big.items()}
    dtorch.synchronize()
    before = dtorch.stats()
    save(tensors, tmp_path / "ck")
    state = load({k: dtorch.zeros(256, 128, device_mesh=mesh4, placements=[Shard(1)]) for k in big}, tmp_path / "ck")
    dtorch.synchronize()
    after = dtorch.stats()
    moved = {k: after[k] - before[k] for k in ("bytes_sent", "bytes_received", "checkpoint_bytes_saved",
                                               "checkpoint_tensors_saved", "checkpoint_tensors_loaded")}
    total = sum(t.numel() * 4 for t in big.values())
    for counter in ("checkpoint_bytes_saved_via_controller", "checkpoint_bytes_via_controller"):   # (earlier tests
        assert after[counter] == before[counter], counter                                            # may count)
    assert moved["checkpoint_bytes_saved"] == total and moved["checkpoint_tensors_saved"] == 4
    assert moved["checkpoint_tensors_loaded"] == 4
    assert moved["bytes_sent"] + moved["bytes_received"] < total // 50, moved   # commands and statuses only
    assert_equal_exactly(state, big)


def test_each_rank_writes_its_own_file_and_replicas_are_written_once(mesh22, tmp_path):
    tensors = {f"r{i}": dtorch.tensor(values(i, (4, 4)), device_mesh=mesh22, placements=[Replicate(), Replicate()])
               for i in range(4)}
    tensors["s"] = dtorch.tensor(values(9, (8, 4)), device_mesh=mesh22, placements=[Shard(0), Replicate()])
    save(tensors, tmp_path / "ck")
    index = json.loads((tmp_path / "ck" / "checkpoint.json").read_text())
    for key in tensors:
        chunks = index["tensors"][key]["chunks"]
        assert sum(torch.Size(c["shape"]).numel() for c in chunks) == tensors[key].numel()   # no replica twice
    writers = {c["file"] for entry in index["tensors"].values() for c in entry["chunks"]}
    assert len(writers) == 4, writers   # replicated tensors spread over their replicas, not all on rank 0
    for file in writers:
        header = read_header(str(tmp_path / "ck" / file))   # plain safetensors files
        assert header and all(name in tensors for name in header)


def test_a_rank_starts_a_new_file_past_the_file_size(mesh4, tmp_path, monkeypatch):
    monkeypatch.setattr(saving, "FILE_BYTES", 100)
    expected = {f"t{i}": values(i, (8, 10)) for i in range(3)}   # 80 bytes per rank per tensor
    save({k: dtorch.tensor(t, device_mesh=mesh4, placements=[Shard(0)]) for k, t in expected.items()}, tmp_path / "ck")
    files = sorted(f for f in os.listdir(tmp_path / "ck") if f.endswith(".safetensors"))
    assert len(files) == 12 and "__3_2.safetensors" in files
    state = load({k: dtorch.zeros(8, 10, device_mesh=mesh4, placements=[Shard(1)]) for k in expected}, tmp_path / "ck")
    assert_equal_exactly(state, expected)


def test_the_converter_gives_the_full_tensors(mesh22, tmp_path):
    a, b = values(1, (7, 5)), values(2, (4, 9), torch.bfloat16)
    save({"model": {"a": dtorch.tensor(a, device_mesh=mesh22, placements=[Shard(1), Shard(0)]),
                    "b": dtorch.tensor(b, device_mesh=mesh22, placements=[Replicate(), Shard(1)])},
          "optim": {"state": {0: {"m": dtorch.tensor(a, device_mesh=mesh22, placements=[Shard(0), Replicate()])}}},
          "step": 11}, tmp_path / "ck")
    full = to_torch_state_dict(tmp_path / "ck")
    assert torch.equal(full["model"]["a"], a) and torch.equal(full["model"]["b"], b)
    assert torch.equal(full["optim"]["state"][0]["m"], a) and full["step"] == 11
    out = tmp_path / "full.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-m", "dtorch.checkpoint.convert", str(tmp_path / "ck"), str(out)], cwd=REPO,
                   env=env, check=True, capture_output=True, timeout=120)
    converted = torch.load(out, weights_only=True)
    assert torch.equal(converted["model"]["a"], a) and torch.equal(converted["model"]["b"], b)
    assert converted["step"] == 11 and list(converted["optim"]["state"]) == [0]


def test_a_module_round_trips_across_layouts(mesh22, mesh4, tmp_path):
    def model(mesh, tp_dim):
        return nn.Sequential(nn.ColumnParallelLinear(8, 12, device_mesh=mesh, tp_dim=tp_dim),
                             nn.RowParallelLinear(12, 6, device_mesh=mesh, tp_dim=tp_dim))
    source, target = model(mesh22, "tp"), model(mesh4, "dp")
    save({"model": source.state_dict(), "step": 2}, tmp_path / "ck")
    loaded = load({"model": target.state_dict(), "step": 0}, tmp_path / "ck")
    target.load_state_dict(loaded["model"])
    for name, tensor in target.state_dict().items():
        assert torch.equal(tensor.to_torch(), source.state_dict()[name].to_torch()), name
        assert tensor.device_mesh == mesh4
    x = values(3, (5, 8))
    def same_input(mesh):
        return dtorch.tensor(x, device_mesh=mesh, placements=[Replicate()] * mesh.ndim)
    torch.testing.assert_close(target(same_input(mesh4)).to_torch(), source(same_input(mesh22)).to_torch())


def test_resuming_from_a_checkpoint_gives_the_same_losses(mesh22, tmp_path):
    """Linear regression with explicit gradients (batch over dp): a run that saves at step 3 and
    a run that loads that checkpoint and goes on have bit-equal losses."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(64, 8, generator=g, dtype=torch.float64)
    Y = X @ torch.randn(8, 1, generator=g, dtype=torch.float64)
    x, y = (dtorch.tensor(t, device_mesh=mesh22, placements=[Shard(0), Replicate()]) for t in (X, Y))
    replicated = [Replicate(), Replicate()]

    def step(w):
        err = x @ w - y
        grad = (x.T @ err).redistribute(mesh22, replicated) * (2.0 / 64)
        return (err * err).mean().item(), w - 0.05 * grad

    w, losses = dtorch.zeros(8, 1, dtype=torch.float64, device_mesh=mesh22, placements=replicated), []
    for index in range(6):
        if index == 3:
            save({"w": w, "step": index, "losses": list(losses)}, tmp_path / "ck")
        loss, w = step(w)
        losses.append(loss)
    state = load({"w": dtorch.zeros(8, 1, dtype=torch.float64, device_mesh=mesh22, placements=replicated),
                  "step": 0, "losses": []}, tmp_path / "ck")
    w, resumed = state["w"], state["losses"]
    for _ in range(state["step"], 6):
        loss, w = step(w)
        resumed.append(loss)
    assert resumed == losses and losses[-1] < losses[0]


def test_saving_again_replaces_the_checkpoint(mesh4, tmp_path):
    def one(v):
        return {"a": dtorch.full((4, 4), v, device_mesh=mesh4, placements=[Shard(0)]), "step": int(v)}
    save(one(1.0), tmp_path / "ck")
    save(one(2.0), tmp_path / "ck")
    state = load(one(0.0), tmp_path / "ck")
    assert state["step"] == 2 and torch.equal(state["a"].to_torch(), torch.full((4, 4), 2.0))
    assert os.listdir(tmp_path) == ["ck"]   # no staging or old directory left beside it


def test_a_failed_tensor_fails_the_save_and_leaves_nothing(mesh4, tmp_path):
    good = dtorch.ones(4, 4, device_mesh=mesh4, placements=[Shard(0)])
    broken = _load_shard(StoredTensor(str(tmp_path / "absent.safetensors"), "w", torch.float32, (4, 4), 0),
                         TensorTarget((4, 4), torch.float32, mesh4, [Shard(0)]))
    with pytest.raises(DTorchError) as info:
        save({"good": good, "broken": broken}, tmp_path / "ck")
    assert "absent.safetensors" in str(info.value) or "'broken'" in str(info.value)
    assert os.listdir(tmp_path) == []
    save({"good": good}, tmp_path / "ck")   # the session goes on
    assert torch.equal(load({"good": dtorch.zeros(4, 4, device_mesh=mesh4)}, tmp_path / "ck")["good"].to_torch(),
                       torch.ones(4, 4))


@pytest.fixture
def saved(mesh4, tmp_path):
    save({"model": {"w": dtorch.ones(6, 4, device_mesh=mesh4, placements=[Shard(0)]),
                    "b": dtorch.ones(6, device_mesh=mesh4, placements=[Shard(0)])}, "step": 1}, tmp_path / "ck")
    return tmp_path / "ck"


def test_missing_unexpected_and_mismatched_keys_are_one_clear_error(mesh4, saved):
    state = {"model": {"w": dtorch.zeros(6, 5, device_mesh=mesh4), "extra": dtorch.zeros(2, device_mesh=mesh4)},
             "step": dtorch.zeros(1, device_mesh=mesh4)}
    with pytest.raises(CheckpointError) as info:
        load(state, saved)
    message = str(info.value)
    for expected in ("missing from the checkpoint (1): 'model.extra'", "not expected (1): 'model.b'",
                     "'model.w': shape [6, 4] in the checkpoint", "[6, 5] expected",
                     "'step': a plain value in the checkpoint, a DTensor expected", "nothing was loaded"):
        assert expected in message, (expected, message)


def test_strict_false_keeps_what_the_checkpoint_lacks(mesh4, saved):
    keep = dtorch.full((2,), 3.0, device_mesh=mesh4)
    state = load({"model": {"w": dtorch.zeros(6, 4, device_mesh=mesh4), "extra": keep}}, saved, strict=False)
    assert state["model"]["extra"] is keep and torch.equal(state["model"]["w"].to_torch(), torch.ones(6, 4))


def test_a_cast_that_loses_values_is_refused(mesh4, saved):
    with pytest.raises(CheckpointError,
                       match="'model.w': dtype torch.float32 in the checkpoint cannot become torch.int64"):
        load({"model": {"w": dtorch.zeros(6, 4, dtype=torch.int64, device_mesh=mesh4),
                        "b": dtorch.zeros(6, device_mesh=mesh4)}, "step": 0}, saved)


def test_absent_incomplete_and_damaged_checkpoints_are_refused(mesh4, saved, tmp_path):
    def state():
        return {"model": {"w": dtorch.zeros(6, 4, device_mesh=mesh4), "b": dtorch.zeros(6, device_mesh=mesh4)},
                "step": 0}
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        load(state(), tmp_path / "nowhere")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "__0_0.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match="no checkpoint.json"):
        load(state(), tmp_path / "half")
    victim = saved / "__1_0.safetensors"
    victim.write_bytes(victim.read_bytes()[:-4])
    with pytest.raises(CheckpointError, match="truncated"):
        load(state(), saved)
    victim.unlink()
    with pytest.raises(CheckpointError, match="__1_0.safetensors is missing"):
        load(state(), saved)


def test_values_that_cannot_be_saved_are_refused_before_anything_is_written(mesh4, tmp_path):
    with pytest.raises(CheckpointError, match="'opt.fn': cannot save a builtin_function_or_method"):
        save({"w": dtorch.ones(2, device_mesh=mesh4), "opt": {"fn": print}}, tmp_path / "ck")
    with pytest.raises(CheckpointError, match="the key 'a.b'"):
        save({"a.b": 1, "a": {"b": dtorch.ones(2, device_mesh=mesh4)}}, tmp_path / "ck")
    assert os.listdir(tmp_path) == []


KILLED_SAVE = """
    import json, os, signal, threading, time, torch, dtorch
    from dtorch.spec.placements import init_device_mesh, Shard
    EXISTING = {existing}
    mesh = init_device_mesh("cpu", (2,))
    parent = {folder!r}   # the test's tmp_path: pytest removes it
    target = os.path.join(parent, "ck")
    x = dtorch.tensor(torch.arange(64.0).reshape(8, 8), device_mesh=mesh, placements=[Shard(0)])
    if EXISTING:
        dtorch.checkpoint.save({{"x": x, "step": 1}}, target)
    y = x * 2
    dtorch.synchronize()
    pids = [w["pid"] for w in dtorch.workers()]
    os.kill(pids[1], signal.SIGSTOP)          # rank 1 cannot write its file: the save is held mid-way
    outcome = {{}}

    def saving():
        try:
            dtorch.checkpoint.save({{"x": y, "step": 2}}, target)
            outcome["error"] = None
        except Exception as error:
            outcome["error"] = type(error).__name__ + ": " + str(error)

    thread = threading.Thread(target=saving)
    thread.start()
    staged, deadline = None, time.monotonic() + 60
    while staged is None and time.monotonic() < deadline:   # rank 0 has written its file
        staged = next((d for d in os.listdir(parent) if d.startswith(".ck.saving-")
                       and os.path.exists(os.path.join(parent, d, "__0_0.safetensors"))), None)
        time.sleep(0.01)
    os.kill(pids[1], signal.SIGKILL)
    thread.join(60)
    report = {{"staged": staged, "error": outcome.get("error"), "listing": sorted(os.listdir(parent)), "pids": pids}}
    if EXISTING:
        old = dtorch.checkpoint.to_torch_state_dict(target)
        report["old_intact"] = old["step"] == 1 and torch.equal(old["x"], torch.arange(64.0).reshape(8, 8))
        dtorch.replace_lost_workers(timeout=60)
        mesh = init_device_mesh("cpu", (2,))
        state = dtorch.checkpoint.load({{"x": dtorch.zeros(8, 8, device_mesh=mesh, placements=[Shard(1)]), "step": 0}},
                                       target)
        report["reloaded"] = state["step"] == 1 and torch.equal(state["x"].to_torch(), torch.arange(64.0).reshape(8, 8))
        report["pids"] += [w["pid"] for w in dtorch.workers()]
    try:
        dtorch.checkpoint.load({{"x": None}}, os.path.join(parent, "ck" if not EXISTING else "nothing"))
    except dtorch.checkpoint.CheckpointError as error:
        report["load_error"] = str(error)
    dtorch.shutdown()
    print(json.dumps(report))
"""


@pytest.mark.parametrize("existing", [False, True], ids=["fresh_target", "replacing_a_checkpoint"])
def test_a_worker_killed_mid_save_leaves_no_checkpoint_at_the_target(existing, tmp_path):
    result = run_script(KILLED_SAVE.format(existing=existing, folder=str(tmp_path)), timeout=200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["staged"], "the save never started writing"
    assert report["error"] and "WorkerLostError" in report["error"] and "rank 1" in report["error"], report["error"]
    assert report["listing"] == (["ck"] if existing else []), report["listing"]   # staging removed too
    assert "no such checkpoint directory" in report["load_error"]
    if existing:
        assert report["old_intact"] and report["reloaded"]
    for pid in report["pids"]:
        assert not alive(pid)
