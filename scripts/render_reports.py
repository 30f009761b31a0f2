#!/usr/bin/env python
"""Render every generated block of README.md, docs/*.md and benchmarks/results/*.md from the raw
files it names (JSON, JSONL, CSV beside it).

    python scripts/render_reports.py            # rewrite the blocks that differ (make reports)
    python scripts/render_reports.py --check    # write nothing; exit 1 listing each that differs

A block is ``<!-- generated: RENDERER [key=value ...] RAW ... -->`` ... ``<!-- end generated -->``
(``studies/common/core.py``); text outside the blocks is left alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from linear_gpt2.platform import cli  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (see ``linear_gpt2.platform.cli``)."""
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare only; exit 1 if a block differs")
    p.add_argument("--root", type=Path, default=REPO, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from studies import common as reports
    from studies.common import core

    if args.check:
        differ = reports.check(args.root)
        for line in differ:
            print(f"{line}: differs from its raw files", file=sys.stderr)
        if differ:
            print("run: python scripts/render_reports.py (make reports)", file=sys.stderr)
            return 1
        docs = reports.documents(args.root)
        blocks = sum(len(core.parse(d.read_text(), str(d))) for d in docs)
        print(f"every generated block agrees with its raw files ({blocks} blocks in {len(docs)} "
              "documents)")  # fmt: skip
        return 0
    for path in reports.write(args.root):
        print(f"rendered {path.relative_to(args.root)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
