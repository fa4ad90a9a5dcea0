"""A worker's dtorch.compile commands: DefineGraph (a captured program kept, its runs of plain
rows compiled into straight-line functions: straight_line.py), RunGraph (a replay: graphs.py)
and DropGraph.

A mixin of Worker (worker.py), which provides what these handlers use: `graphs`, `tensors`,
`poisoned`, `in_flight`, `start_seq`, `profiler`, `busy_seq`, `_member(mesh_id)` (the mesh, or
None on a rank off it), `_run_command` and `_failed`.
"""
from __future__ import annotations

from ...ops import KERNELS
from ...ops.registry import PEER_KERNELS
from . import graphs, straight_line
from .. import protocol as wire

__all__ = ["GraphCommands"]


class GraphCommands:
    def handle_define_graph(self, command: wire.DefineGraph) -> None:
        graph = graphs.define(command)
        if any(type(c) is wire.CheckpointBegin for c in graph.commands):   # every row through _run_command
            self.graphs[command.graph_id] = graph
            return
        plan = straight_line.build(command.graph_id, graph.commands, graph.scratch, graph.random, KERNELS,
                                   lambda row: straight_line.plain_row(row, PEER_KERNELS), self._region_placer)
        self.graphs[command.graph_id] = graph._replace(plan=plan)

    def _region_placer(self, mesh_id: int):
        """How this rank places a ShardRegion on the mesh (its block), or None off the mesh."""
        mesh = self._member(mesh_id)
        if mesh is None:
            return None
        coordinate = mesh.coordinate_of(self.rank)
        return lambda region: region.at(mesh, coordinate)

    def handle_run_graph(self, command: wire.RunGraph) -> None:
        """Each row runs as a command of its own (seq + i): its failure poisons its outputs and
        is reported under its own seq, as in eager; the replay goes on, as a batch would."""
        graph = self.graphs.get(command.graph_id)
        if graph is None and command.defined_seq < self.start_seq:
            return   # defined before this worker joined: none of the graph's meshes holds this rank
        if graph is None:
            raise KeyError(f"compiled graph {command.graph_id} is not on rank {self.rank} (dropped, or this "
                           "process replaced a lost worker after the graph was defined)")
        graphs.replay(graph, command, (self.tensors, self.poisoned, self.in_flight), self._run_command, self._failed,
                      self._may_run_straight)

    def _may_run_straight(self, first_seq: int) -> bool:
        """Whether a replay's run of plain rows may run as its function now (graphs.py): not while
        the profiler records each row, nor with communication in flight, whose results a row
        would have to wait for. While it runs, the heartbeat names its first row (the rows
        before it, run alone, each cleared busy_seq when done)."""
        if self.profiler is not None or self.in_flight:
            return False
        self.busy_seq = first_seq
        return True

    def handle_drop_graph(self, command: wire.DropGraph) -> None:
        graph = self.graphs.pop(command.graph_id, None)
        if graph is not None and graph.plan is not None:
            for step in graph.plan:
                if type(step) is not int:
                    step.forget()
