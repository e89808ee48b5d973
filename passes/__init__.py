"""Pure FX passes of compile_offload: analysis, memory simulation, cost model, solver,
graph rewriting, offload insertion and scheduling.

This package depends on torch (FX, fake tensors, a few private partitioner helpers wrapped
in ``passes.compat``) and never imports ``compile_offload``.
"""
