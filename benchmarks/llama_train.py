"""10. Llama training step: forward, backward, AdamW step and zero_grad of a small Llama
(transformers' weights), dtorch against the hand-written multi-controller program in
torch.distributed Gloo processes on the same machine, in the same run (train_baselines.py):

  1 worker   dtorch on a (1,) mesh against transformers + torch.optim.AdamW in one process of its own
  dp4        ("dp",) of 4 against DistributedDataParallel over 4 processes; also with the whole
             step as one dtorch.compile'd function (goal: within 1.05x of DDP); and both again with
             a warmup + cosine LambdaLR stepped after every step (issue 45: the compiled step
             takes the new lr as an input of its replay; goal: at most the eager step's time)
  fsdp4      ("fsdp",) of 4 (dtorch.nn.fully_shard per layer and root) against FSDP2's
             fully_shard over 4 processes; fsdp2 (and the 1 worker run, an fsdp of 1) show how
             peak memory falls with the fsdp size; fsdp4 again without prefetch (each layer's
             all-gather begun only at its own forward / backward: docs/design/training.md)
  tp2        ("tp",) of 2 against DTensor's parallelize_module (benchmark 8's Megatron plan)
  pp2 xm     ("pp",) of 2 with m microbatches, against dtorch's own 1 worker (the same work on
             one process); the note gives the pipeline bubble

torch.compile baselines (train_baselines.py, `suite.train_compile_backend`; None leaves them out):
DDP, FSDP2 and DTensor TP each again with torch.compile, their first step's time cold (empty
compile caches) and warm (after torch._dynamo.reset()) in the note, beside the step time; the dp,
fsdp and tp goals (issue 46) divide dtorch's fused rows (`fused_layouts`: the step under
dtorch.compile(backend="inductor")) by them. A fused row's note gives its compile, cold (the
pool's TORCHINDUCTOR_CACHE_DIR is a fresh folder) and warm (a second step function of the same
layout): fused_compile_seconds.

A sample is one step after two warm-up steps: dtorch's from the forward call to the return of dtorch.synchronize(), a
torch layout's the slowest rank's, after a barrier. Each dtorch layout's first loss is checked
against transformers' on the same weights and batch, outside the timer.

Memory: every timed process (dtorch's workers, torch's ranks, the 1-process reference: all
started alike, since freeing large buffers to the OS costs page faults a reused heap does not,
~30% of a step here) starts with MALLOC_MMAP_THRESHOLD_ set (process_memory.py). Its resident
set is read before the layout's model is built (idle: torch, the libraries, earlier layouts'
leftovers) and its peak-RSS mark (VmHWM) is reset after the
warm-up steps (the model, the optimizer state and the allocator's working set exist by then).
The note gives, for the process with the highest peak during the timed steps, the peak and its
split into idle + what the layout added: the second number is the one fsdp shards. It ends with
the host's steal during the row's timed steps (steal.py). The dp rows and DDP's, eager and
torch.compile'd, take their steps in turns (ddp_turns.py); the other rows and their references
are timed at different moments of the run, so a ratio between rows whose steal differs says little.

Pipeline bubble, measured: a pp worker's busy time over the timed steps is the time its main
thread ran or was runnable (/proc/<pid>/schedstat; a worker waiting for a stage's activations or
for a command sleeps, and waiting for a core on a shared machine counts as busy), so the bubble
is 1 - sum(busy) / (stages * step time). The GPipe model (p - 1) / (m + p - 1) is printed beside it.

Threads: every process computes on one intra-op thread (the ranks, the 1-process reference, and
dtorch's workers, whose pool gives each cpu_count // pool size threads: 1 on the 2-core machine
of the published run; see _pool_size for the 1-worker mesh).
"""
from __future__ import annotations

import contextlib
import gc
import math
import os
import tempfile
from dataclasses import dataclass, replace

from . import dtorch_session
from .llama_forward import config_fields
from .ddp_turns import DdpTurns
from .local_ranks import run_ranks
from .process_memory import busy_seconds, peak_mib, reset_peak, returned_buffers, rss_mib
from .steal import Meter, describe
from .timing import Row, failed, guarded, median, not_installed, repeat, stopwatch
from .train_baselines import TP_RANKS as TP_WORLD
from .train_baselines import COMPILED, one_process, tiny_fields, train_rank

