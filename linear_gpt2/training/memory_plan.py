"""``model.remat: auto`` and ``model.loss_chunk: auto``: the fastest setting whose step fits.

The memory options change neither the function nor its gradients, only what is kept for the
backward pass, so choosing among them is a question of cost. The candidates, most memory first:

====  ===========  ========  ==============================================================
 #    loss_chunk   remat     cost beyond the plain step
====  ===========  ========  ==============================================================
 1    0            none      none: today's program (nanoGPT's head, everything kept)
 2    4096         none      none in FLOPs (the fused loss computes its gradient in the
                             forward pass, ``loss.py``); one scan over token chunks
 3    4096         dots      recompute LayerNorm, GELU, phi and attention in the backward
 4    4096         full      recompute each block's forward (+1/3 of the blocks' FLOPs)
 5    4096         offload   as full, plus each block's input to host memory and back
====  ===========  ========  ==============================================================

Values set explicitly in the config are kept; only ``auto`` fields vary. :func:`plan` first
*estimates* every candidate from the configuration alone (:func:`estimate`: nothing compiled):
its memory per device (parameters, AdamW state and gradients, each sharded as FSDP shards
them; the activations autodiff keeps for the backward, by remat policy, read from JAX's own
list of saved residuals traced at one device's shapes, and under context parallelism what the
attention's slices keep besides, from its context-parallel form traced apart; the largest
working set beside them: one block's backward, which with the Pallas glue kernels (``auto``
on a GPU) holds the cotangent of everything the block saved, or the head's float32 logits by
``loss_chunk``; under
FSDP the embedding gathered whole for the tied head) and a modelled step time (FLOPs, HBM
bytes, host transfers and the collectives of FSDP and context parallelism, each at an assumed
rate). It then compiles, fastest first, only the candidates whose estimate fits the budget with a margin
(:data:`ESTIMATE_MARGIN`), and takes the first whose *compiled* memory fits: the compiler, not
the estimate, decides what fits, and the winning executable is returned, so nothing is compiled
twice. Where the devices report no memory limit (the CPU) the first candidate is taken without
estimating or compiling: the default CPU run compiles exactly the program it compiled before
these options existed.

How close the estimate comes to the compiled memory on the shipped configs:
``benchmarks/results/memory_estimate_h100_compiled.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from linear_gpt2.model.config import ModelConfig
from linear_gpt2.platform.cards import H100
from linear_gpt2.platform.memory import GiB, MemoryReport

LOSS_CHUNK = 4096
LADDER: tuple[tuple[int, str], ...] = (
    (0, "none"),
    (LOSS_CHUNK, "none"),
    (LOSS_CHUNK, "dots"),
    (LOSS_CHUNK, "full"),
    (LOSS_CHUNK, "offload"),
)
# Share of a device's allocator limit a planned step may use (the rest: fragmentation, cuDNN
# workspaces, tiles autotuned on the device).
DEVICE_BUDGET_FRACTION = 0.92
# A candidate is compiled when its estimate is at most the budget times (1 + this): the margin
# covers the estimate's error above the compiled memory, so that a setting that fits is not
# skipped on the estimate's word. It is one-sided (an estimate too low costs a compile, not a
# failed run) and set just above the largest overestimate of a scanned step on the results page
# above; any more lets through candidates that cannot fit, each a compile of minutes at start-up.
ESTIMATE_MARGIN = 0.15
# With the blocks unrolled (model.scan_layers: false, and auto's choice on a GPU) the estimate
# is higher than the compiled memory: with XLA's glue, XLA recomputes inside the backward's
# fusions LayerNorm and GELU intermediates that a scan must keep as stacked residuals (the same
# page); with the Pallas glue kernels it is still well above at short contexts, where the
# parameters, AdamW state and gradients dominate (the compiled unrolled step does not hold
# every layer's gradient at once), and close at long ones. Set as ESTIMATE_MARGIN is, just above
# the largest overestimate of an unrolled step compiled with the glue kernels
# (benchmarks/results/scan_compile_h100_compiled.md; tests/test_memory_plan.py reads it).
UNROLLED_ESTIMATE_MARGIN = 0.35


def estimate_margin(cfg: ModelConfig) -> float:
    """The margin a candidate's estimate is allowed over the budget before it is skipped."""
    from linear_gpt2.model.gpt import scans_layers

    return ESTIMATE_MARGIN if scans_layers(cfg) else UNROLLED_ESTIMATE_MARGIN


