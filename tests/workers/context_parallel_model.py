"""The model's loss and gradients with the sequence split over a ``data x seq`` mesh, against
the same model on one device; prints one JSON line per (variant, forgetting, mesh).

usage: python tests/workers/context_parallel_model.py VARIANT   (the caller sets the host
device count, 16 for data=2 x seq=8)
       python tests/workers/context_parallel_model.py VARIANT --data-only
           (data=2 x seq=1 with the mesh in context, as on GPUs: the attention inside
           ``over_batch``'s shard_map over ``data``; resets and the gate where taken)

Documents (``doc_reset``), at T = 32: row 0 has starts at 5 (inside the first slice at every
N), 16 (on the slice boundary for N = 2, 4, 8) and 22; row 1 at 8 (on a boundary for N = 4, 8)
and 13 (scaled with T). Every other document spans at least one slice boundary.
"""

import json
import sys

# name -> (attention, options, T): the Pallas kernels take chunks of 16 or more, so their
# sequence is 4x longer (a slice of 16 at seq = 8) and the document starts scale with it.
VARIANTS = {
    "LT_chunked-xla": ("LT_chunked", {"chunk_size": 2, "kernel": "xla"}, 32),
    "LT_chunked-pallas": ("LT_chunked", {"chunk_size": 16, "kernel": "pallas_chunk"}, 128),
    # The loss by chunks of 4 tokens too (model.loss_chunk: per device under context parallelism)
    "LT_state_parallel": ("LT_state_parallel", {"loss_chunk": 4}, 32),
    "flash-xla": ("flash", {"kernel": "xla"}, 32),
    # Keys wider than the values (issue 39): Based's Taylor map of a 5-dim projection, 21
    # features in 2 blocks of the 16-wide value heads through the kernels' initial state. The
    # head and the loss by the fused kernel pair that never writes the logits (issue 37), each
    # device walking its own rows, its weight's gradient summed over the mesh.
    "LT_chunked-pallas-taylor2": (
        "LT_chunked",
        {
            "chunk_size": 16,
            "kernel": "pallas_chunk",
            "feature_map": "taylor2",
            "feature_dim": 5,
            "loss_kernel": "pallas_fused",
        },
        128,
    ),
}
# Variants that run only the plain case and the one with both resets and the gate, on two
# meshes (8 slices; 4 slices of 2 data groups): the expanded keys add no path of their own
# across slices, only wider states.
BOTH_ONLY = {"LT_chunked-pallas-taylor2": [(1, 8), (2, 4)]}
MESHES = [(1, 2), (2, 2), (1, 4), (2, 4), (1, 8), (2, 8)]  # (data, seq)
B = 2


# Every sequence split and both data sizes in three meshes: the variants whose own code across
# slices is the local kernel (the state exchange is LT_chunked-xla's, which runs all six).
EVERY_SEQ = [(2, 2), (1, 4), (2, 8)]
ALL_MESHES = {"LT_chunked-xla"}


def plan(forgets: list[tuple[bool, str]], meshes=MESHES):
    """Which meshes each forgetting runs on: the last (resets and the gate together, every path
    across slices at once) on ``meshes``, the others on the widest (data 2 x seq 8). Every mesh
    and every forgetting is covered at a fraction of the compiles of the full product, which
    made this worker the suite's second slowest test."""
    return [(f, meshes if i == len(forgets) - 1 else [(2, 8)]) for i, f in enumerate(forgets)]


def main() -> None:
    from linear_gpt2.platform import process

    process.configure()  # several host devices: XLA:CPU's collectives in order
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from linear_gpt2 import attention
    from linear_gpt2.model import init_params, loss_fn
    from linear_gpt2.model.config import ModelConfig
    from linear_gpt2.training.sharding import make_mesh, traced_on

    jax.config.update("jax_default_matmul_precision", "highest")
    name, options, T = VARIANTS[sys.argv[1]]
    s = T // 32
    spec = attention.registry.spec(name)
    forgets = [(False, "none"), (True, "none")]
    if spec.decay:
        forgets += [(False, "gate"), (True, "gate")]
    runs = plan(forgets, MESHES if sys.argv[1] in ALL_MESHES else EVERY_SEQ)
    if sys.argv[1] in BOTH_ONLY:
        runs = [(f, BOTH_ONLY[sys.argv[1]]) for f in [(False, "none"), (True, "gate")]]
    data_only = "--data-only" in sys.argv
    if data_only:
        runs = [(forgets[-1], [(2, 1)])]

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 97, size=(B, T + 1))
    inputs, targets = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])
    starts = np.zeros((B, T), bool)
    starts[0, [0, 5 * s, 16 * s, 22 * s]] = True
    starts[1, [0, 8 * s, 13 * s]] = True
    segments = jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

    for (doc_reset, decay), meshes in runs:
        cfg = ModelConfig(
            vocab_size=97, block_size=T, n_layer=1, n_head=2, n_embd=16, dtype="float32",
            attention=name, doc_reset=doc_reset, decay=decay, **options,
        )  # fmt: skip
        params = init_params(cfg, 0)
        seg = segments if doc_reset else None

        def loss(params, x, y, seg, cfg=cfg):
            return loss_fn(params, x, y, cfg, segment_ids=seg)

        grad = jax.value_and_grad(loss)
        l0, g0 = jax.jit(grad)(params, inputs, targets, seg)
        for data, seq in meshes:
            mesh = make_mesh(jax.devices()[: data * seq], context_parallel=seq)
            split = NamedSharding(mesh, P("data") if data_only else P("data", "seq"))
            rep = NamedSharding(mesh, P())
            traced = traced_on(mesh, grad)
            if data_only:  # the mesh in context as the trainer sets it on GPUs (traced_on)

                def traced(*args, mesh=mesh, grad=grad):
                    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                        return grad(*args)

            step = jax.jit(traced, in_shardings=(rep, split, split, split if doc_reset else None))
            l1, g1 = step(params, inputs, targets, seg)
            hlo = step.lower(params, inputs, targets, seg).as_text()
            crossing = sum(hlo.count(op) for op in ("all_gather", "collective_permute"))
            manual = hlo.count("shard_map") + hlo.count("manual_computation")
            g_err = max(
                rel(a, b) for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True)
            )
            print(json.dumps({
                "variant": sys.argv[1], "doc_reset": doc_reset, "decay": decay, "data": data,
                "seq": seq, "loss": abs(float(l1) - float(l0)) / abs(float(l0)), "grads": g_err,
                "loss_value": float(l0), "seq_collectives": crossing, "manual": manual,
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
