"""The differentiable ``LT_attention_parallel`` kernels, and the choice between the designs.

``kernel`` (``attention.kernel``): ``pallas_tiled`` (``tiled.py``: resident 128-row blocks,
programs longest first, one backward kernel with atomic dq), ``pallas_tiled_dq``
(``tiled_dq.py``: the same forward, FlashAttention 2's two backward kernels without atomics),
``pallas_blocked`` (``blocked.py``: the first design, one query block per program, a two-loop
backward kernel), or ``pallas``, which asks the roofline model (``cost.choose``) for the design
with the lowest modelled forward + backward time at the shape and runs a tiled one with the
two-kernel backward (``pallas_tiled_dq``: the atomic one measured slower on an H200 with the
same forward, ``cost.MEASURED``), and notes the choice once per shape (logged at INFO, printed
by the trainer and ``scripts/compile.py``), as ``LT_chunked``'s ``kernel=pallas`` does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from linear_gpt2 import kernels
from linear_gpt2.kernels import key_blocks
from linear_gpt2.kernels.lt_attention_parallel import BLOCKED, NAMES, TILED, TILED_DQ, cost, plan

_LOGGED: set = set()


@functools.lru_cache(maxsize=256)
def _choose(kernel: str, B: int, T: int, H: int, D: int, c: int, itemsize: int) -> cost.Choice:
    return cost.choose(B, T, H, D, c, itemsize, kernel)


def choose(kernel: str, B: int, T: int, H: int, D: int, c: int, dtype) -> cost.Choice:
    """The design (and tiling) behind ``kernel`` at ``[B, T, H, D]`` (T a multiple of c, D the
    padded head dim): ``pallas`` asks the cost model and notes the choice once per shape."""
    if kernel not in NAMES:
        raise ValueError(
            f"LT_attention_parallel: unknown Pallas kernel {kernel!r}; valid: {', '.join(NAMES)}"
        )
    dtype = jnp.dtype(dtype)
    choice = _choose(kernel, B, T, H, D, c, dtype.itemsize)
    key = (kernel, B, T, H, D, c, dtype.name)
    if kernel == "pallas" and key not in _LOGGED:
        _LOGGED.add(key)
        what = choice.kernel + (f" {choice.tiles.describe()}" if choice.tiles else "")
        kernels.note_choice(
            f"LT_attention_parallel kernel=pallas at [B={B}, T={T}, H={H}, D={D}] c={c} "
            f"{dtype.name}: {what} ({choice.reason})",
            __name__,
        )
    return choice


def _design(fq, v, c: int, kernel: str) -> cost.Choice:
    B, T, H, _ = fq.shape
    D = v.shape[-1]
    plan.check(c, D, f"LT_attention_parallel kernel={kernel}")
    Dp, nk = key_blocks.plan(fq.shape[-1], D)
    return choose(kernel, B, T, H * nk, Dp, c, fq.dtype)


def attention(fq, fk, v, c: int, eps: float, kernel: str = "pallas") -> jax.Array:
    """Normalised causal linear attention from features, fused; differentiable.

    fq = phi(q), fk = phi(k) ``[B, T, H, Dk]`` and v ``[B, T, H, D]``, T a multiple of the
    block size c (a power of two >= 16), D <= 128; keys wider than the padded D run as blocks
    of it (``key_blocks``). Returns y ``[B, T, H, D]`` in fq's dtype."""
    choice = _design(fq, v, c, kernel)
    if _key_blocks(fq, v):
        return _split_attention(fq, fk, v, None, None, c, eps, choice)
    if choice.kernel == BLOCKED:
        from linear_gpt2.kernels.lt_attention_parallel import blocked

        return blocked.blocked_attention(fq, fk, v, c, eps)
    if choice.kernel == TILED_DQ:
        from linear_gpt2.kernels.lt_attention_parallel import tiled_dq

        return tiled_dq.attention(fq, fk, v, c, eps, choice.tiles)
    from linear_gpt2.kernels.lt_attention_parallel import tiled

    return tiled.attention(fq, fk, v, c, eps, choice.tiles)


