"""How many bytes an optimizer's state will take, asked of its class before its first step.

torch's optimizers create their state lazily, at the first ``step()``, so an optimizer just
built holds none; its size follows from the class and each parameter group's options.
Known classes (``torch.optim``), per parameter of the group, in the parameter's own dtype
(the state tensors are ``zeros_like(param)``):

| class | state tensors per parameter |
|---|---|
| Adam, AdamW (``amsgrad``: 3) | 2: ``exp_avg``, ``exp_avg_sq`` |
| NAdam, RAdam, Adamax, Adadelta | 2 |
| Adagrad | 1 |
| RMSprop | 1, + 1 with ``momentum`` > 0, + 1 ``centered`` |
| SGD | 1 with ``momentum`` > 0, else 0 |

plus a 4-byte ``step`` per parameter where the class keeps one (NAdam also a 4-byte
``mu_product``). A subclass counts as its
known base. Any other optimizer is assumed to hold 2 tensors per parameter, and the note
returned says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_STEPPED = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adagrad", "RMSprop", "Adadelta")
UNKNOWN_TENSORS_PER_PARAMETER = 2


def _tensors_per_parameter(name: str, group: dict) -> int | None:
    if name in ("Adam", "AdamW"):
        return 3 if group.get("amsgrad") else 2
    if name in ("NAdam", "RAdam", "Adamax", "Adadelta"):
        return 2
    if name == "Adagrad":
        return 1
    if name == "RMSprop":
        return 1 + (1 if group.get("momentum", 0) else 0) + (1 if group.get("centered") else 0)
    if name == "SGD":
        return 1 if group.get("momentum", 0) else 0
    return None


def _known_base(optimizer: Any) -> str | None:
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("torch.optim") and _tensors_per_parameter(cls.__name__, {}) is not None:
            return cls.__name__
    return None


def optimizer_state_bytes(optimizer: Any, nbytes: Callable[[Any], int]) -> tuple[int, str | None]:
    """(bytes of state ``optimizer`` will hold after its first step, a note or None).

    ``nbytes(param)`` is a parameter's size in bytes (unsharded: the optimizer may have been
    built on placeholders)."""
    known = _known_base(optimizer)
    total = 0
    for group in optimizer.param_groups:
        per = _tensors_per_parameter(known, group) if known else UNKNOWN_TENSORS_PER_PARAMETER
        for param in group["params"]:
            if not getattr(param, "requires_grad", True):
                continue
            total += per * nbytes(param) + (4 if known in _STEPPED else 0) + (4 if known == "NAdam" else 0)
    if known is None:
        return total, (f"optimizer {type(optimizer).__name__} is not one whose state size is known "
                       f"(torch.optim's Adam, AdamW, SGD, ...): assumed {UNKNOWN_TENSORS_PER_PARAMETER} tensors "
                       "the size of each parameter")
    return total, None
