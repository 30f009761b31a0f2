"""Config loading: YAML + dotted overrides onto the typed schema; every bad input is a clear error."""

import dataclasses
from pathlib import Path

import pytest

from linear_gpt2 import attention
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.platform.errors import ConfigError
from linear_gpt2.training.config import Config, diff, load_config, main, save_config


def write(tmp_path, text, name="run.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_are_gpt2_124m_from_scratch():
    cfg = load_config()
    m = cfg.model_config
    assert (m.n_layer, m.n_head, m.n_embd, m.vocab_size, m.block_size) == (12, 12, 768, 50304, 1024)
    assert m.attention == "softmax" and not m.doc_reset and m.decay == "none"
    assert load_config(None, ["attention.name=LT_chunked"]).model_config.feature_map == "softplus"
    assert cfg.train.tokens_per_update == 2**19


def test_yaml_then_overrides_in_order(tmp_path):
    p = write(
        tmp_path,
        "model: {n_layer: 4, n_head: 4, n_embd: 128}\nattention: {name: LT_chunked, chunk_size: 32}\n",
    )
    cfg = load_config(p, ["model.n_layer=24", "attention.chunk_size=128", "train.lr=3e-4"])
    assert cfg.model.n_layer == 24 and cfg.model.n_head == 4
    assert cfg.attention.chunk_size == 128
    assert cfg.train.lr == pytest.approx(3e-4)
    assert isinstance(cfg.model.n_layer, int) and isinstance(cfg.train.lr, float)


def test_preset_fills_sizes_and_explicit_keys_win(tmp_path):
    p = write(tmp_path, "model: {preset: 355M, n_layer: 2}\n")
    cfg = load_config(p)
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd) == (2, 16, 1024)
    cfg = load_config(None, ["model.preset=gpt2-xl"])
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd) == (48, 25, 1600)


def test_defaults_key_extends_another_file(tmp_path):
    write(tmp_path, "model: {n_layer: 3, n_head: 2, n_embd: 64}\nlog: {name: base}\n", "base.yaml")
    p = write(tmp_path, "defaults: [base.yaml]\nlog: {name: child}\n")
    cfg = load_config(p)
    assert cfg.model.n_layer == 3 and cfg.log.name == "child"
    assert cfg.log.run_dir == "runs/child"  # interpolation resolved after merging


@pytest.mark.parametrize(
    "override, must_mention",
    [
        (["model.n_layr=3"], ["model.n_layr", "did you mean 'n_layer'", "n_head", "block_size"]),
        (["atention.name=softmax"], ["atention", "attention", "model"]),
        (["train.learning_rate=1"], ["train.learning_rate", "lr", "warmup_steps"]),
    ],
)
def test_unknown_keys_name_the_key_and_list_valid_ones(override, must_mention):
    with pytest.raises(ConfigError) as e:
        load_config(None, override)
    for text in must_mention:
        assert text in str(e.value)


def test_unknown_key_in_yaml_file(tmp_path):
    p = write(tmp_path, "model:\n  n_embed: 768\n")
    with pytest.raises(ConfigError, match=r"model\.n_embed.*did you mean 'n_embd'"):
        load_config(p)


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.n_layer=twelve", "model.n_layer"),
        ("model.bias=maybe", "model.bias"),
        ("train.lr=fast", "train.lr"),
        ("attention.chunk_size=1.5", "attention.chunk_size"),
    ],
)
def test_wrong_types_name_the_key(override, key):
    with pytest.raises(ConfigError, match="wrong type") as e:
        load_config(None, [override])
    assert key in str(e.value)


@pytest.mark.parametrize(
    "overrides, must_mention",
    [
        (["model.n_embd=100", "model.n_head=12"], ["n_embd=100", "n_head=12", "divisible"]),
        (["data.context=2048"], ["data.context", "2048", "block_size=1024"]),
        (["attention.name=LT_chunkd"], ["attention.name", "LT_chunked", "softmax"]),
        (["attention.feature_map=elu"], ["feature_map", "elu1", "softplus"]),
        (["attention.scan=prefix"], ["attention.scan", "cumsum", "associative"]),
        (["attention.kernel=cuda"], ["attention.kernel", "pallas", "xla"]),
        (["attention.chunk_size=0"], ["attention.chunk_size", ">= 1"]),
        (["model.dropout=1.5"], ["model.dropout"]),
        (["model.dtype=float16"], ["model.dtype", "bfloat16"]),
        (["model.preset=gpt3"], ["model.preset", "124M", "gpt2-xl"]),
        (["train.min_lr=1"], ["train.min_lr"]),
        (["log.wandb=maybe"], ["log.wandb", "offline", "disabled"]),
        (["model.n_layer=0"], ["model.n_layer", "positive"]),
        (["model.vocab_size=1000"], ["model.vocab_size", "50257", "50304"]),
    ],
)
def test_impossible_values_and_combinations(overrides, must_mention):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    for text in must_mention:
        assert text in str(e.value)


