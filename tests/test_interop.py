"""``linear_gpt2.model.interop``: layouts, exact round trips, files, and the errors for checkpoints that
do not fit. (Numerical parity with the torch models: test_parity_hf.py, test_parity_nanogpt.py.)"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from linear_gpt2.model import interop, param_shapes
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.model.interop import (
    CheckpointError,
    MissingKeysError,
    ShapeMismatchError,
    TiedWeightsError,
    UnexpectedKeysError,
    VocabSizeMismatchError,
    from_hf,
    from_nanogpt,
    load_params,
    load_state_dict,
    save_state_dict,
    to_hf,
    to_nanogpt,
)

V, T, L, C = 11, 5, 2, 8
FROM = {"nanogpt": from_nanogpt, "hf": from_hf}
TO = {"nanogpt": to_nanogpt, "hf": to_hf}
FORMATS = ["nanogpt", "hf"]
BIASES = pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])


def _cfg(bias: bool = True, **kw) -> ModelConfig:
    return ModelConfig(
        **{
            **dict(vocab_size=V, block_size=T, n_layer=L, n_head=2, n_embd=C, bias=bias),
            **kw,
        }
    )


def _random_state_dict(cfg: ModelConfig, fmt: str, seed: int = 0) -> dict[str, np.ndarray]:
    """A full float32 state dict in ``fmt`` with distinct random values everywhere."""
    rng = np.random.default_rng(seed)
    sd = {
        k: rng.standard_normal(s).astype(np.float32)
        for k, s in interop.expected_state_dict_shapes(cfg, fmt).items()
    }
    sd["lm_head.weight"] = sd["transformer.wte.weight"]  # tied
    return sd


def _random_params(cfg: ModelConfig, seed: int = 0):
    rng = np.random.default_rng(seed)
    shapes = param_shapes(cfg)
    return jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), shapes)


def _assert_state_dicts_equal(a: dict, b: dict, ordered: bool = True) -> None:
    # Order matters for to_x (torch's state_dict order), not in files (safetensors sorts keys).
    assert list(a) == list(b) if ordered else sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype == np.float32, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _assert_trees_equal(a, b) -> None:
    fa, fb = (dict(jax.tree_util.tree_leaves_with_path(t)) for t in (a, b))
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_array_equal(np.asarray(fa[k]), np.asarray(fb[k]), err_msg=str(k))


# --------------------------------------------------------------------------------------------
# Layout


NANOGPT_BLOCK_KEYS = [  # nanoGPT's GPT(bias=True).state_dict() keys for one block, in order
    "ln_1.weight",
    "ln_1.bias",
    "attn.c_attn.weight",
    "attn.c_attn.bias",
    "attn.c_proj.weight",
    "attn.c_proj.bias",
    "ln_2.weight",
    "ln_2.bias",
    "mlp.c_fc.weight",
    "mlp.c_fc.bias",
    "mlp.c_proj.weight",
    "mlp.c_proj.bias",
]


@BIASES
def test_state_dict_keys_and_shapes_are_nanogpts_and_hfs(bias):
    cfg = _cfg(bias)
    block = [k for k in NANOGPT_BLOCK_KEYS if bias or not k.endswith(".bias")]
    keys = (
        ["transformer.wte.weight", "transformer.wpe.weight"]
        + [f"transformer.h.{i}.{k}" for i in range(L) for k in block]
        + ["transformer.ln_f.weight"]
        + (["transformer.ln_f.bias"] if bias else [])
        + ["lm_head.weight"]
    )
    nano = interop.expected_state_dict_shapes(cfg, "nanogpt")
    hf = interop.expected_state_dict_shapes(cfg, "hf")
    assert list(nano) == list(hf) == keys
    # torch.nn.Linear weights are [out, in]; HF's Conv1D weights are [in, out].
    for i in range(L):
        p = f"transformer.h.{i}."
        assert nano[p + "attn.c_attn.weight"] == (3 * C, C)
        assert hf[p + "attn.c_attn.weight"] == (C, 3 * C)
        assert nano[p + "mlp.c_fc.weight"] == (4 * C, C)
        assert hf[p + "mlp.c_fc.weight"] == (C, 4 * C)
        assert nano[p + "mlp.c_proj.weight"] == (C, 4 * C)
        assert hf[p + "mlp.c_proj.weight"] == (4 * C, C)
    assert nano["transformer.wte.weight"] == nano["lm_head.weight"] == (V, C)
    assert nano["transformer.wpe.weight"] == (T, C)


@BIASES
def test_expected_params_shapes_match_the_model(bias):
    cfg = _cfg(bias)
    shapes = param_shapes(cfg)
    flat = {
        tuple(k.key for k in path): tuple(leaf.shape)
        for path, leaf in jax.tree_util.tree_leaves_with_path(shapes)
    }
    assert flat == interop.expected_params_shapes(cfg)


@BIASES
def test_orientation_and_layer_order(bias):
    """Layer i of the stack is ``h.{i}``; nanoGPT's Linear weights are our kernels transposed,
    HF's Conv1D weights are our kernels as they are; everything else is copied."""
    cfg = _cfg(bias)
    sd = _random_state_dict(cfg, "nanogpt")
    params = from_nanogpt(sd, cfg)
    for i in range(L):
        w = sd[f"transformer.h.{i}.attn.c_attn.weight"]  # [3C, C] = [out, in]
        np.testing.assert_array_equal(params["h"]["attn"]["c_attn"]["kernel"][i], w.T)
        w = sd[f"transformer.h.{i}.attn.c_proj.weight"]  # square: only values can tell
        np.testing.assert_array_equal(params["h"]["attn"]["c_proj"]["kernel"][i], w.T)
        np.testing.assert_array_equal(
            params["h"]["ln_2"]["scale"][i], sd[f"transformer.h.{i}.ln_2.weight"]
        )
        if bias:
            np.testing.assert_array_equal(
                params["h"]["mlp"]["c_fc"]["bias"][i], sd[f"transformer.h.{i}.mlp.c_fc.bias"]
            )
    np.testing.assert_array_equal(params["wte"]["embedding"], sd["transformer.wte.weight"])
    np.testing.assert_array_equal(params["wpe"]["embedding"], sd["transformer.wpe.weight"])

    hf = to_hf(params, cfg)
    nano = to_nanogpt(params, cfg)
    for k in nano:
        is_kernel = k.startswith("transformer.h.") and k.endswith("weight") and "ln_" not in k
        np.testing.assert_array_equal(hf[k], nano[k].T if is_kernel else nano[k], err_msg=k)


