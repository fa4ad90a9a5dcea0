"""dtorch.compile (issue 14 part 1): a replay gives what eager gives, bit for bit, on the op
sweep's cases, on random chains, on Llama's forward and on whole training steps; what a replay
cannot do is refused at capture, naming the line; a failure inside a replay names the line
inside the compiled function."""
from __future__ import annotations

import gc
import json
import random
import re
import zlib

import pytest
import torch

import dtorch
from dtorch.spec.placements import Replicate, Shard
from dtorch.errors import CompileError, PlacementError, RemoteError
from dtorch.ops import REGISTRY
from dtorch.ops.tooling.samples import SAMPLED_FAMILIES, samples
from dtorch.ops.tooling.simulate import placement_options, tensor_inputs, with_inputs
from dtorch.dtensor.tensor import call_op
from support import placed

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("strict")]

OPS = sorted(name for name, spec in REGISTRY.items() if spec.family in SAMPLED_FAMILIES)
COMBOS_PER_SAMPLE = 3
RANDOM_OPS = ("dropout", "rand_like", "randn_like")


def _line_of(pattern: str) -> int:
    """The line of this file holding `pattern` (errors must name the user's own line)."""
    with open(__file__) as source:
        return next(i for i, line in enumerate(source, 1) if pattern in line and "_line_of" not in line)


# --- the op sweep's cases ------------------------------------------------------------------------
@pytest.mark.parametrize("op", OPS)
def test_replay_equals_eager_on_the_op_sweep(op, mesh4):
    """Capture on one set of inputs, replay on fresh ones: the replay equals eager on those."""
    checks = []
    for uneven in (False, True):
        for number, sample in enumerate(samples(op, uneven)):
            seed = zlib.crc32(f"compile {op} {uneven} {number}".encode())
            g, chooser = torch.Generator().manual_seed(seed), random.Random(seed)
            options = [placement_options(v, ("sum",)) for v in tensor_inputs(sample)]
            combos = [tuple(rng.choice(o) for o in options) for rng in [chooser] * 8]
            for combo in list(dict.fromkeys(combos))[:COMBOS_PER_SAMPLE]:
                checks += _compiled_against_eager(op, sample, mesh4, combo, g)
    for got, want, what in checks:   # bit for bit (NaN where eager has NaN)
        torch.testing.assert_close(got.result(timeout=120), want.result(timeout=120), rtol=0, atol=0,
                                   equal_nan=True, msg=what)


def _compiled_against_eager(op, sample, mesh, combo, g) -> list:
    values = tensor_inputs(sample)

    def place(scale):
        return [placed(v * scale if v.is_floating_point() else v, mesh, (p,), g) for v, p in zip(values, combo)]

    def call(*inputs):
        args, kwargs = with_inputs(sample, list(inputs))
        return call_op(op, args, kwargs)

    compiled = dtorch.compile(call)
    try:
        compiled(*place(1.0))   # the capture
    except PlacementError:
        return []
    fresh = place(0.5)
    dtorch.manual_seed(11)
    replayed = compiled(*fresh)
    assert compiled.captures == 1, f"{op}: captured again"
    dtorch.manual_seed(11)
    eager = call(*fresh)
    pairs = zip(*(r if isinstance(r, tuple) else (r,) for r in (replayed, eager)))
    return [(a.fetch(), b.fetch(), f"{op} {combo}") for a, b in pairs]


# --- random chains -------------------------------------------------------------------------------
CHAIN_STEPS = ["add", "mul", "matmul", "relu", "sum", "transpose", "redistribute", "dropout", "randn_like", "softmax"]


def _random_chain(seed: int, mesh):
    rng = random.Random(seed)
    steps = [rng.choice(CHAIN_STEPS) for _ in range(rng.randint(4, 12))]
    targets = [[rng.choice([Shard(0), Shard(1), Replicate()]) for _ in range(mesh.ndim)] for _ in steps]

    def chain(x, y):
        for step, target in zip(steps, targets):
            if step == "add":
                x = x + y
            elif step == "mul":
                x = x * y.transpose(0, 1).transpose(0, 1) * 0.5
            elif step == "matmul":
                x = (x @ y.transpose(0, 1)) @ y / 8
            elif step == "relu":
                x = x.relu() - 0.1
            elif step == "sum":
                x = x + x.sum(dim=0, keepdim=True) * 0.01
            elif step == "transpose":
                x = x.transpose(0, 1).contiguous().transpose(0, 1)
            elif step == "redistribute":
                x = x.redistribute(mesh, target)
            elif step == "dropout":
                x = dtorch.nn.functional.dropout(x, 0.3)
            elif step == "randn_like":
                x = x + dtorch.randn_like(x) * 0.1
            else:
                x = x.softmax(dim=-1) * 4
        return x

    return chain, rng


