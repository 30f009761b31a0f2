"""Data pipeline throughput on this machine, against what training consumes.

    python benchmarks/bench_data.py            # about a minute on a small CPU
    python benchmarks/bench_data.py --tiny --out /tmp/x   # seconds (used by the tests)

Measures, on the offline sample corpus (C4 format):

- tokenization: GPT-2 BPE ``encode_ordinary`` + EOT over in-memory documents, 1 and 2 processes
  (a warmed-up pool, so process start-up is excluded);
- pre-tokenization end to end (``prepare_split``: gzip JSON through ``datasets``, BPE, shard
  writes), 1 and 2 processes (start-up included; skipped with ``--tiny``);
- loader: batches from pre-tokenized shards, shuffled windows, incl. batch assembly and int32
  conversion, without and with the prefetch thread;
- shard validation at open (``TokenShards``: sizes, dtype, every id below the vocabulary): the
  first open scans every token, a later open of unchanged shards only stats them; also on a
  64M-token shard (skipped with ``--tiny``), which gives the scan rate for large splits.

Writes ``data_throughput.json`` and ``.md`` (with machine info and git commit) into ``--out``
and compares each rate with ``H100_TOKENS_PER_S``, the training throughput of GPT-2 124M on one
H100 (about llm.c's figure in ``shared/anchors/published-figures.md``).
``--compare OLD.json`` adds the rates of an earlier run (e.g. before a change) to the table;
``--merge RUN.json ...`` measures nothing and writes the best of several earlier runs per row
(runs alternated with those of the code compared against see the same machine load).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from linear_gpt2.platform import env  # noqa: E402
from linear_gpt2.platform.provenance import environment  # noqa: E402
from linear_gpt2.training.data import TokenizedSource, c4_files, ensure_sample, prepare_split  # noqa: E402
from linear_gpt2.training.data.loader import Loader  # noqa: E402
from linear_gpt2.training.data.packing import doc_tokens  # noqa: E402
from linear_gpt2.training.data.sample import document  # noqa: E402
from linear_gpt2.training.data.sources import iter_file  # noqa: E402

H100_TOKENS_PER_S = 470_000  # GPT-2 124M training on one H100 (nanoGPT-class setup)
REPO = Path(__file__).resolve().parents[1]


def _encode_chunk(texts: list[str]) -> int:
    return sum(len(doc_tokens(t)) for t in texts)


def bench_encode(texts: list[str], procs: int) -> dict:
    chunks = [texts[i : i + 64] for i in range(0, len(texts), 64)]
    if procs == 1:
        _encode_chunk(chunks[0])  # warm up: BPE ranks load on first use
        t = time.perf_counter()
        n = sum(_encode_chunk(c) for c in chunks)
        dt = time.perf_counter() - t
    else:
        with multiprocessing.get_context("spawn").Pool(procs) as pool:
            pool.map(_encode_chunk, chunks[:procs])  # warm up: imports, BPE ranks
            t = time.perf_counter()
            n = sum(pool.map(_encode_chunk, chunks, chunksize=4))
            dt = time.perf_counter() - t
            pool.close()
            pool.join()
    return {"tokens": n, "seconds": dt, "tokens_per_s": n / dt}


def bench_prepare(root: Path, procs: int) -> dict:
    files = c4_files(root, "train")
    next(iter_file(files[0]))  # warm up: importing datasets and its json builder takes seconds
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        index = prepare_split(files, Path(tmp) / "train", "train", num_proc=procs)
        dt = time.perf_counter() - t
    n = sum(e["n_tokens"] for e in index["shards"].values())
    return {"tokens": n, "seconds": dt, "tokens_per_s": n / dt, "files": len(files)}


def bench_loader(split_dir: Path, batch: int, context: int, prefetch: int, seconds: float) -> dict:
    src = TokenizedSource(
        split_dir,
        batch_size=batch,
        context=context,
        seed=0,
        shuffle=True,
        epochs=None,
        rank=0,
        world=1,
    )
    meta = {"source": "c4", "split": "train", "batch_size": batch, "context": context, "seed": 0}
    loader = Loader(src, {**meta, "shuffle": True, "process_count": 1}, prefetch=prefetch)
    next(loader)  # start-up (thread, first memmap pages) is not throughput
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        b = next(loader)
        n += b["inputs"].size
    dt = time.perf_counter() - t
    loader.close()
    return {"tokens": n, "seconds": dt, "tokens_per_s": n / dt, "batch": batch, "context": context,
            "prefetch": prefetch}  # fmt: skip


def best(measure, repeats: int) -> dict:
    """The fastest of ``repeats`` measurements (the machine may be shared: interference only
    slows a run down), with every run's rate kept."""
    runs = [measure() for _ in range(repeats)]
    out = max(runs, key=lambda r: r["tokens_per_s"])
    return {**out, "runs_tokens_per_s": [r["tokens_per_s"] for r in runs]}