NAME = "llama_train"
TITLE = "10. Llama training step (forward, backward, AdamW, zero_grad)"
PER = "step"
LOSS_RTOL = 1e-4
WARMUP_STEPS = 2   # the first step makes the optimizer state, the second is the first of the steady state
ONE_PROCESS = "transformers + AdamW, 1 process"
ONE_WORKER = "dtorch 1 worker (fsdp1)"


@dataclass(frozen=True)
class Layout:
    variant: str
    shape: tuple                    # the mesh, one dim named `dim`
    dim: str
    microbatches: int | None = None
    reference: str | None = None    # the variant this one is divided by
    schedule: str | None = None     # model.forward_backward's ("gpipe", "1f1b"); None: loss.backward()
    compiled: bool = False          # the whole step as one dtorch.compile'd function (docs/design/compile.md)
    lr_schedule: bool = False       # a warmup + cosine LambdaLR stepped after each step, inside the timer
    checkpointed: bool = False      # gradient_checkpointing_enable(): each layer recomputed in backward
    prefetch: bool = True           # fully_shard's forward and backward prefetch (False: turned off per module)
    backend: str | None = None      # dtorch.compile(step, backend=...) for a compiled layout; None: the default


def peer_variants(world: int, compiled: bool = False) -> dict[str, str]:
    """train_baselines.py's layouts -> their rows' variant names (`compiled`: the torch.compile'd
    ones too)."""
    eager = {"DDP": f"torch DDP, {world} procs", "FSDP2": f"torch FSDP2 fully_shard, {world} procs",
             "TP": f"torch DTensor parallelize_module, {TP_WORLD} procs"}
    if not compiled:
        return eager
    return {**eager, **{key + COMPILED: variant + COMPILED for key, variant in eager.items()}}


def fused_layouts(suite, backend: str) -> list[Layout]:
    """dtorch's fused rows: the dp, fsdp and tp steps as one dtorch.compile'd function with
    `backend` (issue 46's "compiled and fused": each run of the forward's local ops one compiled
    function with a compiled backward), against the torch.compile'd peers."""
    world, peers = suite.train_world, peer_variants(suite.train_world, compiled=True)
    fused = [Layout(f"dtorch dp{world}, dtorch.compile step ({backend})", (world,), "dp",
                    reference=peers["DDP" + COMPILED], compiled=True, backend=backend),
             Layout(f"dtorch fsdp{world}, dtorch.compile step ({backend})", (world,), "fsdp",
                    reference=peers["FSDP2" + COMPILED], compiled=True, backend=backend),
             Layout(f"dtorch tp{TP_WORLD}, dtorch.compile step ({backend})", (TP_WORLD,), "tp",
                    reference=peers["TP" + COMPILED], compiled=True, backend=backend)]
    # the smoke suite checks the path on dp alone: each fused row compiles twice (cold, warm)
    return fused[:1] if suite.name == "smoke" else fused


def layouts(suite) -> list[Layout]:
    """dtorch's layouts in the order of the table; the peers' rows go before the layouts that refer to them.
    `suite.train_world` is the dp / fsdp size compared with DDP / FSDP2."""
    world, peers = suite.train_world, peer_variants(suite.train_world)
    fsdp_sizes = sorted({world, *suite.train_fsdp_sizes} - {1})
    return [Layout(ONE_WORKER, (1,), "fsdp", reference=ONE_PROCESS),
            Layout(f"dtorch dp{world}", (world,), "dp", reference=peers["DDP"]),
            Layout(f"dtorch dp{world}, dtorch.compile step", (world,), "dp", reference=peers["DDP"], compiled=True),
            Layout(f"dtorch dp{world}, LambdaLR", (world,), "dp", reference=peers["DDP"], lr_schedule=True),
            Layout(f"dtorch dp{world}, dtorch.compile step, LambdaLR", (world,), "dp",
                   reference=f"dtorch dp{world}, LambdaLR", compiled=True, lr_schedule=True),
            *(Layout(f"dtorch fsdp{n}", (n,), "fsdp", reference=peers["FSDP2"] if n == world else None)
              for n in fsdp_sizes),
            Layout(f"dtorch fsdp{world}, no prefetch", (world,), "fsdp", reference=f"dtorch fsdp{world}",
                   prefetch=False),
            Layout(f"dtorch fsdp{world}, gradient checkpointing", (world,), "fsdp", reference=f"dtorch fsdp{world}",
                   checkpointed=True),
            Layout(f"dtorch tp{TP_WORLD}", (TP_WORLD,), "tp", reference=peers["TP"]),
            *(Layout(f"dtorch pp2, {m} microbatch{'es' if m > 1 else ''}", (2,), "pp", m, reference=ONE_WORKER)
              for m in suite.train_microbatches),
            *(Layout(f"dtorch pp2, {max(suite.train_microbatches)} microbatches, forward_backward {schedule}", (2,),
                     "pp", max(suite.train_microbatches), reference=ONE_WORKER, schedule=schedule)
              for schedule in ("gpipe", "1f1b") if len(suite.train_microbatches) > 1),
            *fused_layouts(suite, "inductor")]


