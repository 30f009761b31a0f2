"""The training step and single attentions compiled for a GPU target (no GPU needed).

What ``scripts/compile.py``, the memory frontier and the compile tests ask for: the trainer's own
step (``training.train_step.jit_train_step``) or one attention's forward / backward, compiled by
:func:`linear_gpt2.platform.target.compile_program` for a target's devices, with ``model.remat``
/ ``model.loss_chunk`` ``auto`` resolved by ``training.memory_plan`` against the target's budget:
each candidate estimated first (traced for the target's GPUs, ``target.traced_for``), only those
that can fit compiled, fastest first, and the chosen one's executable kept.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from linear_gpt2 import attention
from linear_gpt2.experiments import collectives
from linear_gpt2.model import gpt, layers
from linear_gpt2.platform.target import (
    DEFAULT,
    CompileReport,
    Target,
    compile_program,
    devices,
    get,
    replicated,
    traced_for,
)
from linear_gpt2.training import memory_plan
from linear_gpt2.training.batches import plan_batches
from linear_gpt2.training.config import TrainConfig
from linear_gpt2.training.optim import optimizer
from linear_gpt2.training.sharding import make_mesh
from linear_gpt2.training.train_step import jit_train_step


def mesh(target: str | Target = DEFAULT, context_parallel: int = 1):
    """The trainer's mesh over the target's (compile-only) devices: ``(data,)``, or ``(data,
    seq)`` with the sequence split over ``context_parallel`` of them."""
    return make_mesh(list(devices(get(target).name)), context_parallel)


def compile_attention(
    name: str,
    shape: tuple[int, int, int, int],
    dtype: Any = "bfloat16",
    target: str | Target = DEFAULT,
    *,
    backward: bool = True,
    kernels: bool = True,
    fail_on_spill: bool = False,
    resets: bool = False,
    log_gate: bool = False,
    key_dim: int | None = None,
    **options: Any,
) -> CompileReport:
    """Compile attention ``name`` alone at q, k, v ``shape`` = ``[B, T, H, D]``: forward, or
    forward + backward (a VJP with a cotangent), for ``target``. ``resets`` / ``log_gate``:
    with forgetting (issue 14), document starts bool ``[B, T]`` and log-gates float32
    ``[B, T, H]`` as further inputs (the backward differentiates the log-gates too).
    ``key_dim``: q and k of that many dimensions instead of D (``attention.feature_dim``)."""
    fn = attention.get(name, **options)
    rep = replicated(target)
    x = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=rep)
    B, T, H, _ = shape
    qk = x if key_dim is None else jax.ShapeDtypeStruct((B, T, H, key_dim), x.dtype, sharding=rep)
    extra: tuple[Any, ...] = ()
    if resets:
        extra += (jax.ShapeDtypeStruct((B, T), jnp.bool_, sharding=rep),)
    if log_gate:
        extra += (jax.ShapeDtypeStruct((B, T, H), jnp.float32, sharding=rep),)

    def call(q, k, v, *forget):
        kw = {}
        if resets:
            kw["resets"] = forget[0]
        if log_gate:
            kw["log_gate"] = forget[-1]
        return fn(q, k, v, **kw)

    if backward:

        def f(q, k, v, dy, *forget):
            r, g = (forget[:1], forget[1:]) if resets else ((), forget)
            y, vjp = jax.vjp(lambda q, k, v, *g: call(q, k, v, *r, *g), q, k, v, *g)
            return y, vjp(dy)

        args: tuple[Any, ...] = (qk, qk, x, x, *extra)
    else:
        f, args = call, (qk, qk, x, *extra)
    opts = ", ".join(f"{k}={v}" for k, v in sorted(options.items()))
    what = f"{name} {'forward+backward' if backward else 'forward'} {list(shape)} {dtype}" + (
        f" ({opts})" if opts else ""
    )
    if resets or log_gate:
        what += " with " + " and ".join(
            w for w, on in (("resets", resets), ("log-gates", log_gate)) if on
        )
    out = compile_program(
        jax.jit(f), args, target, kernels=kernels, fail_on_spill=fail_on_spill, what=what
    )
    assert isinstance(out, CompileReport)
    return out


# --------------------------------------------------------------------------------------------
# The training step


@dataclasses.dataclass
class StepReport:
    """A training step compiled for a target, with ``auto`` memory settings resolved."""

    config: Any  # the resolved ModelConfig
    compile: CompileReport
    plan: Any  # memory_plan.Plan
    accum: int
    batch: int  # global sequences per micro-step
    context: int
    context_parallel: int = 1
    # Per kind and mesh axis, what the step's collectives send per device (``collectives``);
    # empty on a one-device target.
    collectives: list[dict] = dataclasses.field(default_factory=list)
    # The chosen setting's compiled step (the plan's executable, not compiled again): its
    # ``as_text()`` is the optimized program.
    executable: Any = None
    # The chosen step's ``auto`` choices as traced for the target (:func:`choices`).
    choices: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def hlo_text(self) -> str | None:
        """The chosen setting's optimized HLO text (what ``hlo_costs`` prices), or None."""
        return None if self.executable is None else self.executable.as_text()

    @property
    def fits(self) -> bool:
        return self.plan.fits

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.compile.as_dict(),
            "fits": self.fits,
            "remat": self.config.remat,
            "loss_chunk": self.config.loss_chunk,
            "attention": self.config.attention,
            "kernel": self.config.attention_options.as_dict().get("kernel"),
            "accum": self.accum,
            "batch": self.batch,
            "context": self.context,
            "context_parallel": self.context_parallel,
            "collectives": self.collectives,
            "tried": [(name, m.total) for name, m in self.plan.tried],
            "choices": self.choices,
        }


