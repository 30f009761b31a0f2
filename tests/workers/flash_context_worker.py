"""Worker for tests/test_flash_context.py: ``flash`` (kernel=xla) under context parallelism on 8
CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, set by the test) against the
same attention on one device: loss, output and gradients, float32 at matmul precision highest,
for every (data, seq) mesh (with documents; without them at seq = 8), document layout and ring
(balanced and contiguous), with whole and tiled XLA blocks; and which
positions each device holds in the balanced layout. Prints one JSON object: case -> errors."""

import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from linear_gpt2 import attention
from linear_gpt2.attention.context import over_sequence, sequence_shards
from linear_gpt2.kernels.flash import ring as flash_context
from linear_gpt2.platform import process

jax.config.update("jax_default_matmul_precision", "highest")

B, T, H, D = 2, 64, 2, 8
MESHES = [(1, 2), (2, 2), (1, 4), (2, 4), (1, 8)]
# The tiled block's compiles are the worker's costliest (each ring step holds its loops): the
# shortest ring with data=2 and the longest. seq=4 runs the same ring code as seq=8 (several
# steps, every slice pairing of the balanced layout); the XLA block still covers it.
TILED_MESHES = [(2, 2), (1, 8)]


def meshes(block: str, layout: str) -> list[tuple[int, int]]:
    """(data, seq) meshes per block and document layout: with documents (every mask path across
    slices) on all of the block's meshes, without on one: the widest (seq = 8) for the XLA
    block, the cheapest to compile (data=2, seq=2) for the tiled one, whose ring code is the
    XLA block's. Every mesh and layout is covered at about half the compiles of the product."""
    if layout == "resets":
        return MESHES if block == "xla" else TILED_MESHES
    return [(1, 8)] if block == "xla" else [(2, 2)]


def tiled(ring: str):
    """flash under context parallelism with the tiled XLA block, in tiles of at most 3 (which
    divide no slice here but the halves of 2): the one-device function is flash's own."""
    one = attention.get("flash", kernel="xla")

    def fn(q, k, v, resets=None):
        n = sequence_shards()
        if n == 1:
            return one(q, k, v, resets=resets)
        local = flash_context.ring_local(flash_context.tiled_block(3), n, ring)
        return over_sequence(local, q, k, v, resets)

    return fn


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def resets_cases() -> dict:
    none = None
    r = np.zeros((B, T), bool)
    # Row 0: documents spanning the boundaries at 32 (seq=2) and 48 (seq=4, 8), one starting
    # exactly on 16 (a boundary for seq=4 and 8) and one starting at 5 inside the first slice.
    r[0, [5, 16, 33]] = True
    # Row 1: one document ending just before the middle boundary and one starting on it (32), a
    # one-token document at 31; then a start on every seq=8 boundary after it.
    r[1, [31, 32, 40, 56]] = True
    return {"plain": none, "resets": jnp.asarray(r)}


def zigzag_layout(n: int) -> list[list[int]]:
    """The positions device r holds after to_zigzag, and whether from_zigzag restores the
    sequence: [[positions of device 0], ...] (or None when the round trip fails)."""
    x = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :, None, None], (1, T, 1, 1))
    devs = np.array(jax.devices()[:n]).reshape(1, n)

    def both(x, *_):  # the layout and its round trip in one program (one compile per n)
        zz = flash_context.to_zigzag(x, n)
        return jnp.concatenate([zz, flash_context.from_zigzag(zz, n)], axis=-1)

    with jax.set_mesh(Mesh(devs, ("data", "seq"))):
        zz_back = np.asarray(jax.jit(lambda x: over_sequence(both, x, x, x))(x))
    held = zz_back[0, :, 0, 0].reshape(n, T // n)
    ok = bool((zz_back[..., 1:] == np.asarray(x)).all())
    return held.tolist() if ok else None


def stacked_masks() -> int:
    """Masks kept for every tile at once: pred arrays of rank 6 ([tiles, tiles, B, H, t, t]) in
    the compiled gradient of two layers (a scan) of the tiled ring with documents."""
    resets = resets_cases()["resets"]
    fn = tiled("zigzag")
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)

    def loss(x):
        def layer(x, _):
            return fn(x, x, x, resets=resets) + x, None

        return jnp.sum(jax.lax.scan(layer, x, None, length=2)[0] ** 2)

    devs = np.array(jax.devices()[:2]).reshape(1, 2)
    with jax.set_mesh(Mesh(devs, ("data", "seq"))):
        hlo = jax.jit(jax.grad(loss)).lower(x).compile().as_text()
    return len(re.findall(r"pred\[\d+,\d+,\d+,\d+,\d+,\d+\]", hlo))


def main() -> None:
    process.configure()  # several host devices: XLA:CPU's collectives in order
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32) for _ in range(3))
    w = jnp.asarray(rng.uniform(0.5, 1.5, size=(B, T, H, D)), jnp.float32)
    out = {f"layout seq={n}": zigzag_layout(n) for n in (2, 4, 8)}
    out["stacked masks"] = stacked_masks()
    one = attention.get("flash", kernel="xla")

    def value_and_grad(fn, kw):
        def loss(q, k, v):
            y = fn(q, k, v, **kw)
            return jnp.sum(w * y * y), y

        return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)

    # The one-device function is the same for every ring and block: one reference per layout.
    refs = {
        name: jax.jit(value_and_grad(one, {} if r is None else {"resets": r}))(q, k, v)
        for name, r in resets_cases().items()
    }
    cases = [(r, "xla", *c) for r in flash_context.RINGS for c in resets_cases().items()]
    cases += [(r, "tiled", *c) for r in flash_context.RINGS for c in resets_cases().items()]
    for ring, block, name, resets in cases:
        fn = attention.get("flash", kernel="xla", ring=ring)
        if block == "tiled":
            fn = tiled(ring)
        grad = value_and_grad(fn, {} if resets is None else {"resets": resets})
        (l0, y0), g0 = refs[name]
        for data, seq in meshes(block, name):
            devs = np.array(jax.devices()[: data * seq]).reshape(data, seq)
            with jax.set_mesh(Mesh(devs, ("data", "seq"))):
                (l1, y1), g1 = jax.jit(grad)(q, k, v)
            out[f"{ring} {block} {name} data={data} seq={seq}"] = {
                "loss": abs(float(l1) - float(l0)) / abs(float(l0)),
                "y": rel(y1, y0),
                "grads": max(rel(a, b) for a, b in zip(g1, g0)),
                "finite": bool(all(np.isfinite(np.asarray(x)).all() for x in (y1, *g1))),
            }
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
