"""The media by the names ``--edges`` takes, for whatever needs one: a host for the
orchestrator's token ends and for cleanup, a stage process for its two edges. Nothing
outside this package constructs a medium, so adding one touches this module and its
own, never a host, a loop or a worker."""

from __future__ import annotations

from runtime_cupy.edges.port import EdgeMedium, Rendezvous
from runtime_cupy.edges.shm import ShmMedium
from runtime_cupy.edges.tcp import TcpMedium
from runtime_cupy.edges.tcp_seal import protection_for


def open_medium(
    name: str, rendezvous: Rendezvous, bind_host: str, encrypt: bool = False
) -> EdgeMedium:
    """The medium ``name``: TCP consumers listen on ``bind_host`` and publish their
    address at ``rendezvous``, and every TCP frame is authenticated (``encrypt``:
    encrypted too, ``tcp_seal``); ``ValueError`` for a name no medium has."""
    if name == "shm":
        return ShmMedium()
    if name == "tcp":
        return TcpMedium(rendezvous, bind_host, protection=protection_for(encrypt))
    raise ValueError(f"unknown edge medium {name!r} (shm or tcp)")


def every_medium(rendezvous: Rendezvous) -> tuple[EdgeMedium, ...]:
    """One of each medium, to free what any of them left of a run on this machine."""
    return (ShmMedium(), TcpMedium(rendezvous))
