"""Context parallelism (``train.context_parallel``, issue 29): the sequence split over a ``data x
seq`` mesh of CPU devices gives the one-device loss and gradients (the model, per variant, with
and without document resets and decay gates), the trainer's runs (one process and two), exact
resumption, the collectives counted against their model, and one-line refusals."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from linear_gpt2.platform.errors import ConfigError
from linear_gpt2.training.batches import plan_batches
from linear_gpt2.training.config import load_config
from tests.helpers import SLOW, entry_point_calls
from tests.test_trainer import (
    TINY,
    _env,
    _read_steps,
    assert_same_run,
    run_two_processes,
    run_worker,
    setup,  # noqa: F401  (the module's fixture: the tiny config and the sample corpus)
)

ROOT = Path(__file__).resolve().parents[1]
MODEL_WORKER = ROOT / "tests" / "workers" / "context_parallel_model.py"
# LT_chunked with chunks of 2 (a slice of 2 tokens at seq = 8), resets and the decay gate.
CP = ["attention.name=LT_chunked", "attention.chunk_size=2", "attention.kernel=xla",
      "attention.doc_reset=true", "attention.decay=gate"]  # fmt: skip


# --------------------------------------------------------------------------------------------
# The model: loss and gradients against one device


@pytest.mark.parametrize(
    "variant",
    ["LT_chunked-xla", "LT_chunked-pallas", "LT_state_parallel", "flash-xla",
     "LT_chunked-pallas-taylor2"],
)  # fmt: skip
@SLOW
def test_model_under_context_parallelism_equals_one_device(variant):
    """Every seq in {2, 4, 8} and data in {1, 2} on 16 host devices (their six products for
    LT_chunked-xla, whose state exchange the others share) with resets (documents that span
    slice boundaries and start exactly on them) and the gate together where the variant takes
    them, and every other forgetting at data 2 x seq 8 (the worker's ``plan``)."""
    out = subprocess.run(
        [sys.executable, str(MODEL_WORKER), variant],
        env=_env(16),
        check=True,
        timeout=900,
        capture_output=True,
        text=True,
    ).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    forgets = {(r["doc_reset"], r["decay"]) for r in rows}
    expected = 2 if variant in ("flash-xla", "LT_chunked-pallas-taylor2") else 4
    # taylor2 (and the fused head): seq = 8 and data 2 x seq 4. LT_chunked-xla (the state
    # exchange in XLA): six meshes for the last forgetting; the others three (every seq, both
    # data sizes); the other forgettings at data 2 x seq 8.
    if variant == "LT_chunked-pallas-taylor2":
        meshes = {(1, 8), (2, 4)}
    elif variant == "LT_chunked-xla":
        meshes = {(1, 2), (2, 2), (1, 4), (2, 4), (1, 8), (2, 8)}
    else:
        meshes = {(2, 2), (1, 4), (2, 8)}
    runs = 4 if variant == "LT_chunked-pallas-taylor2" else len(meshes) + expected - 1
    assert len(rows) == runs and len(forgets) == expected
    assert {(r["data"], r["seq"]) for r in rows} == meshes
    for r in rows:
        assert r["seq_collectives"] > 0, r  # the attention did cross the slices
        assert r["loss"] <= 1e-6 and r["grads"] <= 1e-5, r
    # The cases differ: resets and the gate change the loss, so equality above is not vacuous.
    # (With resets on, the gate's initial effect on the loss is below float32's resolution.)
    loss = {f: next(r["loss_value"] for r in rows if (r["doc_reset"], r["decay"]) == f)
            for f in forgets}  # fmt: skip
    assert all(loss[f] != loss[(False, "none")] for f in forgets if f[0])
    if (False, "gate") in loss:
        assert loss[(False, "gate")] != loss[(False, "none")]


@SLOW
def test_data_parallel_attention_runs_each_devices_own_sequences():
    """Under a ``data`` mesh in context (as the trainer traces for GPUs) the attention runs
    inside ``shard_map`` over ``data`` (``attention.context.over_batch``): on 2 host devices
    LT_chunked's Pallas kernels (interpret mode) with resets and the gate give one device's loss
    and gradients; compiled for h100x8, the data-parallel step's LT kernels launch the programs
    of one sequence, not of all eight (a custom call is not split by XLA's partitioner: it ran
    the whole batch on every GPU)."""
    from linear_gpt2.experiments.compile_step import compile_attention, compile_train_step
    from linear_gpt2.model.config import ModelConfig

    out = subprocess.run(
        [sys.executable, str(MODEL_WORKER), "LT_chunked-pallas", "--data-only"],
        env=_env(2), check=True, timeout=600, capture_output=True, text=True,
    ).stdout  # fmt: skip
    (row,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert (row["data"], row["seq"], row["doc_reset"], row["decay"]) == (2, 1, True, "gate")
    assert row["manual"] > 0 and row["loss"] <= 1e-6 and row["grads"] <= 1e-5, row

    cfg = ModelConfig(vocab_size=512, block_size=1024, n_layer=1, n_head=2, n_embd=128,
                      attention="LT_chunked", chunk_size=64, remat="none", loss_chunk=0,
                      dtype="bfloat16")  # fmt: skip

    def programs(kernels) -> dict[str, int]:
        got: dict[str, int] = {}
        for k in kernels:
            name = k.name.split("__")[0]
            if name.startswith("lt_chunked"):
                got[name] = got.get(name, 0) + k.programs
        return got

    # One sequence's attention alone, forward and backward (the step's, at the same options).
    one = compile_attention("LT_chunked", (1, 1024, 2, 64), "bfloat16", "h100", chunk_size=64)
    step = compile_train_step(cfg, "h100x8", batch=8, accum=2, context=1024, kernels=True)
    assert programs(one.kernels) and programs(step.compile.kernels) == programs(one.kernels)

    # The gradients are summed over the devices once per update, in float32, as DDP sums
    # them: left to XLA's partitioner each weight's gradient was all-reduced at its matmul's
    # output, in bfloat16, inside every micro-step of the accumulation loop.
    import jax

    from linear_gpt2.experiments.collectives import collectives
    from linear_gpt2.model import init_params

    n_params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(lambda: init_params(cfg, 0))))
    reduces = [c for c in collectives(step.hlo_text, 8) if c.kind == "all-reduce"]
    assert reduces and all(c.count == 1 for c in reduces), reduces
    summed = sum(c.operand_bytes for c in reduces)
    assert 4 * n_params <= summed <= 4 * n_params + 64, (summed, n_params)
    lines = [x for x in step.hlo_text.splitlines() if re.search(r" all-reduce(-start)?\(", x)]
    assert lines and not any("bf16[" in x.split("all-reduce")[0] for x in lines)


