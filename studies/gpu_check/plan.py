"""What a GPU session will do and what it will cost: stages of units, each unit priced, and the
windows they run in.

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

A lent GPU gives 15 minutes of device time in all, one command at most 10 minutes: the work is
cut into **windows** (:func:`windows`), each one device command of at most
:data:`WINDOW_LIMIT_S` seconds (or ``--time-limit``), its start (:data:`WINDOW_START`: the
runner, the wheels installed, JAX's look at the device) and its units priced. Units go into
windows in the order of their value (``Unit.tier``, then the plan's order), so the most
important number comes first; tier 0 is the headline and opens window 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

CHECKS, LEARNING = "checks", "learning"
# One device command may run 10 minutes; a window plans 9 of them, so that the runner's own start,
# packing and the tool's transfers fit in the rest.
WINDOW_LIMIT_S = 540.0
PHASES = (CHECKS, LEARNING)

# Work no GPU has timed yet, priced by assumption: (seconds, what is assumed). The dry run lists
# the ones it used; a GPU run records the real unit times, which replace them next time.
ASSUMPTIONS: dict[str, tuple[float, str]] = {
    "process": (10.0, "a Python process that imports JAX and starts CUDA on the GPU machine"),
    "wheels": (10.0, "installing the carried wheels (.whl/, pure Python, no index) on the machine"),
    "pack": (1.0, "merging a finished unit's outputs and packing the archive again"),
    "tiny_unit": (20.0, "one unit of the CPU path on tiny shapes (--tiny; the tests)"),
    "load_step": (
        3.0,
        "a step compiled here, loaded on the GPU: lowering it again for its key, reading "
        "and loading the executable",
    ),
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
    "glue_call": (
        0.003,
        "one call of a glue kernel or its XLA oracle at the step's widths: "
        "a few GB at a fraction of the bandwidth",
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
    and its arguments; ``{out}`` in them is replaced by the unit's folder. ``tier``: its
    value, 0 first (windows follow it); ``compiles``: the training steps it compiles, as
    (attention, size, context, chunk_size or None), for ``--compile-here``."""

    name: str
    argv: tuple[str, ...]
    costs: tuple[Cost, ...]
    work: str = ""  # what it does, in words, for the dry run
    tier: int = 99
    compiles: tuple[tuple[str, str, int, int | None], ...] = ()

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

    def without(self, keys: Iterable[tuple[str, str]]) -> Plan:
        """The plan less the units ``keys`` (``(stage, unit)``; those done): the windows are cut
        from what is left, so a device command is filled with work, not with finished units."""
        drop = set(keys)
        stages = [dataclasses.replace(s, units=tuple(u for u in s.units if (s.name, u.name)
                                                     not in drop)) for s in self.stages]  # fmt: skip
        return dataclasses.replace(self, stages=tuple(s for s in stages if s.units))

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


# ------------------------------------------------------------------------------------- windows


@dataclasses.dataclass(frozen=True)
class Window:
    """One device command: ``items`` (stage, unit) in the order they run, after ``start``."""

    number: int
    items: tuple[tuple[Stage, Unit], ...]
    start: tuple[Cost, ...]
    limit_s: float

    @property
    def start_s(self) -> float:
        return sum(c.seconds for c in self.start)

    @property
    def seconds(self) -> float:
        return self.start_s + sum(_wall(s, u) for s, u in self.items)

    def keys(self) -> list[tuple[str, str]]:
        return [(s.name, u.name) for s, u in self.items]

    def segments(self) -> list[tuple[Stage, list[Unit]]]:
        """Consecutive units of one stage together (a stage's side-by-side runs need them)."""
        out: list[tuple[Stage, list[Unit]]] = []
        for s, u in self.items:
            if out and out[-1][0].name == s.name:
                out[-1][1].append(u)
            else:
                out.append((s, [u]))
        return out


def window_start() -> tuple[Cost, ...]:
    """What every window spends before its first unit: the wheels installed on a fresh
    machine and JAX's look at the device (one process)."""
    return (assumed("wheels", "wheel installs"), assumed("process", "device probes"))


def _wall(stage: Stage, unit: Unit) -> float:
    """A unit's share of a window: its time (side by side: its share of the group's), and the
    packing after it."""
    return unit.seconds * stage.factor + ASSUMPTIONS["pack"][0]


