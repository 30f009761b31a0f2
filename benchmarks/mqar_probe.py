#!/usr/bin/env python
"""Where a trained MQAR model's attention looks: the two heads recall needs, measured.

Recall in two attention-only layers takes a previous-token head in layer 1 (each value position
copies its key) and a matching head in layer 2 (the query, a key, finds the value position that
copied it). For a run of ``configs/mqar/base.yaml`` (softmax, no biases, no MLP, no short
convolution), on held-out examples, this prints:

- layer 1 at the value positions: attention mass on the previous token (the value's own key), on
  the other keys, on values, on itself;
- layer 2 at the queries: mass on the right value, on all values, on the keys, on the query
  region (the queries and the zeros after the pairs), and the mean attention logit of each kind
  of position (values, keys, zeros at even and odd positions, earlier queries) less the row's
  largest logit;
- the held-out accuracy of the same examples.

The examples are the run's task (its ``data.mqar`` settings), or with ``--zero-fill`` the same
with zeros between the queries, as Zoology's figure 2 has them.

A run that learned recall puts most of layer 2's mass on the right value. The forward pass is
the plain-JAX model of ``benchmarks/mqar_reference.py`` on the run's parameters (tests check its
logits against ``linear_gpt2.model.forward``), because the library's attention does not return
its weights::

    python benchmarks/mqar_probe.py RUN [RUN ...] [--examples 32] [--out benchmarks/results/mqar_probe_cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mqar_reference import layer_norm  # noqa: E402

from linear_gpt2.training.data.mqar import example  # noqa: E402


def reference_params(params: dict, model_cfg=None) -> dict:
    """The library's GPT parameters (layers stacked on axis 0) in the reference's layout. With
    ``model_cfg`` a linear run of Based's recipe is read too (issue 39): one head, its short
    convolution (``conv{i}``), q and k of ``feature_dim`` and the feature map's kernel."""
    h = params["h"]
    linear = model_cfg is not None and model_cfg.spec.family == "linear"
    conv = "conv" in h["attn"]  # the short convolution lives in the attention layer
    if "bias" in h["attn"]["c_attn"] or "mlp" in h or "ln_2" in h or (conv and not linear):
        raise ValueError(
            "the probe reads attention-only models without biases, ln_2 or short convolution "
            "(configs/mqar/base.yaml), or a linear run of Based's recipe "
            "(configs/sweeps/mqar_rebased_based.yaml); this run has more"
        )
    p = {
        "wte": np.asarray(params["wte"]["embedding"]),
        "wpe": np.asarray(params["wpe"]["embedding"]),
        "lnf": np.asarray(params["ln_f"]["scale"]),
    }
    if linear:
        if model_cfg.n_head != 1 or model_cfg.decay != "none" or model_cfg.qk_layer_norm:
            raise ValueError("the probe reads one-head linear runs without gates or ln_q, ln_k")
        p["kernel"], p["eps"] = model_cfg.feature_map, model_cfg.eps
        p["qk_dim"] = model_cfg.qk_dim
    for i in range(h["ln_1"]["scale"].shape[0]):
        p[f"ln{i}"] = np.asarray(h["ln_1"]["scale"][i])
        p[f"qkv{i}"] = np.asarray(h["attn"]["c_attn"]["kernel"][i])
        p[f"o{i}"] = np.asarray(h["attn"]["c_proj"]["kernel"][i])
        if conv:
            c = h["attn"]["conv"]
            p[f"conv{i}"] = (np.asarray(c["kernel"][i]), np.asarray(c["bias"][i]))
    return p


