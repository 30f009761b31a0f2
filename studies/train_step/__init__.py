"""The training step: its time against context, measured (the post's timing figure), its memory
compiled for the H100, and its time modelled.

- runners: :mod:`.step_time` (``scripts/bench_step.py``; ``benchmarks/ab_step_time.py``,
  ``benchmarks/gpu_memory_check.py``), :mod:`.frontier` (``scripts/bench_step.py --target``,
  ``benchmarks/compile_configs.py``, ``benchmarks/forget_memory.py``);
- the model: :mod:`.step_model`, :mod:`.step_costs`, :mod:`.step_targets`
  (``benchmarks/step_model.py``);
- reports: :mod:`.report` (step time), :mod:`.report_ab` (the CPU A/B of two commits),
  :mod:`.report_memory` (frontier, memory check, configs, forgetting), :mod:`.report_model`
  (the model's page).
"""
