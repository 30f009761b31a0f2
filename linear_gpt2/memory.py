"""Device memory: recognising out-of-memory errors, and what a compiled function needs.

Shared by the trainer (an OOM at start becomes an actionable message), the step benchmark (an OOM
is recorded as that setting's limit) and the attention memory table (docs/attention.md).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` is a device out-of-memory (XLA's RESOURCE_EXHAUSTED) or a MemoryError."""
    if isinstance(err, MemoryError):
        return True
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


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
