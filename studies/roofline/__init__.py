"""The kernels' FLOPs and bytes against the H100's roofline (``benchmarks/roofline.py``,
``benchmarks/roofline_parallel.py``); :mod:`.report` renders their pages.
"""