# --------------------------------------------------------------------------------------------
# The trainer


# The tests that compare with the one-device run share one xdist worker, which trains it once.
ONE_WORKER = pytest.mark.xdist_group("context_parallel_one_device")


@pytest.fixture(scope="module")
def one_device(setup):  # noqa: F811
    return run_worker(setup, "cp_dev1", 1, CP)


@SLOW
@ONE_WORKER
@pytest.mark.parametrize("seq", [2, 8])
def test_training_split_over_seq_equals_one_device(setup, one_device, seq):  # noqa: F811
    """8 devices as data=4 x seq=2 and data=1 x seq=8: the losses and parameters of one."""
    split = run_worker(setup, f"cp_seq{seq}", 8, [*CP, f"train.context_parallel={seq}"])
    assert split[0]["devices"] == 8
    assert_same_run(one_device, split)


@SLOW
@ONE_WORKER
@pytest.mark.parametrize("seq", [2, 8])
def test_two_processes_equal_one(setup, one_device, seq):  # noqa: F811
    """Two processes of 4 devices: seq = 2 keeps each sequence on one host (2 micro-steps per
    update, accumulated across hosts); seq = 8 splits every sequence across both hosts (they load
    the same rows and keep half of T each), in one micro-step of all 16 rows: on CPU, Gloo's
    cross-host collectives inside the micro-step loop take seconds each, and 8 micro-steps made
    this case the suite's slowest (about 90 s per update against 0.4 s for one micro-step)."""
    extra = ["train.micro_batch=16"] if seq == 8 else []
    multi = run_two_processes(
        setup, f"cp_proc2_seq{seq}", 4, [*CP, f"train.context_parallel={seq}", *extra]
    )
    assert multi[0]["processes"] == 2 and multi[0]["devices"] == 8
    assert_same_run(one_device, multi)


