"""What a GPU session will do and what it will cost: stages of units, each unit priced.

A unit is one subprocess (a test file, one benchmark invocation, one training run): the smallest
piece that is either done, with its output on disk, or not. A stage is a list of units with one
collector that turns their outputs into results files. Each unit carries its costs: how many
of which kind of work (processes, compiles, timed steps, training updates) and the seconds each
takes, with where that number comes from:

- ``measured: FILE``: a time the H100 gave before (``benchmarks/results/``);
- ``compiled: FILE``: counted from a compile for the H100 on the CPU machine (how many memory
  settings ``auto`` compiles before one fits);
- ``recorded: FILE``: the unit's own time in an earlier ``make gpu-check`` on the GPU;
- ``assumption: NAME``: nothing measured yet; :data:`ASSUMPTIONS` states each one.

The checks and timings (``checks``) and the learning cells (``learning``) each get at most
:data:`PHASE_BUDGET_S` of GPU time; stages run in the order of their value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

CHECKS, LEARNING = "checks", "learning"
PHASES = (CHECKS, LEARNING)
# A lent GPU is held for about half an hour: the checks and timings in 25 minutes, the learning
# cells a second pass of at most 25.
PHASE_BUDGET_S = {CHECKS: 25 * 60.0, LEARNING: 25 * 60.0}

# Work no GPU has timed yet, priced by assumption: (seconds, what is assumed). The dry run lists
# the ones it used; a GPU run records the real unit times, which replace them next time.
ASSUMPTIONS: dict[str, tuple[float, str]] = {
    "process": (10.0, "a Python process that imports JAX and starts CUDA on the GPU machine"),
    "pytest": (20.0, "pytest's start on one test file: imports, collection, CUDA"),
    "gpu_test": (
        4.0,
        "one gpu test, mostly compiling (Pallas/Triton, cuDNN) and a float64 reference on the host",
    ),
    "init": (1.5, "initialising the train state and copying it to the GPU, per 100M parameters"),
    "compile_step": (
        20.0,
        "compiling a training step where no H100 compile was timed (the "
        "measured 124M compiles took 16-26 s)",
    ),
    "compile_parallel": (
        1.5,
        "compiles run side by side (a thread each, 16 cores) take 1.5 "
        "times the longest of them alone (a factor)",
    ),
    "kernel_compile": (3.0, "compiling one kernel program (fwd, or fwd+bwd) at one shape"),
    "kernel_rate": (
        0.3,
        "a kernel's FLOP rate as a share of the H100's dense bf16 peak "
        "(989 TFLOP/s), for the run time of a kernel call",
    ),
    "fla_first": (
        30.0,
        "flash-linear-attention's first call at a shape: Triton's JIT and "
        "autotuning of its kernels",
    ),
    "fla_compile": (2.0, "flash-linear-attention at a new T once its kernels are built"),
    "decode_compile": (6.0, "compiling one decode step (one attention, one cache length)"),
    "decode_token": (0.01, "one sampled token (reads the weights and the cache once)"),
    "trace": (15.0, "writing and parsing a profiler trace of a few steps"),
    "train_start": (
        40.0,
        "a training run's start: config, data, compiling the step and the evaluation programs",
    ),
    "mqar_update": (0.005, "one update of the 2-layer d=64 MQAR model at 256 sequences of 256"),
    "context_update": (0.03, "one update of the 3.4M Shakespeare model at 4096 tokens"),
    "eval": (1.0, "one held-out evaluation of a small model"),
    "cache_hit": (
        3.0,
        "loading a step an earlier stage compiled with the same setting from "
        "JAX's persistent compilation cache (the run's, shared by its units)",
    ),
    "side_by_side": (
        2.0,
        "runs of a small model side by side on one GPU take this many times "
        "one run alone, for all of them (a factor; they leave the GPU mostly "
        "idle, and their starts and compiles use other cores)",
    ),
    "step_by_tokens": (
        1.0,
        "a step time measured at another context, scaled by the ratio of "
        "tokens (the factor; the file is named in the line that uses it)",
    ),
}


@dataclasses.dataclass(frozen=True)
class Cost:
    """``count`` pieces of work ``what`` of ``each_s`` seconds, and where that number is from."""

    what: str
    count: float
    each_s: float
    basis: str

    @property
    def seconds(self) -> float:
        return self.count * self.each_s

    @property
    def assumed(self) -> bool:
        return self.basis.startswith("assumption")


def assumed(name: str, what: str, count: float = 1, scale: float = 1.0) -> Cost:
    """A cost priced by the assumption ``name`` (seconds x ``scale`` each)."""
    seconds, _ = ASSUMPTIONS[name]
    return Cost(what, count, seconds * scale, f"assumption: {name}")


@dataclasses.dataclass(frozen=True)
class Unit:
    """One subprocess: ``argv`` is a script path relative to the repository (or ``-m module``)
    and its arguments; ``{out}`` in them is replaced by the unit's folder."""

    name: str
    argv: tuple[str, ...]
    costs: tuple[Cost, ...]
    work: str = ""  # what it does, in words, for the dry run

    @property
    def seconds(self) -> float:
        return sum(c.seconds for c in self.costs)

    @property
    def assumed_seconds(self) -> float:
        return sum(c.seconds for c in self.costs if c.assumed)


