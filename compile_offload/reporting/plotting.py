"""PNG figures drawn without touching the user's matplotlib state."""

from __future__ import annotations

from typing import Any


def new_figure(figsize: tuple[float, float]) -> tuple[Any, Any]:
    """``(figure, axes)`` for one PNG: a ``matplotlib.figure.Figure`` made directly, not
    through pyplot, so neither the global backend (``matplotlib.use``) nor pyplot's list
    of open figures changes (a notebook's inline plots keep working) and nothing needs
    closing. ``savefig`` renders with Agg. ImportError without matplotlib."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=figsize)
    return figure, figure.subplots()
