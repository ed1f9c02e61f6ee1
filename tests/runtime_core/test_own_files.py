"""Files a user names for writing (``--trace``): what another user put at the name first
in a shared folder (a link to someone's file, a FIFO, their own file) is refused naming
it, at once, never written through or waited on; this user's file is emptied and
written, a device (``/dev/null``, ``/dev/full``) or root's link to one is written to.
(The stage logs' own cases: ``tests/runtime_cupy/test_stage_log.py``.)"""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path

import pytest

from runtime_core.console import writable_file
from runtime_core.own_files import FileRefused, open_own_file

ROOT = os.geteuid() == 0
NOBODY = 65534


def _write(path: Path, text: bytes, **kwargs: bool) -> None:
    fd = open_own_file(path, "the trace", **kwargs)
    try:
        os.write(fd, text)
    finally:
        os.close(fd)


def test_this_users_file_is_made_private_then_emptied_or_appended_to(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    _write(path, b"one\n")
    _write(path, b"two\n", append=True)
    assert path.read_bytes() == b"one\ntwo\n"
    assert path.stat().st_mode & 0o777 == 0o600
    _write(path, b"three\n")
    assert path.read_bytes() == b"three\n"


def test_a_fifo_at_the_name_is_refused_at_once_with_or_without_a_reader(tmp_path: Path) -> None:
    fifo = tmp_path / "trace.json"
    os.mkfifo(fifo)
    done = threading.Event()
    outcome: list[BaseException] = []

    def open_it() -> None:
        try:
            os.close(open_own_file(fifo, "the trace", devices=True))
        except BaseException as exc:
            outcome.append(exc)
        done.set()

    threading.Thread(target=open_it, daemon=True).start()
    assert done.wait(5), "the open waited for a reader"  # (it once hung the run)
    assert isinstance(outcome[0], FileRefused) and "a FIFO" in str(outcome[0])
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # another process reading it
    try:
        with pytest.raises(FileRefused, match="a FIFO"):
            open_own_file(fifo, "the trace", devices=True)
    finally:
        os.close(reader)


def test_a_link_is_followed_only_where_it_is_this_users_or_roots(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    link = tmp_path / "trace.json"
    link.symlink_to(victim)
    with pytest.raises(FileRefused, match="a symbolic link"):  # not without ``devices``
        open_own_file(link, "a stage's log", append=True)
    _write(link, b"mine\n", devices=True)  # this user's own link: as the user meant
    assert victim.read_bytes() == b"mine\n"
    if ROOT:  # another user's link (made by root here, as nobody would)
        os.lchown(link, NOBODY, NOBODY)
        with pytest.raises(FileRefused, match=f"a symbolic link of uid {NOBODY}"):
            open_own_file(link, "the trace", devices=True)
        assert victim.read_bytes() == b"mine\n"


@pytest.mark.skipif(not ROOT, reason="another user's file is made with chown, as root")
def test_another_users_file_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    theirs = tmp_path / "trace.json"
    theirs.write_bytes(b"theirs\n")
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(FileRefused, match=f"a file of uid {NOBODY}"):
        open_own_file(theirs, "the trace", devices=True)
    assert theirs.read_bytes() == b"theirs\n"


def test_a_file_with_another_name_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    """A hard link planted at the name (where the system lets a user link a file of
    root's) reaches the other file: it was emptied and overwritten, root's too."""
    victim = tmp_path / "victim.conf"
    victim.write_bytes(b"important\n")
    planted = tmp_path / "trace.json"
    os.link(victim, planted)
    for kwargs in ({"devices": True}, {"append": True}):
        with pytest.raises(FileRefused, match=f"{planted} is a file of uid .* with 2 names"):
            open_own_file(planted, "the trace", **kwargs)
    assert victim.read_bytes() == b"important\n"


def test_a_folder_that_is_another_users_link_is_refused_naming_it(tmp_path: Path) -> None:
    """A folder on the way to the name that is a symbolic link: this user's (or root's)
    is followed; another user's (in a sticky ``/tmp`` whose system follows it) was, and
    the trace overwrote a file of root's wherever it pointed."""
    private = tmp_path / "rootonly"
    private.mkdir(mode=0o700)
    (private / "trace.json").write_bytes(b"private\n")
    link = tmp_path / "mytraces"
    link.symlink_to(private)
    _write(link / "trace.json", b"mine\n", devices=True)  # this user's own link
    (tmp_path / "x").mkdir()
    _write(tmp_path / "x" / ".." / "mytraces" / "new.json", b"new\n")
    assert (private / "trace.json").read_bytes() == b"mine\n"
    assert (private / "new.json").read_bytes() == b"new\n"
    if not ROOT:
        pytest.skip("another user's link is made with lchown, as root")
    os.lchown(link, NOBODY, NOBODY)
    deeper = tmp_path / "deeper"
    deeper.symlink_to("mytraces")  # root's link to the stranger's: still reaches it
    for path in (link / "trace.json", deeper / "trace.json", link / "fresh.json"):
        with pytest.raises(
            FileRefused, match=f"the folder {link} on its way is a symbolic link of uid {NOBODY}"
        ):
            open_own_file(path, "the trace", devices=True)
    assert (private / "trace.json").read_bytes() == b"mine\n"
    assert not (private / "fresh.json").exists()


@pytest.mark.skipif(not Path("/dev/null").is_char_device(), reason="no /dev/null")
def test_a_device_is_written_to_only_where_devices_are_allowed() -> None:
    _write(Path("/dev/null"), b"gone\n", devices=True)
    with pytest.raises(FileRefused, match="a special file"):
        open_own_file(Path("/dev/null"), "a stage's log", append=True)


def test_the_trace_flag_refuses_a_planted_fifo_naming_it(tmp_path: Path) -> None:
    fifo = tmp_path / "trace.json"
    os.mkfifo(fifo)
    with pytest.raises(argparse.ArgumentTypeError, match=r"is a FIFO of uid \d+"):
        writable_file(str(fifo))
    fresh = tmp_path / "fresh.json"
    assert writable_file(str(fresh)) == fresh and not fresh.exists()  # nothing left
