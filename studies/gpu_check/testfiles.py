"""The test files that hold ``gpu`` tests, and how many tests each holds, read from their source
(no import, no collection: the dry run stays fast).

A test counts once per case of its ``pytest.mark.parametrize`` decorators whose values are a
literal list or tuple, or ``list(NAME)`` / ``NAME`` of a module-level literal; other value
expressions count as one case (the plan's estimate, not the test run, uses the count).
"""

from __future__ import annotations

import ast
from pathlib import Path

from linear_gpt2.platform.provenance import REPO


def _is_gpu_mark(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "gpu"


def _cases(dec: ast.expr, names: dict[str, int]) -> int:
    if not (isinstance(dec, ast.Call) and getattr(dec.func, "attr", "") == "parametrize"):
        return 1
    if len(dec.args) < 2:
        return 1
    values = dec.args[1]
    if isinstance(values, (ast.List, ast.Tuple)):
        return len(values.elts)
    if isinstance(values, ast.Call) and values.args and isinstance(values.args[0], ast.Name):
        values = values.args[0]
    if isinstance(values, ast.Name):
        return names.get(values.id, 1)
    return 1


def count_gpu_tests(source: str) -> int:
    tree = ast.parse(source)
    names: dict[str, int] = {}
    for node in tree.body:  # module-level literal collections: KERNELS = {...}, CASES = [...]
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.List, ast.Tuple)):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    names[t.id] = len(node.value.elts)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    names[t.id] = len(node.value.keys)
    marked = any(_is_gpu_mark(n) for n in _module_marks(tree))
    total = 0
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test"):
            continue
        if not (marked or any(_is_gpu_mark(d) for d in node.decorator_list)):
            continue
        n = 1
        for d in node.decorator_list:
            n *= _cases(d, names)
        total += n
    return total


def _module_marks(tree: ast.Module) -> list[ast.expr]:
    """``pytestmark = pytest.mark.gpu`` (or a list holding it)."""
    out: list[ast.expr] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            v = node.value
            out += list(v.elts) if isinstance(v, (ast.List, ast.Tuple)) else [v]
    return out


def gpu_test_files(root: Path = REPO) -> dict[str, int]:
    """``tests/<file>.py`` -> its number of gpu tests, for each file that has any."""
    out = {}
    for path in sorted((root / "tests").glob("test_*.py")):
        text = path.read_text()
        if "mark.gpu" not in text:
            continue
        n = count_gpu_tests(text)
        if n:
            out[str(path.relative_to(root))] = n
    return out
