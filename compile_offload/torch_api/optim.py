"""The optimizers' private corners: the step pre- and post-hooks an optimizer holds
(``Optimizer._optimizer_step_pre_hooks``, ``_optimizer_step_post_hooks``) and those
registered for every optimizer (``torch.optim.optimizer._global_optimizer_pre_hooks``,
``_global_optimizer_post_hooks``), and the step beneath the wrapper that runs them
(``Optimizer.profile_hook_step`` wraps each class's ``step`` once, marking it ``hooked``).

Checked on torch 2.11-2.14 (installed: 2.13).
"""

from __future__ import annotations

import torch


def step_pre_hook_count(optimizer: torch.optim.Optimizer) -> int:
    """How many step pre-hooks run when ``optimizer.step()`` is called: its own
    (``register_step_pre_hook``) and the global ones (``register_optimizer_step_pre_hook``)."""
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    return len(getattr(optimizer, "_optimizer_step_pre_hooks", {})) + len(_global_optimizer_pre_hooks)


def step_post_hook_count(optimizer: torch.optim.Optimizer) -> int:
    """How many step post-hooks run when ``optimizer.step()`` returns: its own
    (``register_step_post_hook``) and the global ones (``register_optimizer_step_post_hook``)."""
    from torch.optim.optimizer import _global_optimizer_post_hooks

    return len(getattr(optimizer, "_optimizer_step_post_hooks", {})) + len(_global_optimizer_post_hooks)


def step_without_hooks(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` without any step hook, global or its own: the class's step as
    torch wrapped it (``functools.wraps`` keeps the step beneath as ``__wrapped__``)."""
    step = type(optimizer).step
    if getattr(step, "hooked", False) and callable(getattr(step, "__wrapped__", None)):
        step = step.__wrapped__
    step(optimizer)
