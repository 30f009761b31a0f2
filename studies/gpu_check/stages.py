"""The plan's content: the units of each stage on the H100, priced, each with its tier (the order
of value the windows follow, :func:`plan.windows`), and the same stages on tiny shapes for the
CPU (``tiny=True``: the tests run every stage's CPU path).

Tier 0, the first window: the headline, the 124M step of ``flash`` and ``LT_chunked`` at 1k to
64k (one unit per context; min / median / max of 7 steps; ``auto``'s memory setting), loaded
from the steps compiled here (:mod:`.compiled`), then ``LT_chunked``'s kernels against cuDNN
flash and flash-linear-attention at B1 H12 D64, 4k to 64k, and one context again compiled on
the GPU (``compile_ab``: are the loaded steps' times the device-compiled ones'?), and what
decides the glue kernels' ``auto`` (``kernels/choice.py``): their gpu tests and the 124M step
with them at ``pallas`` beside ``xla``, and with the blocks unrolled as well, in one process
(``glue``: 1k, 16 x 1k, 64k). Then, each in windows that fit: the gpu tests against float64
(1); the larger sizes at 1k, and the 124M step at 64k traced, every op with its instruction
beside the compiled program, to set the step-time MODEL's prices against (2);
``LT_attention_parallel``'s kernels at 4k-64k (3); sampling (4); the memory check (5);
Zoology's MQAR cell (6); the context grid, a window's worth of runs at a time (7); and what was
measured once before (8): the other attentions at 124M, ``LT_chunked`` past 512k, the larger
sizes at 4k and 16k, the kernels with resets and gates and at B8 H16 D128.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from linear_gpt2.platform.cards import H100
from studies.gpu_check import learning, testfiles
from studies.gpu_check.known import Known
from studies.gpu_check.plan import CHECKS, LEARNING, Cost, Plan, Stage, Unit
from studies.gpu_check.plan import assumed as A
from studies.gpu_check.report import GLUE_CANDIDATE

K = 1024
HEADLINE = ("flash", "LT_chunked")  # the post's figure: the pair it claims about
HEADLINE_CONTEXTS = (K, 4 * K, 16 * K, 64 * K)
HEADLINE_CHUNKS = (64, 128)  # LT_chunked's candidates (the measured file's)
AB_CONTEXT = 4 * K  # compile_ab: this context compiled on the GPU as well
# The rest of the post's timing figure at 124M: every attention but the two position loops.
STEP_124M_OTHERS = ("LT_attention_parallel", "softmax", "LT_state_parallel",
                    "LT_attention_parallel_no_flash")  # fmt: skip
STEP_LONG = (("LT_chunked", 256 * K), ("LT_chunked", 1024 * K))  # past the post's 512k
STEP_PAIR = ("flash", "LT_chunked")
STEP_LARGE = ("355M", "774M", "1.6B")
WARMUP, REPEATS = 1, 7  # the step is compiled ahead of time: one call warms the caches
COMPILE_THREADS = 6
KERNEL_HEADLINE = (1, 12, 64)  # (B, H, D)
KERNEL_HEADLINE_T = (4 * K, 16 * K, 64 * K)
KERNEL_REST = (((1, 12, 64), (K, 4 * K, 16 * K, 64 * K), ("resets+gate",)),
               ((8, 16, 128), (K, 4 * K, 16 * K, 64 * K), ("none", "resets+gate")))  # fmt: skip
KERNEL_WARMUP, KERNEL_REPEATS = 2, 5
GLUE_KERNEL_ROWS = (16 * K, 64 * K)  # the post's 16 x 1k micro-step and the 64k step, in tokens
GLUE_KERNEL_ROUNDS, GLUE_KERNEL_ITERS = 5, 10
PARALLEL_T = (4 * K, 64 * K)  # LT_attention_parallel's kernels, T_start and T_max
SAMPLE_SIZES = ("124M", "1.6B")  # the ends of the post's range
SAMPLE_ATTENTIONS = ("softmax", "LT_chunked")  # KV cache, recurrent state
SAMPLE_CONTEXTS = (K, 8 * K, 64 * K)
SAMPLE_STEPS, SAMPLE_ROUNDS = 10, 3
PROFILE = (("flash", "124M", 64 * K), ("LT_chunked", "124M", 64 * K))
PROFILE_WARMUP, PROFILE_STEPS = 2, 3
# The memory check, as attention:size:context:remat:loss_chunk[:chunk_size]: host offload, where
# the deviceless compile was furthest from the device (memory_check_h100.md), and the
# rematerialised step; the plain steps at 64k agreed to 0.28% and are not measured again.
MEMORY_POINTS = ("LT_chunked:124M:262144:dots:4096:64", "LT_chunked:124M:1048576:offload:4096:64")
MEMORY_REPEATS = 3
# The step units run under the store's loader (compiled.py): python -m this, then the script.
WITH_STORE = ("-m", "studies.gpu_check.compiled")
# The glue kernels (issue 37, kernels/choice.py): whether auto may take them on a GPU is decided
# by their gpu tests (these files, run in the first window) and by the 124M step timed with them
# at pallas beside xla in one process (the glue stage). Points: (unit, attentions, context,
# batch, chunk size, memory setting): 1k at batch 1, the post's micro-step 16 x 1k, and 64k at
# step_glue's settings (benchmarks/results/step_glue_h100_model.md).
GLUE_TESTS = ("test_kernels_glue_gpu",)
GLUE_POINTS = (("124M_1k", ("LT_chunked", "flash"), K, 1, 128, ("remat=none", "loss_chunk=0")),
               ("124M_16x1k", ("LT_chunked",), K, 16, 128, ("remat=none", "loss_chunk=0")),
               ("124M_64k", ("LT_chunked",), 64 * K, 1, 64, ("remat=none", "loss_chunk=4096")))  # fmt: skip
GLUE_WARMUP, GLUE_ROUNDS, GLUE_REPEATS = 2, 5, 4


def params(size: str) -> float:
    """Parameters of a preset, from its name (``124M``, ``1.6B``): for pricing only."""
    scale = {"M": 1e6, "B": 1e9}
    return float(size[:-1]) * scale[size[-1]] if size[-1] in scale else 1e6


def _ctx(t: int) -> str:
    return f"{t // (1024 * K)}M" if t >= 1024 * K else f"{t // K}k" if t >= K else str(t)


def _unit(known: Known, stage: str, name: str, argv, costs, work: str, tier: int,
          compiles=()) -> Unit:  # fmt: skip
    """A unit priced by its costs, or by its recorded time where a GPU run recorded one (and
    nothing it compiles is loaded from the store now)."""
    rec = known.recorded_cost(stage, name)
    if compiles and known.all_compiled(compiles):
        rec = None
    return Unit(name, tuple(map(str, argv)), (rec,) if rec else tuple(costs), work, tier,
                tuple(compiles))  # fmt: skip


# ---------------------------------------------------------------------------------------------


def tests_stage(known: Known, tiny: bool) -> Stage:
    files = testfiles.gpu_test_files()
    if tiny:
        files = {f: n for f, n in files.items() if f.endswith("test_kernels_autotune.py")}
    units = []
    for path, n in files.items():
        argv = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", path,
                "--junitxml={out}/junit.xml"]  # fmt: skip
        costs = [A("pytest", "pytest processes"), A("gpu_test", "gpu tests", n)]
        tier = 0 if Path(path).stem in GLUE_TESTS else 1  # they decide auto: the first window
        units.append(_unit(known, "tests", Path(path).stem, argv, costs, f"{n} gpu tests", tier))
    return Stage("tests", CHECKS, "every gpu test against float64 references", tuple(units))


def _chunks(attention: str, context: int, chunks) -> list[int | None]:
    from linear_gpt2.attention import spec
    from studies.train_step.step_time import chunk_candidates

    return list(chunk_candidates(context, chunks)) if spec(attention).sweep_chunk_size else [None]


def step_unit(known: Known, stage: str, name: str, size: str, contexts, names, tier: int, *,
              chunks=HEADLINE_CHUNKS, store: bool = True, tiny: bool = False) -> Unit:  # fmt: skip
    """One ``bench_step.py`` process: ``names`` at ``size`` over ``contexts``, compiled side by
    side before any is timed, or loaded from the store (``store``: run under its loader)."""
    common = ["--warmup", WARMUP, "--repeats", REPEATS, "--out", "{out}", "--stem", "step",
              "--no-plot", "--compile-threads", COMPILE_THREADS]  # fmt: skip
    compiles = tuple(
        (a, size, t, c) for t in contexts for a in names for c in _chunks(a, t, chunks)
    )
    argv = ["scripts/bench_step.py", "--sizes", size, "--contexts", *contexts, "--attentions",
            *names, "--chunk-sizes", *chunks, *common]  # fmt: skip
    if tiny:  # the optimised CPU compile: the store's steps are compiled without options
        argv += ["--tiny", "--full-compile", "--dtype", "float32"]
    if store:
        argv = [*WITH_STORE, *argv]
    costs = [A("process", "processes"),
             A("init", "state inits", len(contexts), scale=params(size) / 1e8)]  # fmt: skip
    if store and known.all_compiled(compiles):
        costs.append(A("load_step", "steps loaded", len(compiles)))
    else:
        # Every setting compiles side by side before any is timed: as long as the longest
        # chain (a memory plan compiles its candidates one after the other) or the work over
        # the threads, times the parallel factor.
        chains = [known.compile_cost(a, size, t, known.rungs(a, size, t)[0])
                  for a, _, t, _ in compiles]  # fmt: skip
        n = sum(c.count for c in chains)
        longest = max(chains, key=lambda c: c.seconds)
        wall = max(longest.seconds, sum(c.seconds for c in chains) / COMPILE_THREADS)
        if len(chains) > 1:
            wall *= A("compile_parallel", "").each_s
            costs.append(Cost("compile rounds", 1, 0.0, "assumption: compile_parallel"))
        costs.append(Cost("step compiles", n, wall / n, longest.basis))
    for a, _, t, c in compiles:
        costs.append(
            known.step_cost(a, size, t, WARMUP + REPEATS, c or known.best_chunk(a, size, t))
        )
    how = "loaded from the store, else compiled" if store else "compiled on the GPU"
    return _unit(known, stage, name, argv, costs, f"{', '.join(names)} ({how})", tier,
                 compiles if store else ())  # fmt: skip


def step_stage(known: Known, tiny: bool) -> Stage:
    units = []
    if tiny:
        for t in (64, 128):
            units.append(step_unit(known, "step", f"tiny_{t}", "tiny", (t,), HEADLINE, 0,
                                   chunks=(16,), tiny=True))  # fmt: skip
        return Stage("step", CHECKS, "training step times", tuple(units))
    for t in HEADLINE_CONTEXTS:
        units.append(step_unit(known, "step", f"124M_{_ctx(t)}", "124M", (t,), HEADLINE, 0))
    for size in STEP_LARGE:
        units.append(step_unit(known, "step", f"{size}_1k", size, (K,), STEP_PAIR, 2))
    for t in HEADLINE_CONTEXTS:
        names = tuple(a for a in STEP_124M_OTHERS if known.fits(a, "124M", t))
        units.append(step_unit(known, "step", f"124M_others_{_ctx(t)}", "124M", (t,), names, 8))
    for a in sorted({a for a, _ in STEP_LONG}):
        for t in (t for b, t in STEP_LONG if b == a):
            units.append(step_unit(known, "step", f"124M_{a}_{_ctx(t)}", "124M", (t,), (a,), 8))
    for size in STEP_LARGE:
        for t in (4 * K, 16 * K):
            units.append(step_unit(known, "step", f"{size}_{_ctx(t)}", size, (t,), STEP_PAIR, 8))
    return Stage("step", CHECKS, "training step: min / median / max of 7 steps, auto's memory "
                 "setting, the allocator share", tuple(units))  # fmt: skip


def compile_ab_stage(known: Known, tiny: bool) -> Stage:
    """The headline's ``AB_CONTEXT`` again, compiled on the GPU: its times beside the loaded
    steps' of ``step/124M_4k`` (a deviceless compile autotunes nothing)."""
    if tiny:
        unit = step_unit(known, "compile_ab", "tiny_64", "tiny", (64,), HEADLINE, 0,
                         chunks=(16,), store=False, tiny=True)  # fmt: skip
    else:
        unit = step_unit(known, "compile_ab", f"124M_{_ctx(AB_CONTEXT)}", "124M", (AB_CONTEXT,),
                         HEADLINE, 0, store=False)  # fmt: skip
    return Stage("compile_ab", CHECKS, "a headline context compiled on the GPU, against the "
                 "steps compiled here", (unit,))  # fmt: skip


