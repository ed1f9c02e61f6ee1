"""A re-placement of a CUDA chain asks each GPU host of the cluster its GPUs' memory (a
Ray task there, ``session._gpu_memory_there``): a host that does not answer within the
chain's silence bound (a paused host: its raylet's port still takes connections) is
placed around as a lost host is, and its task is cancelled. A one-node cluster of its
own that reports a GPU (no GPU is needed: the task's function is replaced)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="the Ray host needs Ray (the test extra has it)")

from runtime_cupy.hosts.ray import session  # noqa: E402
from runtime_cupy.hosts.ray.cluster import gpu_stage_nodes  # noqa: E402
from runtime_cupy.hosts.ray.host import RayHost  # noqa: E402
from tests.support.hygiene import alive  # noqa: E402
from tests.support.ray_checks import wait_until  # noqa: E402
from tests.support.ray_local_cluster import local_cluster  # noqa: E402

#: A Ray cluster of its own (make fast leaves these out).
pytestmark = [pytest.mark.ray, pytest.mark.process]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with local_cluster(num_gpus=1) as c:  # a GPU Ray counts: none is used
        yield c


def _pid() -> int:
    return os.getpid()


def test_a_gpu_host_silent_past_the_bound_is_placed_around_and_its_task_cancelled(
    cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The host's memory query never answers: the live nodes of a re-placement come back
    within the bound without it (its stage's node and its GPU left out), the warning names
    it, and its task's worker is ended. It waited 120 s, then failed the recovery with
    Ray's untyped ``GetTimeoutError``."""
    pid_file = tmp_path / "pid"

    def paused() -> dict[int, int]:  # the host never answers (SIGSTOP)
        pid_file.write_text(str(os.getpid()))
        time.sleep(3600)
        return {}

    warm: Any = ray.remote(_pid)  # a worker there, so the query starts at once
    ray.get(warm.options(num_cpus=0).remote(), timeout=60)
    (host,) = session.hosts()
    placed = gpu_stage_nodes((host,), 1, {host.ray_node_id: {0: 8 << 30}})
    ray_host = RayHost(placed, "127.0.0.1", silence_s=3.0)
    known = [(n.spec, n.device) for n in placed]
    monkeypatch.setattr(session, "_gpu_memory_there", paused)
    with caplog.at_level("WARNING", logger="runtime_cupy.hosts.ray"):
        assert ray_host.live_nodes(known, "cuda") == ()
    said = f"host {host.label} did not report its GPUs' memory within 3 s"
    assert any(said in r.getMessage() for r in caplog.records), caplog.text
    assert pid_file.exists(), "the query never ran"
    pid = int(pid_file.read_text())
    assert not wait_until(lambda: alive(pid), 30), f"the query's worker {pid} still runs"
