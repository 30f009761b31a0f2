"""The model with issue 37's glue kernels (LayerNorm, MLP activation, cross-entropy: Pallas, in
interpret mode on CPU) on ``data x seq`` meshes against one device; prints one JSON line per
mesh: the relative error of the loss and of the gradients, and how many all-gathers of at least
a sequence's activations the compiled program has, with the kernels and with XLA's glue (the
kernels run per device on their own rows: they add none).

usage: python tests/workers/glue_kernels_mesh.py   (the caller sets 4 host devices)
"""

import json
import re

MESHES = [(2, 1), (2, 2)]  # (data, seq)


def main() -> None:
    from linear_gpt2.platform import process

    process.configure()  # several host devices: XLA:CPU's collectives in order
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from linear_gpt2.model import init_params, loss_fn
    from linear_gpt2.model.config import ModelConfig
    from linear_gpt2.training.sharding import make_mesh

    def traced_on(mesh, fn):
        # The trainer puts the mesh in context for GPU meshes (training/sharding.py); on CPU
        # devices it does so only with a seq axis: here always, as on GPUs.
        def traced(*args):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return fn(*args)

        return traced

    jax.config.update("jax_default_matmul_precision", "highest")
    B, T = 2, 16
    xla = ModelConfig(
        vocab_size=97, block_size=T, n_layer=1, n_head=2, n_embd=16, dtype="float32",
        attention="LT_chunked", chunk_size=2, kernel="xla", loss_chunk=8,
    )  # fmt: skip
    cfg = xla.replace(
        layernorm_kernel="pallas", mlp_kernel="pallas", loss_kernel="pallas", bias_kernel="pallas"
    )
    params = init_params(cfg, 0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 97, size=(B, T + 1))
    x, y = jax.numpy.asarray(tokens[:, :-1]), jax.numpy.asarray(tokens[:, 1:])
    grad = jax.value_and_grad(lambda p, x, y: loss_fn(p, x, y, cfg))
    grad_xla = jax.value_and_grad(lambda p, x, y: loss_fn(p, x, y, xla))
    l0, g0 = jax.jit(grad)(params, x, y)

    def gathers(fn, mesh, shardings) -> int:
        text = jax.jit(traced_on(mesh, fn), in_shardings=shardings).lower(params, x, y)
        text = text.compile().as_text()
        sizes = [
            int(np.prod([int(d) for d in m.split(",") if d]))
            for m in re.findall(r"= \w+\[([\d,]*)\][^=]*? all-gather(?:-start)?\(", text)
        ]
        return sum(s >= T * xla.n_embd for s in sizes)

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

    for data, seq in MESHES:
        mesh = make_mesh(jax.devices()[: data * seq], context_parallel=seq)
        split = NamedSharding(mesh, P("data", "seq") if seq > 1 else P("data"))
        rep = NamedSharding(mesh, P())
        step = jax.jit(traced_on(mesh, grad), in_shardings=(rep, split, split))
        l1, g1 = step(params, x, y)
        grads = max(rel(a, b) for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)))
        shardings = (rep, split, split)
        print(json.dumps({"data": data, "seq": seq, "loss": rel(l1, l0), "grads": grads,
                          "gathers": gathers(grad, mesh, shardings),
                          "gathers_xla": gathers(grad_xla, mesh, shardings)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
