"""The GPT-2 BPE through tiktoken, offline.

``tiktoken.get_encoding("gpt2")`` downloads its rank file at first use, which clusters without
internet cannot do. The package ships that file (``assets/gpt2.tiktoken``, the ranks tiktoken itself
expects, checked by sha256) and builds the same ``Encoding`` from it with tiktoken's own split
pattern, so ids are identical to ``get_encoding("gpt2")``.
"""

from __future__ import annotations

import base64
import functools
import hashlib
from importlib import resources

import tiktoken
from tiktoken_ext.openai_public import r50k_pat_str

EOT = 50256  # <|endoftext|>, the document separator
VOCAB_SIZE = 50257
RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


@functools.cache
def gpt2() -> tiktoken.Encoding:
    """The GPT-2 encoding, built from the shipped ranks (no network)."""
    path = resources.files("linear_gpt2") / "assets" / "gpt2.tiktoken"
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != RANKS_SHA256:
        raise RuntimeError(
            f"{path} is corrupt (sha256 {digest}, expected {RANKS_SHA256}); reinstall the package "
            "or restore the file from git"
        )
    # tiktoken's format (token in base64, rank, a line each), read from the bytes checked
    # above: tiktoken's own loader copies any file it reads into a cache under the system's
    # temporary directory, outside the run directory.
    lines = (line.split() for line in data.splitlines() if line)
    ranks = {base64.b64decode(tok): int(rank) for tok, rank in lines}
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT},
        explicit_n_vocab=VOCAB_SIZE,
    )


def encode(text: str) -> list[int]:
    """Ids of ``text`` as ordinary text (special-token strings are not interpreted)."""
    return gpt2().encode_ordinary(text)


def decode(ids: list[int]) -> str:
    return gpt2().decode(ids)
