"""The jitted training step: gradient accumulation by ``lax.scan``, AdamW, and a finite check.

One call is one optimizer update over ``tokens_per_update`` tokens: the batch arrives as
``[accum, global_micro_batch, T]`` with the micro-batch axis split across devices, the scan sums
gradients of ``accum`` micro-batches (loss is a per-token mean, so the summed mean gradients over
equal micro-batches divided by ``accum`` equal the gradient of one large batch), and one AdamW
step applies them.

Data parallel with replicated parameters (not FSDP), each device computes the gradients of its
own sequences and they are summed over the devices once per update, in float32
(:func:`_local_gradients`), as DDP does. Left to XLA's partitioner, the sum over the batch
happens where a weight's gradient is formed, at the matmul's output: in bfloat16, inside every
micro-step (the H100 program's all-reduces: tests/test_context_parallel.py, the data-parallel
test; the one-device step equalled with unequal counts: tests/test_train_step_parallel.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from linear_gpt2.model import correct, init_params, loss_fn
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.model.loss import IGNORE_INDEX
from linear_gpt2.platform.mesh import DATA
from linear_gpt2.training.sharding import batch_sharding, replicated, state_shardings, traced_on


class TrainState(NamedTuple):
    params: Any
    opt_state: Any
    step: jax.Array  # int32 scalar: updates applied so far


def init_state(params, tx: optax.GradientTransformation) -> TrainState:
    return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))


def _summed_gradients(model_cfg: ModelConfig, params, xs, weights=None):
    """(gradients, loss) summed over the micro-batches of ``xs`` = (inputs, targets, keys[,
    segments]), each scaled by its row of ``weights`` ``[accum]`` where given; float32, as the
    parameters."""
    grad_fn = jax.value_and_grad(loss_fn)

    def micro(carry, xs):
        grads, loss = carry
        x, y, k, w, *seg = xs
        l, g = grad_fn(params, x, y, model_cfg, train=True, rng=k, segment_ids=(seg or [None])[0])
        if w is None:
            return (jax.tree.map(jnp.add, grads, g), loss + l), None
        return (jax.tree.map(lambda a, b: a + w * b, grads, g), loss + w * l), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    xs = (*xs[:3], weights, *xs[3:])
    (grads, loss), _ = jax.lax.scan(micro, (zeros, jnp.zeros((), jnp.float32)), xs)
    return grads, loss


def _local_gradients(model_cfg: ModelConfig, mesh, params, xs):
    """:func:`_summed_gradients` over a batch split on the mesh's ``data`` axis, each device on
    its own sequences (``shard_map`` over ``data``), the devices' sums added once, in float32.

    The loss is a mean over a micro-batch's counted targets (all devices' together), so each
    device's mean enters weighted by its share of them: the weighted sum over devices is the
    micro-batch's mean exactly, whatever each device counts. Each device folds its index into
    the dropout key, so that devices draw different masks."""
    targets = xs[1]
    accum, B = targets.shape[:2]
    n = mesh.shape[DATA]
    counted = (targets != IGNORE_INDEX).reshape(accum, n, B // n, -1).sum(axis=(2, 3))
    counted = counted.astype(jnp.float32)  # [accum, n]: each device's counted targets
    weights = counted / jnp.maximum(counted.sum(axis=1, keepdims=True), 1.0)

    def local(params, weights, inputs, targets, keys, *segments):
        keys = jax.vmap(lambda k: jax.random.fold_in(k, jax.lax.axis_index(DATA)))(keys)
        g, loss = _summed_gradients(
            model_cfg, params, (inputs, targets, keys, *segments), weights[:, 0]
        )
        return jax.lax.psum((g, loss), DATA)

    split = P(None, DATA)
    run = jax.shard_map(
        local, mesh=mesh, in_specs=(P(), split, split, split, P(), *(split,) * (len(xs) - 3)),
        out_specs=P(), axis_names={DATA}, check_vma=False,
    )  # fmt: skip
    return run(params, weights, *xs)


def make_train_step(
    model_cfg: ModelConfig,
    tx: optax.GradientTransformation,
    skip_nonfinite: bool,
    data_mesh=None,
):
    """``step(state, inputs, targets, key) -> (state, metrics)``.

    inputs, targets (and, with ``doc_reset``, segments: document ids): int32 ``[accum, B, T]``.
    ``key`` seeds dropout; each update folds in its step number so a resumed run draws the same
    masks. With ``skip_nonfinite`` an update whose loss or
    gradient is NaN/inf is dropped (parameters and optimizer state unchanged) and reported.
    ``data_mesh``: the mesh whose ``data`` axis splits B over devices holding the whole
    parameters; each device then computes its own sequences' gradients
    (:func:`_local_gradients`). None: XLA's partitioner places the step (one device, FSDP).
    """

    def step(state: TrainState, inputs, targets, key, segments=None):
        accum = inputs.shape[0]
        keys = jax.random.split(jax.random.fold_in(key, state.step), accum)
        xs = (inputs, targets, keys) + (() if segments is None else (segments,))
        if data_mesh is None:
            grads, loss = _summed_gradients(model_cfg, state.params, xs)
        else:
            grads, loss = _local_gradients(model_cfg, data_mesh, state.params, xs)
        grads = jax.tree.map(lambda g: g / accum, grads)
        loss = loss / accum
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        new = TrainState(params, opt_state, state.step + 1)
        if skip_nonfinite:
            keep = TrainState(state.params, state.opt_state, state.step + 1)
            new = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, keep)
        return new, {"loss": loss, "grad_norm": grad_norm, "finite": finite}

    return step


def make_eval_step(model_cfg: ModelConfig, accuracy: bool = False):
    """``eval(params, inputs, targets) -> mean loss`` over ``[accum, B, T]`` batches; with
    ``accuracy`` ``(mean loss, hits, counted)``: also how many counted targets (!= -1) are the
    argmax of their logits, and how many were counted (``model.correct``)."""

    def evaluate(params, inputs, targets, segments=None):
        def one(xs):
            x, y, *seg = xs
            seg_ids = (seg or [None])[0]
            loss = loss_fn(params, x, y, model_cfg, segment_ids=seg_ids)
            if not accuracy:
                return loss
            return (loss, *correct(params, x, y, model_cfg, segment_ids=seg_ids))

        xs = (inputs, targets) + (() if segments is None else (segments,))
        if not accuracy:
            return jax.lax.map(one, xs).mean()
        losses, hits, counted = jax.lax.map(one, xs)
        return losses.mean(), hits.sum(), counted.sum()

    return evaluate


class StepProgram(NamedTuple):
    """A training step jitted with the trainer's shardings, and its abstract arguments."""

    step: Any  # jax.jit(...): (state, inputs, targets, key) -> (state, metrics), state donated
    args: tuple[Any, ...]  # ShapeDtypeStructs with shardings: what .lower() takes
    state_shardings: TrainState


