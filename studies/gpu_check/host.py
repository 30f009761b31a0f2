"""The machine ``make gpu-check`` runs on: is there a GPU, the carried wheels, what the device
and packages are (and what JAX's compilation-cache key would read from them), the progress
bars, packing the results to take home, and unpacking them back here.

The orchestrating process never starts a JAX backend (that would take most of the GPU's memory
from the units it starts): the GPU is found from the driver's device files, and what JAX sees
is asked of a short subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable
from pathlib import Path

from linear_gpt2.platform.errors import DeviceError, RunError
from linear_gpt2.platform.provenance import REPO

DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0")
WHEELS = REPO / ".whl"
# Versions of what the kernels stage and the jax-triton test use, recorded with the results.
PACKAGES = ("torch", "triton", "jax-triton", "flash-linear-attention", "fla-core", "flax",
            "optax", "jax-cuda13-plugin")  # fmt: skip
# Whether each imports on the machine (recorded: what the image lacks, for the wheel list).
MODULES = ("flax", "optax", "orbax", "omegaconf", "einops", "fla", "jax_triton", "tensorstore",
           "etils", "msgpack", "treescope", "transformers", "rich", "yaml", "zstandard")  # fmt: skip
# Not packed: the compilation cache, the installed wheels, the training runs' checkpoints and
# the kernels' reference outputs (large, and made again by a rerun).
PACK_SKIP = ("jax_cache", "site", "checkpoints", ".npz")
# Where runs and the store live, relative to the repository (what the device command carries).
RUNS = Path("runs") / "gpu_check"


COMMIT_FILE = RUNS / "commit.json"  # what make gpu-compile saw: for a copy without .git


def record_commit() -> None:
    """``runs/gpu_check/commit.json``: this tree's commit, carried to the GPU machine, whose
    copy of the work tree may have no git folder to ask."""
    import time

    from linear_gpt2.platform.provenance import git_commit

    path = REPO / COMMIT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"commit": git_commit(), "written_utc": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n")  # fmt: skip


def commit_from_file() -> None:
    """Without git here, tell provenance (and the units) the commit ``make gpu-compile``
    recorded."""
    from linear_gpt2.platform.provenance import COMMIT_ENV

    path = REPO / COMMIT_FILE
    if (REPO / ".git").exists() or COMMIT_ENV in os.environ or not path.is_file():
        return
    commit = json.loads(path.read_text()).get("commit")
    if commit:
        os.environ[COMMIT_ENV] = commit
        os.environ["LINEAR_GPT2_COMMIT_SOURCE"] = f"{COMMIT_FILE} (make gpu-compile; no git here)"


def device_label(env: dict) -> str:
    """The name a run's files carry: ``h100`` / ``h200`` for those GPUs (the figures of an
    H200 are kept apart from the H100's, never compared), else the device kind made
    file-safe; the CPU path's own label (``tiny_cpu``)."""
    from linear_gpt2.platform.provenance import device_slug

    if env.get("platform") != "gpu":
        return env.get("label") or "tiny_cpu"
    kind = str(env.get("device_kind") or "")
    for name in ("H100", "H200", "B200", "A100"):
        if name in kind.upper():
            return name.lower()
    return device_slug(kind)


def require_gpu() -> None:
    if not any(os.path.exists(p) for p in DEVICE_FILES):
        raise DeviceError(
            "no CUDA GPU on this machine (no /dev/nvidia0): make gpu-check runs on a lent GPU "
            "machine; here, make gpu-check --dry-run prints its plan and estimate"
        )


def install_wheels(site: Path = REPO / ".cache" / "gpu_check" / "site") -> None:
    """Install the wheels of ``.whl/`` (``make gpu-wheels``) into ``site`` once, and put that
    folder first on this process's path and its units': the GPU machine cannot reach a package
    index, and its image lacks some of what the configs and the kernels stage import."""
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        return
    marker = site / ".installed"
    names = "\n".join(w.name for w in wheels)
    if not (marker.is_file() and marker.read_text() == names):
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
               "--no-compile", "--upgrade", "--target", str(site), *map(str, wheels)]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True)
        site.mkdir(parents=True, exist_ok=True)
        if r.returncode != 0:
            raise RunError(f"installing .whl/ failed: {r.stderr.strip().splitlines()[-1:]}")
        marker.write_text(names)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(site), os.environ.get("PYTHONPATH")])
    )


