"""A Ray cluster of its own on this machine for a test module (``ray.cluster_utils``):
a head and ``nodes`` more nodes, this process connected to it as the runtime connects
(``session.connect``); at the end Ray shut down, the cluster too, and its session's
folder (logs, sockets) removed, with Ray's temp folder once empty."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def local_cluster(nodes: int = 0, **head: Any) -> Iterator[Any]:
    """The cluster (``Cluster``): a head of one CPU and no dashboard (``head`` adds
    to or overrides its arguments), ``nodes`` nodes of one CPU each."""
    import ray
    from ray.cluster_utils import Cluster

    from runtime_cupy.hosts.ray.session import connect

    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, **head},
    )
    where = Path(c.head_node.get_session_dir_path())
    try:
        for _ in range(nodes):
            c.add_node(num_cpus=1)
        c.wait_for_nodes()
        connect(c.address)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        remove_session(where)


def remove_session(session: Path) -> None:
    """Ray keeps each session's folder (logs, sockets) under its temp folder: the
    cluster's goes with it, and the temp folder too once empty."""
    shutil.rmtree(session, ignore_errors=True)
    latest = session.parent / "session_latest"
    if latest.is_symlink() and not latest.exists():
        latest.unlink()
    with contextlib.suppress(OSError):
        session.parent.rmdir()
