"""References that cannot go stale: every repository file and every module path that README.md,
docs/, configs/, pyproject.toml and the docstrings of the package, studies/, scripts/ and
benchmarks/ name exists.

A file reference is a path with a known suffix (``.py``, ``.md``, ``.yaml``, ``.json``, ...) or a
folder of the repository (``linear_gpt2/kernels/flash/``); it resolves against the repository,
the naming file's folder, the package or one of its subpackages (``lt_chunked/ops.py``), the
package folders above a naming module, or a config folder (a sweep file's ``../post/base.yaml``).
A bare ``.py`` name resolves anywhere in the repository; other bare names (``done.json``,
``config.yaml``) are mostly files a program writes, and placeholders (``STEM.json``,
``RUN_DIR/...``, ``my_lab/...``) and outputs (``runs/``, ``data/``) are not files of the
repository: neither is checked. A module path is a dotted name starting with ``linear_gpt2.``,
``studies.`` or with one of the package's subpackages (``attention.schema``, ``kernels.forget.Forget``): its longest
prefix that is a module must exist, and the next name must be defined at that module's top
level. A config key (``attention.chunk_size``, ``model.remat``) is not a module path. Paths into
other projects (flash-linear-attention's ``fla/ops/...``, JAX's sources, the papers'
repositories) are listed in :data:`ELSEWHERE`.
Every ``from linear_gpt2... / studies... import name`` in the code, inside functions too, resolves
(:func:`test_every_first_party_import_resolves`).
"""

from __future__ import annotations

