"""torch._guards: the compile and tracing contexts Dynamo and AOTAutograd keep, and ``Guard``.

Checked on torch 2.11-2.14 (installed: 2.13).
"""

from torch._guards import CompileContext, Guard, TracingContext  # noqa: F401  (re-exported)

__all__ = ["CompileContext", "Guard", "TracingContext"]