_PROBE = """
import json, os
from importlib import metadata
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
import linear_gpt2
from linear_gpt2.platform import provenance
env = provenance.environment()
env.update(provenance.allocator())
versions = {}
for name in PACKAGES:
    try:
        versions[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        versions[name] = None
env["packages"] = versions
env["commit_source"] = os.environ.get("LINEAR_GPT2_COMMIT_SOURCE", "git")
import importlib.util
env["modules"] = {m: importlib.util.find_spec(m) is not None for m in MODULES}
# What JAX's compilation-cache key reads from this machine (gpu_check/compiled.py): recorded so
# that a later session can tell whether a deviceless compile's key could equal the GPU's own.
import importlib.util
import jax
from jax._src.lib import xla_client
dev = jax.devices()[0]
env["backend_platform_version"] = dev.client.platform_version
env["xla_flags"] = os.environ.get("XLA_FLAGS", "")
env["compression"] = "zstandard" if importlib.util.find_spec("zstandard") else "zlib"
env["compute_capability"] = getattr(dev, "compute_capability", None)
try:
    topo = xla_client.get_topology_for_devices(jax.devices()[:1])
    env["topology_fingerprint"] = topo.fingerprint()
    import base64
    env["topology_serialized_b64"] = base64.b64encode(topo.serialize()).decode()
except Exception as e:
    env["topology_fingerprint"] = f"unavailable: {type(e).__name__}: {e}"[:200]
try:
    from jax._src.lib import cuda_versions
    env["cuda"] = {k: getattr(cuda_versions, k)() for k in (
        "cuda_driver_get_version", "cuda_runtime_get_version", "cudnn_get_version",
        "cuda_runtime_build_version", "cudnn_build_version")}
except Exception as e:
    env["cuda"] = f"unavailable: {type(e).__name__}"
print("PROBE " + json.dumps(env))
"""