@SLOW
def test_resume_under_context_parallelism_is_exact(setup):  # noqa: F811
    """Four steps straight, against two steps and a resumption to four: the same losses to the
    last bit's neighbourhood (same program, same data order), with the sequence split in two;
    and resumed with the sequence split in four."""
    root, config, base = setup
    common = [*base, *CP, "train.context_parallel=2", "checkpoint.every=2"]
    script = [sys.executable, str(ROOT / "scripts" / "train.py"), str(config)]

    def train(run: str, *extra: str) -> None:
        subprocess.run([*script, *common, f"log.run_dir={root / run}", *extra], env=_env(8),
                       check=True, timeout=600, capture_output=True)  # fmt: skip

    train("cp_straight", "train.max_steps=4")
    train("cp_resumed", "train.max_steps=2")
    # The resplit run below starts from the same two steps: a copy, not a third training run.
    shutil.copytree(root / "cp_resumed", root / "cp_resplit")
    train("cp_resumed", "train.max_steps=4", "checkpoint.resume=auto")
    straight = _read_steps(root / "cp_straight" / "metrics.jsonl")
    resumed = _read_steps(root / "cp_resumed" / "metrics.jsonl")
    assert sorted(straight) == sorted(resumed) == [1, 2, 3, 4]
    for step in straight:
        assert resumed[step] == pytest.approx(straight[step], rel=1e-6), step
    # The split is an implementation choice: resuming with the sequence over 4 devices instead
    # of 2 continues the same run (the same function, summed in another order).
    train("cp_resplit", "train.max_steps=4", "checkpoint.resume=auto", "train.context_parallel=4")
    resplit = _read_steps(root / "cp_resplit" / "metrics.jsonl")
    assert sorted(resplit) == [1, 2, 3, 4]
    for step in straight:
        assert resplit[step] == pytest.approx(straight[step], rel=1e-5), step


# --------------------------------------------------------------------------------------------
# Bad input: one line naming the problem and the fix


def _config(tmp_path, *overrides):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return load_config(path, list(overrides))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.context_parallel=2"], r"attention 'softmax' does not split the sequence over "
         r"devices; those that do: .*flash.*LT_state_parallel.*LT_chunked; use one of them"),
        (["attention.name=LT_chunked", "train.context_parallel=3"],
         r"train.context_parallel=3 does not divide data.context=16 into equal slices"),
        (["attention.name=LT_chunked", "attention.chunk_size=8", "train.context_parallel=4"],
         r"attention.chunk_size: each device's slice \(data.context=16 / "
         r"train.context_parallel=4\): chunk_size=8 does not divide T=4"),
        (["attention.name=LT_chunked", "train.context_parallel=0"], r"train.context_parallel"),
    ],
)  # fmt: skip
def test_bad_context_parallel_settings_are_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        _config(tmp_path, *overrides)
    assert "\n" not in str(err.value)


@SLOW
def test_the_console_shows_the_split_and_never_cuts_a_line(setup):  # noqa: F811
    """scripts/train.py under context parallelism, stdout a pipe (a job's log): the header
    names the data x seq mesh and each device's share of a sequence, and a line longer than 80
    columns (the stop line's checkpoint path) is printed whole."""
    root, config, base = setup
    run = root / ("a_run_directory_whose_path_alone_passes_eighty_columns_" * 2).strip("_")
    args = [*base, *CP, "train.context_parallel=2", "train.max_steps=1",
            "train.max_hours=1e-9", f"log.run_dir={run}"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), str(config), *args],
        env=_env(2), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if "parameters |" in line)
    assert "| 2 devices in 1 process(es) (data 1 x seq 2: 8 tokens of each sequence per " in header
    assert "micro-steps of 2 per data group | starting at step 0 of 1" in header
    stop = f"stopped by max_hours at step 1; checkpoint saved in {run / 'checkpoints'}"
    assert stop in lines, proc.stdout[-3000:]


