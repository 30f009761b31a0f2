"""The studies: the experiments that replicate and extend the post, one folder each, holding
its runner, its analysis and the renderers of its report (``report.py``). They sit on top of the
library (``linear_gpt2``), which imports none of them, and import no other study; the GPU command
(:mod:`.gpu_check`) runs the others' measurements in one window, and :mod:`.common` is the
report machinery they share (the import contracts in pyproject.toml). Not installed: scripts/,
benchmarks/, the notebooks and the tests import them from the repository root.

- :mod:`.train_step`: the training step's time against context (the post's timing figure), its
  memory compiled for the H100 (the frontier, the configs), and its time model;
- :mod:`.sample_time`: milliseconds per sampled token, KV cache against recurrent state;
- :mod:`.data_throughput`: the data loader's and the shards' validation's tokens per second;
- :mod:`.mqar`: multi-query associative recall, the protocols and the report;
- :mod:`.learning`: the context finding (loss against context, on CPU and GPU);
- :mod:`.attention`: the attention ops' accuracy and memory, and the options table;
- :mod:`.roofline`: the kernels' FLOPs and bytes against the H100's roofline;
- :mod:`.context_parallel`: the ring's compiled collectives and stress counts;
- :mod:`.gpu_check`: ``make gpu-check``, a lent GPU's windows;
- :mod:`.common`: generated blocks, formats, the results index.
"""
