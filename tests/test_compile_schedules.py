"""dtorch.compile in a training loop as torch users write it (issue 45): an lr scheduler changes
the optimizer's numbers between calls, and the replay takes them as inputs instead of capturing
again; losses equal eager's bit for bit. Also gradient accumulation under no_sync, fsdp and pp
inside a compiled step, numbers passed to the function (`scalars=`), and why a call captures
again (`compiled.stats()`, the warning of a function that keeps capturing)."""
from __future__ import annotations

import math
import threading
import warnings

import pytest
import torch
from torch.optim import lr_scheduler

import dtorch
from dtorch.compile import RecaptureWarning
from dtorch.dtensor import compile_scalars
from dtorch.runtime import protocol as wire
from dtorch.spec.placements import Replicate, Shard, init_device_mesh

pytestmark = pytest.mark.timeout(300)

STEPS = 50
# A training step captures twice: its first call makes the optimizer's state, which the second
# call's step reads (docs/guide/compile.md); every later call replays.
TRAINING_CAPTURES = 2
FIRST_STEP = "AdamW's state buffers are not the ones the capture stepped (its first step made them)"


def warmup_cosine(warmup: int, total: int):
    return lambda step: (step + 1) / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * step / total))


SCHEDULES = {
    "LambdaLR": lambda opt: lr_scheduler.LambdaLR(opt, warmup_cosine(5, STEPS)),
    # changes AdamW's betas too (cycle_momentum)
    "OneCycleLR": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS),
    "CosineAnnealingWarmRestarts": lambda opt: lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=8, T_mult=2),
    # driven by the loss: a read after each call, outside the compiled function
    "ReduceLROnPlateau": lambda opt: lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.05),
}


def _mlp(mesh):
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = dtorch.nn.Sequential(dtorch.nn.Linear(8, 16, device_mesh=mesh), dtorch.nn.ReLU(),
                                 dtorch.nn.Linear(16, 4, device_mesh=mesh))
    model.load_state_dict(reference.state_dict())
    return model


def _batches(mesh, count: int) -> list:
    g = torch.Generator().manual_seed(1)
    return [tuple(dtorch.tensor(torch.randn(8, n, generator=g), device_mesh=mesh, placements=[Shard(0)])
                  for n in (8, 4)) for _ in range(count)]


def _scheduled_training(mesh, schedule: str, compiled: bool):
    model = _mlp(mesh)
    optimizer = dtorch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = SCHEDULES[schedule](optimizer)

    def step(x, y):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        dtorch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return loss
    if compiled:
        step = dtorch.compile(step)
    losses, lrs = [], []
    for x, y in _batches(mesh, STEPS):
        loss = step(x, y).item()
        losses.append(loss)
        lrs.append((optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["betas"]))
        scheduler.step(loss) if schedule == "ReduceLROnPlateau" else scheduler.step()
    return losses, lrs, step


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_scheduled_training_step_replays_and_equals_eager(schedule, mesh4):
    eager_losses, eager_lrs, _ = _scheduled_training(mesh4, schedule, compiled=False)
    losses, lrs, step = _scheduled_training(mesh4, schedule, compiled=True)
    assert losses == eager_losses   # bit for bit
    assert lrs == eager_lrs and len(set(lrs)) > 2, lrs   # the schedule did change the lr, as in eager
    stats = step.stats()
    assert stats["captures"] == TRAINING_CAPTURES and stats["replays"] == STEPS - TRAINING_CAPTURES, stats
    assert stats["recaptures"] == {FIRST_STEP: 1}


def _llama(mesh):
    transformers = pytest.importorskip("transformers")
    from dtorch.models import LlamaForCausalLM
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    initial = transformers.LlamaForCausalLM(config).state_dict()
    model = LlamaForCausalLM(config, device_mesh=mesh)
    model.load_state_dict(initial)
    return model