def bench_open(split_dir: Path) -> dict[str, dict]:
    """``TokenShards(split_dir)`` timed twice: the first open validates every id (the record of
    earlier validations is removed first), the second finds the shards unchanged."""
    from linear_gpt2.training.data.shards import VALIDATED, TokenShards

    (split_dir / VALIDATED).unlink(missing_ok=True)
    t = time.perf_counter()
    first = TokenShards(split_dir)
    dt_first = time.perf_counter() - t
    if getattr(first, "scanned_tokens", 0) != first.n_tokens:
        raise RuntimeError("the first open did not scan every token (no validation in this code)")
    t = time.perf_counter()
    again = TokenShards(split_dir)
    dt_again = time.perf_counter() - t
    n = first.n_tokens
    return {
        "first open (validates every id)": {"tokens": n, "seconds": dt_first,
                                            "tokens_per_s": n / dt_first,
                                            "scan_seconds": first.validation_s},
        "later open (unchanged, stat only)": {"tokens": n, "seconds": dt_again,
                                              "tokens_per_s": n / dt_again,
                                              "scanned": again.scanned_tokens},
    }  # fmt: skip


def big_shard(root: Path, n_tokens: int) -> Path:
    """A split of one shard of ``n_tokens`` random GPT-2 ids (for the scan rate)."""
    split = root / "big" / "train"
    split.mkdir(parents=True)
    rng = np.random.default_rng(0)
    rng.integers(0, 50257, size=n_tokens, dtype=np.uint16).tofile(split / "big.bin")
    index = {"version": 1, "tokenizer": "gpt2", "dtype": "uint16", "split": "train",
             "sources": ["big"], "complete": True,
             "shards": {"big": {"file": "big.bin", "n_tokens": n_tokens}}}  # fmt: skip
    (split / "index.json").write_text(json.dumps(index))
    return split


