"""Each node's predicted seconds, looked up instead of computed per candidate plan.

The solver asks the cost function for the same node's time again and again: every saved
set's schedules and step time sum the times of thousands of nodes, and hundreds of saved
sets are priced. ``node_durations(seconds)`` returns a function with the same values whose
calls are a dictionary lookup (the table fills itself on first use of each node), so the
sums and therefore every decision stay exactly what ``seconds`` gives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx

Seconds = Callable[[fx.Node], float]


class _Durations(dict):
    """node -> ``seconds(node)``, computed on first lookup."""

    def __init__(self, seconds: Seconds) -> None:
        super().__init__()
        self.seconds = seconds

    def __missing__(self, node: fx.Node) -> float:
        value = self[node] = self.seconds(node)
        return value

    @property
    def in_schedule(self) -> "_ScheduleDurations":
        """node -> its time in a schedule: ``seconds(node)`` for ``call_function`` nodes,
        0.0 for the rest (``transfer.timed``), also a table that fills itself."""
        if "_in_schedule" not in self.__dict__:
            self.__dict__["_in_schedule"] = _ScheduleDurations(self)
        return self.__dict__["_in_schedule"]


class _ScheduleDurations(dict):
    def __init__(self, durations: _Durations) -> None:
        super().__init__()
        self.durations = durations

    def __missing__(self, node: fx.Node) -> float:
        value = self[node] = self.durations[node] if node.op == "call_function" else 0.0
        return value


def schedule_durations(seconds: Seconds) -> Callable[[fx.Node], float] | None:
    """For a function ``node_durations`` returned: a lookup of each node's time in a
    schedule (``seconds(node)`` if it is a ``call_function``, else 0.0); else None."""
    table = getattr(seconds, "__self__", None)
    return table.in_schedule.__getitem__ if table.__class__ is _Durations else None


def node_durations(seconds: Seconds) -> Seconds:
    """``seconds`` as a table lookup (a bound ``dict.__getitem__``: no Python frame per call).
    Wrapping a function this returned returns it as it is."""
    if getattr(seconds, "__self__", None).__class__ is _Durations:
        return seconds
    return _Durations(seconds).__getitem__
