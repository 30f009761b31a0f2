"""The offline GPT-2 BPE gives tiktoken's gpt2 ids."""

from linear_gpt2.model import tokenizer

KNOWN = "Hello world! The quick brown fox jumps over the lazy dog."
KNOWN_IDS = [15496, 995, 0, 383, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13]


def test_known_ids_and_round_trip():
    enc = tokenizer.gpt2()
    assert tokenizer.encode(KNOWN) == KNOWN_IDS
    assert enc.encode(KNOWN + "<|endoftext|>", allowed_special="all") == KNOWN_IDS + [tokenizer.EOT]
    assert enc.n_vocab == tokenizer.VOCAB_SIZE == 50257
    text = "  Ünïcödé, numbers 12345 and\nnewlines\t\ttabs 's 've"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_token_text_is_ordinary_in_encode():
    # Documents containing the literal string must not inject a document boundary.
    assert tokenizer.EOT not in tokenizer.encode("a <|endoftext|> b")


def test_matches_tiktokens_own_registry_encoding(monkeypatch):
    """tiktoken's registered r50k_base (the same ranks and split as gpt2), built by tiktoken itself
    from the shipped ranks file served in place of its download, gives the same ids as ours."""
    from importlib import resources

    import tiktoken
    import tiktoken.load

    shipped = (resources.files("linear_gpt2") / "assets" / "gpt2.tiktoken").read_bytes()

    def offline_read(blobpath):
        if blobpath.endswith("r50k_base.tiktoken"):
            return shipped
        raise ConnectionError(f"no network in tests: {blobpath}")

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # no cache: always go through offline_read
    monkeypatch.setattr(tiktoken.load, "read_file", offline_read)
    reference = tiktoken.get_encoding("r50k_base")
    samples = [
        KNOWN,
        "Some more text, with 123 numbers and émojis 🙂. It's 've 're 'll 'd\n\n  spaces   ",
        "def f(x):\n    return x ** 2  # code\r\n",
        "日本語のテキスト and Ελληνικά, mixed.",
    ]
    for text in samples:
        assert tokenizer.encode(text) == reference.encode_ordinary(text)
    assert tokenizer.gpt2().encode("a<|endoftext|>b", allowed_special="all") == reference.encode(
        "a<|endoftext|>b", allowed_special="all"
    )
