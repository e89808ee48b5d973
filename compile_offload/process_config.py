"""Make an assignment to ``compile_offload.config`` reach every thread.

torch >= 2.12 keeps each config override in a ``ContextVar``, so ``config.memory_budget =
"4GiB"`` in the main thread is not seen by a training loop started in a worker thread
(a new thread starts with an empty context): that thread would compile with the default,
no budget. torch 2.11 keeps one global value. We give every supported torch the same
rule, torch 2.11's for assignments:

* ``config.x = v`` (outside a ``config.patch``) sets ``x`` for the whole process: every
  thread reads ``v`` unless it patched ``x`` itself;
* ``config.patch(x=v)`` applies to the thread (context) that entered it, as torch does
  (on torch 2.11 a patch is process-wide too: there is only one value); when it exits the
  thread reads the process's value again.

Everything here uses private details of ``torch.utils._config_module`` (the entries'
``user_override`` and its unset sentinel); on a torch without per-context overrides it
installs nothing.
"""

from __future__ import annotations

import threading
from contextvars import ContextVar
from types import ModuleType
from typing import Any

from .torch_api import dynamo
from .torch_api.utils import UNSET_SENTINEL as _UNSET  # None on a torch without it: nothing to install
from .torch_api.utils import ContextDecorator


_changes = 0  # bumped by every change of a knob, in any thread: lets readers skip re-reading
_installed = False


def version() -> int | None:
    """A number that changes whenever any thread changes a knob (an assignment, a patch
    entered or left, a delete); None where nothing is installed (then read the knobs)."""
    return _changes if _installed else None


def _changed() -> None:
    global _changes
    _changes += 1


class _Patching(threading.local):
    depth = 0  # > 0 while this thread is inside one of our config.patch blocks


_patching = _Patching()


def _per_context(module: ModuleType) -> bool:
    entries = getattr(module, "_config", {})
    return _UNSET is not None and bool(entries) and all(
        isinstance(entry.user_override, ContextVar) for entry in entries.values())


def install(module: ModuleType) -> None:
    """Swap ``module``'s config class (made by ``install_config_module``) for one whose
    assignments are process-wide; a no-op on torch without per-context overrides."""
    if not _per_context(module):
        return
    base = type(module)
    process_values: dict[str, Any] = {}

    class ProcessWideConfig(base):  # type: ignore[misc, valid-type]
        _bypass_keys = base._bypass_keys | {"_process_values"}

        def __setattr__(self, name: str, value: object) -> None:
            _changed()
            if name in self._config and _patching.depth == 0 and self._config[name].alias is None:
                # A plain assignment: the process's value; this context's own override
                # (if any) is cleared so that this thread reads it too.
                process_values[name] = value
                self._config[name].user_override.set(_UNSET)
                self._hash_dirty_var.set(True)
                self._mark_get_dict_dirty(name)
                self._config[name].hide = False
                return
            super().__setattr__(name, value)

        def __getattr__(self, name: str) -> Any:
            entry = self._config.get(name)
            if (entry is not None and name in process_values and not entry.hide
                    and entry.user_override.get() is _UNSET):
                return process_values[name]
            return super().__getattr__(name)

        def __dir__(self) -> list[str]:  # the knobs too: tab completion, dir(compile_offload.config)
            methods = (name for name in dir(type(self)) if not name.startswith("_"))  # patch, get_config_copy, ...
            return sorted({*super().__dir__(), *self._config, *methods})

        def __delattr__(self, name: str) -> None:
            _changed()
            process_values.pop(name, None)
            super().__delattr__(name)

        def _get_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            values = super()._get_dict(*args, **kwargs)
            for name, value in process_values.items():
                if name in values and self._config[name].user_override.get() is _UNSET:
                    values[name] = value
            return values

        def get_hash(self) -> bytes:
            # torch caches the hash per context, and an assignment in another thread
            # does not mark this context's cache dirty: always recompute (it is small).
            self._hash_dirty_var.set(True)
            return super().get_hash()

        def patch(self, *args: Any, **kwargs: Any) -> Any:
            _NOT_WHILE_TRACED()
            return _ThreadPatch(self, super(ProcessWideConfig, self).patch(*args, **kwargs))

    # ModuleType.__setattr__: the config class's own refuses names that are not knobs.
    ModuleType.__setattr__(module, "__class__", ProcessWideConfig)
    ModuleType.__setattr__(module, "_process_values", process_values)
    global _installed
    _installed = True


class _NotWhileTraced:
    """Called first by ``config.patch``: a function ``torch.compile`` traces that enters the
    patch fails at once, naming what to do. The settings are read when a graph compiles,
    after tracing; Dynamo would break the graph at the patch and run its body eagerly (no
    budget), or fail on the patch's machinery with an error that says nothing of it."""

    def __call__(self) -> None:
        """Outside tracing: nothing, and the patch goes on."""

    def __str__(self) -> str:
        return ("compile_offload.config.patch inside a function torch.compile traces: enter it around the call of "
                "the compiled function, or use it as the function's decorator (the settings are read when a graph "
                "compiles)")


_NOT_WHILE_TRACED = dynamo.forbidden_while_traced(_NotWhileTraced())


class _ThreadPatch(ContextDecorator):
    """torch's ``ConfigPatch``, with our assignments marked as a patch's (per context)."""

    def __init__(self, module: Any, inner: Any) -> None:
        self.module = module
        self.inner = inner
        self.changes = inner.changes
        # This context's own overrides before each (nested) entry: torch's patch restores
        # the values it read, which would pin the process's value of that moment to this
        # thread; restoring the overrides themselves keeps later assignments visible.
        self._prior: ContextVar[tuple[dict[str, Any], ...]] = ContextVar(f"_ThreadPatch[{id(self)}]", default=())

    def __enter__(self) -> None:
        entries = self.module._config
        prior = {name: entries[name].user_override.get() for name in self.changes if name in entries}
        _patching.depth += 1
        try:
            self.inner.__enter__()
        finally:
            _patching.depth -= 1
        self._prior.set((*self._prior.get(), prior))

    def __exit__(self, exc_type, exc_val, exc_tb):  # type: ignore[no-untyped-def]
        _patching.depth += 1
        try:
            self.inner.__exit__(exc_type, exc_val, exc_tb)
        finally:
            _patching.depth -= 1
        stack = self._prior.get()
        self._prior.set(stack[:-1])
        for name, override in stack[-1].items():
            self.module._config[name].user_override.set(override)
            self.module._hash_dirty_var.set(True)
            self.module._mark_get_dict_dirty(name)
        _changed()
        return False
