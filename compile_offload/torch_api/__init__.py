"""The package's door to private torch names: one module per torch area.

Every private torch name ``compile_offload/`` and ``benchmarks/`` use (a dotted part starts
with ``_``: ``torch._inductor.config``, ``torch.utils._pytree``) is imported or reached here,
in the module of its area, and nowhere else; ``passes/compat.py`` is the passes' own door
(they cannot import ``compile_offload``). On a torch upgrade these modules are what to read;
``tests/test_private_torch_names.py`` lists each name and keeps it so.

Importing these modules stays cheap: what torch has not loaded when ``compile_offload`` is
imported (``compile_fx``, the scheduler, code generation, lowering...) is imported when a
function here is called.
"""