# --------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("fmt", FORMATS)
@BIASES
def test_round_trip_state_dict_is_exact(fmt, bias):
    cfg = _cfg(bias)
    sd = _random_state_dict(cfg, fmt)
    _assert_state_dicts_equal(TO[fmt](FROM[fmt](sd, cfg), cfg), sd)


@pytest.mark.parametrize("fmt", FORMATS)
@BIASES
def test_round_trip_params_is_exact(fmt, bias):
    cfg = _cfg(bias)
    params = _random_params(cfg)
    sd = TO[fmt](params, cfg)
    assert sd["lm_head.weight"] is sd["transformer.wte.weight"]  # tied, one array
    assert all(v.flags.c_contiguous and v.flags.writeable for v in sd.values())
    back = FROM[fmt](sd, cfg)
    _assert_trees_equal(back, params)
    assert jax.tree.structure(back) == jax.tree.structure(params)


def test_torch_tensors_are_accepted():
    torch = pytest.importorskip("torch", reason="torch is the parity extra")
    cfg = _cfg()
    sd = _random_state_dict(cfg, "nanogpt")
    tsd = {k: torch.from_numpy(v).requires_grad_(True) for k, v in sd.items()}
    _assert_trees_equal(from_nanogpt(tsd, cfg), from_nanogpt(sd, cfg))
    # Half-precision checkpoints are widened to float32.
    bf = {k: v.detach().to(torch.bfloat16) for k, v in tsd.items()}
    params = from_nanogpt(bf, cfg)
    wte = params["wte"]["embedding"]
    assert wte.dtype == np.float32
    np.testing.assert_array_equal(wte, bf["transformer.wte.weight"].float().numpy())


def test_torch_compile_prefix_and_mask_buffers_are_ignored():
    cfg = _cfg()
    sd = _random_state_dict(cfg, "nanogpt")
    compiled = {f"_orig_mod.{k}": v for k, v in sd.items()}
    for i in range(L):  # nanoGPT's causal mask without flash attention: [1, 1, T, T]
        compiled[f"_orig_mod.transformer.h.{i}.attn.bias"] = np.tril(np.ones((1, 1, T, T)))
    _assert_trees_equal(from_nanogpt(compiled, cfg), from_nanogpt(sd, cfg))


def test_hf_buffers_and_bare_gpt2model_layout():
    cfg = _cfg()
    sd = _random_state_dict(cfg, "hf")
    ref = from_hf(sd, cfg)
    with_buffers = dict(sd)
    for i in range(L):
        with_buffers[f"transformer.h.{i}.attn.bias"] = np.tril(np.ones((1, 1, T, T)))
        with_buffers[f"transformer.h.{i}.attn.masked_bias"] = np.float32(-1e4)
    _assert_trees_equal(from_hf(with_buffers, cfg), ref)
    # The hub's gpt2 checkpoints are GPT2Model's: no "transformer." prefix and no lm_head.
    bare = {k.removeprefix("transformer."): v for k, v in with_buffers.items()}
    del bare["lm_head.weight"]
    _assert_trees_equal(from_hf(bare, cfg), ref)
    assert interop.detect_format(bare, cfg) == "hf"