def probe(run_dir: Path | None = None) -> dict:
    """What JAX sees (device, versions, commit, allocator share), the packages' versions, and
    the fields of JAX's cache key this machine supplies (platform version, topology
    fingerprint, CUDA driver and libraries, compressor, XLA flags), from a subprocess;
    written to ``run_dir/environment.json`` when given."""
    code = f"PACKAGES = {PACKAGES!r}\nMODULES = {MODULES!r}\n" + _PROBE
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO
    )
    found = [ln for ln in r.stdout.splitlines() if ln.startswith("PROBE ")]
    if not found:
        raise RunError(f"could not start JAX here: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    info = json.loads(found[-1][len("PROBE ") :])
    if run_dir is not None:
        write_environment(run_dir, info)
    return info


def write_environment(run_dir: Path, info: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "environment.json").write_text(json.dumps(info, indent=1) + "\n")


def run_with_progress(plan, run_dir: Path, args, *, segments=None, start=None, store=None,
                      target: str = "h100", after=None) -> list:  # fmt: skip
    """The runner over ``segments`` (a window's) with a progress bar per stage (rich), a line
    per finished unit, and ``after(outcome)`` (merge and pack) once each has ended."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from studies.gpu_check.runner import Runner, log_tail

    console = Console(stderr=False)
    progress = Progress(
        TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=console, disable=args.no_progress,
    )  # fmt: skip

    def report(o) -> None:
        note = f" ({log_tail(run_dir, o.stage, o.unit, 1)})" if o.status == "failed" else ""
        console.print(
            f"{o.stage}/{o.unit}: {o.status} in {o.seconds:.0f} s (estimate {o.estimate_s:.0f} s)"
            + note
        )
        if after is not None:
            after(o)

    limit = getattr(args, "stop_after", None) or args.time_limit
    if limit is None and segments is not None:
        from studies.gpu_check.plan import WINDOW_LIMIT_S

        limit = WINDOW_LIMIT_S
    with progress:
        r = Runner(plan, run_dir, time_limit=limit, retry_failed=args.retry_failed,
                   report=report, progress=progress, start=start, store=store, target=target)  # fmt: skip
        return r.run(segments)


def bundle_sizes(carried: tuple[str, ...] = (".whl", str(RUNS))) -> dict[str, int]:
    """Bytes that travel with a device command: the tracked files (and untracked ones git does
    not ignore), and each carried ignored path."""
    out: dict[str, int] = {}
    r = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       cwd=REPO, capture_output=True, text=True)  # fmt: skip
    tracked = 0
    for name in filter(None, r.stdout.split("\0")):
        path = REPO / name
        if path.is_file():
            tracked += path.stat().st_size
    out["tracked files"] = tracked
    for c in carried:
        root = REPO / c
        out[c] = (
            sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0
        )
    return out


def last_gpu_environment(results: Path) -> tuple[dict, str]:
    """What the last GPU run recorded of its machine: ``gpu_check_h100_measured.json``'s
    environment (with the key fields ``host.probe`` records), else the newest measured H100
    results file's ``meta.environment`` (device kind and versions only)."""
    results = Path(results)
    path = results / "gpu_check_h100_measured.json"
    if path.is_file():
        meta = json.loads(path.read_text()).get("meta", {})
        env = {**meta.get("environment", {}), **(meta.get("machine") or {})}
        return env, path.name
    best: tuple[str, dict, str] | None = None
    for f in sorted(results.glob("*h100*.json")):
        try:
            env = json.loads(f.read_text()).get("meta", {}).get("environment", {})
        except (OSError, json.JSONDecodeError):
            continue
        if env.get("platform") == "gpu":
            when = env.get("time_utc") or ""
            if best is None or when > best[0]:
                best = (when, env, f.name)
    return (best[1], best[2]) if best else ({}, "no GPU run recorded")


def pack(run_dir: Path, written: Iterable[Path], out: Path, label: str | None = None) -> Path:
    """``out`` (``.tar.gz``): the run folder, less :data:`PACK_SKIP`, as
    ``runs/gpu_check/<label>/``, and the results files as ``benchmarks/results/<name>``."""
    out.parent.mkdir(parents=True, exist_ok=True)

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = Path(info.name).parts
        if any(p in PACK_SKIP for p in parts) or info.name.endswith(".npz"):
            return None
        return info

    # Written beside and renamed: a window stopped while packing leaves the last whole archive.
    tmp = out.with_name(out.name + ".part")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(run_dir, arcname=str(RUNS / (label or run_dir.name)), filter=keep)
        for path in written:
            tar.add(path, arcname=f"benchmarks/results/{Path(path).name}")
    tmp.replace(out)
    return out


def unpack(archive: Path, dest: Path) -> tuple[Path, dict]:
    """Extract ``archive`` (made by :func:`pack`) into ``dest``; returns the run folder in it
    and its ``environment.json``. Only ``runs/gpu_check/<label>/...`` and
    ``benchmarks/results/<file>`` are accepted: anything else (absolute, ``..``, links) is
    refused in one line before anything is written."""
    from linear_gpt2.platform.errors import UsageError

    try:
        tar = tarfile.open(archive, "r:*")
    except (OSError, tarfile.TarError) as e:
        raise UsageError(f"cannot read {archive} as an archive of make gpu-check ({e}); pass "
                         "the gpu_check.tar.gz a device command wrote to $OUT") from None  # fmt: skip
    with tar:
        members = tar.getmembers()
        runs = set()
        for m in members:
            parts = Path(m.name).parts
            ok = not Path(m.name).is_absolute() and ".." not in parts and (m.isfile() or m.isdir())
            ok = ok and (parts[:2] == RUNS.parts and len(parts) >= 3 or (
                parts[:2] == ("benchmarks", "results") and len(parts) == 3))  # fmt: skip
            if not ok:
                raise UsageError(f"{archive}: unexpected member {m.name!r}; it is not an "
                                 "archive of make gpu-check (nothing was unpacked)")  # fmt: skip
            if parts[:2] == RUNS.parts:
                runs.add(parts[2])
        if len(runs) != 1:
            raise UsageError(f"{archive} holds {len(runs)} run folders ({sorted(runs)}); "
                             "expected one")  # fmt: skip
        tar.extractall(dest, members=members, filter="data")
    run = dest / RUNS / runs.pop()
    env_path = run / "environment.json"
    if not env_path.is_file():
        raise UsageError(f"{archive}: no environment.json in its run folder; nothing to merge")
    return run, json.loads(env_path.read_text())


def merge_run(src: Path, dest: Path) -> list[str]:
    """The unit folders of ``src`` copied into run folder ``dest`` (a unit there is replaced
    by the archive's: it is newer); ``environment.json`` and the window records too. Returns
    the units merged (``stage/unit``)."""
    merged = []
    dest.mkdir(parents=True, exist_ok=True)
    for item in sorted(src.iterdir()):
        if item.is_file():
            if item.name == "windows.jsonl" and (dest / item.name).is_file():
                old = (dest / item.name).read_text().splitlines()
                new = [ln for ln in item.read_text().splitlines() if ln not in old]
                (dest / item.name).write_text("\n".join([*old, *new]) + "\n")
            else:
                shutil.copy2(item, dest / item.name)
            continue
        for unit in sorted(p for p in item.iterdir() if p.is_dir()):
            target = dest / item.name / unit.name
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(unit, target)
            merged.append(f"{item.name}/{unit.name}")
    return merged


def scratch() -> Path:
    return Path(tempfile.mkdtemp(prefix="gpu_check_unpack_"))
