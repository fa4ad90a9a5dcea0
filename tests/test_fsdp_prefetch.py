"""fully_shard's prefetch (dtorch/nn/fsdp_prefetch.py, runtime/worker/fsdp_gather.py): forward
begins the next block's all-gather before the current block computes, backward the previous
block's gather again; the values are those of a run without prefetch bit for bit (and torch's),
with activation checkpointing too; at most one all-gather is in flight beyond the group in use;
a failed parameter fails the read, not the session."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import dtorch
from dtorch.errors import RemoteError
from dtorch.nn import fully_shard, set_modules_to_backward_prefetch, set_modules_to_forward_prefetch
from dtorch.ops.tensor_meta import tensor_meta
from dtorch.runtime import protocol
from dtorch.runtime.controller import session
from dtorch.spec.placements import Replicate, Shard

pytestmark = pytest.mark.timeout(120)

_PREFETCH = "fully_shard (prefetched all-gather)"


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 2 * width + 1), torch.nn.Linear(2 * width + 1, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, h):
        return h + self.down(torch.tanh(self.up(self.norm(h))))


class Net(torch.nn.Module):
    """Uneven widths over 4 ranks (7, 15); `checkpointed`: every block recomputed in backward."""

    def __init__(self, blocks: int = 4, width: int = 7, checkpointed: bool = False):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = torch.nn.Linear(width, 3)
        self.checkpointed = checkpointed

    def forward(self, h):
        for block in self.blocks:
            h = torch_checkpoint.checkpoint(block, h, use_reentrant=False) if self.checkpointed else block(h)
        return self.head(h)


def _sharded(reference, mesh, prefetch: bool):
    model = dtorch.distribute_module(copy.deepcopy(reference), mesh)
    for block in model.blocks:
        fully_shard(block, mesh.mesh_dim_names[0])
    fully_shard(model, mesh.mesh_dim_names[0])
    if not prefetch:
        for module in list(model.blocks) + [model]:
            set_modules_to_forward_prefetch(module, [])
            set_modules_to_backward_prefetch(module, [])
    return model


def _train(model, mesh, steps: int = 3, batch: int = 6):
    """Losses, then every parameter and (last step's) gradient, as torch tensors. A batch of 6
    leaves a rank of 4 an empty piece, so backward keeps the gathered parameters (RunOp.regather
    False); of 8, backward gathers them again."""
    optimizer = model and (dtorch.optim.AdamW if mesh else torch.optim.AdamW)(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses, grads = [], []
    for _ in range(steps):
        x = torch.randn(batch, 7, generator=g)
        loss = model(dtorch.distribute_tensor(x, mesh, [Shard(0)]) if mesh else x).pow(2).mean()
        loss.backward()
        grads = [p.grad.to_torch() if mesh else p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, [p.to_torch() if mesh else p.detach() for p in model.parameters()], grads


@contextlib.contextmanager
def _ops_sent():
    controller = session.controller()
    sent, submit = [], controller.submit

    def spy(command_type, *fields, **kwargs):
        if command_type is protocol.RunOp:
            sent.append(fields[2])
        return submit(command_type, *fields, **kwargs)
    controller.submit = spy
    try:
        yield sent
    finally:
        del controller.submit


def _in_flight_stats(mesh) -> torch.Tensor:
    """Each rank's (held, most) prefetched all-gathers begun and not finished (fsdp_gather's stat)."""
    controller = session.controller()
    (out_id,) = controller.new_ids(1)
    seq = controller.submit(protocol.RunOp, (out_id,), controller.define_mesh(mesh), "fsdp_prefetch_stats",
                            "fsdp_prefetch_stats", (), {"device": mesh.device_type}, (), False)
    spec = tensor_meta((2 * mesh.size(),), torch.int64, mesh, [Shard(0)])
    return dtorch.DTensor(out_id, spec, seq, controller).to_torch().view(mesh.size(), 2)


@pytest.mark.parametrize("ranks, checkpointed", [(2, False), (4, False), (4, True)],
                         ids=["fsdp2", "fsdp4", "fsdp4 checkpointed"])
def test_prefetch_trains_bit_equal_to_no_prefetch_and_as_torch(ranks, checkpointed, session):
    """3 AdamW steps: losses, gradients and parameters equal a run without prefetch bit for bit,
    and torch's within rounding; the later steps did prefetch (the first learns the order),
    except into checkpointed blocks (fsdp_prefetch.py says why); nothing is left in flight."""
    mesh = dtorch.init_device_mesh("cpu", (ranks,), mesh_dim_names=["fsdp"])
    torch.manual_seed(0)
    reference = Net(checkpointed=checkpointed)
    plain = _train(_sharded(reference, mesh, prefetch=False), mesh)
    with _ops_sent() as sent:
        prefetched = _train(_sharded(reference, mesh, prefetch=True), mesh)
    # steps 2 and 3: each block's, begun by the one before (the root's pre-forward begins the first)
    assert sent.count(_PREFETCH) == (0 if checkpointed else 2 * 4), sent
    assert _in_flight_stats(mesh)[:, 0].tolist() == [0] * ranks
    expected = _train(copy.deepcopy(reference), None)
    for got, plain_values, want in zip(prefetched, plain, expected):
        assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(got, plain_values))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_at_most_one_all_gather_is_in_flight_beside_the_group_in_use(mesh4):
    """The default keeps one group begun ahead, forward and backward (each worker counts the
    all-gathers begun and not finished); an explicit list of two begins two."""
    torch.manual_seed(0)
    model = _sharded(Net(blocks=4), mesh4, prefetch=True)
    _train(model, mesh4, steps=1, batch=8)   # learns the order
    _in_flight_stats(mesh4)   # (restarts the count)
    _train(model, mesh4, steps=1, batch=8)
    assert _in_flight_stats(mesh4).tolist() == [[0, 1]] * mesh4.size()
    set_modules_to_forward_prefetch(model.blocks[0], [model.blocks[1], model.blocks[2]])
    with dtorch.no_grad():   # (no backward: only forward's prefetch)
        model(dtorch.ones(4, 7, device_mesh=mesh4, placements=[Shard(0)])).to_torch()
    assert _in_flight_stats(mesh4).tolist() == [[0, 2]] * mesh4.size()


def test_an_empty_list_turns_prefetch_off(mesh4):
    """Forward and backward: no prefetch command, and no all-gather begun on any worker."""
    torch.manual_seed(0)
    model = _sharded(Net(blocks=3), mesh4, prefetch=False)
    _in_flight_stats(mesh4)   # (restarts the count)
    with _ops_sent() as sent:
        _train(model, mesh4, steps=2)
    assert _PREFETCH not in sent and sent.count("fully_shard (all-gather)") == 2 * 4
    assert _in_flight_stats(mesh4).tolist() == [[0, 0]] * 4
    with pytest.raises(TypeError, match="not fully sharded"):
        set_modules_to_forward_prefetch(model.blocks[0], [model.head])
    with pytest.raises(NotImplementedError, match="forward order"):
        set_modules_to_backward_prefetch(model.blocks[1], [model.blocks[0]])


def test_a_failed_parameter_in_a_prefetched_gather_fails_the_read(mesh4):
    """A parameter that failed on the workers joins its prefetched all-gather with zeros, so no
    peer waits; the failure comes back at the read, and the session goes on."""
    torch.manual_seed(0)
    model = _sharded(Net(blocks=2), mesh4, prefetch=True)
    _train(model, mesh4, steps=1)
    table = dtorch.randn(8, 7, device_mesh=mesh4, placements=[Replicate()])
    rows = dtorch.tensor(torch.tensor([0, 1, 2, 3, 4, 5, 6, 99]), device_mesh=mesh4, placements=[Replicate()])
    with dtorch.no_grad():
        broken = table[rows]   # fails on the workers only
        weight = model.blocks[1].down.weight
        weight.copy_(broken[:7, :].t()[:, :1].expand(7, 15).contiguous().redistribute(placements=weight.placements))
    with _ops_sent() as sent:
        out = model(dtorch.ones(4, 7, device_mesh=mesh4, placements=[Shard(0)]))
    assert _PREFETCH in sent
    with pytest.raises(RemoteError, match="index"):
        out.to_torch()
    assert dtorch.ones(3, device_mesh=mesh4, placements=[Shard(0)]).sum().item() == 3.0


def test_backward_begins_the_previous_groups_gather_again(mesh4):
    """Forward prefetch off: only backward's begins an all-gather (one at a time), and the
    gradients equal those without it."""
    torch.manual_seed(0)
    reference = Net(blocks=3)
    plain = _train(_sharded(reference, mesh4, prefetch=False), mesh4, steps=2, batch=8)
    model = _sharded(reference, mesh4, prefetch=True)
    for module in list(model.blocks) + [model]:
        set_modules_to_forward_prefetch(module, [])
    _in_flight_stats(mesh4)   # (restarts the count)
    got = _train(model, mesh4, steps=2, batch=8)
    assert _in_flight_stats(mesh4).tolist() == [[0, 1]] * mesh4.size()
    assert got[0] == plain[0] and all(torch.equal(a, b) for a, b in zip(got[1] + got[2], plain[1] + plain[2]))


LOST_DURING_PREFETCH = """
    import json, os, signal, time, torch, dtorch
    from dtorch.models import LlamaForCausalLM
    from dtorch.models.llama import LlamaSettings
    config = LlamaSettings(**{**LlamaSettings.DEFAULTS, "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
                              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2})
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["fsdp"])
    model = LlamaForCausalLM(config, device_mesh=mesh)
    ids = torch.randint(0, 64, (4, 32))
    model(ids, labels=ids).loss.backward()   # learns the order: the next forward prefetches
    dtorch.synchronize()
    victim = dtorch.workers()[1]["pid"]
    os.kill(victim, signal.SIGKILL)          # before the forward: rank 0 begins its all-gathers with no peer
    start = time.monotonic()
    loss = model(ids, labels=ids).loss       # each layer's gather begun by the one before
    try:
        loss.item()
        message = None
    except dtorch.DTorchError as error:
        message = f"{type(error).__name__}: {error}"
    seconds = time.monotonic() - start
    alone = dtorch.init_device_mesh("cpu", (1,))   # rank 0 alone: it answers once past its gathers
    survivor = alone.ranks == (0,) and dtorch.ones(3, device_mesh=alone).sum().item() == 3.0
    print(json.dumps({"seconds": seconds, "message": message, "survivor": survivor,
                      "waited": time.monotonic() - start}))
