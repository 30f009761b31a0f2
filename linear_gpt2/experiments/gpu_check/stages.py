"""The plan's content: which units each stage runs on the H100, priced, and the same stages on
tiny shapes for the CPU (``tiny=True``: the tests run every stage's CPU path).

Stages in the order of their value, the most valuable first, so that a session cut short has
done what matters most: the GPU tests against float64 references (wrong numbers make every
timing moot); the kernels beside flash-linear-attention (never measured); the training step
(the post's figure, now with min / median / max, the memory setting and 256k / 1M); the profile
of the 124M step at 64k (where its time goes); sampling (never measured); the memory check
(measured once before); then the learning cells, a second pass.
"""

from __future__ import annotations

from pathlib import Path

from linear_gpt2.experiments.gpu_check import learning, testfiles
from linear_gpt2.experiments.gpu_check.known import Known
from linear_gpt2.experiments.gpu_check.plan import CHECKS, LEARNING, Cost, Plan, Stage, Unit
from linear_gpt2.experiments.gpu_check.plan import assumed as A

K = 1024
# The post's timing figure at 124M: every attention but the two that loop over positions.
STEP_124M = ("flash", "LT_chunked", "LT_attention_parallel", "softmax", "LT_state_parallel",
             "LT_attention_parallel_no_flash")  # fmt: skip
STEP_124M_CONTEXTS = (K, 4 * K, 16 * K, 64 * K)
STEP_LONG = (("LT_chunked", 256 * K), ("LT_chunked", 1024 * K))  # past the post's 512k
STEP_PAIR = ("flash", "LT_chunked")
STEP_LARGE = ("355M", "774M", "1.6B")
STEP_LARGE_CONTEXTS = (K, 4 * K, 16 * K)
WARMUP, REPEATS = 1, 5  # the step is compiled ahead of time: one call warms the caches
COMPILE_THREADS = 6
KERNEL_SHAPES = ((1, 12, 64), (8, 16, 128))  # (B, H, D)
KERNEL_T = (K, 4 * K, 16 * K, 64 * K)
KERNEL_FORGET = ("none", "resets+gate")
KERNEL_WARMUP, KERNEL_REPEATS = 2, 5
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
PEAK_BF16 = 989e12  # the H100 SXM's dense bf16 rate (NVIDIA's data sheet)


def params(size: str) -> float:
    """Parameters of a preset, from its name (``124M``, ``1.6B``): for pricing only."""
    scale = {"M": 1e6, "B": 1e9}
    return float(size[:-1]) * scale[size[-1]] if size[-1] in scale else 1e6


def _ctx(t: int) -> str:
    return f"{t // (1024 * K)}M" if t >= 1024 * K else f"{t // K}k" if t >= K else str(t)


def _unit(known: Known, stage: str, name: str, argv, costs, work: str) -> Unit:
    """A unit priced by its costs, or by its recorded time where a GPU run recorded one."""
    rec = known.recorded_cost(stage, name)
    return Unit(name, tuple(map(str, argv)), (rec,) if rec else tuple(costs), work)


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
        units.append(_unit(known, "tests", Path(path).stem, argv, costs, f"{n} gpu tests"))
    return Stage("tests", CHECKS, "every gpu test against float64 references", tuple(units))


