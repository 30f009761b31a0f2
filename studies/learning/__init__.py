"""The context finding: loss against context, run as sweeps (``scripts/sweep.py``,
``configs/sweeps/context_cpu.yaml``) and drawn by ``scripts/plot_runs.py``; :mod:`.report`
renders its tables.
"""
