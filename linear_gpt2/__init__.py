"""linear_gpt2: GPT-2 in JAX/Flax with pluggable softmax and linear attention.

The data path, one module per step: ``config`` -> ``tokenizer`` -> ``model`` -> ``attention``
-> (train step, logs: the trainer). ``interop`` converts weights to and from nanoGPT and
Hugging Face.
"""

__version__ = "0.1.0"
