#!/usr/bin/env python
"""Compile the training step, or one attention, for a GPU this machine does not have.

    python scripts/compile.py CONFIG [section.key=value ...] [--target h100] [--batch N]
    python scripts/compile.py configs/gpt2_124m.yaml attention.name=LT_chunked \\
        model.block_size=65536 data.context=65536 --batch 1        # the post's timing setting
    python scripts/compile.py configs/post/124M_flash_16k.yaml --target h100x8   # one 8-GPU node
    python scripts/compile.py configs/gpt2_124m.yaml attention.name=flash --batch 1 --frontier
    python scripts/compile.py --attention LT_chunked --shape 1 16384 12 64 chunk_size=64 --kernels

Reports what the target would need, measured by XLA's real GPU compiler (deviceless): memory per
device (arguments + outputs + temporaries - donated aliases) against the target's budget, the
``model.remat`` / ``model.loss_chunk`` setting that ``auto`` resolves to, and with ``--kernels``
each Pallas/Triton kernel's grid, threads, shared memory, registers and spills. A step that does
not fit is reported with the bytes it needs and the largest power-of-two context that fits.
``--frontier`` searches the largest context that fits. No timing: compiling runs nothing.

Without ``--batch`` the step is the trainer's (``train.tokens_per_update`` split into
micro-batches over the target's devices); with ``--batch N`` it is one micro-step of N sequences,
the setting of the post's timing figure (batch 1). Needs the CUDA plugin (``make setup``
installs it; otherwise ``pip install -e '.[cuda]'``). Exit codes: 0 fits, 1 does not fit or does
not compile, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linear_gpt2.platform import cli  # noqa: E402  (before JAX: it sets XLA's log level)


def parse_args(argv: list[str]) -> argparse.Namespace:
    from linear_gpt2.platform import target

    p = cli.ArgumentParser(
        prog="scripts/compile.py",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("config", nargs="?", help="run config (YAML); omit with --attention")
    p.add_argument(
        "overrides", nargs="*", help="section.key=value (attention options with --attention)"
    )
    p.add_argument("--target", default=target.DEFAULT, help=f"one of {', '.join(target.names())}")
    p.add_argument("--list-targets", action="store_true", help="describe the targets and exit")
    p.add_argument(
        "--batch", type=cli.positive_int, default=None, help="one micro-step of N sequences"
    )
    p.add_argument("--kernels", action="store_true", help="report every Pallas/Triton kernel")
    p.add_argument("--fail-on-spill", action="store_true", help="a register spill is an error")
    p.add_argument("--frontier", action="store_true", help="search the largest context that fits")
    p.add_argument(
        "--budget-gib", type=cli.positive_float, default=None, help="override the target's budget"
    )
    p.add_argument("--json", default=None, help="also write the report to this JSON file")
    p.add_argument("--attention", default=None, help="compile this attention alone")
    p.add_argument("--shape", nargs=4, type=cli.positive_int, metavar=("B", "T", "H", "D"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--forward-only", action="store_true", help="attention: no backward pass")
    # Overrides may come before options: argparse leaves "a=b" words for the positionals.
    args, extra = p.parse_known_args(argv)
    unknown = [w for w in extra if w.startswith("-")]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = list(args.overrides) + extra
    if args.config and "=" in args.config:  # attention mode: no config, options only
        args.overrides.insert(0, args.config)
        args.config = None
    if args.attention is None and args.config is None and not args.list_targets:
        p.error("give a CONFIG, or --attention NAME --shape B T H D")
    if args.attention is not None and args.shape is None:
        p.error("--attention needs --shape B T H D")
    if args.target not in target.TARGETS:
        target.get(args.target)  # the one-line error listing the targets
    if args.json and not Path(args.json).absolute().parent.is_dir():
        p.error(f"--json {args.json}: its directory does not exist")
    return args


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def print_choices(choices: list[str]) -> None:
    """The kernel choices made by shape while compiling (LT_chunked ``kernel=pallas``)."""
    for choice in choices:
        print(f"kernel: {choice}")


def kernel_choices():
    """A block that collects the kernel choices logged while it runs (their INFO records)."""
    from linear_gpt2 import kernels
    from linear_gpt2.platform import logs

    choices: list[str] = []
    return logs.echo(kernels.CHOICES, choices.append), choices


def print_kernels(report) -> None:
    from rich.console import Console
    from rich.table import Table

    if not report.kernels:
        print("kernels: none (no Pallas/Triton kernel in this program)")
        return
    table = Table(title=f"Pallas/Triton kernels ({report.target.name})")
    for col in ("kernel", "grid", "programs", "threads", "smem (B)", "regs", "spill st/ld (B)"):
        table.add_column(col, justify="left" if col == "kernel" else "right")
    for k in report.kernels:
        table.add_row(
            k.name,
            "x".join(map(str, k.grid)),
            str(k.programs),
            str(k.threads_per_block),
            str(k.shared_memory),
            "-" if k.registers is None else str(k.registers),
            "-" if k.spills is None else f"{k.spill_stores}/{k.spill_loads}",
        )
    Console(width=120).print(table)
    limit = report.target.device.get("shared_memory_per_block_optin")
    print(f"shared memory per block limit {limit} B; registers per thread limit 255")


def print_collectives(report) -> None:
    """Every collective of a multi-device step: bytes one device sends per step (counted from
    the compiled program, ring algorithms; ``experiments/collectives.py``)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"collectives per device per step ({report.compile.target.name})")
    for col in ("collective", "mesh axes", "where", "launches", "sent (GB)"):
        table.add_column(col, justify="right" if col in ("launches", "sent (GB)") else "left")
    for c in report.collectives:
        table.add_row(c["kind"], c["axes"], c["where"], str(c["launches"]),
                      f"{c['sent_bytes'] / 1e9:,.3f}")  # fmt: skip
    Console(width=120).print(table)


