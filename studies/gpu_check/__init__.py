"""``make gpu-check``: everything a lent GPU should check and time, in one resumable command.

A GPU comes to this project rarely and for about half an hour, on a machine without network. This
package plans that half hour on the CPU machine and runs it on the GPU:

- :mod:`.plan`: stages, their units of work (each one subprocess: a test file, a benchmark
  invocation, a training run), and what each costs, priced from the times measured on the H100
  before (``benchmarks/results/*h100*``), from the stage times a GPU run recorded, or from an
  assumption stated as such;
- :mod:`.stages`: the plan's content, for the GPU and as tiny CPU shapes (the tests);
- :mod:`.runner`: runs the plan with a progress bar per stage; a unit that finished is on disk
  (``runs/gpu_check/<device>/``) and is not run again; ``--only`` / ``--skip`` stages; a time
  limit per invocation (one device command may run 10 minutes);
- :mod:`.collect`: the units' outputs merged into ``benchmarks/results/*_<device>_measured.*``
  with provenance, and the page that renders them;
- :mod:`.profile` (the 124M step traced, the GPU ops that take the most time) and
  :mod:`.learning` (the learning cells' summaries).

Nothing here imports JAX: the orchestrating process must not take the GPU's memory from the
units it starts.
"""
