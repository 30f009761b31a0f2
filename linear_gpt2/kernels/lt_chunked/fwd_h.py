"""State pass, forward: the state entering every chunk (``lt_chunked_fwd_h``).

Grid ``(G, B, H, NV)``: one program per (segment, batch, head, value block). The T/c chunks are
split into G segments of L = T/(c G) consecutive chunks (``plan.Blocks.segments``); a program
walks the L chunks of its segment in order, sequentially, carrying in float32

    S [D, BV]  the segment-local state  sum_{j in the segment, before chunk n} phi(k_j) v_j^T
    z [D]      the segment-local normaliser sum  sum_j phi(k_j)

starting from zero. Per chunk n it writes to HBM the state *entering* the chunk, h[n] = S
(``[B, H, N, D, D]`` float32, value block BV) and z[n] (``[B, H, N, D]``, written by the value
block 0 programs), then adds the chunk: S = scale_n S + phi(K_n)^T V_n (scale_n = 1:
``tiles.chunk_scale``, issue 14's decay hook), z += phi(K_n)^T 1. At the end it writes the
segment's total, ``[B, H, G, D, D]`` and ``[B, H, G, D]``.

The state entering chunk n is then ``base[g(n)] + h[n]``, where base[g] = S_0 + the totals of
segments 0..g-1 (an exact prefix over segments, computed in XLA: the update is a plain sum);
the output and gradient kernels add the two. With G = 1 and no initial state, base = 0 and is
not read. Splitting the sequence gives the pass G times more programs (``plan``: enough to
fill the H100's 132 SMs at batch 1) at the price of G [D, D] totals.

Reads phi(K), V once ([B, T, H, D], input dtype); per chunk, one [D, c] x [c, BV] dot.

With forgetting (issue 14) it also reads b ``[B, T, H]`` float32 (chunk-local cumulative
log-gates) and s ``[B, T]`` int32 (document index within the chunk): per chunk it scales the
carried S, z by ``tiles.carry`` = [no reset in the chunk] e^{b_last} and weights each key row by
``tiles.out`` = [same document as the chunk's last row] e^{b_last - b_j} before the dot. It
writes the same arrays; the segment bases then follow a decayed prefix (``__init__``).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from linear_gpt2 import kernels
from linear_gpt2.kernels.lt_chunked import plan as plan_lib
from linear_gpt2.kernels.lt_chunked import tiles

F32 = jnp.float32


def add_tile(fk_ref, v_ref, start, bt, p, carry, *, gate=None):
    """The state plus row tile p of the chunk starting at ``start``: S + phi(K)^T V, z + phi(K)^T 1;
    with forgetting (``gate`` = (b_ref, s_ref, b_last, s_last)) each key row weighted by
    ``tiles.out``, its weight in the state leaving the chunk."""
    S, z = carry
    rows = pl.ds(start + p * bt, bt)
    k = fk_ref[rows, :]
    k32 = k.astype(F32)
    if gate is not None:
        b_ref, s_ref, b_last, s_last = gate
        k32 = k32 * tiles.out(tiles.gate_rows(b_ref, s_ref, rows), b_last, s_last)[:, None]
        k = k32.astype(k.dtype)
    return S + tiles.dot(k.T, v_ref[rows, :]), z + jnp.sum(k32, axis=0)


def _kernel(*refs, c: int, bt: int, L: int, forget: bool, local: bool = True):
    """fk ``[L c, D]``, v ``[L c, BV]`` (the segment), (b ``[L c]``, s ``[L c]``); (h
    ``[L, D, BV]``, z ``[L, D]``: unless not ``local``), ht ``[D, BV]``, zt ``[D]``."""
    fk_ref, v_ref = refs[:2]
    if forget:
        b_ref, s_ref = refs[2:4]
    ht_ref, zt_ref = refs[-2:]
    h_ref, z_ref = refs[-4:-2] if local else (None, None)
    first_block = pl.program_id(3) == 0
    D, BV = fk_ref.shape[-1], v_ref.shape[-1]

    def chunk(n, carry):
        S, z = carry
        if local:
            h_ref[n] = S

            @pl.when(first_block)
            def _():
                z_ref[n] = z

        gate = None
        if forget:
            b_last, s_last = tiles.last(b_ref, s_ref, n * c + c - 1)
            scale = tiles.carry(b_last, s_last)
            gate = (b_ref, s_ref, b_last, s_last)
        else:
            scale = tiles.chunk_scale(n)
        add = partial(add_tile, fk_ref, v_ref, n * c, bt, gate=gate)
        return tiles.loop(0, c // bt, add, (S * scale, z * scale))

    S, z = lax.fori_loop(0, L, chunk, (jnp.zeros((D, BV), F32), jnp.zeros((D,), F32)))
    ht_ref[...] = S

    @pl.when(first_block)
    def _():
        zt_ref[...] = z


def chunk_fwd_h(
    fk: jax.Array, v: jax.Array, blocks: plan_lib.Blocks, b=None, s=None, local: bool = True
):
    """``(h [B, H, N, D, D], z [B, H, N, D], ht [B, H, G, D, D], zt [B, H, G, D])``, float32:
    segment-local states entering each chunk and each segment's total. fk, v ``[B, T, H, D]``,
    T = N c, D a power of two; with forgetting b ``[B, T, H]`` float32 (chunk-local cumulative
    log-gates) and s ``[B, T]`` int32 (document index within the chunk). Without ``local``
    (one chunk per segment, G = N: every segment-local state is zero) only ``(ht, zt)``, the
    chunks' own totals."""
    B, T, H, D = fk.shape
    c, BV, G = blocks.c, blocks.state_block, blocks.segments
    L = T // c // G
    seg = pl.BlockSpec((None, L * c, None, D), lambda g, b, h, iv: (b, g, h, 0))
    seg_v = pl.BlockSpec((None, L * c, None, BV), lambda g, b, h, iv: (b, g, h, iv))
    in_specs, args = [seg, seg_v], [fk, v]
    return launch_state_pass(
        _kernel, "fwd_h", in_specs, args, (B, T, H, D), blocks, b, s, local=local
    )


