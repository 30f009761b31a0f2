"""Generated blocks in markdown: find them, render them from their raw files, compare or write.

A block is two marker lines in a markdown file and the text between them::

    <!-- generated: NAME [key=value ...] RAW [RAW ...] -->
    ...text rendered by the renderer NAME from the raw files RAW...
    <!-- end generated -->

RAW are paths relative to the markdown file's folder (JSON, JSONL or CSV); ``key=value`` are
options passed to the renderer as strings. A renderer is a function registered with
:func:`renderer`, called as ``fn(*raws, **options) -> str`` with one :class:`Raw` per path. The
markers are HTML comments, so the rendered page shows only the text between them. Text outside
the blocks is written by hand and is left as it is.

Nothing here imports JAX: rendering every report takes a fraction of a second, but for the
option table of docs/attention.md, which asks the variants' specs (``attention.options``).
"""

from __future__ import annotations

import csv
import dataclasses
import importlib
import json
import pkgutil
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from linear_gpt2.platform.errors import RunError, UsageError

BEGIN = re.compile(r"^<!-- generated: (?P<spec>.+?) -->$")
END = "<!-- end generated -->"

# The documents whose blocks are rendered, relative to the repository root.
DOCUMENTS = ("README.md", "docs/*.md", "benchmarks/results/*.md")


class ReportError(UsageError):
    """A generated block that cannot be rendered: unknown renderer, missing raw file, bad
    markers. The message names the file, the line and the fix."""


class RawFileError(RunError):
    """A raw file that exists but cannot be read as its suffix says."""


@dataclasses.dataclass(frozen=True)
class Raw:
    """One raw file of a block: ``path`` as written in the marker, ``data`` its parsed content
    (JSON: the object; JSONL: a list of objects; CSV: a list of dicts with numbers parsed)."""

    path: str
    data: Any


@dataclasses.dataclass(frozen=True)
class Block:
    """One generated block of a document: its marker's line (1-based), the renderer's name,
    its raw files and options, and the current text between the markers."""

    line: int
    name: str
    sources: tuple[str, ...]
    options: tuple[tuple[str, str], ...]
    text: str
    start: int  # index of the marker line
    end: int  # index of the end marker line

    @property
    def label(self) -> str:
        """The block's name, options and raw files (the first two, then how many more)."""
        more = len(self.sources) - 2
        files = [*self.sources[:2], *([f"(+{more} more)"] if more > 0 else [])]
        return " ".join([self.name, *(f"{k}={v}" for k, v in self.options), *files])


RENDERERS: dict[str, Callable[..., str]] = {}


def renderer(name: str) -> Callable[[Callable[..., str]], Callable[..., str]]:
    """Register ``fn(*raws, **options) -> markdown`` as the renderer of blocks named ``name``."""

    def register(fn: Callable[..., str]) -> Callable[..., str]:
        if name in RENDERERS:
            raise ValueError(f"two renderers named {name!r}")
        RENDERERS[name] = fn
        return fn

    return register


# The studies' folders: each registers its renderers in ``report.py`` (and ``report_*.py``).
STUDIES = Path(__file__).resolve().parents[1]


def load_renderers() -> dict[str, Callable[..., str]]:
    """Import every study's report modules (``studies/*/report*.py``), so that each registers
    its renderers, and return the registry. Found by name, not imported here: this package
    imports no study (the import contracts in pyproject.toml), and a new study's renderers are
    found without editing a list."""
    root = __name__.split(".")[0]
    for study in pkgutil.iter_modules([str(STUDIES)]):
        if not study.ispkg or study.name == "common":
            continue
        for module in pkgutil.iter_modules([str(STUDIES / study.name)]):
            if module.name == "report" or module.name.startswith("report_"):
                importlib.import_module(f"{root}.{study.name}.{module.name}")
    return RENDERERS


def _number(text: str) -> Any:
    if text == "":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(text, text)


