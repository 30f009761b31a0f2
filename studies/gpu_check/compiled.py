"""Compile here, run there: training steps compiled on the CPU machine for the H100, carried to
the lent GPU in a store, and loaded there instead of compiled.

A lent GPU gives 15 minutes, and compiling the steps of a window on it takes a good share of
them (``compile_s`` in ``benchmarks/results/step_time_h100_*.json``). Here the same programs
compile deviceless (``platform/target.py``) and
:func:`jax.experimental.serialize_executable.serialize` writes them to a :class:`Store`
(``runs/gpu_check/compiled/<target>/``: one lzma-compressed payload per program and
``index.json``). On the GPU, ``step_time.compile_step`` asks the store first
(:func:`install`): the step is lowered again (no compile) for the same target, its key
looked up, and the payload loaded onto the GPU with ``deserialize_and_load``; a miss compiles
on the GPU as before. Each look-up is recorded (``LOG_ENV``), and the dry run prices the
loaded programs as loads.

**The key** is JAX's own (``jax._src.cache_key.get``), taken from the compile JAX is about to
run (:func:`jax_key`: the compile is stopped once JAX has its key), so the program, the
compile options JAX builds, jaxlib's version and ``XLA_FLAGS`` are hashed as JAX hashes them.
Its two machine fields are the compile target's on both machines, by construction: the
*backend version* is that of the compile-only client of :func:`target_devices` and the
*accelerator config* the fingerprint of its topology, whose host CPU is pinned
(:data:`PINNED_HOST`: otherwise the fingerprint names the CPU of the machine that made the
topology). The compression named in the key is fixed (:data:`COMPRESSION`), where JAX names
whichever compressor imports. What differs between machines is then what should: the code
(the program), jaxlib, the flags. The GPU's device kind must equal the target's for a load.

Why not JAX's persistent cache itself: a deviceless compile's entry carries the compile-only
client's platform version (``PJRT C API`` + the target's device name) and its topology's
fingerprint (the target description and this host's CPU), where the GPU's carries its plugin's
CUDA version and the fingerprint of the real device's description (clocks, driver, cuDNN, its
host's CPU), which no GPU run had recorded (:func:`plain_cache_fields`; ``host.probe`` records
them from now on). And a compile-only client cannot read a cache entry back (``PjRtCompiler
must be constructed with a Client``), so the GPU cannot look up under the target's key with
JAX's own reader either.

A deviceless compile autotunes nothing (matmul tiles are XLA's defaults): the headline window
also times one setting compiled on the GPU (``compile_ab``), so the loaded steps' times are
checked against device-compiled ones in the same session.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import lzma
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Any

STORE_ENV = "LINEAR_GPT2_COMPILED_STORE"  # the store the units load from (runner sets it)
LOG_ENV = "LINEAR_GPT2_COMPILED_LOG"  # JSON lines: one per look-up (hit or miss, why)
TARGET_ENV = "LINEAR_GPT2_COMPILED_TARGET"  # h100 (default), or cpu (the tests)
PINNED_HOST = 'triple: "x86_64-unknown-linux-gnu" cpu: "x86-64"'
COMPRESSION = "zlib"
INDEX = "index.json"
# Source locations as paths from the package or the site-packages folder: Pallas's Triton
# kernels carry their IR, locations included, inside the program, so the key of a step with a
# Pallas kernel named the repository's folder (measured: a copy elsewhere missed).
# (The carried wheels install into .cache/gpu_check/site/: host.install_wheels.)
SOURCE_PATHS = r"^(.*/(site|dist)-packages/|.*/gpu_check/site/|.*(?=linear_gpt2/))"


# The code a training step's program is made of (the layers below experiments, and the assets):
# the store's entries carry its fingerprint, so that the plan prices a step as loaded while
# this code is unchanged (the GPU still checks the key).
PROGRAM_CODE = ("platform", "kernels", "attention", "model", "training", "assets")


def code_fingerprint() -> str:
    """sha256 of the files of :data:`PROGRAM_CODE` (names and bytes); no git needed, so the
    GPU machine's copy of the tree computes the same."""
    import hashlib

    import linear_gpt2

    root = Path(linear_gpt2.__file__).resolve().parent
    h = hashlib.sha256()
    for part in PROGRAM_CODE:
        for path in sorted((root / part).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


class StoreError(RuntimeError):
    """The store cannot give what was asked (a key JAX did not compute, a damaged entry)."""


# ---------------------------------------------------------------------------- the target


@functools.cache
def target_devices(target: str) -> tuple[Any, ...]:
    """The devices programs are compiled for: ``cpu`` (this process's CPU, the tests), or a
    GPU target of ``platform/target.py`` as a compile-only topology with the host pinned."""
    import jax

    if target == "cpu":
        return tuple(jax.devices("cpu")[:1])
    from jax.experimental import topologies

    from linear_gpt2.platform import target as tg

    t = tg.get(target)
    if not tg.plugin_available():
        raise tg.TargetUnavailableError(
            f"compiling for {t.name} needs JAX's CUDA plugin; install it with {tg.INSTALL_HINT}"
        )
    topo = topologies.get_topology_desc(
        platform="cuda", topology_name=f"{t.name}_pinned_host", target_config=t.spec_text,
        topology=t.topology, host_target_machine_options=PINNED_HOST,
    )  # fmt: skip
    return tuple(topo.devices)


def target_kind(target: str) -> str:
    return target_devices(target)[0].device_kind


def target_mesh(target: str):
    from linear_gpt2.training.sharding import make_mesh

    return make_mesh(list(target_devices(target)))


@contextlib.contextmanager
def _tracing_for(target: str):
    """What ``target.compile_program`` sets while lowering for a GPU target: the target's
    abstract mesh (Pallas reads its device kind) and cuDNN's capability checks answered by the
    target."""
    from jax._src import config

    with config.hlo_source_file_canonicalization_regex(SOURCE_PATHS):
        if target == "cpu":
            yield
            return
        import jax

        from linear_gpt2.platform import target as tg

        mesh = target_mesh(target)
        with (
            jax.sharding.use_abstract_mesh(mesh.abstract_mesh),
            tg._cudnn_checks_for(tg.get(target)),
        ):
            yield


def lower_for(jitted, args, target: str):
    """``jitted(*args)`` lowered for ``target`` as the store's programs are (``args``:
    ``jax.ShapeDtypeStruct`` replicated on :func:`target_mesh`, see :func:`replicated`)."""
    with _tracing_for(target):
        return jitted.lower(*args)


def replicated(target: str):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return NamedSharding(target_mesh(target), P())


def lower_step(cfg, batch: int, target: str):
    """The training step of ``step_time.compile_step`` (``[1, batch, T]`` tokens, clip +
    AdamW, state donated) lowered for ``target``'s device; ``cfg`` must be resolved (no
    ``auto`` memory setting)."""
    from linear_gpt2.training.config import TrainConfig
    from linear_gpt2.training.optim import optimizer
    from linear_gpt2.training.train_step import jit_train_step

    program = jit_train_step(cfg, optimizer(TrainConfig()), target_mesh(target), accum=1,
                             batch=batch)  # fmt: skip
    with _tracing_for(target):
        return program.step.lower(*program.args)


# ---------------------------------------------------------------------------- the key

_capture = threading.local()
_patch_lock = threading.Lock()


class _Captured(Exception):  # noqa: N818 - control flow, not an error
    def __init__(self, key: str, fields: dict[str, str]):
        super().__init__(key)
        self.key, self.fields = key, fields


def _field_hashes(module, devices, compile_options, backend, ignore) -> dict[str, str]:
    """Each input of JAX's key hashed alone, with the helpers ``cache_key.get`` hashes them with
    (its own debug log does the same): a key that differs between machines names its field."""
    import hashlib

    from jax._src import cache_key as ck
    from jax._src.lib import version_str

    strip = backend.platform == "gpu"
    parts = {
        "computation": lambda h: ck._hash_computation(h, module, ignore),
        "jax_lib version": lambda h: h.update(version_str.encode()),
        "backend version": lambda h: ck._hash_platform(h, backend),
        "XLA flags": lambda h: ck._hash_xla_flags(h, ck.get_flag_prefixes()),
        "compile_options": lambda h: ck._hash_serialized_compile_options(h, compile_options, strip),
        "accelerator_config": lambda h: ck._hash_accelerator_config(h, devices),
    }
    out = {}
    for name, fn in parts.items():
        h = hashlib.sha256()
        try:
            fn(h)
            out[name] = h.hexdigest()[:16]
        except Exception as e:  # noqa: BLE001 - a diagnostic only
            out[name] = f"unavailable: {type(e).__name__}"
    return out


def _install_capture() -> None:
    """Wrap ``compilation_cache.get_cache_key`` once: in a thread capturing (:func:`jax_key`)
    it computes JAX's key with :data:`COMPRESSION` and stops the compile; elsewhere (the
    other threads compiling side by side) it is JAX's, unchanged."""
    from jax._src import cache_key, compilation_cache

    with _patch_lock:
        original = compilation_cache.get_cache_key
        if getattr(original, "_linear_gpt2_capture", False):
            return

        def get_cache_key(module, devices, compile_options, backend, *args, **kwargs):
            if not getattr(_capture, "on", False):
                return original(module, devices, compile_options, backend, *args, **kwargs)
            ignore = args[0] if args else kwargs.get("ignore_custom_partitioning", False)
            key = cache_key.get(module, devices, compile_options, backend, COMPRESSION, ignore)
            raise _Captured(key, _field_hashes(module, devices, compile_options, backend, ignore))

        get_cache_key._linear_gpt2_capture = True  # type: ignore[attr-defined]
        compilation_cache.get_cache_key = get_cache_key


def _ensure_cache_on() -> None:
    """JAX asks for a key only with its persistent cache on; off, point it at a folder of
    its own (nothing is written there by a captured compile)."""
    import jax

    if not jax.config.jax_compilation_cache_dir:
        import tempfile

        jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="jax_cache_"))


