"""dtorch.optim and dtorch.nn.utils clipping against torch.optim and torch.nn.utils on the same full
tensors: the main options of SGD, Adam, AdamW, RMSprop, Adagrad, Adadelta, Adamax, NAdam and RAdam
over several steps on meshes (1,), (2,), (4,), (2,2) and placements R, S(0), S(1) with uneven
shapes; the updates are elementwise, so parameters and state must be bit-equal (within rounding
for torch's fused kernels). Also argument checks, lr schedulers, state_dict round trips across
layouts and from torch, init_state, a compiled step, zero_grad, the number of commands per step,
and a worker failure in a step."""
from __future__ import annotations

import gc

import pytest
import torch

import dtorch
from dtorch import Replicate as R, Shard as S
from dtorch.spec.placements import DeviceMesh, init_device_mesh
from dtorch.errors import DependencyError, RemoteError

pytestmark = pytest.mark.timeout(300)

SHAPES = [(7, 5), (5, 3), (11,)]   # uneven over 2 and 4 ranks on purpose


@pytest.fixture(scope="module")
def mesh2(session):
    return init_device_mesh("cpu", (2,), mesh_dim_names=["dp"])


@pytest.fixture(params=["mesh1", "mesh2", "mesh4", "mesh22"])
def any_mesh(request):
    return request.getfixturevalue(request.param)


def layouts(mesh) -> list:
    """One placement list per SHAPES entry: shards over both dims and Replicate."""
    if mesh.ndim == 2:
        return [[S(0), S(1)], [R(), S(0)], [S(0), R()]]
    return [[S(0)], [S(1)], [R()]] if mesh.size() > 1 else [[S(0)], [R()], [S(0)]]


def make_pair(mesh, placements, seed: int = 0):
    """dtorch Parameters and torch leaf tensors holding the same values. (Uploads here are always
    from tensors that torch never steps: dtorch.tensor sends the tensor's own memory when the
    batch leaves, so a torch step right after the call could change what a worker receives.)"""
    g = torch.Generator().manual_seed(seed)
    fulls = [torch.randn(shape, generator=g) for shape in SHAPES]
    ours = [dtorch.nn.Parameter(dtorch.tensor(t, device_mesh=mesh, placements=p)) for t, p in zip(fulls, placements)]
    theirs = [t.clone().requires_grad_() for t in fulls]
    return ours, theirs


def set_grads(ours, theirs, step: int, skip: int | None = None) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for i, (p, t) in enumerate(zip(ours, theirs)):
        grad = torch.randn(t.shape, generator=g)
        if i == skip:
            p.grad, t.grad = None, None
            continue
        p.grad = dtorch.tensor(grad, device_mesh=p.device_mesh, placements=p.placements)
        t.grad = grad.clone()


def assert_same_state(opt, ours, topt, theirs, exact: bool = True) -> None:
    """Bit-equal; or, for torch's fused kernels (`exact=False`), within rounding: their vector body
    and their scalar tail round differently, and a shard puts other elements in the tail."""
    same = torch.equal if exact else lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    for p, t in zip(ours, theirs):
        mine = p.to_torch()
        assert same(mine, t.detach()), f"parameter differs from torch's by {(mine - t.detach()).abs().max()}"
        mine, torchs = opt.state[p], topt.state[t]
        assert set(mine) == set(torchs), (set(mine), set(torchs))
        for name, value in torchs.items():
            if name == "step":
                assert mine[name] == int(value.item())
            elif value is None:
                assert mine[name] is None
            else:
                assert mine[name].placements == expected_placements(name, p) and mine[name].device_mesh == p.device_mesh
                assert mine[name].dtype == value.dtype and same(mine[name].to_torch(), value), name


def expected_placements(name: str, p) -> tuple:
    """A buffer is sharded like its parameter; NAdam's mu_product is one number, on every rank."""
    return (R(),) * p.device_mesh.ndim if name == "mu_product" else p.placements