def step_stage(known: Known, tiny: bool) -> Stage:
    common = ["--warmup", WARMUP, "--repeats", REPEATS, "--out", "{out}", "--stem", "step",
              "--no-plot", "--compile-threads", COMPILE_THREADS]  # fmt: skip
    if tiny:
        argv = ["scripts/bench_step.py", "--tiny", "--sizes", "tiny", "--contexts", 64,
                "--attentions", "softmax", "LT_chunked", "--chunk-sizes", 16, *common]  # fmt: skip
        unit = _unit(
            known, "step", "tiny_64", argv, [A("process", "processes")], "tiny, 2 attentions"
        )
        return Stage("step", CHECKS, "training step times", (unit,))
    groups: list[tuple[str, str, tuple[int, ...], tuple[str, ...]]] = []
    for t in STEP_124M_CONTEXTS:
        names = tuple(a for a in STEP_124M if known.fits(a, "124M", t))
        groups.append((f"124M_{_ctx(t)}", "124M", (t,), names))
    for a in sorted({a for a, _ in STEP_LONG}):
        ts = tuple(t for b, t in STEP_LONG if b == a)
        groups.append((f"124M_{a}_long", "124M", ts, (a,)))
    groups += [(s, s, STEP_LARGE_CONTEXTS, STEP_PAIR) for s in STEP_LARGE]
    units = []
    for name, size, ts, names in groups:
        costs = [A("process", "processes"),
                 A("init", "state inits", len(ts), scale=params(size) / 1e8)]  # fmt: skip
        chunks = {known.best_chunk(a, size, t) or 64 for a in names for t in ts}
        # Every setting of the unit compiles side by side before any is timed: as long as the
        # longest chain (a memory plan compiles its candidates one after the other) or the
        # work over the threads, times the parallel factor.
        chains = []
        for t in ts:
            for a in names:
                rungs, _ = known.rungs(a, size, t)
                chains.append(known.compile_cost(a, size, t, rungs))
                steps = known.step_cost(a, size, t, WARMUP + REPEATS, known.best_chunk(a, size, t))
                costs.append(steps)
        n = sum(c.count for c in chains)
        longest = max(chains, key=lambda c: c.seconds)
        wall = max(longest.seconds, sum(c.seconds for c in chains) / COMPILE_THREADS)
        if len(chains) > 1:
            wall *= A("compile_parallel", "").each_s
            costs.append(Cost("compile rounds", 1, 0.0, "assumption: compile_parallel"))
        costs.append(Cost("step compiles", n, wall / n, longest.basis))
        argv = ["scripts/bench_step.py", "--sizes", size, "--contexts", *ts, "--attentions",
                *names, "--chunk-sizes", *sorted(chunks), *common]  # fmt: skip
        units.append(_unit(known, "step", name, argv, costs, ", ".join(names)))
    return Stage("step", CHECKS, "training step: min / median / max of 5 steps, auto's memory "
                 "setting, the allocator share", tuple(units))  # fmt: skip


def _kernel_flops(B: int, H: int, D: int, T: int, softmax: bool, c: int = 64) -> float:
    """Forward matmul FLOPs (not halved for causality), for pricing a kernel call only."""
    return B * H * T * (4 * T * D if softmax else 4 * c * D + 4 * D * D)


def kernels_stage(known: Known, tiny: bool) -> Stage:
    shapes, Ts = (((1, 2, 16),), (64, 128)) if tiny else (KERNEL_SHAPES, KERNEL_T)
    rate = A("kernel_rate", "").each_s * PEAK_BF16
    calls = KERNEL_WARMUP + KERNEL_REPEATS
    units = []
    for B, H, D in shapes:
        tag = f"{B}x{H}x{D}"
        shape = ["--B", B, "--H", H, "--D", D, "--Ts", *Ts, "--forget", *KERNEL_FORGET,
                 "--warmup", KERNEL_WARMUP, "--repeats", KERNEL_REPEATS]  # fmt: skip
        # Ours: LT_chunked under each forgetting, cuDNN flash (resets only: it has no gate).
        # fwd and fwd+bwd (x4 the forward's FLOPs, the backward twice the forward).
        programs = 2 * len(Ts) * (2 * len(KERNEL_FORGET))
        run = calls * sum(4 * _kernel_flops(B, H, D, T, False) * len(KERNEL_FORGET)
                          + 4 * _kernel_flops(B, H, D, T, True) * len(KERNEL_FORGET)
                          for T in Ts) / rate  # fmt: skip
        ours = [A("process", "processes"), A("kernel_compile", "kernel compiles", programs,
                scale=A("compile_parallel", "").each_s / COMPILE_THREADS),
                Cost("kernel calls", programs * calls, run / (programs * calls),
                     "assumption: kernel_rate")]  # fmt: skip
        argv = ["benchmarks/bench_kernels.py", "--compare", *shape, "--out", "{out}",
                "--compile-threads", COMPILE_THREADS]  # fmt: skip
        units.append(
            _unit(
                known,
                "kernels",
                f"ours_{tag}",
                argv,
                ours,
                "LT_chunked (pallas) and cuDNN flash, " + " / ".join(KERNEL_FORGET),
            )
        )
        # flash-linear-attention: chunk_simple_gla under each; chunk_linear_attn without a gate.
        peers = len(KERNEL_FORGET) + sum("gate" not in f for f in KERNEL_FORGET)
        fla_run = calls * sum(4 * _kernel_flops(B, H, D, T, False) * peers for T in Ts) / rate
        fla = [A("process", "processes"), A("fla_first", "fla first calls"),
               A("fla_compile", "fla compiles", peers * 2 * len(Ts)),
               Cost("kernel calls", peers * 2 * len(Ts) * calls, fla_run / (peers * 2 * len(Ts)
                    * calls), "assumption: kernel_rate")]  # fmt: skip
        argv = ["benchmarks/bench_kernels.py", "--peer", "fla", *shape, "--out", "{out}",
                "--reference", f"{{stage}}/ours_{tag}"]  # fmt: skip
        units.append(
            _unit(
                known,
                "kernels",
                f"fla_{tag}",
                argv,
                fla,
                "flash-linear-attention, its outputs checked against ours first",
            )
        )
    return Stage("kernels", CHECKS, "LT_chunked fwd and fwd+bwd against cuDNN flash and "
                 "flash-linear-attention, ms and TFLOP/s", tuple(units))  # fmt: skip


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
        units.append(_unit(known, "sample", size, argv, costs, f"{n} (attention, context)"))
    return Stage("sample", CHECKS, "ms per sampled token: KV cache against the recurrent state",
                 tuple(units))  # fmt: skip


