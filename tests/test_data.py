"""Data pipeline: tokenization, packing, shards, hosts, resume, bad input (on tiny local C4 files)."""

from __future__ import annotations

import gzip
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from linear_gpt2.model.tokenizer import EOT, encode
from linear_gpt2.platform.errors import ConfigError
from linear_gpt2.training.config import DataConfig
from linear_gpt2.training.data import (
    DataError,
    Packer,
    Prefetcher,
    TokenShards,
    c4_files,
    doc_tokens,
    document_boundaries,
    make_loader,
    permute,
    prepare_split,
)
from linear_gpt2.training.data.sample import document, sample_digest
from linear_gpt2.training.data.sources import iter_file, new_stats
from tests.helpers import SLOW

# --------------------------------------------------------------------------------------------
# Fixtures: tiny C4-format corpora


def write_c4(path: Path, texts: list, raw: bytes | None = None) -> Path:
    """A gzip JSON-lines file in C4's format; ``None`` texts give a record without ``text``."""
    lines = []
    for i, t in enumerate(texts):
        rec = {"timestamp": "2019-04-25T12:57:54Z", "url": f"https://example.com/{i}"}
        if t is not None:
            rec["text"] = t
        lines.append(json.dumps(rec))
    with gzip.open(path, "wb") as f:
        f.write(raw if raw is not None else ("\n".join(lines) + "\n").encode())
    return path


def make_corpus(root: Path, n_train=4, docs_per_file=12, n_val=1) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("validation", n_val)):
        for i in range(n):
            texts = [document(7, split, i * 100 + j)["text"][:400] for j in range(docs_per_file)]
            write_c4(root / f"c4-{split}.{i:05d}-of-{n:05d}.json.gz", texts)
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("c4"))


@pytest.fixture(scope="module")
def tokenized(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    for split in ("train", "validation"):
        prepare_split(c4_files(corpus, split), out / split, split, num_proc=1)
    return out


def stream_of(files) -> np.ndarray:
    """The reference token stream: every document's tokens + EOT, files in order."""
    return np.concatenate([doc_tokens(t) for f in files for _, t in iter_file(f)])


def take(loader, n):
    out = [next(loader) for _ in range(n)]
    loader.close()
    return out


def windows_of(batches) -> np.ndarray:
    """Windows [N, T+1] rebuilt from batches (inputs plus the last target)."""
    return np.concatenate(
        [np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1) for b in batches]
    )


# --------------------------------------------------------------------------------------------
# Tokenize and pack


def test_token_ids_match_tiktoken():
    text = "Hello world! The quick brown fox jumps over the lazy dog."
    want = [15496, 995, 0, 383, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13]
    assert encode(text) == want
    assert doc_tokens(text).tolist() == want + [EOT]
    # "<|endoftext|>" inside a document is ordinary text, never the separator.
    assert EOT not in doc_tokens("a <|endoftext|> b")[:-1]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=30),
    st.integers(1, 9),
    st.integers(1, 4),
)
def test_packing_is_exact(doc_lengths, window, rows):
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(0, 50000, n), EOT).astype(np.uint16) for n in doc_lengths]
    packer, out = Packer(window, rows), []
    for i, d in enumerate(docs):
        packer.add(i, d)
        while packer.ready():
            out.append(packer.take())
    stream = np.concatenate(docs)
    got = np.concatenate(out).reshape(-1) if out else np.zeros(0, np.uint16)
    # Consecutive windows reproduce the stream: nothing lost, nothing repeated.
    assert len(got) == (len(stream) // (window * rows)) * window * rows
    np.testing.assert_array_equal(got, stream[: len(got)])


def test_document_boundaries():
    inputs = np.array([[1, EOT, 2, 3, EOT], [4, 5, 6, 7, 8]])
    b = document_boundaries(inputs)
    assert b[0].tolist() == [1, 4] and b[1].tolist() == []


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3000), st.integers(0, 5), st.integers(0, 3))
def test_permute_is_a_bijection(n, seed, epoch):
    p = permute(np.arange(n), n, seed, epoch)
    assert sorted(p.tolist()) == list(range(n))


