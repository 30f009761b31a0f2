"""The machine ``make gpu-check`` runs on: is there a GPU, the carried wheels, what the device
and packages are, the progress bars, and packing the results to take home.

The orchestrating process never starts a JAX backend (that would take most of the GPU's memory
from the units it starts): the GPU is found from the driver's device files, and what JAX sees
is asked of a short subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterable
from pathlib import Path

from linear_gpt2.platform.errors import DeviceError, RunError
from linear_gpt2.platform.provenance import REPO

DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0")
WHEELS = REPO / ".whl"
# Versions of what the kernels stage and the jax-triton test use, recorded with the results.
PACKAGES = ("torch", "triton", "jax-triton", "flash-linear-attention", "fla-core", "flax",
            "optax", "jax-cuda13-plugin")  # fmt: skip
# Not packed: the compilation cache, the installed wheels, the training runs' checkpoints and
# the kernels' reference outputs (large, and made again by a rerun).
PACK_SKIP = ("jax_cache", "site", "checkpoints", ".npz")


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
print("PROBE " + json.dumps(env))
"""


def probe(run_dir: Path) -> dict:
    """What JAX sees (device, versions, commit, allocator share) and the packages' versions,
    from a subprocess; written to ``run_dir/environment.json``."""
    code = f"PACKAGES = {PACKAGES!r}\n" + _PROBE
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
    (run_dir / "environment.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def run_with_progress(plan, run_dir: Path, args) -> list:
    """The runner with a progress bar per stage (rich) and a line per finished unit."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from linear_gpt2.experiments.gpu_check.runner import Runner, log_tail

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

    with progress:
        r = Runner(plan, run_dir, time_limit=args.time_limit, retry_failed=args.retry_failed,
                   report=report, progress=progress)  # fmt: skip
        return r.run()


def pack(run_dir: Path, written: Iterable[Path], out: Path) -> Path:
    """``out`` (``.tar.gz``): the run folder, less :data:`PACK_SKIP`, and the results files,
    as paths relative to the repository, to unpack at its root."""
    out.parent.mkdir(parents=True, exist_ok=True)

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = Path(info.name).parts
        if any(p in PACK_SKIP for p in parts) or info.name.endswith(".npz"):
            return None
        return info

    with tarfile.open(out, "w:gz") as tar:
        tar.add(run_dir, arcname=_rel(run_dir), filter=keep)
        for path in written:
            tar.add(path, arcname=_rel(path))
    return out


def _rel(path: Path) -> str:
    path = Path(path).absolute()
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return path.name
