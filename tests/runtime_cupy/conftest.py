from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime_cupy.edges.shm import unlink_segment
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.support.hygiene import (
    SHM,
    TAG_VARIABLE,
    listening_sockets,
    resources,
    tagged_processes,
    users,
    wait_gone,
)

if not sys.platform.startswith("linux"):
    pytest.skip("the process-runtime tests read /proc and /dev/shm", allow_module_level=True)


@pytest.fixture(autouse=True)
def no_leftovers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test leaves no process, no shared memory or run folder and no listening
    port behind, even when it fails: strays are killed and removed, then the test
    errors. What appeared meanwhile but is in use by a process this test did not start
    (another test session or a benchmark on the same host) is not this test's, and is
    left alone. A stage's listening ports die with it; the test process's own (the
    orchestrator's token-out) are checked here."""
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_VARIABLE, tag)  # inherited by every process a test starts
    before = resources()
    ports_before = listening_sockets(os.getpid())
    yield
    ports_left = sorted(set(listening_sockets(os.getpid())) - set(ports_before))
    stray = tagged_processes(tag)
    for pid in stray:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_gone(stray, 5.0)
    left = sorted(path for path in resources() - before if not users(path))
    for path in left:
        if path.startswith(str(SHM)):
            unlink_segment(Path(path).name)
        else:
            shutil.rmtree(path, ignore_errors=True)
    assert not stray, f"processes left running: {stray}"
    assert not left, f"resources left behind: {left}"
    assert not ports_left, f"listening sockets left open: {ports_left}"


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 4-block random-weight llama (runs in a few ms per token)."""
    return str(write_model(tmp_path_factory.mktemp("cupy") / "tiny.gguf", ModelShape(n_layers=4)))
