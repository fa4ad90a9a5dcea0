"""5. A model-shaped step: MLP blocks forward with DP=2 x TP=2 on 4 workers, against the same
math written by hand as a multi-controller torch.distributed program (megatron_mlp.py).

Mesh (2, 2) named ("dp", "tp"). Activations [S(0), R]; W1 [R, S(1)] (column parallel), W2
[R, S(0)] (row parallel) gives [S(0), P] on tp, redistributed to [S(0), R]. dtorch is timed
from the first op to the return of `dtorch.synchronize()`. The result is checked against
plain torch once, outside the timer: a wrong answer would make the timing meaningless.
"""
from __future__ import annotations

from . import dtorch_session
from .megatron_mlp import DP, TP, make_weights, megatron_step_seconds, reference_forward
from .timing import Row, guarded, stopwatch

NAME = "mlp_step"
TITLE = "5. MLP forward step, DP=2 x TP=2 on 4 workers"
HAND = "hand-written torch.distributed (4 procs)"
DTORCH = "dtorch (2,2) mesh"


def run(suite) -> list[Row]:
    case = f"{suite.mlp_layers} blocks, hidden {suite.mlp_hidden}, batch {suite.mlp_batch}"
    shape = (suite.mlp_layers, suite.mlp_hidden, suite.mlp_batch)
    return [
        guarded(lambda: Row(NAME, case, HAND, "step", megatron_step_seconds(
            *shape, suite.collective_reps, suite.process_timeout_s)), NAME, case, HAND, "step"),
        guarded(lambda: _dtorch_row(suite, case, shape), NAME, case, DTORCH, "step"),
    ]


def _dtorch_row(suite, case: str, shape) -> Row:
    import dtorch
    x, weights = _upload(*shape)
    _check_against_torch(x, weights, shape)
    samples = [_time_step(dtorch, x, weights) for _ in range(suite.collective_reps + 1)][1:]
    return Row(NAME, case, DTORCH, "step", samples, reference=(case, HAND))


def _upload(layers: int, hidden: int, batch: int):
    import dtorch
    from dtorch.spec.placements import Replicate, Shard
    mesh = dtorch_session.mesh((DP, TP), ("dp", "tp"))
    x, weights = make_weights(layers, hidden, batch)
    upload = lambda t, placements: dtorch.tensor(t, device_mesh=mesh, placements=placements)  # noqa: E731
    return (upload(x, [Shard(0), Replicate()]),
            [(upload(w1, [Replicate(), Shard(1)]), upload(w2, [Replicate(), Shard(0)])) for w1, w2 in weights])


def forward(x, weights):
    from dtorch.spec.placements import Replicate, Shard
    for w1, w2 in weights:
        x = ((x @ w1).relu() @ w2).redistribute(placements=[Shard(0), Replicate()])
    return x


def _check_against_torch(x, weights, shape) -> None:
    import torch
    expected = reference_forward(*make_weights(*shape))
    got = forward(x, weights).to_torch()
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
        raise RuntimeError(f"dtorch MLP differs from torch: max error {(got - expected).abs().max():.3g}")


def _time_step(dtorch, x, weights) -> float:
    elapsed = stopwatch()
    forward(x, weights)
    dtorch.synchronize()
    return elapsed()
