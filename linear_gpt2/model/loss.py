"""The language-model loss: token cross-entropy, plain or fused with the head by token chunks.

:func:`cross_entropy` is nanoGPT's ``F.cross_entropy(logits, targets, ignore_index=-1)`` on
``[..., V]`` float32 logits. It is what the model uses by default, and the oracle of the fused
form.

:func:`head_cross_entropy` computes the same mean loss from the final hidden states and the tied
head ``wte`` without ever holding the ``[N, V]`` float32 logits of the whole sequence: it walks
the N tokens in chunks of ``chunk`` (a ``lax.scan``), and for each chunk computes the logits,
their log-sum-exp, the loss, and already the gradient (softmax minus one-hot, divided by the
number of counted tokens), from which it forms the chunk's ``dx`` and adds its ``dW``. Those are
the ``custom_vjp``'s residuals; the backward pass only scales them by the incoming cotangent.

Why compute the gradient in the forward pass? The loss is the last op of the step and a scalar,
so its cotangent is a single number known to be applied to exactly these partials: nothing is
recomputed (a ``jax.checkpoint``-ed scan would run the head matmul a third time, +10% of the
124M step's FLOPs) and nothing of size ``[N, V]`` is kept. Memory: ``dx`` ``[N, C]`` and ``dW``
``[V, C]`` float32, plus one chunk's ``[chunk, V]`` logits and probabilities (about 2.4 GiB at
4096 tokens and V = 50304). At 64k tokens the plain form holds 12.3 GiB of logits and as much
again of their gradient.

With ``kernel="pallas_fused"`` (``model.loss_kernel``) there are no chunks: the per-row losses
come from ``kernels/head_loss``, whose forward kernel keeps an online log-sum-exp over
vocabulary tiles and whose backward recomputes each block of logits from it, so neither the
logits nor their gradient is ever written, and nothing of size ``[N, V]`` or ``[chunk, V]`` is
allocated; the mean over counted targets is taken here.

Precision: as nanoGPT under torch autocast, where the head's output is bfloat16 and the
gradient reaching its backward is bfloat16 too. The forward matmul takes operands in ``dtype``
(bfloat16 in training) and accumulates in float32; logits, log-sum-exp, softmax, the loss and the
gradient of the logits are formed in float32 (the logits kept in float32, where autocast rounds
them to bfloat16 before F.cross_entropy upcasts them). The gradient of the logits is then rounded
to ``dtype`` before the backward's two matmuls (``dx = dlogits @ W``, ``dW = dlogits^T @ x``),
which accumulate in float32 and round their results to ``dtype`` (``dx`` per chunk, ``dW``
once, after summing the chunks in float32). Without the rounding the float32 gradient met the
bfloat16 operand and both GEMMs ran in float32 (TF32 on the H100/H200, half the bfloat16 rate;
LT_chunked's two largest ops in the 124M step at 64k tokens traced on an H200:
``benchmarks/results/profile_h200_measured.json``). The plain head takes the same backward
(:func:`head_logits`), so the two agree up to summation order in either dtype: <= 1e-6
relative in float32, where nothing is rounded (tested).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from linear_gpt2.kernels import rows
from linear_gpt2.kernels.choice import is_fused_head, is_pallas
from linear_gpt2.kernels.cross_entropy import naive as ce_naive
from linear_gpt2.platform.mesh import DATA, SEQ, manual_axes, sequence_shards

F32 = jnp.float32
IGNORE_INDEX = -1


def cross_entropy(logits: jax.Array, targets: jax.Array, ignore_index: int = IGNORE_INDEX):
    """Mean token cross-entropy in float32 over targets != ``ignore_index`` (torch's semantics).

    logits ``[..., V]``, targets int ``[...]``.
    """
    logits = logits.astype(F32)
    valid = targets != ignore_index
    safe = jnp.where(valid, targets, 0)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
    nll = jnp.where(valid, log_z - picked, 0.0)
    return nll.sum() / jnp.maximum(counted(valid, log_z), 1)


def counted(valid: jax.Array, after: jax.Array) -> jax.Array:
    """float32 number of ``valid`` targets, computed after ``after`` (an array of the loss's
    own, ``valid``'s shape or more: ``0 * after`` adds nothing finite, and a non-finite loss
    stays non-finite).

    The count depends on the targets alone; summed over sharded devices it is a collective
    that XLA:CPU would start while the layer loop's collectives were still in flight on the
    same device (``linear_gpt2.experiments.collectives.unordered_collectives``), and host
    devices with two collectives waiting each ran their shared thread pool dry and aborted
    (issue 38). Made from the loss's own values it waits for the layers, as the rest of the
    loss does; an optimization barrier would not do: XLA removes it before the program runs."""
    zero = 0.0 * after.reshape(*valid.shape, -1)[..., 0]
    return jnp.sum(valid.astype(F32) + zero)


def head_logits(x: jax.Array, w: jax.Array, dtype="float32") -> jax.Array:
    """The tied head's logits ``x @ w^T``: x ``[..., C]``, w ``[V, C]`` -> ``[..., V]`` float32,
    the operands in ``dtype`` and the products accumulated in float32.

    Its gradient is autodiff's except that the logits' cotangent is rounded to ``dtype`` before
    the two backward matmuls (as under torch autocast, where the head's output and so its
    gradient are bfloat16); they accumulate in float32 and round their results to ``dtype``,
    as autodiff does, and the cotangents come back in x's and w's dtypes. In float32 it is the
    plain einsum (nothing to round)."""
    dt = jnp.dtype(dtype)
    if dt == F32:
        return _logits(x, w, dt)
    return _head_logits(x, w, dt.name, jnp.dtype(x.dtype).name, jnp.dtype(w.dtype).name)


def _logits(x, w, dt):
    return jnp.einsum("...c,vc->...v", x.astype(dt), w.astype(dt), preferred_element_type=F32)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _head_logits(x, w, dtype: str, x_dtype: str, w_dtype: str):
    return _logits(x, w, jnp.dtype(dtype))


def _logits_fwd(x, w, dtype, x_dtype, w_dtype):
    dt = jnp.dtype(dtype)
    xc, wc = x.astype(dt), w.astype(dt)
    return _logits(xc, wc, dt), (xc, wc)


def _logits_bwd(dtype, x_dtype, w_dtype, residuals, g):
    xc, wc = residuals  # [..., C], [V, C] in dtype
    g = g.astype(dtype)  # [..., V]
    dx = jnp.einsum("...v,vc->...c", g, wc, preferred_element_type=F32).astype(dtype)
    lead = tuple(range(g.ndim - 1))  # the tokens' axes, summed over
    dw = jnp.tensordot(g, xc, (lead, lead), preferred_element_type=F32).astype(dtype)
    return dx.astype(x_dtype), dw.astype(w_dtype)


_head_logits.defvjp(_logits_fwd, _logits_bwd)


def _chunks(x: jax.Array, targets: jax.Array, chunk: int):
    """``[N, C]``, ``[N]`` -> ``[N/chunk, chunk, C]``, ``[N/chunk, chunk]``; N padded with zero
    rows whose targets are ignored (they add nothing to the loss or to any gradient)."""
    N = x.shape[0]
    pad = (-N) % chunk
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
        targets = jnp.pad(targets, (0, pad), constant_values=IGNORE_INDEX)
    n = x.shape[0] // chunk
    return x.reshape(n, chunk, x.shape[1]), targets.reshape(n, chunk)


def _forward_and_partials(x, w, targets, chunk: int, dtype, kernel: str = "xla"):
    """Loss, dloss/dx ``[N, C]`` and dloss/dw ``[V, C]`` (float32), by chunks of tokens. The
    chunk's losses and d(mean nll)/d logits = (softmax - onehot) / count (0 where a target is
    ignored) by ``kernel``: ``xla`` (the oracle's operations) or ``pallas`` (one kernel)."""
    N, C = x.shape
    V = w.shape[0]
    dt = jnp.dtype(dtype)
    valid_all = targets != IGNORE_INDEX
    count = jnp.maximum(counted(valid_all, x), 1.0)  # after the layers (counted)
    xs, ts = _chunks(x, targets, chunk)
    w_c = w.astype(dt)
    if is_pallas(kernel):
        from linear_gpt2.kernels.cross_entropy import fused  # Pallas: imported when picked

        nll_and_grad = fused.cross_entropy
    else:
        nll_and_grad = ce_naive.nll_and_grad

    def body(carry, inputs):
        loss_sum, dw = carry
        xc, tc = inputs  # [chunk, C], [chunk]
        xc_c = xc.astype(dt)
        logits = jnp.dot(xc_c, w_c.T, preferred_element_type=F32)  # [chunk, V]
        nll, dlogits = nll_and_grad(logits, tc, count)
        # As the plain head's backward (head_logits): the gradient of the logits rounded to
        # dtype, so both matmuls take dtype operands (float32 against bfloat16 ran as a float32
        # GEMM), float32 results rounded to dtype (dx here, dw once at the end).
        dlogits = dlogits.astype(dt)
        dxc = jnp.dot(dlogits, w_c, preferred_element_type=F32).astype(dt)  # [chunk, C]
        dw = dw + jnp.dot(dlogits.T, xc_c, preferred_element_type=F32)  # [V, C]
        return (loss_sum + nll.sum(), dw), dxc

    init = (jnp.zeros((), F32), jnp.zeros((V, C), F32))
    (loss_sum, dw), dx = jax.lax.scan(body, init, (xs, ts))
    dx = dx.reshape(-1, C)[:N].astype(F32)
    return loss_sum / count, dx, dw.astype(dt).astype(F32)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _head_cross_entropy(x, w, targets, chunk: int, dtype: str, kernel: str):
    return _forward_and_partials(x, w, targets, chunk, dtype, kernel)[0]


def _fwd(x, w, targets, chunk, dtype, kernel):
    loss, dx, dw = _forward_and_partials(x, w, targets, chunk, dtype, kernel)
    return loss, (dx, dw, targets)


def _bwd(chunk, dtype, kernel, residuals, g):
    dx, dw, targets = residuals
    g = g.astype(F32)
    # Integer targets take a float0 cotangent (JAX's convention for non-differentiable inputs).
    dt = jnp.zeros(targets.shape, dtype=jax.dtypes.float0)
    return (g * dx).astype(dx.dtype), (g * dw).astype(dw.dtype), dt


_head_cross_entropy.defvjp(_fwd, _bwd)


def head_cross_entropy(
    x: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    *,
    chunk: int,
    dtype="float32",
    kernel: str = "xla",
) -> jax.Array:
    """Mean cross-entropy of the logits ``x @ w^T`` against ``targets`` (-1 ignored), by chunks
    of ``chunk`` tokens, without the full ``[N, V]`` logits; differentiable in x and w.

    x ``[..., C]`` hidden states (after the final LayerNorm; float32, or the compute dtype), w
    ``[V, C]`` float32 (the tied embedding), targets int ``[...]``; the matmuls run in ``dtype``.
    Equals ``cross_entropy(head_logits(x, w, dtype), targets)``, gradients included: the
    gradient of the logits is rounded to ``dtype`` before the backward's matmuls (in float32
    no rounding), whichever the kernel. ``kernel``: each chunk's losses and gradient by XLA's
    operations (``xla``) or one Pallas kernel (``pallas``, ``kernels/cross_entropy/``; then
    under a mesh of several devices each device walks its own rows, as under context
    parallelism); or ``pallas_fused``: no chunks, the head and the loss as one kernel pair that
    never writes the logits (``kernels/head_loss/``; ``chunk`` unused).
    """
    if chunk < 1:
        raise ValueError(f"loss chunk must be >= 1 token, got {chunk}")
    kernels_on = is_pallas(kernel) or is_fused_head(kernel)
    if x.ndim == 3 and (sequence_shards() > 1 or (kernels_on and rows.split(x))):
        return _over_devices(x, w, targets, chunk, jnp.dtype(dtype).name, kernel)
    return _local(x, w, targets, chunk, jnp.dtype(dtype).name, kernel)


def _local(x, w, targets, chunk: int, dtype: str, kernel: str = "xla") -> jax.Array:
    C = x.shape[-1]
    x2, t2 = x.reshape(-1, C), targets.reshape(-1)
    if is_fused_head(kernel):
        return _fused_head(x2, w, t2, dtype)
    chunk = min(chunk, x2.shape[0])
    return _head_cross_entropy(x2.astype(F32), w.astype(F32), t2, chunk, dtype, kernel)


def _fused_head(x, w, targets, dtype: str) -> jax.Array:
    """Mean loss of x ``[N, C]`` by ``kernels/head_loss`` (per-row losses, the logits never
    written): the matmuls' operands in ``dtype``, as the chunked form; the mean over counted
    targets in float32 here. Its gradients come back in ``dtype``, rounded once, and
    autodiff of the casts returns them in float32, as the chunked form's."""
    from linear_gpt2.kernels.head_loss import ops  # Pallas: imported when picked

    dt = jnp.dtype(dtype)
    nll = ops.head_nll(x.astype(dt), w.astype(dt), targets, kernel="pallas")
    count = jnp.maximum(counted(targets != IGNORE_INDEX, nll), 1.0)  # after the layers
    return nll.sum() / count


def _over_devices(x, w, targets, chunk: int, dtype: str, kernel: str = "xla") -> jax.Array:
    """The chunked loss of x ``[B, T, C]`` split over the mesh's ``data`` and ``seq`` axes
    (context parallelism), each device walking its own rows and slice. The chunk scan must not
    see the sharded token axis: slicing it chunk by chunk made XLA gather the whole sequence's
    hidden states at every step. Per device the mean of its counted tokens, weighted back into
    sums and combined over the mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(a for a in (DATA, SEQ) if a in mesh.axis_names and a not in manual_axes())
    split = P(DATA if DATA in axes else None, SEQ if SEQ in axes else None)

    def body(x, w, t):
        mean = _local(x, w, t, chunk, dtype, kernel)  # 0 where nothing is counted
        n = counted(t != IGNORE_INDEX, mean * jnp.ones(t.shape, F32))  # after the layers
        total = jax.lax.psum(mean * jnp.maximum(n, 1.0), axes)
        return total / jnp.maximum(jax.lax.psum(n, axes), 1.0)

    run = jax.shard_map(
        body, mesh=mesh, in_specs=(split, P(), split), out_specs=P(), axis_names=set(axes),
        check_vma=False,
    )  # fmt: skip
    return run(x, w, targets)
