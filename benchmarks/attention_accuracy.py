"""Accuracy of every linear formulation against the float64 reference of the formula.

    python benchmarks/attention_accuracy.py --out benchmarks/results/attention_accuracy_cpu

The reference, the inputs and the options are the test suite's (``tests/test_attention_linear.py``,
which asserts the tolerances); this measures the errors themselves, worst over the four feature
maps: float32 output and gradients (the largest of dq, dk, dv) at the test's odd shape, and the
bfloat16 output against the reference on the same rounded inputs. Relative errors
``||out - ref|| / ||ref||``. Writes ``OUT.json`` and renders ``OUT.md`` from it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from linear_gpt2 import attention  # noqa: E402
from tests import test_attention_linear as t  # noqa: E402  (the reference the tests assert on)
from tests.helpers import rel_err  # noqa: E402


def float32_errors(name: str, feature_map: str) -> tuple[float, float]:
    shape = (t.B, t.T, t.H, t.D)
    q, k, v, dy = t.inputs(shape, 0)
    y, grads = t.run(name, q, k, v, dy, feature_map=feature_map, **t.ODD_T_OPTIONS.get(name, {}))
    ref = t.reference(*(x.astype(np.float64) for x in (q, k, v)), feature_map)
    ref_grads = t.reference_vjp(q, k, v, dy, feature_map)
    return rel_err(y, ref), max(rel_err(g, r) for g, r in zip(grads, ref_grads))


def bfloat16_error(name: str, feature_map: str) -> float:
    q, k, v, _ = t.inputs((t.B, 32, t.H, t.D), seed=3)
    qb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    opts = t.BF16_OPTIONS.get(name, {})
    fn = attention.get(name, feature_map=feature_map, eps=t.EPS, **opts)
    y = jax.jit(fn)(qb, kb, vb)
    rounded = (np.asarray(x.astype(jnp.float32), np.float64) for x in (qb, kb, vb))
    return rel_err(y.astype(jnp.float32), t.reference(*rounded, feature_map))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="write OUT.json and render OUT.md")
    a = p.parse_args(argv)
    from linear_gpt2.platform import provenance
    from studies import common as reports

    rows = []
    with jax.default_matmul_precision("highest"):
        for name in t.LINEAR:
            f32 = [float32_errors(name, fm) for fm in t.FEATURE_MAPS]
            bf16 = [bfloat16_error(name, fm) for fm in t.FEATURE_MAPS]
            rows.append({
                "attention": name,
                "float32_output": max(e for e, _ in f32),
                "float32_grads": max(g for _, g in f32),
                "bfloat16_output": max(bf16),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    result = {
        "meta": {
            "how": "measured",
            "environment": provenance.environment(),
            "settings": {
                "float32_shape": [t.B, t.T, t.H, t.D], "bfloat16_shape": [t.B, 32, t.H, t.D],
                "feature_maps": list(t.FEATURE_MAPS), "eps": t.EPS,
                "options_float32": t.ODD_T_OPTIONS, "options_bfloat16": t.BF16_OPTIONS,
                "tolerances": {"float32_output": t.F32_TOL, "float32_grads": t.GRAD_TOL,
                               "bfloat16_output": t.BF16_TOL},
                "matmul_precision": "highest",
            },
        },
        "rows": rows,
    }  # fmt: skip
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        path = a.out.with_suffix(".json")
        path.write_text(json.dumps(result, indent=1) + "\n")
        reports.page(a.out.with_suffix(".md"), reports.block("attention_accuracy.page", path.name))
    return 0


if __name__ == "__main__":
    from linear_gpt2.platform import process

    process.configure()  # the settings JAX reads as it starts (platform/process.py)
    raise SystemExit(main())
