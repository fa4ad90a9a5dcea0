"""A worker's dtorch.compile commands: DefineGraph (a captured program kept, its runs of plain
rows compiled into straight-line functions: straight_line.py, and with backend "inductor" into
fused ones: fusion.py), RunGraph (a replay: graphs.py)
and DropGraph.

GraphCommands is a component of the Worker (worker.py), which owns one: it keeps the graphs
(`graphs`, by id) and takes the rank's LocalShards (shards.py), the worker as a CommandRunner
(a replay runs each row as the loop would run it) and the seq this worker started at.
"""
from __future__ import annotations

from typing import Protocol

from ...ops import KERNELS
from ...ops.registry import PEER_KERNELS
from . import graphs, straight_line
from .. import protocol as wire
from .shards import LocalShards

__all__ = ["GraphCommands", "CommandRunner"]


class CommandRunner(Protocol):
    """What a replay needs of the worker running it (worker.Worker)."""

    busy_seq: int   # the command running now, which the heartbeat names: a straight run sets it

    @property
    def profiling(self) -> bool:
        """Whether dtorch.profile records each command now."""

    def run_command(self, command) -> None:
        """Run one command as the loop does: a failure poisons its outputs and is reported."""

    def failed(self, command, error: Exception) -> None:
        """The command raised `error`: poison its outputs, report it under its seq."""


class GraphCommands:
    def __init__(self, shards: LocalShards, runner: CommandRunner, start_seq: int):
        self.shards, self.runner, self.start_seq = shards, runner, start_seq
        self.graphs: dict[int, graphs.Graph] = {}   # graph id -> captured commands

    def handle_define_graph(self, command: wire.DefineGraph) -> None:
        graph = graphs.define(command)
        if any(type(c) is wire.CheckpointBegin for c in graph.commands):   # every row through run_command
            self.graphs[command.graph_id] = graph
            return
        plan = straight_line.build(command.graph_id, graph.commands, graph.scratch, graph.random, KERNELS,
                                   lambda row: straight_line.plain_row(row, PEER_KERNELS), self._region_placer)
        if command.backend == "inductor":
            from . import fusion   # here: importing inductor costs a worker ~0.8 s, for graphs that fuse only
            plan = fusion.fuse(plan)
            graph = fusion.foreach_updates(graph)
        elif command.backend:
            raise ValueError(f"DefineGraph: unknown backend {command.backend!r} (\"\" or \"inductor\")")
        self.graphs[command.graph_id] = graph._replace(plan=plan)

    def _region_placer(self, mesh_id: int):
        """How this rank places a ShardRegion on the mesh (its block), or None off the mesh."""
        mesh = self.shards.member(mesh_id)
        if mesh is None:
            return None
        coordinate = mesh.coordinate_of(self.shards.rank)
        return lambda region: region.at(mesh, coordinate)

    def handle_run_graph(self, command: wire.RunGraph) -> None:
        """Each row runs as a command of its own (seq + i): its failure poisons its outputs and
        is reported under its own seq, as in eager; the replay goes on, as a batch would."""
        graph = self.graphs.get(command.graph_id)
        if graph is None and command.defined_seq < self.start_seq:
            return   # defined before this worker joined: none of the graph's meshes holds this rank
        if graph is None:
            raise KeyError(f"compiled graph {command.graph_id} is not on rank {self.shards.rank} (dropped, or this "
                           "process replaced a lost worker after the graph was defined)")
        shards, runner = self.shards, self.runner
        graphs.replay(graph, command, (shards.tensors, shards.poisoned, shards.in_flight), runner.run_command,
                      runner.failed, self._may_run_straight)

    def _may_run_straight(self, first_seq: int) -> bool:
        """Whether a replay's run of plain rows may run as its function now (graphs.py): not while
        the profiler records each row, nor with communication in flight, whose results a row
        would have to wait for. While it runs, the heartbeat names its first row (the rows
        before it, run alone, each cleared busy_seq when done)."""
        if self.runner.profiling or self.shards.in_flight:
            return False
        self.runner.busy_seq = first_seq
        return True

    def handle_drop_graph(self, command: wire.DropGraph) -> None:
        graph = self.graphs.pop(command.graph_id, None)
        if graph is not None and graph.plan is not None:
            for step in graph.plan:
                if type(step) is not int:
                    step.forget()