def glue_variants() -> dict[str, dict[str, Any]]:
    """The settings timed side by side: XLA's program (what ``auto`` runs now) first, the
    baseline; the glue kernels (step_glue's "after", :data:`GLUE_CANDIDATE`: what decides
    ``AUTO_PICKS_PALLAS``); and those with the blocks unrolled (step_glue's "unrolled",
    ``model.scan_layers: false``: the switch the MODEL credits with issue 37's 1k targets,
    measured in the same rounds). The first two name the scan (``model.scan_layers: true``):
    ``auto`` unrolls on a GPU now, and the A/B on file timed them scanned."""
    from studies.train_step.step_glue import AFTER_KERNELS, SCANNED, UNROLLED

    return {"xla": {**{k: "xla" for k in AFTER_KERNELS}, **SCANNED},
            GLUE_CANDIDATE: {**AFTER_KERNELS, **SCANNED},
            "unrolled": {**AFTER_KERNELS, **UNROLLED}}  # fmt: skip


def _options(values: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in values.items())


def glue_unit(known: Known, name: str, size: str, names, context: int, batch: int,
              chunk: int, memory, tiny: bool = False) -> Unit:  # fmt: skip
    """One ``bench_step.py --side-by-side`` process: the step of ``names`` at ``context`` x
    ``batch`` with the glue kernels at xla and at pallas, compiled on the GPU side by side (the
    trainer compiles there too), then timed in alternating rounds."""
    variants = glue_variants()
    argv = ["scripts/bench_step.py", "--sizes", size, "--contexts", context, "--batch", batch,
            "--attentions", *names, "--chunk-sizes", chunk, "--model", *memory,
            "--side-by-side", *(f"{v}:{_options(o)}" for v, o in variants.items()),
            "--warmup", GLUE_WARMUP, "--rounds", 2 if tiny else GLUE_ROUNDS,
            "--repeats", GLUE_REPEATS,
            "--out", "{out}", "--stem", "step", "--no-plot",
            "--compile-threads", COMPILE_THREADS]  # fmt: skip
    if tiny:
        argv += ["--tiny", "--dtype", "float32"]
    # Every (attention, variant) compiles side by side before any is timed: priced as the step
    # units price theirs. The kernels' step time is priced as XLA's (measured); 16 x 1k as the
    # measured step of one sequence of as many tokens.
    chains = [known.compile_cost(a, size, context) for a in names for _ in variants]
    longest = max(chains, key=lambda c: c.seconds)
    wall = max(longest.seconds, sum(c.seconds for c in chains) / COMPILE_THREADS)
    wall *= A("compile_parallel", "").each_s
    costs = [A("process", "processes"), A("init", "state inits", scale=params(size) / 1e8),
             Cost("compile rounds", 1, 0.0, "assumption: compile_parallel"),
             Cost("step compiles", len(chains), wall / len(chains), longest.basis)]  # fmt: skip
    steps = len(variants) * (GLUE_WARMUP + GLUE_ROUNDS * GLUE_REPEATS)
    for a in names:
        c = known.step_cost(a, size, context * batch, steps)
        if batch > 1 and not c.assumed:
            c = dataclasses.replace(c, basis=f"assumption: step_by_tokens ({batch} x "
                                    f"{_ctx(context)} as one {_ctx(context * batch)} sequence of "
                                    f"{c.basis.removeprefix('measured: ')})")  # fmt: skip
        costs.append(c)
    b = f"{batch} x " if batch > 1 else ""
    work = (f"{', '.join(names)} at {b}{_ctx(context)}: {' / '.join(variants)}, side by side "
            "(compiled on the GPU)")  # fmt: skip
    return _unit(known, "glue", name, argv, costs, work, 0)


