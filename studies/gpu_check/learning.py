"""The learning cells of ``make gpu-check`` (its second pass): the sweeps, their points, and what
their runs say.

- ``mqar``: Zoology's (256, 16) MQAR cell with its zeros, softmax, and Based's recipe (taylor2,
  short convolution) at ReBased's L = 128 and 256, at Zoology's budget
  (``configs/sweeps/mqar_zoology_gpu.yaml``), which the CPU could not give them;
- ``context``: the context grid of ``configs/sweeps/context_cpu.yaml`` with two seeds
  (``configs/sweeps/context_gpu.yaml``), trained for two passes over the corpus's training
  split: ``train.max_steps`` is counted here from the corpus, so that it follows the corpus.

:func:`curve_summary` and :func:`gaps` read the runs: where held-out loss starts rising, and each
variant's gap to ``flash`` per context beside the spread between seeds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from typing import Any

from linear_gpt2.platform.provenance import REPO

PASSES = 2


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    stage: str
    file: str  # relative to the repository
    title: str
    update_assumption: str  # plan.ASSUMPTIONS' price of one update
    passes: bool  # train.max_steps = PASSES over the training split
    concurrent: int = 1  # runs side by side on the GPU


SWEEPS = (
    SweepSpec("mqar", "configs/sweeps/mqar_zoology_gpu.yaml", "MQAR at Zoology's budget: its "
              "(256, 16) cell with its zeros, softmax; Based's recipe at ReBased's L = 128 and "
              "256", "mqar_update", False),
    SweepSpec("context", "configs/sweeps/context_gpu.yaml", "the context grid, two passes over "
              "the corpus, two seeds", "context_update", True, 4),
)  # fmt: skip
# The CPU path: two points of each sweep, two updates each, a tiny model.
TINY_POINTS = 2
TINY_OVERRIDES = ("train.max_steps=2", "log.every=1", "log.eval_every=1", "log.eval_batches=1",
                  "log.diagnostics=false", "log.wandb=disabled", "model.n_layer=1")  # fmt: skip
TINY_MQAR = ("data.context=64", "data.mqar.num_kv_pairs=4", "data.mqar.train_examples=256",
             "train.tokens_per_update=256", "train.micro_batch=4")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class LearningPoint:
    index: int
    name: str
    max_steps: int
    evals: int
    overrides: tuple[str, ...]


def points(spec: SweepSpec, tiny: bool) -> list[LearningPoint]:
    """The sweep's points, with the overrides ``make gpu-check`` adds and the updates each runs
    at most (a run stopped at ``train.target_val_acc`` runs fewer)."""
    from linear_gpt2.experiments.sweep_file import load_sweep
    from linear_gpt2.training.config import load_config

    sweep = load_sweep(REPO / spec.file)
    out = []
    chosen = sweep.points[:TINY_POINTS] if tiny else sweep.points
    for p in chosen:
        extra: tuple[str, ...] = ()
        if tiny:
            extra = TINY_OVERRIDES + (TINY_MQAR if spec.stage == "mqar" else ())
        cfg = load_config(str(sweep.base), [*p.overrides, *extra])
        if spec.passes and not tiny:
            steps = math.ceil(
                PASSES * train_tokens(cfg.data.doc_chars) / cfg.train.tokens_per_update
            )
            extra = (f"train.max_steps={steps}",)
            cfg = load_config(str(sweep.base), [*p.overrides, *extra])
        evals = cfg.train.max_steps // cfg.log.eval_every if cfg.log.eval_every else 0
        out.append(LearningPoint(p.index, p.name, cfg.train.max_steps, evals, extra))
    return out


def train_tokens(doc_chars: int) -> int:
    """Tokens of the Shakespeare corpus's training split (documents + EOT), counted once per
    corpus and kept in the project's cache."""
    from linear_gpt2.platform.env import cache_root
    from linear_gpt2.training.data import packing, shakespeare

    key = f"{shakespeare.PACKAGE}=={shakespeare.package_version()} doc_chars={doc_chars}"
    cache = cache_root() / "gpu_check" / "corpus_tokens.json"
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    if key not in known:
        docs = shakespeare.corpus_documents(doc_chars)
        every = shakespeare.VAL_EVERY
        known[key] = sum(
            len(packing.doc_tokens(text))
            for i, (_, text) in enumerate(docs)
            if not (i % every == every - 1 or (len(docs) < every and i == len(docs) - 1))
        )
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(known, indent=1) + "\n")
    return int(known[key])


# ------------------------------------------------------------------------- reading the runs


def curve_summary(evals: list[tuple[int, float]]) -> dict[str, Any]:
    """Held-out loss over updates: its minimum, the last value, and where it starts rising (the
    first evaluation after the minimum that is above it; None while it still falls)."""
    if not evals:
        return {"min_step": None, "min_loss": None, "final_loss": None, "rising_from": None}
    evals = sorted(evals)
    i = min(range(len(evals)), key=lambda j: evals[j][1])
    later = [s for s, v in evals[i + 1 :] if v > evals[i][1]]
    return {
        "min_step": evals[i][0],
        "min_loss": evals[i][1],
        "final_step": evals[-1][0],
        "final_loss": evals[-1][1],
        "rising_from": later[0] if later else None,
    }


def gaps(rows: list[dict[str, Any]], baseline: str = "flash") -> list[dict[str, Any]]:
    """Per context and variant: the final held-out loss minus the baseline's, per seed; their
    mean; and the seed noise, the largest spread between seeds of any variant at that context
    (the baseline's included). ``rows``: ``variant``, ``context``, ``seed``, ``final_loss``."""
    by = {(r["variant"], r["context"], r["seed"]): r["final_loss"] for r in rows}
    out = []
    for ctx in sorted({r["context"] for r in rows}):
        spread = []
        for v in {r["variant"] for r in rows if r["context"] == ctx}:
            vals = [x for (vv, c, _), x in by.items() if vv == v and c == ctx and x is not None]
            if len(vals) >= 2:
                spread.append(max(vals) - min(vals))
        noise = max(spread) if spread else None
        for v in sorted({r["variant"] for r in rows if r["context"] == ctx} - {baseline}):
            per_seed = {}
            for (vv, c, s), x in by.items():
                base = by.get((baseline, ctx, s))
                if vv == v and c == ctx and x is not None and base is not None:
                    per_seed[s] = x - base
            mean = statistics.fmean(per_seed.values()) if per_seed else None
            out.append({
                "context": ctx, "variant": v, "gap_per_seed": per_seed, "gap": mean,
                "seed_noise": noise,
                "above_noise": None if mean is None or noise is None else abs(mean) > noise,
            })  # fmt: skip
    return out