def test_the_context_advised_for_a_split_passes_every_check(tmp_path):
    """``train.context_parallel`` that does not divide the context (issue 38: 3 advised 126,
    which LT_chunked's chunks then refused): the one-line error of scripts/train.py advises a
    context that the config's checks all accept, for each variant's own rule of slices."""
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    cases = [["attention.name=LT_chunked", "train.context_parallel=3"],  # chunks of 64: 192
             ["attention.name=LT_chunked", "attention.chunk_size=2", "train.context_parallel=3"],
             ["attention.name=flash", "train.context_parallel=3"],  # zigzag: slices that halve
             ["attention.name=flash", "data.context=12", "train.context_parallel=8"]]  # fmt: skip
    results = entry_point_calls(
        ROOT / "scripts" / "train.py", [[str(config), *o] for o in cases], env=_env(1)
    )
    for overrides, (code, err) in zip(cases, results, strict=True):
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "does not divide data.context" in lines[0], err
        advised = int(re.search(r"e\.g\. data\.context=(\d+)", lines[0])[1])
        fixed = [*overrides, f"data.context={advised}", f"model.block_size={max(advised, 16)}"]
        cfg = _config(tmp_path, *fixed)  # no ConfigError: the advice passes
        assert cfg.data.context == advised and advised % cfg.train.context_parallel == 0
    first = results[0][1]  # LT_chunked's chunks of 64 take no context of 16 or less: above
    assert "data.context=192, with model.block_size at least that" in first


def test_seq_must_divide_the_devices_and_fit_the_hosts(tmp_path):
    cfg = _config(tmp_path, "attention.name=LT_chunked", "attention.chunk_size=2",
                  "train.context_parallel=8")  # fmt: skip
    with pytest.raises(ConfigError, match=r"context_parallel=8 does not divide the 12 devices"):
        plan_batches(cfg, devices=12, processes=1)
    cfg4 = _config(tmp_path, "attention.name=LT_chunked", "attention.chunk_size=2",
                   "train.context_parallel=4")  # fmt: skip
    with pytest.raises(ConfigError, match=r"does not fit 2 hosts of 6 devices"):
        plan_batches(cfg4, devices=12, processes=2)
    # A sequence over whole hosts: the two processes of a group read the same rows.
    plan = plan_batches(cfg, devices=8, processes=2, process_index=1)
    assert (plan.processes_per_sequence, plan.loader_count, plan.loader_index) == (2, 1, 0)
    assert plan.local_positions(16) == slice(8, 16)


# --------------------------------------------------------------------------------------------
# The collectives: counted from the program compiled for one 8-GPU node, against their model


@SLOW
def test_compiled_state_exchange_is_the_model(tmp_path):
    """The LT_chunked step split over h100x8: one all-gather of the slice states per layer
    forward and one reduce-scatter backward, each sending exactly the model's bytes."""
    from linear_gpt2.experiments import collectives
    from linear_gpt2.experiments.compile_step import compile_train_step
    from linear_gpt2.model.config import ModelConfig

    cfg = ModelConfig(vocab_size=512, block_size=4096, n_layer=2, n_head=2, n_embd=128,
                      attention="LT_chunked", chunk_size=64, remat="none", loss_chunk=0,
                      dtype="bfloat16")  # fmt: skip
    report = compile_train_step(cfg, "h100x8", batch=1, context=4096, context_parallel=8)
    rows = {(r["kind"], r["where"]): r for r in report.collectives}
    per_layer = collectives.linear_state_bytes(1, 2, 64, 8)
    for kind in ("all-gather", "reduce-scatter"):
        row = rows[(kind, "attention")]
        assert row["axes"] == "seq" and row["launches"] == 2
        assert row["sent_bytes"] == pytest.approx(2 * per_layer, rel=1e-9)
    assert report.context_parallel == 8 and report.fits


def test_one_sequence_shard_keeps_the_one_axis_mesh():
    """context_parallel = 1 builds the mesh of before (one ``data`` axis), so the program is
    unchanged; > 1 puts a sequence's devices side by side on ``seq``."""
    import jax

    from linear_gpt2.training.sharding import make_mesh, traced_on

    mesh = make_mesh(context_parallel=1)
    assert mesh.axis_names == ("data",)

    def f():
        return 1

    assert traced_on(mesh, f) is f
    if len(jax.devices()) >= 2:
        two = make_mesh(jax.devices()[:2], context_parallel=2)
        assert dict(two.shape) == {"data": 1, "seq": 2}