def glue_stage(known: Known, tiny: bool) -> Stage:
    if tiny:
        units = (glue_unit(known, "tiny_64", "tiny", ("LT_chunked",), 64, 1, 16,
                           ("remat=none", "loss_chunk=0"), tiny=True),)  # fmt: skip
    else:
        units = tuple(glue_unit(known, n, "124M", names, t, b, c, memory)
                      for n, names, t, b, c, memory in GLUE_POINTS)  # fmt: skip
    return Stage("glue", CHECKS, "the step with the glue kernels at pallas beside xla, and with "
                 "the blocks unrolled too, side by side: which wins, by how much", units)  # fmt: skip


def _kernel_flops(B: int, H: int, D: int, T: int, softmax: bool, c: int = 64) -> float:
    """Forward matmul FLOPs (not halved for causality), for pricing a kernel call only."""
    return B * H * T * (4 * T * D if softmax else 4 * c * D + 4 * D * D)


def _kernel_units(known: Known, shape, Ts, forget, tier: int, tag: str) -> list[Unit]:
    B, H, D = shape
    rate = A("kernel_rate", "").each_s * H100.peak_bf16_flops
    calls = KERNEL_WARMUP + KERNEL_REPEATS
    args = ["--B", B, "--H", H, "--D", D, "--Ts", *Ts, "--forget", *forget,
            "--warmup", KERNEL_WARMUP, "--repeats", KERNEL_REPEATS]  # fmt: skip
    # Ours: LT_chunked under each forgetting, cuDNN flash where there is no gate; fwd and
    # fwd+bwd (x4 the forward's FLOPs, the backward twice the forward).
    flash = sum("gate" not in f for f in forget)
    programs = 2 * len(Ts) * (len(forget) + flash)
    run = calls * sum(4 * _kernel_flops(B, H, D, T, False) * len(forget)
                      + 4 * _kernel_flops(B, H, D, T, True) * flash for T in Ts) / rate  # fmt: skip
    ours = [A("process", "processes"), A("kernel_compile", "kernel compiles", programs,
            scale=A("compile_parallel", "").each_s / COMPILE_THREADS),
            Cost("kernel calls", programs * calls, run / (programs * calls),
                 "assumption: kernel_rate")]  # fmt: skip
    argv = ["benchmarks/bench_kernels.py", "--compare", *args, "--out", "{out}",
            "--compile-threads", COMPILE_THREADS]  # fmt: skip
    units = [_unit(known, "kernels", f"ours_{tag}", argv, ours, "LT_chunked (pallas) and cuDNN "
                   f"flash at T {', '.join(_ctx(t) for t in Ts)}, {' / '.join(forget)}", tier)]  # fmt: skip
    # flash-linear-attention: chunk_simple_gla under each; chunk_linear_attn without a gate.
    peers = len(forget) + sum("gate" not in f for f in forget)
    fla_run = calls * sum(4 * _kernel_flops(B, H, D, T, False) * peers for T in Ts) / rate
    fla = [A("process", "processes"), A("fla_first", "fla first calls"),
           A("fla_compile", "fla compiles", peers * 2 * len(Ts)),
           Cost("kernel calls", peers * 2 * len(Ts) * calls,
                fla_run / (peers * 2 * len(Ts) * calls), "assumption: kernel_rate")]  # fmt: skip
    argv = ["benchmarks/bench_kernels.py", "--peer", "fla", *args, "--out", "{out}",
            "--reference", f"{{stage}}/ours_{tag}"]  # fmt: skip
    units.append(_unit(known, "kernels", f"fla_{tag}", argv, fla, "flash-linear-attention's "
                       "chunk_linear_attn and chunk_simple_gla, checked against ours first", tier))  # fmt: skip
    return units