@pytest.mark.parametrize("fmt", FORMATS)
def test_lm_head_is_optional_but_must_be_tied(fmt):
    cfg = _cfg()
    sd = _random_state_dict(cfg, fmt)
    no_head = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    _assert_trees_equal(FROM[fmt](no_head, cfg), FROM[fmt](sd, cfg))
    untied = dict(sd, **{"lm_head.weight": sd["lm_head.weight"] + 1e-3})
    with pytest.raises(TiedWeightsError, match=r"lm_head\.weight"):
        FROM[fmt](untied, cfg)


# --------------------------------------------------------------------------------------------
# Files


@pytest.mark.parametrize("suffix", [".pt", ".safetensors", ".npz"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_save_load_files(tmp_path, suffix, fmt):
    if suffix == ".pt":
        pytest.importorskip("torch", reason="torch is the parity extra")
    cfg = _cfg()
    sd = _random_state_dict(cfg, fmt)
    path = tmp_path / f"weights{suffix}"
    save_state_dict(sd, path)
    _assert_state_dicts_equal(load_state_dict(path), sd, ordered=False)
    # "auto" tells the layouts apart by the orientation of c_attn.weight.
    _assert_trees_equal(load_params(path, cfg), FROM[fmt](sd, cfg))
    _assert_trees_equal(load_params(path, cfg, format=fmt), FROM[fmt](sd, cfg))


def test_nanogpt_training_checkpoint(tmp_path):
    """nanoGPT's train.py saves {"model": raw_model.state_dict(), "optimizer": ..., ...}, with
    ``_orig_mod.`` keys when the model was torch.compile'd."""
    torch = pytest.importorskip("torch", reason="torch is the parity extra")
    cfg = _cfg()
    sd = _random_state_dict(cfg, "nanogpt")
    model = {f"_orig_mod.{k}": torch.from_numpy(v) for k, v in sd.items()}
    ckpt = {
        "model": model,
        "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": []},
        "model_args": dict(n_layer=L, n_head=2, n_embd=C, block_size=T, bias=True, vocab_size=V),
        "iter_num": 3,
        "best_val_loss": torch.tensor(2.5),
        "config": {"learning_rate": 6e-4, "dataset": "openwebtext"},
    }
    path = tmp_path / "ckpt.pt"
    torch.save(ckpt, path)
    loaded = load_state_dict(path)
    assert set(loaded) == set(model)
    _assert_trees_equal(load_params(path, cfg), from_nanogpt(sd, cfg))
    _assert_trees_equal(load_params(path, cfg, format="nanogpt"), from_nanogpt(sd, cfg))


def test_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        load_state_dict(tmp_path / "nope.pt")
    (tmp_path / "w.h5").write_bytes(b"")
    with pytest.raises(ValueError, match=r"\.h5"):
        load_state_dict(tmp_path / "w.h5")
    with pytest.raises(ValueError, match=r"\.h5"):
        save_state_dict({}, tmp_path / "w.h5")


@pytest.mark.parametrize("suffix", [".pt", ".safetensors", ".npz"])
def test_a_damaged_weights_file_names_the_file_and_the_fix(tmp_path, suffix):
    """A file cut short is the package's own run error (exit 1 from a command, one line), with
    the file's name, not the reader's bare exception; a bad ``format`` is refused before the
    file is read."""
    from linear_gpt2.platform import cli, errors

    if suffix == ".pt":
        pytest.importorskip("torch", reason="torch is the parity extra")
    cfg = _cfg()
    path = tmp_path / f"weights{suffix}"
    save_state_dict(_random_state_dict(cfg, "hf"), path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    with pytest.raises(interop.WeightsFileError) as e:
        load_params(path, cfg)
    assert isinstance(e.value, errors.RunError)
    code, line = cli.exit_code_and_message(e.value)
    assert code == 1 and str(path) in line and "download or export it again" in line
    with pytest.raises(errors.UsageError, match=r"format must be one of .*'auto', got 'gpt2'"):
        load_params(tmp_path / "not_read.npz", cfg, format="gpt2")
    with pytest.raises(errors.PathNotFoundError, match="not_read.npz"):
        load_params(tmp_path / "not_read.npz", cfg, format="hf")


# --------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_key(fmt):
    cfg = _cfg()
    sd = _random_state_dict(cfg, fmt)
    del sd["transformer.h.1.mlp.c_fc.weight"]
    with pytest.raises(MissingKeysError) as e:
        FROM[fmt](sd, cfg)
    msg = str(e.value)
    assert "transformer.h.1.mlp.c_fc.weight" in msg and "Expected" in msg
    assert "transformer.h.{0..1}.{ln_1.weight" in msg  # what was expected, compactly
    assert e.value.keys == ["transformer.h.1.mlp.c_fc.weight"]
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("fmt", FORMATS)
def test_wrong_shape(fmt):
    cfg = _cfg()
    sd = _random_state_dict(cfg, fmt)
    sd["transformer.h.0.mlp.c_proj.bias"] = np.zeros(C + 1, np.float32)
    with pytest.raises(ShapeMismatchError) as e:
        FROM[fmt](sd, cfg)
    msg = str(e.value)
    assert "transformer.h.0.mlp.c_proj.bias" in msg
    assert f"expected shape [{C}], found [{C + 1}]" in msg
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("fmt", FORMATS)
def test_extra_key(fmt):
    cfg = _cfg()
    sd = dict(_random_state_dict(cfg, fmt), **{"transformer.h.0.attn.rotary": np.zeros(3)})
    with pytest.raises(UnexpectedKeysError, match=r"transformer\.h\.0\.attn\.rotary"):
        FROM[fmt](sd, cfg)


@pytest.mark.parametrize("fmt", FORMATS)
def test_wrong_vocab_says_which_vocab_size_to_set(fmt):
    sd = _random_state_dict(_cfg(vocab_size=50257), fmt)
    with pytest.raises(VocabSizeMismatchError) as e:
        FROM[fmt](sd, _cfg(vocab_size=50304))
    msg = str(e.value)
    assert "transformer.wte.weight" in msg
    assert "vocab_size=50257" in msg and "50304" in msg
    assert "[50257, 8]" in msg and "[50304, 8]" in msg
    assert isinstance(e.value, ShapeMismatchError) and isinstance(e.value, ValueError)


def test_errors_give_the_config_to_set():
    sd = _random_state_dict(_cfg(n_layer=3), "nanogpt")
    with pytest.raises(UnexpectedKeysError, match=r"transformer\.h\.2\..*set n_layer=3"):
        from_nanogpt(sd, _cfg(n_layer=2))
    with pytest.raises(MissingKeysError, match=r"transformer\.h\.3\..*set n_layer=3"):
        from_nanogpt(sd, _cfg(n_layer=4))
    with pytest.raises(ShapeMismatchError, match=r"transformer\.wpe\.weight.*block_size=5"):
        from_nanogpt(sd, _cfg(n_layer=3, block_size=7))
    sd = _random_state_dict(_cfg(bias=False), "nanogpt")
    with pytest.raises(MissingKeysError, match=r"ln_1\.bias.*set bias=False"):
        from_nanogpt(sd, _cfg(bias=True))
    sd = _random_state_dict(_cfg(bias=True), "nanogpt")
    with pytest.raises(UnexpectedKeysError, match=r"ln_1\.bias.*set bias=True"):
        from_nanogpt(sd, _cfg(bias=False))


def test_the_other_layout_is_named():
    """An HF state dict given to from_nanogpt fails on the transposed weights, and says so."""
    cfg = _cfg()
    with pytest.raises(
        ShapeMismatchError,
        match=r"c_attn\.weight: expected shape \[24, 8\], found \[8, 24\].*from_hf",
    ):
        from_nanogpt(_random_state_dict(cfg, "hf"), cfg)
    with pytest.raises(ShapeMismatchError, match=r"from_nanogpt"):
        from_hf(_random_state_dict(cfg, "nanogpt"), cfg)
    sd = _random_state_dict(_cfg(n_embd=16), "hf")
    with pytest.raises(ShapeMismatchError, match=r"c_attn\.weight.*n_embd"):
        interop.detect_format(sd, cfg)


def test_params_that_do_not_fit_the_config():
    cfg = _cfg()
    params = _random_params(cfg)
    with pytest.raises(UnexpectedKeysError, match=r"ln_f\.bias"):
        to_nanogpt(params, _cfg(bias=False))
    with pytest.raises(
        ShapeMismatchError, match=r"h\.attn\.c_attn\.kernel: expected shape \[3, 8, 24\]"
    ):
        to_hf(params, _cfg(n_layer=3))
    del params["wpe"]
    with pytest.raises(MissingKeysError, match=r"wpe\.embedding"):
        to_hf(params, cfg)
    assert issubclass(MissingKeysError, CheckpointError) and issubclass(CheckpointError, ValueError)