# --------------------------------------------------------------------------------------------
# Pre-tokenized vs streaming, hosts, resume


def test_pretokenized_equals_streaming(corpus, tokenized):
    files = c4_files(corpus, "train")
    ref = stream_of(files)
    shards = TokenShards(tokenized / "train")
    np.testing.assert_array_equal(shards.read(0, shards.n_tokens), ref)
    assert int((ref == EOT).sum()) == 4 * 12  # one EOT after every document
    cfg = dict(context=31, shuffle=False, prefetch=0)
    tok = make_loader(
        DataConfig(source="c4", tokenized_dir=str(tokenized), **cfg), "train", 3, epochs=1
    )
    stm = make_loader(DataConfig(source="c4", path=str(corpus), **cfg), "train", 3, epochs=1)
    a, b = windows_of(list(tok)), windows_of(list(stm))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a.reshape(-1), ref[: a.size])
    batch = make_loader(DataConfig(source="c4", tokenized_dir=str(tokenized), **cfg), "val", 2)
    first = next(batch)
    assert first["inputs"].dtype == np.int32 and first["inputs"].shape == (2, 31)
    np.testing.assert_array_equal(first["inputs"][:, 1:], first["targets"][:, :-1])


def test_hosts_disjoint_and_cover_pretokenized(tokenized):
    cfg = DataConfig(source="c4", tokenized_dir=str(tokenized), context=15, prefetch=0)
    P, B = 2, 3
    seen = []
    for h in range(P):
        src = make_loader(cfg, "train", B, h, P).source
        for k in range(src.batches_per_epoch):
            seen.extend(src.window_ids(0, k).tolist())
    n_used = src.batches_per_epoch * P * B
    assert len(seen) == len(set(seen)) == n_used  # disjoint
    assert src.n_windows - n_used < P * B  # together they cover the epoch but a partial batch
    # Each host's batches really hold those windows.
    b0 = next(make_loader(cfg, "train", B, 1, P))
    ids = make_loader(cfg, "train", B, 1, P).source.window_ids(0, 0)
    shards = TokenShards(tokenized / "train")
    np.testing.assert_array_equal(b0["inputs"][0], shards.read(int(ids[0]) * 16, 15))


@pytest.mark.parametrize("P", [2, 3])  # 4 files: whole files per host (2) or rows per file (3)
def test_hosts_disjoint_and_cover_streaming(corpus, P):
    cfg = DataConfig(source="c4", path=str(corpus), context=15, prefetch=0)
    parts = []
    for h in range(P):
        src = make_loader(cfg, "train", 2, h, P, epochs=1).source
        start = src.initial_state()
        parts.append({(f, r) for (_, f, r), _, _ in src._docs(start)} if P == 3 else
                     {(src._epoch_files(0)[f].name, r) for (_, f, r), _, _ in src._docs(start)})  # fmt: skip
    assert sum(len(p) for p in parts) == len(set().union(*parts))  # disjoint
    assert len(set().union(*parts)) == 4 * 12  # cover every document


@pytest.mark.parametrize("kind", ["tokenized", "stream", "synthetic"])
def test_resume_equals_uninterrupted(corpus, tokenized, tmp_path, kind):
    if kind == "stream":
        # A tiny corpus, so 9 batches run through several epochs and their boundaries.
        root = tmp_path / "tiny"
        root.mkdir()
        for i in range(2):
            write_c4(
                root / f"c4-train.{i:05d}-of-00002.json.gz",
                [f"Doc {i} {j} " * (j + 3) for j in range(3)],
            )
        cfg = DataConfig(source="c4", path=str(root), context=23, prefetch=2, seed=3)
    elif kind == "tokenized":
        cfg = DataConfig(source="c4", tokenized_dir=str(tokenized), context=63, prefetch=2, seed=3)
    else:
        cfg = DataConfig(source="synthetic", context=16, prefetch=2)
    full = take(make_loader(cfg, "train", 3), 9)
    first = make_loader(cfg, "train", 3)
    head = [next(first) for _ in range(4)]
    state = json.loads(json.dumps(first.state_dict()))  # it must survive a JSON checkpoint
    first.close()
    second = make_loader(cfg, "train", 3)
    second.load_state_dict(state)
    tail = take(second, 5)
    for a, b in zip(full, head + tail, strict=True):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
        np.testing.assert_array_equal(a["targets"], b["targets"])
    if kind != "synthetic":
        assert not np.array_equal(full[0]["inputs"], full[1]["inputs"])