def kernels_stage(known: Known, tiny: bool) -> Stage:
    if tiny:
        units = _kernel_units(known, (1, 2, 16), (64, 128), ("none",), 0, "1x2x16")
    else:
        units = _kernel_units(known, KERNEL_HEADLINE, KERNEL_HEADLINE_T, ("none",), 0,
                              "1x12x64")  # fmt: skip
        for shape, Ts, forget in KERNEL_REST:
            tag = "x".join(map(str, shape)) + ("_" + "_".join(forget)).replace("+", "")
            units += _kernel_units(known, shape, Ts, forget, 8, tag)
    return Stage("kernels", CHECKS, "LT_chunked fwd and fwd+bwd against cuDNN flash and "
                 "flash-linear-attention, ms and TFLOP/s", tuple(units))  # fmt: skip


def kernel_sweep_stage(known: Known, tiny: bool) -> Stage:
    """``LT_attention_parallel``'s kernels (its tiled Pallas designs and XLA), fwd and
    fwd+bwd, ``bench_kernels.py``'s sweep from 4k to 64k."""
    lo, hi = (64, 128) if tiny else PARALLEL_T
    Ts = []
    t = lo
    while t <= hi:
        Ts.append(t)
        t *= 2
    from linear_gpt2 import attention

    kernels = [k for k in attention.spec("LT_attention_parallel").kernels if k != "auto"]
    programs = 2 * len(Ts) * len(kernels)
    costs = [A("process", "processes"), A("kernel_compile", "kernel compiles", programs),
             Cost("kernel calls", programs * 12, 0.01, "assumption: kernel_rate")]  # fmt: skip
    if not tiny:
        costs += [A("fla_first", "fla first calls"), A("fla_compile", "fla compiles", 2 * len(Ts))]
    argv = ["benchmarks/bench_kernels.py", "--names", "LT_attention_parallel", "--T-start", lo,
            "--T-max", hi, "--warmup", 2, "--repeats", 10, "--out", "{out}"]  # fmt: skip
    if tiny:
        argv += ["--B", 1, "--H", 2, "--D", 16, "--chunk-size", 16, "--dtype", "float32"]
    unit = _unit(known, "kernel_sweep", "LT_attention_parallel", argv, costs,
                 f"{', '.join(kernels)} at T {_ctx(lo)}-{_ctx(hi)}", 3)  # fmt: skip
    return Stage("kernel_sweep", CHECKS, "LT_attention_parallel's kernels, fwd and fwd+bwd",
                 (unit,))  # fmt: skip


