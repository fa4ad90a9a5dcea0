"""Run by dtorch-launch in tests/launcher/test_relay.py and benchmarks/relay_bytes.py: a mesh over
every slot of the hostfile, with the per-host relays dtorch-launch starts (unless DTORCH_RELAY=0).

Prints ``WORKERS <json>`` (rank, host, pid), ``RELAYS <json>`` (host, pid, ranks) and
``SESSION <json>`` (curve: on or off, the command address), then:
- by default: checks an upload, ops and a redistribute against torch, shuts down, prints OK;
- ``--bytes OPS``: runs OPS elementwise ops and one read, and prints ``BYTES <json>``: the TCP
  bytes the kernel sent on the connections of the controller's command PUB socket while they
  ran (`ss -tin`, bytes_sent per connection: what really left, not arithmetic), and how many
  such connections there are (one per subscriber: a relay, or a worker without one);
- ``--wait``: prints WAITING and blocks on stdin (a test SIGKILLs this process);
- ``--lose-relay``: prints READY, waits for one stdin line (the test kills a relay meanwhile) and
  prints ``LOST <seconds> <message>`` for the read that follows.
"""
import json
import subprocess
import sys
import time

import torch

import dtorch
from dtorch import Replicate, Shard, init_device_mesh
from dtorch.runtime.controller import session


def tcp_bytes(port: int, counter: str = "bytes_sent") -> dict:
    """`counter` (bytes_sent, bytes_received) of every established TCP connection whose local
    port is `port`, by peer."""
    output = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
                            capture_output=True, text=True, check=True, timeout=30).stdout
    sent, peer = {}, None
    for line in output.splitlines():
        if not line[:1].isspace():   # a socket line: Recv-Q Send-Q Local Peer
            peer = line.split()[3]
            sent[peer] = 0
        elif peer is not None:       # its info line; a counter is absent while it is 0
            for field in line.split():
                if field.startswith(counter + ":"):
                    sent[peer] = int(field.split(":")[1])
    return sent


def measure(mesh, world: int, ops: int) -> dict:
    """The same program for every layout: the commands do not depend on the worker count."""
    sockets = session.controller().sockets
    port, reply_port = (int(address.rsplit(":", 1)[1]) for address in (sockets.command_address, sockets.reply_address))
    x = dtorch.ones(64, device_mesh=mesh, placements=[Shard(0)])   # 64: every layout divides it
    dtorch.synchronize()
    before, replies_before = tcp_bytes(port), tcp_bytes(reply_port, "bytes_received")
    for _ in range(ops // 2):
        x = x * 1.0001 + 0.5
    total = x.sum().item()
    dtorch.synchronize()
    after, replies_after = tcp_bytes(port), tcp_bytes(reply_port, "bytes_received")
    assert set(after) == set(before), (before, after)
    return {"bytes": sum(after[p] - before[p] for p in after), "connections": len(after), "ops": ops,
            "workers": world, "value": total,
            "reply_bytes": sum(replies_after[p] - replies_before.get(p, 0) for p in replies_after)}


def main() -> None:
    dtorch.init()
    world = len(dtorch.workers())
    mesh = init_device_mesh("cpu", (world,))
    print("WORKERS " + json.dumps([{k: w[k] for k in ("rank", "host", "pid")} for w in dtorch.workers()]),
          flush=True)
    print("RELAYS " + json.dumps(session._spawner.relays()), flush=True)
    controller = session.controller()
    print("SESSION " + json.dumps({"curve": controller.curve is not None,
                                   "command_address": controller.sockets.command_address}), flush=True)
    if "--bytes" in sys.argv:
        print("BYTES " + json.dumps(measure(mesh, world, int(sys.argv[sys.argv.index("--bytes") + 1]))), flush=True)
    else:
        expected = torch.arange(world * 6.0).reshape(world * 3, 2)
        x = dtorch.tensor(expected, device_mesh=mesh, placements=[Shard(0)])   # private uploads per rank
        y = (x * 3 + x).redistribute(mesh, [Replicate()])
        torch.testing.assert_close(y.to_torch(), expected * 3 + expected)
    if "--lose-relay" in sys.argv:
        print("READY", flush=True)
        sys.stdin.readline()
        lost_at = time.monotonic()
        try:
            (x * 2).to_torch()
            print("LOST never: the read succeeded", flush=True)
        except dtorch.WorkerLostError as error:
            print(f"LOST {time.monotonic() - lost_at:.1f} {error}", flush=True)
    if "--wait" in sys.argv:
        print("WAITING", flush=True)
        sys.stdin.read()
    dtorch.shutdown()
    print("OK", flush=True)


if __name__ == "__main__":
    main()
