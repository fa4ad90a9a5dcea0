"""A model of a 1,024-GPU cluster (128 hosts x 8 GPUs) under one dtorch controller, worked out
from costs measured on this machine (docs/design/scale.md explains it):

    python -m benchmarks.scale_model [--worlds 1 4 16 64] [--json model.json]

It measures, then prints every input figure and every derived one:

- the controller's CPU per op issued (benchmark 12's program, workers paused while issuing, so
  64 workers on 2 cores do not take the controller's cores) at each world size, fitted as
  c0 + f x subscribers: f is ZeroMQ's PUB writing each subscriber its own copy;
- the read round trip of a ready replicated (1,) tensor and its controller CPU (every rank
  replies, one sender carries the bytes), fitted as t0 + t x ranks;
- the controller's CPU per heartbeat (idle pool), and each message's size;
- the encoded size of typical commands (dtorch.runtime.protocol's encoding, captured as the
  controller publishes them) and the bytes per op of a long chain as sent;
- a raw ZeroMQ round trip on tcp loopback: the extra hop a relay adds on each host.

The cluster's own figures (hosts, GPUs per host, NIC bandwidth, network round trip) are
assumptions on the command line, printed with the rest.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass

from .controller_scale import measure_in_subprocess

__all__ = ["Cluster", "Measured", "fit_line", "model", "main"]

PATHWAYS = {128: 2.3e-3, 2048: 35e-3}   # Pathways' minimum computation per step to keep pace (s)


@dataclass
class Cluster:
    hosts: int = 128
    gpus_per_host: int = 8
    nic_gbps: float = 100.0          # the controller host's network interface
    network_rtt_s: float = 20e-6     # one round trip between two hosts in the cluster

    @property
    def workers(self) -> int:
        return self.hosts * self.gpus_per_host


@dataclass
class Measured:
    op_cpu_s: float            # c0: controller CPU per op issued, the part that does not grow with workers
    op_cpu_per_subscriber_s: float   # f: added per PUB subscriber (one copy each)
    read_wall_s: float         # t0: read round trip at the smallest world measured (1 worker)
    read_wall_per_rank_s: float      # t: added per rank that replies: the controller's CPU per reply,
                                     # which it spends one reply after another (on this 2-core machine
                                     # the wall slope is mostly 64 workers waiting for a core)
    read_wall_slope_here_s: float    # the wall slope measured here, for the record
    heartbeat_cpu_s: float     # controller CPU per heartbeat handled (loop + ZeroMQ threads)
    heartbeat_bytes: int       # worker -> controller, as framed by ZMTP (header + 2 B)
    pong_bytes: int
    heartbeat_interval_s: float
    bytes_per_op: float        # a long chain as sent: command rows, batch headers, frees
    hop_s: float               # a raw ZeroMQ round trip on loopback: the relay's extra hop


def fit_line(xs: list, ys: list) -> tuple[float, float]:
    """Least squares (intercept, slope) of y = a + b x."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else 0.0
    return mean_y - slope * mean_x, slope


def model(m: Measured, c: Cluster) -> dict:
    """Every derived figure for cluster `c`, without relays (each worker subscribes to the
    controller) and with one relay per host (the host subscribes once; replies and heartbeats
    still go direct unless stated)."""
    n, h = c.workers, c.hosts
    nic_bytes_s = c.nic_gbps * 1e9 / 8
    out: dict = {"workers": n}
    for name, subscribers in (("no_relays", n), ("relays", h)):
        op_s = m.op_cpu_s + m.op_cpu_per_subscriber_s * subscribers
        rate = 1 / op_s
        out[name] = {
            "controller_cpu_per_op_us": 1e6 * op_s,
            "commands_per_s": rate,
            "bytes_per_op_per_host": m.bytes_per_op * (c.gpus_per_host if name == "no_relays" else 1),
            "controller_egress_gbps_at_full_rate": rate * m.bytes_per_op * subscribers * 8 / 1e9,
            "commands_per_s_the_nic_allows": nic_bytes_s / (m.bytes_per_op * subscribers),
        }
    out["no_relays"]["read_floor_ms"] = 1e3 * (m.read_wall_s + m.read_wall_per_rank_s * n + c.network_rtt_s)
    # Replies through the relay, merged there into one message per host: the controller handles
    # `hosts` replies; each relay handles its own workers' in parallel; one loopback hop more.
    out["relays"]["read_floor_ms"] = 1e3 * (m.read_wall_s + m.read_wall_per_rank_s * (h + c.gpus_per_host)
                                            + c.network_rtt_s + m.hop_s)
    out["relays"]["read_floor_replies_direct_ms"] = out["no_relays"]["read_floor_ms"] + 1e3 * m.hop_s
    out["read_tree"] = _read_tree(m, c)
    beats = n / m.heartbeat_interval_s
    out["heartbeats"] = {
        "per_s": beats, "bytes_in_per_s": beats * m.heartbeat_bytes, "bytes_out_per_s": beats * m.pong_bytes,
        "controller_core_share": beats * m.heartbeat_cpu_s,
        "per_s_one_per_host": h / m.heartbeat_interval_s,
        "controller_core_share_one_per_host": h / m.heartbeat_interval_s * m.heartbeat_cpu_s,
    }
    out["breaks"] = _breaking_points(m, c)
    out["pathways"] = {str(size): _step_floor(m, c, size) for size in PATHWAYS}
    return out


