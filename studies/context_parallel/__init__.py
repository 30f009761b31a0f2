"""The ring: the compiled collectives of a context-parallel step and the stress counts
(``benchmarks/context_parallel_compile.py``, ``benchmarks/context_parallel_stress.py``);
:mod:`.report` renders them.
"""
