"""8. Llama forward latency: dtorch.models.llama against transformers' LlamaForCausalLM with the
same weights.

  1 worker   dtorch on a (1,) mesh against transformers in this process: the runtime's overhead
             (the same kernels run in one worker instead of here)
  TP=2       dtorch's Megatron layout on 2 workers against PyTorch DTensor's parallelize_module
             (ColwiseParallel q/k/v/gate/up, RowwiseParallel o/down) on transformers' model in 2
             torch.distributed Gloo processes, the multi-controller peer
  DP=2       dtorch with the batch sharded on 2 workers against 2 torch.distributed processes
             each running its half of the batch (what DDP's forward is)

dtorch is timed from the call to the return of dtorch.synchronize(); the peers per forward, the
slowest rank per repetition. Logits are checked against transformers once, outside the timer.
Goal (issue 12): dtorch within 1.1x of the 1-process transformers figure, and at or below DTensor's.
"""
from __future__ import annotations

from . import dtorch_session
from .local_ranks import run_ranks
from .timing import Row, failed, guarded, not_installed, repeat, stopwatch

NAME = "llama_forward"
TITLE = "8. Llama forward latency (transformers' weights)"
BATCH = 4
TRANSFORMERS = "transformers, 1 process"
TP_PLAN = {f"model.layers.*.{name}": style for style, names in (
    ("colwise", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")),
    ("rowwise", ("self_attn.o_proj", "mlp.down_proj"))) for name in names}


def config_fields(suite) -> dict:
    """A small Llama with GQA (8 query heads, 4 key/value heads), sized by the suite."""
    hidden = suite.llama_hidden
    return dict(vocab_size=4 * hidden, hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_attention_heads=8,
                num_hidden_layers=suite.llama_layers, num_key_value_heads=4,
                max_position_embeddings=4 * suite.llama_seq, tie_word_embeddings=False)


def run(suite) -> list[Row]:
    case = f"{suite.llama_layers} layers, hidden {suite.llama_hidden}, batch {BATCH} x {suite.llama_seq} tokens"
    fields = config_fields(suite)
    try:
        import transformers  # noqa: F401 -- a test dependency; the benchmark needs it as the reference
    except ImportError:
        return [not_installed(NAME, case, TRANSFORMERS, "forward", "transformers")]
    reps, seq = max(1, suite.collective_reps // 2), suite.llama_seq
    # dtorch first (1 worker, then one pool of 2 for TP and DP), then the peers: the pool is
    # restarted once and closed while the peers' processes run
    layouts = (("1 worker", (1,), ("tp",), TRANSFORMERS), ("TP=2", (2,), ("tp",), "torch DTensor TP=2, 2 procs"),
               ("DP=2", (2,), ("dp",), "torch DP=2, 2 procs"))
    ours = {label: guarded(lambda: Row(NAME, case, f"dtorch {label}", "forward",
                                       _dtorch_seconds(fields, seq, shape, names, reps), reference=(case, peer)),
                           NAME, case, f"dtorch {label}", "forward") for label, shape, names, peer in layouts}
    rows = [guarded(lambda: Row(NAME, case, TRANSFORMERS, "forward", _transformers_seconds(fields, seq, reps)),
                    NAME, case, TRANSFORMERS, "forward"), ours["1 worker"]]
    try:   # both peers in one pair of processes: spawning one costs more than the forwards
        peers = _peer_seconds(fields, seq, reps, suite)
    except Exception as error:  # noqa: BLE001 -- reported on each peer row
        peers = error
    for label, _, _, peer in layouts[1:]:
        rows.append(failed(NAME, case, peer, "forward", peers) if isinstance(peers, Exception)
                    else Row(NAME, case, peer, "forward", peers[label]))
        rows.append(ours[label])
    return rows


def reference_model(fields: dict, seq: int):
    import torch
    import transformers
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()
    ids = torch.randint(0, fields["vocab_size"], (BATCH, seq), generator=torch.Generator().manual_seed(1))
    return model, ids


def _transformers_seconds(fields: dict, seq: int, reps: int) -> list[float]:
    import torch
    model, ids = reference_model(fields, seq)
    torch.set_num_threads(1)   # as each dtorch worker and each peer rank runs

    def once() -> float:
        elapsed = stopwatch()
        with torch.no_grad():
            model(ids)
        return elapsed()
    return repeat(once, reps)


def _dtorch_seconds(fields: dict, seq: int, shape, names, reps: int) -> list[float]:
    import dtorch
    from dtorch.models import LlamaForCausalLM
    reference, ids = reference_model(fields, seq)
    mesh = dtorch_session.mesh(shape, names)
    model = LlamaForCausalLM(reference.config, device_mesh=mesh)
    model.load_state_dict(reference.state_dict())
    _check(model(ids).logits.to_torch(), reference, ids)

    def once() -> float:
        elapsed = stopwatch()
        model(ids)
        dtorch.synchronize()
        return elapsed()
    return repeat(once, reps)


def _check(logits, reference, ids) -> None:
    import torch
    with torch.no_grad():
        expected = reference(ids).logits
    error = (logits - expected).abs().max().item()
    if error > 1e-3:
        raise RuntimeError(f"dtorch's logits differ from transformers' by {error:.3g}")


def _peer_seconds(fields: dict, seq: int, reps: int, suite) -> dict[str, list[float]]:
    """{"TP=2": samples, "DP=2": samples}, each sample the slower rank's forward."""
    dtorch_session.close()   # the peers' 2 processes get the cores to themselves, as dtorch's workers do
    per_rank = run_ranks(_peer_rank, 2, (fields, seq, reps), suite.process_timeout_s)
    return {label: [max(samples) for samples in zip(*(rank[label] for rank in per_rank))]
            for label in per_rank[0]}


def _peer_rank(rank: int, world: int, fields: dict, seq: int, reps: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    model, ids = reference_model(fields, seq)

    def timed(forward) -> list[float]:
        def once() -> float:
            dist.barrier()
            elapsed = stopwatch()
            with torch.no_grad():
                forward()
            return elapsed()
        return repeat(once, reps)
    own_batch = ids.chunk(world)[rank]
    results = {"DP=2": timed(lambda: model(own_batch))}          # DDP's forward: the local model, half the batch
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, init_device_mesh("cpu", (world,)), {k: styles[v]() for k, v in TP_PLAN.items()})
    results["TP=2"] = timed(lambda: model(ids))
    return results
