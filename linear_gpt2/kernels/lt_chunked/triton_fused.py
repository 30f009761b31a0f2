"""``LT_chunked`` as hand-written Triton kernels called through ``jax_triton.triton_call``.

The single-pass design of :mod:`linear_gpt2.kernels.lt_chunked.fused_chunk` as it was first
written (one [c, c] tile per chunk, one backward kernel with both loops): grid (B, H), a
sequential loop over chunks carrying the float32 state S [D, D], z [D]; backward recomputes the states in a forward
loop (dphi(Q)) and carries their cotangents in a reverse loop (dphi(K), dV). Written in Triton
directly so that a GPU benchmark can tell whether Pallas' lowering leaves speed on the table;
it is kept only if it is competitive.

GPU only: needs ``jax-triton`` and ``triton`` (``pip install .[triton]``) and a CUDA backend.
Nothing here can run on CPU: the GPU tests (``@pytest.mark.gpu`` in tests/test_kernels.py)
check it against the Pallas kernel and the XLA oracle, and :func:`compile_ptx` compiles it for
the H100 on any machine with Triton (a CPU test reads the dots' precision in its PTX).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_gpt2 import kernels
from linear_gpt2.platform import device

F32 = jnp.float32

# Optional dependencies: importing this module never fails, calling it explains. Triton alone
# (torch brings it) defines the kernels, so they compile for the H100 here (compile_ptx).
_IMPORT_ERROR: Exception | None = None
try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - depends on the installation
    triton = tl = None
    _IMPORT_ERROR = e
try:
    import jax_triton as jt
except ImportError as e:  # pragma: no cover - depends on the installation
    jt = None
    _IMPORT_ERROR = _IMPORT_ERROR or e


def _triton_mismatch() -> str | None:
    """Why the installed jax-triton cannot drive the installed Triton, or None.

    jax-triton imports with a stubbed NVIDIA backend when Triton is older than it needs and
    fails only at lowering with an AttributeError; its own requirement says why up front.
    """
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        have = metadata.version("triton")
        jt_version = metadata.version("jax-triton")
        needs = [Requirement(r) for r in metadata.requires("jax-triton") or []]
    except metadata.PackageNotFoundError:
        return None
    for req in needs:
        if req.name == "triton" and req.marker is None and have not in req.specifier:
            return (
                f"kernel=triton: jax-triton {jt_version} needs triton{req.specifier} but triton "
                f"{have} is installed; pin the jax-triton release made for triton {have} "
                f"(see pyproject's `triton` extra) or use kernel=pallas|xla"
            )
    return None


def unavailable_reason() -> str | None:
    """Why ``kernel=triton`` cannot run here, or None if it can."""
    if _IMPORT_ERROR is not None:
        return (
            f"kernel=triton needs jax-triton and triton ({_IMPORT_ERROR}); install them with "
            f"`pip install .[triton]` on a machine with a CUDA GPU, or use kernel=pallas|xla"
        )
    if (mismatch := _triton_mismatch()) is not None:
        return mismatch
    if not device.gpu_present():
        return (
            f"kernel=triton needs a CUDA GPU (Triton kernels cannot run on the "
            f"{jax.default_backend()!r} backend); use kernel=pallas (interpret mode off-GPU) "
            f"or kernel=xla"
        )
    return None


def check_available() -> None:
    reason = unavailable_reason()
    if reason:
        raise kernels.KernelUnavailableError(reason)


if triton is not None:  # defined with Triton alone: compile_ptx compiles them here

    @triton.jit
    def _fwd_kernel(FQ, FK, V, Y, DEN, T: tl.constexpr, H: tl.constexpr, EPS: tl.constexpr,
                    C: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
        # Layout [B, T, H, D], contiguous: row t of head h of batch b starts at
        # ((b T + t) H + h) D. DEN is [B, H, T].
        b, h = tl.program_id(0), tl.program_id(1)
        rows, cols = tl.arange(0, C), tl.arange(0, D)
        base = b * T * H * D + h * D
        causal = rows[:, None] >= rows[None, :]
        S = tl.zeros((D, D), dtype=tl.float32)
        z = tl.zeros((D,), dtype=tl.float32)
        for n in range(0, T // C):
            off = base + (n * C + rows)[:, None] * (H * D) + cols[None, :]
            fq, fk, v = tl.load(FQ + off), tl.load(FK + off), tl.load(V + off)
            A = tl.where(causal, tl.dot(fq, tl.trans(fk), input_precision=PREC), 0.0)
            num = tl.dot(fq.to(tl.float32), S, input_precision=PREC) + tl.dot(
                A.to(v.dtype), v, input_precision=PREC
            )
            den = tl.sum(fq.to(tl.float32) * z[None, :], axis=1) + tl.sum(A, axis=1)
            d = den + EPS
            r = tl.where(d > 0, 1.0 / tl.where(d > 0, d, 1.0), 0.0)
            tl.store(Y + off, (num * r[:, None]).to(Y.dtype.element_ty))
            tl.store(DEN + (b * H + h) * T + n * C + rows, den)
            S += tl.dot(tl.trans(fk), v, input_precision=PREC)
            z += tl.sum(fk.to(tl.float32), axis=0)

    @triton.jit
    def _bwd_kernel(FQ, FK, V, Y, DY, DEN, DQ, DK, DV, T: tl.constexpr, H: tl.constexpr,
                    EPS: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
                    PREC: tl.constexpr):  # fmt: skip
        b, h = tl.program_id(0), tl.program_id(1)
        rows, cols = tl.arange(0, C), tl.arange(0, D)
        base = b * T * H * D + h * D
        den_base = (b * H + h) * T
        causal = rows[:, None] >= rows[None, :]
        N = T // C

        # Loop 1, forward: dphi(Q) = g S^T - delta z^T + dA phi(K), recomputing S, z.
        S = tl.zeros((D, D), dtype=tl.float32)
        z = tl.zeros((D,), dtype=tl.float32)
        for n in range(0, N):
            off = base + (n * C + rows)[:, None] * (H * D) + cols[None, :]
            fk = tl.load(FK + off)
            v = tl.load(V + off)
            d = tl.load(DEN + den_base + n * C + rows) + EPS
            r = tl.where(d > 0, 1.0 / tl.where(d > 0, d, 1.0), 0.0)
            g = tl.load(DY + off).to(tl.float32) * r[:, None]
            delta = tl.sum(g * tl.load(Y + off).to(tl.float32), axis=1)
            fk32, v32 = fk.to(tl.float32), v.to(tl.float32)
            dA = tl.where(
                causal, tl.dot(g, tl.trans(v32), input_precision=PREC) - delta[:, None], 0.0
            )
            dq = (
                tl.dot(g, tl.trans(S), input_precision=PREC)
                - delta[:, None] * z[None, :]
                + tl.dot(dA, fk32, input_precision=PREC)
            )
            tl.store(DQ + off, dq.to(DQ.dtype.element_ty))
            S += tl.dot(tl.trans(fk), v, input_precision=PREC)
            z += tl.sum(fk32, axis=0)

        # Loop 2, reverse: dV, dphi(K), carrying dS, dz (cotangent of the state after chunk n).
        dS = tl.zeros((D, D), dtype=tl.float32)
        dz = tl.zeros((D,), dtype=tl.float32)
        for i in range(0, N):
            n = N - 1 - i
            off = base + (n * C + rows)[:, None] * (H * D) + cols[None, :]
            fq, fk, v = tl.load(FQ + off), tl.load(FK + off), tl.load(V + off)
            d = tl.load(DEN + den_base + n * C + rows) + EPS
            r = tl.where(d > 0, 1.0 / tl.where(d > 0, d, 1.0), 0.0)
            g = tl.load(DY + off).to(tl.float32) * r[:, None]
            delta = tl.sum(g * tl.load(Y + off).to(tl.float32), axis=1)
            fq32, fk32, v32 = fq.to(tl.float32), fk.to(tl.float32), v.to(tl.float32)
            A = tl.where(causal, tl.dot(fq, tl.trans(fk), input_precision=PREC), 0.0)
            dA = tl.where(
                causal, tl.dot(g, tl.trans(v32), input_precision=PREC) - delta[:, None], 0.0
            )
            dv = tl.dot(tl.trans(A), g, input_precision=PREC) + tl.dot(
                fk32, dS, input_precision=PREC
            )
            dk = (
                tl.dot(tl.trans(dA), fq32, input_precision=PREC)
                + tl.dot(v32, tl.trans(dS), input_precision=PREC)
                + dz[None, :]
            )
            tl.store(DV + off, dv.to(DV.dtype.element_ty))
            tl.store(DK + off, dk.to(DK.dtype.element_ty))
            dS += tl.dot(tl.trans(fq32), g, input_precision=PREC)
            dz -= tl.sum(fq32 * delta[:, None], axis=0)


def _precision(dtype) -> str:
    """``tl.dot``'s input precision for the kernels' float32 dots: Triton's default is TF32,
    which rounded the float32 kernel's outputs past its oracle's tolerance on an H200
    (benchmarks/results/gpu_tests_h200_measured.json); IEEE for float32 inputs, as Pallas'
    lowering gives its twin kernels. With bfloat16 inputs the float32 state's dots stay TF32:
    its 10-bit significand is finer than the inputs' 7, and IEEE float32 has no tensor cores."""
    return "ieee" if jnp.dtype(dtype) == jnp.float32 else "tf32"


