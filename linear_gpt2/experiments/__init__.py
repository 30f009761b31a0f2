"""The experiment harness on top of the library: what the scripts and benchmarks run.

- :mod:`.step_time`: milliseconds per training step against context (the post's timing figure);
- :mod:`.frontier` and :mod:`.compile_step`: the step compiled for a GPU target (memory
  frontier, ``scripts/compile.py``);
- :mod:`.sample_time`: milliseconds per sampled token, KV cache against recurrent state;
- :mod:`.sweep`: grids of config overrides, run names, point status, SLURM arrays;
- :mod:`.runs` and :mod:`.plots`: run directories as records, and the post's figures;
- :mod:`.mqar`: the MQAR protocols and report;
- :mod:`.provenance` and :mod:`.axes`: what every results file and table shares.
"""