import ast
import re
import subprocess
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "linear_gpt2"
STUDIES = ROOT / "studies"
SUBPACKAGES = tuple(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
SUFFIXES = ("py", "md", "yaml", "yml", "json", "jsonl", "csv", "toml", "ipynb", "tiktoken")
TOP = ("linear_gpt2", "studies", "scripts", "benchmarks", "docs", "configs", "tests", "notebooks")

# Paths into other projects, named as they are there (not files of this repository).
ELSEWHERE = (
    "fla/",  # flash-linear-attention
    "jax/",  # JAX's sources
    "jax_triton/",
    "zoology/",  # Zoology's repository
    "configs/main_fig_sweep.yaml",  # ReBased's repository
    "model.py",  # nanoGPT's
    "train.py",  # nanoGPT's (scripts/train.py is named with its folder)
    "pallas/ops/gpu/attention.py",
    "flash_attention.py",
    "shared/anchors/",  # the session's shared folder, beside the repository
)
# Folders of program outputs and placeholders written in examples: not repository files.
OUTPUTS = ("runs/", "data/", ".cache/", "my_lab/", "my_lib/", "run_dir/")

FILE = re.compile(
    r"(?<![\w./\-$<{*}%])((?:\.\./)*(?:[\w.\-]+/)*[\w\-]+(?:\.[\w\-]+)*\.(?:"
    + "|".join(SUFFIXES)
    + r"))(?![\w/*{<])"
)
FOLDER = re.compile(r"(?<![\w./\-])((?:" + "|".join(TOP) + r")/(?:[\w\-]+/)*)(?![\w*<{])")
MODULE = re.compile(
    r"(?<![\w.])((?:linear_gpt2|studies|" + "|".join(SUBPACKAGES) + r")(?:\.[A-Za-z_]\w*)+)"
)


@cache
def repo_files() -> tuple[str, ...]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return tuple(line for line in out.splitlines() if line)


@cache
def basenames() -> frozenset[str]:
    return frozenset(Path(f).name for f in repo_files())


@cache
def config_keys() -> frozenset[str]:
    """``attention.<option>`` and ``model.<field>``: config keys that look like module paths."""
    import dataclasses

    from linear_gpt2.attention import registry
    from linear_gpt2.attention.options import declared
    from linear_gpt2.model.config import ArchConfig

    example = ROOT / "docs" / "examples" / "tempered_attention.py"
    own = set(re.findall(r"^    (\w+): \w+ = option\(", example.read_text(), re.M))
    options = {k for n in registry.BUILTIN for k in declared(registry.spec(n).options)}
    attention = {f"attention.{k}" for k in {*options, *own, "name", "extra"}}
    model = {f"model.{f.name}" for f in dataclasses.fields(ArchConfig)} | {"model.preset"}
    return frozenset(attention | model)


def sources() -> list[tuple[Path, str]]:
    """``(file, text)`` of every place references are read from: the markdown pages, the
    configs, pyproject.toml, and the docstrings of the package, the scripts and the
    benchmarks."""
    out = [(p, p.read_text()) for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]]
    out += [(p, p.read_text()) for p in sorted((ROOT / "configs").rglob("*.yaml"))]
    out.append((ROOT / "pyproject.toml", (ROOT / "pyproject.toml").read_text()))
    for folder in (
        PACKAGE,
        STUDIES,
        ROOT / "scripts",
        ROOT / "benchmarks",
        ROOT / "docs" / "examples",
    ):
        for path in sorted(folder.rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(
                    node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
                ):
                    doc = ast.get_docstring(node, clean=False)
                    if doc:
                        out.append((path, doc))
    return out


def _elsewhere(ref: str) -> bool:
    return any(ref == e or ref.startswith(e) or f"/{e}" in ref for e in ELSEWHERE)


def unchecked(ref: str) -> bool:
    """A placeholder, a program's output or a bare name that is not a module (module doc)."""
    parts = ref.strip("/").split("/")
    if any(p.split(".")[0].isupper() or p.split(".")[0] in ("", "stem") for p in parts):
        return True  # STEM.json, RUN_DIR/config.yaml, OUT/kernels.json, _measured.md
    if ref.startswith(OUTPUTS) or _elsewhere(ref):
        return True
    return "/" not in ref and not ref.endswith(".py")


def file_exists(ref: str, where: Path) -> bool:
    """Whether the path ``ref``, named in ``where``, is a file or folder of the repository."""
    ref = ref.rstrip("/")
    bases = [ROOT, where.parent, PACKAGE, *(PACKAGE / s for s in SUBPACKAGES)]
    bases += [p for p in (ROOT / "configs").iterdir() if p.is_dir()]
    if where.suffix == ".py":
        bases += [
            p
            for p in where.parents
            if p in (PACKAGE, STUDIES) or {PACKAGE, STUDIES} & set(p.parents)
        ]
    if any((b / ref).exists() for b in bases):
        return True
    return "/" not in ref and ref in basenames()


@cache
def _top_names(path: Path) -> frozenset[str]:
    """The names a module defines at its top level (definitions, assignments, imports,
    ``__all__``) and its submodules."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    if path.name == "__init__.py":
        names |= {p.stem for p in path.parent.iterdir() if p.suffix == ".py" or p.is_dir()}
    return frozenset(names)


def module_exists(ref: str) -> bool:
    """Whether the dotted ``ref`` names a module of the package and, after it, a name that
    module defines (deeper attributes are not followed)."""
    parts = ref.split(".")
    if parts[0] not in ("linear_gpt2", "studies"):
        parts = ["linear_gpt2", *parts]
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if path.is_file():
            rest = parts[n:]
            return not rest or rest[0] in _top_names(path)
    return False


def stale(text: str, where: Path) -> list[str]:
    """The references of ``text`` (named in ``where``) that do not resolve."""
    found = []
    for m in FILE.finditer(text):
        ref = m.group(1)
        before = text[: m.start()]
        word = before.rsplit(None, 1)[-1] if before.strip() and not before[-1].isspace() else ""
        if "://" in word or word.startswith(("/", "~")):
            continue  # part of a web address or of an absolute path outside the repository
        if not unchecked(ref) and not file_exists(ref, where):
            found.append(ref)
    for m in FOLDER.finditer(text):
        if not unchecked(m.group(1)) and not file_exists(m.group(1), where):
            found.append(m.group(1))
    for m in MODULE.finditer(text):
        ref = m.group(1).rstrip(".")
        if ref.split(".")[-1] in SUFFIXES or ref in config_keys():
            continue  # a file name (read above) or a config key
        if not module_exists(ref):
            found.append(ref)
    return found


def test_every_file_and_module_named_exists():
    texts = sources()
    assert len(texts) > 500, len(texts)  # the pages, configs and docstrings were read
    checked = sum(len(FILE.findall(t)) + len(MODULE.findall(t)) for _, t in texts)
    assert checked > 500, checked
    broken = {}
    for path, text in texts:
        bad = stale(text, path)
        if bad:
            broken.setdefault(str(path.relative_to(ROOT)), []).extend(bad)
    assert not broken, broken


def test_the_checker_finds_stale_references():
    doc = PACKAGE / "attention" / "flash.py"
    text = (
        "see attention/flash_context.py, ``linear_gpt2.attention.flash_context.ring_local``, "
        "``kernels.flash.ring.no_such_function``, linear_gpt2/kernels/nothing/ and "
        "benchmarks/results/none.json; fine: kernels/flash/ring.py, ``kernels.flash.ring.Block``, "
        "``linear_gpt2.attention.schema``, ``spec.py``, fla/ops/linear_attn/naive.py"
    )
    assert stale(text, doc) == [
        "attention/flash_context.py",
        "benchmarks/results/none.json",
        "linear_gpt2/kernels/nothing/",
        "linear_gpt2.attention.flash_context.ring_local",
        "kernels.flash.ring.no_such_function",
    ]


FIRST_PARTY = ("linear_gpt2", "studies")


def first_party_imports(path: Path) -> list[tuple[int, str, str]]:
    """``(line, module, name)`` for every ``from linear_gpt2... / studies... import name`` in
    ``path``, the ones inside functions too (they run only on their own path, such as a
    benchmark's compile step, so importing the file does not check them)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in FIRST_PARTY:
                out += [(node.lineno, node.module, a.name) for a in node.names]
    return out


def unresolved(imports: list[tuple[int, str, str]]) -> list[str]:
    """The imports whose module does not exist or does not define (or contain) the name."""
    import importlib
    import importlib.util

    bad = []
    for line, module, name in imports:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError:
            bad.append(f"{line}: from {module} import {name} (no module {module})")
            continue
        if name != "*" and not hasattr(mod, name) and (
            importlib.util.find_spec(f"{module}.{name}") is None
        ):  # fmt: skip
            bad.append(f"{line}: from {module} import {name} ({module} has no {name})")
    return bad


def test_every_first_party_import_resolves():
    """A module moved between the library and the studies breaks here, not in a researcher's
    run: every ``from linear_gpt2... import x`` and ``from studies... import x`` of the
    package, the studies, the scripts, the benchmarks and the tests names a module that exists
    and a name it has."""
    files = [p for top in ("linear_gpt2", "studies", "scripts", "benchmarks", "tests")
             for p in sorted((ROOT / top).rglob("*.py"))]  # fmt: skip
    imports = {p: first_party_imports(p) for p in files}
    assert sum(map(len, imports.values())) > 500
    broken = {str(p.relative_to(ROOT)): bad for p, i in imports.items() if (bad := unresolved(i))}
    assert not broken, broken


def test_the_import_checker_finds_a_moved_module(tmp_path):
    f = tmp_path / "bench.py"
    f.write_text(
        "def compile_it():\n"
        "    from linear_gpt2.experiments import hlo_costs, step_costs\n"
        "    from linear_gpt2.no_such_layer import x\n"
        "    from studies.train_step import step_costs\n"
    )
    assert unresolved(first_party_imports(f)) == [
        "2: from linear_gpt2.experiments import step_costs (linear_gpt2.experiments has no "
        "step_costs)",
        "3: from linear_gpt2.no_such_layer import x (no module linear_gpt2.no_such_layer)",
    ]