CONFIGS = [
    ("SGD", {"lr": 0.1}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}),
    ("SGD", {"lr": 0.05, "momentum": 0.8, "nesterov": True, "weight_decay": 0.1, "maximize": True}),
    ("Adam", {"lr": 0.01}),
    ("Adam", {"lr": 0.02, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1, "amsgrad": True, "maximize": True}),
    ("AdamW", {"lr": 0.01}),
    ("AdamW", {"lr": 0.03, "weight_decay": 0.05, "amsgrad": True, "maximize": True}),
    # torch's other implementations, chosen as in torch (each element still gets torch's bits)
    ("SGD", {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01, "fused": True}),
    ("Adam", {"lr": 0.02, "weight_decay": 0.1, "amsgrad": True, "foreach": True}),
    ("AdamW", {"lr": 0.03, "weight_decay": 0.05, "fused": True}),
    ("AdamW", {"lr": 0.03, "amsgrad": True, "maximize": True, "fused": True}),
    # the rest of torch.optim's common optimizers
    ("RMSprop", {"lr": 0.01}),
    ("RMSprop", {"lr": 0.02, "alpha": 0.9, "eps": 1e-6, "weight_decay": 0.1, "momentum": 0.5, "centered": True,
                 "maximize": True}),
    ("RMSprop", {"lr": 0.02, "momentum": 0.9, "foreach": True}),
    ("Adagrad", {"lr": 0.1}),
    ("Adagrad", {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.05, "initial_accumulator_value": 0.3, "eps": 1e-8,
                 "maximize": True}),
    ("Adagrad", {"lr": 0.1, "initial_accumulator_value": 0.1, "fused": True}),
    ("Adadelta", {}),
    ("Adadelta", {"lr": 0.5, "rho": 0.8, "eps": 1e-5, "weight_decay": 0.1, "maximize": True, "foreach": True}),
    ("Adamax", {}),
    ("Adamax", {"lr": 0.01, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1, "maximize": True}),
    ("NAdam", {}),
    ("NAdam", {"lr": 0.01, "betas": (0.8, 0.95), "weight_decay": 0.1, "momentum_decay": 0.01,
               "decoupled_weight_decay": True, "maximize": True}),
    ("NAdam", {"lr": 0.01, "weight_decay": 0.1, "foreach": True}),
    # (RAdam's first steps take its unrectified branch; test_a_torch_state_dict_loads steps on to the other)
    ("RAdam", {}),
    ("RAdam", {"lr": 0.01, "betas": (0.8, 0.9), "weight_decay": 0.1, "decoupled_weight_decay": True,
               "maximize": True}),
    ("RAdam", {"lr": 0.01, "betas": (0.8, 0.9), "weight_decay": 0.1, "foreach": True}),
]


@pytest.mark.parametrize("name,options", CONFIGS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CONFIGS)])
def test_steps_equal_torch(any_mesh, name, options):
    ours, theirs = make_pair(any_mesh, layouts(any_mesh))
    opt = getattr(dtorch.optim, name)(ours, **options)
    topt = getattr(torch.optim, name)(theirs, **options)
    for step in range(3):
        set_grads(ours, theirs, step, skip=2 if step == 1 else None)   # no grad: skipped, as in torch
        opt.step()
        topt.step()
    assert_same_state(opt, ours, topt, theirs, exact=not options.get("fused"))


ALL_KINDS = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam"]


@pytest.mark.parametrize("name", ALL_KINDS)
def test_param_groups_and_commands_per_step(mesh2, mesh4, name):
    """One OptimizerStep per param group and mesh; a group spanning two meshes (pipeline stages:
    here mesh2 and the ranks 2, 3) sends one per mesh."""
    stage2 = DeviceMesh("cpu", [2, 3])
    ours, theirs = make_pair(mesh2, [[S(0)], [R()], [S(0)]])
    extra = dtorch.nn.Parameter(dtorch.tensor(theirs[2].detach().clone(), device_mesh=stage2, placements=[S(0)]))
    extra_t = theirs[2].detach().clone().requires_grad_()
    def groups(a, b, c, d):
        return [{"params": [a, b]}, {"params": [c, d], "lr": 0.5}]
    opt = getattr(dtorch.optim, name)(groups(ours[0], ours[1], ours[2], extra), lr=0.1)
    topt = getattr(torch.optim, name)(groups(theirs[0], theirs[1], theirs[2], extra_t), lr=0.1)
    for step in range(2):
        set_grads(ours + [extra], theirs + [extra_t], step)
        dtorch.synchronize()
        before = dtorch.stats()["commands_sent"]
        opt.step()
        dtorch.synchronize()
        assert dtorch.stats()["commands_sent"] - before == 3 + 1   # 3 (group, mesh) pairs, then the Sync
        topt.step()
    assert_same_state(opt, ours + [extra], topt, theirs + [extra_t])
    assert opt.param_groups[1]["lr"] == 0.5


