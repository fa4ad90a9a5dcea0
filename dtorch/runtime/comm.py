"""Worker-to-worker collectives on CPU: torch.distributed Gloo process groups, one per mesh-dim
slice (a tuple of ranks), created lazily on first use and cached.

No default (world) process group: each group is a ProcessGroupGloo on a PrefixStore of the
controller-hosted TCPStore, so the worker pool can grow without re-forming a world. Members create
a group at the same command (they run the same commands in order), which is what Gloo's
rendezvous needs. Tensor bytes never pass through the controller.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

__all__ = ["GlooCommunicator", "REDUCE_OPS"]

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM,
              "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class GlooCommunicator:
    def __init__(self, store_address: str, rank: int, hostname: str, timeout_s: float = 300.0):
        host, port = store_address.rsplit(":", 1)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, int(port), is_master=False, timeout=self.timeout)
        self.rank, self.hostname = rank, hostname
        self._groups: dict[tuple, dist.ProcessGroup] = {}

    def group(self, ranks: tuple) -> dist.ProcessGroup:
        pg = self._groups.get(ranks)
        if pg is None:
            prefix = dist.PrefixStore("gloo/" + "-".join(map(str, ranks)), self.store)
            options = dist.ProcessGroupGloo._Options()
            options._timeout = self.timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.hostname)]
            pg = dist.ProcessGroupGloo(prefix, ranks.index(self.rank), len(ranks), options)
            self._groups[ranks] = pg
        return pg

    # --- collectives over one group; every member calls the same one -------------------------
    def all_reduce(self, ranks: tuple, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        self.group(ranks).allreduce([tensor], _allreduce_options(reduce_op)).wait()
        if reduce_op == "avg":
            tensor /= len(ranks)
        return tensor

    def all_gather(self, ranks: tuple, tensor: torch.Tensor) -> torch.Tensor:
        """Every member's `tensor` (same shape everywhere), stacked on a new dim 0 in one buffer."""
        tensor = tensor.contiguous()
        gathered = tensor.new_empty((len(ranks),) + tuple(tensor.shape))
        # Gloo splits the output along dim 0 into one input-shaped piece per member: flat views.
        self.group(ranks)._allgather_base(gathered.view(-1), tensor.view(-1)).wait()
        return gathered

    def reduce_scatter(self, ranks: tuple, stacked: torch.Tensor, reduce_op: str) -> torch.Tensor:
        """`stacked` (contiguous) holds one equal-size piece per member on dim 0; returns this
        member's piece reduced over all members."""
        output = torch.empty_like(stacked[0])
        options = dist.ReduceScatterOptions()
        options.reduceOp = REDUCE_OPS[reduce_op]
        self.group(ranks).reduce_scatter([output], [list(stacked.unbind(0))], options).wait()
        if reduce_op == "avg":
            output /= len(ranks)
        return output

    def all_to_all(self, ranks: tuple, send: torch.Tensor) -> torch.Tensor:
        """`send` stacks one equal-size piece per member on dim 0; returns the pieces received."""
        receive = torch.empty_like(send)
        self.group(ranks).alltoall_base(receive, send, [], [], dist.AllToAllOptions()).wait()
        return receive

    def exchange(self, ranks: tuple, sends: list, receives: list) -> None:
        """Point-to-point within the group `ranks`: sends/receives are (peer rank, tensor) pairs;
        all are posted before any is waited on, so no ordering between peers can deadlock."""
        pg = self.group(ranks)
        works = [pg.send([tensor], ranks.index(peer), 0) for peer, tensor in sends]
        works += [pg.recv([tensor], ranks.index(peer), 0) for peer, tensor in receives]
        for work in works:
            work.wait()

    def agree_max(self, ranks: tuple, value: int) -> int:
        """The largest `value` any member passed (used to agree on failures before moving data)."""
        flag = torch.tensor([value], dtype=torch.int64)
        self.group(ranks).allreduce([flag], _allreduce_options("max")).wait()
        return int(flag.item())

    def close(self) -> None:
        for pg in self._groups.values():
            try:
                pg.abort()   # do not wait for peers that may be gone
            except RuntimeError:
                pass
        self._groups.clear()


def _allreduce_options(reduce_op: str) -> dist.AllreduceOptions:
    options = dist.AllreduceOptions()
    options.reduceOp = REDUCE_OPS[reduce_op]
    return options
