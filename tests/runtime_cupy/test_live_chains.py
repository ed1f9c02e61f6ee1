"""The registry of live chains (``runtime_cupy.edges.live_chains``): a chain every
process of which on the host was SIGKILLed at once left its rings and edge folders for
good (no one survived to free them, and a later run could not name them); the next
process that makes a hop on the host frees them. A live chain's names are never freed
by a run beside it, and what a stranger planted in the registry is refused, never
followed."""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from runplan import RingSpec, SamplingConfig
from runtime_cupy.api import plan_for
from runtime_cupy.edges import live_chains
from runtime_cupy.edges.links import ProcessLinks
from runtime_cupy.edges.live_chains import LiveChain, entry_name, registry_dir
from runtime_cupy.edges.shm import SHM_DIR, ShmMedium, segment_name
from runtime_cupy.process.launcher import ProcessRun
from runtime_cupy.process.names import edge_dir
from tests.runtime_cupy.test_kill_orchestrator import STOP_MS, Driver
from tests.support.hygiene import alive, run_resources, wait_gone

SPEC = RingSpec(2, 64, 256)


@pytest.fixture
def temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp folder of the test's own (inherited by the processes it starts): its edge
    folders and its registry of live chains are the test's alone."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    return folder


def _entries() -> list[str]:
    """The entries of the registry ([] where there is none)."""
    folder = registry_dir()
    return sorted(os.listdir(folder)) if folder.exists() else []


def _one_run(model: str) -> None:
    """A whole run of two stages in this process: its chain's processes start, make
    their hops (each first sweeping the registry) and end."""
    plan, devices = plan_for(
        model, stages=2, prompt_len=3, max_tokens=3, sampling=SamplingConfig(), return_logits=False
    )
    result = ProcessRun(plan, [1, 2, 3], devices=devices).run()
    assert result.finished is not None and result.finished.fault is None


@pytest.mark.process
def test_the_next_run_frees_what_a_chain_killed_whole_left(tiny: str, temp: Path) -> None:
    """The orchestrator stopped, its stages SIGKILLed, then it: no process of the chain is
    left to free its rings, FIFO folders and token-out. They stayed for good; the next
    run on the host frees them, and the registry holds nothing once it ended."""
    driver = Driver(tiny, {1: ["step-delay=2:60"]}, temp.parent / "driver.log")
    driver.until("token", 2)
    driver.until_logged("step 2 delayed")
    assert len(driver.pids) == 3 and all(alive(p) for p in driver.pids)
    left = run_resources(driver.chain_id)
    assert len(left) == 8  # four hops: a segment and a folder each
    os.kill(driver.proc.pid, signal.SIGSTOP)  # frees nothing when its stages die
    for pid in driver.pids:
        os.kill(pid, signal.SIGKILL)
    assert wait_gone(driver.pids, 10) == []
    driver.kill()
    time.sleep(0.2)
    assert run_resources(driver.chain_id) == left  # no one left to free them
    _one_run(tiny)
    assert run_resources(driver.chain_id) == []
    assert list(temp.iterdir()) == []  # the registry too, once no chain runs


@pytest.mark.process
def test_the_next_run_frees_the_trace_folders_a_traced_chain_killed_whole_left(
    tiny: str, temp: Path
) -> None:
    """A ``--trace`` run's folders (``gguf-pipeline-trace-*``), which its orchestrator
    removes once it read its stages' traces, and a stage whose orchestrator is gone its
    own: every process of the run SIGKILLed at once, they stayed for good. The next
    run on the host frees them, as it frees the chain's links."""
    driver = Driver(tiny, {1: ["step-delay=2:60"]}, temp.parent / "driver.log", trace=True)
    driver.until("token", 2)
    driver.until_logged("step 2 delayed")
    traces = sorted(temp.glob("gguf-pipeline-trace-*"))
    assert len(traces) == 3
    os.kill(driver.proc.pid, signal.SIGSTOP)  # frees nothing when its stages die
    for pid in driver.pids:
        os.kill(pid, signal.SIGKILL)
    assert wait_gone(driver.pids, 10) == []
    driver.kill()
    assert sorted(temp.glob("gguf-pipeline-trace-*")) == traces  # no one left to free them
    _one_run(tiny)
    assert list(temp.iterdir()) == []


@pytest.mark.process
def test_a_relative_temp_folder_runs_and_leaves_nothing(
    tiny: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``TMPDIR`` relative to the working folder (which every process of the chain
    shares): each hop is listed in the registry by its absolute folder, and the run
    completes and leaves nothing. Every run faulted at its first hop, the registry
    refusing the relative folder (``ValueError: tmp/gpp-... is not an edge folder``)."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", "tmp")
    _one_run(tiny)
    assert list((tmp_path / "tmp").iterdir()) == []
    assert edge_dir("chain-x", 1).parent == tmp_path / "tmp"


@pytest.mark.process
def test_a_run_beside_a_live_chain_frees_none_of_its_names(tiny: str, temp: Path) -> None:
    driver = Driver(tiny, {1: ["step-delay=2:60"]}, temp.parent / "driver.log")
    driver.until("token", 2)
    driver.until_logged("step 2 delayed")  # stage 1 is in its long step
    live = run_resources(driver.chain_id)
    assert len(live) == 8
    _one_run(tiny)
    assert run_resources(driver.chain_id) == live
    assert _entries() == [entry_name(driver.chain_id)]
    driver.kill()  # its stages free it as they stop
    assert wait_gone(driver.pids, STOP_MS / 1000 + 8) == []
    assert run_resources(driver.chain_id) == []


HOLD = """
import sys
from pathlib import Path
from runtime_cupy.edges.live_chains import LiveChain
entry = LiveChain.hold(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
assert entry is not None
print("held", flush=True)
sys.stdin.read()
"""


