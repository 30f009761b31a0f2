"""A researcher's own attention variant, outside the package, through every entry point.

The variant is docs/examples/tempered_attention.py (the README's example), copied into a package
of a temporary directory and selected by module path: the library learns everything from its
``SPEC``. Also: the registry's other ways in (entry points), the decoder every variant gets
without writing one, and the rule that no library module outside ``attention/`` branches on a
built-in variant's or kernel's name.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_gpt2 import attention
from linear_gpt2.attention import registry
from linear_gpt2.attention.spec import FAMILIES, AttentionSpec, quadratic_flops
from linear_gpt2.model import ModelConfig, count_params, init_params, param_shapes
from linear_gpt2.model.flops import flops_per_token
from linear_gpt2.platform.errors import ConfigError
from linear_gpt2.training.config import load_config
from tests.helpers import TINY_OVERRIDES, entry_point_calls, rel_err

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "tempered_attention.py"
NAME = "my_lab.tempered_attention"
TINY = [
    *TINY_OVERRIDES,
    "train.warmup_steps=1",
    "log.wandb=disabled",
    "log.eval_every=0",
    "checkpoint.async_save=false",
]


@pytest.fixture
def lab(tmp_path, monkeypatch):
    """A package ``my_lab`` outside the repository holding the example variant, importable."""
    pkg = tmp_path / "lab" / "my_lab"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "tempered_attention.py").write_text(EXAMPLE.read_text())
    monkeypatch.syspath_prepend(str(pkg.parent))
    yield pkg.parent
    for mod in [m for m in sys.modules if m == "my_lab" or m.startswith("my_lab.")]:
        del sys.modules[mod]
    registry.spec.cache_clear()


def _run(root: Path, lab: Path, script: str, *args: str, timeout: int = 600):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": f"{ROOT}{os.pathsep}{lab}"}
    return subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=timeout,
    )


def test_the_example_is_softmax_at_temperature_one_and_sharper_below(lab):
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 13, 3, 8)) for i in range(3))
    ours = attention.get(NAME, temperature=1.0)(q, k, v)
    assert rel_err(ours, attention.get("softmax")(q, k, v)) < 1e-6
    # tau = 0.5 doubles every logit: the same as softmax of 2 q against k.
    half = attention.get(NAME, temperature=0.5)(q, k, v)
    assert rel_err(half, attention.get("softmax")(2 * q, k, v)) < 1e-6


def test_config_takes_the_module_path_and_its_own_option(lab):
    cfg = load_config(None, [*TINY, f"attention.name={NAME}", "attention.temperature=0.5"])
    assert cfg.attention.options == attention.spec(NAME).options(temperature=0.5)
    assert cfg.model_config.temperature == 0.5 and cfg.attention.temperature == 0.5
    assert cfg.to_dict()["attention"] == {"name": NAME, "doc_reset": False, "decay": "none",
                                          "temperature": 0.5}  # fmt: skip
    # The form an earlier version saved (own options under extra) loads to the same config.
    again = load_config(None, [*TINY, f"attention.name={NAME}", "attention.extra.temperature=0.5"])
    assert again == cfg
    # Typed by the variant's options class: an int is a float, a string is not.
    assert load_config(None, [*TINY, f"attention.name={NAME}", "attention.temperature=2"]
                       ).attention.temperature == 2.0  # fmt: skip
    with pytest.raises(ConfigError, match=r"^attention.temperature: wrong type: expected float"):
        load_config(None, [*TINY, f"attention.name={NAME}", "attention.temperature=abc"])
    with pytest.raises(ConfigError, match=r"^attention.temperature: must be > 0, got 0"):
        load_config(None, [*TINY, f"attention.name={NAME}", "attention.temperature=0"])
    with pytest.raises(ConfigError, match=r"attention.temprature.*did you mean 'temperature'"):
        load_config(None, [*TINY, f"attention.name={NAME}", "attention.temprature=2"])
    with pytest.raises(ConfigError, match=r"attention.decay.*takes no decay gates"):
        load_config(None, [*TINY, f"attention.name={NAME}", "attention.decay=gate"])
    with pytest.raises(ConfigError, match=r"no module 'my_lib' on the Python path"):
        load_config(None, [*TINY, "attention.name=my_lib.nothing"])


def test_flops_and_decoder_come_from_the_spec(lab):
    cfg = ModelConfig(
        n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, attention=NAME,
        temperature=0.7,
    )  # fmt: skip
    n = count_params(param_shapes(cfg), non_embedding=False)
    # quadratic_flops: 4 T D per head and layer, forward; 3x for training, plus 6 N.
    assert flops_per_token(cfg, n, 16) == 6 * n + 3 * 2 * 2 * 4 * 16 * 16
    params = init_params(cfg, seed=0)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), params,
                                     init_params(cfg.replace(attention="softmax"), seed=0)))  # fmt: skip
    from linear_gpt2.model import sampling

    prompt = jnp.asarray([[3, 1, 4, 1, 5]])
    fast = sampling.generate(params, cfg, prompt, 6, temperature=0.0)
    slow = sampling.greedy_by_recompute(params, cfg, prompt, 6)
    np.testing.assert_array_equal(np.asarray(fast), np.asarray(slow))


# A variant of one's own with a float option ``scale`` and no check of its own: the type alone
# refuses a bad value.
SCALED = """
import dataclasses
from linear_gpt2.attention import AttentionSpec, Options, option
from linear_gpt2.attention.spec import quadratic_flops


