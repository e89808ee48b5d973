"""torch._subclasses (fake tensors): ``FakeTensor``, ``FakeTensorMode``,
``unset_fake_temporarily`` and the ``fake_tensor`` module itself (patched by the CUDA
schedule benchmark). ``torch._library``'s ``FakeScriptObject`` is used by the passes only
(``passes/compat.py``).

Checked on torch 2.11-2.14 (installed: 2.13).
"""

from torch._subclasses import fake_tensor  # noqa: F401  (re-exported)
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily  # noqa: F401

__all__ = ["FakeTensor", "FakeTensorMode", "fake_tensor", "unset_fake_temporarily"]
