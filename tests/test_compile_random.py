"""Random small programs, compiled and replayed, against the same program in torch: arguments,
tensors from before the call (closures) and temporaries changed in place, directly, through a
view (`x[1].add_(...)`) or by assignment (`x[:, 0] = ...`), outputs returned and fed back as the
next call's arguments. After every call, each output, argument and closure tensor must equal
torch's. Before three replay fixes of 2026-12-04 (argument ids read after the function ran, a
caller's id equal to one the graph writes, an EMA's new value moved over), 54 of the first 60
programs failed. DTORCH_COMPILE_PROGRAMS sets how many programs (default 100, seeded).
Then random training steps (backward and in-place updates inside the compiled function) on a
2-D mesh: DTORCH_COMPILE_TRAINING_PROGRAMS (default 24)."""
from __future__ import annotations

import os
import random

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard

pytestmark = pytest.mark.timeout(600)

PROGRAMS = int(os.environ.get("DTORCH_COMPILE_PROGRAMS", "100"))
CALLS = 4
SHAPE = (4, 3)


def _program(rng: random.Random) -> tuple:
    """(argument count, steps, returned names, whether outputs feed back). A step changes a
    name in place, `("inplace" | "view" | "setitem", target, op, other, k)`, or makes one,
    `("new", name, op, a, b, k)`."""
    arguments, steps, made = rng.randint(1, 3), [], []
    names = lambda: [f"a{i}" for i in range(arguments)] + ["c0", "c1"] + made   # noqa: E731
    for _ in range(rng.randint(2, 6)):
        op, k = rng.choice(["add", "mul", "sub"]), round(rng.uniform(0.5, 1.5), 2)
        kind = rng.choice(["argument", "closure", "temporary", "new", "new", "view", "setitem"])
        if kind in ("view", "setitem"):
            target = rng.choice(names())
            steps.append((kind, target, op, rng.choice(names()), k))
            continue
        if kind == "new" or (kind == "temporary" and not made):
            steps.append(("new", f"t{len(made)}", op, rng.choice(names()), rng.choice(names()), k))
            made.append(f"t{len(made)}")
            continue
        target = {"argument": f"a{rng.randrange(arguments)}", "closure": f"c{rng.randrange(2)}",
                  "temporary": rng.choice(made) if made else "c0"}[kind]
        steps.append(("inplace", target, op, rng.choice(names()), k))
    returned = rng.sample([f"a{i}" for i in range(arguments)] + made, k=min(arguments + len(made), rng.randint(1, 3)))
    return arguments, steps, returned, rng.random() < 0.5


def _run(steps, env: dict, returned) -> tuple:
    for step in steps:
        if step[0] == "view":
            _, target, op, other, k = step
            getattr(env[target][1], op + "_")(env[other][2] * k)
            continue
        if step[0] == "setitem":
            _, target, op, other, k = step
            env[target][:, 0] = getattr(env[other][:, 1], op)(k)
            continue
        if step[0] == "inplace":
            _, target, op, other, k = step
            getattr(env[target], op + "_")(env[other] * k)
        else:
            _, name, op, a, b, k = step
            env[name] = getattr(env[a], op)(env[b] * k) * 0.5
    return tuple(env[name] for name in returned)