def load(path: Path) -> Any:
    """The content of a raw file, parsed by its suffix."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise
    try:
        if path.suffix == ".json":
            return json.loads(text)
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        if path.suffix == ".csv":
            return [
                {k: _number(v) for k, v in row.items()} for row in csv.DictReader(text.splitlines())
            ]
    except (ValueError, csv.Error) as e:
        raise RawFileError(f"{path}: not valid {path.suffix[1:]}: {e}; fix or rewrite it") from e
    raise RawFileError(f"{path}: raw files are .json, .jsonl or .csv, not {path.suffix!r}")


def parse(text: str, where: str) -> list[Block]:
    """The generated blocks of a markdown text (``where`` names it in errors)."""
    lines = text.split("\n")
    blocks, open_at = [], None
    for i, line in enumerate(lines):
        m = BEGIN.match(line.strip())
        if m:
            if open_at is not None:
                raise ReportError(
                    f"{where}:{i + 1}: a generated block starts inside the one of line "
                    f"{open_at[0] + 1}; close that one with '{END}' first"
                )
            open_at = (i, m.group("spec"))
        elif line.strip() == END:
            if open_at is None:
                raise ReportError(f"{where}:{i + 1}: '{END}' without a block; remove it")
            start, spec = open_at
            tokens = spec.split()
            options = tuple(tuple(t.split("=", 1)) for t in tokens[1:] if "=" in t)
            sources = tuple(t for t in tokens[1:] if "=" not in t)
            body = "\n".join(lines[start + 1 : i])
            blocks.append(Block(start + 1, tokens[0], sources, options, body, start, i))  # type: ignore[arg-type]
            open_at = None
    if open_at is not None:
        raise ReportError(
            f"{where}:{open_at[0] + 1}: generated block {open_at[1].split()[0]!r} has no "
            f"'{END}'; add it after the block"
        )
    return blocks


def render_block(block: Block, folder: Path, where: str) -> str:
    """The text of ``block``, rendered from its raw files (relative to ``folder``)."""
    fn = RENDERERS.get(block.name) or load_renderers().get(block.name)
    if fn is None:
        raise ReportError(
            f"{where}:{block.line}: unknown generated block {block.name!r}; known: "
            + ", ".join(sorted(RENDERERS))
        )
    raws = []
    for source in block.sources:
        path = folder / source
        if not path.is_file():
            raise ReportError(
                f"{where}:{block.line}: block {block.name!r} reads {source}, which does not exist; "
                "restore it or fix the path in the marker"
            )
        raws.append(Raw(source, load(path)))
    return fn(*raws, **dict(block.options)).strip("\n")


def render_text(text: str, folder: Path, where: str) -> tuple[str, list[str]]:
    """``text`` with every block re-rendered, and the labels of the blocks that changed."""
    blocks = parse(text, where)
    if not blocks:
        return text, []
    lines = text.split("\n")
    out, changed, last = [], [], 0
    for b in blocks:
        new = render_block(b, folder, where)
        if new != b.text.strip("\n") or b.text != new:
            changed.append(f"{where}:{b.line}: {b.label}")
        out += lines[last : b.start + 1] + ([new] if new else []) + [lines[b.end]]
        last = b.end + 1
    out += lines[last:]
    return "\n".join(out), changed


def documents(root: Path) -> list[Path]:
    """Every markdown file whose blocks :func:`check` and :func:`write` render."""
    found: list[Path] = []
    for pattern in DOCUMENTS:
        found += sorted(root.glob(pattern))
    return found


def check(root: Path, paths: Iterable[Path] | None = None) -> list[str]:
    """One line per block whose text differs from what its raw files render (empty: all agree)."""
    differ = []
    for path in paths if paths is not None else documents(root):
        _, changed = render_text(path.read_text(), path.parent, str(path.relative_to(root)))
        differ += changed
    return differ


def write(root: Path, paths: Iterable[Path] | None = None) -> list[Path]:
    """Re-render the blocks of ``paths`` (default: every document) in place; the files that
    changed."""
    written = []
    for path in paths if paths is not None else documents(root):
        text = path.read_text()
        new, changed = render_text(text, path.parent, str(path.relative_to(root)))
        if changed:
            path.write_text(new)
            written.append(path)
    return written


def block(name: str, *sources: str, **options: Any) -> str:
    """The markers of an empty block (its text is rendered by :func:`page` or :func:`write`)."""
    spec = " ".join([name, *(f"{k}={v}" for k, v in options.items()), *sources])
    return f"<!-- generated: {spec} -->\n{END}\n"


def page(path: Path, template: str) -> Path:
    """Render the results page ``path`` in place: its blocks if it has some (the text around
    them is kept), else ``template`` (markdown with blocks, e.g. one :func:`block`), which also
    replaces a page written before pages had blocks. What a writer calls after it has written
    its raw files."""
    path = Path(path)
    if not path.exists() or not parse(path.read_text(), str(path)):
        path.write_text(template)
    new, _ = render_text(path.read_text(), path.parent, path.name)
    path.write_text(new)
    return path