def _meta(fq, c: int, eps: float) -> dict:
    B, T, H, Dp = fq.shape
    return dict(
        grid=(B, H),
        num_warps=kernels.num_warps(Dp),
        num_stages=2,
        T=T,
        H=H,
        EPS=float(eps),
        C=c,
        D=Dp,
        PREC=_precision(fq.dtype),
    )


def _forward(fq, fk, v, c: int, eps: float):
    B, T, H, Dp = fq.shape
    return jt.triton_call(
        fq,
        fk,
        v,
        kernel=_fwd_kernel,
        out_shape=[
            jax.ShapeDtypeStruct(fq.shape, v.dtype),
            jax.ShapeDtypeStruct((B, H, T), F32),
        ],
        **_meta(fq, c, eps),
    )


def _backward(fq, fk, v, y, dy, den, c: int, eps: float):
    return jt.triton_call(
        fq,
        fk,
        v,
        y,
        dy,
        den,
        kernel=_bwd_kernel,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (fq, fk, v)],
        **_meta(fq, c, eps),
    )


def compile_ptx(dtype, *, T: int, H: int, D: int, c: int, eps: float = 1e-6,
                capability: int = 90) -> dict[str, str]:  # fmt: skip
    """Each kernel's PTX, compiled by Triton for ``sm_<capability>`` on any machine (no GPU
    needed): ``{"_fwd_kernel": ptx, "_bwd_kernel": ptx}`` for inputs of ``dtype`` at the
    launch :func:`chunked_attention` would use (``D`` the padded head width)."""
    if triton is None:
        raise kernels.KernelUnavailableError(f"compile_ptx needs triton ({_IMPORT_ERROR})")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptr = {jnp.dtype(jnp.float32): "*fp32", jnp.dtype(jnp.bfloat16): "*bf16"}[jnp.dtype(dtype)]
    consts = dict(T=T, H=H, EPS=float(eps), C=c, D=D, PREC=_precision(dtype))
    out = {}
    for fn in (_fwd_kernel, _bwd_kernel):
        # DEN, the forward's saved denominators, is float32 whatever the inputs are.
        sig = {a: "constexpr" if a in consts else "*fp32" if a == "DEN" else ptr
               for a in fn.arg_names}  # fmt: skip
        src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v
                                             for k, v in consts.items()})  # fmt: skip
        opts = {"num_warps": kernels.num_warps(D), "num_stages": 2}
        out[fn.__name__] = triton.compile(src, target=GPUTarget("cuda", capability, 32),
                                          options=opts).asm["ptx"]  # fmt: skip
    return out


_fused = kernels.fused_linear_attention(_forward, _backward, "LT_chunked kernel=triton")


def chunked_attention(fq: jax.Array, fk: jax.Array, v: jax.Array, c: int, eps: float):
    """Normalised causal linear attention by chunks of ``c`` (Triton). Same contract as
    :func:`linear_gpt2.kernels.lt_chunked.ops.chunked_attention`; GPU and jax-triton only.
    The kernels compute offsets from the contiguous ``[B, T, H, Dp]`` layout."""
    check_available()
    return _fused(fq, fk, v, c, eps)