def forget_attention(fq, fk, v, log_gate, seg, c: int, eps: float, kernel: str = "pallas"):
    """:func:`attention` with document resets and decay gates: log_gate float32 ``[B, T, H]``
    (log gamma <= 0), seg int32 ``[B, T]`` the document id of each position; differentiable in
    fq, fk, v and log_gate."""
    choice = _design(fq, v, c, kernel)
    if _key_blocks(fq, v):
        return _split_attention(fq, fk, v, log_gate, seg, c, eps, choice)
    if choice.kernel == BLOCKED:
        from linear_gpt2.kernels.lt_attention_parallel import blocked

        return blocked.blocked_forget_attention(fq, fk, v, log_gate, seg, c, eps)
    if choice.kernel == TILED_DQ:
        from linear_gpt2.kernels.lt_attention_parallel import tiled_dq

        return tiled_dq.forget_attention(fq, fk, v, log_gate, seg, c, eps, choice.tiles)
    from linear_gpt2.kernels.lt_attention_parallel import tiled

    return tiled.forget_attention(fq, fk, v, log_gate, seg, c, eps, choice.tiles)


# --------------------------------------------------------------------------------------------
# Keys wider than the values (an expanding feature map): blocks of the key features folded into
# the heads, each design's kernels unnormalised, the sums divided here (``kernels.key_blocks``)


def _key_blocks(fq, v) -> int:
    """The key blocks of the split path; 0 when keys and values share a padded width (the
    square kernels as they are)."""
    Dk, D = fq.shape[-1], v.shape[-1]
    if kernels.padded_head_dim(Dk) == kernels.padded_head_dim(D):
        return 0
    return key_blocks.plan(Dk, D)[1]


def _block_kernels(design: tuple, c: int, eps: float, nk: int):
    """``(forward, backward, tile)`` of the chosen design on folded, padded inputs (``nk`` key
    blocks per head): forward(fq, fk, v, log_gate, seg) -> (num float32, den [B, H NK, T])
    unnormalised; backward(fq, fk, v, y, dy, den, log_gate, seg) -> (dphi(q), dphi(k), dv, dL
    or None) with y and den the summed ones; ``tile`` the multiple T must be padded to.

    ``log_gate`` is the layer's, ``[B, T, H]``, not repeated per block: its within-block sums
    are taken per head and only those repeated (a head's blocks share its gates). Summing the
    repeated log-gates instead had XLA fuse the forward's and the backward's cumulative sums of
    one broadcast into a single loop kernel that spills registers on the H100."""
    kernel, t = design

    def repeat(*gates):
        return tuple(key_blocks.repeat_heads(x, nk, 2) for x in gates)

    if kernel == BLOCKED:
        from linear_gpt2.kernels.lt_attention_parallel import blocked

        def gates(log_gate, Dp):
            if log_gate is None:
                return None
            return repeat(kernels.block_cumsum(log_gate, blocked.tile(c, Dp)))[0]

        def forward(fq, fk, v, log_gate, seg):
            b = gates(log_gate, fq.shape[-1])
            return blocked._forward(fq, fk, v, c, eps, b, seg, normalise=False)

        def backward(fq, fk, v, y, dy, den, log_gate, seg):
            b = gates(log_gate, fq.shape[-1])
            out = blocked._backward(fq, fk, v, y, dy, den, c, eps, b, seg)
            return (*out, None) if b is None else out

        return forward, backward, c
    from linear_gpt2.kernels.lt_attention_parallel import tiled

    if kernel == TILED_DQ:
        from linear_gpt2.kernels.lt_attention_parallel import tiled_dq

        def forward(fq, fk, v, log_gate, seg):
            g = None if log_gate is None else (*repeat(*tiled.block_gates(log_gate, t.tk)), seg)
            return tiled.forward(fq, fk, v, t, eps, g, normalise=False)

        def backward(fq, fk, v, y, dy, den, log_gate, seg):
            gates = None
            if log_gate is not None:
                fwd = repeat(*tiled.block_gates(log_gate, t.tk))
                bwd = fwd if t.tq == t.tk else repeat(*tiled.block_gates(log_gate, t.tq))
                gates = (fwd, bwd, seg)
            out = tiled_dq.backward(fq, fk, v, y, dy, den, t, eps, gates)
            if gates is None:
                return (*out, None)
            return (*out[:3], jnp.swapaxes(out[3] - out[4], 1, 2))

        return forward, backward, t.pad

    def gates(log_gate, seg, rows: int):
        if log_gate is None:
            return None
        return (*repeat(*tiled.block_gates(log_gate, rows)), seg)

    def forward(fq, fk, v, log_gate, seg):
        return tiled.forward(fq, fk, v, t, eps, gates(log_gate, seg, t.tk), normalise=False)

    def backward(fq, fk, v, y, dy, den, log_gate, seg):
        gate = gates(log_gate, seg, t.tq)
        out = tiled.backward(fq, fk, v, y, dy, den, t, eps, gate)
        dq32 = out[0]
        if gate is None:
            return dq32.astype(fq.dtype), out[1], out[2], None
        dL = jnp.einsum("bthd,bthd->bth", fq.astype(jnp.float32), dq32) - jnp.swapaxes(out[3], 1, 2)
        return dq32.astype(fq.dtype), out[1], out[2], dL

    return forward, backward, t.pad


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _split_core(fq, fk, v, log_gate, seg, design: tuple, c: int, eps: float, nk: int):
    return _split_forward(fq, fk, v, log_gate, seg, design, c, eps, nk)[0]


