"""dtorch.checkpoint the torch.distributed.checkpoint way: fresh objects and one load.

A scheduled (LambdaLR), accumulated (2 microbatches), clipped AdamW run saved mid-way with
{"model": model, "optim": opt, "sched": sched, "step": k} and resumed into freshly built objects,
on its own layout and on another, equals the uninterrupted run (to the bit on the same layout).
A fresh optimizer's state_dict() is a load target without init_state; torch's
get_state_dict / set_state_dict work on dtorch objects; StateDictOptions apply or are refused by
name; a checkpoint torch.distributed.checkpoint wrote loads into dtorch objects, and torch's
dcp.load reads one dtorch wrote (through DtorchStorageReader); the errors name the key at fault."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import nn
from dtorch.checkpoint import (CheckpointError, get_state_dict, load, save, set_state_dict,
                               to_torch_state_dict)
from dtorch.spec.placements import Replicate, Shard, init_device_mesh

from support import run_script

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

STEPS, SAVED_AT = 6, 3


class MLP(nn.Module):
    """Megatron's pair on a "tp" mesh dim; replicated on a mesh without one."""

    def __init__(self, mesh):
        super().__init__()
        self.up = nn.ColumnParallelLinear(8, 32, device_mesh=mesh)
        self.down = nn.RowParallelLinear(32, 4, device_mesh=mesh)

    def forward(self, x):
        return self.down(self.up(x).relu())


class TorchMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.down(self.up(x).relu())


def warmup_then_decay(step: int) -> float:
    return min(1.0, (step + 1) / 3) * 0.7 ** max(0, step - 2)


def fresh(mesh):
    """A model, AdamW and LambdaLR as a new process builds them (other weights than the run's)."""
    dtorch.manual_seed(0)
    model = MLP(mesh)
    optimizer = dtorch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.1)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_decay)


def microbatches(step: int, mesh):
    """The step's batch of 8 in two microbatches of 4, sharded over "dp" where the mesh has it."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    placements = [Shard(0) if name == "dp" else Replicate() for name in mesh.mesh_dim_names]
    return [(dtorch.tensor(xs, device_mesh=mesh, placements=placements),
             dtorch.tensor(ys, device_mesh=mesh, placements=placements)) for xs, ys in zip(x.chunk(2), y.chunk(2))]


def train(model, optimizer, scheduler, steps, mesh) -> list[float]:
    losses = []
    for step in steps:
        (x1, y1), (x2, y2) = microbatches(step, mesh)
        with model.no_sync():   # the first microbatch accumulates unreduced
            first = F.mse_loss(model(x1), y1) / 2
            first.backward()
        second = F.mse_loss(model(x2), y2) / 2
        second.backward()
        dtorch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append((first + second).item())
    return losses


@pytest.fixture(scope="module")
def dp2(session):
    return init_device_mesh("cpu", (2,), mesh_dim_names=["dp"])


@pytest.fixture(scope="module")
def dp2xtp2(session):
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])


@pytest.fixture(scope="module")
def uninterrupted(dp2):
    model, optimizer, scheduler = fresh(dp2)
    losses = train(model, optimizer, scheduler, range(STEPS), dp2)
    return losses, {name: p.to_torch() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def saved_mid_run(dp2, tmp_path_factory):
    model, optimizer, scheduler = fresh(dp2)
    losses = train(model, optimizer, scheduler, range(SAVED_AT), dp2)
    directory = tmp_path_factory.mktemp("dcp") / "ckpt"
    save({"model": model, "optim": optimizer, "sched": scheduler, "step": SAVED_AT, "losses": losses,
          "rng": torch.get_rng_state()}, directory)
    return directory


@pytest.mark.parametrize("layout,tolerance", [("dp2", 0.0), ("dp2xtp2", 1e-6)])
def test_a_resume_into_fresh_objects_equals_the_uninterrupted_run(layout, tolerance, request, uninterrupted,
                                                                  saved_mid_run):
    mesh = request.getfixturevalue(layout)
    model, optimizer, scheduler = fresh(mesh)
    with torch.no_grad():   # other weights than the saved ones: the load must replace them all
        for p in model.parameters():
            p.copy_(dtorch.zeros(*p.shape, device_mesh=mesh, placements=p.placements))
    state = {"model": model, "optim": optimizer, "sched": scheduler, "step": 0, "losses": [],
             "rng": torch.get_rng_state()}
    load(state, saved_mid_run)
    assert state["model"] is model and state["sched"] is scheduler and state["step"] == SAVED_AT
    assert scheduler.last_epoch == SAVED_AT and optimizer.param_groups[0]["lr"] == scheduler.get_last_lr()[0]
    exp_avg = optimizer.state[model.up.weight]["exp_avg"]
    assert exp_avg.device_mesh == mesh and exp_avg.placements == model.up.weight.placements
    losses = state["losses"] + train(model, optimizer, scheduler, range(SAVED_AT, STEPS), mesh)
    expected_losses, expected_params = uninterrupted
    for step, (got, want) in enumerate(zip(losses, expected_losses)):
        assert abs(got - want) <= tolerance * abs(want), (step, got, want)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.to_torch(), expected_params[name], rtol=tolerance, atol=tolerance, msg=name)


def test_a_fresh_optimizers_state_dict_is_a_load_target_without_init_state(dp2xtp2, saved_mid_run):
    """The DCP habit: load into opt.state_dict(), then opt.load_state_dict(...). The buffers are
    made by the load, on each parameter's layout; nothing is allocated before."""
    model, optimizer, scheduler = fresh(dp2xtp2)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "sched": scheduler.state_dict(),
             "step": 0, "losses": [], "rng": None}
    load(state, saved_mid_run)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    scheduler.load_state_dict(state["sched"])
    saved = to_torch_state_dict(saved_mid_run)
    for index, p in enumerate(model.parameters()):
        got = optimizer.state[p]
        assert got["step"] == SAVED_AT and got["exp_avg_sq"].placements == p.placements
        assert torch.equal(got["exp_avg"].to_torch(), saved["optim"]["state"][index]["exp_avg"])


