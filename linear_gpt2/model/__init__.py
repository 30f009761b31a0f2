"""The model layer: GPT-2 (nanoGPT's) with a pluggable attention, as functions of plain params.

- :mod:`.config`: :class:`ModelConfig`, the architecture and the attention, flat and hashable;
- :mod:`.gpt`: the Flax modules; :mod:`.layers`: their building blocks beyond attention;
- :mod:`.api`: ``init_params``, ``forward``, ``loss_fn``, ``decode_init`` / ``decode``, ...
  (re-exported here);
- :mod:`.loss`: cross-entropy, plain and fused with the head by chunks of tokens;
- :mod:`.layer_stats`: per-layer attention statistics (``log.diagnostics``);
- :mod:`.flops`: FLOPs per token for MFU; :mod:`.interop`: nanoGPT / Hugging Face weights;
- :mod:`.tokenizer`: GPT-2's BPE; :mod:`.sampling`: generation on the decode path.
"""

from linear_gpt2.model.api import (
    Params,
    correct,
    count_params,
    decode,
    decode_init,
    diagnostics,
    forward,
    init_config,
    init_params,
    loss_fn,
    param_shapes,
)
from linear_gpt2.model.config import PRESETS, ModelConfig

__all__ = [
    "PRESETS",
    "ModelConfig",
    "Params",
    "correct",
    "count_params",
    "decode",
    "decode_init",
    "diagnostics",
    "forward",
    "init_config",
    "init_params",
    "loss_fn",
    "param_shapes",
]
