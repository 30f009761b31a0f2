"""The data pipeline's throughput: tokens per second of the loader and of the shards'
validation on the CPU machine (``benchmarks/bench_data.py``); :mod:`.report` renders its page
and the sentence docs/training.md quotes.
"""
