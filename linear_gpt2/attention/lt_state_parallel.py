"""``LT_state_parallel``: every state at once, by a parallel prefix sum (the post's section 2).

    P_i = phi(k_i) v_i^T                   all T outer products, [T, D, D] per head
    S = prefix_sum(P)     z = prefix_sum(phi(k))
    y_i = phi(q_i)^T S_i / (phi(q_i) . z_i + eps)

O(T D^2) FLOPs, parallel over T (depth O(log T) for the prefix sum). ``scan`` picks the prefix
sum: ``cumsum`` (``jnp.cumsum``, which XLA lowers as it sees fit) or ``associative``
(``lax.associative_scan`` with ``+``, the explicit up/down-sweep).

With forgetting (``kernels.forget.Forget``) the states obey S_i = gamma_i S_{i-1} + P_i: a first-order
linear recurrence, computed by ``lax.associative_scan`` over the pairs (gamma, P) with
(g1, P1) . (g2, P2) = (g1 g2, g2 P1 + P2) (a reset is gamma = 0: a segmented scan); the
``scan`` option then only affects the plain form (a cumulative sum cannot carry the decays).

Memory: P and S are T D^2 float32 values per head each, materialised in the forward pass.
Reverse-mode autodiff keeps S for the backward pass: it is a residual of ``y = phi(q) S`` (the
gradient w.r.t. phi(q) is S dY; ``jax.ad_checkpoint.print_saved_residuals`` lists it); the backward
builds dS = phi(q) dY^T and its reverse prefix sum, T D^2 each. XLA reuses P's buffer, so the
compiled peak is about 2 T D^2 floats per head both for the forward and for forward+backward:
406 and 408 MiB of temp memory at B=1, H=12, D=64, T=1024 (T D^2 floats for all heads are
192 MiB), measured on CPU with ``memory_analysis()`` (``benchmarks/attention_memory.py``,
``docs/attention.md``). At long context this is what runs out of memory first.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from linear_gpt2.attention import linear
from linear_gpt2.attention.options import option
from linear_gpt2.attention.spec import state_flops
from linear_gpt2.kernels.forget import decayed_scan

F32 = jnp.float32


def prefix_sum(x: jax.Array, axis: int, scan: str) -> jax.Array:
    """Inclusive prefix sum of ``x`` along ``axis``."""
    if scan == "cumsum":
        return jnp.cumsum(x, axis=axis)
    return lax.associative_scan(jnp.add, x, axis=axis)


def _decayed_prefix(g: jax.Array, P: jax.Array, p: jax.Array):
    """S_i = g_i S_{i-1} + P_i and z_i = g_i z_{i-1} + p_i from zero, along axis 1, in log
    depth. g ``[B, T, H]``, P ``[B, T, H, D, D]``, p ``[B, T, H, D]``."""

    _, S, z = decayed_scan(g, P, p, axis=1)
    return S, z


def lt_state_parallel(
    fq: jax.Array,
    fk: jax.Array,
    v: jax.Array,
    scan: str = "cumsum",
    forget: linear.Forget | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Numerator ``[B, T, H, D]`` and denominator ``[B, T, H]`` (float32) with all T states
    ``[B, T, H, D, D]`` materialised. fq = phi(q), fk = phi(k), v: ``[B, T, H, D]``;
    ``forget`` see ``kernels.forget.Forget``."""
    P = jnp.einsum("bthd,bthe->bthde", fk, v, preferred_element_type=F32)
    if forget is None:
        S = prefix_sum(P, axis=1, scan=scan)
        z = prefix_sum(fk.astype(F32), axis=1, scan=scan)
    else:
        g = linear.gammas(forget, fq.shape[:3])
        S, z = _decayed_prefix(g, P, fk.astype(F32))
    num = jnp.einsum("bthd,bthde->bthe", fq, S, preferred_element_type=F32)
    den = jnp.einsum("bthd,bthd->bth", fq, z, preferred_element_type=F32)
    return num, den


SCANS = ("cumsum", "associative")


@dataclasses.dataclass(frozen=True)
class LTStateParallelOptions(linear.LinearOptions):
    scan: str = option(
        "cumsum",
        "the prefix sum (cumsum: jnp.cumsum; associative: lax.associative_scan)",
        choices=SCANS,
        implementation=True,
    )


def make(options: LTStateParallelOptions):
    algorithm = lambda fq, fk, v, forget: lt_state_parallel(fq, fk, v, options.scan, forget)
    return linear.attention_fn("LT_state_parallel", algorithm, options)


SPEC = linear.spec(
    "LT_state_parallel",
    make,
    state_flops,
    options=LTStateParallelOptions,
    description="every state at once by a parallel prefix sum",
)
