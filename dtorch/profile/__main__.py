"""python -m dtorch.profile {summarize,plot,check} trace.json"""
from __future__ import annotations

import argparse
import sys

from ..errors import DTorchError
from .summary import load, summarize
from .timeline import plot
from .trace import check_trace


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtorch.profile", description="Read a dtorch.profile trace.")
    commands = parser.add_subparsers(dest="command", required=True)
    text = commands.add_parser("summarize", help="top ops, the controller's calls, communication and idle per rank")
    text.add_argument("trace")
    text.add_argument("--top", type=int, default=10, help="rows of the ops and controller tables (default 10)")
    picture = commands.add_parser("plot", help="the timeline as a PNG: the controller on top, one lane per rank, "
                                  "commands coloured by phase (needs matplotlib)")
    picture.add_argument("trace")
    picture.add_argument("-o", "--out", default="timeline.png", help="the PNG to write (default timeline.png)")
    picture.add_argument("--title", help="default: dtorch timeline")
    check = commands.add_parser("check", help="validate the trace's structure (Trace Event Format)")
    check.add_argument("trace")
    args = parser.parse_args(argv)
    trace = load(args.trace)
    if args.command == "summarize":
        print(summarize(trace, args.top))
    elif args.command == "plot":
        try:
            plot(trace, args.out, args.title)
        except DTorchError as missing:
            print(missing, file=sys.stderr)
            return 1
        print(f"wrote {args.out}")
    else:
        problems = check_trace(trace)
        print("\n".join(problems) or f"{args.trace}: a valid trace ({len(trace['traceEvents'])} events)")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