def test_cpu_collectives_flag_is_set_only_with_several_host_devices():
    code = (
        "import os; from linear_gpt2.platform import process; process.configure(); "
        "print(os.environ.get('XLA_FLAGS', ''))"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    one = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    many = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "concurrency_optimized_scheduler" not in one.stdout
    assert "--xla_cpu_enable_concurrency_optimized_scheduler=false" in many.stdout


# --------------------------------------------------------------------------------------------
# Collectives one at a time on host devices (issue 38)

ONE_AT_A_TIME = """
import json, sys
from linear_gpt2.experiments.collectives import unordered_collectives
from linear_gpt2.training.config import load_config
from linear_gpt2.training.train_step import jit_train_step, make_eval_step
from linear_gpt2.training.trainer import _lay_out
import jax
out = {}
for name, overrides in json.loads(sys.argv[2]).items():
    cfg = load_config(sys.argv[1], overrides)
    lay = _lay_out(cfg)
    step = jit_train_step(lay.model_cfg, lay.tx, lay.mesh, accum=lay.plan.accum,
                          batch=lay.plan.global_micro_batch, context=cfg.data.context)
    out[name] = unordered_collectives(step.step.lower(*step.args).compile().as_text())
print(json.dumps(out))
"""


@SLOW
def test_every_device_runs_its_collectives_one_at_a_time(tmp_path):
    """The training steps of both context-parallel families, compiled for 8 host devices with
    JAX's own device setting (so XLA:CPU's concurrency-optimised scheduler stays on, as for a
    user who sets JAX_NUM_CPU_DEVICES): no collective may start while a loop's collectives are
    in flight on the same device. The loss's count of tokens did (a reduction over the targets
    alone), and such runs aborted in XLA's rendezvous (benchmarks/context_parallel_stress.py)."""
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    cases = {
        "flash": ["attention.name=flash", "train.context_parallel=2", "model.loss_chunk=0"],
        "LT_chunked, fused loss": [*CP, "train.context_parallel=2", "model.loss_chunk=8"],
    }
    env = {k: v for k, v in _env(1).items() if k != "XLA_FLAGS"}
    env.update(JAX_NUM_CPU_DEVICES="8", XLA_FLAGS=os.environ.get("XLA_FLAGS", ""))
    proc = subprocess.run(
        [sys.executable, "-c", ONE_AT_A_TIME, str(config), json.dumps(cases)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == dict.fromkeys(cases, [])


def test_collectives_that_may_overlap_a_loop_are_found():
    """The HLO reading behind the test above: a collective after a loop that holds collectives
    is flagged unless it depends on the loop's result; collectives inside one computation in a
    chain of data are not."""
    from linear_gpt2.experiments.collectives import unordered_collectives

    def module(after: str) -> str:
        return f"""HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {{
  %p = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4] get-tuple-element(%p), index=1
  %r = f32[4] all-reduce(%x), channel_id=1, replica_groups={{{{0,1}}}}, to_apply=%add
  ROOT %t = (s32[], f32[4]) tuple(%i, %r)
}}

%cond (q: (s32[], f32[4])) -> pred[] {{
  %q = (s32[], f32[4]) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}}

ENTRY %main (x0: f32[4], y0: f32[4]) -> f32[4] {{
  %x0 = f32[4] parameter(0)
  %y0 = f32[4] parameter(1)
  %z = s32[] constant(0)
  %init = (s32[], f32[4]) tuple(%z, %x0)
  %w = (s32[], f32[4]) while(%init), condition=%cond, body=%body
  %out = f32[4] get-tuple-element(%w), index=1
  %late = f32[4] all-reduce({after}), channel_id=2, replica_groups={{{{0,1}}}}, to_apply=%add
  ROOT %sum = f32[4] add(%out, %late)
}}
"""

    assert unordered_collectives(module("%y0")) == [("main", "w", "late")]
    assert unordered_collectives(module("%out")) == []
