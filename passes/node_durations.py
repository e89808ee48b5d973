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


def node_durations(seconds: Seconds) -> Seconds:
    """``seconds`` as a table lookup (a bound ``dict.__getitem__``: no Python frame per call).
    Wrapping a function this returned returns it as it is."""
    if getattr(seconds, "__self__", None).__class__ is _Durations:
        return seconds
    return _Durations(seconds).__getitem__
