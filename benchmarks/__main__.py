"""Command line: run the suite, print the table, write JSON / Markdown / PNG under
benchmarks/results/, and with --publish refresh docs/design/benchmarks.md and docs/design/benchmarks.png."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from . import BENCHMARKS, dtorch_session, report, steal
from .config import PRESETS
from .timing import Row, failed

ROOT = Path(__file__).resolve().parent.parent
DOCS_PAGE = ROOT / "docs" / "design" / "benchmarks.md"   # where --publish writes (report.publish)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="longer chains, more repetitions, larger sizes")
    size.add_argument("--smoke", action="store_true", help="a handful of iterations (used by the tests)")
    parser.add_argument("--only", action="append", choices=sorted(BENCHMARKS), metavar="NAME",
                        help=f"run only this benchmark (repeatable): {', '.join(BENCHMARKS)}")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results",
                        help="where latest.json / latest.md / latest.png go")
    parser.add_argument("--publish", action="store_true",
                        help="also rewrite the results block of docs/design/benchmarks.md and "
                             "docs/design/benchmarks.png")
    parser.add_argument("--from-json", type=Path, metavar="LATEST_JSON",
                        help="measure nothing: rebuild the tables and plot (and with --publish the docs) from a "
                             "run's saved latest.json, after a change to how results are reported")
    return parser.parse_args(argv)


def run_selected(names: list[str], suite, stolen: dict) -> list[Row]:
    """The benchmarks' rows; `stolen` gets each one's host steal share (steal.Meter)."""
    rows: list[Row] = []
    try:
        for name in names:
            print(f"[benchmarks] {name} ({suite.name}) ...", file=sys.stderr, flush=True)
            rows += _run_one(BENCHMARKS[name], suite, stolen)
    finally:
        dtorch_session.close()
    return rows


def _run_one(module, suite, stolen: dict) -> list[Row]:
    started, meter = time.perf_counter(), steal.Meter()
    try:
        rows = module.run(suite)
    except Exception as error:  # noqa: BLE001 -- one broken benchmark must not hide the others
        rows = [failed(module.NAME, "-", "-", "-", error)]
    stolen[module.NAME] = meter.share()
    print(f"[benchmarks] {module.NAME} took {time.perf_counter() - started:.1f} s, "
          f"{steal.describe(stolen[module.NAME])}", file=sys.stderr, flush=True)
    return rows


def write_outputs(rows: list[Row], meta: dict, args) -> None:
    titles = {name: module.TITLE for name, module in BENCHMARKS.items()}
    print(report.text_table(rows, titles, meta["steal"]))
    args.out.mkdir(parents=True, exist_ok=True)
    report.write_json(rows, meta, args.out / "latest.json")
    markdown = report.markdown_report(rows, titles, meta)
    (args.out / "latest.md").write_text(markdown)
    plot = args.out / "latest.png"
    skipped = report.write_plot(rows, titles, plot)
    print(f"\nresults: {args.out / 'latest.json'}, {args.out / 'latest.md'}"
          + ("" if skipped else f", {plot}"))
    if skipped:
        print(skipped)
    if args.publish:
        report.publish(markdown, None if skipped else plot, DOCS_PAGE)
        print(f"published to {DOCS_PAGE}")


def _load() -> str:
    """The 1-minute load average: other work on a shared machine shows up in absolute times."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "unknown"


def main(argv: list[str]) -> int:
    # A SIGTERM (e.g. a test timeout) unwinds through every `finally`, so no process is left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = parse_args(argv)
    if args.from_json is not None:
        rows, meta = report.read_json(args.from_json)
        write_outputs(rows, meta, args)
        return 0
    suite = PRESETS["full" if args.full else "smoke" if args.smoke else "quick"]
    started, load_before, stolen = time.time(), _load(), {}
    rows = run_selected(args.only or list(BENCHMARKS), suite, stolen)
    meta = {"steal": stolen, "command": " ".join(["python -m benchmarks", *argv]), "suite": suite.name,
            "date": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)),
            "duration_s": time.time() - started,
            "machine": dict(report.machine_info(), load=f"{load_before} before, {_load()} after")}
    write_outputs(rows, meta, args)
    return 1 if any(row.status.startswith("error") for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
