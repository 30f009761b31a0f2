"""``make gpu-check`` (scripts/gpu_check.py, studies/gpu_check/) without a GPU:
the windows (each within its limit, window 1 the headline, a shorter limit smaller windows), the
one-line refusal on a machine without a GPU, a whole window's CPU path on tiny shapes with its
steps compiled into a store here and loaded by the units (pack, unpack and merge, reports;
an interrupted window resumed; an H200's archive in H200 files), and the H100 store's key: the
one a fresh process elsewhere computes, from inputs the last GPU run recorded."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from linear_gpt2.platform.errors import UsageError
from studies import common as reports
from studies.gpu_check import (
    compiled,
    host,
    learning,
    plan,
    profile,
    runner,
    stages,
    testfiles,
)
from tests.helpers import SLOW

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SCRIPT = ROOT / "scripts" / "gpu_check.py"
HAS_GPU = any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0"))
HEADLINE = [("step", f"124M_{k}") for k in ("1k", "4k", "16k", "64k")] + [
    ("kernels", "ours_1x12x64"), ("kernels", "fla_1x12x64")]  # fmt: skip


def run_script(*args: str, timeout: int = 900, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)  # fmt: skip


def _argv(u: plan.Unit) -> str:
    return " ".join(u.argv)


def test_windows_fit_their_limit_and_window_one_is_the_headline(tmp_path):
    p = stages.build(RESULTS, store=tmp_path / "no_store")
    wins = plan.windows(p, plan.WINDOW_LIMIT_S)
    assert all(w.seconds <= plan.WINDOW_LIMIT_S for w in wins), [w.seconds for w in wins]
    every = [k for w in wins for k in w.keys()]
    assert sorted(every) == sorted((s.name, u.name) for s in p.stages for u in s.units)
    assert wins[0].keys()[: len(HEADLINE)] == HEADLINE
    assert ("compile_ab", "124M_4k") in wins[0].keys()
    units = {(s.name, u.name): u for s in p.stages for u in s.units}
    for name, t in (("1k", 1024), ("4k", 4096), ("16k", 16384), ("64k", 65536)):
        argv = _argv(units[("step", f"124M_{name}")])
        assert f"--contexts {t} --attentions flash LT_chunked" in argv, argv
        assert argv.startswith("-m studies.gpu_check.compiled scripts/bench_step")
        assert int(re.search(r"--repeats (\d+)", argv)[1]) >= 5
    assert "--B 1 --H 12 --D 64 --Ts 4096 16384 65536" in _argv(units[("kernels", "ours_1x12x64")])
    assert "--peer fla" in _argv(units[("kernels", "fla_1x12x64")])
    assert "compiled" not in _argv(units[("compile_ab", "124M_4k")])  # compiled on the GPU
    # A shorter limit: smaller windows, more of them, the headline still first.
    short = plan.windows(p, 300)
    assert all(w.seconds <= 300 for w in short) and len(short) > len(wins)
    assert [k for w in short for k in w.keys()][: len(HEADLINE)] == HEADLINE
    assert max(len(w.items) for w in short) < max(len(w.items) for w in wins)
    _first_window_decides_the_glue_kernels(wins[0])
    # With most of window 1 done, what is left of it opens the next window, filled with the
    # following units up to the limit (not a short command of its remains).
    done = wins[0].keys()[:-2]
    left = plan.windows(p.without(done), plan.WINDOW_LIMIT_S)
    assert left[0].keys()[:2] == wins[0].keys()[-2:]
    assert wins[1].keys()[0] in left[0].keys() and not set(done) & {
        k for w in left for k in w.keys()
    }
    assert all(w.seconds <= plan.WINDOW_LIMIT_S for w in left)


def test_a_unit_that_failed_at_an_earlier_commit_runs_again():
    """A failure is not retried at the commit it happened at (it would spend the GPU's minutes
    again), but a new commit may be its fix; a record without a commit is retried too."""
    ok, failed = {"status": "ok"}, {"status": "failed", "git_commit": "abc"}
    assert runner.settled(ok, commit="def") and not runner.settled(None, commit="abc")
    assert runner.settled(failed, commit="abc") and runner.settled(failed, commit="abc+dirty")
    assert not runner.settled(failed, commit="def")
    assert not runner.settled(failed, retry_failed=True, commit="abc")
    assert not runner.settled({"status": "failed"}, commit="abc")


def test_dry_run_prints_the_windows_and_the_last_one_run(tmp_path):
    res = tmp_path / "res"
    shutil.copytree(RESULTS, res, ignore=shutil.ignore_patterns("*.png"))
    record = {"meta": {"how": "measured", "environment": {}}, "units": [], "windows": [{
        "window": 1, "device_kind": "NVIDIA H100 80GB HBM3", "estimate_s": 501.0,
        "seconds": 432.5, "units": 11, "units_done": 11, "started_utc": "2026-12-01T10:00:00Z"}]}  # fmt: skip
    (res / "gpu_check_h100_measured.json").write_text(json.dumps(record))
    r = run_script("--dry-run", "--time-limit", "300", "--results", str(res), "--run-dir",
                   str(tmp_path / "run"), "--store", str(tmp_path / "store"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert re.search(r"^make gpu-check on h100: \d+ windows of at most 300 s", out, re.M), out
    assert "last window run: 1 on NVIDIA H100 80GB HBM3, estimated 501 s, took 432 s" in out
    assert re.search(r"^window 1: estimated \d+ s of 300 .*<- next$", out, re.M)
    assert "step/124M_1k" in out.split("window 2:")[0]
    assert "priced from:\n  measured: " in out and re.search(
        r"^assumptions .*\n  \w+ = ", out, re.M
    )


@SLOW
def test_make_honours_dry_run_and_args():
    for cmd in (["make", "-n", "gpu-check"], ["make", "gpu-check", "ARGS=--dry-run"]):
        r = subprocess.run([*cmd, f"PY={sys.executable}"], capture_output=True, text=True,
                           cwd=ROOT, timeout=300)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert "dry run: nothing runs" in r.stdout and "window 1: estimated" in r.stdout


@pytest.mark.skipif(HAS_GPU, reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_it_says_so_in_one_line_and_does_nothing(tmp_path):
    r = run_script("--run-dir", str(tmp_path / "run"), "--results", str(tmp_path / "res"))
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no CUDA GPU"), r.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "res").exists()


def test_select_only_skip_and_a_bad_name():
    p = stages.build(RESULTS, tiny=True)
    assert [s.name for s in p.select(["step", "learning"]).stages] == ["step", "mqar", "context"]
    assert "tests" not in [s.name for s in p.select(skip=["tests"]).stages]
    with pytest.raises(UsageError, match="unknown stage 'steps'; the stages are checks, learning"):
        p.select(["steps"])


def test_an_archive_with_a_foreign_member_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "bad.tar.gz"
    (tmp_path / "x").write_text("x")
    with tarfile.open(bad, "w:gz") as tar:
        tar.add(tmp_path / "x", arcname="../escape")
    with pytest.raises(UsageError, match="unexpected member '../escape'"):
        host.unpack(bad, tmp_path / "dest")
    assert not (tmp_path / "escape").exists() and not (tmp_path / "dest").exists()


def test_counts_gpu_tests_from_the_source():
    src = """
