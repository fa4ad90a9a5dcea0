"""dtorch-launch: run a dtorch script whose workers start on the hosts of a hostfile.

    dtorch-launch --hostfile hosts [--python P] [--chdir D] [--env NAME]... [--ssh-option "..."]...
                  [--log-dir D] [--controller-address ADDR] [--connect-timeout S] script.py [args...]
    dtorch-launch --slurm [--python P] [--chdir D] [--log-dir D] [--controller-address ADDR] script.py [args...]

The script runs IN THIS PROCESS as ``__main__`` (it is the controller). The launcher only writes
the options into the environment; the runtime reads them when the script builds its first mesh.
Without --hostfile the script runs with local workers, exactly as ``python script.py`` would.
With --slurm (inside salloc or sbatch) each task of the allocation runs one worker, started with srun.
"""
from __future__ import annotations

import argparse
import os
import runpy
import shlex
import signal
import sys

from .host_identity import load_hostfile
from .options import DEFAULT_WORKER_MODULE, ENV_CONTROLLER_ADDRESS, ENV_HOSTFILE, SshOptions
from .slurm import ENV_SLURM, Allocation

__all__ = ["main", "build_parser"]

USAGE_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dtorch-launch",
        description="Run a dtorch script as the controller, with workers started over ssh or srun.")
    parser.add_argument("--hostfile", help="hosts and slots, one `host slots=N` per line")
    parser.add_argument("--slurm", action="store_true",
                        help="inside a SLURM allocation (salloc, sbatch): one worker per task, started with srun")
    parser.add_argument("--python", help="python on the hosts (default: this interpreter's path)")
    parser.add_argument("--chdir", help="working directory on the hosts (default: the current one)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME",
                        help="forward this environment variable to the workers (repeatable); "
                             "values travel over ssh's stdin, never on a command line")
    parser.add_argument("--ssh-option", action="append", default=[], metavar="OPTIONS",
                        help='extra ssh arguments, split like a shell would, e.g. "-F ssh_config" '
                             'or "-o ProxyJump=gateway" (repeatable)')
    parser.add_argument("--log-dir", help="also write each worker's output to LOG_DIR/rank<N>.log")
    parser.add_argument("--controller-address", help="address the workers connect back to")
    parser.add_argument("--connect-timeout", type=float, default=10.0, metavar="SECONDS",
                        help="seconds ssh may take to connect to a host (default: 10)")
    parser.add_argument("--worker-module", default=DEFAULT_WORKER_MODULE, help=argparse.SUPPRESS)
    parser.add_argument("script", help="the dtorch program to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        os.environ.update(launch_environment(args))
    except (OSError, ValueError) as error:
        parser.exit(USAGE_ERROR, f"dtorch-launch: error: {error}\n")
    if args.slurm:
        signal.signal(signal.SIGTERM, _end_of_slurm_job)
    run_script(args.script, args.script_args)
    return 0


def launch_environment(args: argparse.Namespace) -> dict[str, str]:
    """The variables the runtime reads; loading the hostfile here reports its errors up front
    (a bad line, a name that does not resolve, a host listed twice)."""
    options = options_from_arguments(args)
    environment = options.to_environment()
    if args.slurm:
        if args.hostfile:
            raise ValueError("--slurm and --hostfile exclude each other: SLURM's allocation names the nodes")
        Allocation.from_environment()   # outside an allocation, say so before the script runs
        environment[ENV_SLURM] = "1"
    if args.hostfile:
        path = os.path.abspath(args.hostfile)
        load_hostfile(path, options)
        environment[ENV_HOSTFILE] = path
    if args.controller_address:
        environment[ENV_CONTROLLER_ADDRESS] = args.controller_address
    return environment


def options_from_arguments(args: argparse.Namespace) -> SshOptions:
    defaults = SshOptions()
    ssh_options = [word for option in args.ssh_option for word in shlex.split(option)]
    return SshOptions(
        python=args.python or defaults.python,
        chdir=args.chdir or defaults.chdir,
        env=args.env,
        ssh_options=ssh_options,
        log_dir=os.path.abspath(args.log_dir) if args.log_dir else None,
        connect_timeout=args.connect_timeout,
        worker_module=args.worker_module,
    )


def _end_of_slurm_job(signum, frame) -> None:
    """SIGTERM under sbatch: SLURM ends the job (scancel, time limit, preemption) and signals the
    batch script and the workers' steps together. Python would die at once, skipping atexit;
    as an exception it unwinds the script (its `finally` blocks may save a checkpoint) and
    dtorch's shutdown runs, within SLURM's KillWait grace period."""
    job = os.environ.get("SLURM_JOB_ID", "?")
    raise SystemExit(f"dtorch-launch: SLURM is ending job {job} (SIGTERM: scancel, time limit or preemption)")


def run_script(script: str, script_args: list[str]) -> None:
    """Run ``script`` as ``__main__`` the way ``python script.py args`` would."""
    if not os.path.isfile(script):
        raise SystemExit(f"dtorch-launch: error: no such script: {script}")
    sys.argv = [script, *script_args]
    # `python script.py` puts the script's folder first on sys.path; here that slot holds the
    # folder of the dtorch-launch entry point, which the script has no use for.
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    sys.exit(main())
