"""Milliseconds per sampled token, KV cache against recurrent state (:mod:`.sample_time`;
``scripts/bench_sample.py``). :mod:`.report` renders its page and the other CPU pages: the data
loader's throughput (``benchmarks/bench_data.py``) and the step's A/B
(``benchmarks/ab_step_time.py``).
"""
