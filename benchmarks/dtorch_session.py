"""One place that starts and stops dtorch workers for the benchmarks.

Benchmarks that need different world sizes ask for a mesh; the pool is restarted with exactly
that many workers, so idle extra workers never share the two cores with the ones measured.
"""
from __future__ import annotations

import math

__all__ = ["mesh", "close", "traffic", "traffic_note"]

_world_size: int | None = None


def mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None):
    """A device mesh of `shape` over a pool of exactly prod(shape) local CPU workers."""
    global _world_size
    import dtorch
    from dtorch.spec.placements import init_device_mesh
    world = math.prod(shape)
    if _world_size != world:
        close()
        dtorch.init(num_workers=world)
        _world_size = world
    return init_device_mesh("cpu", shape, mesh_dim_names=list(names) if names else None)


def close() -> None:
    global _world_size
    if _world_size is None:
        return
    import dtorch
    _world_size = None
    dtorch.shutdown()


def traffic() -> dict:
    """dtorch's message counters, or {} if this build does not keep them."""
    import dtorch
    stats = getattr(dtorch, "stats", None)
    return dict(stats()) if stats else {}


def traffic_note(before: dict, after: dict, units: int, per: str = "op") -> str:
    """'1 message per 240 ops, 35 B/op sent' from two `traffic()` snapshots around `units` units."""
    if not before or not after or units <= 0:
        return ""
    messages = after.get("messages_sent", 0) - before.get("messages_sent", 0)
    sent = (after.get("bytes_sent", 0) - before.get("bytes_sent", 0)) / units
    batching = f"1 message per {units / messages:.0f} {per}s" if 0 < messages < units else \
        f"{messages / units:.1f} messages/{per}"
    return f"{batching}, {sent:.0f} B/{per} sent"
