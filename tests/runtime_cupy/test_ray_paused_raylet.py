"""A Ray node whose raylet is paused (SIGSTOP: a host frozen) is not live: its port
still takes connections (the kernel accepts them) but nothing answers gRPC's preface,
so a re-placement places around it rather than start a stage there and wait for
that start until Ray calls the node dead (a minute on a test cluster), a recovery
spent. A cluster of its own, of two Ray nodes on this machine."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="the Ray host needs Ray (the test extra has it)")

from runtime_cupy.hosts.ray import session  # noqa: E402
from runtime_cupy.hosts.ray.cluster import cpu_stage_nodes  # noqa: E402
from runtime_cupy.hosts.ray.host import RayHost  # noqa: E402
from tests.support.ray_checks import wait_until  # noqa: E402
from tests.support.ray_local_cluster import local_cluster  # noqa: E402

#: A Ray cluster of its own (make fast leaves these out).
pytestmark = [pytest.mark.ray, pytest.mark.process]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with local_cluster(nodes=1) as c:
        yield c


def test_a_node_whose_raylet_is_paused_is_placed_around(cluster: Any) -> None:
    """The worker node's raylet paused: the cluster's live hosts leave it out, and so do
    the live nodes of a re-placement (the stage placed there with them); continued, it
    is live again."""
    assert not wait_until(lambda: len(session.hosts()) != 2, 60), session.hosts()
    placed = cpu_stage_nodes(session.hosts(), 2)  # one stage on each node
    (worker,) = [n for n in cluster.list_all_nodes() if n is not cluster.head_node]
    raylet = worker.all_processes["raylet"][0].process.pid
    known = [(n.spec, n.device) for n in placed]
    os.kill(raylet, signal.SIGSTOP)
    try:
        live = [spec.node_id for spec, _ in RayHost(placed, "127.0.0.1").live_nodes(known, "cpu")]
        assert live == [placed[0].node_id], live
    finally:
        os.kill(raylet, signal.SIGCONT)
    assert not wait_until(lambda: len(session.hosts()) != 2, 60), session.hosts()
