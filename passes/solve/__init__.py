"""The search: a budget -> which saved tensors to keep, recompute or offload.

``recompute`` (the recompute-only greedy and the plan types), ``joint`` (keep / recompute /
offload), the move sequences it walks (``search_sequence``, ``peak``), bounds that skip
simulations (``peak_bound``), and the passes after it (``lower_peak``, ``prune``, ``refine``,
``neighbours``)."""