def run(suite) -> list[Row]:
    fields = config_fields(replace(suite, llama_layers=suite.train_layers, llama_hidden=suite.train_hidden,
                                   llama_seq=suite.train_seq))
    case = (f"{suite.train_layers} layers, hidden {suite.train_hidden}, "
            f"batch {suite.train_batch} x {suite.train_seq} tokens")
    try:
        import transformers  # noqa: F401 -- a test dependency; the benchmark needs it as the reference
    except ImportError:
        return [not_installed(NAME, case, ONE_PROCESS, PER, "transformers")]
    with returned_buffers(), fresh_inductor_cache():
        dtorch_session.close()   # the next pool starts with the variables in its environment
        ddp = _DdpRow(suite, fields, case)
        try:
            ours = _dtorch_rows(suite, fields, case, ddp)
        finally:
            ddp.close()
            dtorch_session.close()   # the peers get the cores to themselves, as dtorch's workers do
        peers = {**_peer_rows(suite, fields, case, skip=ddp.keys), **ddp.rows()}
        one = guarded(lambda: _one_process_row(suite, fields, case), NAME, case, ONE_PROCESS, PER)
    rows = [one]
    variants = peer_variants(suite.train_world, compiled=bool(suite.train_compile_backend))
    for layout in layouts(suite):   # each peer row just before the first dtorch row that refers to it
        rows += [peers.pop(key) for key, variant in variants.items() if variant == layout.reference and key in peers]
        rows.append(ours[layout.variant])
    for key in list(variants):   # the compiled peers: after their eager rows' dtorch rows
        if key in peers:
            rows.append(peers.pop(key))
    return rows