# The share of a fully rematerialised block's residuals its backward holds at once (chosen
# from the one-GPU compiles of benchmarks/results/memory_estimate_h100_compiled.md: the estimate
# is checked there against every compiled point, this included).
RECOMPUTED_SHARE = 0.5

# Rates the modelled time prices at (ASSUMED, for ranking the candidates of one step against
# each other; the fractions are of the order the compiled-program step model fits,
# benchmarks/results/train_step_h100_model.md).
MATMUL_FLOPS_PER_S = 0.7 * H100.peak_bf16_flops
HBM_BYTES_PER_S = 0.8 * H100.hbm_bytes_per_s
HOST_BYTES_PER_S = H100.host_bytes_per_s  # to pinned host memory, each way
LINK_BYTES_PER_S = 450e9  # NVLink 4, per GPU and direction, within a host
NETWORK_BYTES_PER_S = 50e9  # one 400 Gb/s NIC per GPU, between hosts


def label(cfg: ModelConfig) -> str:
    return f"loss_chunk={cfg.loss_chunk} remat={cfg.remat}"


def candidates(cfg: ModelConfig) -> list[ModelConfig]:
    """Resolutions of ``cfg``'s ``auto`` memory fields, most memory first (explicit values
    kept)."""
    out: list[ModelConfig] = []
    for chunk, remat in LADDER:
        c = cfg.replace(
            loss_chunk=chunk if cfg.loss_chunk == "auto" else cfg.loss_chunk,
            remat=remat if cfg.remat == "auto" else cfg.remat,
        )
        if c not in out:
            out.append(c)
    return out


def rung(cfg: ModelConfig) -> int:
    """Position of a resolved config's setting in :data:`LADDER` (0 when not on it)."""
    key = (cfg.loss_chunk, cfg.remat)
    return next((i for i, r in enumerate(LADDER) if r == key), 0)


def is_resolved(cfg: ModelConfig) -> bool:
    return cfg.loss_chunk != "auto" and cfg.remat != "auto"


