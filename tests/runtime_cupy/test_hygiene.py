"""The leftover check of every process-runtime test looks at what the test made itself:
the resources of the runs it used (``hygiene.RunLedger``), never a stranger's on the
host, and not those another process is using (``hygiene.users``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import runtime_cupy
from runplan import RingSpec
from runtime_cupy.edges.live_chains import registry_dir
from runtime_cupy.edges.shm import ShmMedium, remove_run
from runtime_cupy.process.names import PREFIX
from tests.support import hygiene
from tests.support.hygiene import (
    SHM,
    TAG_VARIABLE,
    RunLedger,
    alive,
    held_links,
    run_resources,
    users,
    wait_gone,
)

HOLD = """
import mmap, os, sys, time
path = sys.argv[1]
fd = os.open(path, os.O_RDONLY if os.path.isdir(path) else os.O_RDWR)
if path.startswith("/dev/shm/"):
    os.ftruncate(fd, 4096)
    m = mmap.mmap(fd, 4096)
    os.close(fd)
print("ready", flush=True)
time.sleep(60)
"""


def _hold(path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_a_file_held_open_in_a_folder_names_its_holder(tmp_path: Path) -> None:
    folder = tmp_path / "gpp-folder"
    folder.mkdir()
    (folder / "wake").write_bytes(b"")
    assert users(str(folder)) == []
    proc = _hold(folder / "wake")
    try:
        assert users(str(folder)) == [proc.pid]
        assert users(str(tmp_path / "gpp-fold")) == []  # a prefix is not the folder
    finally:
        proc.kill()
        proc.wait()
    assert not alive(proc.pid) and wait_gone([proc.pid], 1.0) == []
    assert users(str(folder)) == []


def test_a_mapped_segment_names_its_mapper() -> None:
    segment = SHM / f"gpp-hygiene-{uuid.uuid4().hex[:8]}"
    segment.write_bytes(b"")
    try:
        proc = _hold(segment)
        try:
            assert users(str(segment)) == [proc.pid]
        finally:
            proc.kill()
            proc.wait()
        assert users(str(segment)) == []
    finally:
        segment.unlink()


def test_held_links_are_a_chains_names_and_not_the_registry_of_live_chains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``held_links``: a chain's entry in the registry of live chains, a file of an edge
    folder, a segment (mapped) are links their holders hold; the registry's folder is
    not, which every chain of the user has its entry in and a stage holds open for a
    moment as it takes its own (sampled then, it counted as the chain's, and was still
    there after the chain was gone while any other chain lived)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    registry = registry_dir()
    registry.mkdir(mode=0o700)
    entry = registry / ("0" * 32)
    entry.write_bytes(b"")
    folder = tmp_path / f"{PREFIX}{'a' * 24}"
    folder.mkdir()
    (folder / "data").write_bytes(b"")
    segment = SHM / f"{PREFIX}hygiene-{uuid.uuid4().hex[:8]}"
    segment.write_bytes(b"")
    holders = [_hold(registry)]
    try:
        assert held_links([holders[0].pid]) == set()
        holders += [_hold(entry), _hold(folder / "data"), _hold(segment)]
        links = {str(entry), str(folder / "data"), str(segment)}
        assert held_links(p.pid for p in holders) == links
    finally:
        for proc in holders:
            proc.kill()
            proc.wait()
        segment.unlink()


STRANGER = """
import os, sys
from pathlib import Path
Path(sys.argv[1]).write_bytes(b"")  # a segment, held by no one
os.mkdir(sys.argv[2], 0o700)  # an edge folder
os.mkfifo(os.path.join(sys.argv[2], "data"), 0o600)
"""


@pytest.fixture(scope="session")
def strangers() -> Iterator[list[Path]]:
    """Resources a stranger made on this host; removed at the end of the session, after
    every test's leftover check. (Another test session on the host may remove them
    before: a stranger's resources come and go as they will.)"""
    made: list[Path] = []
    yield made
    for path in made:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _stranger_makes_resources(strangers: list[Path]) -> tuple[Path, Path]:
    """A process that is not this test's (no tag in its environment) makes a segment and
    an edge folder with this runtime's prefix, and exits: nobody holds them."""
    segment = SHM / f"{PREFIX}{uuid.uuid4().hex[:12]}-1"
    folder = Path(tempfile.gettempdir()) / f"{PREFIX}{uuid.uuid4().hex[:12]}"
    strangers += [segment, folder]
    env = {k: v for k, v in os.environ.items() if k != TAG_VARIABLE}
    subprocess.run([sys.executable, "-c", STRANGER, str(segment), str(folder)], env=env, check=True)
    assert segment.exists() and (folder / "data").exists()
    assert users(str(segment)) == [] and users(str(folder)) == []
    return segment, folder


def test_a_strangers_resources_made_during_a_test_are_not_its_leftovers(
    strangers: list[Path],
) -> None:
    """The leftover check of this very test (``conftest.no_leftovers``) passes, and
    leaves the stranger's resources where they are."""
    segment, folder = _stranger_makes_resources(strangers)
    assert not {str(segment), str(folder)} & set(hygiene.current_ledger.resources())


def test_a_run_of_the_ledger_left_behind_is_found_and_a_strangers_is_not(
    strangers: list[Path],
) -> None:
    segment, folder = _stranger_makes_resources(strangers)
    ours = f"test-{uuid.uuid4().hex}"
    ledger = RunLedger()
    ledger.learn([ours])
    ring = ShmMedium().create(ours, 1, RingSpec(2, 64, 256), b"")
    try:
        ring.close()  # this process lets go; the names stay, as a killed stage's would
        left = ledger.leftovers()
        assert left == sorted(run_resources(ours)) and len(left) >= 2  # a segment, a folder
        assert str(segment) not in left and str(folder) not in left
    finally:
        remove_run(ours, [1])
    assert ledger.leftovers() == []


@pytest.mark.process
def test_a_run_made_in_the_tests_process_is_in_its_ledger(tiny: str) -> None:
    result = runtime_cupy.generate(tiny, [1, 2], max_tokens=2, stages=2, worker="numpy")
    assert result.outcome == "completed"
    # A run's resources are its chain's links, named from the chain id.
    assert result.chain_id in hygiene.current_ledger.run_ids


@pytest.mark.process
def test_a_cli_runs_leftovers_are_found_from_the_chain_id_its_json_names(tiny: str) -> None:
    """A run's links are named from its chain's id, not its run id: the leftover checks
    of the tests that run the command line looked for names made from ``run_id``, which
    no run makes, and could not fail. A link left as the run's would be (its process
    gone, its names there) is found from ``chain_id``."""
    from tests.runtime_cupy.test_process_cli import _env

    proc = subprocess.run(
        [sys.executable, "-m", "runtime_cupy", "--model", tiny, "--stages", "2",
         "--prompt-ids", "1,2", "--max-tokens", "2", "--worker", "numpy", "--json"],
        capture_output=True, text=True, check=False, env=_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    hygiene.learn_chain_ids([doc["chain_id"]])
    assert doc["chain_id"].startswith("chain-") and hygiene.current_ledger.leftovers() == []
    ring = ShmMedium().create(doc["chain_id"], 1, RingSpec(2, 64, 256), b"")
    try:
        ring.close()  # left behind as a killed stage's ring of the chain's hop 1
        left = hygiene.current_ledger.leftovers()
        assert left == run_resources(doc["chain_id"]) and len(left) >= 2, left
        assert run_resources(doc["run_id"]) == []  # what the checks looked for
    finally:
        remove_run(doc["chain_id"], [1])