@pytest.mark.parametrize("name,options", [("SGD", {"lr": 0.1, "momentum": 0.9}), ("RMSprop", {"lr": 0.1}),
                                          ("NAdam", {"lr": 0.1}), ("Adagrad", {"lr": 0.1})])
@pytest.mark.parametrize("scheduler,arguments", [
    ("StepLR", {"step_size": 2, "gamma": 0.5}),
    ("LambdaLR", {"lr_lambda": lambda epoch: 1.0 / (epoch + 1)}),
    ("CosineAnnealingLR", {"T_max": 3}),
])
def test_lr_schedulers_drive_lr(mesh4, scheduler, arguments, name, options):
    ours, theirs = make_pair(mesh4, layouts(mesh4))
    opt, topt = getattr(dtorch.optim, name)(ours, **options), getattr(torch.optim, name)(theirs, **options)
    schedule = getattr(torch.optim.lr_scheduler, scheduler)
    ours_s, theirs_s = schedule(opt, **arguments), schedule(topt, **arguments)
    for step in range(5):
        set_grads(ours, theirs, step)
        opt.step()
        topt.step()
        ours_s.step()
        theirs_s.step()
        assert opt.param_groups[0]["lr"] == topt.param_groups[0]["lr"]
    assert_same_state(opt, ours, topt, theirs)


EVERY_BUFFER = [   # options under which each kind keeps all of its buffers
    ("Adam", {"lr": 0.05, "amsgrad": True}),
    ("RMSprop", {"lr": 0.05, "momentum": 0.9, "centered": True}),
    ("Adagrad", {"lr": 0.05, "initial_accumulator_value": 0.2}),
    ("Adadelta", {"lr": 0.5}),
    ("Adamax", {"lr": 0.05}),
    ("NAdam", {"lr": 0.05}),
    ("RAdam", {"lr": 0.05}),
]


@pytest.mark.parametrize("name,options", EVERY_BUFFER, ids=[name for name, _ in EVERY_BUFFER])
def test_state_dict_layout_and_round_trip_onto_another_layout(mesh2, mesh22, name, options):
    """Saved on mesh (2,), loaded into an optimizer whose parameters live on (2,2) with other
    placements: training goes on exactly as torch's does."""
    ours, theirs = make_pair(mesh2, [[S(0)], [S(1)], [R()]])
    opt, topt = getattr(dtorch.optim, name)(ours, **options), getattr(torch.optim, name)(theirs, **options)
    for step in range(2):
        set_grads(ours, theirs, step)
        opt.step()
        topt.step()
    saved, torch_saved = opt.state_dict(), topt.state_dict()
    assert saved["param_groups"] == torch_saved["param_groups"]
    assert list(saved["state"]) == list(torch_saved["state"]) == [0, 1, 2]
    assert list(saved["state"][0]) == list(torch_saved["state"][0])
    assert torch.equal(saved["state"][0]["step"], torch_saved["state"][0]["step"])

    moved = [dtorch.nn.Parameter(dtorch.tensor(t.detach().clone(), device_mesh=mesh22, placements=p))
             for t, p in zip(theirs, layouts(mesh22))]
    reloaded = getattr(dtorch.optim, name)(moved, lr=1.0)
    reloaded.load_state_dict(saved)
    assert reloaded.param_groups[0]["lr"] == options["lr"]
    buffers = [key for key in saved["state"][0] if key != "step"]
    assert all(reloaded.state[moved[0]][key].placements == expected_placements(key, moved[0]) for key in buffers)
    for step in range(2, 4):
        set_grads(moved, theirs, step)
        reloaded.step()
        topt.step()
    assert_same_state(reloaded, moved, topt, theirs)
    # the saved optimizer's buffers were copied, never updated in place by the new one
    assert opt.state[ours[0]]["step"] == 2
    assert all(torch.equal(opt.state[ours[0]][key].to_torch(), saved["state"][0][key].to_torch()) for key in buffers)


