"""Compile targets: any jitted program compiled for a GPU this machine lacks.

JAX 0.11's CUDA plugin compiles "deviceless": ``topologies.get_topology_desc`` describes GPUs
from an XLA ``GpuTargetConfigProto`` (``assets/targets/*.txtpb``), and a program lowered under
that topology's abstract mesh runs XLA's real GPU pipeline: fusion, buffer assignment, cuDNN
graphs, and Pallas kernels lowered to Triton and built by ptxas for sm_90a. Per program this
gives, measured rather than modelled:

- memory (:class:`~linear_gpt2.platform.memory.MemoryReport`) as the H100 program would allocate it, so
  whether a step fits, and the largest context that does, are decided by compiling;
- per Pallas/Triton kernel (:class:`~linear_gpt2.platform.kernel_report.KernelReport`): grid, threads and shared memory (XLA's thunk
  sequence), and registers and spills from ptxas's ``-v`` output when that log is captured
  (``kernel_report.enable_ptxas_log``, which ``scripts/compile.py`` calls);
- failures: a kernel over the H100's shared memory fails to compile, and with ``fail_on_spill``
  so does any kernel that spills registers to local memory.

It gives no time (see ``benchmarks/roofline.py`` for a model), and matmul tiles are XLA's
fallback choice rather than the ones autotuning would pick on a device, which shifts temporary
memory (by up to ~30% in small tests): hence each target's budget, below its device memory.

Kernel choices follow the target: code choosing between a GPU kernel and a CPU fallback asks
:func:`linear_gpt2.platform.device.platform`, which reads the abstract mesh being compiled for
before the process's default backend, so ``kernel=auto`` resolves to cuDNN / Pallas when
compiling for the H100 here. The training step and single attentions are compiled by
:mod:`linear_gpt2.experiments.compile_step` on top of :func:`compile_program`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import importlib.util
import math
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from linear_gpt2.platform.errors import RunError, UsageError
from linear_gpt2.platform.kernel_report import (
    KernelReport,
    captured_stderr,
    parse_ptxas_log,
    parse_thunk_sequence,
    ptxas_log_enabled,
)
from linear_gpt2.platform.memory import GiB, MemoryReport, compiled_memory

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "targets"
PLUGIN_MODULE = "jax_plugins.xla_cuda13"
INSTALL_HINT = "pip install -e '.[cuda]' (make setup installs it)"


class TargetError(UsageError):
    """An unknown target name (a usage error: exit 2)."""


class TargetUnavailableError(RunError):
    """The CUDA plugin needed to compile for a GPU target is missing or did not load."""


class CompileError(RunError):
    """The program does not compile for the target (shared memory, register spills, ...)."""


@dataclasses.dataclass(frozen=True)
class Target:
    """A GPU system to compile for: a device description and a topology."""

    name: str
    description: str
    spec: str  # GpuTargetConfigProto text file in assets/targets/
    topology: str  # "slices x hosts x devices per host"
    # Bytes a program may use per device: the device's memory less a margin for what this
    # compile cannot see (autotuned matmul tiles, cuDNN workspaces, the allocator's slack).
    budget_bytes: int

    @property
    def n_devices(self) -> int:
        return math.prod(int(n) for n in self.topology.split("x"))

    @functools.cached_property
    def spec_text(self) -> str:
        return (ASSETS / self.spec).read_text()

    @functools.cached_property
    def device(self) -> dict[str, Any]:
        """Fields of the device description: ``name``, ``device_memory_size``, ``core_count``,
        ``shared_memory_per_block_optin``, ``registers_per_core_limit``, ..."""
        info: dict[str, Any] = {}
        for key, value in re.findall(r"^\s*(\w+): (\S.*)$", self.spec_text, re.M):
            value = value.strip('"')
            info.setdefault(key, int(value) if value.isdigit() else value)
        return info

    def describe(self) -> str:
        return (
            f"{self.name}: {self.description}, {self.n_devices} device(s), budget "
            f"{self.budget_bytes / GiB:.0f} GiB of {self.device['device_memory_size'] / GiB:.1f}"
            " GiB per device"
        )


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target(
            "h100",
            "NVIDIA H100 SXM 80 GB (the post's timing setup)",
            "h100_sxm.txtpb",
            "1x1x1",
            72 * GiB,
        ),  # fmt: skip
        Target(
            "h100x8",
            "one node of 8 NVIDIA H100 SXM 80 GB (the post's learning runs)",
            "h100_sxm.txtpb",
            "1x1x8",
            72 * GiB,
        ),  # fmt: skip
        Target(
            "h100x16",
            "two nodes of 8 NVIDIA H100 SXM 80 GB (multi-node context parallelism)",
            "h100_sxm.txtpb",
            "1x2x8",
            72 * GiB,
        ),  # fmt: skip
    )
}
DEFAULT = "h100"


def names() -> list[str]:
    return list(TARGETS)


def get(name: str | Target) -> Target:
    """The target called ``name``; an unknown name lists the valid ones."""
    if isinstance(name, Target):
        return name
    if name not in TARGETS:
        close = difflib.get_close_matches(str(name), names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TargetError(f"unknown target {name!r}{hint}; valid targets: {', '.join(names())}")
    return TARGETS[name]


def plugin_available() -> bool:
    return importlib.util.find_spec(PLUGIN_MODULE) is not None


@functools.cache
def devices(name: str = DEFAULT) -> tuple[Any, ...]:
    """The (compile-only) devices of target ``name``."""
    t = get(name)
    if not plugin_available():
        raise TargetUnavailableError(
            f"compiling for {t.name} needs JAX's CUDA plugin (jax-cuda13-plugin 0.11.2), which is "
            f"not installed; install it with {INSTALL_HINT}"
        )
    # Deviceless topologies need the CUDA plugin: imported only to compile for a target.
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(
            platform="cuda", topology_name=t.name, target_config=t.spec_text, topology=t.topology
        )
    except Exception as e:  # the plugin did not register (its CUDA check failed at start-up)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TargetUnavailableError(
            f"the CUDA plugin did not load ({first}); set JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 "
            "before JAX starts (importing linear_gpt2 first does this on machines without a GPU)"
        ) from None
    return tuple(topo.devices)


def mesh(name: str = DEFAULT, axis: str = "data"):
    """A one-axis mesh over the target's devices (the trainer's data-parallel layout; a program
    whose arguments carry their own mesh is compiled on that one, :func:`compile_program`)."""
    return jax.sharding.Mesh(np.array(devices(name)), (axis,))


# --------------------------------------------------------------------------------------------
# Compiling


@dataclasses.dataclass
class CompileReport:
    target: Target
    memory: MemoryReport
    kernels: list[KernelReport]
    seconds: float
    what: str = ""

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.target.budget_bytes

    def as_dict(self) -> dict[str, Any]:
        return {
            "target": self.target.name,
            "what": self.what,
            "memory": self.memory.as_dict(),
            "budget_bytes": self.target.budget_bytes,
            "fits": self.fits,
            "kernels": [k.as_dict() for k in self.kernels],
            "compile_seconds": self.seconds,
        }


def _first_error_line(err: BaseException) -> str:
    text = str(err)
    for pattern in (
        r"Shared memory size limit exceeded[^\n]*",
        r"Compilation result discarded due to register spilling[^\n]*",
        r"RESOURCE_EXHAUSTED[^\n]*",
    ):
        m = re.search(pattern, text)
        if m:
            return m[0].strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else type(err).__name__


@contextlib.contextmanager
def _cudnn_checks_for(t: Target) -> Iterator[None]:
    """JAX 0.11.2's cuDNN attention checks its support conditions in Python against the
    process's default backend (``fused_attention_stablehlo.check_compute_capability``): on a
    machine without a GPU it concludes "not Hopper" and refuses what the H100 supports (the
    packed layout of ``flash`` with document resets; head dims up to 256). While compiling for a
    target, answer those two checks with the target's compute capability instead."""
    try:
        # cuDNN attention's internals: only while compiling for a GPU target.
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except ImportError:  # pragma: no cover - a JAX without cuDNN attention
        yield
        return
    cc = tuple(int(x) for x in str(devices(t.name)[0].compute_capability).split("."))

    def at_least(capability: str) -> bool:
        return cc >= tuple(int(x) for x in capability.split("."))

    def equal(capability: str) -> bool:
        return cc == tuple(int(x) for x in capability.split("."))

    saved = fa.check_compute_capability, fa.is_cuda_compute_capability_equal
    fa.check_compute_capability, fa.is_cuda_compute_capability_equal = at_least, equal
    try:
        yield
    finally:
        fa.check_compute_capability, fa.is_cuda_compute_capability_equal = saved


