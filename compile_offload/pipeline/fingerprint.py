"""A fingerprint of compile_offload's own source, for cache keys.

Inductor's FX graph cache, AOTAutograd's cache and our plan cache must miss when our code
changes, since the same graph and settings can then plan differently.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

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