def _fine_tune(mesh, compiled: bool, steps: int, accumulate: bool):
    """The issue's fine-tune: AdamW, warmup + cosine through LambdaLR, clipping, and (with
    `accumulate`) two microbatches per step, the first under no_sync."""
    model = _llama(mesh)
    optimizer = dtorch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = lr_scheduler.LambdaLR(optimizer, warmup_cosine(3, steps))

    def step(batches):
        if accumulate:
            ids, labels = batches[0]
            with model.no_sync():   # DDP's pattern: the first half accumulates unreduced
                (model(ids, labels=labels).loss / 2).backward()
        ids, labels = batches[-1]
        loss = model(ids, labels=labels).loss / len(batches)
        loss.backward()
        dtorch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return loss
    if compiled:
        step = dtorch.compile(step)

    def upload(ids):   # labels where the loss is (pp: the last stage), so the shift needs no read
        labels_mesh = model.stages[-1]
        return model._upload(ids), (dtorch.tensor(ids, device_mesh=labels_mesh) if labels_mesh != model.stages[0]
                                    else None)
    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (4, 12), generator=g)
        uploaded = [upload(half) for half in (ids.chunk(2) if accumulate else [ids])]
        losses.append(step([(i, i if labels is None else labels) for i, labels in uploaded]))
        scheduler.step()
    return [loss.item() for loss in losses], step


