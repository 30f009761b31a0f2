"""Multi-query associative recall: the protocols, cells and report (:mod:`.mqar`;
``scripts/mqar.py``; ``benchmarks/mqar_probe.py``, ``benchmarks/mqar_reference.py``,
``benchmarks/mqar_zoology_reference.py``) and the renderers of its pages (:mod:`.report`).
"""
