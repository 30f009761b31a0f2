"""Compiled memory of every attention formulation (``benchmarks/attention_memory.py``): the
table of docs/attention.md and ``attention_memory_cpu.md``.

Raw file: ``attention_memory_cpu.json`` (``meta``; ``rows``: per formulation its cost strings
and ``temp_bytes[T]`` forward and forward+backward).
"""

from __future__ import annotations

from typing import Any

from studies.common.core import Raw, renderer
from studies.common.fmt import how, provenance, short, table

MiB = 2**20


def _e(x: float, digits: int = 0) -> str:
    """``1.0e-7``, ``1e-5``: scientific notation without the exponent's leading zero."""
    mantissa, exp = f"{x:.{digits}e}".split("e")
    return f"{mantissa}e{int(exp)}"


def _rows(raw: Raw) -> list[dict[str, Any]]:
    return [r for r in raw.data["rows"] if "(" not in r["attention"]]


@renderer("attention_memory.table")
def memory_table(raw: Raw) -> str:
    """Cost per head, then compiled temp memory (MiB) per length, forward and forward+backward."""
    s, prov = raw.data["meta"]["settings"], provenance(raw.data)
    Ts = [str(t) for t in s["T"]]
    body = []
    for r in _rows(raw):
        sizes = r["temp_bytes"]
        cells = (
            [f"{sizes[t][k] / MiB:.1f}" for t in Ts for k in ("forward", "forward_backward")]
            if sizes
            else [r["note"]] * (2 * len(Ts))
        )
        body.append([f"`{r['attention']}`", r["flops_per_head"], r["memory_per_head"], *cells])
    head = ["formulation", "FLOPs per head", "memory per head"]
    head += [f"{p}, T={t}" for t in Ts for p in ("fwd", "fwd+bwd")]
    T0, B, H, D = s["T"][0], s["B"], s["H"], s["D"]
    return "\n".join([
        table(head, body, "lll" + "r" * 2 * len(Ts)),
        "",
        f"Temp memory in MiB (`memory_analysis().temp_size_in_bytes`: scratch beyond arguments "
        f"and outputs), {how(prov).lower()} on {s['backend']}, jax {prov['jax']}, commit "
        f"{short(prov['commit'])}, {s['dtype']}, B={B}, H={H}, D={D}, c={s['chunk_size']}, "
        f"LT_state_parallel scan={s['scan']}. At T={T0} one [B, T, H, D] array is "
        f"{B * T0 * H * D * 4 / MiB:.1f} MiB, a T x T score matrix for all heads "
        f"{B * H * T0 * T0 * 4 / MiB:.1f} MiB and T D^2 floats for all heads "
        f"{B * T0 * H * D * D * 4 / MiB:.1f} MiB.",
    ])  # fmt: skip


@renderer("attention_memory.page")
def memory_page(raw: Raw) -> str:
    return "# Compiled memory of every attention formulation\n\n" + memory_table(raw)


@renderer("attention_memory.state_parallel")
def state_parallel(raw: Raw, *, attention: str = "LT_state_parallel") -> str:
    """The memory of ``attention`` (a variant that holds every state) against T D^2, its growth
    with T, and its rows with other options (``<attention> (<option>)``)."""
    s = raw.data["meta"]["settings"]
    T0, T1 = (str(t) for t in s["T"][:2])
    B, H, D = s["B"], s["H"], s["D"]
    td2 = B * int(T0) * H * D * D * 4
    rows = {r["attention"]: r for r in raw.data["rows"]}
    sp = rows[attention]["temp_bytes"]
    lines = [
        f"`{attention}` holds {sp[T0]['forward'] / td2:.1f} x the T D^2 floats of all heads "
        f"at T={T0} ({sp[T0]['forward'] / MiB:.1f} MiB), forward and forward+backward alike, and "
        f"grows {sp[T1]['forward'] / sp[T0]['forward']:.2f}x from T={T0} to T={T1}."
    ]
    for name, r in rows.items():
        if name.startswith(f"{attention} ("):
            t = r["temp_bytes"][T0]
            lines.append(
                f"With {name[len(attention) + 1 :].strip('()')}: "
                f"{t['forward'] / MiB:.0f} MiB forward and {t['forward_backward'] / MiB:.0f} MiB "
                f"forward+backward at T={T0}."
            )
    return " ".join(lines)


@renderer("attention_accuracy.table")
def accuracy_table(raw: Raw) -> str:
    """Worst relative error over the feature maps per formulation, float32 and bfloat16."""
    s, prov = raw.data["meta"]["settings"], provenance(raw.data)
    body = [
        [f"`{r['attention']}`", _e(r["float32_output"], 1), _e(r["float32_grads"], 1),
         _e(r["bfloat16_output"], 1)]
        for r in raw.data["rows"]
    ]  # fmt: skip
    tol = s["tolerances"]
    B, T, H, D = s["float32_shape"]
    return "\n".join([
        table(["variant", "float32 output", "float32 grads (max of q, k, v)", "bfloat16 output"],
              body, "lrrr"),
        "",
        f"{how(prov)} on {prov['device']}, jax {prov['jax']}, commit {short(prov['commit'])} "
        f"(`benchmarks/attention_accuracy.py`): relative errors ||out - ref|| / ||ref||, worst "
        f"over the feature maps {', '.join(s['feature_maps'])}, at B={B}, T={T}, H={H}, D={D}; "
        f"the bfloat16 column at T={s['bfloat16_shape'][1]} against the reference on the "
        f"bfloat16-rounded inputs. Tested tolerances: {_e(tol['float32_output'])} (float32 "
        f"output), {_e(tol['float32_grads'])} (float32 gradients), "
        f"**{_e(tol['bfloat16_output'])} (bfloat16 output)**.",
    ])  # fmt: skip


@renderer("attention_accuracy.page")
def accuracy_page(raw: Raw) -> str:
    return "# Accuracy of the linear formulations against a float64 reference\n\n" + (
        accuracy_table(raw)
    )


@renderer("attention.options")
def options_table() -> str:
    """Each built-in variant's own options, from its options class (no raw file: the code is
    the source; ``scripts/train.py --help`` prints the same). Imports the variants, so JAX."""
    from linear_gpt2.attention import registry, schema

    def cell(r: dict[str, Any]) -> str:
        values = ", ".join(f"`{c}`" for c in r["choices"]) if r["choices"] else r["type"]
        return f"`{r['option']}`{'*' if r['implementation'] else ''} = `{r['default']}` ({values})"

    rows = []
    for name in registry.BUILTIN:
        own = [r for r in schema.describe(name) if not r["layer"]]
        rows.append((f"`{name}`", "; ".join(cell(r) for r in own) or "none"))
    layer = "; ".join(cell(r) for r in schema.describe("softmax") if r["layer"])
    return (
        table(
            ["name", "its options (`*`: only selects the implementation; a resume may change it)"],
            rows,
        )  # fmt: skip
        + f"\n\nEvery variant also has the layer's options {layer}: refused at config load by a "
        "variant whose spec takes no document resets (decay gates)."
    )