@pytest.mark.parametrize("name,options,steps", [
    ("SGD", {"lr": 0.1, "momentum": 0.9}, 1),
    ("NAdam", {"lr": 0.05}, 2),   # mu_product: a 0-d tensor, uploaded Replicate
    ("Adagrad", {"lr": 0.05, "initial_accumulator_value": 0.5}, 1),
    ("RMSprop", {"lr": 0.05, "momentum": 0.5, "centered": True}, 1),
    # torch steps 6 times: from step 7 RAdam takes its rectified branch (rho_t > 5 with beta2 0.8)
    ("RAdam", {"lr": 0.05, "betas": (0.9, 0.8)}, 6),
])
def test_a_torch_state_dict_loads(mesh4, name, options, steps):
    ours, theirs = make_pair(mesh4, layouts(mesh4))
    topt = getattr(torch.optim, name)(theirs, **options)
    for step in range(steps):
        set_grads(ours, theirs, step)
        topt.step()
    ours = [dtorch.nn.Parameter(dtorch.tensor(t.detach().clone(), device_mesh=mesh4, placements=p.placements))
            for t, p in zip(theirs, ours)]
    opt = getattr(dtorch.optim, name)(ours, lr=0.3)
    opt.load_state_dict(topt.state_dict())
    for step in range(steps, steps + 2):
        set_grads(ours, theirs, step)
        opt.step()
        topt.step()
    assert_same_state(opt, ours, topt, theirs)


def test_zero_grad_both_ways(mesh22):
    ours, theirs = make_pair(mesh22, layouts(mesh22))
    opt = dtorch.optim.SGD(ours, lr=0.1)
    set_grads(ours, theirs, 0)
    grads = [p.grad for p in ours]
    gc.collect()       # earlier tests' garbage, freed in the window, would add its own Free to the count
    dtorch.synchronize()
    gc.disable()
    try:
        before = dtorch.stats()["commands_sent"]
        opt.zero_grad(set_to_none=False)   # in place on the workers: the same symbols read zeros
        dtorch.synchronize()
        assert dtorch.stats()["commands_sent"] - before == 1 + 1
        assert all(p.grad is g for p, g in zip(ours, grads))
        assert all(torch.equal(g.to_torch(), torch.zeros(g.shape)) for g in grads)
        set_grads(ours, theirs, 1)
        dtorch.synchronize()
        before = dtorch.stats()["commands_sent"]
        opt.zero_grad()   # one SetGrads for every parameter
        dtorch.synchronize()
        assert dtorch.stats()["commands_sent"] - before == 1 + 1 + 1   # and one Free of the dropped grads
    finally:
        gc.enable()
    assert all(p.grad is None for p in ours)
    opt.step()   # no grads: nothing to do
    assert all(torch.equal(p.to_torch(), t.detach()) for p, t in zip(ours, theirs))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
def test_clip_grad_norm_equals_torch(mesh2, mesh22, norm_type):
    """The global norm over every shard and parameter, a Replicate grad counted once, across two
    meshes; grads scaled in place."""
    ours, theirs = make_pair(mesh22, layouts(mesh22))
    more, more_t = make_pair(mesh2, [[S(1)], [R()], [S(0)]], seed=1)
    ours, theirs = ours + more, theirs + more_t
    set_grads(ours, theirs, 0)
    grads = [p.grad for p in ours]
    total = dtorch.nn.utils.clip_grad_norm_(ours, 1.5, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.5, norm_type=norm_type)
    assert total.placements == (R(), R()) and total.shape == ()
    torch.testing.assert_close(total.to_torch(), expected, rtol=1e-6, atol=0)
    for g, t in zip(grads, theirs):
        torch.testing.assert_close(g.to_torch(), t.grad, rtol=1e-6, atol=1e-7)
    assert all(p.grad is g for p, g in zip(ours, grads))


