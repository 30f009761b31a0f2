"""The trainer: sharding invariance, accumulation, exact resume after SIGTERM, NaN handling,
incompatible checkpoints, batch planning. Multi-device runs are subprocesses, since the CPU
device count is fixed when JAX starts."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from linear_gpt2.model import count_params, init_params
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.model.flops import device_peak_flops, flops_per_token
from linear_gpt2.platform.errors import ConfigError
from linear_gpt2.training.checkpoint import IncompatibleCheckpointError
from linear_gpt2.training.config import DataConfig, load_config
from linear_gpt2.training.train_step import init_state, make_train_step
from linear_gpt2.training.trainer import NonFiniteLossError, plan_batches, train
from tests.helpers import SLOW, rel_err

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "train_worker.py"
TINY = """
model: {vocab_size: 50304, block_size: 16, n_layer: 2, n_head: 2, n_embd: 32}
data: {source: sample, context: 16}
train: {tokens_per_update: 256, micro_batch: 2, max_steps: 3, warmup_steps: 1, lr: 1.0e-3}
log: {wandb: disabled, eval_every: 0}
checkpoint: {resume: never, every: 100, async_save: false}
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny config file and the sample corpus, tokenized once for every run in this module."""
    root = tmp_path_factory.mktemp("trainer")
    sample = root / "sample"
    from linear_gpt2.training.data import prepare_sample

    data_cfg = DataConfig(source="sample", path=str(sample), context=16)
    prepare_sample(data_cfg, "train")
    prepare_sample(data_cfg, "validation")
    config = root / "tiny.yaml"
    config.write_text(TINY)
    return root, config, [f"data.path={sample}"]


def _env(devices: int, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        # The suite's own flags (conftest: fast CPU compiles) plus the device count.
        XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
        f"--xla_force_host_platform_device_count={devices}".strip(),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT),
        **extra,
    )
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        if var not in extra:
            env.pop(var, None)
    return env


def run_worker(setup, name: str, devices: int, overrides=()) -> tuple[dict, dict]:
    return run_workers(setup, devices, {name: overrides})[name]


def run_workers(setup, devices: int, runs: dict) -> dict[str, tuple[dict, dict]]:
    """Each run (name -> overrides) trained in turn by one worker process on ``devices`` CPU
    devices: one JAX start-up for them all."""
    root, config, base = setup
    argv = []
    for name, overrides in runs.items():
        argv += ["--then"] * bool(argv)
        argv += [str(root / name), *base, f"log.run_dir={root}/{name}", *overrides]
    argv.insert(1, str(config))
    subprocess.run(
        [sys.executable, str(WORKER), *argv],
        env=_env(devices),
        check=True,
        timeout=600,
        capture_output=True,
    )
    return {
        name: (json.loads((root / f"{name}.json").read_text()), dict(np.load(root / f"{name}.npz")))
        for name in runs
    }


def assert_same_run(a, b, loss_tol=1e-5, param_tol=1e-4):
    """Same losses and parameters up to float32 rounding of differently ordered sums. Parameters
    get a looser bound: Adam's first steps are ~lr * g / |g|, which turns a rounding difference in
    a near-zero gradient (zero-initialised biases) into a visible one."""
    (meta_a, params_a), (meta_b, params_b) = a, b
    assert meta_a["losses"].keys() == meta_b["losses"].keys()
    for step in meta_a["losses"]:
        assert meta_b["losses"][step] == pytest.approx(meta_a["losses"][step], rel=loss_tol), step
    assert params_a.keys() == params_b.keys()
    for k in params_a:
        assert rel_err(params_b[k], params_a[k]) < param_tol, k


@SLOW
def test_eight_devices_match_one(setup):
    one = run_worker(setup, "dev1", 1)
    # Both 8-device runs in one worker process (one start-up of JAX on 8 devices).
    runs = run_workers(setup, 8, {"dev8": [], "dev8_fsdp": ["train.fsdp=true"]})
    eight, fsdp = runs["dev8"], runs["dev8_fsdp"]
    assert one[0]["devices"] == 1 and eight[0]["devices"] == fsdp[0]["devices"] == 8
    assert_same_run(one, eight)
    # FSDP shards parameters and optimizer state; the numbers must not change.
    assert_same_run(one, fsdp)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_processes(setup, name: str, devices_each: int, overrides=()) -> tuple[dict, dict]:
    """The worker as two processes joined on 127.0.0.1, ``devices_each`` CPU devices each;
    process 0's losses and the gathered parameters."""
    root, config, base = setup
    port, out = _free_port(), str(root / name)
    args = [*base, f"log.run_dir={root}/{name}", *overrides]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), out, str(config), *args],
            env=_env(
                devices_each,
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JAX_NUM_PROCESSES="2",
                JAX_PROCESS_ID=str(i),
            ),  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=600)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    return json.loads(Path(out + ".json").read_text()), dict(np.load(out + ".npz"))