@pytest.mark.parametrize("seed", range(12))
def test_replayed_random_chains_equal_eager(seed, mesh4, mesh22, automatic):
    mesh = mesh4 if seed % 2 else mesh22
    chain, rng = _random_chain(seed, mesh)
    compiled = dtorch.compile(chain)
    placements = [rng.choice([Shard(0), Shard(1), Replicate()]) for _ in range(mesh.ndim)]
    for call in range(3):
        x = dtorch.randn(10, 6, device_mesh=mesh, placements=placements)
        y = dtorch.randn(10, 6, device_mesh=mesh, placements=placements)
        dtorch.manual_seed(100 + call)
        got = compiled(x, y).to_torch()
        dtorch.manual_seed(100 + call)
        want = chain(x, y).to_torch()
        assert torch.equal(got, want), f"call {call}"
    assert compiled.captures == 1


def test_random_numbers_are_fresh_on_every_call_and_equal_eager(mesh4):
    noisy = dtorch.compile(lambda x: x + dtorch.randn(8, 4, device_mesh=mesh4, placements=[Shard(0)]))
    x = dtorch.zeros(8, 4, device_mesh=mesh4, placements=[Shard(0)])
    dtorch.manual_seed(5)
    got = [noisy(x).to_torch() for _ in range(3)]
    dtorch.manual_seed(5)
    want = [(x + dtorch.randn(8, 4, device_mesh=mesh4, placements=[Shard(0)])).to_torch() for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(got[1], got[2])
    # the stream goes on after replays as it would after eager calls
    assert torch.equal(dtorch.randn(3, device_mesh=mesh4, placements=[Replicate()]).to_torch(),
                       dtorch.randn(3, device_mesh=mesh4, placements=[Replicate()]).to_torch()) is False


# --- what a replay keeps and frees ---------------------------------------------------------------------
def test_a_replay_leaves_earlier_results_and_inputs_alone(mesh4):
    double = dtorch.compile(lambda x: (x * 2, x.sum()))
    first_in = dtorch.ones(8, device_mesh=mesh4, placements=[Shard(0)])
    first, first_sum = double(first_in)
    second, second_sum = double(dtorch.full((8,), 3.0, device_mesh=mesh4, placements=[Shard(0)]))
    assert torch.equal(first.to_torch(), torch.full((8,), 2.0)) and first_sum.item() == 8.0
    assert torch.equal(second.to_torch(), torch.full((8,), 6.0)) and second_sum.item() == 24.0
    assert torch.equal(first_in.to_torch(), torch.ones(8))


def test_in_place_on_an_argument_reaches_the_callers_tensor(mesh4):
    def bump(x, y):
        x.add_(y)
        return x * 1
    compiled = dtorch.compile(bump)
    for value in (1.0, 2.0, 3.0):
        x = dtorch.zeros(6, device_mesh=mesh4, placements=[Shard(0)])
        out = compiled(x, dtorch.full((6,), value, device_mesh=mesh4, placements=[Shard(0)]))
        assert torch.equal(x.to_torch(), torch.full((6,), value)) and torch.equal(out.to_torch(), x.to_torch())


def test_an_argument_changed_in_place_on_every_call(mesh4):
    """The same tensor passed on every call: after the capture it holds the id its in-place op
    made there, which is also the graph's own output id. The replay used to write that id and then
    move the unchanged input over it: the tensor stayed at 1.0 and each output at 4.0."""
    @dtorch.compile
    def bump(x):
        x.add_(1)
        return x * 2

    @dtorch.compile
    def bump_only(x):
        x.add_(1)
    x = dtorch.zeros(8, 6, device_mesh=mesh4, placements=[Shard(0)])
    y = dtorch.zeros(8, 6, device_mesh=mesh4, placements=[Shard(0)])
    for call in range(1, 5):
        out = bump(x)
        bump_only(y)
        assert torch.equal(x.to_torch(), torch.full((8, 6), float(call)))
        assert torch.equal(out.to_torch(), torch.full((8, 6), 2.0 * call))
        assert torch.equal(y.to_torch(), torch.full((8, 6), float(call)))


def test_a_replay_takes_the_previous_calls_outputs_as_its_inputs(mesh4):
    """Loop-carried state, `state = step(state)`: the first replay's inputs are the capture's own
    outputs, whose ids the graph writes again. It used to return its input unchanged (a step
    skipped, silently); swapped outputs fed back as swapped inputs too."""
    @dtorch.compile
    def step(t):
        return t * 2 + 1

    @dtorch.compile
    def swap(a, b):
        return b * 1, a + 1
    a0, b0 = torch.randn(7, 5), torch.randn(7, 5)
    up = lambda value, placements: dtorch.tensor(value, device_mesh=mesh4, placements=placements)  # noqa: E731
    t, want = up(a0, [Shard(0)]), a0
    a, b, want_a, want_b = up(a0, [Shard(1)]), up(b0, [Replicate()]), a0, b0
    for _ in range(5):
        t, want = step(t), want * 2 + 1
        a, b = swap(a, b)
        want_a, want_b = want_b * 1, want_a + 1
        torch.testing.assert_close(t.to_torch(), want)
        torch.testing.assert_close(a.to_torch(), want_a)
        torch.testing.assert_close(b.to_torch(), want_b)


def test_a_tensor_from_before_the_call_changed_in_place_keeps_each_replays_value(mesh4):
    """An EMA kept outside the function (ema.mul_(0.5).add_(t * 0.5)): the replay binds it by the
    id it holds and writes its new value at that same id; moving the bound input back over it
    left the EMA at its first value. Also with the input fed back from the last call, and with
    an argument changed twice in place and returned."""
    ema = dtorch.tensor(torch.zeros(4, 3), device_mesh=mesh4, placements=[Replicate()])
    total = dtorch.tensor(torch.zeros(4, 3), device_mesh=mesh4, placements=[Replicate()])

    @dtorch.compile
    def average(t):
        ema.mul_(0.5).add_(t * 0.5)
        total.add_(t)
        return t + 1

    @dtorch.compile
    def twice(t):
        t.add_(1)
        t.mul_(2)
        return t
    x = dtorch.ones(4, 3, device_mesh=mesh4, placements=[Shard(0)])
    y = dtorch.zeros(4, 3, device_mesh=mesh4, placements=[Shard(0)])
    want_ema, want_total, want_x, want_y = torch.zeros(4, 3), torch.zeros(4, 3), torch.ones(4, 3), torch.zeros(4, 3)
    for _ in range(5):
        want_ema, want_total = want_ema * 0.5 + want_x * 0.5, want_total + want_x
        x, want_x = average(x), want_x + 1
        out, want_y = twice(y), (want_y + 1) * 2
        for got, want in ((ema, want_ema), (total, want_total), (x, want_x), (y, want_y), (out, want_y)):
            torch.testing.assert_close(got.to_torch(), want)


def test_arguments_swapped_between_calls(mesh4):
    @dtorch.compile
    def accumulate(p, q):
        p.add_(q)
        return p - q
    a = dtorch.ones(4, 3, device_mesh=mesh4, placements=[Shard(0)])
    b = dtorch.full((4, 3), 10.0, device_mesh=mesh4, placements=[Shard(0)])
    want_a, want_b = torch.ones(4, 3), torch.full((4, 3), 10.0)
    for call in range(4):
        if call % 2 == 0:
            out, want_a = accumulate(a, b), want_a + want_b
            want_out = want_a - want_b
        else:
            out, want_b = accumulate(b, a), want_b + want_a
            want_out = want_b - want_a
        for got, want in ((a, want_a), (b, want_b), (out, want_out)):
            torch.testing.assert_close(got.to_torch(), want)


def test_a_function_that_rebinds_what_it_read_captures_again_each_call(mesh4):
    """fn reads holder["w"] and binds the name to a new tensor itself (as a module that assigns
    its buffer an op's output): the old id is dropped during the capture, before any watch on
    it could mark the graph stale, and the replay read a freed id ("tensor #N is not on rank")."""
    holder = {"w": dtorch.ones(4, device_mesh=mesh4, placements=[Replicate()])}

    def halve():
        holder["w"] = holder["w"] * 0.5
    compiled = dtorch.compile(halve)
    for call in range(3):
        compiled()
        torch.testing.assert_close(holder["w"].to_torch(), torch.full((4,), 0.5 ** (call + 1)))
    assert compiled.captures == 3


def test_a_tensor_read_from_outside_the_arguments_is_read_again_once_released(mesh4):
    """fn reads holder["w"] (a closure); the name is bound to a new tensor and the old one dropped.
    The replay read the old id: a freed tensor (an error), or, before its Free arrived, the old
    values. Now the release makes the graph stale and the next call captures again. A manual
    update of the weights outside (p -= lr * p.grad, which rebinds p) is the same case."""
    a, b = torch.randn(8, 6), torch.randn(6, 6)
    x = dtorch.tensor(a, device_mesh=mesh4, placements=[Shard(0)])
    holder = {"w": dtorch.tensor(b, device_mesh=mesh4, placements=[Replicate()])}
    compiled = dtorch.compile(lambda t: t @ holder["w"])
    compiled(x)
    holder["w"] = holder["w"] * 2
    gc.collect()
    torch.testing.assert_close(compiled(x).to_torch(), a @ (b * 2))
    torch.testing.assert_close(compiled(x).to_torch(), a @ (b * 2))
    assert compiled.captures == 2

    w = dtorch.tensor(b, device_mesh=mesh4, placements=[Replicate()], requires_grad=True)
    forward, reference = dtorch.compile(lambda t: (t @ w).square().mean()), b.clone()
    for _ in range(3):
        torch.testing.assert_close(forward(x).to_torch(), (a @ reference).square().mean())
        (x @ w).square().mean().backward()
        with torch.no_grad():
            w -= 0.1 * w.grad
        w.grad = None
        reference = reference - 0.1 * torch.func.grad(lambda v: (a @ v).square().mean())(reference)
    torch.testing.assert_close(w.to_torch(), reference, rtol=1e-5, atol=1e-6)


def test_returned_arguments_constants_and_structures(mesh4):
    weight = dtorch.ones(4, device_mesh=mesh4, placements=[Replicate()])
    compiled = dtorch.compile(lambda x, scale: {"x": x, "w": weight, "y": [x * scale, None], "n": 3})
    for scale in (2.0, 2.0, 5.0):
        x = dtorch.ones(4, device_mesh=mesh4, placements=[Shard(0)])
        out = compiled(x, scale)
        assert out["x"] is x and out["w"] is weight and out["n"] == 3 and out["y"][1] is None
        assert torch.equal(out["y"][0].to_torch(), torch.full((4,), scale))
    assert compiled.captures == 2   # scale is part of the signature


def test_intermediates_are_freed_after_every_replay(mesh4):
    def chain(x):
        for _ in range(20):
            x = x * 1.01 + 1
        return x
    compiled = dtorch.compile(chain)
    x = dtorch.ones(16, device_mesh=mesh4, placements=[Shard(0)])
    compiled(x)
    dtorch.synchronize()
    before = _live_tensors()
    for _ in range(30):
        out = compiled(x)
    assert torch.allclose(out.to_torch(), chain(x).to_torch())
    del out
    dtorch.synchronize()
    assert _live_tensors() <= before + 4


def test_intermediates_held_in_a_reference_cycle_are_freed_after_every_replay(mesh4):
    """Garbage that only the cycle collector frees is scratch too, not state a replay keeps
    (the capture collects when some id is left neither returned nor dropped)."""
    def chain(x):
        for _ in range(20):
            x = x * 1.01 + 1
            loop = [x]
            loop.append(loop)
        return x
    compiled = dtorch.compile(chain)
    x = dtorch.ones(16, device_mesh=mesh4, placements=[Shard(0)])
    before = _live_tensors()
    for _ in range(5):
        out = compiled(x)
    assert torch.allclose(out.to_torch(), chain(x).to_torch())
    del out
    gc.collect()
    assert _live_tensors() <= before + 4


def _live_tensors() -> int:
    controller = dtorch.runtime.controller.session.controller()
    controller.synchronize()
    import time
    time.sleep(1.2)   # heartbeats carry the count
    return sum(w.live_tensors for w in controller.workers.values())


# --- signatures, guards, the cache -------------------------------------------------------------------
def test_a_new_signature_captures_again_and_the_cache_is_bounded(mesh4):
    compiled = dtorch.compile(lambda x: x + 1, max_graphs=2)
    for shape in [(4,), (8,), (4,), (12,), (4,), (8,)]:   # LRU: (12,) drops (8,)
        x = dtorch.zeros(shape, device_mesh=mesh4, placements=[Shard(0)])
        assert torch.equal(compiled(x).to_torch(), torch.ones(shape))
    assert compiled.graphs() == 2 and compiled.captures == 4
    x = dtorch.zeros(8, device_mesh=mesh4, placements=[Replicate()])   # placements key too
    compiled(x)
    assert compiled.captures == 5


def test_compiled_inside_compiled_is_part_of_the_outer_capture(mesh4):
    inner = dtorch.compile(lambda x: x * 3)
    outer = dtorch.compile(lambda x: inner(x) + 1)
    for _ in range(3):
        x = dtorch.ones(4, device_mesh=mesh4, placements=[Shard(0)])
        assert torch.equal(outer(x).to_torch(), torch.full((4,), 4.0))
    assert outer.captures == 1 and inner.captures == 0


def test_a_worker_that_joined_after_the_capture_skips_its_replays():
    """Its own session: growing the shared pool would change what other tests see."""
    from support import run_script
    result = run_script("""
        import json, dtorch
        from dtorch.spec.placements import init_device_mesh, Shard
        mesh = init_device_mesh("cpu", (2,))
        double = dtorch.compile(lambda x: x * 2)
        double(dtorch.ones(8, device_mesh=mesh, placements=[Shard(0)]))
        init_device_mesh("cpu", (3,))   # one more worker joins the pool
        out = double(dtorch.ones(8, device_mesh=mesh, placements=[Shard(0)])).to_torch()
        dtorch.synchronize()   # the newcomer reported no missing graph
        print(json.dumps({"out": out.tolist(), "captures": double.captures, "workers": len(dtorch.workers())}))
        dtorch.shutdown()
    """, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"out": [2.0] * 8, "captures": 1, "workers": 3}, report


def test_after_replace_lost_workers_a_compiled_function_captures_again():
    """The replacing processes never saw the graph: the next call captures anew."""
    from support import run_script
    result = run_script("""
        import json, os, signal, torch, dtorch
        from dtorch.spec.placements import init_device_mesh, Shard
        mesh = init_device_mesh("cpu", (2,))
        double = dtorch.compile(lambda x: x * 2)
        double(dtorch.ones(4, device_mesh=mesh, placements=[Shard(0)]))
        os.kill(dtorch.workers()[1]["pid"], signal.SIGKILL)
        try:
            dtorch.synchronize(timeout=30)
        except dtorch.WorkerLostError:
            pass
        dtorch.replace_lost_workers(timeout=60)
        out = double(dtorch.ones(4, device_mesh=mesh, placements=[Shard(0)])).to_torch()
        again = double(dtorch.ones(4, device_mesh=mesh, placements=[Shard(0)])).to_torch()
        dtorch.synchronize()
        print(json.dumps({"out": out.tolist(), "again": again.tolist(), "captures": double.captures}))
        dtorch.shutdown()
    """, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"out": [2.0] * 4, "again": [2.0] * 4, "captures": 2}, report


# --- errors ------------------------------------------------------------------------------------------
def test_a_read_inside_is_refused_at_capture_naming_the_line(mesh4):
    def reads(x):
        return x * x.sum().item()   # READ HERE
    with pytest.raises(CompileError, match=rf"test_compile.py:{_line_of('READ HERE')}.*inside compiled"):
        dtorch.compile(reads)(dtorch.ones(4, device_mesh=mesh4, placements=[Shard(0)]))

    def branches(x):
        if x.sum() > 0:   # BRANCH HERE
            return x
        return -x
    with pytest.raises(CompileError, match=rf"test_compile.py:{_line_of('BRANCH HERE')}"):
        dtorch.compile(branches)(dtorch.ones(4, device_mesh=mesh4, placements=[Replicate()]))


def test_an_upload_of_per_call_data_is_refused(mesh4):
    def uploads(x):
        return x + dtorch.tensor(torch.ones(4), device_mesh=mesh4, placements=[Shard(0)])   # UPLOAD HERE
    with pytest.raises(CompileError, match=rf"test_compile.py:{_line_of('UPLOAD HERE')}.*Upload it before"):
        dtorch.compile(uploads)(dtorch.ones(4, device_mesh=mesh4, placements=[Shard(0)]))
    with pytest.raises(CompileError, match="torch.Tensor argument"):
        dtorch.compile(lambda x: x)(torch.ones(3))


def test_a_failure_inside_a_replay_names_the_line_inside_the_function(mesh4):
    table = dtorch.randn(5, 3, device_mesh=mesh4, placements=[Replicate()])

    def lookup(index):
        picked = table.index_select(0, index)   # FAILS HERE
        return picked * 2
    compiled = dtorch.compile(lookup)
    good = dtorch.tensor(torch.tensor([0, 4, 1, 2]), device_mesh=mesh4, placements=[Shard(0)])
    compiled(good).to_torch()
    bad = dtorch.tensor(torch.tensor([0, 9, 1, 2]), device_mesh=mesh4, placements=[Shard(0)])
    result = compiled(bad)
    assert compiled.captures == 1
    with pytest.raises(RemoteError) as raised:
        result.to_torch()
    assert re.search(rf"test_compile.py:{_line_of('FAILS HERE')} \(replayed, in the compiled call at",
                     str(raised.value))
    assert torch.equal(compiled(good).to_torch(), table.to_torch()[[0, 4, 1, 2]] * 2)   # the session goes on


# --- training --------------------------------------------------------------------------------------------
def _mlp_step(mesh, compiled: bool, lr_schedule=None):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = dtorch.nn.Sequential(dtorch.nn.Linear(8, 16, device_mesh=mesh), dtorch.nn.ReLU(),
                                 dtorch.nn.Linear(16, 4, device_mesh=mesh))
    model.load_state_dict(ref.state_dict())
    optimizer = dtorch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def step(x, y):
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        dtorch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        return loss
    if compiled:
        step = dtorch.compile(step)
    g = torch.Generator().manual_seed(1)
    losses = []
    for index in range(6):
        if lr_schedule:
            optimizer.param_groups[0]["lr"] = lr_schedule[index]
        x = dtorch.tensor(torch.randn(6, 8, generator=g), device_mesh=mesh, placements=[Shard(0)])
        y = dtorch.tensor(torch.randn(6, 4, generator=g), device_mesh=mesh, placements=[Shard(0)])
        losses.append(step(x, y))
    return [loss.item() for loss in losses], model, optimizer, step


@pytest.mark.parametrize("lr_schedule", [None, [1e-2, 1e-2, 1e-2, 5e-3, 5e-3, 5e-3]])
def test_a_compiled_training_step_equals_eager(mesh4, lr_schedule):
    eager_losses, eager_model, eager_opt, _ = _mlp_step(mesh4, False, lr_schedule)
    losses, model, optimizer, step = _mlp_step(mesh4, True, lr_schedule)
    assert losses == eager_losses
    for (name, got), want in zip(model.state_dict().items(), eager_model.state_dict().values()):
        assert torch.equal(got.to_torch(), want.to_torch()), name
    # the first call makes AdamW's state (a fresh optimizer), so the second captures again; an lr
    # change is an input of the replay, not a capture
    assert step.captures == 2
    assert optimizer.state_dict()["state"][0]["step"] == eager_opt.state_dict()["state"][0]["step"] == 6


@pytest.mark.parametrize("frozen_calls", [(0, 1, 2), (3, 4, 5)], ids=["unfrozen-at-3", "frozen-at-3"])
def test_freezing_a_layer_between_compiled_steps_captures_again(mesh4, frozen_calls):
    """Whether a parameter requires grad decides what a capture records: a layer unfrozen
    between calls was never trained by the replays (wrong values, no error), and one frozen
    failed the replayed backward on the workers, poisoning every parameter."""
    import copy
    import torch.nn as tnn
    import torch.nn.functional as F
    torch.manual_seed(0)
    reference = tnn.Sequential(tnn.Linear(4, 8), tnn.ReLU(), tnn.Linear(8, 3))
    model = dtorch.distribute_module(copy.deepcopy(reference), mesh4)
    want_opt, got_opt = torch.optim.SGD(reference.parameters(), lr=0.1), dtorch.optim.SGD(model.parameters(), lr=0.1)

    @dtorch.compile
    def step(x, y):
        F.cross_entropy(model(x), y).backward()
        got_opt.step()
        got_opt.zero_grad()
    g = torch.Generator().manual_seed(1)
    for call in range(6):
        reference[0].requires_grad_(call not in frozen_calls)
        model[0].requires_grad_(call not in frozen_calls)
        x, y = torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
        F.cross_entropy(reference(x), y).backward()
        want_opt.step()
        want_opt.zero_grad()
        step(dtorch.tensor(x, device_mesh=mesh4, placements=[Shard(0)]),
             dtorch.tensor(y, device_mesh=mesh4, placements=[Shard(0)]))
    assert step.captures == 2
    for (name, want), got in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(got.to_torch(), want.detach(), msg=name)


def test_a_module_switched_to_eval_or_given_another_momentum_captures_again(mesh4):
    """A module's plain settings shape what a capture records; model.eval() or a new BatchNorm
    momentum between calls was baked in (train-mode replays, wrong running stats, no error)."""
    import copy
    import torch.nn as tnn
    torch.manual_seed(0)
    reference = tnn.Sequential(tnn.Linear(4, 6), tnn.BatchNorm1d(6), tnn.Dropout(0.0))
    model = dtorch.distribute_module(copy.deepcopy(reference), mesh4)
    run = dtorch.compile(lambda x: model(x))
    g = torch.Generator().manual_seed(1)
    for call in range(6):
        if call == 2:
            reference[1].momentum = model[1].momentum = 0.5
        if call == 4:
            reference.eval()
            model.eval()
        x = torch.randn(8, 4, generator=g)
        got = run(dtorch.tensor(x, device_mesh=mesh4, placements=[Shard(0)]))
        torch.testing.assert_close(got.to_torch(), reference(x).detach(), msg=f"call {call}")
    torch.testing.assert_close(model[1].running_mean.to_torch(), reference[1].running_mean)
    assert run.captures == 3
    # a module's own bookkeeping (dtorch.nn.BatchNorm2d counts its batches) is not a setting
    norm = dtorch.nn.BatchNorm2d(3, device_mesh=mesh4)
    normalize = dtorch.compile(lambda x: norm(x).sum())
    for _ in range(3):
        normalize(dtorch.randn(4, 3, 5, 5, device_mesh=mesh4, placements=[Shard(0)]))
    assert normalize.captures == 1


def test_a_state_tensor_changed_in_place_outside_keeps_what_the_next_replay_writes(mesh4):
    """A buffer the function updates in place (BatchNorm's running stats, an EMA) and the
    program also changes in place between calls (reset_running_stats): the change outside
    drops the buffer's id, which the next replay writes again. A Free of that id batched after
    the replay (16 drops to a Free) freed the replay's result: the next read or call raised
    "tensor #N is not on rank" (found by the training probe, 1 run in 8)."""
    buffer = dtorch.zeros(4, device_mesh=mesh4, placements=[Replicate()])
    x = dtorch.tensor(torch.arange(8.0).reshape(2, 4), device_mesh=mesh4, placements=[Replicate()])

    @dtorch.compile
    def update(x):
        buffer.mul_(0.5).add_(x.sum(0))
    want = torch.zeros(4)
    for call in range(5):
        update(x)
        want = want * 0.5 + torch.arange(8.0).reshape(2, 4).sum(0)
        scratch = [x * k for k in range(20)]   # enough drops for a batched Free after the replay
        del scratch
        torch.testing.assert_close(buffer.to_torch(), want, msg=f"call {call}")
        if call == 2:
            buffer.zero_()
            want = torch.zeros(4)
    assert update.captures == 1


def test_grads_accumulate_across_compiled_calls_as_in_eager(mesh4):
    w = dtorch.ones(4, device_mesh=mesh4, placements=[Replicate()], requires_grad=True)

    def accumulate(x):
        (w * x).sum().backward()
    compiled = dtorch.compile(accumulate)
    for k in range(1, 5):
        compiled(dtorch.full((4,), float(k), device_mesh=mesh4, placements=[Shard(0)]))
    assert torch.equal(w.grad.to_torch(), torch.full((4,), 10.0))
    w.grad = None
    compiled(dtorch.full((4,), 2.0, device_mesh=mesh4, placements=[Shard(0)]))
    assert torch.equal(w.grad.to_torch(), torch.full((4,), 2.0))


@pytest.mark.parametrize("shape, names", [((2, 2), ["dp", "tp"]), ((4,), ["fsdp"])], ids=["dp2xtp2", "fsdp4"])
def test_llama_forward_and_training_step_replay_like_eager(session, shape, names):
    """On fsdp the forward's rows read gathered parameters, which backward gathers again
    (kernels.saves_gathered): in a replay too."""
    transformers = pytest.importorskip("transformers")
    from dtorch.spec.placements import init_device_mesh
    from dtorch.models import LlamaForCausalLM
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    weights = transformers.LlamaForCausalLM(config).state_dict()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 96, (4, 12), generator=g) for _ in range(4)]

    def run(compiled: bool):
        model = LlamaForCausalLM(config, device_mesh=mesh)
        model.load_state_dict(weights)
        optimizer = dtorch.optim.AdamW(model.parameters(), lr=3e-3)
        forward = lambda ids: model(ids).logits   # noqa: E731
        def step(ids):
            loss = model(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss
        if compiled:
            forward, step = dtorch.compile(forward), dtorch.compile(step)
        uploaded = [dtorch.tensor(b, device_mesh=mesh, placements=[Shard(0)] + [Replicate()] * (len(shape) - 1))
                    for b in batches]
        logits = [forward(ids).to_torch() for ids in uploaded[:2]]
        return logits, [step(ids).item() for ids in uploaded], step
    eager_logits, eager_losses, _ = run(False)
    logits, losses, step = run(True)
    assert all(torch.equal(a, b) for a, b in zip(logits, eager_logits))
    assert losses == eager_losses and step.captures == 2


# --- whole training steps that replay (issue 14) ------------------------------------------------------
def _dp_mlp(mesh):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = dtorch.nn.Sequential(dtorch.nn.Linear(8, 16, device_mesh=mesh), dtorch.nn.ReLU(),
                                 dtorch.nn.Linear(16, 4, device_mesh=mesh))
    model.load_state_dict(ref.state_dict())
    return model


def _batches(mesh, count: int = 4, requires_grad: bool = False) -> list:
    g = torch.Generator().manual_seed(1)
    return [(dtorch.tensor(torch.randn(6, 8, generator=g), device_mesh=mesh, placements=[Shard(0)],
                           requires_grad=requires_grad),
             dtorch.tensor(torch.randn(6, 4, generator=g), device_mesh=mesh, placements=[Shard(0)]))
            for _ in range(count)]


def _same_step(got: dict, want: dict, call: int) -> None:
    """Loss, parameters and gradients of one step, compiled against eager, bit for bit."""
    assert got.keys() == want.keys()
    for name in want:
        a, b = got[name], want[name]
        assert (a is None) == (b is None), f"call {call}: {name}"
        assert a is None or torch.equal(a, b), f"call {call}: {name}"


def _snapshot(loss, model, **more) -> dict:
    """Values now (the next step changes these tensors in place, as torch's would be)."""
    found = {"loss": loss, **more}
    for name, p in model.named_parameters():
        found[name], found[name + ".grad"] = p, p.grad
    return {name: None if t is None else t.to_torch() for name, t in found.items()}


@pytest.mark.parametrize("where", ["end", "start", "outside"])
def test_zero_grad_without_set_to_none_replays_a_dp_training_step(mesh4, where):
    """zero_grad(set_to_none=False) keeps each .grad, which the next backward builds on; on
    data-parallel parameters that backward reduces into a new tensor, so the guard `.grad is
    what the capture built on` failed on every call and each call captured again (values right,
    no replay). Now that grad is an input of the graph, bound to the one the leaf holds."""
    def run(compiled: bool) -> tuple:
        model = _dp_mlp(mesh4)
        optimizer = dtorch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

        def step(x, y):
            if where == "start":
                optimizer.zero_grad(set_to_none=False)
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            optimizer.step()
            if where == "end":
                optimizer.zero_grad(set_to_none=False)
            return loss
        step = dtorch.compile(step) if compiled else step
        found = []
        for x, y in _batches(mesh4):
            loss = step(x, y)
            found.append(_snapshot(loss, model))
            if where == "outside":
                optimizer.zero_grad(set_to_none=False)
        return found, step
    want, _ = run(False)
    got, step = run(True)
    for call, (a, b) in enumerate(zip(got, want)):
        _same_step(a, b, call)
    assert step.captures == 2   # the first call makes AdamW's state and the first .grad


def test_an_argument_that_requires_grad_replays_and_gets_its_own_grad(mesh4):
    """An input with requires_grad=True, and a parameter passed as an argument: the guard read
    the captured argument's .grad, which the capture itself had set, so every call captured
    again; a replay would also have set that old argument's .grad, not the new one's. Now an
    argument's grad state is part of the signature, and its grad is an output of the replay."""
    def run(compiled: bool) -> tuple:
        model = _dp_mlp(mesh4)
        head = dtorch.nn.Parameter(dtorch.tensor(torch.linspace(-1, 1, 16).reshape(4, 4), device_mesh=mesh4,
                                                 placements=[Replicate()]))
        optimizer = dtorch.optim.SGD([*model.parameters(), head], lr=1e-2, momentum=0.9)

        def step(w, x, y):
            loss = ((model(x) @ w - y) ** 2).mean()
            loss.backward()
            optimizer.step()
            return loss
        step = dtorch.compile(step) if compiled else step
        found = []
        for x, y in _batches(mesh4, requires_grad=True):
            loss = step(head, x, y)
            found.append(_snapshot(loss, model, head=head, head_grad=head.grad, x_grad=x.grad))
            optimizer.zero_grad()
        return found, step
    want, _ = run(False)
    got, step = run(True)
    for call, (a, b) in enumerate(zip(got, want)):
        _same_step(a, b, call)
    assert step.captures == 2   # the first call makes SGD's momentum buffers
    # the old replay set the first argument's .grad and left the new one's None (no error)
    triple = dtorch.compile(lambda x: (x * 3).sum().backward())
    first, second = (dtorch.ones(4, device_mesh=mesh4, placements=[Shard(0)], requires_grad=True) for _ in range(2))
    triple(first)
    first.grad = None
    triple(second)
    assert first.grad is None and torch.equal(second.grad.to_torch(), torch.full((4,), 3.0))
    assert triple.captures == 1


def test_a_parameter_changed_in_place_outside_replays_the_next_step(mesh4):
    """Weight decay by hand between compiled forward/backward calls (p.mul_(0.9) under no_grad
    gives p a new id): the release of the old id made the graph stale, so every call captured
    again. Now the replay binds the id the parameter holds then."""
    def run(compiled: bool) -> tuple:
        model = _dp_mlp(mesh4)
        optimizer = dtorch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)

        def forward_backward(x, y):
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            return loss
        forward_backward = dtorch.compile(forward_backward) if compiled else forward_backward
        found = []
        for x, y in _batches(mesh4):
            loss = forward_backward(x, y)
            found.append(_snapshot(loss, model))
            optimizer.step()
            with dtorch.no_grad():
                for p in model.parameters():
                    p.mul_(0.9)
            optimizer.zero_grad()
        return found, forward_backward
    want, _ = run(False)
    got, step = run(True)
    for call, (a, b) in enumerate(zip(got, want)):
        _same_step(a, b, call)
    assert step.captures == 1


