"""Which medium an edge uses, from what the run asks (``--edges``) and whether its two
ends share a machine (the host port says)."""

from __future__ import annotations

import platform

from runtime_cupy.edges.port import MEDIA
from runtime_cupy.edges.shm import shm_supported

#: What ``--edges`` takes: ``auto`` is shared memory where both ends share a machine
#: (and the machine's memory order allows it), TCP everywhere else.
PREFERENCES = ("auto", *MEDIA)


def choose_medium(preference: str, same_host: bool, edge_id: int) -> str:
    """``shm`` or ``tcp`` for one edge; ``ValueError`` for a choice that cannot be."""
    if preference not in PREFERENCES:
        raise ValueError(f"unknown edges {preference!r} (one of {', '.join(PREFERENCES)})")
    if preference == "tcp":
        return "tcp"
    if preference == "shm":
        if not same_host:
            raise ValueError(f"edge {edge_id}: shared memory between two machines; use tcp or auto")
        if not shm_supported():
            raise ValueError(
                f"shared-memory edges need x86-64's store order; this machine is "
                f"{platform.machine()!r}: use tcp or auto"
            )
        return "shm"
    return "shm" if same_host and shm_supported() else "tcp"
