"""Progress and the time limit of one solve.

A solve that runs past ``SHOW_AFTER_SECONDS`` says how far it has got, every
``EVERY_SECONDS``: an INFO line on the ``compile_offload.solver`` logger
(``TORCH_LOGS=compile_offload`` shows it) and a line on stderr, as Inductor's autotuning
does. With a time limit, the solvers stop generating candidate plans once it has passed,
with one warning, and choose among those generated so far: the greedy solvers search only
the first sequence then (a few simulations; the unconstrained plan is always a candidate),
the exact one stops enumerating.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings

log = logging.getLogger("compile_offload.solver")
SHOW_AFTER_SECONDS = 5.0
EVERY_SECONDS = 5.0


class Progress:
    def __init__(self, time_limit: float | None = None, graph_name: str = "graph",
                 started: float | None = None) -> None:
        """``started``: the ``time.perf_counter()`` the time limit counts from (now by default)."""
        if time_limit is not None and not time_limit >= 0:
            raise ValueError(f"time_limit={time_limit!r}: accepted: None or seconds >= 0")
        self.time_limit, self.graph_name = time_limit, graph_name
        self.started = time.perf_counter() if started is None else started
        self.reported = self.started + SHOW_AFTER_SECONDS - EVERY_SECONDS
        self.plans = 0
        self.total: int | None = None  # the plans the search will simulate, where it knows (the exact solver)
        self.out_of_time = False

    def step(self) -> bool:
        """Count one more candidate plan; False once the time limit has passed (the
        first time, with a warning)."""
        self.plans += 1
        now = time.perf_counter()
        if now - self.reported >= EVERY_SECONDS:
            self.reported = now
            of = "" if self.total is None else f" of {self.total}"
            message = (f"compile_offload: {self.graph_name}: planning, {self.plans}{of} candidate plans "
                       f"in {now - self.started:.0f} s")
            log.info(message)
            print(message, file=sys.stderr, flush=True)
        if self.time_limit is not None and now - self.started > self.time_limit and not self.out_of_time:
            self.out_of_time = True
            warnings.warn(
                f"compile_offload: {self.graph_name}: planning reached plan_time_limit={self.time_limit:g} s after "
                f"{self.plans} candidate plans; using the best plan found so far (it may be slower or use "
                "more memory than a complete search would give)",
                stacklevel=2,
            )
        return not self.out_of_time