def test_torchs_get_state_dict_and_set_state_dict_on_dtorch_objects(dp2, dp2xtp2, tmp_path):
    """torch's own AppState pattern: the optimizer keyed by parameter name, as FSDP2 saves it."""
    model, optimizer, scheduler = fresh(dp2)
    train(model, optimizer, scheduler, range(2), dp2)

    class AppState:
        def __init__(self, model, optimizer):
            self.model, self.optimizer = model, optimizer

        def state_dict(self):
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            return {"model": model_state, "optim": optim_state}

        def load_state_dict(self, state):
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])

    save({"app": AppState(model, optimizer)}, tmp_path / "ck")
    saved = to_torch_state_dict(tmp_path / "ck")["app"]["optim"]
    assert set(saved["state"]) == {"up.weight", "up.bias", "down.weight", "down.bias"}
    assert saved["param_groups"][0]["params"] == ["up.weight", "up.bias", "down.weight", "down.bias"]
    resumed, resumed_optimizer, _ = fresh(dp2xtp2)
    load({"app": AppState(resumed, resumed_optimizer)}, tmp_path / "ck")
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p.to_torch(), q.to_torch()), name
        assert torch.equal(optimizer.state[p]["exp_avg"].to_torch(), resumed_optimizer.state[q]["exp_avg"].to_torch())


def test_state_dict_options_apply_or_are_refused_by_name(dp2, tmp_path):
    from dtorch.checkpoint import StateDictOptions
    model, optimizer, scheduler = fresh(dp2)
    model.up.bias.requires_grad_(False)
    save({"model": model}, tmp_path / "ck", options=StateDictOptions(ignore_frozen_params=True))
    saved = to_torch_state_dict(tmp_path / "ck")
    assert set(saved["model"]) == {"up.weight", "down.weight", "down.bias"}
    whole = load({"model": model.state_dict()}, tmp_path / "ck", options=StateDictOptions(
        full_state_dict=True, cpu_offload=True, strict=False))
    assert isinstance(whole["model"]["up.weight"], torch.Tensor)
    assert torch.equal(whole["model"]["up.weight"], saved["model"]["up.weight"])
    gathered = load({"model": {"up.weight": model.up.weight}}, tmp_path / "ck", strict=False,
                    options=StateDictOptions(full_state_dict=True, strict=False))["model"]["up.weight"]
    assert gathered.placements == (Replicate(),)
    for options, words in [(StateDictOptions(flatten_optimizer_state_dict=True), "flatten_optimizer_state_dict"),
                           (StateDictOptions(cpu_offload=True), "nothing to move"),
                           (StateDictOptions(full_state_dict=True, broadcast_from_rank0=True), "set_state_dict")]:
        with pytest.raises(ValueError, match=words):
            load({"model": model}, tmp_path / "ck", options=options)
    with pytest.raises(ValueError, match="disagree"):
        load({"model": model}, tmp_path / "ck", strict=True, options=StateDictOptions(strict=False))


def test_a_checkpoint_torch_dcp_wrote_loads_into_fresh_dtorch_objects(dp2xtp2, tmp_path):
    import torch.distributed.checkpoint as dcp
    torch.manual_seed(0)
    reference = TorchMLP()
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=2e-2, weight_decay=0.1)
    torch_scheduler = torch.optim.lr_scheduler.LambdaLR(torch_optimizer, warmup_then_decay)
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        F.mse_loss(reference(torch.randn(8, 8, generator=g)), torch.randn(8, 4, generator=g)).backward()
        torch_optimizer.step()
        torch_optimizer.zero_grad()
        torch_scheduler.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": reference.state_dict(), "optim": torch_optimizer.state_dict(),
                  "sched": torch_scheduler.state_dict(), "step": 2}, checkpoint_id=str(tmp_path / "dcp"))
    model, optimizer, scheduler = fresh(dp2xtp2)
    state = {"model": model, "optim": optimizer, "sched": scheduler, "step": 0}
    load(state, tmp_path / "dcp")
    assert state["step"] == 2 and scheduler.last_epoch == 2
    assert optimizer.param_groups[0]["lr"] == torch_optimizer.param_groups[0]["lr"]
    torch_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        expected = torch_params[name]
        assert torch.equal(p.to_torch(), expected.detach()), name
        assert optimizer.state[p]["step"] == 2
        assert torch.equal(optimizer.state[p]["exp_avg"].to_torch(), torch_optimizer.state[expected]["exp_avg"])
        assert optimizer.state[p]["exp_avg"].placements == p.placements


