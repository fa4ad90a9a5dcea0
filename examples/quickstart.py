"""The first five minutes: one process, four local CPU workers, a global view."""
import asyncio

import torch

import dtorch
from dtorch import Replicate, Shard, init_device_mesh


def main() -> None:
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=["dp"])      # starts 4 local worker processes
    x = dtorch.randn(256, 128, device_mesh=mesh, placements=[Shard(0)])
    y = dtorch.randn(256, 128, device_mesh=mesh, placements=[Shard(0)])
    z = x + y                                                          # returns at once
    t = z.to_torch()                                                   # the full logical tensor
    print("z:", z)
    print("z.to_torch():", tuple(t.shape), "sum", round(t.sum().item(), 4))
    print("await z.fetch() matches:", torch.equal(asyncio.run(z.fetch()), t))

    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])  # same workers, another shape
    a = dtorch.randn(64, 32, device_mesh=grid, placements=[Shard(0), Replicate()])
    w = dtorch.randn(32, 16, device_mesh=grid, placements=[Replicate(), Shard(1)])
    h = a @ w                                                          # [S(0), S(1)]: no communication
    s = h.sum(0)                                                       # [P(sum), S(0)]: still none
    print("h:", h)
    print("s:", s)
    full = s.redistribute(placements=[Replicate(), Replicate()])       # all-reduce + all-gather on workers
    print("matches torch:", torch.allclose(full.to_torch(), (a.to_torch() @ w.to_torch()).sum(0), atol=1e-4))
    print("workers:", [(w["rank"], w["host"], w["pid"]) for w in dtorch.workers()])
    print("controller traffic:", dtorch.stats())
    dtorch.shutdown()


if __name__ == "__main__":
    main()
