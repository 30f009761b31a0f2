"""model.scan_layers and model.residual_dtype (issue 37 item 4).

Unrolled blocks compute the scanned blocks' function on the same stacked parameters (values and
gradients equal to float32 precision, every rematerialisation policy); a bfloat16 residual
stream carries the stream (and what remat keeps) in bfloat16, within a stated tolerance of the
float32 stream; a run resumes with the other scan setting and refuses another residual dtype in
one line."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_gpt2.model import init_params, loss_fn
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.platform.errors import ConfigError
from linear_gpt2.training.config import load_config
from tests.helpers import SLOW, rel_err, slow

pytestmark = pytest.mark.usefixtures("full_precision_matmuls")

CFG = ModelConfig(n_layer=3, n_head=2, n_embd=32, vocab_size=97, block_size=40, loss_chunk=0)


def _batch(T: int = 32):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.integers(0, 97, (2, T)))
    y = jnp.asarray(rng.integers(-1, 97, (2, T)))
    return x, y


_value_and_grad = jax.jit(jax.value_and_grad(loss_fn), static_argnums=3)


# Each remat policy once, and forgetting (resets, a decay gate) through the unrolled blocks.
@pytest.mark.parametrize(
    "attention, remat, extra",
    [
        slow("softmax", "none", {}),
        ("LT_chunked", "full", {"chunk_size": 8, "doc_reset": True, "decay": "gate"}),
        slow("flash", "offload", {}),
        slow("LT_chunked", "dots", {"chunk_size": 8}),
    ],
)
def test_unrolled_blocks_equal_the_scan_in_values_and_gradients(attention, remat, extra):
    cfg = CFG.replace(attention=attention, remat=remat, **extra)
    params = init_params(cfg, 0)
    x, y = _batch()
    l0, g0 = _value_and_grad(params, x, y, cfg)
    l1, g1 = _value_and_grad(params, x, y, cfg.replace(scan_layers=False))
    assert abs(float(l1) - float(l0)) <= 1e-6 * abs(float(l0))
    worst = max(jax.tree.leaves(jax.tree.map(rel_err, g1, g0)))
    assert worst <= 1e-5, worst


def test_unrolled_blocks_run_without_a_scan_and_with_dropout():
    """No loop over the layers is left in the unrolled forward; with dropout each layer draws
    its own masks (nanoGPT's three sites per block, and the embeddings')."""
    cfg = CFG.replace(scan_layers=False, dropout=0.1)
    params = init_params(cfg, 0)
    x, y = _batch()
    jaxpr = str(
        jax.make_jaxpr(lambda p: loss_fn(p, x, y, cfg, train=True, rng=jax.random.key(3)))(params)
    )
    assert "scan" not in jaxpr and "while" not in jaxpr
    assert jaxpr.count("name=_bernoulli") == 1 + 3 * cfg.n_layer
    loss = jax.jit(lambda p: loss_fn(p, x, y, cfg, train=True, rng=jax.random.key(3)))(params)
    assert np.isfinite(float(loss))


def test_bfloat16_residual_stream_is_bfloat16_and_within_tolerance_of_float32():
    """With bf16 matmuls, a bf16 stream changes the loss by under 1e-3 relative and the
    gradients by under 3e-2 (relative norm, each parameter) on this model; what full remat keeps
    per block is the stream itself, now bfloat16."""
    from jax._src.ad_checkpoint import saved_residuals

    cfg = CFG.replace(dtype="bfloat16", remat="full")
    params = init_params(cfg, 0)
    x, y = _batch()
    l32, g32 = _value_and_grad(params, x, y, cfg)
    l16, g16 = _value_and_grad(params, x, y, cfg.replace(residual_dtype="bfloat16"))
    assert abs(float(l16) - float(l32)) <= 1e-3 * abs(float(l32))
    worst = max(jax.tree.leaves(jax.tree.map(rel_err, g16, g32)))
    assert worst <= 3e-2, worst
    for dtype, c in (("float32", cfg), ("bfloat16", cfg.replace(residual_dtype="bfloat16"))):
        kept = [a for a, why in saved_residuals(lambda p, c=c: loss_fn(p, x, y, c), params)
                if a.shape == (cfg.n_layer, 2, 32, cfg.n_embd)]  # fmt: skip
        assert [str(a.dtype) for a in kept] == [dtype]


def test_switches_are_checked():
    assert load_config(None, ["model.residual_dtype=bfloat16"]).model.residual_dtype == "bfloat16"
    assert load_config(None, ["model.scan_layers=false"]).model.scan_layers is False
    assert load_config(None, ["model.scan_layers=true"]).model.scan_layers is True
    assert load_config().model.scan_layers == "auto"  # the default
    with pytest.raises(ConfigError, match=r"model.residual_dtype.*'float16'.*valid values"):
        load_config(None, ["model.residual_dtype=float16"])
    # A string other than auto is refused (never read as true), in one line naming the values.
    for bad in ("yes", "false", 1):
        with pytest.raises(ConfigError) as e:
            ModelConfig(scan_layers=bad)
        text = str(e.value)
        assert text.startswith("model.scan_layers: must be auto")
        assert "true" in text and "false" in text and "\n" not in text


def test_scan_auto_unrolls_for_a_gpu_target_and_scans_elsewhere(caplog):
    """auto follows the kernels' rule (the target traced for, not the process's backend): on
    CPU the scan (its lowered text is tests/test_kernels_glue.py's CPU program), for the H100
    the blocks unrolled, the same program as false, noted once on the kernels' choices logger;
    the plan's margin is the unrolled one there; with whole blocks rematerialised, the scan.
    Explicit values are kept everywhere."""
    import logging

    from linear_gpt2 import kernels
    from linear_gpt2.model import gpt
    from linear_gpt2.platform.target import traced_for
    from linear_gpt2.training import memory_plan

    auto = CFG.replace(n_layer=2)
    assert auto.scan_layers == "auto" and gpt.scans_layers(auto)
    assert memory_plan.estimate_margin(auto) == memory_plan.ESTIMATE_MARGIN
    tokens = jnp.zeros((1, 16), jnp.int32)
    params = jax.eval_shape(lambda: init_params(auto, 0))

    def lowered(c):
        c = c.replace(
            layernorm_kernel="xla", mlp_kernel="xla", loss_kernel="xla", bias_kernel="xla"
        )
        return jax.jit(jax.grad(lambda p: loss_fn(p, tokens, tokens, c))).lower(params).as_text()

    gpt._SCAN_NOTED.clear()
    with traced_for("h100"), caplog.at_level(logging.INFO, logger=kernels.CHOICES):
        assert not gpt.scans_layers(auto) and not gpt.scans_layers(auto)
        assert gpt.scans_layers(auto.replace(scan_layers=True))
        assert not gpt.scans_layers(auto.replace(scan_layers=False))
        # Whole blocks rematerialised: the scan (unrolled, they compiled to far more memory).
        assert gpt.scans_layers(auto.replace(remat="full"))
        assert gpt.scans_layers(auto.replace(remat="offload"))
        assert not gpt.scans_layers(auto.replace(remat="dots"))
        assert memory_plan.estimate_margin(auto) == memory_plan.UNROLLED_ESTIMATE_MARGIN
        text = lowered(auto)
        assert text == lowered(auto.replace(scan_layers=False)) and "stablehlo.while" not in text
    assert [r.getMessage() for r in caplog.records if r.name.startswith(kernels.CHOICES)] == [
        "model.scan_layers=auto: unrolled (the program is for a GPU)"
    ]


def test_bad_switches_exit_2_in_one_line_naming_the_key(capsys):
    from linear_gpt2.training.config import main

    for key, value in (("model.residual_dtype", "float16"), ("model.scan_layers", "maybe")):
        assert main([f"{key}={value}"]) == 2
        err = capsys.readouterr().err.strip()
        assert key in err and "\n" not in err, err


def test_a_resume_may_switch_the_scan_but_not_the_stream():
    # Declared beside the fields (ArchConfig's metadata): the unrolled blocks run on the scan's
    # stacked parameters, so the checkpoint serves both; a bfloat16 stream rounds differently.
    cfg = load_config()
    assert cfg.resume_may_change("model.scan_layers")
    assert not cfg.resume_may_change("model.residual_dtype")
    assert not cfg.resume_may_change("model.dtype")  # its neighbour, for contrast


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny config on the sample corpus, tokenized once for the runs below."""
    from linear_gpt2.training.config import DataConfig
    from linear_gpt2.training.data import prepare_sample

    root = tmp_path_factory.mktemp("switches")
    sample = root / "sample"
    data = DataConfig(source="sample", path=str(sample), context=16)
    prepare_sample(data, "train")
    prepare_sample(data, "validation")
    config = root / "tiny.yaml"
    config.write_text(
        "model: {vocab_size: 50304, block_size: 16, n_layer: 2, n_head: 2, n_embd: 32}\n"
        "data: {source: sample, context: 16}\n"
        "train: {tokens_per_update: 64, micro_batch: 2, max_steps: 3, warmup_steps: 1}\n"
        "log: {wandb: disabled, eval_every: 0}\n"
        "checkpoint: {resume: never, every: 2, async_save: false}\n"
    )
    return root, config, [f"data.path={sample}"]


@SLOW
def test_a_run_resumes_unrolled_from_a_scanned_checkpoint_and_refuses_another_stream(tiny_run):
    from linear_gpt2.training.checkpoint import IncompatibleCheckpointError
    from linear_gpt2.training.trainer import train

    root, config, base = tiny_run
    straight = train(load_config(config, [*base, f"log.run_dir={root}/straight"]))
    run = [*base, f"log.run_dir={root}/switched"]
    train(load_config(config, [*run, "train.max_steps=2"]))
    resumed = train(
        load_config(config, [*run, "checkpoint.resume=auto", "model.scan_layers=false"])
    )
    assert resumed.last_step == 3
    assert resumed.losses[3] == pytest.approx(straight.losses[3], rel=1e-5)
    with pytest.raises(IncompatibleCheckpointError) as e:
        train(load_config(config, [*run, "checkpoint.resume=auto", "train.max_steps=4",
                                   "model.residual_dtype=bfloat16"]))  # fmt: skip
    msg = str(e.value)
    assert "\n" not in msg and "model.residual_dtype (checkpoint 'float32', now 'bfloat16')" in msg
