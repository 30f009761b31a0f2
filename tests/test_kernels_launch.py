"""The glue kernels' launches (``kernels/launch.py``): every candidate a GPU will time computes
what the default computes and what the oracle computes (interpret mode, odd shapes: rows that
are not a multiple of any tile, walking programs that run past the last tile), bad overrides are
refused in one line, and every candidate compiles for the H100 without register spills."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_gpt2.kernels import launch
from linear_gpt2.kernels.bias_add import fused as add_fused
from linear_gpt2.kernels.bias_add import naive as add_naive
from linear_gpt2.kernels.bias_gelu import fused as gelu_fused
from linear_gpt2.kernels.bias_gelu import naive as gelu_naive
from linear_gpt2.kernels.cross_entropy import fused as ce_fused
from linear_gpt2.kernels.cross_entropy import naive as ce_naive
from linear_gpt2.kernels.layernorm import fused as ln_fused
from linear_gpt2.kernels.layernorm import naive as ln_naive
from linear_gpt2.platform import target
from tests.helpers import SLOW, rel_err

F32_TOL = 1e-5

pytestmark = pytest.mark.usefixtures("full_precision_matmuls")


def _inputs(name: str, rng, N: int):
    """A kernel's inputs at N rows (odd widths: C = 72, F = 200, V = 333) and its call:
    (kernel(*args) under the launch in context, oracle(*args))."""
    n = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    if name == "layernorm_fwd":
        args = (n(N, 72), n(N, 72), 1.0 + 0.2 * n(72), n(72))
        return args, (lambda *a: ln_fused.layernorm_fwd(*a, 1e-5, jnp.float32),
                      lambda *a: ln_naive.forward(*a, 1e-5, jnp.float32))  # fmt: skip
    if name == "layernorm_bwd":
        s, scale, dy, ds = n(N, 72), 1.0 + 0.2 * n(72), n(N, 72), n(N, 72)
        _, _, mean, rstd = ln_naive.forward(s, None, scale, None)
        args = (s, mean, rstd, scale, dy, ds)

        def kernel(*a):
            dx, _, dscale, dbias = ln_fused.layernorm_bwd(*a, jnp.float32, None)
            return dx, dscale, dbias

        return args, (kernel, ln_naive.backward)
    if name == "bias_gelu_fwd":
        return (n(N, 200), n(200)), (gelu_fused.bias_gelu_fwd, gelu_naive.forward)
    if name == "bias_gelu_bwd":
        args = (n(N, 200), n(200), n(N, 200))

        return args, (gelu_fused.bias_gelu_bwd, gelu_naive.backward)
    if name == "bias_add_bwd":
        args = (n(N, 72), n(N, 72), n(N, 72))

        def oracle(*c):  # it takes [B, T, C] rows
            dz, db = add_naive.backward([x[None] for x in c], jnp.float32)
            return dz[0], db

        return args, (lambda *c: add_fused.bias_add_bwd(list(c), jnp.float32), oracle)
    assert name == "cross_entropy"
    t = jnp.asarray(rng.integers(-1, 333, N), jnp.int32)
    args = (n(N, 333), t, jnp.float32(N))
    return args, (ce_fused.cross_entropy, ce_naive.nll_and_grad)


def test_the_candidates_are_the_defaults_first_and_every_kernel_has_some():
    assert set(launch.CANDIDATES) == set(launch.DEFAULTS)
    for name, cands in launch.CANDIDATES.items():
        assert cands[0] == launch.DEFAULTS[name] and len(set(cands)) == len(cands) > 1, name
        with launch.override({name: cands[1]}):
            assert launch.of(name) == cands[1]
        assert launch.of(name) == launch.DEFAULTS[name]


def _check(name: str, N: int, runs) -> None:
    args, (kernel, oracle) = _inputs(name, np.random.default_rng(7), N)
    want = jax.tree.leaves(oracle(*args))
    for run in runs:
        with launch.override({name: run}):
            got = jax.tree.leaves(jax.jit(kernel)(*args))
        assert len(got) == len(want), (name, run)
        for a, b in zip(got, want):
            assert a.shape == b.shape and rel_err(a, b) < F32_TOL, (name, run)


@pytest.mark.parametrize("name", sorted(launch.DEFAULTS))
def test_every_candidate_launch_computes_what_the_oracle_computes(name):
    """Each candidate as a GPU runs it at 37 rows (no tile divides it); then, for the kernels
    whose programs walk row tiles, one row per tile over 300 rows: 132 programs walk 3 tiles
    each, the last ones past the end."""
    _check(name, 37, launch.CANDIDATES[name])
    if launch.DEFAULTS[name].programs_per_sm is not None:
        _check(name, 300, [launch.Launch(4, tile=16, programs_per_sm=1)])


def test_a_bad_override_is_one_line_and_changes_nothing():
    before = {k: launch.of(k) for k in launch.DEFAULTS}
    bad = [({"layernorm": launch.Launch(8)}, "no glue kernel named layernorm"),
           ({"layernorm_bwd": launch.Launch(3, programs_per_sm=4)}, "warps a power of two"),
           ({"layernorm_bwd": launch.Launch(8)}, "walk row tiles: give programs_per_sm"),
           ({"cross_entropy": launch.Launch(8, programs_per_sm=2)}, "each take one tile: drop")]  # fmt: skip
    for launches, msg in bad:
        with pytest.raises(ValueError, match=msg) as e:
            with launch.override(launches):
                pass
        assert "\n" not in str(e.value)
    assert {k: launch.of(k) for k in launch.DEFAULTS} == before


@SLOW
def test_every_candidate_compiles_for_the_h100_without_spills():
    """Each candidate of each kernel, traced under its launch into one program (one compile),
    at the 124M step's widths: C = 768, F = 3072, V = 50304."""
    rep = target.replicated("h100")
    N = 16384  # enough row tiles that every candidate's programs differ (no two kernels alike)
    shapes = {"layernorm_fwd": ((N, 768), (N, 768), (768,), (768,)),
              "layernorm_bwd": ((N, 768), (N,), (N,), (768,), (N, 768), (N, 768)),
              "bias_gelu_fwd": ((N, 3072), (3072,)),
              "bias_gelu_bwd": ((N, 3072), (3072,), (N, 3072)),
              "bias_add_bwd": ((N, 768),) * 3,
              "cross_entropy": ((256, 50304), (256,), ())}  # fmt: skip
    calls = {name: _inputs(name, np.random.default_rng(0), 4)[1][0] for name in shapes}

    def program(*flat):
        out, i = [], 0
        for name, shp in shapes.items():
            args = flat[i : i + len(shp)]
            i += len(shp)
            for cand in launch.CANDIDATES[name]:
                with launch.override({name: cand}):
                    out.append(calls[name](*args))
        return out

    def S(name, k, shp):
        dt = jnp.int32 if (name, k) == ("cross_entropy", 1) else jnp.float32
        dt = jnp.bfloat16 if name.startswith("bias_gelu") and len(shp) == 2 else dt
        return jax.ShapeDtypeStruct(shp, dt, sharding=rep)

    args = [S(n, k, s) for n, shp in shapes.items() for k, s in enumerate(shp)]
    r = target.compile_program(jax.jit(program), args, "h100", kernels=True, fail_on_spill=True)
    counts: dict[str, int] = {}
    for k in r.kernels:
        base = k.name.split("__")[0]
        counts[base] = counts.get(base, 0) + 1
    assert counts == {n: len(c) for n, c in launch.CANDIDATES.items()}, counts