def test_resume_with_other_host_count_is_an_error(tokenized):
    cfg = DataConfig(source="c4", tokenized_dir=str(tokenized), context=15, prefetch=0)
    a = make_loader(cfg, "train", 2, 0, 2)
    next(a)
    b = make_loader(cfg, "train", 2, 0, 1)
    with pytest.raises(ValueError, match=r"process_count=2.*process_count=1"):
        b.load_state_dict(a.state_dict())
    c = make_loader(
        DataConfig(source="c4", tokenized_dir=str(tokenized), context=31), "train", 2, 0, 2
    )
    with pytest.raises(ValueError, match="context"):
        c.load_state_dict(a.state_dict())


def test_validation_is_one_ordered_pass(tokenized):
    cfg = DataConfig(source="c4", tokenized_dir=str(tokenized), context=15, prefetch=1)
    a, b = list(make_loader(cfg, "validation", 2)), list(make_loader(cfg, "val", 2))
    assert len(a) == TokenShards(tokenized / "validation").n_tokens // 16 // 2
    np.testing.assert_array_equal(windows_of(a), windows_of(b))


# --------------------------------------------------------------------------------------------
# Pre-tokenization is resumable


def test_prepare_resumes_after_interruption(corpus, tokenized, tmp_path):
    files = c4_files(corpus, "train")
    out = tmp_path / "train"
    prepare_split(files[:1] + files[1:], out, "train")
    index = json.loads((out / "index.json").read_text())
    # Simulate an interruption: one shard missing from the index, a stale temp file, incomplete.
    gone = files[2].name
    del index["shards"][gone]
    index["complete"] = False
    (out / "index.json").write_text(json.dumps(index))
    (out / (gone.removesuffix(".json.gz") + ".bin.tmp")).write_bytes(b"garbage")
    with pytest.raises(DataError, match="incompletely tokenized"):
        TokenShards(out)
    events = []
    prepare_split(files, out, "train", on_shard=events.append)
    redone = [e["source"] for e in events if not e.get("skipped")]
    assert redone == [gone]
    np.testing.assert_array_equal(
        TokenShards(out).read(0, TokenShards(out).n_tokens),
        TokenShards(tokenized / "train").read(0, TokenShards(tokenized / "train").n_tokens),
    )


# --------------------------------------------------------------------------------------------
# Bad input


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data.path=.*does not exist"):
        make_loader(DataConfig(source="c4", path=str(tmp_path / "nope")), "train", 2)
    with pytest.raises(FileNotFoundError, match=r"no C4 'train' files"):
        c4_files(tmp_path, "train")


def test_empty_file_is_skipped_and_counted(tmp_path):
    write_c4(tmp_path / "c4-train.00000-of-00003.json.gz", ["one document", "two"])
    write_c4(tmp_path / "c4-train.00001-of-00003.json.gz", [], raw=b"")
    (tmp_path / "c4-train.00002-of-00003.json.gz").write_bytes(b"")  # not even a gzip header
    stats = new_stats()
    texts = [t for f in c4_files(tmp_path, "train") for _, t in iter_file(f, stats=stats)]
    assert texts == ["one document", "two"]
    assert stats == {"docs": 2, "no_text": 0, "empty_files": 2}