def choices(cfg: Any, target: str | Target = DEFAULT) -> dict[str, Any]:
    """What ``cfg``'s (a ``ModelConfig``, remat resolved) step runs when traced for ``target``,
    asked of the model's own readers of each option: the blocks as one scan or unrolled
    (``model.scan_layers``) and the glue's implementation, ``xla`` or ``pallas``
    (``model.layernorm_kernel``, ``mlp_kernel``, ``bias_kernel``, ``loss_kernel``)."""
    impl = {True: "pallas", False: "xla"}
    with traced_for(get(target)):
        return {
            "scan_layers": gpt.scans_layers(cfg),
            "layernorm_kernel": impl[layers.fused_layer_norm(cfg)],
            "mlp_kernel": impl[layers.fused_mlp(cfg)],
            "bias_kernel": impl[layers.fused_bias(cfg)],
            "loss_kernel": gpt.loss_kernel_of(cfg),
        }


def compile_train_step(
    cfg: Any,
    target: str | Target = DEFAULT,
    *,
    batch: int = 1,
    accum: int = 1,
    context: int | None = None,
    fsdp: bool = False,
    kernels: bool = False,
    fail_on_spill: bool = False,
    budget_bytes: int | None = None,
    start_rung: int = 0,
    context_parallel: int = 1,
) -> StepReport:
    """Compile the trainer's step (``train_step.jit_train_step``: clip + AdamW, state donated)
    for ``cfg`` (a ``ModelConfig``) on ``target``: ``accum`` micro-steps of ``batch`` sequences
    (global, split over the target's devices) of ``context`` tokens (default ``block_size``).
    ``remat`` / ``loss_chunk`` ``auto`` are resolved by ``memory_plan.plan`` against the target's
    budget (or ``budget_bytes``); the report is that of the chosen setting. ``context_parallel``
    splits each sequence over that many devices (``train.context_parallel``): the memory
    reported is then one device's, holding ``context / context_parallel`` positions."""
    t = get(target)
    budget = t.budget_bytes if budget_bytes is None else budget_bytes
    tx = optimizer(TrainConfig())
    reports: dict[Any, CompileReport] = {}

    def compile_candidate(c):
        program = jit_train_step(
            c, tx, mesh(t, context_parallel), accum=accum, batch=batch, context=context,
            fsdp=fsdp,
        )  # fmt: skip
        what = f"{c.attention} step, {c.n_layer}L {c.n_embd}C, context {context or c.block_size}"
        report, compiled = compile_program(
            program.step,
            program.args,
            t,
            kernels=kernels,
            fail_on_spill=fail_on_spill,
            what=f"{what} ({memory_plan.label(c)})",
            keep_executable=True,
        )
        assert isinstance(report, CompileReport)
        reports[c] = report
        return report.memory, compiled

    shape = step_shape(t, batch, context or cfg.block_size, accum, context_parallel, fsdp)

    def estimate(c):
        with traced_for(t):
            return memory_plan.estimate(c, shape)

    chosen = memory_plan.plan(cfg, compile_candidate, budget, start=start_rung, estimate=estimate)
    if chosen.config not in reports:  # fully explicit settings: plan() compiled nothing
        mem, exe = compile_candidate(chosen.config)
        chosen = dataclasses.replace(
            chosen, fits=mem.total <= budget, budget=budget, memory=mem, executable=exe,
            tried=[(memory_plan.label(chosen.config), mem)],
        )  # fmt: skip
    return StepReport(
        chosen.config,
        reports[chosen.config],
        chosen,
        accum,
        batch,
        context or cfg.block_size,
        context_parallel,
        # Only the chosen program's collectives are read: its text, once.
        collectives.summary(collectives.collectives(chosen.executable.as_text(), t.n_devices))
        if chosen.executable is not None and t.n_devices > 1
        else [],
        chosen.executable,
        choices(chosen.config, t),
    )


