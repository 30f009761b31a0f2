"""Step-time benchmark: milliseconds per full training step against context, per attention.

The post's timing figure (section 2, "Linear Transformers Are Faster"): one device, batch 1,
mixed precision, one full GPT-2 training step (forward, backward, AdamW) per measurement, every
context length from 1k upward until the device runs out of memory. Here:

- the step is the trainer's own: :func:`linear_gpt2.training.train_step.make_train_step` with
  :func:`linear_gpt2.training.optim.optimizer` (clip + AdamW), jitted with the state donated as in
  training, on ``[accum=1, batch, T]`` random tokens;
- it is compiled ahead of time (``lower().compile()``) so that compilation and a cap on memory
  (below) are decided before any buffer is allocated;
- ``warmup`` calls are discarded, then ``repeats`` calls are timed, each ended by
  ``jax.block_until_ready`` on the new state and the metrics (the device has finished the step),
  and the median is reported with the raw times;
- an out-of-memory error (XLA ``RESOURCE_EXHAUSTED`` / "out of memory", at compile time or at run
  time) ends the sweep over contexts for that (attention, size): it is recorded as the limit and
  larger contexts are not tried, since they need more memory still;
- ``max_bytes`` simulates a smaller device: a setting whose compiled step needs more than
  ``max_bytes`` (:func:`step_memory_bytes`: XLA's ``memory_analysis()``, arguments + outputs +
  temporaries - donated aliases) is recorded exactly as an OOM (``oom_reason`` says it was the
  cap). This is how the OOM path is tested on CPU, whose memory is effectively unbounded;
- a variant whose spec says ``sweep_chunk_size`` (``LT_chunked``) is timed at each candidate
  chunk size that divides the context and the fastest is recorded (``chunk_size``) with every
  candidate's median (``chunk_ms``), as the post picked the chunk size per setting from a few
  training steps each; the spec's ``kernel_design`` names the implementation the step ran.
"""

from __future__ import annotations

import csv
import dataclasses
import gc
import json
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from linear_gpt2.attention import autotune
from linear_gpt2.experiments.axes import loglog_slope
from linear_gpt2.model.api import count_params, init_config, init_params, param_shapes
from linear_gpt2.model.config import PRESETS, ModelConfig
from linear_gpt2.platform.memory import compiled_memory, is_oom
from linear_gpt2.platform.provenance import json_default
from linear_gpt2.training import memory_plan
from linear_gpt2.training.config import TrainConfig
from linear_gpt2.training.optim import optimizer
from linear_gpt2.training.sharding import make_mesh
from linear_gpt2.training.train_step import init_state, jit_train_step

# Model sizes: the post's four GPT-2 presets (vocabulary 50304) and a tiny one for CPU runs.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, vocab_size=256),
    **{name: dict(**dims, vocab_size=50304) for name, dims in PRESETS.items()},
}
# Chunk sizes tried for LT_chunked at each setting (only those dividing the context).
CHUNK_CANDIDATES = (32, 64, 128, 256)
TINY_CHUNK_CANDIDATES = (16, 32)
TINY_CONTEXTS = (64, 128, 256)


class SimulatedOOM(MemoryError):
    """The compiled step needs more memory than the ``max_bytes`` cap."""


def default_contexts(start: int = 1024, stop: int = 2**20) -> list[int]:
    """Powers of two from ``start`` to ``stop`` inclusive (the sweep stops earlier at an OOM)."""
    out, t = [], start
    while t <= stop:
        out.append(t)
        t *= 2
    return out