def jit_train_step(
    model_cfg: ModelConfig,
    tx: optax.GradientTransformation,
    mesh,
    *,
    accum: int,
    batch: int,
    context: int | None = None,
    fsdp: bool = False,
    skip_nonfinite: bool = False,
) -> StepProgram:
    """The step the trainer runs, for ``mesh``: the state replicated (or FSDP-sharded), the
    ``[accum, batch, context]`` token batches split over the mesh on the batch axis, the state
    donated. ``batch`` is global (all devices); ``context`` defaults to ``block_size``. Used by the trainer, the step benchmark and the compile
    targets (``target.py``), so that what is compiled for the H100 is what trains."""
    abstract_state = jax.eval_shape(lambda: init_state(init_params(model_cfg, 0), tx))
    sh = state_shardings(abstract_state, mesh, fsdp)
    sh = TrainState(sh.params, sh.opt_state, replicated(mesh))
    batch3 = batch_sharding(mesh, 3, batch_axis=1)
    # With doc_reset the step takes the document ids as a fifth argument, sharded as the tokens.
    extra = (batch3,) if model_cfg.doc_reset else ()
    n = mesh.shape.get(DATA, 1)
    data_mesh = mesh if n > 1 and not fsdp and batch % n == 0 else None
    step = jax.jit(
        traced_on(mesh, make_train_step(model_cfg, tx, skip_nonfinite, data_mesh)),
        in_shardings=(sh, batch3, batch3, replicated(mesh), *extra),
        out_shardings=(sh, replicated(mesh)),
        donate_argnums=(0,),
    )
    T = model_cfg.block_size if context is None else context
    tokens = jax.ShapeDtypeStruct((accum, batch, T), jnp.int32, sharding=batch3)
    key = jax.eval_shape(lambda: jax.random.key(0))
    args = (
        jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, sh
        ),
        tokens,
        tokens,
        jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated(mesh)),
        *((tokens,) if model_cfg.doc_reset else ()),
    )
    return StepProgram(step, args, sh)