@pytest.mark.parametrize("seed", range(PROGRAMS))
def test_a_random_program_replays_as_torch_runs_it(seed, mesh4):
    rng = random.Random(seed)
    arguments, steps, returned, feed_back = _program(rng)
    values = [torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed * 8 + i)) for i in range(arguments + 2)]
    up = lambda v: dtorch.tensor(v, device_mesh=mesh4, placements=[rng.choice([Shard(0), Replicate()])])  # noqa: E731
    want_args, want_closures = [v.clone() for v in values[:arguments]], [v.clone() for v in values[arguments:]]
    got_args, got_closures = [up(v) for v in values[:arguments]], [up(v) for v in values[arguments:]]

    def program(closures):
        return lambda *args: _run(steps, {**{f"a{i}": a for i, a in enumerate(args)},
                                          "c0": closures[0], "c1": closures[1]}, returned)
    compiled, reference = dtorch.compile(program(got_closures)), program(want_closures)
    for call in range(CALLS):
        got, want = compiled(*got_args), reference(*want_args)
        where = f"program {steps}, returning {returned}, call {call}"
        for name, g, w in [*zip(returned, got, want), *zip(("a0", "a1", "a2"), got_args, want_args),
                           *zip(("c0", "c1"), got_closures, want_closures)]:
            torch.testing.assert_close(g.to_torch(), w, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m} ({where})")
        if feed_back:
            for i in range(min(arguments, len(got))):
                got_args[i], want_args[i] = got[i], want[i]


TRAINING_PROGRAMS = int(os.environ.get("DTORCH_COMPILE_TRAINING_PROGRAMS", "24"))
UNARY = ("tanh", "sigmoid", "relu", "neg", "sin", "square")
LAYOUTS = ([Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(1), Replicate()], [Replicate(), Replicate()])


@pytest.mark.parametrize("seed", range(TRAINING_PROGRAMS))
def test_a_random_training_step_replays_as_torch_runs_it(seed, mesh22):
    """A compiled step of random ops over parameters that require grad (closures) and an input:
    backward inside, gradients set to None first or accumulated, parameters updated in place
    under no_grad or not. Each call's loss, every parameter and every gradient equal torch's."""
    rng = random.Random(seed)
    count = rng.randint(1, 3)
    program = [(rng.choice(("unary", "binary", "binary")), rng.randrange(count + 1), rng.randrange(count),
                rng.choice(UNARY), rng.choice(("add", "mul", "sub"))) for _ in range(rng.randint(2, 5))]
    zero_first, update = rng.random() < 0.5, rng.random() < 0.6
    values = [torch.randn(4, 6, generator=torch.Generator().manual_seed(seed * 8 + i)) for i in range(count + 1)]
    want = [v.clone().requires_grad_() for v in values[:count]]
    got = [dtorch.tensor(v, device_mesh=mesh22, placements=rng.choice(LAYOUTS), requires_grad=True)
           for v in values[:count]]
    x = dtorch.tensor(values[count], device_mesh=mesh22, placements=rng.choice(LAYOUTS))

    def step(parameters, x, no_grad):
        if zero_first:
            for p in parameters:
                p.grad = None
        made = list(parameters) + [x]
        for kind, a, b, unary, op in program:   # a binary op's right operand is a parameter
            made.append(getattr(made[a], unary)() if kind == "unary" else getattr(made[a], op)(made[b]))
        loss = sum((v * (i + 1)).sum() for i, v in enumerate(made[count + 1:])) * 0.01 + parameters[0].sum() * 0
        loss.backward()
        if update:
            with no_grad():
                for p in parameters:
                    if p.grad is not None:
                        p.sub_(p.grad * 0.05)
        return loss
    compiled = dtorch.compile(lambda x: step(got, x, dtorch.no_grad))
    for call in range(CALLS):
        where = f"program {program}, zero_first={zero_first}, update={update}, call {call}"
        loss, want_loss = compiled(x), step(want, values[count], torch.no_grad)
        torch.testing.assert_close(loss.to_torch(), want_loss.detach(), rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{m} ({where})")
        for g, w in zip(got, want):
            torch.testing.assert_close(g.to_torch(), w.detach(), rtol=1e-4, atol=1e-4, msg=lambda m: f"{m} ({where})")
            assert (g.grad is None) == (w.grad is None), where
            if w.grad is not None:
                torch.testing.assert_close(g.grad.to_torch(), w.grad, rtol=1e-4, atol=1e-4,
                                           msg=lambda m: f"{m} ({where})")
