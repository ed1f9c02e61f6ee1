"""A stage's log in a folder others may write in (``--log-dir``): what another process
put at ``stage-<i>.log`` first (a link to someone's file, a FIFO, another user's file,
a folder) is refused naming it, at once, never written through or waited on; a file of
this user's is appended to. A stage that cannot be started leaves no trace folder."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

import attrs
import pytest

from runtime_cupy.hosts.local import LocalProcessHost
from runtime_cupy.hosts.port import StageLaunch
from runtime_cupy.hosts.stage_log import StageLogRefused, open_stage_log

LAUNCH = StageLaunch("run-x", 0, 1, "stage-0", "orchestrator", "numpy", "shm", "shm", 1_000)


def _append(path: Path, text: bytes) -> None:
    fd = open_stage_log(path)
    try:
        os.write(fd, text)
    finally:
        os.close(fd)


def test_a_log_is_made_private_and_appended_to(tmp_path: Path) -> None:
    log = tmp_path / "stage-0.log"
    _append(log, b"one\n")
    _append(log, b"two\n")
    assert log.read_bytes() == b"one\ntwo\n"
    assert log.stat().st_mode & 0o777 == 0o600


def test_a_link_planted_at_the_log_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    (tmp_path / "stage-0.log").symlink_to(victim)
    with pytest.raises(StageLogRefused, match="a symbolic link"):
        open_stage_log(tmp_path / "stage-0.log")
    assert victim.read_bytes() == b"precious\n"


def test_a_fifo_planted_at_the_log_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "stage-0.log"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def open_it() -> None:
        try:
            os.close(open_stage_log(fifo))
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    opener = threading.Thread(target=open_it, daemon=True)
    opener.start()
    opener.join(10)
    if opener.is_alive():  # the old open("ab") waits for a reader: let it go, then fail
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        opener.join(10)
        pytest.fail("opening a FIFO as a stage's log waited for a reader")
    assert isinstance(outcome[0], StageLogRefused) and "a FIFO" in str(outcome[0])


def test_a_folder_at_the_log_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "stage-0.log").mkdir()
    with pytest.raises(StageLogRefused, match="a folder"):
        open_stage_log(tmp_path / "stage-0.log")


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's file needs root")
def test_another_users_file_at_the_log_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "stage-0.log"
    theirs.write_bytes(b"")
    os.chown(theirs, 65534, 65534)  # nobody's: it would receive this run's log
    with pytest.raises(StageLogRefused, match="uid 65534"):
        open_stage_log(theirs)
    assert theirs.read_bytes() == b""


def test_a_stage_that_cannot_start_leaves_no_trace_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class NoSuchProgram(LocalProcessHost):
        def command(self, launch: StageLaunch, arguments: object) -> list[str]:
            return [str(tmp_path / "no-such-program")]

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(FileNotFoundError):
        NoSuchProgram().start(attrs.evolve(LAUNCH, trace=True), b"k" * 32)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_refused_log_starts_no_stage_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "stage-0.log").symlink_to(tmp_path / "elsewhere")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    host = LocalProcessHost(log_dir=tmp_path / "logs")
    with pytest.raises(StageLogRefused):
        host.start(attrs.evolve(LAUNCH, trace=True), b"k" * 32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]
    assert not (tmp_path / "elsewhere").exists()