def windows(plan: Plan, limit_s: float = WINDOW_LIMIT_S) -> list[Window]:
    """The plan's units in windows of at most ``limit_s`` seconds each, start included, in the
    order of value: by tier, then as the plan lists them. A window is filled in that order and
    closed at the first unit that does not fit (no later, smaller unit jumps the queue); a unit
    that fits no window alone gets one of its own (the dry run marks it OVER)."""
    order = [(s, u) for s in plan.stages for u in s.units]
    order = [x for _, x in sorted(enumerate(order), key=lambda iu: (iu[1][1].tier, iu[0]))]
    start = window_start()
    start_s = sum(c.seconds for c in start)
    out: list[Window] = []
    current: list[tuple[Stage, Unit]] = []
    used = start_s
    for s, u in order:
        w = _wall(s, u)
        if current and used + w > limit_s:
            out.append(Window(len(out) + 1, tuple(current), start, limit_s))
            current, used = [], start_s
        current.append((s, u))
        used += w
    if current:
        out.append(Window(len(out) + 1, tuple(current), start, limit_s))
    return out


def dry_run_text(
    plan: Plan,
    wins: Sequence[Window],
    done: dict[tuple[str, str], object] | None = None,
    last: dict | None = None,
    loaded: set[tuple[str, str]] | None = None,
) -> str:
    """The dry run: every window, its units and their estimates, what rests on assumptions;
    the last window a GPU ran, its estimate beside what it took (``last``, from the record);
    the units whose steps are compiled here (``loaded``)."""
    done, loaded = done or {}, loaded or set()
    total = sum(w.seconds for w in wins)
    limit = wins[0].limit_s if wins else WINDOW_LIMIT_S
    lines = [
        f"make gpu-check on {plan.device}: {len(wins)} windows of at most {limit:.0f} s each "
        f"({minutes(total)} in all; one device command each; dry run: nothing runs)"
    ]
    if last:
        lines.append(
            f"last window run: {last.get('window')} on {last.get('device_kind')}, estimated "
            f"{last.get('estimate_s', 0):.0f} s, took {last.get('seconds', 0):.0f} s "
            f"({last.get('units_done', '?')} of {last.get('units', '?')} units done)"
        )
    listed = {k for w in wins for k in w.keys()}
    off = [k for k in done if k not in listed]
    if off:
        lines.append(f"{len(off)} units done in the run folder, not listed: the windows are cut "
                     "from the rest")  # fmt: skip
    used: set[str] = set()
    for w in wins:
        n_again = sum(k in done for k in w.keys())  # failed before: listed to run again
        flag = "" if w.seconds <= w.limit_s else "  OVER the limit"
        mark = "  <- next" if w.number == 1 else ""  # the windows are cut from what is left
        lines += ["", f"window {w.number}: estimated {w.seconds:.0f} s of {w.limit_s:.0f}"
                  f"{flag} ({len(w.items)} units{f', {n_again} failed before' if n_again else ''}){mark}",
                  f"  start {w.start_s:5.0f} s  the wheels installed, the device probed"]  # fmt: skip
        for b in w.start:
            used.add(b.basis.removeprefix("assumption: "))
        for s, u in w.items:
            tags = [t for t, on in (("failed before: runs again", (s.name, u.name) in done),
                                    ("compiled here", (s.name, u.name) in loaded)) if on]  # fmt: skip
            side = f", {s.concurrent} side by side" if s.concurrent > 1 else ""
            name = f"{s.name}/{u.name}"
            lines.append(f"  {name:<38} {_wall(s, u):6.0f} s  tier {u.tier}{side}: {u.work}"
                         + (f" [{', '.join(tags)}]" if tags else ""))  # fmt: skip
            for c in u.costs:
                if c.assumed:
                    used.add(c.basis.removeprefix("assumption: ").split()[0])
            if s.concurrent > 1:
                used.add("side_by_side")
    bases = sorted({c.basis for s in plan.stages for u in s.units for c in u.costs
                    if not c.assumed})  # fmt: skip
    if bases:
        lines += ["", "priced from:"] + [f"  {b}" for b in bases]
    if used:
        lines += ["", "assumptions (no GPU has timed these yet; a GPU run records the real times):"]
        for name in sorted(used):
            seconds, text = ASSUMPTIONS[name]
            lines.append(f"  {name} = {seconds:g}: {text}")
    return "\n".join(lines)