def glue_kernels_stage(known: Known, tiny: bool) -> Stage:
    """The glue kernels one by one (``benchmarks/bench_glue.py``): each launch candidate of
    ``kernels/launch.py`` and XLA's oracle, side by side, at the 124M step's widths."""
    from linear_gpt2.kernels import launch

    rows = (37,) if tiny else GLUE_KERNEL_ROWS
    programs = len(rows) * sum(1 + (2 if tiny else len(c)) for c in launch.CANDIDATES.values())
    costs = [A("process", "processes"),
             A("kernel_compile", "kernel compiles", programs,
               scale=A("compile_parallel", "").each_s / COMPILE_THREADS),
             A("glue_call", "kernel calls", programs * GLUE_KERNEL_ROUNDS * (GLUE_KERNEL_ITERS + 1))]  # fmt: skip
    argv = ["benchmarks/bench_glue.py", "--rows", *rows, "--compile-threads", COMPILE_THREADS,
            "--rounds", GLUE_KERNEL_ROUNDS, "--iters", GLUE_KERNEL_ITERS,
            "--out", "{out}", *(["--tiny", "--candidates", 2] if tiny else [])]  # fmt: skip
    unit = _unit(known, "glue_kernels", "launches", argv, costs,
                 f"{programs} programs at {', '.join(map(str, rows))} rows", 2)  # fmt: skip
    return Stage("glue_kernels", CHECKS, "the glue kernels one by one: each launch candidate "
                 "against XLA, GB/s and the share of HBM", (unit,))  # fmt: skip


