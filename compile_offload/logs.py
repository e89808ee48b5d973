"""``TORCH_LOGS="+compile_offload"`` support: our logger registered with ``torch._logging``.

torch parses ``TORCH_LOGS`` when it is imported, before ``compile_offload`` can register
its logger, so when the variable names us the settings are parsed again (only then: a
program that configured torch's logging in code keeps its settings). Plain
``logging.getLogger("compile_offload")`` works too: one INFO line per graph, DEBUG details.
"""

from __future__ import annotations

import os

LOGGER_NAME = "compile_offload"


def register_with_torch_logging() -> None:
    from torch._logging import _internal

    _internal.register_log(LOGGER_NAME, LOGGER_NAME)
    if LOGGER_NAME in os.environ.get("TORCH_LOGS", ""):
        _internal._init_logs()
