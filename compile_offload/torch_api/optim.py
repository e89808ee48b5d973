"""The optimizers' private corners: the step pre- and post-hooks an optimizer holds
(``Optimizer._optimizer_step_pre_hooks``, ``_optimizer_step_post_hooks``) and those
registered for every optimizer (``torch.optim.optimizer._global_optimizer_pre_hooks``,
``_global_optimizer_post_hooks``), which a step can set aside.

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
    """``optimizer.step()`` with the hooks registered for every optimizer set aside for its
    duration (the instance's own run as usual: a copy made with ``copy.copy`` has none). Not
    only the class's wrapper runs them: a subclass's step that calls ``super().step()`` goes
    through its base class's wrapper too. The hooks are back, in their order and with their
    handles valid, when it returns; an optimizer stepped on another thread meanwhile misses
    them."""
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    saved = [(hooks, list(hooks.items())) for hooks in (_global_optimizer_pre_hooks, _global_optimizer_post_hooks)]
    for hooks, _ in saved:
        hooks.clear()
    try:
        optimizer.step()
    finally:
        for hooks, items in saved:
            hooks.update(items)
