"""Device memory: recognising out-of-memory errors, and what a compiled program needs.

Shared by the trainer (an OOM at start becomes an actionable message), the step benchmark (an OOM
is recorded as that setting's limit), the compile targets (``target.py``: memory of the H100
program compiled here) and the attention memory table (docs/attention.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

GiB = 2**30


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` is a device out-of-memory (XLA's RESOURCE_EXHAUSTED) or a MemoryError."""
    if isinstance(err, MemoryError):
        return True
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """What XLA's buffer assignment reserves for one compiled program, per device, in bytes."""

    arguments: int
    outputs: int
    temporaries: int
    aliased: int  # outputs that reuse donated argument buffers (the new train state)
    host_temporaries: int = 0  # pinned host memory (offloaded activations)

    @property
    def total(self) -> int:
        """Device bytes needed: arguments + outputs + temporaries - donated aliases."""
        return self.arguments + self.outputs + self.temporaries - self.aliased

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}

    def describe(self) -> str:
        host = f", host {self.host_temporaries / GiB:.2f}" if self.host_temporaries else ""
        return (
            f"{self.total / GiB:.2f} GiB (arguments {self.arguments / GiB:.2f} + outputs "
            f"{self.outputs / GiB:.2f} + temporaries {self.temporaries / GiB:.2f} - aliased "
            f"{self.aliased / GiB:.2f}{host})"
        )


def compiled_memory(compiled) -> MemoryReport | None:
    """The :class:`MemoryReport` of a compiled executable, or None where the backend does not
    report one."""
    try:
        m = compiled.memory_analysis()
    except Exception:
        return None
    if m is None:
        return None
    return MemoryReport(
        arguments=int(m.argument_size_in_bytes),
        outputs=int(m.output_size_in_bytes),
        temporaries=int(m.temp_size_in_bytes),
        aliased=int(m.alias_size_in_bytes),
        host_temporaries=int(getattr(m, "host_temp_size_in_bytes", 0) or 0),
    )


def attention_temp_bytes(fn: Callable, shape: tuple[int, ...], backward: bool) -> int:
    """Temporary bytes XLA allocates for ``fn(q, k, v)`` on float32 inputs of ``shape``
    ``[B, T, H, D]``, forward only or forward + backward (a VJP with a cotangent), from the
    compiled function's memory analysis (nothing is run)."""
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    if backward:
        f = lambda q, k, v, dy: jax.vjp(fn, q, k, v)[1](dy)
        args = (x, x, x, x)
    else:
        f, args = fn, (x, x, x)
    return int(jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes)
