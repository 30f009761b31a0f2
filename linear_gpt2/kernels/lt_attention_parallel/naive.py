"""The oracle of the ``LT_attention_parallel`` kernel: the blocked pure-JAX form with its
hand-written backward (``attention.lt_attention_parallel.blocked_linear_attention``), the same
interface ``(phi(q), phi(k), v, c, eps) -> y``."""

from linear_gpt2.attention.lt_attention_parallel import blocked_linear_attention

__all__ = ["blocked_linear_attention"]