@SLOW
def test_two_processes_match_one_process_with_as_many_devices(setup):
    single = run_worker(setup, "proc1_dev4", 4, ["train.max_steps=2"])
    multi = run_two_processes(setup, "proc2", 2, ["train.max_steps=2"])
    assert multi[0]["processes"] == 2 and multi[0]["devices"] == 4
    assert_same_run(single, multi)


@SLOW
def test_accumulating_k_micro_batches_equals_one_batch_k_times_larger():
    """The accumulated gradient equals the large batch's. Plain SGD with lr 1 makes the update the
    gradient itself (Adam's first step, ~lr * sign(g), would amplify rounding on near-zero
    gradients and hide what accumulation computes)."""
    import optax

    cfg = ModelConfig(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=32)
    tx = optax.sgd(1.0)
    step = jax.jit(make_train_step(cfg, tx, skip_nonfinite=False))
    tokens = jax.random.randint(jax.random.key(0), (8, 17), 0, 97)
    x, y = tokens[:, :-1], tokens[:, 1:]
    key = jax.random.key(1)
    params = init_params(cfg)
    big, m_big = step(init_state(params, tx), x[None], y[None], key)
    small, m_small = step(init_state(params, tx), x.reshape(4, 2, 16), y.reshape(4, 2, 16), key)
    assert float(m_small["loss"]) == pytest.approx(float(m_big["loss"]), rel=1e-6)
    assert float(m_small["grad_norm"]) == pytest.approx(float(m_big["grad_norm"]), rel=1e-6)
    for p0, a, b in zip(
        jax.tree.leaves(params), jax.tree.leaves(big.params), jax.tree.leaves(small.params)
    ):
        assert rel_err(p0 - b, p0 - a) < 1e-5
    # And it is not trivially equal: a different split of other data gives another gradient.
    other, _ = step(
        init_state(params, tx),
        x[::-1].reshape(4, 2, 16)[:, :1],
        y[::-1].reshape(4, 2, 16)[:, :1],
        key,
    )
    assert rel_err(jax.tree.leaves(other.params)[0], jax.tree.leaves(big.params)[0]) > 1e-3


def _read_steps(path: Path) -> dict[int, float]:
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            out[rec["step"]] = rec["loss"]
    return out


@SLOW
def test_sigterm_then_resume_reproduces_the_uninterrupted_run(setup):
    root, config, base = setup
    n = 4
    common = [*base, f"train.max_steps={2 * n}", "checkpoint.every=2", "data.prefetch=2"]
    script = [sys.executable, str(ROOT / "scripts" / "train.py"), str(config)]
    ref_dir = root / "uninterrupted"
    subprocess.run(
        [*script, *common, f"log.run_dir={ref_dir}"],
        env=_env(1),
        check=True,
        timeout=600,
        capture_output=True,
    )
    reference = _read_steps(ref_dir / "metrics.jsonl")
    assert sorted(reference) == list(range(1, 2 * n + 1))

    run_dir = root / "preempted"
    proc = subprocess.Popen(
        [*script, *common, f"log.run_dir={run_dir}"],
        env=_env(1),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 300
    while max(_read_steps(run_dir / "metrics.jsonl"), default=0) < n:
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == 0, out
    assert "stopped by signal" in out
    stopped_at = max(_read_steps(run_dir / "metrics.jsonl"))
    assert n <= stopped_at < 2 * n, "the run should stop soon after the signal, before the end"

    resumed = subprocess.run(
        [*script, *common, f"log.run_dir={run_dir}", "checkpoint.resume=auto"],
        env=_env(1),
        check=True,
        timeout=600,
        capture_output=True,
    )
    assert f"starting at step {stopped_at}" in resumed.stdout.decode()
    losses = _read_steps(run_dir / "metrics.jsonl")
    assert sorted(losses) == list(range(1, 2 * n + 1))
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-6), step


def _poisoning_loader(monkeypatch, poison_batch: int):
    """Marks the ``poison_batch``-th training batch (0-based) and makes the loss NaN on it."""
    import linear_gpt2.training.train_step as ts
    from linear_gpt2.training import data as data_lib

    poison = 50300  # a valid id of the padded vocabulary that the tokenizer never emits
    real_make, real_loss = data_lib.make_loader, ts.loss_fn

    def make_loader(cfg, split, *args, **kwargs):
        loader = real_make(cfg, split, *args, **kwargs)
        if split != "train":
            return loader
        real_next, count = loader.__next__, [0]

        class Wrapped:
            def __iter__(self):
                return self

            def __next__(self):
                batch = dict(real_next())
                if count[0] == poison_batch:
                    batch["inputs"] = batch["inputs"].copy()
                    batch["inputs"][0, 0] = poison
                count[0] += 1
                return batch

            def __getattr__(self, name):
                return getattr(loader, name)

        return Wrapped()

    def loss_fn(params, x, y, cfg, **kw):
        return jnp.where(jnp.any(x == poison), jnp.nan, real_loss(params, x, y, cfg, **kw))

    monkeypatch.setattr(data_lib, "make_loader", make_loader)
    monkeypatch.setattr(ts, "loss_fn", loss_fn)


