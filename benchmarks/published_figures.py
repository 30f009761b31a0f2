"""The post's published figures as a raw file: ``benchmarks/results/published_post.json``.

    python benchmarks/published_figures.py --anchors ../shared/anchors/published-figures.md

Reads the tables of ``published-figures.md`` (the plot data of "Linear Transformers Are Faster",
Buckman & Gelada 2024, read from the post's own plot files) and writes them as JSON, so that the
reports compare against a file in the repository rather than numbers typed into them. Nothing is
retyped: every value is parsed from the anchors' tables. Contexts are keys in tokens; ``"oom"``
is a context the post ran out of memory at; a context the post did not run is absent.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The post's column names -> the registry's names.
NAMES = {
    "softmax (no flash)": "softmax",
    "flash softmax": "flash",
    "LT_attn_par_no_flash": "LT_attention_parallel_no_flash",
}


def tables(text: str) -> dict[str, list[list[str]]]:
    """``{section heading: rows of cells}`` for each markdown table (header row first)."""
    out: dict[str, list[list[str]]] = {}
    heading = None
    for line in text.splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif line.startswith("|") and heading and not re.match(r"^\|[-| ]+\|$", line):
            out.setdefault(heading, []).append([c.strip() for c in line.strip("|").split("|")])
    return out


def context(label: str) -> int:
    m = re.fullmatch(r"(\d+)([kM]?)", label)
    if not m:
        raise SystemExit(f"error: {label!r} is not a context; expected 1024, 1k or 1M")
    return int(m.group(1)) * {"": 1, "k": 1024, "M": 2**20}[m.group(2)]


def value(cell: str) -> float | str | None:
    if cell in ("", "—", "-"):
        return None
    if cell == "OOM":
        return "oom"
    return float(cell)


def pairs(cell: str) -> tuple[float | None, float | None]:
    """``"28.82 vs 31.14"`` -> (28.82, 31.14); ``"— vs 3.10"`` -> (None, 3.10)."""
    a, b = (value(x.strip()) for x in cell.split(" vs "))
    return a, b  # type: ignore[return-value]


def convert(text: str, source: str) -> dict:
    t = tables(text)
    step = t["Step time (ms), 124M"]
    names = [NAMES.get(h, h) for h in step[0][1:]]
    step_time: dict[str, dict[str, dict[str, float | str]]] = {"124M": {n: {} for n in names}}
    for row in step[1:]:
        for name, cell in zip(names, row[1:]):
            v = value(cell)
            if v is not None:
                step_time["124M"][name][str(int(row[0]))] = v
    large = t["Flash softmax vs LT_chunked (ms), larger models"]
    for row in large[1:]:
        size = {"flash": {}, "LT_chunked": {}}
        for label, cell in zip(large[0][1:], row[1:]):
            if cell in ("—", ""):
                continue
            if label == "largest":
                label, cell = (x.strip() for x in cell.split(":", 1))
            flash, chunked = pairs(cell)
            ctx = str(_largest(label))
            for name, v in (("flash", flash), ("LT_chunked", chunked)):
                if v is not None:
                    size[name][ctx] = v
        step_time[row[0]] = size
    sampling = {}
    samp = t["Sampling: time to sample the next token (ms), KV-cache softmax vs recurrent linear"]
    for row in samp[1:]:
        kv, rec = {}, {}
        for label, cell in zip(samp[0][1:], row[1:]):
            a, b = pairs(cell)
            if a is not None:
                kv[str(context(label))] = a
            if b is not None:
                rec[str(context(label))] = b
        sampling[row[0]] = {"kv_cache": kv, "recurrent": rec}
    learning = {}
    learn = t["Learning (8xH100, 24 h, C4, GPT-2 BPE, 2^19 tokens per update)"]
    for row in learn[1:]:
        soft, lin = {}, {}
        for label, cell in zip(learn[0][1:], row[1:]):
            a, b = pairs(cell)
            ctx = str(int(label.split()[-1]))
            soft[ctx], lin[ctx] = a, b
        learning[row[0]] = {"softmax": soft, "linear": lin}
    dated = re.search(r"(\d{4}-\d{2}-\d{2})", text)
    return {
        "meta": {
            "how": "published",
            "source": source,
            "what": "the plot data of 'Linear Transformers Are Faster' (Buckman & Gelada, "
            "Manifest AI, 2024-01-05), read from the post's own plot files",
            "environment": {
                "device_kind": "NVIDIA H100 (the post's: one H100 for step and sampling "
                "times, 8xH100 for learning)",
                "jax_version": None,
                "git_commit": None,
                "time_utc": dated.group(1) if dated else None,
                "note": "the post's code and versions are not published with its figures",
            },
            "settings": {
                "batch": 1,
                "precision": "mixed",
                "step": "full GPT-2 training step (forward + backward + optimizer)",
                "learning": "8xH100, 24 h, C4, GPT-2 BPE, 2^19 tokens per update, final train loss",
            },
        },
        "step_time_ms": step_time,
        "sample_time_ms": sampling,
        "final_train_loss": learning,
    }


def _largest(label: str) -> int:
    """The post's axis labels: ``262k`` is 2^18, ``131k`` 2^17 (powers of two, rounded)."""
    m = re.fullmatch(r"(\d+)k", label)
    if m and int(m.group(1)) not in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        return 2 ** round(math.log2(int(m.group(1)) * 1000))
    return context(label)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--anchors", type=Path, required=True, help="published-figures.md")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/published_post.json")
    args = ap.parse_args(argv)
    if not args.anchors.is_file():
        print(f"error: {args.anchors} does not exist; pass --anchors PATH", file=sys.stderr)
        return 2
    data = convert(args.anchors.read_text(), "shared/anchors/published-figures.md")
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
