"""Training steps under dtorch.compile(step, backend="inductor") (issue 46, "Tests"): forward,
cross-entropy, backward, AdamW and an LR schedule, 20 steps on dp, fsdp, tp, pp and dp x tp.
Each layout trains the same torch MLP (with dropout) from the same weights and seed three times:
fused, eager dtorch, and single-process torch. Fused equals eager (float32 within 1e-5 relative;
dropout's masks bit for bit); eager equals torch, whose dropout is fed dtorch's masks (dtorch
draws its own numbers: docs/guide/compile.md). A failure inside a fused step names the op and
the user's line, and the session goes on.

Each fused run also reads torch's compile counters on every rank (runtime/worker/compile_counters.py):
where inductor could compile, it did: every rank compiled a forward run and, through
AOTAutograd, its backward (docs/design/compile.md, "Fusing on the workers")."""
from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
import torch.nn as tnn
import torch.nn.functional as F

import dtorch
from dtorch.errors import RemoteError
from dtorch.nn import ColwiseParallel, RowwiseParallel, fully_shard, parallelize_module
from dtorch.runtime.worker.compile_counters import COMPILE_COUNTERS
from dtorch.spec.placements import Replicate, Shard, init_device_mesh
from support import on_every_rank

pytestmark = pytest.mark.timeout(300)

RTOL = 1e-5
STEPS, SEED = 20, 17
BATCH, WIDTH, HIDDEN, CLASSES, P = 6, 8, 15, 4, 0.25   # 6 rows on 4 ranks and 15 features on 2: uneven
LAYOUTS = {   # name -> (mesh shape, mesh dim names)
    "dp4": ((4,), ["dp"]),
    "fsdp4": ((4,), ["fsdp"]),
    "tp2": ((2,), ["tp"]),
    "pp2": ((2,), ["pp"]),
    "dp2xtp2": ((2, 2), ["dp", "tp"]),
}


def _line_of(pattern: str) -> int:
    with open(__file__) as source:
        return next(i for i, line in enumerate(source, 1) if pattern in line and "_line_of" not in line)


class MLP(tnn.Module):
    """An ordinary torch model. It returns its logits and its dropped activations, whose zeros are
    dropout's mask; `hand_over` moves the activations to the next pipeline stage (pp2)."""

    def __init__(self):
        super().__init__()
        self.up, self.drop, self.down = tnn.Linear(WIDTH, HIDDEN), tnn.Dropout(P), tnn.Linear(HIDDEN, CLASSES)
        self.hand_over = None

    def forward(self, x):
        dropped = self.drop(F.gelu(self.up(x)))
        moved = dropped if self.hand_over is None else self.hand_over(dropped)
        return self.down(moved), dropped


def _initial() -> MLP:
    torch.manual_seed(0)
    return MLP()


def _batches() -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))
            for _ in range(STEPS)]


def _warmup_then_decay(step: int) -> float:
    return min(1.0, (step + 1) / 4) * 0.9 ** max(0, step - 3)


# --- each layout: the model placed, and where a batch goes ---------------------------------------------
def _placed(layout: str) -> tuple:
    """(the model on `layout`'s mesh, where the inputs go, where the labels go): as a user writes it."""
    shape, names = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = _initial()
    batch = (mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))
    if layout in ("dp4", "fsdp4"):
        dtorch.distribute_module(model, mesh)
        if layout == "fsdp4":
            fully_shard(model, "fsdp")
    elif layout in ("tp2", "dp2xtp2"):
        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()}, tp_dim="tp")
        if layout == "tp2":
            batch = (mesh, [Replicate()])
    else:   # pp2: up on the first stage, down on the last, the activations sent between them
        first, last = mesh.unbind("pp")
        dtorch.distribute_module(model, first, _down_on(last))
        model.hand_over = lambda h: h.redistribute(last, h.placements)
        return model, (first, [Replicate()]), (last, [Replicate()])
    return model, batch, batch