def test_torchs_own_clip_grad_spellings_take_dtensors(mesh2, mesh22):
    """torch.nn.utils.clip_grad_norm_(model.parameters(), ...) as training loops write it (a
    generator, a keyword, the clip_grad module's name): DTensors go to dtorch's, torch tensors to
    torch's own, unchanged. Before, torch's C++ grouping helper raised "incompatible function
    arguments"."""
    from torch.nn.utils import clip_grad
    ours, theirs = make_pair(mesh22, layouts(mesh22))
    set_grads(ours, theirs, 0)
    total = torch.nn.utils.clip_grad_norm_((p for p in ours), 0.5)
    expected = torch.nn.utils.clip_grad_norm_((p for p in theirs), 0.5)
    assert isinstance(total, dtorch.DTensor) and type(expected) is torch.Tensor
    torch.testing.assert_close(total.to_torch(), expected, rtol=1e-6, atol=0)
    for p, t in zip(ours, theirs):
        torch.testing.assert_close(p.grad.to_torch(), t.grad, rtol=1e-6, atol=1e-7)
    clip_grad.clip_grad_value_(parameters=ours, clip_value=0.01)
    torch.nn.utils.clip_grad_value_(theirs, 0.01)
    for p, t in zip(ours, theirs):
        torch.testing.assert_close(p.grad.to_torch(), t.grad)
    norm = torch.nn.utils.get_total_norm([p.grad for p in ours], 3.0)
    torch.testing.assert_close(norm.to_torch(), torch.nn.utils.get_total_norm([t.grad for t in theirs], 3.0),
                               rtol=1e-6, atol=0)


def test_clip_grad_norm_commands_and_no_clip(mesh4, monkeypatch):
    ours, theirs = make_pair(mesh4, layouts(mesh4))
    set_grads(ours, theirs, 0)
    gc.collect()       # earlier tests' garbage, freed now, would add its own Free to the count
    dtorch.synchronize()
    controller = dtorch.runtime.controller.session.controller()
    frees, free_released = [], controller._free_released
    monkeypatch.setattr(controller, "_free_released", lambda: (frees.append(1), free_released())[1])
    gc.disable()
    try:
        before = dtorch.stats()["commands_sent"]
        total = dtorch.nn.utils.clip_grad_norm_(ours, 1e6)   # far above the norm: grads unchanged
        dtorch.synchronize()
    finally:
        gc.enable()
    # GradNorm, its all-reduce, pow, add, rdiv, clamp, UpdateGrads, the Sync: a constant, whatever
    # the number of parameters. Not counted: the Frees of the temporaries, one before each command
    # issued while some were released; how many varies with timing (1 on a quiet machine, 2 or 3
    # under load: CI once saw 11 commands in all).
    assert dtorch.stats()["commands_sent"] - before - len(frees) == 8
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1e6)
    torch.testing.assert_close(total.to_torch(), expected, rtol=1e-6, atol=0)
    assert all(torch.equal(p.grad.to_torch(), t.grad) for p, t in zip(ours, theirs))


def test_clip_grad_norm_error_if_nonfinite(mesh2):
    p = dtorch.nn.Parameter(dtorch.zeros(4, device_mesh=mesh2, placements=[S(0)]))
    p.grad = dtorch.tensor(torch.tensor([1.0, float("inf"), 0.0, 2.0]), device_mesh=mesh2, placements=[S(0)])
    with pytest.raises(RuntimeError, match="non-finite"):
        dtorch.nn.utils.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    assert float(dtorch.nn.utils.clip_grad_norm_([], 1.0)) == 0.0


def test_clip_grad_value_equals_torch(mesh22):
    ours, theirs = make_pair(mesh22, layouts(mesh22))
    set_grads(ours, theirs, 0)
    dtorch.nn.utils.clip_grad_value_(ours, 0.5)
    torch.nn.utils.clip_grad_value_(theirs, 0.5)
    assert all(torch.equal(p.grad.to_torch(), t.grad) for p, t in zip(ours, theirs))