@contextlib.contextmanager
def fresh_inductor_cache():
    """Workers and ranks started inside this block compile into an empty TORCHINDUCTOR_CACHE_DIR
    (one per run, removed after): the fused rows' cold compile is cold."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="dtorch-bench-inductor-") as folder:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


# --- dtorch ------------------------------------------------------------------------------------------------
def _dtorch_rows(suite, fields: dict, case: str, ddp: _DdpRow) -> dict[str, Row]:
    """{variant: row}, run in pool-size order so that each pool starts once."""
    import torch
    reference_model, ids = _reference(fields, suite)
    with torch.no_grad():
        expected_loss = reference_model(ids, labels=ids).loss.item()
    start = (reference_model, ids, expected_loss)
    tiny = _reference(tiny_fields(fields), suite)
    rows = {}
    for layout in sorted(layouts(suite), key=_pool_size):
        rows[layout.variant] = guarded(lambda: _dtorch_row(suite, start, tiny, case, layout, ddp),
                                       NAME, case, layout.variant, PER)
    return rows


def _dtorch_row(suite, start, tiny, case: str, layout: Layout, ddp: _DdpRow) -> Row:
    """One layout's steps; `start` is (transformers' model, the batch, its loss), `tiny` a tiny
    model and batch to warm the layout's code paths with. A layout compared with DDP takes its
    steps in turns with DDP's (`ddp`), one each."""
    import dtorch
    mesh = _mesh(layout)
    pids = [worker["pid"] for worker in dtorch.workers() if worker["rank"] in mesh.ranks]
    repeat(_stepper(*tiny, mesh, layout.microbatches, []), WARMUP_STEPS, warmup=0)
    gc.collect()
    dtorch.synchronize()   # the tiny model and the previous layout's tensors are freed
    idle = [rss_mib(pid) for pid in pids]
    reference_model, ids, expected_loss = start
    losses = []
    make = lambda kept: _stepper(reference_model, ids, mesh, layout.microbatches, kept, layout.schedule,  # noqa: E731
                                 layout.compiled, layout.checkpointed, layout.lr_schedule, layout.prefetch,
                                 layout.backend)
    compiles = ""
    if layout.backend:   # a first step function compiles cold, the timed one warm (fused_compile_seconds)
        cold = fused_compile_seconds(make([]))
        once = make(losses)
        compiles = f"first fused steps (compile) {cold:.1f} s cold, {fused_compile_seconds(once):.1f} s warm; "
    else:
        once = make(losses)
        repeat(once, WARMUP_STEPS, warmup=0)
    _check_loss(losses[0].item(), expected_loss)
    for pid in pids:
        reset_peak(pid)
    busy, meter = [busy_seconds(pid) for pid in pids], Meter()
    if ddp.takes_turns(layout):
        samples, turns = [], f" (in turns with {' and '.join(ddp.variants.values())}'s steps)"
        for _ in range(suite.train_reps):
            samples += repeat(once, 1, warmup=0)
            ddp.step()
    else:
        samples, turns = repeat(once, suite.train_reps, warmup=0), ""
    busy = [busy_seconds(pid) - before for pid, before in zip(pids, busy)]
    note = compiles + memory_note([peak_mib(pid) for pid in pids], idle) + f"; {describe(meter.share())}{turns}"
    if layout.microbatches:
        note += "; " + _bubble_note(sum(busy) / len(samples), median(samples), len(pids), layout.microbatches)
    del once, losses
    gc.collect()   # the next layout on this pool starts without this one's tensors
    return Row(NAME, case, layout.variant, PER, samples, note=note,
               reference=(case, layout.reference) if layout.reference else None)


def _stepper(reference_model, ids, mesh, microbatches, losses: list, schedule: str | None = None,
             compiled: bool = False, checkpointed: bool = False, lr_schedule: bool = False, prefetch: bool = True,
             backend: str | None = None):
    """A function that runs one timed training step of transformers' model on `mesh` and
    keeps the first step's loss in `losses`. Compiled: the step is one dtorch.compile'd function (the two
    warm-up steps capture it; the timed ones replay it), the batch uploaded inside the timer.
    lr_schedule: a LambdaLR (warmup, then cosine) steps after each step, inside the timer.
    prefetch=False: every fully-sharded module's forward and backward prefetch turned off."""
    import dtorch
    from dtorch.models import LlamaForCausalLM
    model = LlamaForCausalLM(reference_model.config, device_mesh=mesh, microbatches=microbatches)
    model.load_state_dict(reference_model.state_dict())
    if checkpointed:
        model.gradient_checkpointing_enable()
    if not prefetch:
        no_prefetch(model)
    optimizer = dtorch.optim.AdamW(model.parameters(), lr=1e-3)
    step = compiled_step(model, optimizer, backend)
    scheduler = warmup_cosine(optimizer) if lr_schedule else None

    def once() -> float:
        elapsed = stopwatch()
        if compiled:
            loss = step(model._upload(ids))
            if scheduler is not None:
                scheduler.step()
            dtorch.synchronize()
            _keep_first(losses, loss)
            return elapsed()
        if schedule:   # per-microbatch backwards in the pipeline schedule's order
            loss = model.forward_backward(ids, ids, schedule=schedule)
        else:
            loss = model(ids, labels=ids).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        dtorch.synchronize()
        _keep_first(losses, loss)
        return elapsed()
    return once


def fused_compile_seconds(once) -> float:
    """The compile of a fused step function (dtorch.compile(backend="inductor")): after the two
    captures (untimed), the first replay runs the forward's ops and compiles their fused functions
    beside them, and the second compiles their backward at its first backward; their seconds,
    less two steps. Cold where the workers' TORCHINDUCTOR_CACHE_DIR has not seen these graphs
    (llama_train.run starts the pool on a fresh one), warm where it has (a second step function
    of the same layout: dynamo traces again, inductor's FX graph cache answers)."""
    repeat(once, WARMUP_STEPS, warmup=0)
    compiling = repeat(once, 2, warmup=0)
    return sum(compiling) - 2 * median(repeat(once, 2, warmup=0))