def jax_key(lowered) -> str:
    """The key JAX computes for compiling ``lowered`` (``jax._src.cache_key.get``), without
    compiling it."""
    return jax_key_and_fields(lowered)[0]


def jax_key_and_fields(lowered) -> tuple[str, dict[str, str]]:
    """:func:`jax_key`, and a hash of each of its inputs (:func:`_field_hashes`)."""
    _ensure_cache_on()
    _install_capture()
    _capture.on = True
    try:
        lowered.compile()
    except _Captured as c:
        return c.key, c.fields
    finally:
        _capture.on = False
    raise StoreError(
        "JAX computed no compilation-cache key: its persistent cache is off in this process "
        "(a backend that was used before the cache folder was set); start a fresh process with "
        "JAX_COMPILATION_CACHE_DIR set"
    )


# ---------------------------------------------------------------------------- the store


@dataclasses.dataclass
class Store:
    """Serialized executables by JAX key: ``<key>.xz`` (lzma of the pickled ``serialize``
    output) and ``index.json`` (per key: what it is, its bytes, memory, compile seconds,
    the versions and flags it was compiled with)."""

    root: Path

    def __post_init__(self):
        self.root = Path(self.root)
        self._lock = threading.Lock()

    def index(self) -> dict[str, dict[str, Any]]:
        try:
            return json.loads((self.root / INDEX).read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def __contains__(self, key: str) -> bool:
        return key in self.index() and (self.root / f"{key}.xz").is_file()

    def put(self, key: str, compiled, meta: dict[str, Any]) -> int:
        from jax.experimental.serialize_executable import serialize

        payload, in_tree, out_tree = serialize(compiled)
        blob = lzma.compress(pickle.dumps((payload, in_tree, out_tree)), preset=6)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{key}.xz.tmp"
        tmp.write_bytes(blob)
        tmp.replace(self.root / f"{key}.xz")
        with self._lock:
            index = self.index()
            index[key] = {**meta, "bytes": len(blob)}
            (self.root / f"{INDEX}.tmp").write_text(json.dumps(index, indent=1) + "\n")
            (self.root / f"{INDEX}.tmp").replace(self.root / INDEX)
        return len(blob)

    def update(self, key: str, **fields: Any) -> None:
        with self._lock:
            index = self.index()
            index[key] = {**index[key], **fields}
            (self.root / f"{INDEX}.tmp").write_text(json.dumps(index, indent=1) + "\n")
            (self.root / f"{INDEX}.tmp").replace(self.root / INDEX)

    def load(self, key: str, device):
        """The executable of ``key`` loaded onto ``device`` (a ``jax.stages.Compiled``)."""
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            payload, in_tree, out_tree = pickle.loads(lzma.decompress(
                (self.root / f"{key}.xz").read_bytes()))  # fmt: skip
        except (OSError, lzma.LZMAError, pickle.UnpicklingError, EOFError) as e:
            raise StoreError(f"store entry {key} is damaged ({e}); compile it again") from e
        return deserialize_and_load(payload, in_tree, out_tree, backend=device.client,
                                    execution_devices=[device])  # fmt: skip

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.glob("*") if p.is_file())