def model_config(
    size: str,
    attention: str,
    context: int,
    *,
    dtype: str = "bfloat16",
    chunk_size: int | None = None,
    **overrides: Any,
) -> ModelConfig:
    """The model of one setting: ``size`` from :data:`SIZES`, ``block_size = context``."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; valid sizes: {', '.join(SIZES)}")
    values: dict[str, Any] = {**SIZES[size], "block_size": context, "attention": attention}
    values["dtype"] = dtype
    if chunk_size is not None:
        values["chunk_size"] = chunk_size
    return ModelConfig(**{**values, **overrides})


# XLA options that halve compile time on CPU (LLVM backend at -O0) for smoke runs (``--tiny``)
# where the step takes milliseconds and compilation dominates; never for reported timings.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

# Compiled steps by (config, batch, options): an OOM cap that needs a setting's memory, and the
# tests, compile each setting once per process.
_COMPILED: dict[tuple[Any, ...], Any] = {}
_MAX_COMPILED = 16
# Seconds each entry of _COMPILED took to compile (its memory plan's candidates included).
_COMPILE_SECONDS: dict[tuple[Any, ...], float] = {}


# Where compile_step asks first for a step compiled elsewhere (make gpu-check's store of steps
# compiled on the CPU machine for the GPU, studies/gpu_check/compiled.py): called with each
# resolved candidate, it returns that step's executable or None (compile it here).
_STEP_LOADER: Callable[[ModelConfig, int, dict | None], Any] | None = None


def set_step_loader(loader: Callable[[ModelConfig, int, dict | None], Any] | None) -> None:
    global _STEP_LOADER
    _STEP_LOADER = loader


def _compiled_key(cfg: ModelConfig, batch: int, compiler_options: dict | None) -> tuple:
    return (cfg, batch, tuple(sorted((compiler_options or {}).items())))


def compile_step(cfg: ModelConfig, batch: int = 1, compiler_options: dict | None = None):
    """The AOT-compiled training step for ``cfg`` on ``[1, batch, block_size]`` tokens, on the
    first local device.

    Returns ``(compiled, tx, resolved_cfg)``; ``compiled(state, inputs, targets, key) -> (state,
    metrics)`` with the state donated. ``model.remat`` / ``model.loss_chunk`` ``auto`` resolve as
    in training (``memory_plan``: the fastest setting that fits the device; on the CPU, which
    reports no limit, the plain step). Nothing is allocated: shapes come from
    ``jax.eval_shape``. ``compiler_options`` go to XLA (e.g. :data:`FAST_COMPILE`).
    """
    key = _compiled_key(cfg, batch, compiler_options)
    if key not in _COMPILED:
        t0 = time.perf_counter()
        tx = optimizer(TrainConfig())
        mesh = make_mesh(jax.local_devices()[:1])

        def compile_candidate(c: ModelConfig):
            loaded = _STEP_LOADER(c, batch, compiler_options) if _STEP_LOADER else None
            if loaded is not None:
                return compiled_memory(loaded), loaded
            program = jit_train_step(c, tx, mesh, accum=1, batch=batch)
            lowered = program.step.lower(*program.args)
            compiled = lowered.compile(compiler_options=compiler_options or None)
            return compiled_memory(compiled), compiled

        budget = None if memory_plan.is_resolved(cfg) else memory_plan.device_budget()
        shape = memory_plan.StepShape(batch, cfg.block_size)
        plan = memory_plan.plan(
            cfg, compile_candidate, budget, estimate=lambda c: memory_plan.estimate(c, shape)
        )
        compiled = plan.executable
        if compiled is None:
            compiled = compile_candidate(plan.config)[1]
        _COMPILED[key] = (compiled, tx, plan.config)
        _COMPILE_SECONDS[key] = time.perf_counter() - t0
        while len(_COMPILED) > _MAX_COMPILED:  # a long GPU sweep need not keep them all
            _COMPILED.pop(next(iter(_COMPILED)))
    return _COMPILED[key]


def clear_compiled() -> None:
    _COMPILED.clear()


def precompile(
    configs: Sequence[ModelConfig],
    batch: int = 1,
    compiler_options: dict | None = None,
    threads: int = 4,
) -> None:
    """Compile the steps of ``configs`` side by side (XLA's compile of one program keeps about
    one core busy; a GPU machine has many), before any is timed: timing runs alone. A failure
    here (out of memory, a variant that cannot run) is left for :func:`bench_setting` to meet
    again and record."""
    from concurrent.futures import ThreadPoolExecutor

    def one(cfg: ModelConfig) -> None:
        try:
            compile_step(cfg, batch, compiler_options)
        except Exception:  # noqa: BLE001 - recorded when the setting is timed
            gc.collect()

    todo = [c for c in configs if _compiled_key(c, batch, compiler_options) not in _COMPILED]
    with ThreadPoolExecutor(max(1, min(threads, len(todo) or 1))) as pool:
        list(pool.map(one, todo[:_MAX_COMPILED]))


def step_memory_bytes(compiled) -> int | None:
    """Device bytes the compiled step needs: arguments + outputs + temporaries, minus the
    outputs that alias donated arguments (the new state reuses the old state's buffers). None
    where the backend does not report it."""
    m = compiled_memory(compiled)
    return None if m is None else m.total


def time_step(
    cfg: ModelConfig,
    *,
    batch: int = 1,
    warmup: int = 2,
    repeats: int = 5,
    max_bytes: int | None = None,
    seed: int = 0,
    compiler_options: dict | None = None,
) -> tuple[list[float], int | None]:
    """Seconds per training step of ``cfg`` (``repeats`` values after ``warmup``) and the
    compiled step's memory. Raises :class:`SimulatedOOM` above ``max_bytes``, and lets a real
    OOM propagate (see :func:`is_oom`)."""
    compiled, tx, _ = compile_step(cfg, batch, compiler_options)
    mem = step_memory_bytes(compiled)
    if max_bytes is not None and mem is not None and mem > max_bytes:
        raise SimulatedOOM(f"simulated: compiled step needs {mem} bytes > max_bytes={max_bytes}")
    state = jax.device_put(initial_state(cfg, tx, seed, compiler_options))
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (1, batch, cfg.block_size + 1), dtype=np.int32)
    x, y = jax.device_put(tokens[..., :-1]), jax.device_put(tokens[..., 1:])
    key = jax.random.key(seed)
    times: list[float] = []
    try:
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            state, metrics = compiled(state, x, y, key)
            jax.block_until_ready((state, metrics))
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        del state
    return times, mem


# The initial train state of the last architecture, on the host. Parameters do not depend on
# the attention (init_params traces softmax), so the attentions timed at one (size, context)
# share one initialisation instead of compiling it again; the state is donated to the step, so
# each setting gets a fresh device copy.
_INITIAL: dict[str, Any] = {}


def initial_state(cfg: ModelConfig, tx, seed: int = 0, compiler_options: dict | None = None):
    """Host (numpy) copy of ``init_state(init_params(cfg, seed), tx)``."""
    arch = (init_config(cfg).replace(chunk_size=64, kernel="auto"), seed)
    if _INITIAL.get("key") != arch:
        _INITIAL.clear()  # one at a time: a 1.6B state is ~19 GB of host memory
        init = jax.jit(lambda: init_state(init_params(cfg, seed), tx))
        compiled = init.lower().compile(compiler_options=compiler_options or None)
        _INITIAL.update(key=arch, state=jax.device_get(compiled()))
    return _INITIAL["state"]


@dataclasses.dataclass
class StepResult:
    """One attempted setting. ``status``: ``ok``, ``oom`` (the limit: larger contexts were not
    tried) or ``error`` (anything else; also ends that attention and size)."""

    attention: str
    size: str
    context: int
    status: str
    n_params: int
    median_ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    times_ms: list[float] = dataclasses.field(default_factory=list)
    chunk_size: int | None = None  # with the spec's sweep_chunk_size: the fastest candidate
    chunk_ms: dict[int, float] = dataclasses.field(default_factory=dict)  # candidate -> median
    # What ``chunk_size: auto`` picks (attention.autotune, timing the attention alone), beside
    # the step-level winner above, so the kernel-level search can be checked against it.
    autotune_chunk_size: int | None = None
    # The implementation the step ran (the spec's kernel_design): xla, or e.g. the Pallas design
    # LT_chunked's kernel=pallas chose for this shape (kernels/lt_chunked/cost.py).
    kernel_design: str | None = None
    memory_bytes: int | None = None
    compile_s: float | None = None  # the timed step's compile (with its memory plan's tries)
    # What model.remat / model.loss_chunk "auto" resolved to for the timed step (memory_plan: the
    # cheapest setting that fits the device), so a slow point that was rematerialised says so.
    remat: str | None = None
    loss_chunk: int | None = None
    oom_reason: str | None = None
    error: str | None = None
    # The model options the setting ran with beyond the size's (``--model``; empty: none), and
    # in a side-by-side run (:func:`side_by_side`) the name of its set of them and the median
    # of each round (the rounds alternate the sets).
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    variant: str | None = None
    rounds_ms: list[float] = dataclasses.field(default_factory=list)


def chunk_candidates(context: int, candidates: Sequence[int]) -> list[int]:
    """The candidate chunk sizes that divide ``context`` (LT_chunked needs it); the context
    itself when none does."""
    fits = [c for c in candidates if c <= context and context % c == 0]
    return fits or [context]


def short_error(err: BaseException, limit: int = 300) -> str:
    text = f"{type(err).__name__}: {err}".replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


def bench_setting(
    attention: str,
    size: str,
    context: int,
    *,
    batch: int = 1,
    dtype: str = "bfloat16",
    warmup: int = 2,
    repeats: int = 5,
    max_bytes: int | None = None,
    chunk_sizes: Sequence[int] = CHUNK_CANDIDATES,
    compiler_options: dict | None = None,
    overrides: dict[str, Any] | None = None,
) -> StepResult:
    """Time one (attention, size, context) with the model options ``overrides``; never raises
    for OOM or a failing variant."""
    base = model_config(size, attention, context, dtype=dtype, **(overrides or {}))
    n_params = count_params(param_shapes(base), non_embedding=False)
    result = StepResult(attention, size, context, "ok", n_params, overrides=dict(overrides or {}))
    spec = base.spec
    chunks: list[int | None] = (
        list(chunk_candidates(context, chunk_sizes)) if spec.sweep_chunk_size else [None]
    )
    best: tuple[float, int | None, list[float]] | None = None
    last_oom: BaseException | None = None
    for c in chunks:
        cfg = base if c is None else base.replace(chunk_size=c)
        try:
            times, mem = time_step(
                cfg,
                batch=batch,
                warmup=warmup,
                repeats=repeats,
                max_bytes=max_bytes,
                compiler_options=compiler_options,
            )
        except Exception as e:  # OOM ends the setting; other failures are recorded, not raised
            gc.collect()
            if is_oom(e):
                last_oom = e
                # Memory of the setting that did not fit (the cap's case knows it).
                if isinstance(e, SimulatedOOM):
                    compiled = compile_step(cfg, batch, compiler_options)[0]
                    result.memory_bytes = step_memory_bytes(compiled)
                continue
            result.status, result.error = "error", short_error(e)
            return result
        med = statistics.median(times)
        if c is not None:
            result.chunk_ms[c] = med * 1e3
        if best is None or med < best[0]:
            best = (med, c, times)
            result.memory_bytes = mem
            # The step time_step just compiled, from the cache (never compiled here).
            key = _compiled_key(cfg, batch, compiler_options)
            hit = _COMPILED.get(key)
            if hit is not None:
                result.remat, result.loss_chunk = hit[2].remat, hit[2].loss_chunk
            result.compile_s = _COMPILE_SECONDS.get(key)
    if best is None:
        assert last_oom is not None
        result.status = "oom"
        result.oom_reason = short_error(last_oom)
        return result
    med, c, times = best
    result.median_ms, result.min_ms = med * 1e3, min(times) * 1e3
    result.max_ms = max(times) * 1e3
    result.times_ms = [t * 1e3 for t in times]
    result.chunk_size = c
    shape = (batch, context, base.n_head, base.head_dim)
    if spec.sweep_chunk_size:
        result.autotune_chunk_size = autotune.best_chunk_size(
            attention, shape, jnp.dtype(dtype), base.kernel, candidates=chunks
        )
    if spec.kernel_design is not None:
        options = base.attention_options
        if c:  # the chunk size the sweep timed fastest
            options = options.replace(chunk_size=c)
        result.kernel_design = spec.kernel_design(shape, dtype, options)
    return result


def run_benchmark(
    attentions: Iterable[str],
    sizes: Iterable[str],
    contexts: Sequence[int],
    *,
    on_result: Callable[[StepResult], None] | None = None,
    compile_threads: int = 1,
    **kwargs: Any,
) -> list[StepResult]:
    """Every attention x size over increasing ``contexts``, stopping each (attention, size) at
    its first OOM or error. ``kwargs`` go to :func:`bench_setting`. With ``compile_threads``
    > 1 the settings of a size, every context, are compiled side by side before any is timed."""
    results = []
    names = list(attentions)
    for size in sizes:
        stopped: set[str] = set()
        if compile_threads > 1:
            settings = [c for t in sorted(contexts) for c in _settings(names, size, t, kwargs)]
            precompile(
                settings, kwargs.get("batch", 1), kwargs.get("compiler_options"), compile_threads
            )
        # Context-major: the attentions at one context run back to back (they share an
        # initialisation, and see the same machine conditions).
        for context in sorted(contexts):
            for name in names:
                if name in stopped:
                    continue
                r = bench_setting(name, size, context, **kwargs)
                results.append(r)
                if on_result is not None:
                    on_result(r)
                if r.status != "ok":
                    stopped.add(name)  # larger contexts need more memory still: the limit
            if len(stopped) == len(names):
                break
    return results


def side_by_side(
    attention: str,
    size: str,
    context: int,
    variants: dict[str, dict[str, Any]],
    *,
    batch: int = 1,
    dtype: str = "bfloat16",
    chunk_size: int | None = None,
    warmup: int = 2,
    rounds: int = 5,
    repeats: int = 5,
    compiler_options: dict | None = None,
    compile_threads: int = 1,
    seed: int = 0,
) -> list[StepResult]:
    """One setting under each set of model options of ``variants`` (name -> overrides; the
    first is the baseline), timed in one process side by side: every variant compiled first,
    then ``rounds`` rounds of ``repeats`` steps each, the variants' order alternating from
    round to round, so that a drift of the machine (clocks, heat) falls on all of them alike.
    One :class:`StepResult` per variant (``variant``, ``overrides``, ``rounds_ms``: each
    round's median; ``median_ms``: of all its timed steps); a variant that fails is recorded
    as ``oom`` or ``error`` and the others still run. The states start from the same
    parameters (the options change how the step is computed, not the parameters)."""
    base = model_config(size, attention, context, dtype=dtype)
    if chunk_size is not None and base.spec.sweep_chunk_size:
        base = base.replace(chunk_size=chunk_size)
    n_params = count_params(param_shapes(base), non_embedding=False)
    cfgs = {name: base.replace(**o) for name, o in variants.items()}
    results = {name: StepResult(attention, size, context, "ok", n_params, overrides=dict(o),
                                variant=name, chunk_size=chunk_size if base.spec.sweep_chunk_size
                                else None) for name, o in variants.items()}  # fmt: skip
    if compile_threads > 1:
        precompile(list(cfgs.values()), batch, compiler_options, compile_threads)
    runs: dict[str, Any] = {}
    for name, cfg in cfgs.items():
        r = results[name]
        try:
            compiled, tx, resolved = compile_step(cfg, batch, compiler_options)
            r.memory_bytes = step_memory_bytes(compiled)
            r.remat, r.loss_chunk = resolved.remat, resolved.loss_chunk
            r.compile_s = _COMPILE_SECONDS.get(_compiled_key(cfg, batch, compiler_options))
            state = jax.device_put(initial_state(base, tx, seed, compiler_options))
            runs[name] = [compiled, state]
        except Exception as e:  # recorded; the other variants still run
            gc.collect()
            r.status = "oom" if is_oom(e) else "error"
            r.oom_reason, r.error = (short_error(e), None) if is_oom(e) else (None, short_error(e))
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, base.vocab_size, (1, batch, context + 1), dtype=np.int32)
    x, y = jax.device_put(tokens[..., :-1]), jax.device_put(tokens[..., 1:])
    key = jax.random.key(seed)
    times: dict[str, list[float]] = {name: [] for name in runs}

    def steps(name: str, n: int) -> list[float]:
        out = []
        compiled, state = runs[name]
        for _ in range(n):
            t0 = time.perf_counter()
            state, metrics = compiled(state, x, y, key)
            jax.block_until_ready((state, metrics))
            out.append(time.perf_counter() - t0)
        runs[name][1] = state
        return out

    order = list(runs)
    try:
        for name in order:
            try:
                steps(name, warmup)
            except Exception as e:  # noqa: BLE001 - an OOM at run time, say
                results[name].status = "oom" if is_oom(e) else "error"
                results[name].error = short_error(e)
        order = [n for n in order if results[n].status == "ok"]
        for i in range(rounds):
            for name in order if i % 2 == 0 else order[::-1]:
                ts = steps(name, repeats)
                times[name] += ts
                results[name].rounds_ms.append(statistics.median(ts) * 1e3)
    finally:
        runs.clear()
    for name in order:
        r, ts = results[name], times[name]
        if ts:
            r.median_ms, r.min_ms, r.max_ms = (statistics.median(ts) * 1e3, min(ts) * 1e3,
                                               max(ts) * 1e3)  # fmt: skip
            r.times_ms = [t * 1e3 for t in ts]
    return list(results.values())


def side_by_side_ratios(results: Iterable[StepResult], batch: int = 1) -> list[dict[str, Any]]:
    """Each setting timed side by side (rows with a ``variant``) at ``batch``: every
    variant's median and its ratio to the first variant's (the baseline), overall and round
    by round."""
    groups: dict[tuple, list[StepResult]] = {}
    for r in results:
        if r.variant is not None:
            groups.setdefault((r.attention, r.size, r.context, r.chunk_size), []).append(r)
    out = []
    for (attention, size, context, chunk), rows in groups.items():
        base = rows[0]
        entry: dict[str, Any] = {
            "attention": attention, "size": size, "context": context, "batch": batch,
            "chunk_size": chunk, "baseline": base.variant,
            "median_ms": {r.variant: r.median_ms for r in rows},
            "status": {r.variant: r.status for r in rows},
            "overrides": {r.variant: r.overrides for r in rows},
            "ratio": {}, "round_ratios": {},
        }  # fmt: skip
        for r in rows[1:]:
            if r.median_ms and base.median_ms:
                entry["ratio"][r.variant] = r.median_ms / base.median_ms
                entry["round_ratios"][r.variant] = [
                    a / b for a, b in zip(r.rounds_ms, base.rounds_ms, strict=False)
                ]
        out.append(entry)
    return out


def _settings(names, size, context, kwargs) -> list[ModelConfig]:
    """The configs :func:`bench_setting` will compile at one context (every chunk candidate)."""
    out = []
    for name in names:
        base = model_config(size, name, context, dtype=kwargs.get("dtype", "bfloat16"),
                            **(kwargs.get("overrides") or {}))  # fmt: skip
        if base.spec.sweep_chunk_size:
            chunks = chunk_candidates(context, kwargs.get("chunk_sizes", CHUNK_CANDIDATES))
            out += [base.replace(chunk_size=c) for c in chunks]
        else:
            out.append(base)
    return out


def limits(results: Iterable[StepResult]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{attention: {size: {"max_context": largest that ran, "oom_at": first OOM or None,
    "error_at": first error or None}}}``."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        entry = out.setdefault(r.attention, {}).setdefault(
            r.size, {"max_context": None, "oom_at": None, "error_at": None}
        )
        if r.status == "ok":
            entry["max_context"] = max(entry["max_context"] or 0, r.context)
        elif r.status == "oom":
            entry["oom_at"] = r.context
        else:
            entry["error_at"] = r.context
    return out


def slopes(results: Iterable[StepResult]) -> dict[str, dict[str, float | None]]:
    """Fitted log-log slope of median step time against context per (attention, size)."""
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in results:
        if r.status == "ok" and r.median_ms:
            series.setdefault((r.attention, r.size), []).append((r.context, r.median_ms))
    out: dict[str, dict[str, float | None]] = {}
    for (name, size), pts in series.items():
        out.setdefault(name, {})[size] = loglog_slope(*zip(*pts))
    return out


CSV_FIELDS = [
    "attention",
    "size",
    "n_params",
    "context",
    "status",
    "median_ms",
    "min_ms",
    "max_ms",
    "chunk_size",
    "autotune_chunk_size",
    "kernel_design",
    "remat",
    "loss_chunk",
    "memory_bytes",
    "compile_s",
    "variant",
    "overrides",
    "times_ms",
    "chunk_ms",
    "oom_reason",
    "error",
    "device_kind",
    "git_commit",
    "jax_version",
]


def write_results(
    results: Sequence[StepResult], out_dir: str | Path, stem: str, meta: dict[str, Any]
) -> tuple[Path, Path]:
    """``stem.csv`` (one row per setting, raw times ``;``-separated) and ``stem.json``
    (``meta``, ``results``, ``limits``, ``slopes``). Returns both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out / f"{stem}.csv", out / f"{stem}.json"
    env = meta.get("environment", {})
    with csv_path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in results:
            row = dataclasses.asdict(r)
            row["times_ms"] = ";".join(f"{t:.4f}" for t in r.times_ms)
            row["chunk_ms"] = ";".join(f"{c}:{t:.4f}" for c, t in r.chunk_ms.items())
            row["overrides"] = ";".join(f"{k}={v}" for k, v in r.overrides.items())
            row.update(
                device_kind=env.get("device_kind"),
                git_commit=env.get("git_commit"),
                jax_version=env.get("jax_version"),
            )
            w.writerow({k: row.get(k) for k in CSV_FIELDS})
    payload = {
        "meta": meta,
        "results": [dataclasses.asdict(r) for r in results],
        "limits": limits(results),
        "slopes": slopes(results),
    }
    pairs = side_by_side_ratios(results, meta.get("settings", {}).get("batch", 1))
    if pairs:
        payload["side_by_side"] = pairs
    json_path.write_text(json.dumps(payload, indent=1, default=json_default) + "\n")
    return csv_path, json_path


def read_results(path: str | Path) -> dict[str, Any]:
    """A ``write_results`` JSON file: ``meta``, ``results`` (dicts), ``limits``, ``slopes``."""
    data = json.loads(Path(path).read_text())
    for r in data["results"]:  # JSON object keys are strings
        r["chunk_ms"] = {int(k): v for k, v in (r.get("chunk_ms") or {}).items()}
    return data