def sample_stage(known: Known, tiny: bool) -> Stage:
    sizes, contexts = (("tiny",), (64, 256)) if tiny else (SAMPLE_SIZES, SAMPLE_CONTEXTS)
    steps, rounds = (2, 1) if tiny else (SAMPLE_STEPS, SAMPLE_ROUNDS)
    units = []
    for size in sizes:
        n = len(SAMPLE_ATTENTIONS) * len(contexts)
        costs = [A("process", "processes"), A("init", "param inits", scale=params(size) / 1e8),
                 A("decode_compile", "decode compiles", n),
                 A("decode_token", "tokens", n * steps * rounds, scale=max(1, params(size) / 3e8))]  # fmt: skip
        argv = ["scripts/bench_sample.py", "--sizes", size, "--attentions", *SAMPLE_ATTENTIONS,
                "--contexts", *contexts, "--steps", steps, "--rounds", rounds,
                "--out", "{out}", "--stem", "sample", *(["--dtype", "float32"] if tiny else [])]  # fmt: skip
        units.append(_unit(known, "sample", size, argv, costs, f"{n} (attention, context)", 4))
    return Stage("sample", CHECKS, "ms per sampled token: KV cache against the recurrent state",
                 tuple(units))  # fmt: skip


def profile_stage(known: Known, tiny: bool) -> Stage:
    points = (("LT_chunked", "tiny", 128),) if tiny else PROFILE
    units = []
    for a, size, t in points:
        costs = [A("process", "processes"), A("init", "state inits", scale=params(size) / 1e8),
                 known.compile_cost(a, size, t), known.step_cost(a, size, t, PROFILE_WARMUP
                 + PROFILE_STEPS), A("trace", "traces")]  # fmt: skip
        argv = ["-m", "studies.gpu_check.profile", "--attention", a,
                "--size", size, "--context", t, "--warmup", PROFILE_WARMUP,
                "--steps", PROFILE_STEPS, "--out", "{out}"]  # fmt: skip
        units.append(_unit(known, "profile", f"{a}_{size}_{_ctx(t)}", argv, costs,
                           "traced steps", 2))  # fmt: skip
    return Stage("profile", CHECKS, "the 124M step at 64k traced: the 15 GPU ops that take the "
                 "most time", tuple(units))  # fmt: skip