def run_attention(args) -> int:
    from linear_gpt2.experiments import compile_step

    options = {}
    for o in args.overrides:
        k, _, v = o.partition("=")
        if not k or not v:
            raise cli.UsageError(f"attention options look like key=value, got {o!r}")
        options[k] = int(v) if v.lstrip("-").isdigit() else (float(v) if _is_float(v) else v)
    from linear_gpt2 import attention

    try:
        attention.get(args.attention, **options)  # bad names and options: usage errors
    except (ValueError, TypeError, NotImplementedError) as e:
        raise cli.UsageError(str(e)) from None
    watch, choices = kernel_choices()
    with watch:
        report = compile_step.compile_attention(
            args.attention,
            tuple(args.shape),
            args.dtype,
            args.target,
            backward=not args.forward_only,
            kernels=True,
            fail_on_spill=args.fail_on_spill,
            **options,
        )
    print(f"{report.what} for {report.target.name}: compiled in {report.seconds:.1f} s")
    print(f"memory per device: {report.memory.describe()}")
    print_choices(choices)
    print_kernels(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=1) + "\n")
    return 0


def _is_float(v: str) -> bool:
    try:
        float(v)
        return True
    except ValueError:
        return False


def run_step(args) -> int:
    from linear_gpt2.experiments import compile_step
    from linear_gpt2.platform import target
    from linear_gpt2.platform.memory import GiB
    from linear_gpt2.training.config import load_config

    t = target.get(args.target)
    cfg = load_config(args.config, args.overrides)
    model_cfg = cfg.model_config
    budget = None if args.budget_gib is None else int(args.budget_gib * GiB)
    budget_of = budget if budget is not None else t.budget_bytes
    print(t.describe())
    watch, choices = kernel_choices()
    with watch:
        report = compile_step.compile_config(
            cfg,
            t,
            batch=args.batch,
            kernels=args.kernels,
            fail_on_spill=args.fail_on_spill,
            budget_bytes=budget,
        )
    accum, batch = report.accum, report.batch
    c = report.config
    kernel = c.attention_options.as_dict().get("kernel")
    print(
        f"{c.attention}{f' (kernel={kernel})' if kernel else ''}, {c.n_layer} layers x "
        f"{c.n_embd}, context "
        f"{report.context}, {accum} x {batch} sequences per update, {c.dtype}: compiled in "
        f"{report.compile.seconds:.1f} s"
    )
    print(f"memory plan: {report.plan.describe()}")
    print(f"memory per device: {report.compile.memory.describe()}")
    if report.context_parallel > 1:
        print(
            f"context parallelism: each sequence over {report.context_parallel} devices, "
            f"{report.context // report.context_parallel:,} tokens each"
        )
    if report.collectives:
        print_collectives(report)
    print_choices(choices)
    if args.kernels:
        print_kernels(report.compile)
    out = {"step": report.as_dict()}
    status = 0
    if args.frontier or not report.fits:
        micro = batch  # global sequences of one micro-step; accumulation adds no memory
        hi = 2**21 if args.frontier else report.context // 2
        best, reports = compile_step.largest_context(
            model_cfg, t, batch=micro, lo=1024, hi=max(hi, 1024), budget_bytes=budget,
            context_parallel=cfg.train.context_parallel,
            on_report=lambda T, r: print(
                f"  context {T:>9,}: {_gib(r.compile.memory.total)} GiB "
                f"({r.config.remat}, loss_chunk={r.config.loss_chunk}) "
                f"{'fits' if r.fits else 'does not fit'}", flush=True),
        )  # fmt: skip
        out["frontier"] = {
            "largest_context": best,
            "batch": micro,
            "memory": {T: r.compile.memory.total for T, r in sorted(reports.items())},
        }
        where = (
            f"the largest power-of-two context that fits is {best:,} "
            f"({_gib(reports[best].compile.memory.total)} GiB)"
            if best
            else "no power-of-two context >= 1024 fits"
        )
        if not report.fits:
            print(
                f"error: the step needs {report.compile.memory.total:,} bytes "
                f"({_gib(report.compile.memory.total)} GiB) per device with the most frugal "
                f"setting, more than the {_gib(budget_of)} GiB budget of {t.name}; {where}",
                file=sys.stderr,
            )
            status = 1
        else:
            print(f"frontier: {where}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
    return status


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (see ``linear_gpt2.platform.cli``)."""
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    from linear_gpt2.platform import kernel_report, target

    if "--kernels" in argv or "--attention" in argv:
        # ptxas's register/spill report is an XLA INFO log: enable it before JAX starts.
        kernel_report.enable_ptxas_log()
    args = parse_args(argv)
    if args.list_targets:
        for t in target.TARGETS.values():
            print(t.describe())
        return 0
    return run_attention(args) if args.attention else run_step(args)


if __name__ == "__main__":
    cli.main(_main)
