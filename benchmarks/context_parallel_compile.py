"""Issue 29's compiled acceptance: the training step of each ``configs/long/*.yaml`` (the sequence
split over a node's GPUs, ``train.context_parallel``) compiled on this CPU machine for its
multi-GPU H100 target (deviceless XLA: nothing runs, nothing is timed).

Per point: the memory XLA's buffer assignment gives one device (against the target's 72 GiB
budget), the ``auto`` memory setting chosen, and every collective of the compiled program
with the bytes it sends per device per step (``experiments/collectives.py``: counted from the
optimised HLO), beside a MODEL of what context parallelism should send: the linear state per
layer and pass for the linear family, (N - 1) / N of K and V per layer for flash's ring, and
one all-reduce of the replicated gradients.

    python benchmarks/context_parallel_compile.py                 # every point (about an hour)
    python benchmarks/context_parallel_compile.py --points 124M_flash_2M_cp8

Writes ``context_parallel_h100x8_compiled.json``; ``scripts/render_reports.py`` renders its
page. A point's row is replaced when it is compiled again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from linear_gpt2.experiments import collectives, compile_step  # noqa: E402
from linear_gpt2.model import count_params, init_params  # noqa: E402
from linear_gpt2.platform import provenance  # noqa: E402
from linear_gpt2.training.config import load_config  # noqa: E402
from studies import common as reports  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
OUT = RESULTS / "context_parallel_h100x8_compiled.json"
PAGE = RESULTS / "context_parallel_h100x8_compiled.md"
# config stem -> target. The memory ladder starts at full rematerialisation: at these lengths
# per device the cheaper settings are far over the budget (the one-GPU frontier,
# memory_frontier_h100_compiled.json), and each rung costs minutes to compile.
POINTS = {
    "124M_LT_chunked_8M_cp8": "h100x8",
    "1.6B_LT_chunked_1M_cp8": "h100x8",
    "124M_flash_2M_cp8": "h100x8",
    "124M_flash_2M_cp8_docs": "h100x8",
    "124M_LT_chunked_16M_cp16": "h100x16",
}
START_RUNG = 3  # memory_plan.LADDER: (LOSS_CHUNK, "full")


def model_bytes(cfg, n_params: int, devices: int) -> dict[str, float | str]:
    """The MODEL of what one device sends per step: the attention's exchange over ``seq`` for a
    forward and a backward pass (``attention_seq``) and with the forward run a second time, as
    rematerialisation may (``attention_seq_remat``), and the parameters' traffic over every
    device."""
    m, n = cfg.model_config, cfg.train.context_parallel
    B, T, H, D = cfg.train.micro_batch, cfg.data.context, m.n_head, m.n_embd // m.n_head
    if m.spec.family == "softmax":
        from linear_gpt2.kernels.flash.ring import modelled_ring_bytes

        layout = m.ring
        ring = modelled_ring_bytes(B, T, H, D, n, 2 if m.dtype == "bfloat16" else 4, layout)
        forward, backward = ring["forward"], ring["backward"]
        what = "ring: (N-1)/N of K and V per layer forward; K, V and float32 dK, dV backward"
        if layout == "zigzag":
            what += "; q, k, v, y to the balanced layout and back, each way"
    else:
        forward = backward = collectives.linear_state_bytes(B, H, D, n, gate=m.decay == "gate")
        what = "the slice states' all-gather per layer forward, its reduce-scatter backward"
    # The position table is split along T like the sequence (FSDP picks its longest axis), so
    # each device reads only its own rows: no traffic. The rest, with FSDP: gradients
    # reduce-scattered, float32 parameters gathered for the forward, its recomputation and the
    # backward; without: one all-reduce of the gradients.
    if cfg.train.fsdp:
        params = (devices - 1) / devices * n_params * 4 * 3
    else:
        params = collectives.gradient_bytes(n_params, devices)
    return {
        "attention_seq": m.n_layer * (forward + backward),
        "attention_seq_remat": m.n_layer * (2 * forward + backward),
        "attention_what": what,
        "parameters_all": params,
    }


def _params(cfg) -> int:
    """Parameters without the position table (nanoGPT's count)."""
    import jax

    return count_params(jax.eval_shape(lambda: init_params(cfg.model_config, 0)))


def _config(stem: str):
    return load_config(ROOT / "configs" / "long" / f"{stem}.yaml", [])


def compile_point(stem: str, target: str) -> dict:
    path = ROOT / "configs" / "long" / f"{stem}.yaml"
    cfg = _config(stem)
    t0 = time.perf_counter()
    report = compile_step.compile_config(cfg, target, start_rung=START_RUNG)
    seconds = time.perf_counter() - t0
    n_params = _params(cfg)
    devices = report.compile.target.n_devices
    sent = report.collectives
    counted_seq = sum(r["sent_bytes"] for r in sent if r["where"] == "attention")
    model = model_bytes(cfg, n_params, devices)
    return {
        "point": stem,
        "config": str(path.relative_to(ROOT)),
        "target": target,
        "devices": devices,
        "attention": cfg.attention.name,
        "doc_reset": cfg.attention.doc_reset,
        "kernel": report.config.kernel,
        "n_params": n_params,
        "context": cfg.data.context,
        "context_parallel": cfg.train.context_parallel,
        "tokens_per_device": cfg.data.context // cfg.train.context_parallel,
        "fsdp": cfg.train.fsdp,
        "remat": report.config.remat,
        "loss_chunk": report.config.loss_chunk,
        "memory": report.compile.memory.as_dict(),
        "budget_bytes": report.compile.target.budget_bytes,
        "fits": report.fits,
        "tried": [[name, m.total] for name, m in report.plan.tried],
        "collectives": sent,
        "attention_sent_bytes": counted_seq,
        "model": model,
        "compile_seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", nargs="*", default=list(POINTS), choices=list(POINTS))
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument(
        "--model-only",
        action="store_true",
        help="recompute the MODEL columns of the compiled rows; compile nothing",
    )
    args = p.parse_args(argv)
    data = json.loads(args.out.read_text()) if args.out.exists() else {"rows": []}
    if args.model_only:
        for row in data["rows"]:
            cfg = _config(row["point"])
            row["n_params"] = _params(cfg)  # without the position table
            row["model"] = model_bytes(cfg, row["n_params"], row["devices"])
        data["meta"]["model_environment"] = provenance.environment()
        args.out.write_text(json.dumps(data, indent=1, default=str) + "\n")
        reports.page(PAGE, reports.block("context_parallel.page", OUT.name))
        return 0
    for stem in args.points:
        row = compile_point(stem, POINTS[stem])
        row["environment"] = provenance.environment()
        data["rows"] = [r for r in data["rows"] if r["point"] != stem] + [row]
        gib = row["memory"]["total"] / 2**30
        print(
            f"{stem}: {gib:.2f} GiB per device ({row['remat']}), "
            f"{'fits' if row['fits'] else 'does NOT fit'}; attention sends "
            f"{row['attention_sent_bytes']:,.0f} B per device per step (model "
            f"{row['model']['attention_seq']:,.0f})",
            flush=True,
        )
        data["meta"] = {
            "how": "compiled",
            "what": "the training step (clip + AdamW, bf16) of each configs/long point compiled "
            "for a multi-GPU H100 target on a CPU machine (deviceless XLA); memory from XLA's "
            "buffer assignment, collectives counted from the optimised HLO; 'model' is MODELLED",
            "script": "benchmarks/context_parallel_compile.py",
            "settings": {"start_rung": START_RUNG, "points": POINTS},
            "environment": row["environment"],
        }
        args.out.write_text(json.dumps(data, indent=1, default=str) + "\n")
    reports.page(PAGE, reports.block("context_parallel.page", OUT.name))
    return 0


if __name__ == "__main__":
    from linear_gpt2.platform import process

    process.configure()  # the settings JAX reads as it starts (platform/process.py)
    sys.exit(main())
