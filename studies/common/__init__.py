"""Every reported number, rendered from its raw file: the generated blocks of ``README.md``,
``docs/*.md`` and ``benchmarks/results/*.md``.

``python scripts/render_reports.py`` (``make reports``) re-renders them in place; ``--check``
compares without writing and lists each block that differs. A block names its renderer and its
raw files in its marker (:mod:`.core`); the renderers live with their study, in
``studies/<study>/report.py`` (found by :func:`load_renderers`), those of the results index
here (:mod:`.index`), and import no JAX. Writers (``scripts/``, ``benchmarks/``) write raw files, then call
:func:`page` to render their page.
"""

from studies.common import index  # noqa: F401  (registers the results index)
from studies.common.core import (
    RENDERERS,
    ReportError,
    block,
    check,
    documents,
    load_renderers,
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
    "load_renderers",
    "page",
    "render_text",
    "renderer",
    "write",
]
