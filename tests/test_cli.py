"""The command-line entry points under bad input, run as a user runs them (subprocesses): each
expected failure ends with one line ``error: ...`` naming the file, key or value and the fix,
exit 2 for usage errors and 1 for the rest, and a traceback only with ``--debug``; nothing is
written under ``$HOME``."""

import gzip
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from linear_gpt2.platform import cli, errors
from tests.helpers import SLOW, TINY_OVERRIDES

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    *TINY_OVERRIDES,
    "train.max_steps=2",
    "log.eval_every=0",
    "log.wandb=disabled",
]
TINY_CONFIG = ("configs/default.yaml", *TINY)


def run(script: str, *args: str, env: dict | None = None, timeout: int = 300):
    target = ["-m", script] if script.startswith("linear_gpt2.") else [str(ROOT / script)]
    base = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    base.pop(cli.DEBUG_ENV, None)
    return subprocess.run(
        [sys.executable, *target, *map(str, args)],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def assert_error(proc, code: int, *words: str) -> str:
    """Exit ``code``, the last stderr line is ``error: ...`` holding ``words``, no traceback."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == code, proc.stdout[-1500:] + proc.stderr[-3000:]
    assert lines and lines[-1].startswith("error: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for word in words:
        assert word in lines[-1], (word, lines[-1])
    return lines[-1]


def tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_file():
            h.update(p.read_bytes() + str(p.stat().st_mtime_ns).encode())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Usage errors: config, arguments, sweep file (exit 2)


def test_config_errors_are_one_line_and_debug_shows_the_traceback(tmp_path):
    proc = run("scripts/train.py", "configs/default.yaml", "model.n_layr=3")
    assert_error(proc, 2, "model.n_layr", "did you mean 'n_layer'")
    debug = run("scripts/train.py", "configs/default.yaml", "model.n_layr=3", "--debug")
    assert debug.returncode == 2 and "Traceback" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1].startswith("error: unknown config key")
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model:\n  n_layer: [1\n")
    assert_error(
        run("linear_gpt2.training.config", bad_yaml), 2, str(bad_yaml), "not valid YAML", "line"
    )
    env_debug = run("linear_gpt2.training.config", tmp_path / "none.yaml", env={cli.DEBUG_ENV: "1"})
    assert env_debug.returncode == 2 and "Traceback" in env_debug.stderr


# --------------------------------------------------------------------------------------------
# Data and shards (exit 1)


def _c4_dir(root: Path, train_bytes=None, docs: int = 300) -> Path:
    from linear_gpt2.training.data.sample import document

    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", docs), ("validation", 20)):
        lines = [json.dumps(document(0, split, i)) for i in range(n)]
        data = ("\n".join(lines) + "\n").encode()
        if split == "train" and train_bytes is not None:
            data = train_bytes(data)
        with gzip.open(root / f"c4-{split}.00000-of-00001.json.gz", "wb") as f:
            f.write(data)
    return root


@SLOW
def test_damaged_source_files_name_the_file_and_line(tmp_path):
    truncated = _c4_dir(tmp_path / "truncated")
    f = truncated / "c4-train.00000-of-00001.json.gz"
    f.write_bytes(f.read_bytes()[:3000])
    out = tmp_path / "tok"
    args = ("data.source=c4", f"data.path={truncated}", f"data.tokenized_dir={out}")
    assert_error(run("scripts/prepare_data.py", *args), 1, str(f), "truncated", "re-download")
    train = run(
        "scripts/train.py",
        "configs/default.yaml",
        *TINY,
        "data.source=c4",
        f"data.path={truncated}",
        f"log.run_dir={tmp_path / 'run'}",
    )
    assert_error(train, 1, str(f), "truncated")

    def bad_line(data: bytes) -> bytes:
        lines = data.split(b"\n")
        lines[5] = lines[5][:40]  # a record cut in the middle: line 6 is not JSON
        return b"\n".join(lines)

    malformed = _c4_dir(tmp_path / "malformed", bad_line)
    args = ("data.source=c4", f"data.path={malformed}", f"data.tokenized_dir={out}")
    assert_error(run("scripts/prepare_data.py", *args), 1, "line 6: not valid JSON")


def test_shard_with_ids_outside_the_vocabulary_fails_when_opened(tmp_path):
    split = tmp_path / "tok" / "train"
    split.mkdir(parents=True)
    tokens = np.arange(4000, dtype=np.uint16) % 50257
    tokens[1234] = 50300  # a padded id: never produced by the tokenizer, NaN-prone if trained on
    tokens.tofile(split / "a.bin")
    index = {
        "version": 1,
        "tokenizer": "gpt2",
        "dtype": "uint16",
        "split": "train",
        "sources": ["a.json.gz"],
        "shards": {"a.json.gz": {"file": "a.bin", "n_tokens": 4000}},
        "complete": True,
    }
    (split / "index.json").write_text(json.dumps(index))
    proc = run(
        "scripts/train.py",
        "configs/default.yaml",
        *TINY,
        "data.source=c4",
        f"data.tokenized_dir={tmp_path / 'tok'}",
        f"log.run_dir={tmp_path / 'run'}",
    )
    assert_error(proc, 1, str(split / "a.bin"), "token id 50300 at token 1234", "prepare_data")


# --------------------------------------------------------------------------------------------
# Checkpoints, refused reruns


def _fake_step(run_dir: Path, step: int, config: dict) -> None:
    """A step directory that passes the file checks (no file list: written by another version)
    and holds ``config``; enough to be refused before any array is read."""
    d = run_dir / "checkpoints" / str(step)
    (d / "meta").mkdir(parents=True)
    (d / "state").mkdir()
    (d / "_CHECKPOINT_METADATA").write_text(json.dumps({"commit_timestamp_nsecs": 1}))
    (d / "meta" / "metadata").write_text(json.dumps({"config": config, "step": step}))
    (d / "state" / "_METADATA").write_text("{}")
    (d / "state" / "manifest.ocdbt").write_bytes(b"\0" * 16)
    loader = run_dir / "loader_state" / str(step)
    loader.mkdir(parents=True)
    (loader / "process_0.json").write_text("{}")


@SLOW
def test_refused_reruns_change_nothing_and_say_what_works(tmp_path):
    from linear_gpt2.training.config import load_config

    run_dir = tmp_path / "run"
    cfg = load_config(ROOT / "configs" / "default.yaml", [*TINY, f"log.run_dir={run_dir}"])
    _fake_step(run_dir, 2, cfg.to_dict())
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    before = tree_hash(run_dir)
    args = ("configs/default.yaml", *TINY, f"log.run_dir={run_dir}")
    other = run("scripts/train.py", *args, "model.n_embd=64")
    assert_error(other, 2, "model.n_embd (checkpoint 32, now 64)", "log.name", "aside")
    assert "resume=never" not in other.stderr
    never = run("scripts/train.py", *args, "checkpoint.resume=never")
    assert_error(never, 2, "checkpoint.resume=never", "log.name", "aside")
    assert tree_hash(run_dir) == before
    missing = run(
        "scripts/train.py",
        *TINY_CONFIG,
        f"log.run_dir={tmp_path / 'other'}",
        f"checkpoint.resume={tmp_path / 'nope'}",
    )
    assert_error(missing, 2, "does not exist")
    assert not (tmp_path / "other").exists()


def test_every_checkpoint_damaged_is_reported_and_moved_aside(tmp_path):
    run_dir = tmp_path / "run"
    for step in (2, 4):  # killed mid-copy, say: directories without their files
        (run_dir / "checkpoints" / str(step)).mkdir(parents=True)
    proc = run("scripts/train.py", *TINY_CONFIG, f"log.run_dir={run_dir}")
    assert_error(proc, 1, "every checkpoint", "steps 4, 2", "step 0")
    assert "warning: checkpoint step 4" in proc.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints" / "damaged").iterdir()) == [
        "2-missing-_CHECKPOINT_METADATA",
        "4-missing-_CHECKPOINT_METADATA",
    ]


# --------------------------------------------------------------------------------------------
# Sampling


@pytest.fixture(scope="module")
def sample_run(tmp_path_factory) -> Path:
    """A run directory with one checkpoint of a tiny model (block_size 32), saved without
    training."""
    from linear_gpt2.model import init_params
    from linear_gpt2.training import checkpoint as ckpt_lib
    from linear_gpt2.training.config import load_config
    from linear_gpt2.training.optim import optimizer
    from linear_gpt2.training.train_step import init_state

    run_dir = tmp_path_factory.mktemp("sample") / "run"
    cfg = load_config(None, [*TINY, f"log.run_dir={run_dir}", "checkpoint.async_save=false"])
    state = init_state(init_params(cfg.model_config, 0), optimizer(cfg.train))
    saver = ckpt_lib.Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
    rng = np.asarray(jax.random.key_data(jax.random.key(0)))
    saver.save(1, {"train": state, "rng": rng}, {"config": cfg.to_dict(), "step": 1}, {})
    saver.close()
    return run_dir


@SLOW
def test_sampling_arguments(sample_run, tmp_path):
    for args, words in (
        (("--tokens", "0"), ("--tokens must be >= 1", "got 0")),
        (("--tokens", "-3"), ("--tokens must be >= 1",)),
        (("--temperature", "-1"), ("--temperature must be >= 0",)),
        (("--tokens", "40"), ("block_size is 32", "--tokens 31 or fewer")),
    ):
        assert_error(run("scripts/sample.py", sample_run, *args), 2, *words)
    assert_error(run("scripts/sample.py", tmp_path / "nope"), 2, "does not exist")
    (tmp_path / "empty").mkdir()
    assert_error(run("scripts/sample.py", tmp_path / "empty"), 1, "holds no checkpoint")
    long = run(
        "scripts/sample.py",
        sample_run,
        "--prompt",
        "word " * 40,
        "--tokens",
        "30",
        "--temperature",
        "0",
    )
    assert long.returncode == 0, long.stderr[-2000:]
    assert "the model sees only the last 2 prompt tokens" in long.stderr


# --------------------------------------------------------------------------------------------
# Missing plugin, missing device


def test_missing_kernel_plugin_and_missing_device(tmp_path):
    proc = run(
        "scripts/train.py",
        *TINY_CONFIG,
        "attention.name=LT_chunked",
        "attention.kernel=triton",
        "attention.chunk_size=16",
        f"log.run_dir={tmp_path / 'run'}",
    )
    assert_error(proc, 1, "kernel=triton", "pip install")
    proc = run(
        "scripts/train.py",
        *TINY_CONFIG,
        f"log.run_dir={tmp_path / 'run2'}",
        env={"JAX_PLATFORMS": "cuda"},
    )
    assert_error(proc, 1, "JAX_PLATFORMS=cuda", "pip install -e '.[gpu]'")


def test_missing_optional_package_names_the_install_command():
    err = ModuleNotFoundError("No module named 'torch'", name="torch")
    assert cli.exit_code_and_message(err) == (
        1,
        "this command needs the optional package 'torch', which is not installed; install it "
        "with: pip install -e '.[parity]'",
    )
    with pytest.raises(errors.MissingDependencyError, match=r"kernel=x needs .*pip install foo"):
        errors.require("linear_gpt2_no_such_module", "pip install foo", "kernel=x")
    assert cli.exit_code_and_message(ValueError("a bug")) is None  # unexpected: traceback


# --------------------------------------------------------------------------------------------
# Nothing under $HOME


@SLOW
def test_entry_points_write_nothing_under_home(tmp_path):
    """Each entry point runs with HOME and the system's temporary directory empty directories
    and none of the cache variables the test suite sets; wandb (offline), datasets, matplotlib,
    tiktoken and JAX leave both empty."""
    home, system_tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    system_tmp.mkdir()
    drop = ("WANDB_", "XDG_", "HF_", "TIKTOKEN_", "TORCHINDUCTOR_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    for var in ("MPLCONFIGDIR", "LINEAR_GPT2_CACHE"):
        env.pop(var, None)
    env.update(HOME=str(home), LINEAR_GPT2_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    env.update(WANDB_MODE="offline", JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.update(TMPDIR=str(system_tmp))

    def ok(*cmd: str) -> None:
        proc = subprocess.run(
            [sys.executable, *cmd], env=env, capture_output=True, text=True, cwd=tmp_path
        )
        assert proc.returncode == 0, (cmd, proc.stderr[-3000:])
        for where in (home, system_tmp):
            assert not list(where.rglob("*")), (cmd, sorted(map(str, where.rglob("*"))))

    run_dir = tmp_path / "run"
    corpus = _c4_dir(tmp_path / "c4", docs=40)
    s = lambda name: str(ROOT / "scripts" / name)  # noqa: E731
    ok(
        s("prepare_data.py"),
        "data.source=c4",
        f"data.path={corpus}",
        f"data.tokenized_dir={tmp_path / 'tok'}",
    )
    train_args = [*TINY, "data.source=c4", f"data.tokenized_dir={tmp_path / 'tok'}"]
    ok(
        s("train.py"),
        str(ROOT / "configs/default.yaml"),
        *train_args,
        "log.wandb=offline",
        f"log.run_dir={run_dir}",
    )
    assert list((run_dir / "wandb").glob("offline-run-*"))
    ok(s("sample.py"), str(run_dir), "--tokens", "3")
    ok(s("plot_runs.py"), str(run_dir), "--out", str(tmp_path / "figures"))
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        json.dumps({"base": str(ROOT / "configs/default.yaml"), "grid": {"seed": [0, 1]}})
    )
    ok(s("sweep.py"), str(sweep), "--dry-run", *train_args)
    ok("-m", "linear_gpt2.training.config", str(ROOT / "configs/default.yaml"))
    bench = ("--tiny", "--attentions", "softmax", "--out", str(tmp_path / "bench"))
    ok(s("bench_step.py"), *bench, "--contexts", "64", "--no-plot", "--repeats", "1")
    ok(s("bench_sample.py"), *bench, "--contexts", "64", "--steps", "1", "--rounds", "1")
    assert (tmp_path / "cache").is_dir()  # the caches went to the project's cache directory


def test_env_defaults_keep_what_the_user_set(tmp_path, monkeypatch):
    from linear_gpt2.platform import env

    monkeypatch.setenv("LINEAR_GPT2_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MPLCONFIGDIR", "/my/matplotlib")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "XDG_CONFIG_HOME", "TRITON_CACHE_DIR",
                "TORCHINDUCTOR_CACHE_DIR"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    d = env.defaults()
    assert d["MPLCONFIGDIR"] == str(tmp_path / "cache" / "matplotlib")
    # PyTorch's compiler (the interop path) would write $TMPDIR/torchinductor_<user>.
    assert d["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "torchinductor")
    assert d["WANDB_CACHE_DIR"] == str(tmp_path / "cache" / "wandb" / "cache")
    assert d["WANDB_CONFIG_DIR"] == str(tmp_path / "cache" / "wandb" / "config")
    settings = tmp_path / "home" / ".config" / "wandb" / "settings"
    settings.parent.mkdir(parents=True)
    settings.write_text("[default]\nentity = me\n")
    assert "WANDB_CONFIG_DIR" not in env.defaults()  # an existing wandb setup stays in use
    saved = dict(os.environ)
    try:
        changed = env.configure()
        assert os.environ["MPLCONFIGDIR"] == "/my/matplotlib" and "MPLCONFIGDIR" not in changed
        assert changed["TRITON_CACHE_DIR"] == str(tmp_path / "cache" / "triton")
    finally:
        os.environ.clear()
        os.environ.update(saved)


# --------------------------------------------------------------------------------------------
# Argument errors: one line, exit 2, from every script


@SLOW
def test_argument_errors_of_every_script_are_one_line_and_exit_2(tmp_path):
    """argparse's usage text never reaches the user, values are checked before any work, and
    train.py without a config says what to give it."""
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(json.dumps({"base": str(ROOT / "configs/default.yaml")}))
    config = ROOT / "configs/default.yaml"
    cases = [
        (("scripts/train.py",), ("give a config file", "configs/default.yaml")),
        (("scripts/train.py", "model.n_layer=2"), ("give a config file",)),
        (("scripts/compile.py", config, "--batch", "0"), ("--batch", ">= 1")),
        (("scripts/compile.py", "--attention", "LT_chunked", "--shape", "1", "-64", "2", "16"),
         ("--shape", ">= 1", "got -64")),
        (("scripts/compile.py", config, "--bogus"), ("unrecognized", "--bogus")),
        (("scripts/compile.py",), ("give a CONFIG",)),
        (("scripts/mqar.py", "--protocol", "zoo"), ("--protocol", "invalid choice")),
        (("scripts/mqar.py", "--report-only", "--keep", tmp_path / "no.json"), ("--keep",)),
        (("scripts/sweep.py",), ("required", "sweep")),
        (("scripts/sweep.py", sweep, "--point", "-1"), ("--point", ">= 0")),
        (("scripts/sweep.py", sweep, "--slurm", tmp_path / "no" / "a.sh"), ("--slurm",)),
        (("scripts/sample.py", tmp_path, "--tokens", "x"), ("--tokens", "invalid int")),
        (("scripts/plot_runs.py", tmp_path, "--smooth", "2"), ("--smooth", "[0, 1)")),
        (("scripts/plot_runs.py", tmp_path / "nope"), ("no such run directory",)),
        (("scripts/prepare_data.py", "--bogus"), ("unrecognized", "--bogus")),
        (("scripts/bench_step.py", "--tiny", "--contexts", "-5"), ("--contexts", ">= 1")),
        (("scripts/bench_step.py", "--attentions", "nope"), ("nope",)),
        (("scripts/bench_sample.py", "--steps", "0"), ("--steps", ">= 1")),
        (("linear_gpt2.training.config", config, "train.max_hours=-1"),
         ("train.max_hours", "> 0")),
    ]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop(cli.DEBUG_ENV, None)
    procs = []
    for args, words in cases:
        script, rest = args[0], args[1:]
        target = ["-m", script] if script.startswith("linear_gpt2.") else [str(ROOT / script)]
        cmd = [sys.executable, *target, *map(str, rest)]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, **pipes)
        procs.append((cmd, words, proc))
    for cmd, words, proc in procs:
        out, err = proc.communicate(timeout=300)
        lines = [line for line in err.splitlines() if line.strip()]
        assert proc.returncode == 2, (cmd, out[-500:], err[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: "), (cmd, err[-2000:])
        assert "usage:" not in out + err, (cmd, out[-500:], err[-500:])
        for word in words:
            assert word in lines[0], (cmd, word, lines[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.yaml"]  # nothing written


# --------------------------------------------------------------------------------------------
# A refused sweep point


def test_a_refused_sweep_point_is_reported_on_stderr_and_exits_2(tmp_path):
    from linear_gpt2.training.config import load_config

    sweep = tmp_path / "sweep.yaml"
    overrides = {k: v for k, _, v in (o.partition("=") for o in TINY)}
    sweep.write_text(
        json.dumps(
            {
                "name": "refused",
                "base": str(ROOT / "configs/default.yaml"),
                "out_dir": str(tmp_path / "runs"),
                "overrides": overrides,
            }
        )
    )
    run_dir = tmp_path / "runs" / "point0"
    other = load_config(
        ROOT / "configs/default.yaml", [*TINY, f"log.run_dir={run_dir}", "train.lr=0.01"]
    )
    _fake_step(run_dir, 2, other.to_dict())
    (run_dir / "config.yaml").write_text(other.to_yaml())
    before = tree_hash(run_dir)
    proc = run("scripts/sweep.py", sweep)
    line = assert_error(proc, 2, "sweep refused", "1 of 1 points not run", "point0", "out_dir")
    warnings = [x for x in proc.stderr.splitlines() if x.strip() and x != line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: not run: sweep point 0")
    assert "train.lr" in warnings[0]
    assert tree_hash(run_dir) == before


# --------------------------------------------------------------------------------------------
# The exit codes in docs/training.md


def _expected_failure_classes() -> list[type]:
    import importlib
    import pkgutil

    import linear_gpt2
    import studies

    # The library and the studies (render_reports.py's errors live in studies.common).
    for package in (linear_gpt2, studies):
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            try:
                importlib.import_module(info.name)
            except ImportError:  # an optional dependency (triton, torch) is missing here
                pass
    found, todo = [], [errors.LinearGPT2Error]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub.__module__.startswith(("linear_gpt2.", "studies.")) and sub not in found:
                found.append(sub)
                todo.append(sub)
    return found


def test_the_exit_code_table_of_the_docs_matches_the_code():
    """Every exception class the package raises for an expected failure is in the row of its
    exit code, and every class the table names exists with that code (names shared by classes
    of two codes are written ``module.Name``)."""
    import re

    text = (ROOT / "docs" / "training.md").read_text()
    rows = {}
    for line in text.split("## Failures", 1)[1].splitlines():
        m = re.match(r"\| (\d+) \|(.*)\|(.*)\|$", line)
        if m:
            rows[int(m[1])] = set(re.findall(r"`([\w.]+)`", m[3]))
    assert set(rows) == {0, 1, 2, 130, 143}, rows.keys()
    classes = _expected_failure_classes()
    codes_of: dict[str, set[int]] = {}
    for cls in classes:
        codes_of.setdefault(cls.__name__, set()).add(cls.exit_code)
    named: dict[str, int] = {"KeyboardInterrupt": 130}
    for cls in classes:
        short = cls.__name__
        if len(codes_of[short]) > 1:
            short = f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"
        named[short] = cls.exit_code
        assert short in rows.get(cls.exit_code, ()), (short, cls.exit_code)
    for code, names in rows.items():
        for name in names:
            assert named.get(name) == code, (name, code)
    assert errors.UsageError.exit_code == 2 and errors.RunError.exit_code == 1
    assert cli.run(lambda argv: (_ for _ in ()).throw(KeyboardInterrupt), []) == 130


def test_third_party_warnings_are_dropped_and_ours_kept(monkeypatch):
    """Told apart by the code that calls ``warnings.warn``, not by the module a stacklevel
    names: a warning of ours pointing at a caller inside JAX still shows."""
    import warnings

    theirs = {"__name__": "jax._src.somewhere"}
    exec("import warnings\ndef f():\n    warnings.warn('theirs', stacklevel=2)\n", theirs)
    ours = {"__name__": "linear_gpt2.somewhere"}
    exec("import warnings\ndef g():\n    warnings.warn('ours', stacklevel=2)\n", ours)
    theirs["g"] = ours["g"]
    monkeypatch.setenv(cli.DEBUG_ENV, "")  # --debug sets it; restored after the test

    def main(argv):
        exec("g()", theirs)  # ours, attributed by its stacklevel to a JAX module
        theirs["f"]()
        return 0

    for argv, shown in (([], ["ours"]), (["--debug"], ["ours", "theirs"])):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert cli.run(main, argv) == 0
        assert [str(w.message) for w in seen] == shown


@SLOW
def test_the_test_suite_leaves_nothing_in_the_system_temp_directory(tmp_path):
    """A run of the suite, as `make test` starts it (two xdist workers), removes the directories
    its processes made for their caches, and pytest keeps only failed tests' tmp_path: the runs
    of the trainer tests filled a CI machine's disk when they were kept."""
    system_tmp = tmp_path / "tmp"
    system_tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "LINEAR_GPT2_TEST_JAX_CACHE"}
    env.update(TMPDIR=str(system_tmp), PYTHONPATH=str(ROOT))
    test = "tests/test_cli.py::test_shard_with_ids_outside_the_vocabulary_fails_when_opened"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider", test, test],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not list(system_tmp.glob("linear_gpt2_tests_*")), sorted(system_tmp.iterdir())
    kept = [p for p in system_tmp.rglob("test_shard_with_ids*") if p.is_dir()]
    assert not kept, kept