@dataclasses.dataclass(frozen=True)
class ScaledOptions(Options):
    scale: float = option(1.0, "multiplies the output")


def make(options):
    def fn(q, k, v):
        return v * options.scale
    return fn


SPEC = AttentionSpec(name="scaled", family="softmax", make=make, flops=quadratic_flops,
                     options=ScaledOptions)
"""


@pytest.mark.parametrize(
    "module, override",
    [(NAME, "attention.temperature=abc"), ("my_lab.scaled", "attention.scale=abc")],
)
def test_a_bad_own_option_is_one_line_at_config_load_with_nothing_written(lab, tmp_path, module,
                                                                         override):  # fmt: skip
    """Through scripts/train.py: exit 2, one line ``error: attention.<key>: ...``, and no run
    directory (the config is read before anything is written)."""
    (lab / "my_lab" / "scaled.py").write_text(SCALED)
    run_dir = tmp_path / "runs" / "bad"
    proc = _run(tmp_path, lab, "scripts/train.py", str(ROOT / "configs/default.yaml"), *TINY,
                f"attention.name={module}", override, f"log.run_dir={run_dir}")  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    key = override.split("=")[0]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines == [f"error: {key}: wrong type: expected float, got 'abc'"], proc.stderr[-3000:]
    assert not run_dir.exists() and not (tmp_path / "runs").exists()


def test_recompute_decoder_keeps_the_decoder_contract():
    """A spec without a decoder of its own gets one: T steps equal the full-sequence function,
    and a prefill in two parts equals one, with document resets and decay gates passed on."""
    fn = attention.get("LT_chunked", chunk_size=4)
    spec = AttentionSpec(name="no_decoder", family="linear", make=lambda options: fn,
                         flops=quadratic_flops, resets=True, decay=True)  # fmt: skip
    dec = spec.decoder()
    assert dec.kind == "recompute"
    B, T, H, D = 2, 8, 2, 4
    q, k, v = (jax.random.normal(jax.random.key(i), (B, T, H, D)) for i in range(3))
    resets = jnp.zeros((B, T), bool).at[0, 5].set(True)
    gate = -jax.random.uniform(jax.random.key(9), (B, T, H))
    full = fn(q, k, v, resets=resets, log_gate=gate)
    state = dec.init(B, H, D, T, jnp.float32)
    steps = []
    for t in range(T):
        y, state = dec.step(state, q[:, t], k[:, t], v[:, t], reset=resets[:, t],
                            log_gate=gate[:, t])  # fmt: skip
        steps.append(y)
    assert rel_err(jnp.stack(steps, 1), full) < 1e-6
    state = dec.init(B, H, D, T, jnp.float32)
    y1, state = dec.prefill(state, q[:, :3], k[:, :3], v[:, :3], resets=resets[:, :3],
                            log_gate=gate[:, :3])  # fmt: skip
    y2, _ = dec.prefill(state, q[:, 3:], k[:, 3:], v[:, 3:], resets=resets[:, 3:],
                        log_gate=gate[:, 3:])  # fmt: skip
    assert rel_err(jnp.concatenate([y1, y2], 1), full) < 1e-6


def test_an_entry_point_registers_a_short_name(lab, tmp_path, monkeypatch):
    dist = tmp_path / "lab" / "my_lab-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my_lab\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        f"[{registry.ENTRY_POINTS}]\ntempered = {NAME}\nbroken = my_lab:NOTHING\n"
    )
    importlib.invalidate_caches()
    registry.spec.cache_clear()
    assert "tempered" in attention.names()
    assert attention.spec("tempered") is attention.spec(NAME)
    assert load_config(None, [*TINY, "attention.name=tempered"]).model_config.spec.family == (
        "softmax"
    )
    with pytest.raises(ConfigError, match=r"attention.name: .*defines no SPEC"):
        load_config(None, [*TINY, "attention.name=broken"])


@pytest.mark.slow
def test_a_variant_of_ones_own_through_every_entry_point(lab, tmp_path):
    """train (2 steps, MFU from the spec's FLOPs), sample (recompute decoder), bench_step --tiny
    and plot_runs, each a subprocess that imports the variant by module path."""
    run_dir = tmp_path / "runs" / "tempered"
    overrides = [*TINY, f"attention.name={NAME}", "attention.temperature=0.5",
                 "train.max_steps=2", "checkpoint.every=2", f"log.run_dir={run_dir}",
                 "log.peak_tflops=1.0"]  # fmt: skip
    proc = _run(tmp_path, lab, "scripts/train.py", str(ROOT / "configs/default.yaml"), *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    cfg = load_config(ROOT / "configs" / "default.yaml", overrides).model_config
    n = count_params(param_shapes(cfg), non_embedding=False)
    per_update = flops_per_token(cfg, n, 32) * 64
    for r in records:
        assert r["mfu"] == pytest.approx(per_update / r["step_time_s"] / 1e12, rel=1e-9)

    proc = _run(tmp_path, lab, "scripts/sample.py", str(run_dir), "--prompt", "Hello",
                "--tokens", "5", "--temperature", "0")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip()

    out = tmp_path / "bench"
    proc = _run(tmp_path, lab, "scripts/bench_step.py", "--tiny", "--attentions", NAME,
                "softmax", "--contexts", "64", "--repeats", "1", "--warmup", "1", "--out",
                str(out), "--stem", "tiny")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["attention"]: r for r in json.loads((out / "tiny.json").read_text())["results"]}
    assert rows[NAME]["status"] == "ok" and rows["softmax"]["status"] == "ok"

    figs = tmp_path / "figs"
    proc = _run(tmp_path, lab, "scripts/plot_runs.py", str(run_dir.parent), "--out", str(figs))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(figs.glob("learning_curves_*.png")) and (figs / "context_table.md").exists()


# --------------------------------------------------------------------------------------------
# Nothing outside attention/ (and the kernels' own folders) branches on a variant's name


def _builtin_names() -> set[str]:
    kernels = {k for n in attention.names() for k in attention.spec(n).kernels}
    return set(registry.BUILTIN) | (kernels - {"auto", "xla"})


# String methods that test or take apart a string: a variant's name (or a prefix of one, for
# startswith, ``"LT_"``) passed to one branches on it as a comparison does.
STRING_TESTS = frozenset((
    "startswith", "endswith", "removeprefix", "removesuffix", "find", "rfind", "index", "rindex",
    "count", "partition", "rpartition", "split", "rsplit",
))  # fmt: skip


def _branches_on(node: ast.AST, names: set[str]) -> list[str]:
    """String literals among ``names`` compared with ``==``, ``!=``, ``in``, ``not in`` (alone
    or in a tuple, list or set), matched in a ``match`` case, passed to a string test
    (``.startswith("pallas_blocked")``, a prefix of a name too) or used as a subscript
    (``row["LT_chunked"]``)."""
    found = []

    def literals(expr):
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            yield expr.value
        elif isinstance(expr, (ast.Tuple, ast.List, ast.Set)):
            for e in expr.elts:
                yield from literals(e)

    def about_family(expr) -> bool:  # "softmax" is a family name too: family == "softmax" is fine
        for x in ast.walk(expr):
            name = x.attr if isinstance(x, ast.Attribute) else getattr(x, "id", "")
            if isinstance(x, ast.Call):
                name = getattr(x.func, "attr", getattr(x.func, "id", ""))
            if "fam" in name:
                return True
        return False

    def word(c: str) -> bool:
        return c.isalnum() or c == "_"

    def named(s: str, method: str) -> bool:
        """``s`` is a name, or for startswith (endswith) a prefix (suffix) of one (``"LT_"``) or
        one followed (preceded) by more that is not part of an identifier (``"LT_state_parallel
        ("``, not ``"pallas_call"``)."""
        if s in names:
            return True
        if method == "startswith":
            return any((n.startswith(s) and len(s) >= 3)
                       or (s.startswith(n) and not word(s[len(n)])) for n in names)  # fmt: skip
        if method == "endswith":
            return any((n.endswith(s) and len(s) >= 3)
                       or (s.endswith(n) and not word(s[-len(n) - 1])) for n in names)  # fmt: skip
        return False

    for n in ast.walk(node):
        if isinstance(n, ast.Compare):
            operands = (n.left, *n.comparators)
            family = any(about_family(e) for e in operands)
            for expr in operands:
                found += [f"line {n.lineno}: {s!r}" for s in literals(expr)
                          if s in names and not (family and s in FAMILIES)]  # fmt: skip
        elif isinstance(n, ast.match_case):
            for sub in ast.walk(n.pattern):
                if isinstance(sub, ast.MatchValue):
                    found += [f"line {n.pattern.lineno}: {s!r}" for s in literals(sub.value)
                              if s in names]  # fmt: skip
        elif isinstance(n, ast.Call) and getattr(n.func, "attr", None) in STRING_TESTS:
            method = n.func.attr
            for arg in n.args:
                found += [f"line {n.lineno}: .{method}({s!r})" for s in literals(arg)
                          if named(s, method)]  # fmt: skip
        elif isinstance(n, ast.Subscript) and not about_family(n.value):
            found += [f"line {n.lineno}: [{s!r}]" for s in literals(n.slice) if s in names]
    return found


def test_no_library_module_outside_attention_branches_on_a_builtin_name():
    names = _builtin_names()
    package = ROOT / "linear_gpt2"
    offenders = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.parts[0] in ("attention", "kernels"):
            continue  # the variants and their kernels decide about themselves
        hits = _branches_on(ast.parse(path.read_text()), names)
        if hits:
            offenders[str(rel)] = hits
    assert not offenders, offenders


def test_the_branch_finder_finds_branches():
    code = (
        "if name == 'LT_chunked': pass\n"
        "x = kernel in ('pallas', 'xla')\n"
        "match a:\n    case 'flash': pass\n"
        "table = {'softmax': 1}\n"  # data keyed by a name: fine
        "ok = spec.family == 'softmax'\n"  # a family, not a variant
        "old = r['auto'].startswith('pallas_blocked')\n"
        "lt = name.startswith('LT_')\n"  # the post's naming, a prefix of names
        "scan = name.startswith('LT_state_parallel (')\n"
        "row = rows['LT_state_parallel']\n"
        "fine = by_family['softmax'] + name.startswith('my_') + op.startswith('pallas_call')\n"
    )
    hits = _branches_on(ast.parse(code), _builtin_names())
    assert sorted(h.split(": ", 1)[1] for h in hits) == sorted([
        "'LT_chunked'", "'pallas'", "'flash'", ".startswith('pallas_blocked')",
        ".startswith('LT_')", ".startswith('LT_state_parallel (')", "['LT_state_parallel']",
    ]), hits  # fmt: skip


def test_unknown_names_suggest_what_was_meant_and_how_to_name_ones_own(lab, tmp_path):
    """Through scripts/train.py (one line, exit 2, before any JAX): a name made of a
    registered one suggests it (``flash_attention`` -> ``flash``, not ``LT_attention``); a
    top-level module of one's own, not registered, is told how to name it (its package, or
    ``module:SPEC``), and that form works."""
    (lab / "tempered_top.py").write_text(EXAMPLE.read_text())
    config = str(ROOT / "configs/default.yaml")
    cases = [
        ("flash_attention", "unknown attention 'flash_attention' (did you mean 'flash'?)"),
        ("Softmax_Attention", "(did you mean 'softmax'?)"),
        ("LT_chunk", "(did you mean 'LT_chunked'?)"),
        ("tempered_top", "a module of your own is named by its path with its package "
         "(my_lab.attn, defining SPEC), or as tempered_top:SPEC for a top-level module"),
        ("no_such_thing", "or the module path of a variant of your own, with its package"),
        # The form the message names gets past the name, to the next setting's check.
        ("tempered_top:SPEC", "error: train.context_parallel"),
    ]  # fmt: skip
    calls = [[config, f"attention.name={name}", "train.context_parallel=0"] for name, _ in cases]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": f"{ROOT}{os.pathsep}{lab}"}
    results = entry_point_calls(ROOT / "scripts" / "train.py", calls, env=env, cwd=tmp_path)
    for (name, says), (code, err) in zip(cases, results, strict=True):
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and says in lines[0], (name, err)