def test_nan_loss_stops_and_names_the_last_good_checkpoint(setup, monkeypatch):
    root, config, base = setup
    _poisoning_loader(monkeypatch, poison_batch=2)
    cfg = load_config(
        config, [*base, f"log.run_dir={root}/nan_stop", "checkpoint.every=2", "train.max_steps=6"]
    )
    with pytest.raises(NonFiniteLossError) as e:
        train(cfg)
    msg = str(e.value)
    assert (
        "step 3" in msg and "last good checkpoint is step 2" in msg and "train.on_nan=skip" in msg
    )
    assert (root / "nan_stop" / "checkpoints" / "2").exists()
    assert not (root / "nan_stop" / "checkpoints" / "3").exists()


def test_nan_loss_with_skip_drops_only_that_update(setup, monkeypatch):
    root, config, base = setup
    _poisoning_loader(monkeypatch, poison_batch=1)
    cfg = load_config(
        config, [*base, f"log.run_dir={root}/nan_skip", "train.on_nan=skip", "train.max_steps=3"]
    )
    result = train(cfg)
    assert result.last_step == 3 and np.isnan(result.losses[2])
    assert np.isfinite(result.losses[3])
    records = [
        json.loads(line) for line in (root / "nan_skip" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["skipped"] for r in records] == [False, True, False]


@SLOW
def test_checkpoint_from_another_config_is_refused(setup):
    root, config, base = setup
    run = [*base, f"log.run_dir={root}/incompatible", "train.max_steps=1"]
    train(load_config(config, run))
    other = load_config(
        config, [*run, "checkpoint.resume=auto", "model.n_embd=64", "train.lr=2e-3"]
    )
    with pytest.raises(IncompatibleCheckpointError) as e:
        train(other)
    assert (
        "model.n_embd (checkpoint 32, now 64)" in str(e.value)
        and "train.lr" in str(e.value)
        and "log.run_dir (checkpoint" not in str(e.value)  # keys that may change are not listed
    )
    # Keys that do not change the experiment may differ.
    ok = load_config(config, [*run, "checkpoint.resume=auto", "train.max_steps=2", "log.every=5"])
    assert train(ok).last_step == 2


@SLOW
def test_a_run_whose_config_was_written_before_the_options_moved_resumes(setup):
    """A run directory and checkpoint whose config main wrote at ddb0b90 (every shared attention
    option, flash's own ``ring`` under ``extra``: tests/fixtures/config_written_at_ddb0b90.yaml)
    resume: the file loads as the same config, and the trainer continues the run from it."""
    from linear_gpt2.training.checkpoint_files import write_manifest

    root, config, base = setup
    run_dir = root / "written_at_main"
    overrides = [*base, f"log.run_dir={run_dir}", "train.max_steps=1", "attention.name=flash",
                 "attention.ring=contiguous", "attention.chunk_size=32"]  # fmt: skip
    assert train(load_config(config, overrides)).last_step == 1
    fixture = (ROOT / "tests" / "fixtures" / "config_written_at_ddb0b90.yaml").read_text()
    data_path = next(o.split("=", 1)[1] for o in base if o.startswith("data.path="))
    old = fixture.replace("RUN_DIR", str(run_dir)).replace("DATA_PATH", data_path)
    (run_dir / "config.yaml").write_text(old)
    step = run_dir / "checkpoints" / "1"
    meta = json.loads((step / "meta" / "metadata").read_text())
    meta["config"] = yaml.safe_load(old)
    (step / "meta" / "metadata").write_text(json.dumps(meta))
    write_manifest(step)  # the file sizes the damage check compares
    again = load_config(run_dir / "config.yaml", ["checkpoint.resume=auto", "train.max_steps=2"])
    assert again.attention.ring == "contiguous" and again.attention.kernel == "auto"
    assert again == load_config(config, [*overrides[:-4], "attention.name=flash",
                                         "attention.ring=contiguous", "checkpoint.resume=auto",
                                         "train.max_steps=2"])  # fmt: skip
    result = train(again)
    assert result.last_step == 2 and sorted(result.losses) == [2]


def test_max_hours_ends_the_run_with_a_checkpoint(setup):
    root, config, base = setup
    cfg = load_config(
        config, [*base, f"log.run_dir={root}/budget", "train.max_hours=1e-9", "train.max_steps=50"]
    )
    result = train(cfg)
    assert result.stopped_by == "max_hours" and result.last_step == 1
    assert (root / "budget" / "checkpoints" / "1").exists()


def test_every_start_of_a_run_records_where_and_with_what_it_trained(setup):
    """``run_info.jsonl`` gets one line per call of ``train``: the step it started at, the
    device, versions and commit (what reports cite), and reading the run gives them back."""
    from linear_gpt2.experiments import runs as runs_lib
    from linear_gpt2.platform import provenance

    root, config, base = setup
    run_dir = root / "starts"
    common = [*base, f"log.run_dir={run_dir}", "checkpoint.resume=auto"]
    train(load_config(config, [*common, "train.max_steps=2"]))
    train(load_config(config, [*common, "train.max_steps=3"]))
    lines = [json.loads(x) for x in (run_dir / "run_info.jsonl").read_text().splitlines()]
    assert [x["start_step"] for x in lines] == [0, 2]
    here = provenance.environment()
    for x in lines:
        assert x["git_commit"] == here["git_commit"] and x["jax_version"] == jax.__version__
        assert x["device_kind"] == here["device_kind"] and x["hours_before"] >= 0
    run = runs_lib.load_run(run_dir)
    assert run.starts == lines and run.commits == [here["git_commit"]]


def test_mfu_is_logged_against_the_configured_peak_on_a_device_the_table_lacks(setup):
    """``log.peak_tflops`` gives MFU where ``flops.py``'s table has no entry (CPU here): each
    record's ``mfu`` is the update's model FLOPs / its step time / (peak x devices), and
    ``model_tflops`` the same FLOP rate per device."""
    root, config, base = setup
    peak_tflops = 0.5
    cfg = load_config(config, [*base, f"log.run_dir={root}/peak", f"log.peak_tflops={peak_tflops}"])
    assert device_peak_flops() is None  # the table does not know this device
    train(cfg)
    records = [json.loads(x) for x in (root / "peak" / "metrics.jsonl").read_text().splitlines()]
    n_params = count_params(jax.eval_shape(lambda: init_params(cfg.model_config)), False)
    flops_update = flops_per_token(cfg.model_config, n_params, 16) * cfg.train.tokens_per_update
    devices = jax.device_count()
    assert len(records) == cfg.train.max_steps
    for r in records:
        want = flops_update / r["step_time_s"] / (peak_tflops * 1e12 * devices)
        assert r["mfu"] == pytest.approx(want, rel=1e-9), r
        model_tflops = flops_update / r["step_time_s"] / devices / 1e12
        assert r["model_tflops"] == pytest.approx(model_tflops, rel=1e-9), r
    # Without it, the table decides: no MFU on CPU, the achieved rate all the same.
    train(load_config(config, [*base, f"log.run_dir={root}/no_peak"]))
    for line in (root / "no_peak" / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        assert r["mfu"] is None and r["model_tflops"] > 0


def test_peak_tflops_must_be_positive_or_null():
    assert load_config(None, ["log.peak_tflops=null"]).log.peak_tflops is None
    for bad in ("0", "-989"):
        with pytest.raises(ConfigError, match=r"^log.peak_tflops: must be > 0 or null"):
            load_config(None, [f"log.peak_tflops={bad}"])


def test_batch_plan_holds_tokens_per_update_constant():
    for context, accum in ((1024, 64), (4096, 16), (16384, 4), (65536, 1)):
        cfg = load_config(
            None, [f"data.context={context}", f"model.block_size={context}", "train.micro_batch=1"]
        )
        plan = plan_batches(cfg, devices=8, processes=1)
        assert (
            plan.sequences * context == 2**19 and plan.accum == accum // 1 and plan.micro_batch == 1
        )
    cfg = load_config(None, ["train.micro_batch=3"])
    with pytest.raises(ConfigError, match=r"micro_batch=3 x 8 devices.*try train.micro_batch=2"):
        plan_batches(cfg, devices=8, processes=1)
    cfg = load_config(None, ["train.tokens_per_update=1000"])
    with pytest.raises(ConfigError, match="not a multiple of data.context=1024"):
        plan_batches(cfg, devices=1, processes=1)


def test_out_of_memory_names_the_sizes_and_the_fixes(setup, monkeypatch):
    import linear_gpt2.training.train_step as train_step_mod

    def exhausted(*args, **kwargs):
        def step(*a):
            raise RuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 80.00GiB"
            )

        return step

    monkeypatch.setattr(train_step_mod, "make_train_step", exhausted)
    root, config, base = setup
    cfg = load_config(config, [*base, f"log.run_dir={root}/oom"])
    with pytest.raises(MemoryError) as e:
        train(cfg)
    msg = str(e.value)
    for text in (
        "1.6M parameters",
        "context 16",
        "micro_batch 2",
        "model.remat=offload",
        "train.fsdp=true",
    ):
        assert text in msg, text
