"""A researcher's tools for their own experiments, on top of the library (the studies that
replicate the post live outside the package, in ``studies/``, and import these):

- :mod:`.sweep` and :mod:`.sweep_file`: grids of config overrides, run names, point status,
  SLURM arrays (``scripts/sweep.py``);
- :mod:`.runs` and :mod:`.plots`: run directories as records, and loss and timing figures
  (``scripts/plot_runs.py``);
- :mod:`.compile_step`, :mod:`.hlo_text`, :mod:`.hlo_costs` and :mod:`.collectives`: the
  training step compiled for a GPU target and read back (``scripts/compile.py``);
- :mod:`.axes`: the context axis every table and figure shares.
"""