def _read_tree(m: Measured, c: Cluster) -> dict:
    """Read floor through a tree of relays of fan-in k: each level handles k replies in series,
    levels one after the other, each a hop. The best k over a few choices."""
    best = {}
    for k in (8, 16, 32, 64, 128):
        depth = max(1, math.ceil(math.log(c.workers, k)))
        floor = m.read_wall_s + depth * (k * m.read_wall_per_rank_s + m.hop_s) + c.network_rtt_s
        best[str(k)] = {"depth": depth, "read_floor_ms": 1e3 * floor}
    return best


def _breaking_points(m: Measured, c: Cluster) -> list:
    """For each mechanism, the number of workers (no relays) at which it crosses a stated line."""
    nic = c.nic_gbps * 1e9 / 8
    points = []
    if m.op_cpu_per_subscriber_s > 0:
        points.append(("controller CPU: PUB fan-out doubles the cost of an op",
                       m.op_cpu_s / m.op_cpu_per_subscriber_s))
    # Issuing at full rate 1/(c0 + f N), the copies need N x bytes x rate <= NIC.
    spare = m.bytes_per_op - nic * m.op_cpu_per_subscriber_s
    points.append((f"PUB fan-out: commands at full rate fill a {c.nic_gbps:g} Gb/s NIC",
                   nic * m.op_cpu_s / spare if spare > 0 else math.inf))
    for floor_ms in (2.3, 10.0):
        points.append((f"read of a replicated tensor: reply fan-in alone takes {floor_ms:g} ms",
                       (floor_ms / 1e3 - m.read_wall_s) / m.read_wall_per_rank_s if m.read_wall_per_rank_s > 0
                       else math.inf))
    points.append(("heartbeats take half a controller core",
                   0.5 * m.heartbeat_interval_s / m.heartbeat_cpu_s if m.heartbeat_cpu_s > 0 else math.inf))
    return sorted(({"what": what, "workers": workers} for what, workers in points), key=lambda p: p["workers"])