@contextlib.contextmanager
def traced_for(target: str | Target = DEFAULT) -> Iterator[None]:
    """Trace (not compile) as for one of ``target``'s devices: the kernels chosen, and cuDNN's
    support checks answered, as :func:`compile_program` makes them (what
    ``training.memory_plan.estimate`` traces for a target)."""
    t = get(target)
    m = jax.sharding.Mesh(np.array(devices(t.name)[:1]), ("data",))
    with jax.sharding.use_abstract_mesh(m.abstract_mesh), _cudnn_checks_for(t):
        yield


def compile_program(
    jitted: Any,
    args: tuple[Any, ...],
    target: str | Target = DEFAULT,
    *,
    kernels: bool = False,
    fail_on_spill: bool = False,
    compiler_options: dict[str, Any] | None = None,
    what: str = "program",
    keep_executable: bool = False,
) -> CompileReport | tuple[CompileReport, Any]:
    """Compile ``jitted(*args)`` for ``target``; ``args`` are ``jax.ShapeDtypeStruct`` carrying
    shardings on :func:`mesh` (or concrete arrays). With ``kernels`` the Pallas/Triton kernels
    are listed (grid, threads, shared memory; registers and spills if
    ``kernel_report.enable_ptxas_log`` ran); with ``fail_on_spill`` a kernel that spills registers is a :class:`CompileError`."""
    t = get(target)
    m = _mesh_of(args) or mesh(t.name)
    # The GPU program as a real run compiles it, whatever XLA_FLAGS say: the test suite lowers
    # the CPU backend's LLVM optimisation to halve compile times, which on the GPU backend would
    # change the kernels' registers and spills that these reports measure.
    options = {
        "xla_backend_optimization_level": 3,
        "xla_llvm_disable_expensive_passes": False,
        **(compiler_options or {}),
    }
    if fail_on_spill:
        options["xla_gpu_fail_ptx_compilation_on_register_spilling"] = True
    dump = tempfile.mkdtemp(prefix="linear_gpt2_xla_dump_") if kernels else None
    if dump:
        options["xla_dump_to"] = dump
    t0 = time.perf_counter()
    try:
        with captured_stderr(kernels and ptxas_log_enabled()) as log:
            try:
                with jax.sharding.use_abstract_mesh(m.abstract_mesh), _cudnn_checks_for(t):
                    lowered = jitted.lower(*args)
                compiled = lowered.compile(compiler_options=options or None)
            except Exception as e:
                if isinstance(e, (TargetError, TargetUnavailableError)):
                    raise
                raise CompileError(
                    f"{what} does not compile for {t.name}: {_first_error_line(e)}"
                ) from e
        seconds = time.perf_counter() - t0
        found: list[KernelReport] = []
        if dump:
            for f in sorted(Path(dump).glob("*thunk_sequence.txt")):
                meta = f.with_name(f.name.replace("thunk_sequence", "thunk_metadata"))
                found += parse_thunk_sequence(
                    f.read_text(), meta.read_text() if meta.exists() else None
                )
            ptxas = parse_ptxas_log("".join(log))
            for k in found:
                for key, value in ptxas.get(k.name, {}).items():
                    setattr(k, key, value)
    finally:
        if dump:
            shutil.rmtree(dump, ignore_errors=True)
    memory = compiled_memory(compiled)
    assert memory is not None, "the GPU compiler reports memory"
    report = CompileReport(t, memory, found, seconds, what)
    return (report, compiled) if keep_executable else report


def _mesh_of(args: tuple[Any, ...]):
    """The mesh the first argument sharded by name is laid out on, or None."""
    for leaf in jax.tree.leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return sharding.mesh
    return None


def replicated(target: str | Target = DEFAULT):
    return NamedSharding(mesh(get(target).name), P())
