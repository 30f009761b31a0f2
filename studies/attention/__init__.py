"""The attention ops' accuracy and memory (``benchmarks/attention_accuracy.py``,
``benchmarks/attention_memory.py``, ``benchmarks/flash_context_memory.py``) and the option
table of docs/attention.md; :mod:`.report` renders them.
"""