def _split_forward(fq, fk, v, log_gate, seg, design, c, eps, nk):
    forward, _, _ = _block_kernels(design, c, eps, nk)
    num, den = forward(fq, fk, key_blocks.repeat_heads(v, nk, 2), log_gate, seg)
    num = key_blocks.sum_heads(num, nk, 2)
    den = key_blocks.sum_heads(den, nk, 1)
    r = jnp.swapaxes(kernels.reciprocal(den, eps), 1, 2)[..., None]
    return (num * r).astype(v.dtype), den


def _split_fwd(fq, fk, v, log_gate, seg, design, c, eps, nk):
    y, den = _split_forward(fq, fk, v, log_gate, seg, design, c, eps, nk)
    return y, (fq, fk, v, log_gate, seg, y, den)


def _split_bwd(design, c, eps, nk, residuals, dy):
    fq, fk, v, log_gate, seg, y, den = residuals
    _, backward, _ = _block_kernels(design, c, eps, nk)
    rep = key_blocks.repeat_heads
    dq, dk, dv, dL = backward(
        fq, fk, rep(v, nk, 2), rep(y, nk, 2), rep(dy.astype(y.dtype), nk, 2), rep(den, nk, 1),
        log_gate, seg,
    )  # fmt: skip
    dv = key_blocks.sum_heads(dv, nk, 2)
    dlog = None
    if log_gate is not None:
        dlog = kernels.log_gate_cotangent(key_blocks.sum_heads(dL, nk, 2))
    dseg = None if seg is None else np.zeros(seg.shape, dtype=jax.dtypes.float0)
    return dq, dk, dv, dlog, dseg


_split_core.defvjp(_split_fwd, _split_bwd)


def _split_attention(fq, fk, v, log_gate, seg, c: int, eps: float, choice: cost.Choice):
    """y ``[B, T, H, D]`` for keys wider than the values: fq, fk folded into NK blocks of the
    padded value width (``key_blocks``), T padded to the design's multiple."""
    B, T, H, Dk = fq.shape
    D = v.shape[-1]
    kernels.check_fused_shape(T, D, c, "LT_attention_parallel kernel=pallas")
    Dp, nk = key_blocks.plan(Dk, D)
    design = (choice.kernel, choice.tiles)
    _, _, multiple = _block_kernels(design, c, eps, nk)
    pad_t = -T % multiple

    def prep(x):
        return jnp.pad(x, ((0, 0), (0, pad_t)) + ((0, 0),) * (x.ndim - 2)) if pad_t else x

    fq_f, fk_f = (prep(key_blocks.fold_keys(x, nk, Dp)) for x in (fq, fk))
    v_p = prep(kernels.pad_head_dim(v.astype(fq.dtype), Dp))
    if log_gate is not None:  # padded positions: gamma = 1 and the last document id
        log_gate = prep(log_gate.astype(jnp.float32))
        seg = jnp.pad(seg.astype(jnp.int32), ((0, 0), (0, pad_t)), mode="edge")
    y = _split_core(fq_f, fk_f, v_p, log_gate, seg, design, c, float(eps), nk)
    return y[:, :T, :, :D]


def design(kernel: str, B: int, T: int, H: int, D: int, c: int, dtype) -> str:
    """What ``kernel`` runs at ``[B, T, H, D]`` (T a multiple of c, D padded): ``pallas_tiled``,
    ``pallas_tiled_dq`` or ``pallas_blocked`` (for benchmarks' ``kernel_design``)."""
    return choose(kernel, B, T, H, D, c, dtype).kernel


__all__ = ["BLOCKED", "TILED", "attention", "choose", "design", "forget_attention"]
