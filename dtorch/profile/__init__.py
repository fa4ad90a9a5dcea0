"""dtorch.profile: a timeline of everything, on one clock (docs/design/profiling.md).

    with dtorch.profile("trace.json"):
        ...                                   # ops, reads, backward, optimizer steps
    python -m dtorch.profile summarize trace.json
    python -m dtorch.profile plot trace.json -o timeline.png

The trace is Chrome's Trace Event Format: Perfetto (ui.perfetto.dev) and chrome://tracing load it.
`dtorch.profile` is the context manager (dtorch/__init__.py re-exports it under this package's
name); `from dtorch.profile import summarize, plot, load, check_trace` reaches the rest.
"""
from __future__ import annotations

from .capture import profile
from .summary import load, summarize
from .timeline import plot
from .trace import check_trace

__all__ = ["profile", "load", "summarize", "plot", "check_trace"]
