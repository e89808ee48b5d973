"""torch._guards: the compile and tracing contexts Dynamo and AOTAutograd keep, ``Guard``, and
the id of the compile running (``compile_id``).

Checked on torch 2.11-2.14 (installed: 2.13).
"""

from torch._guards import CompileContext, Guard, TracingContext  # noqa: F401  (re-exported)

__all__ = ["CompileContext", "Guard", "TracingContext", "compile_id"]


def compile_id() -> tuple[int, int] | None:
    """Dynamo's (frame id, compile of that frame) of the graph being compiled; None outside Dynamo."""
    current = getattr(CompileContext.try_get(), "compile_id", None)
    frame, count = getattr(current, "frame_id", None), getattr(current, "frame_compile_id", None)
    return None if frame is None or count is None else (frame, count)