def launch_state_pass(
    kernel, name, in_specs, args, shape, blocks: plan_lib.Blocks, b, s, local: bool = True,
    row_outputs: int = 0,
):  # fmt: skip
    """The launch both state passes share (``fwd_h`` here, ``bwd_dh`` in reverse): grid
    (G, B, H, D/bv); the inputs given, plus b, s with forgetting; outputs the per-chunk states
    [B, H, N, D, D] and [B, H, N, D] (unless not ``local``: G = N, where they are zero) and
    each segment's total [B, H, G, D, D], [B, H, G, D], float32, then ``row_outputs`` per-row
    arrays [B, H, T] float32 (``bwd_dh``'s row cotangents)."""
    B, T, H, D = shape
    c, bt, BV, G = blocks.c, blocks.bt, blocks.state_block, blocks.segments
    N = T // c
    L = N // G
    forget = b is not None
    if forget:
        in_specs = in_specs + [
            pl.BlockSpec((None, L * c, None), lambda g, b, h, iv: (b, g, h)),
            pl.BlockSpec((None, L * c), lambda g, b, h, iv: (b, g)),
        ]
        args = args + [b, s]
    assert local or L == 1, "only a one-chunk segment has no segment-local states to write"
    out_specs = [
        pl.BlockSpec((None, None, L, D, BV), lambda g, b, h, iv: (b, h, g, 0, iv)),
        pl.BlockSpec((None, None, L, D), lambda g, b, h, iv: (b, h, g, 0)),
        pl.BlockSpec((None, None, None, D, BV), lambda g, b, h, iv: (b, h, g, 0, iv)),
        pl.BlockSpec((None, None, None, D), lambda g, b, h, iv: (b, h, g, 0)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((B, H, N, D, D), F32),
        jax.ShapeDtypeStruct((B, H, N, D), F32),
        jax.ShapeDtypeStruct((B, H, G, D, D), F32),
        jax.ShapeDtypeStruct((B, H, G, D), F32),
    ]
    if not local:
        out_specs, out_shape = out_specs[2:], out_shape[2:]
    out_specs += [pl.BlockSpec((None, None, L * c), lambda g, b, h, iv: (b, h, g))] * row_outputs
    out_shape += [jax.ShapeDtypeStruct((B, H, T), F32)] * row_outputs
    return pl.pallas_call(
        partial(kernel, c=c, bt=bt, L=L, forget=forget, local=local),
        grid=(G, B, H, D // BV),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plan_lib.compiler_params(name, D, blocks),
        interpret=kernels.interpret(),
        name=f"lt_chunked_{name}",
    )(*args)