def test_record_without_text_is_skipped_and_counted(tmp_path, caplog):
    f = write_c4(tmp_path / "c4-train.00000-of-00001.json.gz", ["a", None, "b", ""])
    stats = new_stats()
    assert [(r, t) for r, t in iter_file(f, stats=stats)] == [(0, "a"), (2, "b")]
    assert stats["no_text"] == 2 and "row 1 has no 'text'" in caplog.text


@pytest.mark.parametrize(
    "case, match",
    [
        ("truncated", r"truncated or corrupt gzip file after line \d+ .*re-download it"),
        ("not_json", r"line 4: not valid JSON .*fix that line"),
        ("not_utf8", r"line 4: bytes that are not UTF-8"),
        ("text_not_str", "'text' is int"),
    ],
)
def test_bad_files_are_errors_naming_the_file(tmp_path, case, match):
    f = tmp_path / "c4-train.00000-of-00001.json.gz"
    good = [json.dumps({"text": f"document {i}", "url": "u", "timestamp": "t"}) for i in range(50)]
    if case == "truncated":
        write_c4(f, [f"document {i} " * 50 for i in range(200)])
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2])
    elif case == "not_json":
        write_c4(f, [], raw=("\n".join(good[:3] + ["{not json"] + good[3:]) + "\n").encode())
    elif case == "not_utf8":
        bad = b'{"text": "caf\xe9 \xff", "url": "u", "timestamp": "t"}'
        write_c4(f, [], raw=("\n".join(good[:3]) + "\n").encode() + bad + b"\n")
    else:
        write_c4(f, [], raw=(good[0] + "\n" + json.dumps({"text": 5}) + "\n").encode())
    with pytest.raises(DataError, match=match) as err:
        list(iter_file(f))
    assert str(f) in str(err.value) and "\n" not in str(err.value)
    # The loader surfaces the same error from its prefetch thread.
    loader = make_loader(DataConfig(source="c4", path=str(tmp_path), context=4), "train", 1)
    with pytest.raises(DataError, match=match):
        take(loader, 100)


def test_corrupt_or_empty_token_shard(tokenized, tmp_path):
    import shutil

    bad = tmp_path / "train"
    shutil.copytree(tokenized / "train", bad)
    shard = next(bad.glob("*.bin"))
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"\d+ bytes, but the index records \d+ tokens"):
        TokenShards(bad)
    shard.write_bytes(shard.read_bytes()[:-1])  # not even a whole number of tokens
    with pytest.raises(DataError, match="corrupt or truncated"):
        TokenShards(bad)
    shard.write_bytes(b"")
    with pytest.raises(DataError, match="corrupt"):
        TokenShards(bad)


def test_shards_are_validated_once_when_opened(tokenized, tmp_path):
    """Ids at or above the vocabulary (which would turn into a NaN loss at step 1) fail at open,
    naming the shard and the position; a shard that passed is not scanned again until it
    changes; a wrong dtype in the index is refused."""
    import shutil

    split = tmp_path / "train"
    shutil.copytree(tokenized / "train", split)
    (split / "validated.json").unlink(missing_ok=True)  # copied from the fixture's opens
    first = TokenShards(split)
    assert first.scanned_tokens == first.n_tokens and (split / "validated.json").is_file()
    again = TokenShards(split)
    assert again.scanned_tokens == 0 and again.n_tokens == first.n_tokens

    shard = sorted(split.glob("*.bin"))[1]
    tokens = np.fromfile(shard, dtype=np.uint16)
    tokens[7] = 60000
    tokens.tofile(shard)  # same size, new mtime: scanned again
    with pytest.raises(DataError, match=rf"{shard.name}: token id 60000 at token 7 .* < 50257"):
        TokenShards(split)
    index = json.loads((split / "index.json").read_text())
    index["dtype"] = "uint32"
    (split / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match="dtype 'uint32'"):
        TokenShards(split)
    # The largest id is recorded at write time too.
    assert all(e["max_id"] == EOT for e in index["shards"].values() if e["n_tokens"])


