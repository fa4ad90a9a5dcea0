"""Stand-in for dtorch.runtime.processes.worker_process in the launcher tests: same stdin contract, no runtime.

Reads ONE JSON line from stdin, prints a report of what it received and where it runs, then
waits for stdin EOF (the controller or the ssh connection is gone) and exits, like the real worker.
Config keys it understands: stdout_lines, stderr_lines (printed once), report_env (variable names
to report) and exit_code (exit at once with it instead of waiting).
"""
import json
import os
import sys

REPORT_PREFIX = "ECHO "


def main() -> int:
    config = json.loads(sys.stdin.readline())
    report = {
        "pid": os.getpid(),
        "cwd": os.getcwd(),
        "config": config,
        "ssh_connection": os.environ.get("SSH_CONNECTION"),
        "env": {name: os.environ.get(name) for name in config.get("report_env", [])},
    }
    print(REPORT_PREFIX + json.dumps(report), flush=True)
    for line in config.get("stdout_lines", []):
        print(line, flush=True)
    for line in config.get("stderr_lines", []):
        print(line, file=sys.stderr, flush=True)
    if "exit_code" in config:
        return config["exit_code"]
    sys.stdin.read()
    print("stdin closed, exiting", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
