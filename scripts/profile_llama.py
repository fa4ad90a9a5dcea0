"""Regenerate docs/guide/profiling.png and the summary in docs/guide/profiling.md: the Llama example's
generation (tp=2 on 2 local CPU workers, a few tokens) under dtorch.profile.

    python3 scripts/profile_llama.py [--tokens 4] [--trace /tmp/llama_trace.json]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--trace", default="/tmp/llama_trace.json")
    parser.add_argument("--png", default=str(ROOT / "docs" / "guide" / "profiling.png"))
    args = parser.parse_args(argv)
    python = [sys.executable]
    subprocess.run(python + [str(ROOT / "examples" / "llama_generate.py"), "--tp", "2", "--tokens", str(args.tokens),
                             "--profile", args.trace], check=True, cwd=ROOT, timeout=600)
    subprocess.run(python + ["-m", "dtorch.profile", "summarize", args.trace], check=True, cwd=ROOT, timeout=120)
    subprocess.run(python + ["-m", "dtorch.profile", "plot", args.trace, "-o", args.png,
                             "--title", f"examples/llama_generate.py --tp 2 --tokens {args.tokens}"],
                   check=True, cwd=ROOT, timeout=300)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