def _step_floor(m: Measured, c: Cluster, workers: int) -> dict:
    """The shortest step the controller keeps up with at `workers` (Pathways' measure): one
    command per step issued back to back, and a step that also reads one replicated value."""
    hosts = max(1, workers // c.gpus_per_host)
    op = {name: m.op_cpu_s + m.op_cpu_per_subscriber_s * subscribers
          for name, subscribers in (("no_relays", workers), ("relays", hosts))}
    read = m.read_wall_s + m.read_wall_per_rank_s * workers + c.network_rtt_s
    return {"pathways_ms": 1e3 * PATHWAYS[workers],
            "one_command_per_step_ms": {name: 1e3 * value for name, value in op.items()},
            "step_with_a_read_ms": 1e3 * (op["no_relays"] + read)}


# --- measuring -------------------------------------------------------------------------------------
def measure_all(worlds: list, ops: int, reps: int, timeout_s: float) -> tuple[Measured, dict]:
    runs = {}
    for world in worlds:
        print(f"[scale_model] measuring {world} worker(s) ...", file=sys.stderr, flush=True)
        runs[world] = measure_in_subprocess(world, ops, reps, 3.0, timeout_s)
    med = statistics.median
    c0, f = fit_line(worlds, [med(runs[w]["paused_issue_cpu_per_op"]) for w in worlds])
    _, wall_slope = fit_line(worlds, [med(runs[w]["read_r_wall_s"]) for w in worlds])
    _, read_cpu = fit_line(worlds, [med(runs[w]["read_r_cpu_s"]) for w in worlds])
    _, beat_cpu = fit_line([runs[w]["heartbeats_per_s"] for w in worlds], [runs[w]["idle_cpu_per_s"] for w in worlds])
    sizes = command_sizes()
    from dtorch.runtime import protocol as wire
    from .zmq_pingpong import round_trip_seconds
    measured = Measured(
        op_cpu_s=c0, op_cpu_per_subscriber_s=max(0.0, f), read_wall_s=med(runs[min(worlds)]["read_r_wall_s"]),
        read_wall_per_rank_s=max(0.0, read_cpu), read_wall_slope_here_s=wall_slope, heartbeat_cpu_s=max(0.0, beat_cpu),
        heartbeat_bytes=len(wire.encode(wire.Heartbeat(1023, 100_000, 80 << 30, 123_456_789, 0.5))) + 2,
        pong_bytes=len(wire.encode(wire.Pong())) + 2, heartbeat_interval_s=wire.HEARTBEAT_INTERVAL,
        bytes_per_op=sizes.pop("chain bytes per op as sent"), hop_s=med(round_trip_seconds(500, 4, timeout_s)))
    return measured, {"runs": runs, "command_sizes": sizes}


def command_sizes() -> dict:
    """Encoded size (bytes) of the command row each typical op publishes, captured from the
    controller's own batches on a 2-worker session; and a long chain's bytes per op as sent."""
    import dtorch
    from dtorch.spec.placements import Replicate, Shard, init_device_mesh
    from dtorch.runtime import protocol as wire
    captured: list = []
    original = wire.encode_batch

    def capture(first_seq, commands):
        captured.extend(commands)
        return original(first_seq, commands)

    def row_bytes(make) -> int:
        dtorch.synchronize()
        captured.clear()
        make()
        dtorch.synchronize()
        rows = [c for c in captured if not isinstance(c, (wire.Sync, wire.Free))]
        return max(len(wire.pack((wire.OPCODE[type(c)],) + tuple(c))) for c in rows)

    dtorch.init(num_workers=2)
    wire.encode_batch = capture
    try:
        mesh = init_device_mesh("cpu", (2,))
        x = dtorch.randn(64, 128, device_mesh=mesh, placements=[Shard(0)])
        y = dtorch.randn(64, 128, device_mesh=mesh, placements=[Shard(0)])
        w = dtorch.randn(128, 128, device_mesh=mesh, placements=[Replicate()])
        sizes = {"elementwise x * 1.0001 (RunOp)": row_bytes(lambda: x * 1.0001),
                 "elementwise x + y (RunOp)": row_bytes(lambda: x + y),
                 "matmul x @ w, S(0) @ R (RunOp)": row_bytes(lambda: x @ w),
                 "redistribute S(0) -> R (Redistribute)": row_bytes(lambda: x.redistribute(mesh, [Replicate()])),
                 "read x.to_torch() (Fetch)": row_bytes(lambda: x.to_torch())}
        from .chain import run_chain
        before = dtorch.stats()
        run_chain(x, 4000).to_torch()
        after = dtorch.stats()
        sizes["chain bytes per op as sent"] = (after["bytes_sent"] - before["bytes_sent"]) / 4000
        return sizes
    finally:
        wire.encode_batch = original
        dtorch.shutdown()


# --- printing --------------------------------------------------------------------------------------
def report(measured: Measured, extra: dict, cluster: Cluster, derived: dict) -> str:
    lines = ["== measured on this machine (inputs) =="]
    for world, run in extra["runs"].items():
        med = statistics.median
        lines.append(f"  {world:>3} workers: issue {1e6 * med(run['paused_issue_cpu_per_op']):.2f} us CPU/op (paused), "
                     f"program {1e6 * med(run['cpu_per_op']):.2f} us CPU/op (running); "
                     f"R read {1e3 * med(run['read_r_wall_s']):.2f} ms, {1e3 * med(run['read_r_cpu_s']):.2f} ms CPU; "
                     f"idle {1e3 * run['idle_cpu_per_s']:.1f} ms CPU/s for {run['heartbeats_per_s']:.0f} heartbeats/s")
    for name, size in extra["command_sizes"].items():
        lines.append(f"  command row, {name}: {size} B")
    for name, value in asdict(measured).items():
        lines.append(f"  {name}: {_fmt(value)}")
    lines.append("== assumed for the cluster ==")
    for name, value in asdict(cluster).items():
        lines.append(f"  {name}: {_fmt(value)}")
    lines.append(f"== derived for {cluster.workers} workers ({cluster.hosts} hosts x {cluster.gpus_per_host}) ==")
    lines.append(json.dumps({k: v for k, v in derived.items() if k != "breaks"}, indent=2, default=_fmt))
    lines.append("== what breaks first (workers, no relays) ==")
    for point in derived["breaks"]:
        lines.append(f"  {point['workers']:>8.0f}  {point['what']}")
    return "\n".join(lines)


def _fmt(value):
    return f"{value:.4g}" if isinstance(value, float) else value


def main(argv: list) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--hosts", type=int, default=Cluster.hosts)
    parser.add_argument("--gpus-per-host", type=int, default=Cluster.gpus_per_host)
    parser.add_argument("--nic-gbps", type=float, default=Cluster.nic_gbps)
    parser.add_argument("--network-rtt-us", type=float, default=1e6 * Cluster.network_rtt_s)
    parser.add_argument("--timeout", type=float, default=300.0, help="per world size")
    parser.add_argument("--json", help="also write inputs and derived figures here")
    args = parser.parse_args(argv)
    cluster = Cluster(args.hosts, args.gpus_per_host, args.nic_gbps, args.network_rtt_us / 1e6)
    measured, extra = measure_all(args.worlds, args.ops, args.reps, args.timeout)
    derived = model(measured, cluster)
    print(report(measured, extra, cluster, derived))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"measured": asdict(measured), "cluster": asdict(cluster), "derived": derived, **extra}, out,
                      indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
