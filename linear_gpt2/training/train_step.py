"""The jitted training step: gradient accumulation by ``lax.scan``, AdamW, and a finite check.

One call is one optimizer update over ``tokens_per_update`` tokens: the batch arrives as
``[accum, global_micro_batch, T]`` with the micro-batch axis split across devices, the scan sums
gradients of ``accum`` micro-batches (loss is a per-token mean, so the summed mean gradients over
equal micro-batches divided by ``accum`` equal the gradient of one large batch), and one AdamW
step applies them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from linear_gpt2.model import correct, init_params, loss_fn
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.training.sharding import batch_sharding, replicated, state_shardings, traced_on


class TrainState(NamedTuple):
    params: Any
    opt_state: Any
    step: jax.Array  # int32 scalar: updates applied so far


def init_state(params, tx: optax.GradientTransformation) -> TrainState:
    return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))


def make_train_step(model_cfg: ModelConfig, tx: optax.GradientTransformation, skip_nonfinite: bool):
    """``step(state, inputs, targets, key) -> (state, metrics)``.

    inputs, targets (and, with ``doc_reset``, segments: document ids): int32 ``[accum, B, T]``.
    ``key`` seeds dropout; each update folds in its step number so a resumed run draws the same
    masks. With ``skip_nonfinite`` an update whose loss or
    gradient is NaN/inf is dropped (parameters and optimizer state unchanged) and reported.
    """

    def step(state: TrainState, inputs, targets, key, segments=None):
        accum = inputs.shape[0]
        keys = jax.random.split(jax.random.fold_in(key, state.step), accum)
        grad_fn = jax.value_and_grad(loss_fn)

        def micro(carry, xs):
            grads, loss = carry
            x, y, k, *seg = xs
            l, g = grad_fn(
                state.params, x, y, model_cfg, train=True, rng=k, segment_ids=(seg or [None])[0]
            )
            return (jax.tree.map(jnp.add, grads, g), loss + l), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        xs = (inputs, targets, keys) + (() if segments is None else (segments,))
        (grads, loss), _ = jax.lax.scan(micro, (zeros, jnp.zeros((), jnp.float32)), xs)
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
    step = jax.jit(
        traced_on(mesh, make_train_step(model_cfg, tx, skip_nonfinite)),
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
