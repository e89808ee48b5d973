"""compile_offload: a torch.compile backend that trains under a memory budget in bytes.

``torch.compile(model, backend="offload_remat")`` partitions each training graph so that
every tensor the backward needs is kept on the device, recomputed in the backward, or
offloaded to pinned host memory and prefetched back, choosing the fastest plan whose peak
memory stays under ``compile_offload.config.memory_budget``.
"""

from . import config
from .runtime import ops  # noqa: F401  ops: registers the offload ops before any compiled graph that uses them runs
from .pipeline.backend import BACKEND_NAME, offload_remat, offload_remat_backend
from .tools.explain import explain, explain_all
from .tools.max_batch import MaxBatch, max_batch
from .runtime.memory_tracker import measure_peak
from .passes.plan import Decision, Plan
from .tools.profile_step import profile_step
from .pipeline.result import BudgetError
from .tools.sweep import sweep
from .training import Fitted, StepPlan, fit

__version__ = "0.1.0"


def _register() -> None:
    # Importing the package registers the backend by name. When Dynamo already discovered
    # our entry point (it is importing us right now, or will load it on first use), it
    # registers the function itself, and registering twice is an error in its registry.
    from .torch_api import dynamo

    if not dynamo.backend_registered(BACKEND_NAME):
        dynamo.register_backend(offload_remat_backend, name=BACKEND_NAME)


_register()


from .settings import warn_unknown_environment  # noqa: E402

warn_unknown_environment()

from .reporting.logs import register_with_torch_logging  # noqa: E402

register_with_torch_logging()

__all__ = ["BudgetError", "Decision", "MaxBatch", "Plan", "config", "explain", "explain_all", "fit", "Fitted", "StepPlan", "max_batch", "measure_peak",
           "offload_remat", "offload_remat_backend", "profile_step", "sweep", "__version__"]