def _down_on(last):
    def partition(name, module, mesh):
        if name == "down":
            for key, param in list(module.named_parameters()):
                setattr(module, key, dtorch.nn.Parameter(dtorch.distribute_tensor(param.detach(), last, [Replicate()])))
    return partition


def _upload(value: torch.Tensor, where: tuple):
    mesh, placements = where
    return dtorch.distribute_tensor(value, mesh, placements)


# --- one training run ------------------------------------------------------------------------------
def _training_step(model, optimizer):
    def step(x, labels):
        logits, dropped = model(x)
        loss = F.cross_entropy(logits, labels)   # A BAD LABEL FAILS HERE
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss, dropped != 0
    return step


def _train_dtorch(layout: str, backend: str | None) -> dict:
    """STEPS steps of `layout`, eager (backend None) or compiled with `backend`."""
    return _train(*_placed(layout), backend, _batches())


def _train(model, inputs: tuple, labels: tuple, backend: str | None, batches: list) -> dict:
    """A fresh AdamW and schedule, dtorch.manual_seed(SEED), then a step per batch: every step's
    loss and dropout mask, the final parameters, and the compiled step (None when eager)."""
    optimizer = dtorch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_then_decay)
    step = _training_step(model, optimizer)
    compiled = None if backend is None else dtorch.compile(step, backend=backend)
    dtorch.manual_seed(SEED)
    results = []
    for x, y in batches:
        results.append((compiled or step)(_upload(x, inputs), _upload(y, labels)))
        schedule.step()
    return {"losses": [loss.to_torch() for loss, _ in results], "masks": [kept.to_torch() for _, kept in results],
            "params": {name: p.to_torch() for name, p in model.named_parameters()}, "compiled": compiled}