"""


def test_a_worker_lost_during_a_prefetched_gather_fails_the_read():
    """A worker killed just before a forward that prefetches: the surviving rank begins and waits
    on all-gathers its peer never joins; the read raises within seconds naming the lost rank, and
    nothing hangs. (Killed with the gathers already in flight, the same waits see it; the moment
    cannot be chosen from outside.)"""
    import json
    from support import run_script
    result = run_script(LOST_DURING_PREFETCH, timeout=150)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["message"] is not None and "rank 1" in report["message"], report
    assert report["seconds"] < 10 and report["survivor"] and report["waited"] < 60, report


def test_a_compiled_step_replays_the_prefetches_like_eager(mesh4):
    """dtorch.compile captures the prefetch commands like any other (the order learned on the
    first call) and replays them: losses and parameters equal eager's with prefetch bit for bit."""
    torch.manual_seed(0)
    reference = Net(blocks=3)

    def run(compiled: bool):
        model = _sharded(reference, mesh4, prefetch=True)
        optimizer = dtorch.optim.AdamW(model.parameters(), lr=1e-2)

        def step(x):
            loss = model(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss
        step = dtorch.compile(step) if compiled else step
        g = torch.Generator().manual_seed(1)
        batches = [dtorch.distribute_tensor(torch.randn(8, 7, generator=g), mesh4, [Shard(0)]) for _ in range(5)]
        with _ops_sent() as sent:
            losses = [step(x).item() for x in batches]
        return losses, [p.to_torch() for p in model.parameters()], step, sent
    eager_losses, eager_params, _, _ = run(False)
    losses, params, step, sent = run(True)
    assert _PREFETCH in sent and step.stats()["replays"] >= 2, step.stats()
    assert losses == eager_losses and all(torch.equal(a, b) for a, b in zip(params, eager_params))


def test_a_regather_begun_and_never_used_is_finished_not_held(mesh4):
    """Blocks that share a Parameter (and a 0-D one left whole): backward begins a group's
    regather that no node of this backward reads. Its all-gather was never waited, and its work
    kept the buffer alive: one gathered group more on every worker after each step."""
    from test_fsdp import _Pair, _copy
    torch.manual_seed(0)
    model = dtorch.distribute_module(_copy(_Pair()), mesh4)
    for block in (model.a, model.b, model):
        fully_shard(block, "dp")
    optimizer = dtorch.optim.AdamW(model.parameters(), lr=0.1)
    _in_flight_stats(mesh4)
    for _ in range(3):
        model(dtorch.distribute_tensor(torch.randn(4, 4), mesh4, [Shard(0)])).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        assert _in_flight_stats(mesh4)[:, 0].tolist() == [0] * mesh4.size()