# --------------------------------------------------------------------------------------------
# The estimate


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The training step as one device runs it."""

    batch: int  # sequences per device per micro-step
    context: int  # the whole sequence's positions (data.context)
    accum: int = 1  # micro-steps per update
    devices: int = 1  # devices of the mesh
    context_parallel: int = 1  # devices each sequence is split over (its slices)
    fsdp: bool = False
    devices_per_host: int = 8

    @property
    def positions(self) -> int:
        """Positions of each sequence on one device."""
        return self.context // self.context_parallel

    @classmethod
    def of(
        cls,
        global_batch: int,
        context: int,
        *,
        accum: int = 1,
        devices: int = 1,
        context_parallel: int = 1,
        fsdp: bool = False,
        devices_per_host: int = 8,
    ) -> StepShape:
        """From the trainer's layout: ``global_batch`` sequences per micro-step over the
        ``devices // context_parallel`` data-parallel groups."""
        data = max(1, devices // context_parallel)
        return cls(max(1, global_batch // data), context, accum, devices, context_parallel,
                   fsdp, min(devices_per_host, devices))  # fmt: skip


@dataclasses.dataclass
class Estimate:
    """One candidate, estimated from its configuration (nothing compiled)."""

    memory: int  # bytes per device
    parts: dict[str, int]  # the memory by part (host bytes apart: not device memory)
    seconds: float  # MODELLED step time (assumed rates above), for ranking only
    times: dict[str, float]  # its terms: compute, memory, host, collectives
    collective_bytes: dict[str, float]  # what one device sends per step, by collective
    # How far over the budget this estimate may be and still be compiled (estimate_margin),
    # decided where the estimate was traced: whether auto unrolls the blocks depends on the
    # target traced for, which the plan's caller knows and the plan does not.
    margin: float = ESTIMATE_MARGIN


def _saved_residuals(f, *args):
    # JAX's own list of the residuals autodiff saves (jax.ad_checkpoint.print_saved_residuals
    # prints it): the function that list comes from, in JAX's private namespace (jax 0.11.2).
    from jax._src.ad_checkpoint import saved_residuals

    return saved_residuals(f, *args)


def _is_host(aval) -> bool:
    return "host" in str(getattr(aval, "memory_space", "")).lower()


def _param_shapes(cfg: ModelConfig) -> Any:
    """The parameters' shapes (``model.param_shapes``), the same for every memory setting."""
    from linear_gpt2.model import init_config

    return _shapes(init_config(cfg).replace(scan_layers=True, residual_dtype="float32"))


@functools.lru_cache(maxsize=64)
def _shapes(cfg: ModelConfig) -> Any:
    from linear_gpt2.model import param_shapes

    return param_shapes(cfg)


@functools.lru_cache(maxsize=64)
def _saved_bytes(
    cfg: ModelConfig, n_layer: int, batch: int, positions: int, platform: str
) -> tuple[int, int]:
    """(device, host) bytes of what the loss's forward keeps for its backward at ``n_layer``
    layers, ``batch`` sequences of ``positions`` tokens: traced, not compiled. ``platform``
    keys the cache: the kernels traced depend on it."""
    from linear_gpt2.model import loss_fn

    c = cfg.replace(n_layer=n_layer, block_size=max(cfg.block_size, positions))
    tokens = jax.ShapeDtypeStruct((batch, positions), jnp.int32)
    extra = (tokens,) if c.doc_reset else ()

    def loss(params, x, y, *seg):
        return loss_fn(params, x, y, c, train=True, rng=jax.random.key(0),
                       segment_ids=seg[0] if seg else None)  # fmt: skip

    device = host = 0
    for aval, why in _saved_residuals(loss, _param_shapes(c), tokens, tokens, *extra):
        if "from the argument" in why:  # parameters and tokens: counted as state and inputs
            continue
        n = math.prod(aval.shape) * aval.dtype.itemsize
        if _is_host(aval):
            host += n
        else:
            device += n
    return device, host


def _attention_saved(cfg: ModelConfig, batch: int, positions: int, slices: int) -> int:
    """Bytes per device that one layer's attention keeps for its backward (its inputs q, k, v
    counted when kept), under the block's remat policy: traced, not compiled, on ``batch``
    sequences of ``positions`` tokens per device. With ``slices`` > 1 the sequence is split
    over a ``seq`` mesh axis of that size (the abstract mesh in context, resized) and the
    variant runs its context-parallel form (``attention/context.py``): every residual of that
    trace is either split along the sequence or one slice's own, stacked over the slices, so
    one device holds 1/``slices`` of the total."""
    from linear_gpt2.model.gpt import remat_policy
    from linear_gpt2.platform.mesh import DATA, SEQ

    H, D, Dk = cfg.n_head, cfg.head_dim, cfg.qk_dim
    T = positions * slices
    fn = cfg.spec.build(cfg.attention_options)
    args = [jax.ShapeDtypeStruct((batch, T, H, d), jnp.dtype(cfg.dtype)) for d in (Dk, Dk, D)]
    names = []  # the forgetting the block passes (model/gpt.py: CausalSelfAttention)
    if cfg.doc_reset:
        names.append("resets")
        args.append(jax.ShapeDtypeStruct((batch, T), jnp.bool_))
    if cfg.decay != "none":
        names.append("log_gate")
        args.append(jax.ShapeDtypeStruct((batch, T, H), jnp.float32))

    def attend(q, k, v, *forget):
        return jnp.sum(fn(q, k, v, **dict(zip(names, forget))).astype(jnp.float32))

    policy = remat_policy(cfg.remat)
    f = attend if policy is None else jax.checkpoint(attend, policy=policy, prevent_cse=False)

    def total() -> int:
        return sum(math.prod(a.shape) * a.dtype.itemsize for a, _ in _saved_residuals(f, *args))

    if slices == 1:
        return total()
    # The traced-for mesh resized to (data 1, seq ``slices``), on the same kind of device (the
    # kernels chosen for it); JAX does not resize a mesh in context, so it is left first.
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    auto = (jax.sharding.AxisType.Auto,) * 2
    split = jax.sharding.AbstractMesh((1, slices), (DATA, SEQ), auto, abstract_device=device)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        with jax.sharding.use_abstract_mesh(split):
            return total() // slices


@functools.lru_cache(maxsize=64)
def _context_parallel_extra(
    cfg: ModelConfig, batch: int, positions: int, slices: int, platform: str
) -> int:
    """Bytes per device and layer that the attention's context-parallel form keeps beyond what
    its one-device form keeps at the slice's shapes (what the one-device trace of the model
    misses). For the linear family these are the slice state's own residuals
    (``kernels/context.py``: the weighted key features of its ``S = sum_j w_j phi(k_j) v_j^T``,
    and with the Pallas kernels, which take the raw keys and keep their own features, the raw
    keys phi's gradient reads): ``[B, T/N, H, D]`` arrays, two per layer on a GPU, without
    remat; none under a remat policy that recomputes the attention. ``platform`` keys the
    cache (the kernels traced depend on it)."""
    return max(0, _attention_saved(cfg, batch, positions, slices)
               - _attention_saved(cfg, batch, positions, 1))  # fmt: skip


def _layer_and_rest(cfg: ModelConfig, shape: StepShape) -> tuple[tuple[int, int], tuple[int, int]]:
    """Saved bytes (device, host) of one block, and of everything else (embeddings, final
    LayerNorm, head and loss), from traces with one and two layers (the blocks are alike)."""
    from linear_gpt2.platform.device import platform

    if shape.context_parallel > 1 and cfg.spec.family == "softmax":
        # The ring's blocks keep each slice's output and log-sum-exp, as one device's fused
        # attention over the slice does (document resets included: their tiled blocks keep
        # the same); what the ring adds is priced in estimate().
        cfg = cfg.replace(doc_reset=False)
    one = _saved_bytes(cfg, 1, shape.batch, shape.positions, platform())
    two = _saved_bytes(cfg, 2, shape.batch, shape.positions, platform())
    layer = (two[0] - one[0], two[1] - one[1])
    return layer, (one[0] - layer[0], one[1] - layer[1])


def _params(cfg: ModelConfig, shape: StepShape) -> dict[str, int]:
    """Parameter counts: ``all``, ``blocks`` (under ``h``), ``positions`` (``wpe``), and
    ``bytes``: float32 bytes of one device's share (FSDP splits an array over every device
    where :func:`~linear_gpt2.training.sharding.fsdp_spec` does)."""
    from linear_gpt2.training.sharding import fsdp_spec

    out = {"all": 0, "blocks": 0, "positions": 0, "bytes": 0}
    for path, leaf in jax.tree_util.tree_leaves_with_path(_param_shapes(cfg)):
        n = math.prod(leaf.shape)
        split = shape.fsdp and fsdp_spec(tuple(leaf.shape), shape.devices) != P()
        out["bytes"] += 4 * n // (shape.devices if split else 1)
        out["all"] += n
        top = getattr(path[0], "key", None)
        out["blocks"] += n if top == "h" else 0
        out["positions"] += n if top == "wpe" else 0
    return out


def collective_bytes(cfg: ModelConfig, shape: StepShape) -> dict[str, float]:
    """What one device sends per step (a MODEL), by collective.

    - FSDP: every micro-step gathers the blocks' parameters in the compute dtype for each pass
      that multiplies by them (the forward, the backward and, under ``full`` / ``offload``, the
      recomputed forward) and the others once in float32, and reduce-scatters the float32
      gradients; the position table is split like the sequence under context parallelism, so
      each device reads its own rows (no traffic). Without FSDP: one all-reduce of the
      gradients per update.
    - Context parallelism, the attention's exchange per layer and pass: the linear family's
      slice totals (the state S, z, and with a gate its total log-gate, float32); ``flash``'s
      ring of K and V (``kernels.flash.ring.modelled_ring_bytes``); a recomputed forward
      (``dots``, ``full``, ``offload``) exchanges again.
    - Context parallelism with the plain head (``loss_chunk: 0``) and FSDP's vocabulary-split
      embedding: the compiled step moves activations between the vocabulary and the sequence
      splits in every layer, modelled as the float32 logits three times over (the
      results page sets this beside the collectives of a compiled step)."""
    p = _params(cfg, shape)
    n, cp = shape.devices, shape.context_parallel
    out: dict[str, float] = {}
    if n > 1:
        if shape.fsdp:
            passes = 3 if cfg.remat in ("full", "offload") else 2
            rest = p["all"] - p["blocks"] - (p["positions"] if cp > 1 else 0)
            itemsize = jnp.dtype(cfg.dtype).itemsize
            share = (n - 1) / n
            out["parameters all-gather"] = (
                shape.accum * share * (passes * itemsize * p["blocks"] + 4 * rest)
            )
            out["gradients reduce-scatter"] = shape.accum * share * 4 * (p["all"] - (
                p["positions"] if cp > 1 else 0))  # fmt: skip
        else:
            out["gradients all-reduce"] = 2 * (n - 1) / n * 4 * p["all"]
    if cp > 1:
        B, T, H, D = shape.batch, shape.context, cfg.n_head, cfg.head_dim
        recompute = cfg.remat in ("dots", "full", "offload")  # the attention's forward again
        if cfg.spec.family == "linear":
            state = (cp - 1) * 4 * B * H * (D * D + D + (1 if cfg.decay == "gate" else 0))
            per_layer = state * (3 if recompute else 2)
        else:
            from linear_gpt2.kernels.flash.ring import modelled_ring_bytes

            itemsize = jnp.dtype(cfg.dtype).itemsize
            ring = modelled_ring_bytes(B, T, H, D, cp, itemsize,
                                       cfg.attention_options.as_dict().get("ring", "zigzag"))  # fmt: skip
            per_layer = ring["forward"] * (2 if recompute else 1) + ring["backward"]
        out["attention over seq"] = cfg.n_layer * per_layer * shape.accum
        if cfg.loss_chunk == 0 and shape.fsdp:
            logits = 4 * B * shape.positions * cfg.vocab_size
            out["plain head's relayout"] = 3 * (cp - 1) / cp * logits * shape.accum
    return out


def _link_rate(group: int, shape: StepShape) -> float:
    return LINK_BYTES_PER_S if group <= shape.devices_per_host else NETWORK_BYTES_PER_S


def pallas_glue(cfg: ModelConfig) -> bool:
    """Whether a block's glue (LayerNorm, bias + GELU, bias adds) runs a Pallas kernel in the
    program traced in context: the model's own rules (``model/layers.py``)."""
    from linear_gpt2.model import layers

    return layers.fused_layer_norm(cfg) or layers.fused_mlp(cfg) or layers.fused_bias(cfg)


def _head_work(cfg: ModelConfig, tokens: int) -> tuple[int, bool]:
    """Bytes the head and loss hold at once beyond what is kept (see :func:`estimate`), and
    whether they are the whole sequence's float32 logits as one chunk."""
    from linear_gpt2.kernels import choice
    from linear_gpt2.model.gpt import loss_kernel_of

    impl = loss_kernel_of(cfg)
    if choice.is_fused_head(impl):  # kernels/head_loss: no logits written
        return 0, False
    if cfg.loss_chunk == 0 and not choice.is_pallas(impl):
        return tokens * cfg.vocab_size * jnp.dtype(cfg.dtype).itemsize, False
    chunk = min(tokens, int(cfg.loss_chunk) or tokens)
    return 4 * chunk * cfg.vocab_size, cfg.loss_chunk == 0


def estimate(cfg: ModelConfig, shape: StepShape) -> Estimate:
    """Memory per device and a modelled time of the training step for a resolved ``cfg``,
    from the configuration alone. Traces the model (at one and two layers, one device's
    shapes) for what autodiff keeps; compiles nothing. The kernels traced are those of the
    platform in context (``platform.device.platform``): compiling for a GPU target, trace
    inside that target's abstract mesh."""
    from linear_gpt2.training.sharding import fsdp_spec

    assert is_resolved(cfg), "estimate a resolved config (no auto left)"
    L, B, S, V, C = cfg.n_layer, shape.batch, shape.positions, cfg.vocab_size, cfg.n_embd
    p = _params(cfg, shape)
    params, n_params, n_blocks = p["bytes"], p["all"], p["blocks"]
    (layer_dev, layer_host), (rest_dev, rest_host) = _layer_and_rest(cfg, shape)
    plain_layer, _ = _layer_and_rest(cfg.replace(remat="none"), shape)
    tokens = B * S
    f32_stream = 4 * tokens * C  # one float32 [tokens, C] array: the residual stream's dtype
    # The backward's largest working set beyond what is kept: one block's recomputed
    # activations and the float32 cotangents of the residual stream entering and leaving it.
    # With XLA's glue (LayerNorm, bias + GELU, bias adds) XLA fuses the elementwise
    # intermediates into their consumers: under dots what the policy dropped is recomputed and
    # held; under full / offload it recomputes the whole block inside its backward and holds
    # about half of the block's residuals at once (RECOMPUTED_SHARE). With the Pallas glue
    # kernels nothing is fused into a kernel: each kernel's backward writes the cotangent of
    # every activation the block saved (the same size) and the LayerNorm kernel's float32
    # input gradient beside the stream's, whatever the remat policy.
    plain = plain_layer[0] + plain_layer[1]
    if cfg.remat in ("full", "offload"):
        block_work = RECOMPUTED_SHARE * (plain + 2 * f32_stream)
    else:
        block_work = plain - layer_dev + 2 * f32_stream
    if pallas_glue(cfg):
        block_work = max(block_work, plain + 3 * f32_stream)
    cp = shape.context_parallel
    if cp > 1 and cfg.spec.family != "softmax":
        # The model was traced at one device's shapes, where the attention runs its one-device
        # form; the slices' form keeps more per layer (the slice state's inputs), traced apart.
        # Kept only: the compiled steps' backward working sets show no more for it.
        from linear_gpt2.platform.device import platform

        layer_dev += _context_parallel_extra(cfg, B, S, cp, platform())
    # At the head: the plain head (XLA's loss, loss_chunk 0) keeps its float32 logits (among
    # the residuals) and its backward holds their gradient in the compute dtype; the chunked
    # loss computes its gradient in the forward, holding one chunk's float32 logits while
    # everything kept is alive, and with a Pallas loss kernel and no chunking the whole
    # sequence is that one chunk (model/gpt.py). Those whole-sequence logits, the program's
    # largest buffer, get a place of their own in the one-device step: the backward's
    # buffers are laid beside them, not in their space (the memory-usage reports of the
    # compiled plain-head steps), so that head's working set adds to the blocks' instead of
    # sharing it. With FSDP over several devices (context parallel or not) the compiled steps
    # lay the backward's buffers in the logits' space after all, as their lifetimes allow
    # (the loss's gradient is computed in the forward): there the two share it.
    head_work, whole_sequence = _head_work(cfg, tokens)
    whole_sequence = whole_sequence and not (shape.fsdp and shape.devices > 1)
    kept_dev = L * layer_dev + rest_dev
    if cp > 1 and cfg.spec.family == "softmax":
        # flash's ring: one layer's backward holds the K and V it receives from the other
        # slices again, and float32 dK, dV travel round it. Nothing received is kept from the
        # forward, whatever the remat policy: the compiled steps keep no layer's (the shipped
        # 2M-token config at remat none compiles to what this working set gives, not to every
        # layer's received K and V more).
        block_work += (cp - 1) * 2 * tokens * C * jnp.dtype(cfg.dtype).itemsize
        block_work += 2 * f32_stream
    parts = {
        "parameters and AdamW state": 3 * params,
        "gradients": params * (2 if shape.accum > 1 else 1),
        "activations kept": kept_dev,
        "backward working set": int(
            block_work + head_work if whole_sequence else max(block_work, head_work)
        ),
    }
    if shape.fsdp and fsdp_spec((V, C), shape.devices) != P():
        # FSDP splits the tied embedding, but the head multiplies by the whole table: the step
        # holds it gathered in float32, and its whole gradient before the reduce-scatter.
        parts["embedding gathered for FSDP"] = int(2 * 4 * V * C * (1 - 1 / shape.devices))
    memory = sum(parts.values())
    parts["activations on the host"] = L * layer_host + rest_host

    # The modelled time of one update: FLOPs (the forward, twice it backward, the recomputed
    # forward), HBM bytes (everything kept written once and read once, what is recomputed
    # again; the logits written, read by the loss and by its gradient; the chunked loss's
    # weight-gradient accumulation per chunk), host transfers and collectives.
    from linear_gpt2.model.flops import attention_forward_flops_per_token

    attn = L * attention_forward_flops_per_token(cfg, shape.context)
    per_token = (
        6 * (n_params - p["positions"]) + 3 * attn
    )  # a position is looked up, not multiplied
    if cfg.remat == "dots":
        per_token += attn
    elif cfg.remat in ("full", "offload"):
        per_token += 2 * n_blocks + attn
    kept = L * (layer_dev + layer_host) + rest_dev + rest_host
    recomputed = L * (plain_layer[0] + plain_layer[1] - layer_dev - layer_host)
    # The logits, plain or by chunks: written, read by the loss and by its gradient (the plain
    # head's kept logits are these, not counted twice).
    loss = 3 * 4 * tokens * V
    if cfg.loss_chunk == 0:
        kept -= 4 * tokens * V
    if cfg.loss_chunk:
        loss += math.ceil(tokens / cfg.loss_chunk) * 2 * 4 * V * C
    hbm = 2 * kept + 2 * recomputed + loss
    coll = collective_bytes(cfg, shape)
    times = {
        "compute": shape.accum * tokens * per_token / MATMUL_FLOPS_PER_S,
        "memory": shape.accum * hbm / HBM_BYTES_PER_S,
        "host": shape.accum * 2 * (L * layer_host + rest_host) / HOST_BYTES_PER_S,
    }
    for name, sent in coll.items():
        group = shape.devices if name.startswith(("parameters", "gradients")) else cp
        times[name] = sent / _link_rate(group, shape)
    return Estimate(int(memory), parts, sum(times.values()), times, coll, estimate_margin(cfg))


# --------------------------------------------------------------------------------------------
# The plan


@dataclasses.dataclass
class Plan:
    config: ModelConfig  # resolved: no auto left
    fits: bool
    budget: int | None  # bytes; None: the devices report no limit
    memory: MemoryReport | None = None  # of the chosen candidate, if it was compiled
    executable: Any = None  # its compiled step, if it was compiled
    tried: list[tuple[str, MemoryReport]] = dataclasses.field(default_factory=list)
    # Every candidate's estimate (label, Estimate), when the plan estimated; those whose
    # estimate was over the budget with the margin were not compiled.
    estimates: list[tuple[str, Estimate]] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        if self.budget is None:
            return f"{label(self.config)} (no device memory limit known: the plain setting)"
        steps = "; ".join(f"{name}: {m.total / GiB:.2f} GiB" for name, m in self.tried)
        verdict = "fits" if self.fits else "does NOT fit"
        out = f"{label(self.config)} {verdict} in {self.budget / GiB:.1f} GiB (compiled: {steps})"
        if self.estimates:
            compiled = {name for name, _ in self.tried}
            est = "; ".join(
                f"{name}: {e.memory / GiB:.1f} GiB, {e.seconds * 1e3:.0f} ms"
                + ("" if name in compiled else " (not compiled)")
                for name, e in self.estimates
            )
            out += f" (estimated, time MODELLED: {est})"
        return out


def plan(
    cfg: ModelConfig,
    compile_candidate: Callable[[ModelConfig], tuple[MemoryReport, Any]],
    budget: int | None,
    start: int = 0,
    estimate: Callable[[ModelConfig], Estimate] | None = None,
) -> Plan:
    """The setting of ``cfg``'s ``auto`` fields to run: of :func:`candidates`, the fastest whose
    compiled step fits ``budget`` bytes per device.

    ``compile_candidate(cfg) -> (MemoryReport, executable)`` compiles the step for a resolved
    config. With ``budget`` None nothing is compiled and the first candidate is returned. With
    ``estimate(cfg) -> Estimate`` (:func:`estimate` at the step's shape) the candidates whose
    estimated memory is within the budget and its margin (``Estimate.margin``) are compiled in order of
    modelled time until one fits; without it every candidate is compiled in ladder order.
    When none fits, the plan holds the most frugal one compiled (compiled if it was not),
    with ``fits=False``, for the caller's error message. ``start`` skips the first candidates
    (a sweep over growing contexts knows the smaller context's choice did not fit with
    less)."""
    cands = candidates(cfg)
    cands = cands[min(start, len(cands) - 1) :]
    if budget is None:
        return Plan(cands[0], True, None)
    estimates: dict[ModelConfig, Estimate] = {}
    order = cands
    if estimate is not None:
        estimates = {c: estimate(c) for c in cands}
        # Stable: equal modelled times keep the ladder's order.
        order = sorted((c for c in cands
                        if estimates[c].memory <= budget * (1 + estimates[c].margin)),
                       key=lambda c: estimates[c].seconds)  # fmt: skip
        if not order:  # nothing can fit: compile the most frugal, for the numbers
            order = [min(cands, key=lambda c: estimates[c].memory)]
    listed = [(label(c), estimates[c]) for c in cands] if estimates else []
    tried: list[tuple[str, MemoryReport]] = []
    compiled: dict[ModelConfig, tuple[MemoryReport, Any]] = {}
    for c in order:
        compiled[c] = compile_candidate(c)
        tried.append((label(c), compiled[c][0]))
        if compiled[c][0].total <= budget:
            return Plan(c, True, budget, *compiled[c], tried, listed)
    # None fits: the most frugal of those compiled (by compiled memory).
    c = min(compiled, key=lambda c: compiled[c][0].total)
    return Plan(c, False, budget, *compiled[c], tried, listed)


def device_budget(devices: list[Any] | None = None) -> int | None:
    """Bytes a step may use on each of ``devices`` (default: the local ones): the allocator's
    limit times :data:`DEVICE_BUDGET_FRACTION`; None where the backend reports none (CPU)."""
    devices = jax.local_devices() if devices is None else devices
    limits = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:
            return None
        if not stats or "bytes_limit" not in stats:
            return None
        limits.append(int(stats["bytes_limit"]))
    return int(min(limits) * DEVICE_BUDGET_FRACTION) if limits else None
