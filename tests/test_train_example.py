"""examples/train_llama.py as a user runs it (a subprocess: it trains, prints losses, writes the plot
and the checkpoint, and `--resume` continues with exactly the losses of an uninterrupted run), and
its checkpoint resumed across layouts in-process: saved on dp2 x tp2 after 2 steps, loaded into a
fresh model and optimizer on fsdp4 and on tp4, the next steps give the uninterrupted run's losses.
(A worker killed during a save is tests/test_checkpoint_sharded.py's.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dtorch
from dtorch.checkpoint import save, to_torch_state_dict
from dtorch.spec.placements import init_device_mesh

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_llama.py"
RUN_TIMEOUT_S = 150

pytestmark = pytest.mark.timeout(300)

sys.path.insert(0, str(EXAMPLE.parent))   # the example's functions, for the in-process test
import train_llama  # noqa: E402


def run_example(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python examples/train_llama.py ARGS` with this checkout's dtorch; a run that hangs is
    killed (its workers end when their controller is gone: tests/test_lifecycle.py)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(EXAMPLE), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def logged_losses(path: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, path.read_text().splitlines())}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """4 steps on the default layout (dp 2), as a user would run it."""
    where = tmp_path_factory.mktemp("uninterrupted")
    done = run_example("--steps", "4", "--log-every", "1", "--sample", "8", "--out", "run",
                       "--log-json", "losses.jsonl", cwd=where)
    return where, done.stdout


def test_the_example_trains_prints_losses_and_writes_the_plot_and_the_checkpoint(uninterrupted):
    where, stdout = uninterrupted
    losses = logged_losses(where / "losses.jsonl")
    assert sorted(losses) == [1, 2, 3, 4]
    for step, loss in losses.items():
        assert f"step {step}/4  loss {loss:.4f}" in stdout
    assert "tokens/s" in stdout and "sample: " in stdout
    assert (where / "run" / "loss.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    saved = to_torch_state_dict(str(where / "run" / "checkpoint"))
    assert saved["step"] == 4 and saved["losses"] == [losses[s] for s in range(1, 5)]
    assert saved["data"]["seed"] == 0 and saved["data"]["corpus"] == "fables.txt"
    assert set(saved["optim"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert saved["model"]["model.embed_tokens.weight"].shape == (258, 64)


def test_resume_gives_exactly_the_losses_of_an_uninterrupted_run(uninterrupted, tmp_path):
    where, _ = uninterrupted
    run_example("--steps", "2", "--sample", "0", "--out", "run", "--log-json", "losses.jsonl", cwd=tmp_path)
    done = run_example("--steps", "4", "--resume", "--sample", "0", "--out", "run", "--log-json", "losses.jsonl",
                       cwd=tmp_path)
    assert "resumed at step 2" in done.stdout
    assert logged_losses(tmp_path / "losses.jsonl") == logged_losses(where / "losses.jsonl")   # bit for bit
    assert to_torch_state_dict(str(tmp_path / "run" / "checkpoint"))["step"] == 4


def test_bf16_on_fsdp_and_a_resume_without_a_checkpoint(tmp_path):
    done = run_example("--fsdp", "2", "--bf16", "--steps", "2", "--log-every", "1", "--sample", "0", "--out", "run",
                       cwd=tmp_path)
    assert "mesh_dim_names=('fsdp',)" in done.stdout and "step 2/2  loss" in done.stdout
    missing = subprocess.run([sys.executable, str(EXAMPLE), "--resume", "--out", "nothing"], cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                             timeout=RUN_TIMEOUT_S)
    assert missing.returncode != 0 and "no checkpoint at nothing/checkpoint" in missing.stderr


# --- across layouts, in-process ------------------------------------------------------------------------
LR, BATCH, SEQ = 3e-3, 4, 16
LAYOUTS = {"fsdp4": ((4,), ["fsdp"]), "tp4": ((4,), ["tp"])}


def _batches():
    tokens = train_llama.encode(train_llama.CORPUS.read_text(encoding="utf-8"))
    return [train_llama.batch_at(tokens, step, BATCH, SEQ, seed=0) for step in range(4)]


@pytest.fixture(scope="module")
def saved_at_step_2(session, tmp_path_factory):
    """dp2 x tp2: the losses of 4 uninterrupted steps, and a checkpoint taken after step 2."""
    model = train_llama.build_model(init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"]))
    optimizer = train_llama.make_optimizer(model, LR)
    directory = tmp_path_factory.mktemp("across") / "checkpoint"
    losses = []
    for step, ids in enumerate(_batches()):
        if step == 2:
            save(train_llama.training_state(model, optimizer, step, losses, {}), directory)
        losses.append(train_llama.train_step(model, optimizer, ids, LR).item())
    return directory, losses


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_checkpoint_saved_on_dp2xtp2_resumes_exactly_on_another_layout(layout, saved_at_step_2):
    directory, expected = saved_at_step_2
    shape, names = LAYOUTS[layout]
    model = train_llama.build_model(init_device_mesh("cpu", shape, mesh_dim_names=names), seed=1)   # other weights
    optimizer, state = train_llama.restore(model, LR, directory)
    assert state["step"] == 2 and state["losses"] == expected[:2]
    assert all(s["step"] == 2 for s in optimizer.state.values())
    for param in model.parameters():   # the moments resharded like their parameters
        assert optimizer.state[param]["exp_avg"].placements == param.placements
    losses = [train_llama.train_step(model, optimizer, ids, LR).item() for ids in _batches()[2:]]
    for got, want in zip(losses, expected[2:]):
        assert abs(got - want) <= 2e-4 * abs(want), f"{layout}: {losses} != {expected[2:]}"


def test_init_state_makes_a_fresh_optimizer_a_load_target_and_steps_like_a_fresh_one(session):
    """Adam's zero state with step 0 is what a first step makes: the same parameters after it."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=["dp"])
    ids = _batches()[0]
    results = []
    for prepare in (lambda opt: opt, dtorch.optim.init_state):
        model = train_llama.build_model(mesh)
        optimizer = prepare(train_llama.make_optimizer(model, LR))
        train_llama.train_step(model, optimizer, ids, LR)
        results.append([p.to_torch() for p in model.parameters()])
        assert all(s["step"] == 1 for s in optimizer.state.values())
    assert all((a == b).all() for a, b in zip(*results))
    fresh = dtorch.optim.init_state(dtorch.optim.SGD(train_llama.build_model(mesh).parameters(), lr=0.1,
                                                     momentum=0.9)).state_dict()["state"]
    assert set(fresh[0]) == {"momentum_buffer"}
