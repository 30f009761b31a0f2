"""Data pipeline throughput on this machine, against what training consumes.

    python benchmarks/bench_data.py            # ~1 minute on 2 cores
    python benchmarks/bench_data.py --tiny --out /tmp/x   # seconds (used by the tests)

Measures, on the offline sample corpus (C4 format):

- tokenization: GPT-2 BPE ``encode_ordinary`` + EOT over in-memory documents, 1 and 2 processes
  (a warmed-up pool, so process start-up is excluded);
- pre-tokenization end to end (``prepare_split``: gzip JSON through ``datasets``, BPE, shard
  writes), 1 and 2 processes (start-up included; skipped with ``--tiny``);
- loader: batches from pre-tokenized shards, shuffled windows, incl. batch assembly and int32
  conversion, without and with the prefetch thread.

Writes ``data_throughput.json`` and ``.md`` (with machine info and git commit) into ``--out``
and compares each rate with ~470k tokens/s, the training throughput of GPT-2 124M on one H100.
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

from linear_gpt2.bench import environment  # noqa: E402
from linear_gpt2.data import TokenizedSource, c4_files, ensure_sample, prepare_split  # noqa: E402
from linear_gpt2.data.loader import Loader  # noqa: E402
from linear_gpt2.data.packing import doc_tokens  # noqa: E402
from linear_gpt2.data.sample import document  # noqa: E402
from linear_gpt2.data.sources import iter_file  # noqa: E402

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
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.data) if args.data else Path(tmp) / "sample"
        if args.tiny:  # a small corpus in the same format, so nothing slow is generated or read
            _write_tiny(root)
        else:
            ensure_sample(root)
        texts = [document(0, "train", i)["text"] for i in range(200 if args.tiny else 15000)]
        rows: dict[str, dict] = {}
        rows["encode, 1 process"] = bench_encode(texts, 1)
        rows["encode, 2 processes"] = bench_encode(texts, 2)
        rows["prepare_split, 1 process"] = bench_prepare(root, 1)
        if not args.tiny:
            rows["prepare_split, 2 processes"] = bench_prepare(root, 2)
        tok = Path(tmp) / "tok"
        prepare_split(c4_files(root, "train"), tok / "train", "train")
        batch, context, secs = (2, 128, 0.3) if args.tiny else (8, 1024, 3.0)
        rows["loader, prefetch=0"] = bench_loader(tok / "train", batch, context, 0, secs)
        rows["loader, prefetch=2"] = bench_loader(tok / "train", batch, context, 2, secs)

    for r in rows.values():
        r["x_h100_training"] = r["tokens_per_s"] / H100_TOKENS_PER_S
    result = {
        "benchmark": "data_throughput",
        "tiny": args.tiny,
        "reference_tokens_per_s": H100_TOKENS_PER_S,
        "reference": "GPT-2 124M training on one H100",
        "machine": machine_info(),
        "results": rows,
    }
    lines = [
        "# Data pipeline throughput" + (" (--tiny)" if args.tiny else ""),
        "",
        f"Machine: {result['machine']['cpu_count']} CPUs ({result['machine']['processor']}), "
        f"Python {result['machine']['python']}, commit {result['machine']['git_commit']}",
        f"Versions: {result['machine']['versions']}",
        "",
        f"| measurement | tokens | seconds | tokens/s | x {H100_TOKENS_PER_S // 1000}k (124M on H100) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['tokens']:,} | {r['seconds']:.2f} | {r['tokens_per_s']:,.0f} | "
            f"{r['x_h100_training']:.2f} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    (out / "data_throughput.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "data_throughput.md").write_text(table)
    return result


def _write_tiny(root: Path) -> None:
    import gzip

    root.mkdir(parents=True, exist_ok=True)
    for i in range(2):
        lines = [json.dumps(document(0, "train", 100 * i + j)) for j in range(60)]
        with gzip.open(root / f"c4-train.{i:05d}-of-00002.json.gz", "wt") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