def warmup_cosine(optimizer, warmup: int = 3, total: int = 100):
    """The schedule of a fine-tune (issue 45): a linear warmup, then a cosine decay; the lr
    changes at every step."""
    import torch
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: (step + 1) / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * step / total)))


def no_prefetch(model) -> None:
    """Turn fully_shard's prefetch off on every fully-sharded module of `model`."""
    from dtorch.nn import set_modules_to_backward_prefetch, set_modules_to_forward_prefetch
    from dtorch.nn.fsdp import is_fully_sharded
    for module in model.modules():
        if is_fully_sharded(module):
            set_modules_to_forward_prefetch(module, [])
            set_modules_to_backward_prefetch(module, [])


def compiled_step(model, optimizer, backend: str | None = None):
    """The training step (forward with labels, backward, optimizer step, zero_grad) as one
    dtorch.compile'd function of the uploaded batch, returning the loss. `backend`: passed to
    dtorch.compile when given (the fused rows, fused_layouts)."""
    import dtorch
    compile_step = dtorch.compile if backend is None else lambda fn: dtorch.compile(fn, backend=backend)

    @compile_step
    def step(uploaded):
        loss = model(uploaded, labels=uploaded).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss
    return step


def _keep_first(losses: list, loss) -> None:
    """The first step's loss is checked against transformers'; later ones are dropped, as the torch
    programs drop theirs: a kept loss keeps its step's autograd graph alive on every worker, and
    keeping every step's cost dp4 10-12 ms a step (4 ms of each worker's CPU) in alternated runs."""
    if not losses:
        losses.append(loss)


def _pool_size(layout: Layout) -> int:
    """A pool gives each worker cpu_count // pool size intra-op threads. Two OpenMP threads on a
    busy shared 2-core machine wait on each other (a 0.3 s step took 2-4 s), so the 1-worker mesh
    is taken from a pool of 2, and computes on one thread like every other process here."""
    return max(2, math.prod(layout.shape))


def _mesh(layout: Layout):
    from dtorch.spec.placements import init_device_mesh
    pool = dtorch_session.mesh((_pool_size(layout),))
    if math.prod(layout.shape) == pool.size():
        return dtorch_session.mesh(layout.shape, (layout.dim,))
    return init_device_mesh("cpu", layout.shape, mesh_dim_names=[layout.dim])   # the pool's first workers


def _reference(fields: dict, suite):
    import torch
    import transformers
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
    ids = torch.randint(0, fields["vocab_size"], (suite.train_batch, suite.train_seq),
                        generator=torch.Generator().manual_seed(1))
    return model, ids


def _check_loss(loss: float, expected: float) -> None:
    if abs(loss - expected) > LOSS_RTOL * abs(expected):
        raise RuntimeError(f"dtorch's first loss {loss} differs from transformers' {expected}")


def memory_note(peaks: list[float], idle: list[float]) -> str:
    """The process with the highest peak: its peak, and how much of it the idle process held."""
    peak, base = max(zip(peaks, idle))
    return f"peak {peak:.0f} MiB = idle {base:.0f} + {peak - base:.0f} (max of {len(peaks)} procs)"


def _bubble_note(busy_per_step: float, step: float, stages: int, microbatches: int) -> str:
    measured = 1 - busy_per_step / (stages * step)
    model = (stages - 1) / (microbatches + stages - 1)
    return f"bubble {measured:.0%} measured (stage busy time), GPipe model {model:.0%}"


