"""Benchmarks of the ``offload_remat`` backend against torch's own memory-saving strategies.

``workloads`` builds the models, ``strategies`` says how each alternative runs a training
step, ``runner`` measures them and writes JSON lines, a markdown table and a Pareto plot.
The command line is ``python -m compile_offload bench`` (``compile_offload/tools/bench.py``).
"""