def profile_stage(known: Known, tiny: bool) -> Stage:
    points = (("LT_chunked", "tiny", 128),) if tiny else PROFILE
    units = []
    for a, size, t in points:
        # The step stage compiled the same program (auto's setting): the run's cache holds it.
        load = A("cache_hit", "cached compiles") if not tiny else known.compile_cost(a, size, t)
        costs = [A("process", "processes"), A("init", "state inits", scale=params(size) / 1e8),
                 load, known.step_cost(a, size, t, PROFILE_WARMUP + PROFILE_STEPS),
                 A("trace", "traces")]  # fmt: skip
        argv = ["-m", "linear_gpt2.experiments.gpu_check.profile", "--attention", a,
                "--size", size, "--context", t, "--warmup", PROFILE_WARMUP,
                "--steps", PROFILE_STEPS, "--out", "{out}"]  # fmt: skip
        units.append(_unit(known, "profile", f"{a}_{size}_{_ctx(t)}", argv, costs, "traced steps"))
    return Stage("profile", CHECKS, "the 124M step at 64k traced: the 15 GPU ops that take the "
                 "most time", tuple(units))  # fmt: skip


def memory_stage(known: Known, tiny: bool) -> Stage:
    points = ("LT_chunked:tiny:64:none:0:16",) if tiny else MEMORY_POINTS
    units = []
    for text in points:
        a, size, t = text.split(":")[:3]
        # The step stage compiled this setting where auto chose it (the compiled frontier's).
        chosen = known.frontier.get((a, size, int(t)), {})
        same = [chosen.get("remat"), chosen.get("loss_chunk")] == [
            text.split(":")[3],
            int(text.split(":")[4]),
        ]
        load = A("cache_hit", "cached compiles") if same else known.compile_cost(a, size, int(t))
        costs = [A("process", "processes"), A("init", "state inits", scale=params(size) / 1e8),
                 load, known.step_cost(a, size, int(t), 1 + MEMORY_REPEATS)]  # fmt: skip
        argv = ["benchmarks/gpu_memory_check.py", text, "--out", "{out}", "--stem", "memory",
                "--repeats", MEMORY_REPEATS]  # fmt: skip
        name = "_".join(text.split(":")[:4])
        units.append(_unit(known, "memory", name, argv, costs, "compiled bytes vs the peak"))
    return Stage("memory", CHECKS, "compiled memory against the allocator's peak, offload "
                 "included", tuple(units))  # fmt: skip


def learning_stages(known: Known, tiny: bool) -> list[Stage]:
    out = []
    for spec in learning.SWEEPS:
        units = []
        for point in learning.points(spec, tiny):
            costs = [A("train_start", "training runs"),
                     A(spec.update_assumption, "updates", point.max_steps),
                     A("eval", "evaluations", point.evals)]  # fmt: skip
            argv = ["scripts/sweep.py", spec.file, "--point", point.index, *point.overrides,
                    "log.run_dir={out}/run"]  # fmt: skip
            units.append(_unit(known, spec.stage, point.name, argv, costs,
                               f"at most {point.max_steps:,} updates"))  # fmt: skip
        width = 1 if tiny else spec.concurrent
        out.append(Stage(spec.stage, LEARNING, spec.title, tuple(units), width))
    return out


def build(results: Path, *, tiny: bool = False, device: str = "h100") -> Plan:
    """The whole plan, priced from what ``results`` knows of ``device``."""
    known = Known(results, device)
    stages = [
        tests_stage(known, tiny),
        kernels_stage(known, tiny),
        step_stage(known, tiny),
        profile_stage(known, tiny),
        sample_stage(known, tiny),
        memory_stage(known, tiny),
        *learning_stages(known, tiny),
    ]
    return Plan("tiny_cpu" if tiny else device, tuple(stages), tiny)
