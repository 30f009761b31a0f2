"""Pre-tokenize C4-format files into uint16 token shards (resumable; re-run to continue).

    python scripts/prepare_data.py data.source=c4 data.path=/data/c4/en \\
        data.tokenized_dir=/data/c4_gpt2 data.num_proc=16
    python scripts/prepare_data.py                 # the offline sample corpus (data/sample)

Arguments are the same ``section.key=value`` overrides as training (``--config`` a YAML file),
so the training run can use the identical ``data.*`` settings. Writes
``<tokenized_dir>/<split>/*.bin`` + ``index.json`` for the train and validation splits; finished
shards are skipped, so an interrupted run continues where it stopped.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linear_gpt2.platform import cli  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (see ``linear_gpt2.platform.cli``)."""
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    from rich.console import Console

    from linear_gpt2.training.config import load_config
    from linear_gpt2.training.data import DEFAULT_SAMPLE_DIR, c4_files, ensure_sample

    ap = cli.ArgumentParser(
        prog="scripts/prepare_data.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. data.path=/dir")
    ap.add_argument("--config", default=None, help="YAML run config")
    ap.add_argument("--splits", nargs="+", default=None, help="default: train and data.val_split")
    args = ap.parse_intermixed_args(argv)
    console = Console(stderr=True)
    cfg = load_config(args.config, args.overrides).data
    if cfg.source == "synthetic":
        raise cli.UsageError("data.source=synthetic has nothing to tokenize; use sample or c4")
    if cfg.source == "sample":
        root = Path(cfg.path or DEFAULT_SAMPLE_DIR)
        ensure_sample(root)
        out = Path(cfg.tokenized_dir) if cfg.tokenized_dir else root / "tokenized"
    else:
        if not cfg.path or not cfg.tokenized_dir:
            raise cli.UsageError(
                "set data.path (local C4 files, e.g. data.path=/dir/with/c4-train.*.json.gz) and "
                "data.tokenized_dir (output directory); streaming from the hub needs no "
                "pre-tokenization"
            )
        root, out = Path(cfg.path), Path(cfg.tokenized_dir)
    splits = args.splits or ["train", cfg.val_split]
    for split in splits:
        files = c4_files(root, split)
        _prepare(console, files, out / split, split, cfg.num_proc)
    console.print(f"done: set data.tokenized_dir={out} for training")
    return 0


def _prepare(console, files: list[Path], split_dir: Path, split: str, num_proc: int) -> None:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from linear_gpt2.training.data import prepare_split

    totals = {"tokens": 0, "docs": 0, "no_text": 0, "empty_files": 0, "skipped": 0}
    t0 = time.perf_counter()
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[tokens]:,} tokens ({task.fields[rate]})"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task(split, total=len(files), tokens=0, rate="-")

        def on_shard(entry: dict) -> None:
            totals["tokens"] += entry["n_tokens"]
            totals["docs"] += entry["n_docs"]
            totals["no_text"] += entry["no_text"]
            totals["empty_files"] += entry["empty_files"]
            totals["skipped"] += bool(entry.get("skipped"))
            rate = totals["tokens"] / max(time.perf_counter() - t0, 1e-9)
            progress.update(
                task, advance=1, tokens=totals["tokens"], rate=f"{rate / 1e6:.2f}M tok/s"
            )

        prepare_split(files, split_dir, split, num_proc=num_proc, on_shard=on_shard)
    console.print(
        f"{split}: {len(files)} files ({totals['skipped']} already done), {totals['docs']:,} documents, "
        f"{totals['tokens']:,} tokens -> {split_dir}; skipped {totals['no_text']} records without "
        f"text and {totals['empty_files']} empty files"
    )


if __name__ == "__main__":
    raise SystemExit(main())
