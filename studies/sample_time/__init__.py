"""Milliseconds per sampled token, KV cache against recurrent state (:mod:`.sample_time`;
``scripts/bench_sample.py``); :mod:`.report` renders its page.
"""
