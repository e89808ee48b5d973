"""Fingerprints for cache keys: compile_offload's own source, and torch's compiler config.

Inductor's FX graph cache, AOTAutograd's cache and our plan cache must miss when our code
changes, since the same graph and settings can then plan differently. Our plan cache and
graph records must also miss when torch's functorch or Inductor config changes: torch's
partitioner (the unconstrained plan) and our memory model (in-place reuse, layouts, what
Inductor realizes) read it, and AOTAutograd's cache keys on it, so a record made under
another config would describe code that is not running.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from .. import passes

_PACKAGE_ROOTS = (Path(__file__).parents[1], Path(passes.__file__).parent)


@functools.cache
def source_hash() -> str:
    """SHA-256 of every ``.py`` file of the package and its ``passes``, subpackages included."""
    digest = hashlib.sha256()
    for root in _PACKAGE_ROOTS:
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def torch_config_hash() -> str:
    """A SHA-256 prefix of torch's functorch and Inductor config as their own caches key them
    (``save_config_portable``: without private and machine-local entries), and of whether
    mkldnn is on (Inductor's CPU layouts follow it). ``settings.resolve`` reads it as a
    compile begins (``Settings.torch_config``), before compile_offload patches any of it."""
    from ..torch_api import functorch, inductor

    # torch's budget knob is not hashed: the settings' budget is what it decides
    functorch_config = {name: value for name, value in functorch.config.save_config_portable().items()
                        if name != "activation_memory_budget"}
    configs = [functorch_config, inductor.config.save_config_portable(), torch.backends.mkldnn.enabled]
    return hashlib.sha256(json.dumps(configs, sort_keys=True, default=_portable).encode()).hexdigest()[:16]


def with_options(torch_config: str, options: dict) -> str:
    """``torch_config`` with the Inductor options a compile patches over torch's config
    (``torch.compile``'s ``mode`` and ``options``): they change Inductor's code, so the
    measured peaks the plans are chosen by, as a change of the config itself does."""
    if not options:
        return torch_config
    text = json.dumps([torch_config, options_text(options)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def options_text(options: dict) -> str:
    """``options`` as the same text in every process (an object, a custom pass, by its
    ``uuid()`` where it has one, else by its type: its ``repr`` may hold its address)."""
    return json.dumps(_plain(options))


def _plain(value: Any) -> Any:
    """``value`` as JSON's types, the same in every process: containers element by element
    (a dict's keys as text, sorted; a set's elements sorted by their text), the rest by
    ``_portable``."""
    if isinstance(value, dict):
        return sorted([str(key), _plain(item)] for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_plain(item) for item in value), key=json.dumps)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return _portable(value)


def _portable(value: Any) -> Any:
    """A config value JSON cannot write, as the same text in every process: a set sorted, an
    object (a custom pass) by its ``uuid()`` where it has one, a function by its name, else
    by its type and its ``repr`` where that holds no address (``torch.float16``)."""
    if isinstance(value, (set, frozenset)):
        return _plain(value)
    if callable(value) and hasattr(value, "__qualname__"):  # a function: its name, not only "function"
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    uuid = getattr(value, "uuid", None)
    try:
        if callable(uuid):
            return f"{kind}:{uuid()}"
    except Exception:  # a uuid() that needs what it was not given: the type still tells
        return kind
    text = repr(value)
    return kind if " at 0x" in text else f"{kind}:{text}"
