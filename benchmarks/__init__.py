"""dtorch's benchmark suite: `python -m benchmarks [--full | --smoke] [--only NAME]`.

One module per benchmark, each with NAME, TITLE and run(suite) -> list[Row]; every dtorch
number sits next to a reference measured in the same run. See docs/design/benchmarks.md.
"""
from __future__ import annotations

from . import (controller_scale, dispatch, end_to_end, fetch, fused_chain_suite, llama_forward, llama_train, mlp_step,
               peers, redistribute, relay_bytes, torch_dtensor, worker_start)

__all__ = ["BENCHMARKS"]

# In the order the table prints them.
BENCHMARKS = {module.NAME: module for module in (
    dispatch, end_to_end, fetch, redistribute, mlp_step, torch_dtensor, peers, llama_forward, worker_start,
    llama_train, relay_bytes, controller_scale, fused_chain_suite)}