def step_shape(
    target: str | Target,
    batch: int,
    context: int,
    accum: int = 1,
    context_parallel: int = 1,
    fsdp: bool = False,
) -> memory_plan.StepShape:
    """The step as one of ``target``'s devices runs it (``memory_plan.estimate``'s input):
    ``batch`` global sequences per micro-step of ``context`` tokens."""
    t = get(target)
    return memory_plan.StepShape.of(
        batch, context, accum=accum, devices=t.n_devices, context_parallel=context_parallel,
        fsdp=fsdp, devices_per_host=int(t.topology.split("x")[2]),
    )  # fmt: skip


def with_context(cfg: Any, context: int) -> Any:
    """``cfg`` at another context: ``block_size`` (hence the position table) follows it."""
    return cfg.replace(block_size=context)


def largest_context(
    cfg: Any,
    target: str | Target = DEFAULT,
    *,
    batch: int = 1,
    lo: int = 1024,
    hi: int = 2**21,
    budget_bytes: int | None = None,
    on_report: Callable[[int, StepReport], None] | None = None,
    context_parallel: int = 1,
) -> tuple[int | None, dict[int, StepReport]]:
    """The largest power-of-two context in [lo, hi] whose step fits (memory settings as in
    ``cfg``, ``auto`` resolved), by bisection over the exponents (fitting is monotone in the
    context), each sequence split over ``context_parallel`` devices. Returns it (None if even
    ``lo`` does not fit) and the reports compiled."""
    reports: dict[int, StepReport] = {}

    def fits(T: int) -> bool:
        r = compile_train_step(with_context(cfg, T), target, batch=batch, budget_bytes=budget_bytes,
                               context_parallel=context_parallel)  # fmt: skip
        reports[T] = r
        if on_report:
            on_report(T, r)
        return r.fits

    a, b = int(math.log2(lo)), int(math.log2(hi))
    if not fits(2**a):
        return None, reports
    best = a
    while a < b:  # invariant: 2**best fits; everything above 2**b is unknown or does not fit
        mid = (best + b + 1) // 2
        if fits(2**mid):
            best, a = mid, mid
        else:
            b = mid - 1
    return 2**best, reports


def compile_config(
    cfg: Any,
    target: str | Target = DEFAULT,
    *,
    batch: int | None = None,
    kernels: bool = False,
    fail_on_spill: bool = False,
    budget_bytes: int | None = None,
    start_rung: int = 0,
) -> StepReport:
    """Compile the step a run config (``config.Config``) trains with on ``target``'s devices:
    ``train.tokens_per_update`` split into micro-batches over the devices as the trainer does
    (``trainer.plan_batches``), or with ``batch`` one micro-step of that many sequences."""
    t = get(target)
    if batch is not None:
        accum, global_batch = 1, batch
    else:
        hosts = int(t.topology.split("x")[1])
        bp = plan_batches(cfg, t.n_devices, hosts)
        accum, global_batch = bp.accum, bp.global_micro_batch
    return compile_train_step(
        cfg.model_config,
        t,
        batch=global_batch,
        accum=accum,
        context=cfg.data.context,
        fsdp=cfg.train.fsdp,
        kernels=kernels,
        fail_on_spill=fail_on_spill,
        budget_bytes=budget_bytes,
        start_rung=start_rung,
        context_parallel=cfg.train.context_parallel,
    )
