"""``chunk_size: auto``: pick the chunk (block) size by measuring, once per shape and device.

:func:`best_chunk_size` times forward+backward of the attention for a few candidate chunk sizes
(powers of two from 16 to 256; for ``LT_chunked`` only those dividing T) at the given shape,
dtype and kernel on the default device, and caches the winner in a JSON file keyed by device
kind, jax version, variant, kernel, shape, dtype, feature map and candidates. Later calls (other
processes included) read the cache. ``LT_chunked`` and ``LT_attention_parallel`` call it when
their ``fn`` is traced with ``chunk_size="auto"``: shapes are concrete at trace time, and the
measurement runs eagerly (``jax.ensure_compile_time_eval``) inside the outer trace.

Cost control: each candidate is compiled once, run ``warmup`` times, then timed ``runs`` times
(median, ``block_until_ready``). Off a GPU the fused kernels run in Pallas interpret mode, whose
timings say nothing about the GPU, so there the choice is the heuristic (64, or the candidate
nearest to it) without measuring and without caching; so is it when compiling for a GPU
target that this machine does not have (``linear_gpt2.platform.target``).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from linear_gpt2 import kernels
from linear_gpt2.attention import registry
from linear_gpt2.platform import device

DEFAULT_CANDIDATES = (16, 32, 64, 128, 256)
PREFERRED = 64  # the heuristic choice (the post's chunk size for LT_chunked at D = 64)

# (path, key) -> chunk size: avoids re-reading the file at every trace in one process.
_MEMO: dict[tuple[str, str], int] = {}


def cache_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """``<cache_dir>/chunk_sizes.json``; by default ``$XDG_CACHE_HOME/linear_gpt2`` (falling back
    to ``~/.cache/linear_gpt2``)."""
    if cache_dir is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        cache_dir = os.path.join(base, "linear_gpt2")
    return Path(cache_dir) / "chunk_sizes.json"


def default_candidates(name: str, T: int) -> list[int]:
    """Powers of two in [16, 256]: for ``LT_chunked`` those dividing T (it needs c | T); for the
    blocked ``LT_attention_parallel`` (which pads T) those up to the power of two >= T."""
    if name == "LT_chunked":
        return [c for c in DEFAULT_CANDIDATES if T % c == 0]
    cap = 1 << max(0, (T - 1).bit_length())
    return [c for c in DEFAULT_CANDIDATES if c <= max(cap, DEFAULT_CANDIDATES[0])]


def _fallback(name: str, T: int) -> int:
    """The chunk size when no candidate fits: for LT_chunked the largest divisor of T <= 64
    (T itself if T <= 256: one chunk, plain attention), else 64."""
    if name == "LT_chunked":
        if T <= 256:
            return T
        return max(d for d in range(1, PREFERRED + 1) if T % d == 0)
    return PREFERRED


def _heuristic(candidates: list[int]) -> int:
    return min(candidates, key=lambda c: (abs(c.bit_length() - PREFERRED.bit_length()), -c))


def cache_key(name, shape, dtype, kernel, feature_map, candidates) -> str:
    device = jax.devices()[0]
    return json.dumps(
        [
            device.device_kind,
            jax.__version__,
            name,
            kernel,
            [int(s) for s in shape],
            jnp.dtype(dtype).name,
            feature_map,
            [int(c) for c in candidates],
        ]
    )


def _read(path: Path) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        warnings.warn(f"chunk-size cache {path} unreadable ({e}); measuring again", stacklevel=3)
        return {}


def _write(path: Path, key: str, entry: dict[str, Any]) -> None:
    # Read-merge-replace: concurrent processes may each add their own keys; os.replace keeps the
    # file whole (the last writer of a key wins, and any winner is a valid measurement).
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _read(path)
    data[key] = entry
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".chunk_sizes.", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def time_chunk_size(name, shape, dtype, kernel, chunk_size, *, feature_map, eps, warmup, runs):
    """Median seconds of one forward+backward of attention ``name`` at ``shape`` (``[B, T, H,
    D]``), or None if it does not fit in memory."""
    s = registry.spec(name)
    fn = s.build(s.options(feature_map=feature_map, chunk_size=chunk_size, kernel=kernel, eps=eps))

    def step(q, k, v, dy):
        y, vjp = jax.vjp(fn, q, k, v)
        return y, vjp(dy)

    # Compiled ahead of time, outside ensure_compile_time_eval, and called as an executable:
    # under that context a jitted function is evaluated op by op and a Pallas kernel traced with
    # the eval trace, which it cannot be on a GPU ("Evaluation rule for 'program_id' not
    # implemented"). Lowering is a fresh trace, so this also works inside a caller's jit trace.
    x = jax.ShapeDtypeStruct(shape, dtype)
    try:
        compiled = jax.jit(step).lower(x, x, x, x).compile()
    except Exception as e:  # noqa: BLE001 - only out-of-memory is expected and skipped
        if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
            return None
        raise
    with jax.ensure_compile_time_eval():  # run eagerly, also when called inside a jit trace
        keys = jax.random.split(jax.random.key(0), 4)
        q, k, v, dy = (jax.random.normal(kk, shape, dtype) for kk in keys)
        step = compiled
        try:
            for _ in range(warmup):
                jax.block_until_ready(step(q, k, v, dy))
            times = []
            for _ in range(runs):
                t0 = time.perf_counter()
                jax.block_until_ready(step(q, k, v, dy))
                times.append(time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - only out-of-memory is expected and skipped
            if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
                return None
            raise
    return statistics.median(times)


def best_chunk_size(
    name: str,
    shape: tuple[int, int, int, int],
    dtype: Any,
    kernel: str,
    feature_map: str = "softplus",
    candidates: list[int] | tuple[int, ...] | None = None,
    cache_dir: str | os.PathLike | None = None,
    *,
    eps: float = 1e-6,
    warmup: int = 1,
    runs: int = 3,
    measure: bool | None = None,
) -> int:
    """The fastest chunk size for attention ``name`` at ``shape`` = ``(B, T, H, D)``.

    ``kernel`` is the implementation (``xla``, ``pallas``, ``triton``; ``auto`` is resolved as the
    variant resolves it). ``candidates`` defaults to :func:`default_candidates`. ``measure``:
    None measures unless the kernel would run in Pallas interpret mode (off a GPU), where the
    heuristic choice is returned uncached; True/False force it. Measured winners are cached in
    :func:`cache_path` (``cache_dir``) and reused.
    """
    if kernel == "auto":
        kernel = "pallas" if kernels.on_gpu() else "xla"
    T = int(shape[1])
    cands = sorted({int(c) for c in (candidates or default_candidates(name, T))})
    if name == "LT_chunked":
        cands = [c for c in cands if T % c == 0]
    if kernel != "xla":
        # The fused kernels compile for the H100 at every power of two >= 16 with D <= 128
        # (tests/test_target.py): other candidates are excluded, a D over the limit is an error.
        kernels.check_head_dim(int(shape[-1]), f"{name} kernel={kernel}")
        cands = [c for c in cands if kernels.block_size_problem(c) is None]
    if not cands:
        if kernel != "xla":
            raise ValueError(
                f"{name} kernel={kernel}: no chunk size among {candidates or DEFAULT_CANDIDATES} "
                f"is a power of two >= 16 {'dividing' if name == 'LT_chunked' else 'for'} T={T}; "
                f"use kernel=xla or another context length"
            )
        return _fallback(name, T)
    if len(cands) == 1:
        return cands[0]
    if measure is None:
        # Timing needs the device itself: compiling for a GPU target here measures nothing.
        measure = device.gpu_present() or (kernel == "xla" and not kernels.on_gpu())
    if not measure:
        return _heuristic(cands)

    path = cache_path(cache_dir)
    key = cache_key(name, shape, dtype, kernel, feature_map, cands)
    if (str(path), key) in _MEMO:
        return _MEMO[(str(path), key)]
    entry = _read(path).get(key)
    if isinstance(entry, dict) and entry.get("chunk_size") in cands:
        _MEMO[(str(path), key)] = int(entry["chunk_size"])
        return _MEMO[(str(path), key)]

    times = {
        c: time_chunk_size(
            name,
            shape,
            dtype,
            kernel,
            c,
            feature_map=feature_map,
            eps=eps,
            warmup=warmup,
            runs=runs,
        )  # fmt: skip
        for c in cands
    }
    fits = {c: t for c, t in times.items() if t is not None}
    if not fits:
        raise MemoryError(f"{name}: no chunk size among {cands} fits in memory at {shape}")
    best = min(fits, key=fits.get)
    _write(
        path,
        key,
        {
            "chunk_size": best,
            "seconds": {str(c): t for c, t in times.items()},
            "runs": runs,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
    )
    _MEMO[(str(path), key)] = best
    return best
