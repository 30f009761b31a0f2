"""The index of ``benchmarks/results/``: every raw file with where it came from.

Sources: each raw file that carries a ``meta`` (a JSON, or the ``.meta.json`` beside a CSV or
JSONL). Files of the same stem (the CSV of a JSON, the PNG of a plot) share its row.
"""

from __future__ import annotations

from studies.common.core import Raw, renderer
from studies.common.fmt import provenance, short, table


def stem(path: str) -> str:
    """``a.meta.json`` and ``a.json`` -> ``a``: the files of one result share it."""
    name = path.rsplit("/", 1)[-1]
    return name.removesuffix(".meta.json").rsplit(".", 1)[0]


@renderer("results.index")
def index(*raws: Raw) -> str:
    """One row per raw file: how it was obtained, on what, at which commit and jax version."""
    body = []
    for raw in raws:
        prov = provenance(raw.data)
        meta = raw.data.get("meta", {})
        extra = meta.get("raw")
        name = f"`{raw.path}`" + (f" (of `{extra}`)" if extra else "")
        body.append([
            name, prov["how"] or "not recorded", prov["device"] or "not recorded",
            short(prov["commit"]), prov["jax"] or ("n/a" if prov["device"] else "not recorded"),
            prov["time"][:10] if prov["time"] else "not recorded",
            "yes" if meta.get("backfilled") else "",
        ])  # fmt: skip
    return table(
        [
            "raw file",
            "how",
            "device",
            "commit",
            "jax",
            "date",
            "fields added later (`meta.backfilled`)",
        ],
        body,
    )