@pytest.mark.parametrize("layout,accumulate", [("dp2xtp2", True), ("fsdp2", False), ("pp2", False)])
def test_a_scheduled_llama_step_replays_like_eager(layout, accumulate, session):
    """The fine-tune of the issue on dp2 x tp2, with accumulation under no_sync inside the
    compiled step; fsdp (each layer's gathers and reduce-scatters replayed) and pp (the stages'
    moves) with the same schedule."""
    shape, names = {"dp2xtp2": ((2, 2), ["dp", "tp"]), "fsdp2": ((2,), ["fsdp"]), "pp2": ((2,), ["pp"])}[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    eager, _ = _fine_tune(mesh, compiled=False, steps=8, accumulate=accumulate)
    compiled, step = _fine_tune(mesh, compiled=True, steps=8, accumulate=accumulate)
    assert compiled == eager
    assert step.stats()["captures"] == TRAINING_CAPTURES, step.stats()


def test_a_change_that_shapes_the_step_captures_again_and_says_why(mesh4):
    model = _mlp(mesh4)
    optimizer = dtorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    @dtorch.compile
    def step(x, y):
        ((model(x) - y) ** 2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    batches = _batches(mesh4, 6)
    for x, y in batches[:3]:
        step(x, y)
    optimizer.param_groups[0]["lr"] = 0.05   # a number: an input
    step(*batches[3])
    optimizer.param_groups[0]["nesterov"] = True   # a flag: another update
    step(*batches[4])
    model.eval()
    step(*batches[5])
    stats = step.stats()
    assert stats["captures"] == 4 and stats["replays"] == 2, stats
    assert set(stats["recaptures"]) == {
        "SGD's state buffers are not the ones the capture stepped (its first step made them)",
        "SGD's param group 0 changed what its step keeps or runs: nesterov",
        "Sequential's settings changed: training"}, stats
    assert stats["last_recapture"] == "Sequential's settings changed: training (True -> False)"


def test_a_new_signature_says_what_changed(mesh4):
    double = dtorch.compile(lambda x, factor: x * 2 + factor)
    double(dtorch.ones(8, device_mesh=mesh4, placements=[Shard(0)]), 1)
    double(dtorch.ones(4, device_mesh=mesh4, placements=[Shard(0)]), 1)
    assert double.stats()["last_recapture"] == ("a new signature: x (DTensor [S(0)] shape=(8,) float32 -> "
                                                "DTensor [S(0)] shape=(4,) float32)")
    double(dtorch.ones(4, device_mesh=mesh4, placements=[Shard(0)]), 2)
    assert double.stats()["last_recapture"] == "a new signature: factor (1 -> 2)"


def test_a_function_that_keeps_capturing_warns_once_at_the_callers_line(mesh4):
    x = dtorch.ones(4, device_mesh=mesh4, placements=[Shard(0)])
    scaled = dtorch.compile(lambda x, factor: x * factor)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for factor in range(10):
            scaled(x, float(factor))   # WARNS HERE
    found = [w for w in caught if w.category is RecaptureWarning]
    assert len(found) == 1 and found[0].filename == __file__
    with open(__file__) as source:
        assert "WARNS HERE" in source.read().splitlines()[found[0].lineno - 1]
    assert "captured again on 4 of its last 5 calls" in str(found[0].message)
    assert "the last time because a new signature: factor (3.0 -> 4.0)" in str(found[0].message)
    assert "scalars=" in str(found[0].message)   # the way out


def test_shapes_within_the_cache_do_not_warn(mesh4):
    total = dtorch.compile(lambda x: x.sum())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecaptureWarning)
        for n in range(4, 12):
            total(dtorch.ones(n, device_mesh=mesh4, placements=[Shard(0)]))
    assert total.stats()["captures"] == 8


# --- numbers as inputs ----------------------------------------------------------------------------
def test_marked_numbers_are_inputs_of_the_graph(mesh4):
    a = torch.randn(8, 4)
    x = dtorch.tensor(a, device_mesh=mesh4, placements=[Shard(0)])

    def affine(x, scale, bias=0.0, steps=1):
        return ((x * scale + bias) / scale - scale * x + steps - x * steps, scale)
    compiled = dtorch.compile(affine, scalars=("scale", "bias", "steps"))
    for scale, bias, steps in ((0.5, 0.0, 1), (1.5, 0.25, 2), (3.0, -1.0, 7), (0.25, 2.0, 3)):
        out, returned = compiled(x, scale, bias=bias, steps=steps)
        torch.testing.assert_close(out.to_torch(), affine(a, scale, bias, steps)[0], rtol=0, atol=0)
        assert returned == scale and type(returned) is float
    assert compiled.stats()["captures"] == 1 and compiled.stats()["kept_scalars"] == {}


def test_the_wire_packing_a_marked_number_is_not_python_using_it():
    """A batch of the rows a capture has issued so far is packed when it is flushed: in the
    capture's thread (a batch that waited) or the controller's (the workers went idle).
    msgpack's packer compares an int with 0 to pick its encoding, and that once made the graph
    keep a marked int, at random ("Python used its value"). Neither packing counts, in a slice
    either (an extension type's fields); the function's own comparison does."""
    steps, scale = compile_scalars.traced(1, "steps"), compile_scalars.traced(0.5, "scale")
    row = wire.RunOp(3, (7,), 0, "mul", "mul", (wire.TensorRef(5), steps, scale, slice(steps, None)), {}, ())
    packer = threading.Thread(target=wire.encode_batch, args=(3, [row]))
    packer.start()
    packer.join()
    wire.encode_batch(3, [row])
    assert steps.used_at is None and scale.used_at is None
    assert steps > 0 and steps.used_at is not None and scale.used_at is None


def test_a_number_python_looks_at_is_kept_and_the_reason_given(mesh4):
    a = torch.randn(8, 4)
    x = dtorch.tensor(a, device_mesh=mesh4, placements=[Shard(0)])

    def branchy(x, p, cap):
        y = x * 2 if p > 0.5 else x * 3   # PYTHON LOOKS
        return y.clamp(max=cap) + p
    compiled = dtorch.compile(branchy, scalars=True)
    for p, cap in ((0.9, 0.5), (0.8, 0.5), (0.1, 0.5), (0.1, 0.7)):
        torch.testing.assert_close(compiled(x, p, cap).to_torch(), branchy(a, p, cap), rtol=0, atol=0)
    stats = compiled.stats()
    assert stats["captures"] == 4, stats
    assert set(stats["kept_scalars"]) == {"p", "cap"}
    assert stats["kept_scalars"]["p"].startswith("Python used its value at ")
    assert "test_compile_schedules.py" in stats["kept_scalars"]["p"]
    assert stats["kept_scalars"]["cap"] == "clamp takes it where its plan depends on the value"


def test_an_unknown_scalar_name_is_refused():
    with pytest.raises(ValueError, match="has no parameter 'lr'"):
        dtorch.compile(lambda x, scale: x * scale, scalars=("lr",))


def test_a_marked_number_among_ops_on_two_meshes(mesh4, mesh22):
    """A replay puts the number in every row that took it, on either mesh."""
    a, b = torch.randn(8, 4), torch.randn(4, 4)
    x = dtorch.tensor(a, device_mesh=mesh4, placements=[Shard(0)])
    y = dtorch.tensor(b, device_mesh=mesh22, placements=[Replicate(), Shard(1)])
    both = dtorch.compile(lambda x, y, t: (x + t, (y - t) * t), scalars=("t",))
    for t in (1.0, -2.5, 0.125):
        got_x, got_y = both(x, y, t)
        torch.testing.assert_close(got_x.to_torch(), a + t, rtol=0, atol=0)
        torch.testing.assert_close(got_y.to_torch(), (b - t) * t, rtol=0, atol=0)
    assert both.stats()["captures"] == 1
