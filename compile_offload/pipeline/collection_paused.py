"""Python's cyclic garbage collector paused while one joint graph is planned.

Planning allocates millions of small objects (sets of nodes, steps, schedules), and every
700 allocations that outlive a collection trigger one; each tenth of those (and of those)
walks older generations, and the oldest one holds everything the process owns: the
traced model, the joint graph and its copies, torch itself. Measured on the GPT-8 joint
graph of ``benchmarks/planning_time.py`` (2-core VM, CPU seconds of the partition call),
collections were about 40% of planning (1.3 s with them, 0.8 s without). What planning
leaves behind in cycles (FX graphs it discarded) waits for the next collection after it:
one walk instead of hundreds.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """No automatic collection inside; the collector's state as it was afterwards (a caller
    that disabled it keeps it disabled). Reference counting still frees everything that is
    not in a cycle at once."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