def _train_torch(masks: list) -> dict:
    """The same steps in single-process torch, its dropout keeping what dtorch's kept."""
    model = _initial()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_then_decay)
    losses = []
    for (x, y), kept in zip(_batches(), masks):
        hidden = F.gelu(model.up(x))
        loss = F.cross_entropy(model.down(torch.where(kept, hidden * (1.0 / (1.0 - P)), 0.0)), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        losses.append(loss.detach())
    return {"losses": losses, "params": {name: p.detach() for name, p in model.named_parameters()}}


def _assert_trained_alike(got: dict, want: dict, rtol: float, atol: float, what: str) -> None:
    for step, (loss, expected) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        torch.testing.assert_close(loss, expected, rtol=rtol, atol=atol, msg=f"{what}: the loss of step {step}")
    assert list(got["params"]) == list(want["params"])
    for name, param in got["params"].items():
        torch.testing.assert_close(param, want["params"][name], rtol=rtol, atol=atol, msg=f"{what}: {name}")


def _unfused(caught: list) -> list:
    return [str(w.message) for w in caught if "unfused" in str(w.message)]


# --- fused equals eager, and torch, on every layout -------------------------------------------------
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_fused_training_step_equals_eager_and_torch_over_20_steps(layout, session):
    eager = _train_dtorch(layout, None)
    before = _compiled_since()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = _train_dtorch(layout, "inductor")
    assert _unfused(caught) == []   # no run fell back to the replay
    _assert_inductor_compiled_what_it_could(_compiled_since(before)[:math.prod(LAYOUTS[layout][0])])
    assert fused["compiled"].captures == 2 and fused["compiled"].replays == STEPS - 2   # a training step's two
    for step, (got, want) in enumerate(zip(fused["masks"], eager["masks"], strict=True)):
        assert torch.equal(got, want), f"dropout's mask at step {step}"
    assert 0 < int(torch.stack(eager["masks"]).sum()) < STEPS * BATCH * HIDDEN   # some kept, some dropped
    _assert_trained_alike(fused, eager, RTOL, RTOL, f"{layout} fused against eager")
    _assert_trained_alike(eager, _train_torch(eager["masks"]), 1e-4, 1e-5, f"{layout} eager against torch")


# --- inductor compiled what it could --------------------------------------------------------------
def _compiled_since(before: torch.Tensor | None = None) -> torch.Tensor:
    """Each rank's COMPILE_COUNTERS (its torch compile counters), less `before`: a (4, 3) tensor.
    A layout's meshes hold the session's first ranks (init_device_mesh)."""
    now = on_every_rank(init_device_mesh("cpu", (4,)), "compile_counters", len(COMPILE_COUNTERS))
    return now if before is None else now - before


def _assert_inductor_compiled_what_it_could(compiled: torch.Tensor) -> None:
    """Per rank of a fused training run: a forward run and its backward (two inductor graphs, one
    more than AOTAutograd's count of graphs)."""
    for rank, counts in enumerate(compiled.tolist()):
        counted = dict(zip(COMPILE_COUNTERS, counts))
        assert counted["inductor_graphs"] >= 2, (rank, counted)
        assert counted["inductor_graphs"] > counted["aot_autograd_graphs"], (rank, counted)


def test_the_compile_counters_see_a_fused_chain_and_not_a_replay(session):
    """The counters the training tests read can tell: a fused inference chain on ranks 0 and 1
    compiles there and not on ranks 2 and 3; the same chain replayed compiles nothing."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=["dp"])
    x = dtorch.distribute_tensor(torch.randn(10, 6), mesh, [Shard(0)])
    for backend, ranks_compiling in (("replay", 0), ("inductor", 2)):
        before = _compiled_since()
        chain = dtorch.compile(lambda x: ((x * 3.0).sin() + 1.0).exp() - x, backend=backend)
        for _ in range(2):
            chain(x).to_torch()
        compiled = _compiled_since(before)[:, COMPILE_COUNTERS.index("inductor_graphs")]
        assert compiled.tolist() == [1] * ranks_compiling + [0] * (4 - ranks_compiling), backend


# --- a failure inside a fused step -----------------------------------------------------------------
def test_a_failure_inside_a_fused_training_step_names_the_op_and_the_line(session):
    """A label out of range on the 4th call (a replay): the read names cross_entropy and the
    line inside the step. As in eager, the step poisons the parameters (docs/guide/training.md,
    "Optimizers"): reading one raises, never a wrong value; reloading the weights goes on, and
    the next steps fused equal eager's from the same weights."""
    model, inputs, labels = _placed("dp4")
    optimizer = dtorch.optim.AdamW(model.parameters(), lr=1e-2)
    step = dtorch.compile(_training_step(model, optimizer), backend="inductor")
    batches = _batches()
    for x, y in batches[:3]:   # two captures, then a replay
        step(_upload(x, inputs), _upload(y, labels))[0].to_torch()
    saved = {name: p.to_torch() for name, p in model.state_dict().items()}
    x, y = batches[3]
    bad = y.clone()
    bad[-1] = CLASSES + 3   # out of range
    with pytest.raises(RemoteError) as raised:
        step(_upload(x, inputs), _upload(bad, labels))[0].to_torch()   # THE FAILING CALL
    message = str(raised.value)
    assert "cross_entropy failed" in message, message
    assert re.search(rf"test_fused_training.py:{_line_of('A BAD LABEL FAILS HERE')} \(replayed, in the compiled "
                     rf"call at \S*test_fused_training.py:{_line_of('THE FAILING CALL')}\)", message), message
    with pytest.raises(RemoteError, match="cross_entropy failed"):
        model.up.weight.to_torch()
    model.load_state_dict(saved)
    resumed = _train(model, inputs, labels, "inductor", batches[4:8])
    expected, _, _ = _placed("dp4")
    expected.load_state_dict(saved)
    _assert_trained_alike(resumed, _train(expected, inputs, labels, None, batches[4:8]), RTOL, RTOL, "resumed")
