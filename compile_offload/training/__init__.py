"""Training under one device budget for the whole step: parameters, gradients, optimizer
state and activations (``compile_offload.fit``).

``state_plan``: the placement rule, a pure function of byte sizes (``StepPlan``);
``optimizer_state``: an optimizer's state size, asked of its class; ``fit``: measures the
sizes, prepares the model (FSDP2 with CPU offload where the state does not fit, every block
compiled with this backend) and trains (``Fitted.step``).
"""

from .fit import Fitted, fit
from .state_plan import StateSizes, StepPlan, plan_step

__all__ = ["Fitted", "StateSizes", "StepPlan", "fit", "plan_step"]