# --- torch ---------------------------------------------------------------------------------------------------
class _DdpRow:
    """The DDP references of the dp layouts, eager and (with the suite's compile backend)
    torch.compile'd, measured in turns with them (ddp_turns.py): their ranks start before
    dtorch's pools and wait while dtorch's other layouts run; each dp step of dtorch's is
    followed by one step of each."""

    def __init__(self, suite, fields: dict, case: str) -> None:
        backend = suite.train_compile_backend
        variants = peer_variants(suite.train_world, compiled=bool(backend))
        self.keys = ("DDP", "DDP" + COMPILED) if backend else ("DDP",)
        self.variants = {key: variants[key] for key in self.keys}
        self.case, self.backend, self.samples = case, backend, {key: [] for key in self.keys}
        self._turns, self._last, self._first, self._error = None, None, None, None
        try:
            self._turns = DdpTurns(fields, _reference(fields, suite)[1], suite.train_world,
                                   timeout_s=suite.process_timeout_s * 4,
                                   compile_backend=backend)
            self._first = self._turns.turn(WARMUP_STEPS, warmup=True)
        except Exception as error:  # noqa: BLE001 -- the DDP rows report it; dtorch's rows still run
            self._error = error

    def takes_turns(self, layout: Layout) -> bool:
        return layout.reference in self.variants.values()

    def step(self) -> None:
        """One step of each DDP model (its slowest rank's time joins its row), unless the ranks failed."""
        if self._error is not None:
            return
        try:
            self._last = self._turns.turn(1)
        except Exception as error:  # noqa: BLE001 -- as above
            self._error = error
            return
        for key, turn in zip(self.keys, self._last):
            self.samples[key] += turn.walls

    def rows(self) -> dict[str, Row]:
        if self._error is not None or not self.samples["DDP"]:
            error = self._error or RuntimeError("no DDP step was measured")
            return {key: failed(NAME, self.case, variant, PER, error) for key, variant in self.variants.items()}
        rows = {}
        for key, last, first in zip(self.keys, self._last, self._first):
            note = memory_note(last.peak_mib, self._turns.idle_mib)
            note += "; in turns with the dtorch dp rows, one step each"
            if len(self.keys) > 1:
                note += "; each rank holds both models, so the peak counts both"
            if key != "DDP":
                note = f"torch.compile({self.backend}) first step: cold {first.walls[0]:.1f} s; {note}"
            rows[key] = Row(NAME, self.case, self.variants[key], PER, self.samples[key], note=note)
        return rows

    def close(self) -> None:
        if self._turns is not None:
            self._turns.close()


def _one_process_row(suite, fields: dict, case: str) -> Row:
    """transformers + AdamW in a process of its own, started as the workers and ranks are."""
    (result,) = run_ranks(one_process, 1, (fields, suite.train_batch, suite.train_seq, suite.train_reps,
                                           WARMUP_STEPS), suite.process_timeout_s)
    return Row(NAME, case, ONE_PROCESS, PER, result["samples"],
               note=memory_note([result["peak_mib"]], [result["idle_mib"]]) + "; " + describe(result["steal"]))


def _peer_rows(suite, fields: dict, case: str, skip: tuple) -> dict[str, Row]:
    backend = suite.train_compile_backend
    variants = peer_variants(suite.train_world, compiled=bool(backend))
    try:  # one process group for FSDP2 and TP: spawning one costs more than the steps (DDP: _DdpRow)
        per_rank = run_ranks(train_rank, suite.train_world,
                             (fields, suite.train_batch, suite.train_seq, suite.train_reps, WARMUP_STEPS, skip,
                              backend), suite.process_timeout_s * (3 if backend else 1))
    except Exception as error:  # noqa: BLE001 -- reported on each peer row
        return {key: failed(NAME, case, variant, PER, error) for key, variant in variants.items()}
    rows = {}
    for key, variant in variants.items():
        ranks = [rank[key] for rank in per_rank if key in rank]
        if not ranks:
            continue
        slowest = [max(samples) for samples in zip(*(rank["samples"] for rank in ranks))]
        note = memory_note([rank["peak_mib"] for rank in ranks], [rank["idle_mib"] for rank in ranks])
        rows[key] = Row(NAME, case, variant, PER, slowest, note=compile_note(ranks, backend) + note + "; "
                        + describe(ranks[0]["steal"]))
    return rows


def compile_note(ranks: list, backend: str | None) -> str:
    """A compiled layout's first step, compile included, cold and warm (the slowest rank's)."""
    if "cold_s" not in ranks[0]:
        return ""
    cold, warm = max(rank["cold_s"] for rank in ranks), max(rank["warm_s"] for rank in ranks)
    return f"torch.compile({backend}) first step: cold {cold:.1f} s, warm {warm:.1f} s; "