def machine_info() -> dict:
    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {
        "cpu_count": os.cpu_count(),
        "sched_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "processor": platform.processor() or platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {p: version(p) for p in ("numpy", "tiktoken", "datasets", "pyarrow", "jax")},
        **environment(),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tiny", action="store_true", help="a few seconds: small corpus, short runs")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="output directory")
    ap.add_argument("--data", default=None, help="sample corpus directory (default: a temp dir)")
    ap.add_argument("--compare", default=None, help="an earlier data_throughput.json to compare")
    ap.add_argument("--label", default="", help="a note for the table's heading")
    ap.add_argument("--repeats", type=int, default=1, help="keep the fastest of N runs of each")
    ap.add_argument("--merge", nargs="+", default=None, help="earlier runs: write their best")
    args = ap.parse_args(argv)
    env.configure()  # datasets' caches and locks under the project's .cache, not $HOME
    before = json.loads(Path(args.compare).read_text())["results"] if args.compare else {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.merge:
        return write(merge_runs(args.merge), out, before, args.label, args.compare)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.data) if args.data else Path(tmp) / "sample"
        if args.tiny:  # a small corpus in the same format, so nothing slow is generated or read
            _write_tiny(root)
        else:
            ensure_sample(root)
        texts = [document(0, "train", i)["text"] for i in range(200 if args.tiny else 15000)]
        rows: dict[str, dict] = {}
        n = args.repeats
        rows["encode, 1 process"] = best(lambda: bench_encode(texts, 1), n)
        rows["encode, 2 processes"] = best(lambda: bench_encode(texts, 2), n)
        rows["prepare_split, 1 process"] = best(lambda: bench_prepare(root, 1), n)
        if not args.tiny:
            rows["prepare_split, 2 processes"] = best(lambda: bench_prepare(root, 2), n)
        tok = Path(tmp) / "tok"
        prepare_split(c4_files(root, "train"), tok / "train", "train")
        batch, context, secs = (2, 128, 0.3) if args.tiny else (8, 1024, 3.0)
        for prefetch in (0, 2):
            rows[f"loader, prefetch={prefetch}"] = best(
                lambda p=prefetch: bench_loader(tok / "train", batch, context, p, secs), n
            )
        opens = {}
        big_split = None if args.tiny else big_shard(Path(tmp), 1 << 26)
        for _ in range(n):
            found = bench_open(tok / "train")
            if big_split is not None:
                big = bench_open(big_split)
                found.update({f"{k}, 64M-token shard": v for k, v in big.items()})
            for k, v in found.items():
                if k not in opens or v["tokens_per_s"] > opens[k]["tokens_per_s"]:
                    opens[k] = v
        rows.update({f"shards: {k}": v for k, v in opens.items()})

    result = {
        "benchmark": "data_throughput",
        "tiny": args.tiny,
        "reference_tokens_per_s": H100_TOKENS_PER_S,
        "reference": "GPT-2 124M training on one H100",
        "repeats": args.repeats,
        "machine": machine_info(),
        "results": rows,
    }
    return write(result, out, before, args.label, args.compare)


def merge_runs(paths: list[str]) -> dict:
    """The best rate of each row over several runs' JSON files (all rates kept)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    result = dict(runs[0])
    merged = {}
    for name in runs[0]["results"]:
        rows = [r["results"][name] for r in runs if name in r["results"]]
        top = max(rows, key=lambda r: r["tokens_per_s"])
        rates = [x for r in rows for x in r.get("runs_tokens_per_s", [r["tokens_per_s"]])]
        merged[name] = {**top, "runs_tokens_per_s": rates}
    result.update(results=merged, repeats=len(runs))
    return result


def write(result: dict, out: Path, before: dict, label: str, compare: str | None) -> dict:
    """``data_throughput.json`` (with ``meta``: how, environment) and the page rendered from it
    (``studies.data_throughput.report``)."""
    from studies import common as reports

    rows = result["results"]
    for r in rows.values():
        r["x_h100_training"] = r["tokens_per_s"] / H100_TOKENS_PER_S
    if before:
        result["compared_with"] = {"file": compare, "results": before}
    m = result["machine"]
    keys = ("device_kind", "platform", "device_count", "jax_version", "jaxlib_version", "python",
            "git_commit", "host", "time_utc")  # fmt: skip
    result.pop("meta", None)  # merged runs: a fresh one below
    result = {"meta": {"how": "measured", "environment": {k: m.get(k) for k in keys}}, **result}
    result["label"] = label
    (out / "data_throughput.json").write_text(json.dumps(result, indent=1) + "\n")
    md = reports.page(
        out / "data_throughput.md", reports.block("data_throughput.page", "data_throughput.json")
    )
    print(md.read_text())
    return result


def _write_tiny(root: Path) -> None:
    import gzip

    root.mkdir(parents=True, exist_ok=True)
    for i in range(2):
        lines = [json.dumps(document(0, "train", 100 * i + j)) for j in range(60)]
        with gzip.open(root / f"c4-train.{i:05d}-of-00002.json.gz", "wt") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    from linear_gpt2.platform import process

    process.configure()  # the settings JAX reads as it starts (platform/process.py)
    main()