def test_hub_offline_fails_fast(monkeypatch):
    cfg = DataConfig(source="c4")  # no path, no tokenized_dir: the hub
    t = time.monotonic()
    with pytest.raises(DataError, match=r"HF_HUB_OFFLINE.*data\.path=/dir/with/c4-train"):
        make_loader(cfg, "train", 2)
    # Not marked offline but unreachable: still immediate, no retries.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(DataError, match=r"unreachable.*data\.path="):
        make_loader(cfg, "train", 2)
    assert time.monotonic() - t < 5


# --------------------------------------------------------------------------------------------
# Prefetch thread, global arrays, config, sample corpus


def test_prefetch_propagates_errors_and_shuts_down():
    def gen():
        yield 1
        yield 2
        raise KeyError("boom")

    p = Prefetcher(gen, depth=1)
    assert [next(p), next(p)] == [1, 2]
    with pytest.raises(KeyError, match="boom"):
        next(p)
    p.close()

    def endless():
        i = 0
        while True:
            yield i
            i += 1

    before = threading.active_count()
    p = Prefetcher(endless, depth=2)
    assert next(p) == 0
    time.sleep(0.05)  # the producer is now blocked on the full queue
    p.close(timeout=2)
    assert not p._thread.is_alive() and threading.active_count() <= before


def test_to_global_on_a_mesh():
    import jax
    from jax.sharding import Mesh

    from linear_gpt2.training.data import to_global

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    batch = next(make_loader(DataConfig(source="synthetic", context=8, prefetch=0), "train", 4))
    out = to_global(batch, mesh)
    assert out["inputs"].shape == (4 * jax.process_count(), 8)
    np.testing.assert_array_equal(np.asarray(out["targets"]), batch["targets"])


def test_data_config_validation():
    with pytest.raises(ConfigError, match="data.num_proc"):
        DataConfig(num_proc=0)
    with pytest.raises(ConfigError, match="data.prefetch"):
        DataConfig(prefetch=-1)


def test_sample_corpus_is_deterministic_and_loads(tmp_path):
    # Pinned: the generated text must be the same on every machine.
    assert sample_digest(0) == SAMPLE_SHA256
    assert document(0, "train", 5) == document(0, "train", 5)
    cfg = DataConfig(source="sample", path=str(tmp_path / "sample"), context=32, prefetch=1)
    batch = next(make_loader(cfg, "train", 2))
    assert (
        batch["inputs"].shape == (2, 32)
        and (tmp_path / "sample/tokenized/train/index.json").is_file()
    )
    assert len(list(make_loader(cfg, "validation", 8))) > 10


SAMPLE_SHA256 = "b8c640d1bcfc2d595161098ba5beef760620151dc100d0bf4ee2399d690cbef5"


# --------------------------------------------------------------------------------------------
# Command-line tools


def test_prepare_data_cli(corpus, tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "prepare_data", Path(__file__).parents[1] / "scripts/prepare_data.py"
    )
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    args = [
        "data.source=c4",
        f"data.path={corpus}",
        f"data.tokenized_dir={tmp_path}",
        "data.num_proc=1",
    ]
    assert cli.main(args) == 0
    assert TokenShards(tmp_path / "validation").n_tokens > 0
    assert cli.main(args) == 0  # a second run finds everything done
    assert "(1 already done)" in capsys.readouterr().err
    assert (
        cli.main(
            ["data.source=c4", f"data.path={tmp_path / 'none'}", f"data.tokenized_dir={tmp_path}"]
        )
        == 1
    )


@SLOW
def test_bench_data_tiny(tmp_path):
    import subprocess
    import sys

    script = Path(__file__).parents[1] / "benchmarks/bench_data.py"
    run = subprocess.run(
        [sys.executable, str(script), "--tiny", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    saved = json.loads((tmp_path / "data_throughput.json").read_text())
    assert saved["tiny"] and saved["machine"]["cpu_count"] >= 1
    assert all(r["tokens_per_s"] > 0 for r in saved["results"].values())
    assert "tokens/s" in (tmp_path / "data_throughput.md").read_text()