def _conv(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The short causal convolution (``model.layers.ShortConv``): b + sum_i w_i x_{t-i}."""
    y = b + w[0] * x
    for i in range(1, len(w)):
        y[i:] = y[i:] + w[i] * x[:-i]
    return y


def _kernel(name: str, s: np.ndarray, d: int) -> np.ndarray:
    """phi(q) . phi(k) of the feature map ``name`` from s = q . k (``feature_maps``)."""
    if name == "taylor2":
        return 1.0 + s / np.sqrt(d) + s * s / (2.0 * d)
    if name == "power2":
        return s * s
    raise ValueError(f"the probe knows softmax and the taylor2 / power2 kernels, not {name!r}")


def attention(p: dict, tokens: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """tokens int ``[T]`` -> (attention weights ``[T, T]`` per layer, their logits ``[T, T]``
    (masked entries -inf; for a linear run the log of the kernel), output logits
    ``[T, vocab]``)."""
    T = len(tokens)
    x = p["wte"][tokens].astype(np.float64) + p["wpe"][:T]
    causal = np.tril(np.ones((T, T), bool))
    maps, scores, layer = [], [], 0
    while f"qkv{layer}" in p:
        h = np.asarray(layer_norm(x, p[f"ln{layer}"]))
        if f"conv{layer}" in p:
            h = _conv(h, *p[f"conv{layer}"])
        if "kernel" in p:  # linear: the kernel of q . k, normalised by its sum
            dk = p["qk_dim"]
            qkv = h @ p[f"qkv{layer}"]
            q, k, v = qkv[:, :dk], qkv[:, dk : 2 * dk], qkv[:, 2 * dk :]
            K = np.where(causal, _kernel(p["kernel"], q @ k.T, dk), 0.0)
            a = K / (K.sum(-1, keepdims=True) + p["eps"])
            s = np.where(causal, np.log(np.maximum(K, 1e-30)), -np.inf)
        else:
            q, k, v = np.split(h @ p[f"qkv{layer}"], 3, -1)
            s = np.where(causal, q @ k.T / np.sqrt(q.shape[-1]), -np.inf)
            a = np.exp(s - s.max(-1, keepdims=True))
            a /= a.sum(-1, keepdims=True)
        maps.append(a)
        scores.append(s)
        x = x + a @ v @ p[f"o{layer}"]
        layer += 1
    return maps, scores, np.asarray(layer_norm(x, p["lnf"])) @ p["wte"].T


def probe(p: dict, L: int, N: int, examples: int = 32, vocab_size: int = 8192, **task) -> dict:
    """The statistics of the module docstring, averaged over the first ``examples`` held-out
    examples of MQAR (L, N); ``task``: more arguments of ``linear_gpt2.training.data.mqar.example``
    (``power_a``, ``random_non_queries``)."""
    sums: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        if np.isfinite(value):
            sums.setdefault(name, []).append(float(value))

    for i in range(examples):
        x, y = example(
            i, length=L, num_kv_pairs=N, vocab_size=vocab_size, split="validation", **task
        )
        maps, scores, logits = attention(p, x)
        first, last, s = maps[0], maps[-1], scores[-1]
        for j in range(1, 2 * N, 2):  # value positions
            add("layer1_value_on_its_key", first[j, j - 1])
            add("layer1_value_on_other_keys", first[j, 0 : j - 1 : 2].sum())
            add("layer1_value_on_values", first[j, 1:j:2].sum())
            add("layer1_value_on_itself", first[j, j])
        where = {int(x[2 * j]): 2 * j + 1 for j in range(N)}
        for t in np.flatnonzero(y >= 0):
            right = where[int(x[t])]
            add("layer2_query_on_right_value", last[t, right])
            add("layer2_query_on_values", last[t, 1 : 2 * N : 2].sum())
            add("layer2_query_on_keys", last[t, 0 : 2 * N : 2].sum())
            add("layer2_query_on_query_region", last[t, 2 * N : t + 1].sum())
            add("layer2_query_on_itself", last[t, t])
            js = np.arange(t)
            zero = x[js] == 0
            kinds = {
                "values": js[(js < 2 * N) & (js % 2 == 1)],
                "keys": js[(js < 2 * N) & (js % 2 == 0)],
                "zeros_even": js[zero & (js % 2 == 0) & (js >= 2 * N)],
                "zeros_odd": js[zero & (js % 2 == 1) & (js >= 2 * N)],
                "earlier_queries": js[~zero & (js >= 2 * N)],
            }
            for kind, cols in kinds.items():
                if len(cols):
                    add(f"layer2_logit_{kind}", s[t, cols].mean() - s[t, : t + 1].max())
            add("accuracy", float(logits[t].argmax() == y[t]))
    # layer 1, layer 2's mass, layer 2's logits, accuracy (first-seen order within each)
    keys = sorted(sums, key=lambda k: (k == "accuracy", "logit" in k, k.startswith("layer2")))
    return {k: float(np.mean(sums[k])) for k in keys}


def markdown(results: list[dict]) -> str:
    """One column per probed run, one row per statistic."""
    from studies.mqar.report import probe_table

    return probe_table(results) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run (or checkpoint) directories of MQAR runs")
    ap.add_argument("--examples", type=int, default=32, help="held-out examples (default 32)")
    ap.add_argument("--out", default=None, help="also write OUT.json and OUT.md")
    ap.add_argument(
        "--zero-fill", action="store_true", help="probe on zero-filled examples (Zoology fig. 2)"
    )
    a = ap.parse_args(argv)
    from linear_gpt2.training import trained

    results = []
    for run in a.runs:
        params, model_cfg, cfg, step = trained.load(run)
        if cfg.data.source != "mqar" or model_cfg.spec.family not in ("softmax", "linear"):
            print(
                f"error: {run} is not an MQAR run of softmax or linear attention; probe a run "
                "of configs/mqar/base.yaml",
                file=sys.stderr,
            )
            return 2
        m = cfg.data.mqar
        fill = dict(power_a=m.power_a, random_non_queries=m.random_non_queries)
        if a.zero_fill:
            fill["random_non_queries"] = False
        stats = probe(
            reference_params(params, model_cfg),
            cfg.data.context,
            m.num_kv_pairs,
            a.examples,
            m.vocab_size,
            **fill,
        )
        label = f"{Path(run).name} (L={cfg.data.context}, N={m.num_kv_pairs}, step {step}"
        label += ", random fill)" if fill["random_non_queries"] else ")"
        results.append({"run": str(run), "label": label, "step": step, **stats})
    print(markdown(results))
    if a.out:
        from linear_gpt2.platform import provenance
        from studies import common as reports

        meta = {
            "how": "measured",
            "environment": provenance.environment(),
            "settings": {"examples": a.examples, "zero_fill": a.zero_fill, "runs": a.runs},
        }
        path = Path(a.out).with_suffix(".json")
        path.write_text(json.dumps({"meta": meta, "rows": results}, indent=1) + "\n")
        template = "\n".join(
            [reports.block("mqar.probe", path.name), reports.block("mqar.probe_summary", path.name)]
        )
        reports.page(path.with_suffix(".md"), template)
    return 0


if __name__ == "__main__":
    from linear_gpt2.platform import process

    process.configure()  # the settings JAX reads as it starts (platform/process.py)
    raise SystemExit(main())