import pytest
CASES = [1, 2, 3]
KERNELS = {"a": 1, "b": 2}
@pytest.mark.gpu
@pytest.mark.parametrize("k", list(KERNELS))
@pytest.mark.parametrize("d", ["f32", "bf16"])
def test_a(k, d): pass
@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES)
def test_b(c): pass
def test_not_gpu(): pass
"""
    assert testfiles.count_gpu_tests(src) == 2 * 2 + 3
    marked = "import pytest\npytestmark = [pytest.mark.gpu, pytest.mark.usefixtures('f')]\n"
    assert testfiles.count_gpu_tests(marked + "def test_a(): pass\ndef test_b(): pass\n") == 2
    files = testfiles.gpu_test_files(ROOT)
    assert "tests/test_kernels.py" in files and all(n > 0 for n in files.values())


def test_learning_summaries():
    s = learning.curve_summary([(25, 6.0), (50, 5.5), (75, 5.4), (100, 5.45), (125, 5.6)])
    assert (s["min_step"], s["min_loss"], s["rising_from"], s["final_loss"]) == (75, 5.4, 100, 5.6)
    assert learning.curve_summary([(1, 3.0), (2, 2.0)])["rising_from"] is None
    rows = [
        {"variant": "flash", "context": 128, "seed": 0, "final_loss": 5.0},
        {"variant": "flash", "context": 128, "seed": 1, "final_loss": 5.1},
        {"variant": "LT", "context": 128, "seed": 0, "final_loss": 5.4},
        {"variant": "LT", "context": 128, "seed": 1, "final_loss": 5.5},
    ]
    (g,) = learning.gaps(rows)
    assert g["variant"] == "LT" and g["gap"] == pytest.approx(0.4)
    assert g["seed_noise"] == pytest.approx(0.1) and g["above_noise"] is True


def test_profile_parses_device_ops_and_their_shares(tmp_path):
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 1, "name": "PjitFunction(step)", "ts": 0, "dur": 900.0},
        *(
            {
                "ph": "X",
                "pid": 2,
                "name": "gemm",
                "ts": i,
                "dur": 300.0,
                "args": {"hlo_op": "dot.7"},
            }
            for i in range(4)
        ),  # fmt: skip
        *({"ph": "X", "pid": 2, "name": "flash_fwd", "ts": i, "dur": 100.0} for i in range(4)),
    ]
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    p = profile.parse_trace(path, steps=2)
    assert p["where"] == "GPU" and p["device_ms"] == pytest.approx(0.8)
    assert [(o["name"], o["count"], o["share"]) for o in p["top"]] == [
        ("gemm", 2, pytest.approx(0.75)), ("flash_fwd", 2, pytest.approx(0.25))
    ]  # fmt: skip
    # Every op, with the instruction the trace names, to set beside the MODEL's price of it.
    assert [(o["name"], o["hlo_op"]) for o in p["ops"]] == [("gemm", "dot.7"), ("flash_fwd", None)]


def test_profile_keeps_the_program_it_traced_when_it_can_print_it(tmp_path):
    class Printable:
        def as_text(self):
            return "HloModule step"

    class Loaded:  # an executable loaded from a store prints nothing
        def as_text(self):
            raise RuntimeError("no HLO")

    path = tmp_path / "step.hlo.txt.gz"
    assert profile._save_program(Printable(), path) == "step.hlo.txt.gz"
    assert gzip.open(path, "rt").read() == "HloModule step"
    assert profile._save_program(Loaded(), tmp_path / "x.gz") is None
    assert not (tmp_path / "x.gz").exists()


def _page_is_rendered(path: Path) -> None:
    text = path.read_text()
    new, _ = reports.render_text(text, path.parent, path.name)
    assert new == text and "<!-- generated:" in text


def _as_h200(archive: Path, out: Path) -> None:
    """The archive as an H200's window would be: its environment says so."""
    tmp = out.parent / "h200_src"
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
    (run,) = (tmp / "runs" / "gpu_check").iterdir()
    env_path = run / "environment.json"
    env = json.loads(env_path.read_text())
    env.update(platform="gpu", device_kind="NVIDIA H200", label=None)
    env_path.write_text(json.dumps(env))
    for path in run.rglob("*.json"):  # and each unit's own provenance
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "environment" in data.get("meta", {}):
            data["meta"]["environment"].update(platform="gpu", device_kind="NVIDIA H200")
            path.write_text(json.dumps(data))
    with tarfile.open(out, "w:gz") as tar:
        tar.add(run, arcname=f"runs/gpu_check/{run.name}")