def test_chunk_size_must_divide_context():
    overrides = ["attention.name=LT_chunked", "attention.chunk_size=96", "data.context=1000"]
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    msg = str(e.value)
    assert "chunk_size=96" in msg and "T=1000" in msg and "e.g. chunk_size=50" in msg
    cfg = load_config(
        None, ["attention.name=LT_chunked", "attention.chunk_size=1000", "data.context=1000"]
    )
    assert cfg.attention.chunk_size == 1000


def test_bad_files_and_override_syntax(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["model.n_layer"])


def test_model_config_is_flat_hashable_and_validated():
    # An option only another variant reads (chunk_size under softmax) is checked and dropped.
    m = ModelConfig(n_layer=2, n_head=2, n_embd=64, attention="softmax", chunk_size=16)
    assert hash(m) == hash(ModelConfig(n_layer=2, n_head=2, n_embd=64, chunk_size=16))
    assert m.head_dim == 32
    assert set(m.attention_options.as_dict()) == {"doc_reset", "decay"}  # softmax's own
    # The variant's options read flat, and hash with the rest (a static argument of jax.jit).
    c = ModelConfig(n_layer=2, n_head=2, n_embd=64, attention="LT_chunked", chunk_size=16)
    assert c.chunk_size == 16 and c.feature_map == "softplus" and c.replace(chunk_size=32) != c
    assert hash(c.replace(chunk_size=32)) == hash(c.replace(chunk_size=32))
    assert c.replace(attention="softmax") == m  # the options both declare carry, others drop
    with pytest.raises(AttributeError, match="'softmax' has no option 'chunk_size'"):
        m.chunk_size  # noqa: B018
    with pytest.raises(ConfigError, match="chunk_size: .*int >= 1 or 'auto'"):
        ModelConfig(attention="LT_chunked", chunk_size=0)
    with pytest.raises(ConfigError, match="not divisible"):
        ModelConfig(n_embd=65, n_head=2)
    with pytest.raises(ConfigError, match="valid names"):
        ModelConfig(attention="nope")
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.n_layer = 3  # type: ignore[misc]


def test_run_config_builds_model_config():
    cfg = load_config(None, ["attention.name=LT_state", "attention.eps=1e-5", "model.n_layer=3"])
    m = cfg.model_config
    assert m.attention == "LT_state" and m.eps == 1e-5 and m.n_layer == 3


def test_every_registered_attention_name_is_a_valid_config_value():
    for name in attention.names():
        assert (
            load_config(None, [f"attention.name={name}", "attention.chunk_size=64"]).attention.name
            == name
        )


def test_resolved_config_round_trips_through_its_saved_yaml(tmp_path):
    cfg = load_config(
        None,
        [
            "model.n_layer=5",
            "log.tags=[a,b]",
            "attention.name=LT_chunked",
            "attention.chunk_size=32",
        ],
    )
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg
    assert diff(cfg, again) == {}
    other = load_config(None, ["model.n_layer=6", "attention.name=LT_chunked"])
    assert set(diff(cfg, other)) >= {"model.n_layer", "log.tags", "attention.chunk_size"}


def test_cli_prints_resolved_yaml_and_fails_with_code_2(capsys):
    assert main(["model.n_layer=7"]) == 0
    assert "n_layer: 7" in capsys.readouterr().out
    assert main(["model.n_layer=x"]) == 2
    assert "model.n_layer" in capsys.readouterr().err


def test_config_object_is_the_schema():
    # The six sections the issue asks for, and nothing silently extra.
    names = [f.name for f in dataclasses.fields(Config)]
    assert names == ["model", "attention", "data", "train", "log", "checkpoint", "seed"]


CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


RUN_CONFIGS = sorted(p for p in CONFIG_DIR.rglob("*.yaml") if p.parent.name != "sweeps")


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_shipped_configs_load_and_plan(path):
    from linear_gpt2.training.trainer import plan_batches

    cfg = load_config(path)
    # post: one 8-GPU node; long: the sequence over a node or two (train.context_parallel)
    devices = {"post": 8, "long": max(8, cfg.train.context_parallel)}.get(path.parent.name, 1)
    plan = plan_batches(cfg, devices=devices, processes=1)
    assert plan.sequences * cfg.data.context == cfg.train.tokens_per_update


def test_post_configs_cover_the_learning_study():
    names = {p.stem for p in (CONFIG_DIR / "post").glob("*_*.yaml")}
    expected = {
        f"{size}_{attn}_{ctx}"
        for size in ("124M", "355M", "774M")
        for attn in ("flash", "LT_chunked")
        for ctx in ("1k", "4k", "16k", "64k")
    }
    assert names == expected
    cfg = load_config(CONFIG_DIR / "post" / "355M_LT_chunked_16k.yaml")
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.data.context) == (24, 1024, 16384)
    assert cfg.train.tokens_per_update == 2**19 and cfg.train.max_hours == 24
