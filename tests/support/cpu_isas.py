"""The CPU kernels' instruction sets as pytest parameters: every set the kernels know
(``_kernels.KNOWN_ISAS``), those this processor does not run skipped with the reason, so
a test that compares the sets runs every one the machine has."""

from __future__ import annotations

from typing import Any

import pytest

from runtime_core.workers.cpu import _kernels

HOST_ISAS: tuple[str, ...] = _kernels.isas()


def isa_params(*, portable: bool = True) -> list[Any]:
    """``pytest.param`` per known set (the portable one unless ``portable=False``)."""
    return [
        pytest.param(
            name,
            id=name,
            marks=pytest.mark.skipif(
                name not in HOST_ISAS,
                reason=f"this processor does not run {name} (it runs {', '.join(HOST_ISAS)})",
            ),
        )
        for name in _kernels.KNOWN_ISAS
        if portable or name != "portable"
    ]