def test_a_failed_step_is_raised_at_the_next_read_and_the_session_goes_on(mesh2):
    # a state buffer of the wrong shape (set by hand after the first step): torch's Adam fails on the workers
    p = dtorch.nn.Parameter(dtorch.ones(6, 3, device_mesh=mesh2, placements=[S(0)]))
    p.grad = dtorch.ones(6, 3, device_mesh=mesh2, placements=[S(0)])
    opt = dtorch.optim.Adam([p], lr=0.1)
    opt.step()
    opt.state[p]["exp_avg"] = dtorch.zeros(6, 5, device_mesh=mesh2, placements=[S(0)])
    opt.step()   # returns at once
    with pytest.raises(RemoteError, match="Adam failed") as failure:
        p.to_torch()
    assert "test_optim.py" in str(failure.value) and not isinstance(failure.value, DependencyError)
    with pytest.raises(RemoteError, match="Adam failed"):
        opt.state[p]["exp_avg"].to_torch()
    opt.step()   # on a poisoned parameter: the next read names the first failure
    with pytest.raises(DependencyError, match="Adam failed"):
        p.to_torch()
    x = dtorch.ones(4, device_mesh=mesh2, placements=[S(0)])
    assert torch.equal((x + 1).to_torch(), torch.full((4,), 2.0))   # the session is usable


def test_a_read_issued_before_a_step_sees_the_values_before_it(mesh2):
    """The step writes in place while the read's bytes may still be leaving the worker (zmq
    sends them zero-copy, on its own thread): the read must be a snapshot."""
    p = dtorch.nn.Parameter(dtorch.zeros(512, 512, device_mesh=mesh2, placements=[S(0)]))
    p.grad = dtorch.ones(512, 512, device_mesh=mesh2, placements=[S(0)])
    opt = dtorch.optim.SGD([p], lr=1.0)
    before = p.fetch()
    opt.step()
    after = p.fetch()
    assert torch.equal(before.result(), torch.zeros(512, 512))
    assert torch.equal(after.result(), torch.full((512, 512), -1.0))


def test_bad_arguments_fail_at_the_call(mesh2):
    p = dtorch.nn.Parameter(dtorch.ones(4, device_mesh=mesh2, placements=[S(0)]))
    with pytest.raises(TypeError, match="optimizes DTensors"):
        dtorch.optim.SGD([torch.ones(2, requires_grad=True)])
    with pytest.raises(ValueError, match="Invalid learning rate"):
        dtorch.optim.Adam([p], lr=-1)
    with pytest.raises(ValueError, match="Nesterov"):
        dtorch.optim.SGD([p], nesterov=True)
    with pytest.raises(ValueError, match="capturable=True is not supported"):
        dtorch.optim.AdamW([p], capturable=True)
    with pytest.raises(RuntimeError, match="cannot be `True` together"):
        dtorch.optim.AdamW([p], fused=True, foreach=True)
    whole = dtorch.nn.Parameter(dtorch.ones(4, dtype=torch.int64, device_mesh=mesh2, placements=[S(0)]),
                                requires_grad=False)
    with pytest.raises(RuntimeError, match="floating point Tensors, got a torch.int64 parameter of shape"):
        dtorch.optim.SGD([p, whole], fused=True)
    with pytest.raises(ValueError, match="more than one parameter group"):
        dtorch.optim.SGD([{"params": [p]}, {"params": [p]}])
    with pytest.raises(RuntimeError, match="different size"):   # refused at the assignment, as in torch
        p.grad = dtorch.ones(5, device_mesh=mesh2, placements=[S(0)])
    with pytest.raises(RuntimeError, match="different type"):
        p.grad = dtorch.ones(4, dtype=torch.float64, device_mesh=mesh2, placements=[S(0)])


BAD_ARGUMENTS = [
    ("RMSprop", {"alpha": -0.5}), ("RMSprop", {"momentum": -1}), ("RMSprop", {"lr": torch.ones(2)}),
    ("Adagrad", {"lr_decay": -1}), ("Adagrad", {"initial_accumulator_value": -1}), ("Adagrad", {"eps": -1}),
    ("Adadelta", {"rho": 1.5}), ("Adadelta", {"weight_decay": -1}),
    ("Adamax", {"betas": (0.9, 1.0)}), ("Adamax", {"lr": -1, "eps": -1}),
    ("NAdam", {"momentum_decay": -1}), ("NAdam", {"betas": (-0.1, 0.9)}),
    ("RAdam", {"eps": -1, "weight_decay": -1}), ("RAdam", {"fused": True}), ("Adamax", {"nesterov": True}),
]


