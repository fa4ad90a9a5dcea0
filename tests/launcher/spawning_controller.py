"""A controller stand-in run by dtorch-launch in the CLI tests: what the runtime will do, minus dtorch.

It builds the spawner dtorch-launch asked for (from the environment), starts one echo worker per
slot, prints ``STARTED <json>`` with the remote and ssh pids, then waits (for stdin EOF, or
forever) so that a test can kill it.
"""
import json
import sys

from dtorch_launcher import spawner_from_environment


def main() -> None:
    spawner = spawner_from_environment()
    workers = [spawner.spawn(rank, {"rank": rank, "argv": sys.argv[1:]}) for rank in range(spawner.capacity)]
    started = [{"rank": w.rank, "host": w.host, "pid": w.wait_for_pid(20), "ssh_pid": w.ssh_pid} for w in workers]
    print("STARTED " + json.dumps(started), flush=True)
    sys.stdin.read()
    for worker in workers:
        worker.terminate()
    codes = [worker.wait(10) for worker in workers]
    print("EXITED " + json.dumps(codes), flush=True)


if __name__ == "__main__":
    main()