def test_tensors_read_by_a_replay_follow_in_place_changes_outside(mesh4, automatic):
    """Between calls, tensors the function reads are changed in place outside it: by an op, by
    item assignment, through a view, while the function itself updates an EMA in place. Each
    replay reads the new values; `w.data = t` with another layout captures again."""
    g = torch.Generator().manual_seed(5)
    a, b, x0 = torch.randn(4, 6, generator=g), torch.randn(6, 6, generator=g), torch.randn(4, 6, generator=g)
    c = dtorch.tensor(a, device_mesh=mesh4, placements=[Shard(0)])
    w = dtorch.tensor(b, device_mesh=mesh4, placements=[Replicate()])
    ema = dtorch.zeros(4, 6, device_mesh=mesh4, placements=[Replicate()])
    x = dtorch.tensor(x0, device_mesh=mesh4, placements=[Shard(0)])

    @dtorch.compile
    def forward(x):
        ema.mul_(0.5).add_(x @ w * 0.5)
        return (x + c) @ w
    want_ema = torch.zeros(4, 6)
    for call in range(6):
        want_ema = want_ema * 0.5 + x0 @ b * 0.5
        torch.testing.assert_close(forward(x).to_torch(), (x0 + a) @ b, msg=f"call {call}")
        torch.testing.assert_close(ema.to_torch(), want_ema, msg=f"call {call}")
        with dtorch.no_grad():
            if call == 0:
                w.mul_(0.9)
                b = b * 0.9
            elif call == 1:
                c[1] = 2.0
                a = a.clone()
                a[1] = 2.0
            elif call == 2:
                w.T[0].add_(1.0)   # a view of w: written back into w
                b = b.clone()
                b[:, 0] += 1.0
            elif call == 3:
                ema.mul_(2.0)
                want_ema = want_ema * 2.0
            elif call == 4:
                w.data = dtorch.tensor(b * 2, device_mesh=mesh4, placements=[Shard(1)])
                b = b * 2
    assert forward.captures == 2