def test_an_entry_is_freed_only_once_no_process_holds_it(temp: Path) -> None:
    """A process holds its chain's entry with a hop listed; a sweep beside it frees
    nothing, and frees the hop (made after the entry was held) once the holder was
    killed."""
    chain = "chain-held"
    ring = ShmMedium().create(chain, 1, SPEC, b"")
    ring.detach()  # its names stay, as a killed process's would
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, chain, segment_name(chain, 1), str(edge_dir(chain, 1))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        assert live_chains.sweep() == 0
        assert run_resources(chain, [1]) != []
    finally:
        proc.kill()
        proc.wait()
    assert live_chains.sweep() == 1
    assert run_resources(chain, [1]) == []
    assert not registry_dir().exists()  # nothing left in it


class CheckingMedium(ShmMedium):
    """Shared memory that checks, as it makes a hop, that the hop is listed in its
    chain's entry and the entry held."""

    def create(self, run_id: str, edge_id: int, spec: RingSpec, key: bytes) -> Any:
        path = registry_dir() / entry_name(run_id)
        line = (
            segment_name(run_id, edge_id).encode() + b" " + os.fsencode(edge_dir(run_id, edge_id))
        )
        assert path.read_bytes().splitlines() == [line]
        with path.open("rb") as entry, pytest.raises(BlockingIOError):
            fcntl.flock(entry, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert not (SHM_DIR / segment_name(run_id, edge_id)).exists()
        return super().create(run_id, edge_id, spec, key)


def test_a_hop_is_listed_and_held_before_its_names_are_made(temp: Path, tiny: str) -> None:
    plan, _ = plan_for(
        tiny, stages=1, prompt_len=3, max_tokens=2, sampling=SamplingConfig(), return_logits=False
    )
    medium = CheckingMedium()
    links = ProcessLinks(medium, medium, b"k" * 32, "chain-checked")
    links.open_token_out(plan)
    assert _entries() == [entry_name("chain-checked")]
    links.remove_inbound()
    links.detach()  # the last holder: the entry goes, and the registry with it
    assert not registry_dir().exists()
    assert run_resources("chain-checked") == []


def test_an_entry_an_earlier_version_wrote_is_freed(temp: Path) -> None:
    """An entry of a chain killed whole under an earlier version lists each hop's folder
    alone (its segment was named as it): a sweep frees both."""
    chain = "chain-earlier"
    ring = ShmMedium().create(chain, 1, SPEC, b"")
    ring.detach()  # its names stay, as a killed process's would
    old_segment = SHM_DIR / edge_dir(chain, 1).name  # the segment as it was named
    os.close(os.open(old_segment, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    registry_dir().mkdir(mode=0o700)
    entry = registry_dir() / entry_name(chain)
    entry.write_bytes(os.fsencode(edge_dir(chain, 1)) + b"\n")
    entry.chmod(0o600)
    try:
        assert live_chains.sweep() == 1
        assert not old_segment.exists() and not edge_dir(chain, 1).exists()
    finally:
        old_segment.unlink(missing_ok=True)
        ShmMedium().remove(chain, 1)
    assert not registry_dir().exists()


def test_a_planted_entry_is_refused_not_followed(
    temp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An entry that is a symbolic link (to a list of this user's folders) is neither
    read nor removed; the folder it names stays."""
    registry_dir().mkdir(mode=0o700)
    folder = edge_dir("chain-victim", 1)
    folder.mkdir(mode=0o700)
    target = temp.parent / "planted"
    target.write_bytes(os.fsencode(folder) + b"\n")
    link = registry_dir() / entry_name("chain-planted")
    link.symlink_to(target)
    with caplog.at_level(logging.WARNING, logger="runtime_cupy.edges.live_chains"):
        assert live_chains.sweep() == 0
    assert folder.is_dir() and link.is_symlink()
    assert f"the entry {link} of live chains is a symbolic link" in caplog.text
    # The entry is not held through the link either: no registry for that chain.
    names = segment_name("chain-planted", 1), edge_dir("chain-planted", 1)
    assert LiveChain.hold("chain-planted", *names) is None
    assert folder.is_dir()


def test_another_users_entry_is_refused(temp: Path, caplog: pytest.LogCaptureFixture) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root, to make a file of another user (chown)")
    registry_dir().mkdir(mode=0o700)
    folder = edge_dir("chain-victim", 2)
    folder.mkdir(mode=0o700)
    entry = registry_dir() / entry_name("chain-stranger")
    entry.write_bytes(os.fsencode(folder) + b"\n")
    entry.chmod(0o600)
    os.chown(entry, 65534, 65534)
    with caplog.at_level(logging.WARNING, logger="runtime_cupy.edges.live_chains"):
        assert live_chains.sweep() == 0
    assert folder.is_dir() and entry.exists()
    assert "is a file of uid 65534" in caplog.text


def test_a_planted_registry_is_refused_and_the_chain_runs_without(
    temp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A link where the registry goes (to a folder of this user's, say) is not
    followed: no entry is written through it, and the hop is made all the same."""
    elsewhere = temp.parent / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    registry_dir().symlink_to(elsewhere)
    medium = ShmMedium()
    links = ProcessLinks(medium, medium, b"k" * 32, "chain-unregistered")
    with caplog.at_level(logging.WARNING, logger="runtime_cupy.edges.live_chains"):
        links._receiver(1, SPEC)
    try:
        assert list(elsewhere.iterdir()) == []
        assert f"the registry of live chains {registry_dir()} is a symbolic link" in caplog.text
        assert run_resources("chain-unregistered", [1]) != []
    finally:
        links.remove_inbound()
        links.detach()
    assert run_resources("chain-unregistered", [1]) == []