@SLOW
def test_tiny_window_compiled_here_run_packed_resumed_and_unpacked(tmp_path):
    """Window 1 of the tiny plan, as on the GPU: its steps compiled here into a store (for the
    CPU), the units in subprocesses loading them, an archive packed after every unit; a unit
    whose record is gone (a window cut short) runs again, and only it; the archive merged back
    into other folders with its reports and headline; the same archive as an H200's lands in
    H200 files beside the others, never in them."""
    res, run, store, out = tmp_path / "res", tmp_path / "run", tmp_path / "store", tmp_path / "out"
    shutil.copytree(RESULTS, res, ignore=shutil.ignore_patterns("*.png", "*_tiny_cpu_measured*"))
    common = ("--tiny", "--time-limit", "130", "--stop-after", "5000", "--run-dir", str(run),
              "--store", str(store), "--results", str(res))  # fmt: skip
    c = run_script(*common, "--compile-here", "--window", "1")
    assert c.returncode == 0, c.stdout[-2000:] + c.stderr[-2000:]
    index = json.loads((store / compiled.INDEX).read_text())
    assert sorted(e["setting"][0] for e in index.values()) == ["LT_chunked"] * 2 + ["flash"] * 2

    archive = out / "gpu_check.tar.gz"
    r = run_script(*common, "--window", "next", "--pack", str(archive), "--no-progress")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    p = stages.build(res, tiny=True, store=store)
    (w1, *_) = plan.windows(p, 130)
    assert [k for k in w1.keys()] == [("step", "tiny_64"), ("step", "tiny_128"),
                                      ("kernels", "ours_1x2x16"), ("kernels", "fla_1x2x16"),
                                      ("compile_ab", "tiny_64")]  # fmt: skip
    done = runner.done_units(run, p)
    assert set(done) == set(w1.keys()) and all(d["status"] == "ok" for d in done.values())
    for unit in ("tiny_64", "tiny_128"):  # every step the units asked for came from the store
        looked = [json.loads(ln) for ln in (run / "step" / unit / "compiled.jsonl").read_text()
                  .splitlines()]  # fmt: skip
        assert [e["status"] for e in looked] == ["loaded", "loaded"], looked
    assert not (run / "compile_ab" / "tiny_64" / "compiled.jsonl").exists()
    rec = json.loads((run / "windows.jsonl").read_text().splitlines()[-1])
    assert rec["window"] == 1 and rec["units_done"] == 5 and len(rec["unit_times"]) == 5

    # Cut short before step/tiny_128 finished: only it runs again.
    kept = {k: (run / k[0] / k[1] / runner.DONE).stat().st_mtime_ns for k in w1.keys()}
    (run / "step" / "tiny_128" / runner.DONE).unlink()
    # The windows are cut from what is left: window 1 is now step/tiny_128 and what follows it
    # (the step stage alone here, to keep the test short), never a finished unit.
    dry = run_script(*common, "--dry-run")
    assert "4 units done in the run folder, not listed" in dry.stdout, dry.stdout[:2000]
    assert re.search(r"^window 1: .*<- next\n.*\n  step/tiny_128 ", dry.stdout, re.M), dry.stdout
    again = run_script(*common, "--only", "step", "--window", "next", "--no-progress")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert re.findall(r"^(\S+): ok in", again.stdout, re.M) == ["step/tiny_128"], again.stdout
    for k, mtime in kept.items():
        if k != ("step", "tiny_128"):
            assert (run / k[0] / k[1] / runner.DONE).stat().st_mtime_ns == mtime, k
    nothing = run_script(*common, "--window", "next", "--stop-after", "1", "--no-progress")
    assert "window 1 of" in nothing.stdout and "stopped at the time limit" in nothing.stdout

    # Back here, into other folders.
    back_res, back_runs = tmp_path / "back_res", tmp_path / "back_runs"
    shutil.copytree(
        RESULTS, back_res, ignore=shutil.ignore_patterns("*.png", "*_tiny_cpu_measured*")
    )
    u = run_script("--unpack", str(archive), "--results", str(back_res), "--runs", str(back_runs))
    assert u.returncode == 0, u.stdout[-2000:] + u.stderr[-2000:]
    assert "before:\n(no results of tiny_cpu yet)" in u.stdout and "\nafter:\n" in u.stdout
    assert "| tiny | `LT_chunked` | 64 |" in u.stdout.split("after:")[1]
    for name in ("step_time", "kernels", "compile_ab", "gpu_check"):
        data = json.loads((back_res / f"{name}_tiny_cpu_measured.json").read_text())
        assert data["meta"]["how"] == "measured", name
        assert f"{name}_tiny_cpu_measured.json" in (back_res / "README.md").read_text()
    ab = json.loads((back_res / "compile_ab_tiny_cpu_measured.json").read_text())["rows"]
    assert {r["attention"] for r in ab} == {"flash", "LT_chunked"}
    assert all(r["loaded"] == r["looked_up"] == 2 and r["ratio"] > 0 for r in ab)
    _page_is_rendered(back_res / "gpu_check_tiny_cpu_measured.md")
    assert (back_runs / "tiny_cpu" / "step" / "tiny_64" / runner.DONE).is_file()

    h200 = tmp_path / "h200.tar.gz"
    _as_h200(archive, h200)
    others = "*_tiny_cpu_measured.*", "*h100*"
    before = {f.name: f.read_bytes() for g in others for f in back_res.glob(g)}
    v = run_script("--unpack", str(h200), "--results", str(back_res), "--runs", str(back_runs))
    assert v.returncode == 0, v.stdout[-2000:] + v.stderr[-2000:]
    assert "not compared with the H100's" in v.stdout and "post" not in v.stdout.split("after:")[1]
    steps = json.loads((back_res / "step_time_h200_measured.json").read_text())
    assert steps["meta"]["environment"]["device_kind"] == "NVIDIA H200"
    assert (back_runs / "h200" / "step" / "tiny_64" / runner.DONE).is_file()
    assert {f.name: f.read_bytes() for g in others for f in back_res.glob(g)} == before