def memory_stage(known: Known, tiny: bool) -> Stage:
    points = ("LT_chunked:tiny:64:none:0:16",) if tiny else MEMORY_POINTS
    units = []
    for text in points:
        a, size, t = text.split(":")[:3]
        costs = [A("process", "processes"), A("init", "state inits", scale=params(size) / 1e8),
                 known.compile_cost(a, size, int(t)),
                 known.step_cost(a, size, int(t), 1 + MEMORY_REPEATS)]  # fmt: skip
        argv = ["benchmarks/gpu_memory_check.py", text, "--out", "{out}", "--stem", "memory",
                "--repeats", MEMORY_REPEATS]  # fmt: skip
        name = "_".join(text.split(":")[:4])
        units.append(_unit(known, "memory", name, argv, costs, "compiled bytes vs the peak", 5))
    return Stage("memory", CHECKS, "compiled memory against the allocator's peak, offload "
                 "included", tuple(units))  # fmt: skip


def learning_stages(known: Known, tiny: bool) -> list[Stage]:
    out = []
    for spec, tier in zip(learning.SWEEPS, (6, 7), strict=True):
        units = []
        for point in learning.points(spec, tiny):
            costs = [A("train_start", "training runs"),
                     A(spec.update_assumption, "updates", point.max_steps),
                     A("eval", "evaluations", point.evals)]  # fmt: skip
            argv = ["scripts/sweep.py", spec.file, "--point", point.index, *point.overrides,
                    "log.run_dir={out}/run"]  # fmt: skip
            units.append(_unit(known, spec.stage, point.name, argv, costs,
                               f"at most {point.max_steps:,} updates", tier))  # fmt: skip
        width = 1 if tiny else spec.concurrent
        out.append(Stage(spec.stage, LEARNING, spec.title, tuple(units), width))
    return out


def build(results: Path, *, tiny: bool = False, device: str = "h100",
          store: Path | None = None) -> Plan:  # fmt: skip
    """The whole plan, priced from what ``results`` knows of ``device`` and what ``store``
    holds compiled for it."""
    known = Known(results, device, store=store)
    stages = [
        step_stage(known, tiny),
        kernels_stage(known, tiny),
        compile_ab_stage(known, tiny),
        tests_stage(known, tiny),
        glue_stage(known, tiny),
        kernel_sweep_stage(known, tiny),
        glue_kernels_stage(known, tiny),
        sample_stage(known, tiny),
        memory_stage(known, tiny),
        profile_stage(known, tiny),
        *learning_stages(known, tiny),
    ]
    if tiny:  # the H100's prices mean nothing for tiny CPU runs: one assumed price for each
        tiny_cost = (A("tiny_unit", "tiny CPU units"),)
        stages = [dataclasses.replace(s, units=tuple(dataclasses.replace(u, costs=tiny_cost)
                                                     for u in s.units)) for s in stages]  # fmt: skip
    return Plan("tiny_cpu" if tiny else device, tuple(stages), tiny)
