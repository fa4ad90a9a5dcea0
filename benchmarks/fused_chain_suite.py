"""13. The fused chain in the suite (`python -m benchmarks --only fused_chain`): benchmarks/
fused_chain.py's measurement as the suite's rows. A module of its own, which imports fused_chain
only when it runs, so that `python -m benchmarks.fused_chain` does not find itself imported by
the package first (runpy warns of that)."""
from __future__ import annotations

from .timing import Row, failed

NAME = "fused_chain"
TITLE = "13. Fused chain: dtorch.compile(backend='inductor') against torch.compile, 1 process"


def run(suite) -> list[Row]:
    """The suite's rows: per call, torch eager and torch.compile in this process and, on each
    worker count, dtorch fused (the warm session's) and replayed; then the first calls' seconds,
    cold and warm. The smoke suite runs a short chain on the host's cache."""
    from . import dtorch_session
    from .fused_chain import SHAPE, TORCH_COMPILE, TORCH_EAGER, measure
    dtorch_session.close()   # this benchmark opens its own sessions (a cold and a warm one)
    case, first_case = f"{SHAPE}, {suite.fused_ops} ops", f"{SHAPE}, {suite.fused_ops} ops: first call"
    try:
        torch_rows, sessions = measure(suite.fused_ops, suite.fused_calls, suite.fused_rounds, suite.fused_worlds,
                                       cold_caches=suite.name != "smoke")
    except Exception as error:  # noqa: BLE001 -- one error row; the suite goes on
        return [failed(NAME, case, "dtorch fused", "call", error)]
    compiled = (case, TORCH_COMPILE)
    rows = [Row(NAME, case, TORCH_EAGER, "call", torch_rows["torch eager"]),
            Row(NAME, case, TORCH_COMPILE, "call", torch_rows["torch.compile, 1 process"]),
            Row(NAME, first_case, "torch.compile, cold", "call", [torch_rows["torch.compile first"]])]
    for workers, (cold, warm) in sessions.items():
        label = f"{workers} worker{'s' if workers > 1 else ''}"
        rows += [Row(NAME, case, f"dtorch fused, {label}", "call", warm["fused"], reference=compiled,
                     note=f"{min(warm['fused']) / min(torch_rows['torch eager']):.2f}x torch eager (best over best)"),
                 Row(NAME, case, f"dtorch replay, {label}", "call", warm["replay"], reference=compiled),
                 Row(NAME, first_case, f"dtorch fused, {label}, cold", "call", [cold["first"]],
                     reference=(first_case, "torch.compile, cold")),
                 Row(NAME, first_case, f"dtorch fused, {label}, warm", "call", [warm["first"]],
                     reference=(first_case, "torch.compile, cold"))]
    return rows
