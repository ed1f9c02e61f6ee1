from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runplan import RunPlan
from runtime_cupy.edges.shm import unlink_segment
from runtime_cupy.process.chain_runner import ChainRunner
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.support import hygiene
from tests.support.hygiene import (
    SHM,
    TAG_VARIABLE,
    RunLedger,
    listening_sockets,
    tagged_processes,
    wait_gone,
)

if not sys.platform.startswith("linux"):
    pytest.skip("the process-runtime tests read /proc and /dev/shm", allow_module_level=True)


@pytest.fixture(autouse=True)
def no_leftovers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test leaves no process, no shared memory or run folder and no listening
    port behind, even when it fails: strays are killed and removed, then the test
    errors. It checks what it made itself: the processes carrying its tag, the
    resources of the chains it used (``hygiene.RunLedger``: every ``ChainRunner`` made
    in this process, a ``ProcessRun``'s or a warm chain's, and the runs it learned of
    from processes it started), and its own process's listening ports (the
    orchestrator's token-out; a stage's die with it).
    A resource of one of its runs that a process it did not start still uses (a warm
    chain of a fixture wider than the test) is not a leftover. Nothing else on the
    host is looked at, so a stranger's run or server never makes a test fail, and is
    never removed."""
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_VARIABLE, tag)  # inherited by every process a test starts
    ledger = RunLedger()
    monkeypatch.setattr(hygiene, "current_ledger", ledger)
    made = ChainRunner.__init__

    def observed(self: ChainRunner, plan: RunPlan, *args: Any, **kwargs: Any) -> None:
        made(self, plan, *args, **kwargs)
        ledger.learn([self.chain_id])  # its links are named from the chain's id

    monkeypatch.setattr(ChainRunner, "__init__", observed)
    ports_before = listening_sockets(os.getpid())
    yield
    ports_left = sorted(set(listening_sockets(os.getpid())) - set(ports_before))
    stray = tagged_processes(tag)
    for pid in stray:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_gone(stray, 5.0)
    left = ledger.leftovers()
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
