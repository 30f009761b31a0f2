"""Every reported number, rendered from its raw file: the generated blocks of ``README.md``,
``docs/*.md`` and ``benchmarks/results/*.md``.

``python scripts/render_reports.py`` (``make reports``) re-renders them in place; ``--check``
compares without writing and lists each block that differs. A block names its renderer and its
raw files in its marker (:mod:`.core`); the renderers live here, one module per family of
results, and import no JAX. Writers (``scripts/``, ``benchmarks/``) write raw files, then call
:func:`page` to render their page.
"""

from linear_gpt2.experiments.reports import (  # noqa: F401  (each module registers its renderers)
    attention,
    context_parallel,
    cpu,
    feature_maps,
    gpu_check,
    index,
    learning,
    memory,
    mqar,
    plan,
    roofline,
    step_glue,
    step_model,
    step_time,
)
from linear_gpt2.experiments.reports.core import (
    RENDERERS,
    ReportError,
    block,
    check,
    documents,
    page,
    render_text,
    renderer,
    write,
)

__all__ = [
    "RENDERERS",
    "ReportError",
    "block",
    "check",
    "documents",
    "page",
    "render_text",
    "renderer",
    "write",
]
