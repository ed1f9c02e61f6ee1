"""The import path of a child interpreter that should load the kernels this process
loaded: the tree holding the loaded ``_kernels`` module (``src/``, or ``make
sanitize-*``'s ``build/sanitize/<kind>`` with its sanitized build) ahead of the
repository's root (``tests.support``). A child given ``src/`` instead runs the
unsanitized build under a sanitizer's preloaded runtime, checking nothing."""

from __future__ import annotations

import os
from pathlib import Path

from runtime_core.workers.cpu import _kernels

ROOT = Path(__file__).resolve().parents[2]


def kernels_pythonpath() -> str:
    """``PYTHONPATH`` for a child that imports ``runtime_core`` and ``tests``."""
    tree = Path(_kernels.__file__).resolve().parents[3]
    return os.pathsep.join([str(tree), str(ROOT)])