TWO_RANK_DCP_SAVE = """
import socket, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

def run(rank, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)
    dcp.save({"model": {"w": distribute_tensor(full, mesh, [Shard(0)]),
                        "v": distribute_tensor(full.t().contiguous(), mesh, [Shard(1)])}, "step": 3},
             checkpoint_id=out)
    dist.destroy_process_group()

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
mp.start_processes(run, args=(port, sys.argv[1]), nprocs=2, start_method="fork")
"""


def test_a_two_rank_torch_dcp_checkpoint_of_sharded_dtensors_loads_onto_another_layout(dp2xtp2, tmp_path):
    """torch's DTensors saved by two gloo ranks (a chunk per rank, as an FSDP2 job writes them),
    assembled from both ranks' records and loaded onto a 2-D layout, exactly."""
    done = run_script(TWO_RANK_DCP_SAVE.replace("sys.argv[1]", repr(str(tmp_path / "dcp"))), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    state = {"model": {"w": dtorch.zeros(7, 5, device_mesh=dp2xtp2, placements=[Shard(1), Shard(0)]),
                       "v": dtorch.zeros(5, 7, dtype=torch.float64, device_mesh=dp2xtp2)}, "step": 0}
    load(state, tmp_path / "dcp")
    full = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)
    assert torch.equal(state["model"]["w"].to_torch(), full) and state["model"]["w"].placements == (Shard(1), Shard(0))
    assert torch.equal(state["model"]["v"].to_torch(), full.t().double()) and state["step"] == 3


def test_torch_dcp_reads_a_checkpoint_dtorch_wrote(saved_mid_run):
    """In plain torch, no process group: dcp.load with DtorchStorageReader into torch objects, and
    the whole state rebuilt from the metadata alone (what dcp_to_torch_save does)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    from dtorch.checkpoint import DtorchStorageReader
    saved = to_torch_state_dict(saved_mid_run)
    model = TorchMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_decay)
    F.mse_loss(model(torch.zeros(1, 8)), torch.zeros(1, 4)).backward()
    optimizer.step()   # torch's optimizer state_dict names its buffers only after a step
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "sched": scheduler, "step": 0,
             "losses": [], "rng": torch.zeros(5056, dtype=torch.uint8)}
    dcp.load(state, storage_reader=DtorchStorageReader(saved_mid_run))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    assert state["step"] == SAVED_AT and scheduler.last_epoch == SAVED_AT and len(state["losses"]) == SAVED_AT
    assert torch.equal(state["rng"], saved["rng"])
    for index, (name, p) in enumerate(model.named_parameters()):
        assert torch.equal(p.detach(), saved["model"][name]), name
        assert torch.equal(optimizer.state[p]["exp_avg"], saved["optim"]["state"][index]["exp_avg"])
        assert float(optimizer.state[p]["step"]) == SAVED_AT
    whole: dict = {}
    _load_state_dict(whole, storage_reader=DtorchStorageReader(saved_mid_run), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    assert torch.equal(whole["model"]["up.weight"], saved["model"]["up.weight"])
    assert whole["sched"]["last_epoch"] == SAVED_AT and whole["step"] == SAVED_AT


def test_the_error_names_the_key_really_at_fault_and_what_to_call(dp2, saved_mid_run):
    model, optimizer, scheduler = fresh(dp2)
    copied = dict(optimizer.state_dict())   # a copy no longer knows its parameters
    with pytest.raises(CheckpointError) as refused:
        load({"model": model, "optim": copied, "sched": scheduler, "step": 0, "losses": [], "rng": None},
             saved_mid_run)
    message = str(refused.value)
    assert "'optim' is one dict here" in message and "'optim.state.0.exp_avg'" in message
    assert "load into the optimizer itself ({'optim': opt})" in message
    assert "missing from the checkpoint" not in message and "not expected" not in message
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint \(1\): 'extra'"):
        load({"model": model, "optim": optimizer, "sched": scheduler, "step": 0, "losses": [], "rng": None,
              "extra": 1}, saved_mid_run)
    other, other_optimizer, _ = fresh(dp2)
    two_groups = dtorch.optim.AdamW([{"params": [other.up.weight, other.up.bias]},
                                     {"params": [other.down.weight, other.down.bias]}])
    with pytest.raises(CheckpointError, match=r"1 parameter group\(s\) of \[4\] parameters, this one 2 of \[2, 2\]"):
        load({"optim": two_groups}, saved_mid_run, strict=False)
    assert not two_groups.state   # nothing was loaded, nothing left behind