KEY_SCRIPT = textwrap.dedent("""
    import json, sys
    import linear_gpt2
    from studies.gpu_check import compiled
    from tests_key_program import program
    print("KEY " + compiled.jax_key(compiled.lower_for(*program(), "h100")))
    print("FROM " + compiled.__file__)
""")
KEY_PROGRAM = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from linear_gpt2 import attention
    from studies.gpu_check import compiled

    def program():
        fn = attention.get("LT_chunked", kernel="pallas", chunk_size=16)
        x = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.bfloat16, sharding=compiled.replicated("h100"))
        return jax.jit(fn), (x, x, x)
""")


def test_the_h100_store_key_is_the_one_the_gpu_computes(tmp_path):
    """A program with a Pallas kernel (its Triton IR carries source locations) compiled here
    for the H100 into a store; a fresh process, from a copy of the package in another folder
    (the GPU machine's checkout) and another working directory, lowers it again and computes
    the same key: the key's machine fields are the target's on both sides. The inputs the GPU
    supplies, jaxlib's version and the device kind, are those the last GPU run recorded; JAX's
    own persistent-cache key of a deviceless compile would not match on the fields named."""
    import jaxlib

    (tmp_path / "tests_key_program.py").write_text(KEY_PROGRAM)
    sys.path.insert(0, str(tmp_path))
    try:
        from tests_key_program import program
    finally:
        sys.path.remove(str(tmp_path))
    store = compiled.Store(tmp_path / "store")
    entry = compiled.compile_into(store, compiled.lower_for(*program(), "h100"), "h100",
                                  {"what": "LT_chunked pallas fwd [1, 64, 2, 16]"})  # fmt: skip
    assert entry["key"] in store and entry["bytes"] > 0

    elsewhere = tmp_path / "checkout"
    for package in ("linear_gpt2", "studies"):
        shutil.copytree(ROOT / package, elsewhere / package,
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    shutil.copy(tmp_path / "tests_key_program.py", elsewhere)
    env = {**os.environ, "PYTHONPATH": str(elsewhere)}
    r = subprocess.run([sys.executable, "-c", KEY_SCRIPT], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"FROM {elsewhere}" in r.stdout
    assert re.search(r"^KEY (\S+)$", r.stdout, re.M)[1] == entry["key"]

    gpu, source = host.last_gpu_environment(RESULTS)
    assert gpu["device_kind"] == compiled.target_kind("h100") == "NVIDIA H100 80GB HBM3", source
    assert gpu["jaxlib_version"] == jaxlib.__version__
    fields = {f["field"]: f for f in compiled.plain_cache_fields(gpu)}
    assert fields["jax_lib version"]["match"] and fields["device kind"]["match"]
    assert fields["backend version"]["here"].startswith("PJRT C API")
    if "backend_platform_version" not in gpu:  # no GPU run has recorded these yet
        assert fields["backend version"]["match"] is None
        assert fields["accelerator config"]["match"] is None


def test_compile_ab_without_loaded_steps_says_what_its_ratio_is():
    """On a card the store was not compiled for (an H200), no step is loaded: the page must not
    call the step unit's column 'loaded'."""
    from studies.common.core import Raw
    from studies.gpu_check import report as page

    row = {"attention": "flash", "size": "124M", "context": 4096, "chunk_size": None,
           "loaded_ms": 21.96, "compiled_there_ms": 21.66, "ratio": 21.96 / 21.66}  # fmt: skip
    meta = {"how": "measured", "environment": {"device_kind": "NVIDIA H200"}}
    none = page.compile_ab(
        Raw("x.json", {"meta": meta, "rows": [{**row, "loaded": 0, "looked_up": 0}]})
    )
    assert "none loaded" in none and "loaded median ms" not in none and "step unit / there" in none
    some = page.compile_ab(
        Raw("x.json", {"meta": meta, "rows": [{**row, "loaded": 2, "looked_up": 2}]})
    )
    assert "2 of 2 steps loaded" in some and "| loaded median ms |" in some.replace("\n", "|")


def _first_window_decides_the_glue_kernels(w1: plan.Window) -> None:
    """Window 1 holds the glue kernels' gpu tests and the 124M step timed with them at pallas
    beside xla, and unrolled as well, in one process per point (1k with flash too, 16 x 1k,
    64k), each priced."""
    keys = w1.keys()
    assert ("tests", "test_kernels_glue_gpu") in keys
    glue = {u.name: u for s, u in w1.items if s.name == "glue"}
    assert set(glue) == {"124M_1k", "124M_16x1k", "124M_64k"}
    for u in glue.values():
        argv = _argv(u)
        assert argv.startswith("scripts/bench_step.py --sizes 124M"), argv  # compiled on the GPU
        found = r"--side-by-side (xla:\S+) (pallas:\S+) (unrolled:\S+)"
        xla, pallas, unrolled = re.search(found, argv).groups()
        for k in ("layernorm_kernel", "mlp_kernel", "loss_kernel", "bias_kernel"):
            assert f"{k}=xla" in xla and f"{k}=pallas" in pallas and f"{k}=pallas" in unrolled
        # The baseline and the candidate are the scanned step (auto unrolls on a GPU).
        assert "scan_layers=False" in unrolled
        assert "scan_layers=True" in pallas and "scan_layers=True" in xla
        assert "--model remat=none" in argv and u.seconds > 20
    assert "--batch 16" in _argv(glue["124M_16x1k"]) and "--contexts 65536" in _argv(
        glue["124M_64k"]
    )
    assert "--attentions LT_chunked flash" in _argv(glue["124M_1k"])


def _glue_raw(ratios: dict[str, float], tests: list[str] | None, unrolled: float | None = None):
    """The glue stage's raw file: ``pallas`` at ``ratios`` of xla per point; with ``unrolled``,
    a third setting at that ratio of pallas (failed at the first point: not pallas's verdict)."""
    from studies.common.core import Raw

    env = {"device_kind": "NVIDIA H100 80GB HBM3", "git_commit": "abc", "jax_version": "0.11.2"}
    sets = {"xla": {}, "pallas": {}} | ({"unrolled": {"scan_layers": False}} if unrolled else {})
    meta = {"how": "measured", "environment": env, "settings": {
        "dtype": "bfloat16", "warmup": 2, "rounds": 2, "repeats": 4, "side_by_side": sets}}  # fmt: skip
    rows = [{"attention": "LT_chunked", "size": "124M", "context": t, "batch": b,
             "chunk_size": 64, "baseline": "xla", "median_ms": {"xla": 10.0, "pallas": 10.0 * x},
             "status": {"xla": "ok", "pallas": "ok"}, "ratio": {"pallas": x},
             "round_ratios": {"pallas": [x, x * 1.01]}, "memory_bytes": {}}
            for (t, b), x in ((tuple(map(int, k.split("x"))), x) for k, x in ratios.items())]  # fmt: skip
    for i, r in enumerate(rows if unrolled else []):
        u = r["median_ms"]["pallas"] * unrolled
        r["median_ms"]["unrolled"], r["ratio"]["unrolled"] = u, u / 10.0
        r["round_ratios"]["unrolled"] = [u / 10.0] * 2
        r["status"]["unrolled"] = "failed: out of memory" if i == 0 else "ok"
    glue = Raw("glue_ab_h100_measured.json", {"meta": meta, "rows": rows})
    if tests is None:
        return glue, None
    files = [{"file": "tests/test_kernels_glue_gpu.py",
              "tests": [{"name": f"t{i}", "outcome": o} for i, o in enumerate(tests)]}]  # fmt: skip
    return glue, Raw("gpu_tests_h100_measured.json", {"meta": meta, "files": files})


def test_the_glue_page_says_which_setting_won_and_by_how_much():
    from studies.gpu_check import report as page

    on = page.glue(*_glue_raw({"1024x1": 0.8, "1024x16": 0.5}, ["passed", "passed"]))
    row = "| `LT_chunked` 124M 16 x 1k, chunk 64 | `pallas` | 10 | 5 | 0.500 | `pallas` 2.000x | 2 of 2 |"
    assert row in on
    assert "**`pallas` won at every point** (its step time / `xla`'s 0.500 to 0.800)" in on
    assert "2 of 2 passed" in on and "may be turned on" in on
    # A third setting (the blocks unrolled) is reported against pallas, beside the verdict: it
    # neither makes nor breaks it, even where it failed.
    three = page.glue(*_glue_raw({"1024x1": 0.8, "1024x16": 0.5}, ["passed"] * 2, unrolled=0.6))
    assert row in three and "may be turned on" in three
    assert "| `LT_chunked` 124M 16 x 1k, chunk 64 | `unrolled` | 10 | 3 | 0.300 |" in three
    assert ("`unrolled` (`model.scan_layers: false`) against `pallas`, step time / `pallas`'s: "
            "`LT_chunked` 124M 16 x 1k, chunk 64 0.600.") in three  # fmt: skip
    slow = page.glue(*_glue_raw({"1024x1": 1.25, "65536x1": 0.5}, ["passed", "failed"]))
    assert "`xla` 1.250x" in slow and "**Keep `AUTO_PICKS_PALLAS` off**" in slow
    assert "not faster at `LT_chunked` 124M 1k, chunk 64 (1.250)" in slow
    assert "a gpu test did not pass" in slow and "`t1` failed" in slow
    untested = page.glue(*_glue_raw({"1024x1": 0.9}, None))
    assert "have not run on this device" in untested and "Keep `AUTO_PICKS_PALLAS` off" in untested


def test_the_readme_glue_summary_gives_each_settings_range_over_the_points_that_ran():
    from studies.gpu_check import report as page

    glue, _ = _glue_raw({"1024x1": 0.8, "1024x16": 0.5, "65536x1": 0.7}, None, unrolled=0.6)
    text = page.glue_summary(glue)
    assert text.startswith("Measured on NVIDIA H100 80GB HBM3, jax 0.11.2, commit abc")
    # unrolled failed at the first point: its range is over the two that ran (0.30 and 0.42).
    assert "`pallas` 0.50 to 0.80, `unrolled` 0.30 to 0.42" in text
    assert "`LT_chunked` 124M 1k, chunk 64; `LT_chunked` 124M 16 x 1k, chunk 64;" in text


def test_the_run_page_gives_the_glue_verdict_the_gpu_tests_too(tmp_path):
    """The run's page (gpu_check_<dev>_measured.md) renders the glue block from the glue file
    and the gpu tests' file, as the glue page does: with the glue file alone it said to keep
    AUTO_PICKS_PALLAS off because the tests had not run, beside a tests table that had them."""
    from studies.gpu_check import page

    glue, tests = _glue_raw({"1024x1": 0.8}, ["passed"])
    for raw in (glue, tests):
        (tmp_path / raw.path).write_text(json.dumps(raw.data))
    text = page.template(tmp_path, "h100")
    assert "generated: gpu_check.glue glue_ab_h100_measured.json gpu_tests_h100_measured.json" in (
        text
    )
    assert "generated: gpu_check.glue glue_ab_h100_measured.json gpu_tests_h100_measured.json" in (
        page.glue_template(tmp_path, "h100")
    )
    (tmp_path / tests.path).unlink()
    assert "generated: gpu_check.glue glue_ab_h100_measured.json -->" in page.template(
        tmp_path, "h100"
    )


@SLOW
def test_tiny_glue_unit_times_every_setting_side_by_side_and_renders_its_page(tmp_path):
    """The glue stage's CPU path on tiny shapes, as a window runs it: one process compiles the
    step at xla, at pallas and unrolled, and times them in alternating rounds; the collector writes the
    results file and the page that says which won."""
    res, run = tmp_path / "res", tmp_path / "run"
    shutil.copytree(RESULTS, res, ignore=shutil.ignore_patterns("*.png", "*_tiny_cpu_measured*"))
    r = run_script("--tiny", "--only", "glue", "--time-limit", "130", "--stop-after", "5000",
                   "--run-dir", str(run), "--results", str(res), "--store", str(tmp_path / "s"),
                   "--no-progress")  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    step = json.loads((run / "glue" / "tiny_64" / "step.json").read_text())
    rows = {x["variant"]: x for x in step["results"]}
    assert rows["pallas"]["overrides"]["mlp_kernel"] == "pallas"
    assert rows["xla"]["overrides"]["mlp_kernel"] == "xla"
    assert rows["unrolled"]["overrides"]["scan_layers"] is False
    assert rows["unrolled"]["overrides"]["mlp_kernel"] == "pallas"
    assert all(len(x["rounds_ms"]) == 2 and x["median_ms"] > 0 for x in rows.values())
    (pair,) = step["side_by_side"]
    assert pair["ratio"]["pallas"] == pytest.approx(
        rows["pallas"]["median_ms"] / rows["xla"]["median_ms"])  # fmt: skip
    data = json.loads((res / "glue_ab_tiny_cpu_measured.json").read_text())
    assert data["meta"]["how"] == "measured" and len(data["rows"]) == 1
    md = res / "glue_ab_tiny_cpu_measured.md"
    _page_is_rendered(md)
    assert (
        "AUTO_PICKS_PALLAS" in md.read_text()
        and "| `LT_chunked` tiny 64, chunk 16 | `unrolled` |" in md.read_text()
        and "`unrolled` (`model.scan_layers: false`) against `pallas`" in md.read_text()
    )
    assert "gpu_check.glue" in (res / "gpu_check_tiny_cpu_measured.md").read_text()


@SLOW
def test_tiny_glue_kernels_unit_times_the_launches_beside_xla_and_renders_them(tmp_path):
    """The glue_kernels stage's CPU path (interpret mode, tiny widths, the default and one
    other launch per kernel): every kernel's rows, XLA's beside the default, the collector's
    results file and its block on the run page."""
    from linear_gpt2.kernels import launch

    res, run = tmp_path / "res", tmp_path / "run"
    shutil.copytree(RESULTS, res, ignore=shutil.ignore_patterns("*.png", "*_tiny_cpu_measured*"))
    r = run_script("--tiny", "--only", "glue_kernels", "--time-limit", "130", "--stop-after",
                   "5000", "--run-dir", str(run), "--results", str(res), "--store",
                   str(tmp_path / "s"), "--no-progress")  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    data = json.loads((res / "glue_kernels_tiny_cpu_measured.json").read_text())
    assert data["meta"]["how"] == "measured"
    got = {(x["kernel"], x["impl"], x["default"]) for x in data["rows"]}
    for name in launch.CANDIDATES:
        assert {(name, "xla", False), (name, "pallas", True), (name, "pallas", False)} <= got
    ok = [x for x in data["rows"] if x["status"] == "ok"]
    assert len(ok) == 3 * len(launch.CANDIDATES) and all(x["net_ms"] > 0 for x in ok)
    for x in ok:  # the kernels that write over an input have the copy of it taken off
        aliased = x["kernel"] in ("cross_entropy", "layernorm_bwd", "bias_gelu_bwd")
        assert (x["copy_ms"] is not None) == (aliased and x["impl"] == "pallas"), x
    text = (res / "gpu_check_tiny_cpu_measured.md").read_text()
    assert "gpu_check.glue_kernels" in text and "| `layernorm_bwd` | 37 |" in text
    _page_is_rendered(res / "gpu_check_tiny_cpu_measured.md")
