"""torch._guards: the compile and tracing contexts Dynamo and AOTAutograd keep, ``Guard``, and
the id of the compile running (``compile_id``), and whether it begins a frame anew
(``frame_begun``).

Checked on torch 2.11-2.14 (installed: 2.13).
"""

import weakref

from torch._guards import CompileContext, Guard, TracingContext  # noqa: F401  (re-exported)

__all__ = ["CompileContext", "Guard", "TracingContext", "compile_id", "frame_begun"]


def compile_id() -> tuple[int, int] | None:
    """Dynamo's (frame id, compile of that frame) of the graph being compiled; None outside Dynamo."""
    current = getattr(CompileContext.try_get(), "compile_id", None)
    frame, count = getattr(current, "frame_id", None), getattr(current, "frame_compile_id", None)
    return None if frame is None or count is None else (frame, count)


def frame_begun(first_compiles: dict[int, weakref.ref]) -> bool:
    """Whether the graph being compiled is its frame's first compile in a compile context
    ``first_compiles`` (frame id -> that compile's context) has not seen: after
    ``torch._dynamo.reset()`` Dynamo numbers frames from 0 again, and what a caller recorded
    under a frame's number belongs to another frame. DDPOptimizer's bucket graphs share their
    compile's context, so only the first of them begins the frame. Records the context."""
    context = CompileContext.try_get()
    current = getattr(context, "compile_id", None)
    frame = getattr(current, "frame_id", None)
    if frame is None or getattr(current, "frame_compile_id", None) != 0:
        return False
    first = first_compiles.get(frame)
    if first is not None and first() is context:
        return False
    first_compiles[frame] = weakref.ref(context)
    return True