@dataclasses.dataclass(frozen=True)
class Stage:
    """Units run one after the other, or ``concurrent`` at a time (small training runs)."""

    name: str
    phase: str
    title: str
    units: tuple[Unit, ...]
    concurrent: int = 1

    @property
    def factor(self) -> float:
        """Wall time over the sum of the units' own times."""
        if self.concurrent <= 1:
            return 1.0
        return ASSUMPTIONS["side_by_side"][0] / self.concurrent

    @property
    def seconds(self) -> float:
        return sum(u.seconds for u in self.units) * self.factor

    @property
    def assumed_seconds(self) -> float:
        if self.concurrent > 1:
            return self.seconds
        return sum(u.assumed_seconds for u in self.units)

    def work(self) -> dict[str, float]:
        """How much of each kind of work, over the stage's units."""
        out: dict[str, float] = {}
        for u in self.units:
            for c in u.costs:
                out[c.what] = out.get(c.what, 0) + c.count
        return out

    def bases(self) -> list[str]:
        side = ["assumption: side_by_side"] if self.concurrent > 1 else []
        return sorted({c.basis for u in self.units for c in u.costs} | set(side))


@dataclasses.dataclass(frozen=True)
class Plan:
    """The stages for one device (``h100``; ``tiny_cpu`` for the CPU path on tiny shapes)."""

    device: str
    stages: tuple[Stage, ...]
    tiny: bool = False

    def stage(self, name: str) -> Stage:
        return {s.name: s for s in self.stages}[name]

    def select(self, only: Iterable[str] = (), skip: Iterable[str] = ()) -> Plan:
        """The plan with only the stages ``only`` (all when empty) less ``skip``. Names are
        stage names or a phase (``checks``, ``learning``)."""
        only, skip = list(only), list(skip)
        self._check_names([*only, *skip])

        def hit(stage: Stage, names: Sequence[str]) -> bool:
            return stage.name in names or stage.phase in names

        kept = [s for s in self.stages if (not only or hit(s, only)) and not hit(s, skip)]
        return dataclasses.replace(self, stages=tuple(kept))

    def _check_names(self, names: Sequence[str]) -> None:
        from linear_gpt2.platform.errors import UsageError

        valid = [*PHASES, *(s.name for s in self.stages)]
        bad = [n for n in names if n not in valid]
        if bad:
            raise UsageError(
                f"unknown stage {', '.join(map(repr, bad))}; the stages are {', '.join(valid)}"
            )

    def phase_seconds(self, phase: str) -> float:
        return sum(s.seconds for s in self.stages if s.phase == phase)


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def dry_run_text(plan: Plan, done: dict[tuple[str, str], float] | None = None) -> str:
    """The dry run: every stage, its units and work, its estimated GPU time and how much of it
    rests on assumptions; the total per phase against its budget; the assumptions used."""
    done = done or {}
    lines = [f"make gpu-check on {plan.device}: {len(plan.stages)} stages (dry run: nothing runs)"]
    used: set[str] = set()
    for phase in PHASES:
        stages = [s for s in plan.stages if s.phase == phase]
        if not stages:
            continue
        total = sum(s.seconds for s in stages)
        left = sum(
            u.seconds * s.factor for s in stages for u in s.units if (s.name, u.name) not in done
        )
        budget = PHASE_BUDGET_S[phase]
        lines += ["", f"{phase}: estimated {minutes(total)} of GPU time (budget "
                  f"{minutes(budget)}; {'within' if total <= budget else 'OVER'} it)"
                  + (f", {minutes(left)} still to run" if done else "")]  # fmt: skip
        for i, s in enumerate(stages, 1):
            work = ", ".join(f"{_count(n)} {what}" for what, n in s.work().items())
            share = s.assumed_seconds / s.seconds if s.seconds else 0.0
            n_done = sum((s.name, u.name) in done for u in s.units)
            lines.append(
                f"  {i}. {s.name:<8} {minutes(s.seconds):>9}  {len(s.units)} units"
                + (f" ({n_done} done)" if n_done else "")
                + (f", {s.concurrent} side by side" if s.concurrent > 1 else "")
                + f"; {share:.0%} of it assumed  -- {s.title}"
            )
            lines.append(f"       work: {work}")
            for u in s.units:
                lines.append(f"       - {u.name:<28} {u.seconds:7.0f} s  {u.work}")
            for b in s.bases():
                lines.append(f"       priced from {b}")
                if b.startswith("assumption: "):
                    used.add(b.removeprefix("assumption: ").split()[0])
    if used:
        lines += ["", "assumptions (no GPU has timed these yet; a GPU run records the real times):"]
        for name in sorted(used):
            seconds, text = ASSUMPTIONS[name]
            lines.append(f"  {name} = {seconds:g}: {text}")
    return "\n".join(lines)


def _count(n: float) -> str:
    return f"{n:,.0f}" if n >= 1 or n == 0 else f"{n:.2f}"