@pytest.mark.parametrize("name,options", BAD_ARGUMENTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_ARGUMENTS)])
def test_bad_arguments_fail_as_in_torch(mesh2, name, options):
    """The same exception, with torch's words: the first bad argument torch checks is the one named."""
    p = dtorch.nn.Parameter(dtorch.ones(4, device_mesh=mesh2, placements=[S(0)]))
    with pytest.raises((ValueError, TypeError)) as theirs:
        getattr(torch.optim, name)([torch.ones(4, requires_grad=True)], **options)
    with pytest.raises(type(theirs.value)) as ours:
        getattr(dtorch.optim, name)([p], **options)
    assert str(ours.value).replace("dtorch.optim.", "").replace("Optimizer.", "") == \
        str(theirs.value).replace("torch.optim.", "").replace("Optimizer.", "")


@pytest.mark.parametrize("name,flag", [("RMSprop", "capturable"), ("NAdam", "differentiable"),
                                       ("Adagrad", "differentiable"), ("RAdam", "capturable")])
def test_unsupported_options_are_refused(mesh2, name, flag):
    p = dtorch.nn.Parameter(dtorch.ones(4, device_mesh=mesh2, placements=[S(0)]))
    with pytest.raises(ValueError, match=f"dtorch.optim.{name}: {flag}=True is not supported"):
        getattr(dtorch.optim, name)([p], **{flag: True})


def test_adagrad_makes_its_state_at_construction_as_torch(mesh22):
    ours, theirs = make_pair(mesh22, layouts(mesh22))
    opt = dtorch.optim.Adagrad(ours, initial_accumulator_value=0.25)
    topt = torch.optim.Adagrad(theirs, initial_accumulator_value=0.25)
    assert_same_state(opt, ours, topt, theirs)   # before any step: step 0, sum at 0.25
    assert list(opt.state_dict()["state"][0]) == list(topt.state_dict()["state"][0]) == ["step", "sum"]


@pytest.mark.parametrize("name,options", EVERY_BUFFER, ids=[name for name, _ in EVERY_BUFFER])
def test_init_state_is_torch_first_state(mesh4, name, options):
    """init_state's buffers hold what torch's first step starts from (NAdam's mu_product 1, Adagrad's
    sum initial_accumulator_value): a step from them equals torch's first step."""
    ours, theirs = make_pair(mesh4, layouts(mesh4))
    opt = dtorch.optim.init_state(getattr(dtorch.optim, name)(ours, **options))
    topt = getattr(torch.optim, name)(theirs, **options)
    assert all(opt.state[p]["step"] == 0 for p in ours)
    set_grads(ours, theirs, 0)
    opt.step()
    topt.step()
    assert_same_state(opt, ours, topt, theirs)


@pytest.mark.parametrize("name", ["NAdam", "Adagrad", "RMSprop"])
def test_a_compiled_step_equals_torch(mesh4, name):
    """dtorch.compile replays the step with its step counts moved on; NAdam's mu_product moves on
    with each replay on the workers."""
    ours, theirs = make_pair(mesh4, layouts(mesh4))
    opt, topt = getattr(dtorch.optim, name)(ours, lr=0.05), getattr(torch.optim, name)(theirs, lr=0.05)

    def train(optimizer, params, weights):
        optimizer.zero_grad()
        loss = sum(((p * p) * w).sum() for p, w in zip(params, weights))
        loss.backward()
        optimizer.step()
        return loss
    compiled = dtorch.compile(lambda *weights: train(opt, ours, weights))
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        weights = [torch.randn(t.shape, generator=g) for t in theirs]
        loss = compiled(*[dtorch.tensor(w, device_mesh=mesh4, placements=p.placements) for w, p in zip(weights, ours)])
        torch.testing.assert_close(loss.to_torch(), train(topt, theirs, weights))
    assert_same_state(opt, ours, topt, theirs)
    assert compiled.captures <= 2   # a fresh optimizer's first call makes its state: the second captures again


def test_a_grad_on_other_placements_is_moved_first(mesh4):
    ours, theirs = make_pair(mesh4, layouts(mesh4))
    set_grads(ours, theirs, 0)
    ours[0].grad = ours[0].grad.redistribute(placements=[R()])
    opt, topt = dtorch.optim.Adam(ours), torch.optim.Adam(theirs)
    opt.step()
    topt.step()
    assert_same_state(opt, ours, topt, theirs)
    assert isinstance(opt, torch.optim.Optimizer)
    gc.collect()