def _versions() -> dict[str, Any]:
    import jax
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "xla_flags": os.environ.get("XLA_FLAGS", "")}  # fmt: skip


def setting_name(cfg, batch: int) -> str:
    chunk = f" chunk {cfg.chunk_size}" if cfg.spec.sweep_chunk_size else ""
    return (f"{cfg.attention} n_layer={cfg.n_layer} n_embd={cfg.n_embd} T={cfg.block_size} "
            f"B={batch}{chunk} remat={cfg.remat} loss_chunk={cfg.loss_chunk}")  # fmt: skip


def compile_into(store: Store, lowered, target: str, meta: dict[str, Any]) -> dict[str, Any]:
    """``lowered`` compiled into ``store`` under JAX's key (nothing when the key is there);
    returns its index entry with ``key``."""
    from linear_gpt2.platform.memory import compiled_memory
    from linear_gpt2.platform.provenance import git_commit

    t0 = time.perf_counter()
    key, fields = jax_key_and_fields(lowered)
    if key in store:  # the same program: valid at this commit too (the plan prices by it)
        store.update(key, key_fields=fields, commit=git_commit(), code=code_fingerprint(),
                      **{k: meta[k] for k in ("setting", "what") if meta.get(k)})  # fmt: skip
        return {**store.index()[key], "key": key}
    compiled = lowered.compile()
    memory = compiled_memory(compiled)
    meta = {
        **meta, "target": target, "device_kind": target_kind(target), "key_fields": fields,
        "compile_s": round(time.perf_counter() - t0, 2),
        "memory_bytes": memory.total if memory else None, **_versions(), "commit": git_commit(),
        "code": code_fingerprint(),
        "compiled_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }  # fmt: skip
    store.put(key, compiled, meta)
    return {**meta, "key": key, "bytes": store.index()[key]["bytes"]}


def compile_step_into(store: Store, cfg, batch: int, target: str, setting=None) -> dict[str, Any]:
    """Compile the step of resolved ``cfg`` for ``target`` into ``store`` (nothing when its
    key is there already); returns its index entry with ``key``. ``setting``: the plan's
    (attention, size, context, chunk) it stands for, recorded with the commit for pricing."""
    meta = {"what": setting_name(cfg, batch), "setting": list(setting) if setting else None}
    return compile_into(store, lower_step(cfg, batch, target), target, meta)


def compile_plan_into(
    store: Store, cfg, batch: int, target: str, budget: int | None, setting=None
) -> list:
    """The memory plan the GPU's ``compile_step`` will walk (``memory_plan``: cheapest setting
    first), compiled into ``store`` up to the first setting that fits ``budget`` bytes, and
    the next one where that one is within 3% of the budget (the GPU's own budget is known to
    within that). ``budget`` None: the cheapest only (what a CPU plans)."""
    from linear_gpt2.training import memory_plan

    out = []
    for c in memory_plan.candidates(cfg):
        entry = compile_step_into(store, c, batch, target, setting)
        out.append(entry)
        mem = entry.get("memory_bytes")
        if budget is None or mem is None:
            break
        if mem <= budget:
            if mem > 0.97 * budget and len(out) < len(memory_plan.LADDER):
                continue  # one more rung, then stop
            break
        if out[:-1] and out[-2].get("memory_bytes", 0) <= budget:
            break
    return out


def expected_budget(results: Path, target: str) -> int | None:
    """The bytes the GPU's ``memory_plan`` will allow a step (its allocator's limit times
    ``DEVICE_BUDGET_FRACTION``): the device's memory from the last memory check on it
    (``bytes_limit`` over the share it ran with), else the target's description, times the
    share the package gives the allocator on the GPU (``linear_gpt2/__init__.py``). None on
    the CPU, which reports no limit."""
    if target == "cpu":
        return None
    from linear_gpt2.platform import target as tg
    from linear_gpt2.training import memory_plan

    total = float(tg.get(target).device["device_memory_size"])
    for path in sorted(Path(results).glob(f"memory_check_{target}*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        share = data.get("meta", {}).get("settings", {}).get("allocator_fraction")
        limits = [r["bytes_limit"] for r in data.get("rows", []) if r.get("bytes_limit")]
        if share and limits:
            total = min(limits) / float(share)
    share = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95"))
    return int(total * share * memory_plan.DEVICE_BUDGET_FRACTION)


def compile_units(store: Store, units, target: str, budget: int | None, *, dtype: str,
                  report=None) -> list[dict[str, Any]]:  # fmt: skip
    """Every step the ``units`` (``Unit.compiles``) will ask for, compiled into ``store``."""
    from studies.train_step import step_time

    out = []
    for unit in units:
        for a, size, t, c in unit.compiles:
            cfg = step_time.model_config(size, a, t, dtype=dtype)
            if c is not None:
                cfg = cfg.replace(chunk_size=c)
            for entry in compile_plan_into(store, cfg, 1, target, budget, (a, size, t, c)):
                out.append(entry)
                if report is not None:
                    report(unit, entry)
    return out


# ---------------------------------------------------------------------------- on the device


def _record(event: dict[str, Any]) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    with open(path, "a") as f:
        f.write(json.dumps({**event, "utc": time.strftime("%H:%M:%S", time.gmtime())}) + "\n")


def loader(store: Store, target: str):
    """A step loader for ``step_time.set_step_loader``: ``(cfg, batch, compiler_options) ->
    compiled or None`` (None: compile here as before)."""
    import jax

    lock = threading.Lock()  # one lowering for the target at a time: the capture is per thread

    def load(cfg, batch: int, compiler_options):
        what = setting_name(cfg, batch)
        device = jax.local_devices()[0]
        if compiler_options:
            _record({"what": what, "status": "miss", "why": "compiler options given"})
            return None
        if target != "cpu" and device.device_kind != target_kind(target):
            _record({"what": what, "status": "miss", "why": f"device {device.device_kind!r} is "
                     f"not the target's {target_kind(target)!r}"})  # fmt: skip
            return None
        t0 = time.perf_counter()
        try:
            with lock:
                key, fields = jax_key_and_fields(lower_step(cfg, batch, target))
            if key not in store:
                _record({"what": what, "status": "miss", "why": _why_missed(store, cfg, fields),
                         "key": key, "key_fields": fields})  # fmt: skip
                return None
            compiled = store.load(key, device)
        except Exception as e:  # noqa: BLE001 - never worse than compiling here
            _record({"what": what, "status": "miss",
                     "why": f"{type(e).__name__}: {str(e)[:300]}"})  # fmt: skip
            return None
        _record({"what": what, "status": "loaded", "key": key,
                 "seconds": round(time.perf_counter() - t0, 3)})  # fmt: skip
        return compiled

    return load


def _why_missed(store: Store, cfg, fields: dict[str, str]) -> str:
    """A key not in the store: the fields that differ from the store's entry of the same
    setting (what was compiled here for it), or that no entry is of this setting."""
    same = [e for e in store.index().values() if e.get("what") == setting_name(cfg, 1)]
    if not same:
        return "not in the store: nothing of this setting was compiled here"
    theirs = same[-1].get("key_fields") or {}
    differ = [k for k, v in fields.items() if theirs.get(k) not in (None, v)]
    return "not in the store; fields differing from the entry compiled here: " + (
        ", ".join(differ) or "none recorded"
    )


def install() -> bool:
    """Make ``step_time.compile_step`` ask the store of ``$LINEAR_GPT2_COMPILED_STORE`` first;
    False (nothing installed) where the variable or the store is missing."""
    root = os.environ.get(STORE_ENV)
    if not root or not (Path(root) / INDEX).is_file():
        return False
    from studies.train_step import step_time

    step_time.set_step_loader(loader(Store(Path(root)), os.environ.get(TARGET_ENV, "h100")))
    return True


def run_script(argv: list[str]) -> int:
    """``python -m studies.gpu_check.compiled SCRIPT ARGS...``: the script
    with the store installed (the runner's wrapper for the step units)."""
    import runpy
    import sys

    install()
    script, *rest = argv
    sys.argv = [script, *rest]
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    return 0


# ---------------------------------------------------------------------------- the key check


def plain_cache_fields(gpu: dict[str, Any], target: str = "h100") -> list[dict[str, Any]]:
    """JAX's persistent-cache key fields for a program compiled here (deviceless, for
    ``target``) beside what the GPU run ``gpu`` (``environment.json`` or a results file's
    ``meta.environment``) recorded: whether the GPU's own compile would find a deviceless
    entry. One row per field: ``here``, ``gpu`` (None: not recorded), ``match``."""
    import jax
    import jaxlib
    from jax._src.lib import xla_client

    devs = list(target_devices(target))
    backend = devs[0].client
    try:
        fingerprint = xla_client.get_topology_for_devices(devs).fingerprint()
    except Exception:  # noqa: BLE001 - JAX then hashes the device kinds
        fingerprint = None

    def row(field, here, there, why):
        match = None if there is None else here == there
        return {"field": field, "here": here, "gpu": there, "match": match, "why": why}

    return [
        row("jax_lib version", jaxlib.__version__, gpu.get("jaxlib_version"),
            "jaxlib's version string"),
        row("backend platform", backend.platform, gpu.get("platform"), "'gpu' for CUDA"),
        row("backend version", backend.platform_version, gpu.get("backend_platform_version"),
            "deviceless: 'PJRT C API' + the target's device_description_str; on a GPU: 'PJRT "
            "C API' + the plugin's platform version (CUDA runtime it was built with)"),
        row("accelerator config", fingerprint, gpu.get("topology_fingerprint"),
            "fingerprint of the topology: the target description and the host CPU here; the "
            "device's own description (clocks, memory, driver, cuDNN) and its host's CPU there"),
        row("device kind", devs[0].device_kind, gpu.get("device_kind"),
            "what the topology's devices are called"),
        row("compression", "zstandard" if _has_zstandard() else "zlib",
            gpu.get("compression"), "JAX names zstandard where that module imports"),
        row("XLA flags", os.environ.get("XLA_FLAGS", ""), gpu.get("xla_flags"),
            "XLA_FLAGS and --xla arguments"),
        row("jax", jax.__version__, gpu.get("jax_version"), "lowering rules (the program)"),
    ]  # fmt: skip


def _has_zstandard() -> bool:
    import importlib.util

    return importlib.util.find_spec("zstandard") is not None


if __name__ == "__main__":
    import sys

    # The package's module, not this __main__ copy: one loader, one capture, one store state.
    from studies.gpu_check import compiled as _module

    raise SystemExit(_module.run_script(sys.argv[1:]))
