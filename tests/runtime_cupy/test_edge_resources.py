"""Who frees what: a stopping stage frees its inbound edge (whose ring it made) and
leaves its outbound edge to the next stage; a stranger's segment under a hop's name is
left to it and the rest freed; the local rendezvous is held while published; every
process names an edge's folder alike; shared memory runs only where the memory order
allows it, and the media are chosen as asked."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from runplan import SamplingConfig
from runplan.config import Timeouts
from runplan.messages import StageStopped
from runplan.plan import RingSpec
from runtime_cupy.api import plan_for
from runtime_cupy.edges import choice, shm
from runtime_cupy.edges.choice import choose_medium
from runtime_cupy.edges.port import EdgeSetupError
from runtime_cupy.edges.shm import ShmMedium, segment_name, signal_paths
from runtime_cupy.hosts.local import FileRendezvous, LocalProcessHost, local_medium
from runtime_cupy.process.launcher import ProcessRun
from runtime_cupy.process.names import (
    NameTaken,
    NoSpace,
    NotPrivate,
    edge_dir,
    remove_edge_dir,
)
from tests.runtime_cupy.test_process_cli import _env
from tests.support.hosts import FaultyHost
from tests.support.hygiene import SHM, alive, run_resources


def test_a_stage_that_stopped_its_run_keeps_the_chain_s_links(tiny: str, tmp_path: Path) -> None:
    # Stage 1 sleeps 30 s in step 1, so the orchestrator's token timer (300 ms) runs out
    # and the run is torn down: stage 0 stops the run at once; stage 1, asleep, cannot.
    # Stage 0 stays (it serves the chain), and so does the link it produces to (hop 1,
    # made by stage 1): the chain's links outlive its runs. Closing the chain frees
    # them, by name.
    timeouts = Timeouts(ready_ms=20_000, step_ms=300, edge_wait_ms=20_000, stop_ms=2_000)
    plan, _ = plan_for(
        tiny, stages=2, prompt_len=2, max_tokens=8, sampling=SamplingConfig(),
        return_logits=False, timeouts=timeouts,
    )  # fmt: skip
    pids: dict[int, int] = {}
    seen: dict[str, object] = {}
    chain: list[str] = []

    def on_event(kind: str, fields: dict[str, object]) -> None:
        if kind == "spawned":
            pids[int(str(fields["stage_index"]))] = int(str(fields["pid"]))
        message = fields.get("message")
        if kind == "received" and isinstance(message, StageStopped) and message.stage_index == 0:
            seen["stage 0 alive"] = alive(pids[0])
            seen["stage 1 alive"] = alive(pids[1])
            seen["segment"] = (SHM / segment_name(chain[0], 1)).exists()
            seen["fifos"] = all(p.exists() for p in signal_paths(chain[0], 1))

    host = FaultyHost({1: ["step-delay=1:30"]}, log_dir=tmp_path)
    run = ProcessRun(plan, [1, 2], host=host, edges="shm", on_event=on_event)
    chain.append(run.chain_id)
    result = run.run()
    assert result.finished is not None and result.finished.fault is not None
    assert seen == {"stage 0 alive": True, "stage 1 alive": True, "segment": True, "fifos": True}
    assert run_resources(result.chain_id) == []  # the chain's close freed it, by name


def test_shared_memory_is_refused_where_stores_may_be_reordered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert shm.shm_supported("x86_64") and shm.shm_supported("AMD64")
    for machine in ("aarch64", "arm64", "ppc64le", "riscv64"):
        assert not shm.shm_supported(machine)
    monkeypatch.setattr(shm.platform, "machine", lambda: "aarch64")
    with pytest.raises(EdgeSetupError, match=r"x86-64's store order.*aarch64"):
        ShmMedium().create("r", 1, RingSpec(2, 64, 256), b"")
    with pytest.raises(EdgeSetupError, match="use --edges tcp"):
        ShmMedium().attach("r", 1, RingSpec(2, 64, 256), b"")
    monkeypatch.setattr(choice, "shm_supported", lambda: False)
    assert choose_medium("auto", True, 1) == "tcp"  # auto falls back to TCP
    with pytest.raises(ValueError, match="x86-64"):
        choose_medium("shm", True, 1)


def test_media_are_chosen_as_asked() -> None:
    assert choose_medium("auto", True, 1) == ("shm" if shm.shm_supported() else "tcp")
    assert choose_medium("auto", False, 1) == "tcp"
    assert choose_medium("tcp", True, 1) == "tcp"
    with pytest.raises(ValueError, match="edge 4: shared memory between two machines"):
        choose_medium("shm", False, 4)
    with pytest.raises(ValueError, match="unknown edges 'udp'"):
        choose_medium("udp", True, 1)


def test_a_choice_that_cannot_be_fails_before_any_process_starts(tiny: str) -> None:
    plan, _ = plan_for(
        tiny, stages=2, prompt_len=1, max_tokens=2, sampling=SamplingConfig(),
        return_logits=False,
    )  # fmt: skip
    began = time.monotonic()
    with pytest.raises(ValueError, match="unknown edges"):
        ProcessRun(plan, [1], edges="carrier-pigeon")
    assert time.monotonic() - began < 5


def test_the_local_rendezvous_is_in_use_while_published_and_gone_when_withdrawn() -> None:
    run_id = f"test-{uuid.uuid4().hex}"
    publisher, reader = FileRendezvous(), FileRendezvous()
    try:
        assert reader.lookup(run_id, 2) is None
        publisher.publish(run_id, 2, "127.0.0.1:4242")
        assert reader.lookup(run_id, 2) == "127.0.0.1:4242"
        # Held open by its publisher, so that a leftover check sees the folder in use
        # (``users`` leaves out the asking process itself: the descriptor is looked up).
        assert any(
            os.readlink(f"/proc/self/fd/{fd}") == str(edge_dir(run_id, 2) / "addr")
            for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")
        )
        publisher.publish(run_id, 2, "127.0.0.1:4343")  # published again: the new address
        assert reader.lookup(run_id, 2) == "127.0.0.1:4343"
        publisher.withdraw(run_id, 2)
        assert reader.lookup(run_id, 2) is None
        assert not any(
            os.readlink(f"/proc/self/fd/{fd}").startswith(str(edge_dir(run_id, 2)))
            for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")
        )
    finally:
        publisher.withdraw(run_id, 2)
    assert run_resources(run_id) == []


def test_an_end_uses_only_what_its_consumer_can_have_made() -> None:
    """A segment, edge folder or address file that is not this user's alone (another
    owner, a mode open to others) is refused naming it, never attached to or read."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to make a resource of another user (chown)")
    run_id = f"test-{uuid.uuid4().hex}"
    ring = RingSpec(2, 64, 256)
    segment = SHM / segment_name(run_id, 1)
    folder = edge_dir(run_id, 2)
    try:
        os.close(os.open(segment, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
        os.truncate(segment, 1 << 16)
        os.chown(segment, 65534, 65534)
        with pytest.raises(NotPrivate, match=f"{segment.name} is a file of uid 65534"):
            ShmMedium().attach(run_id, 1, ring, b"")
        with pytest.raises(NameTaken, match="exists before its consumer made it"):
            ShmMedium().create(run_id, 1, ring, b"")
        folder.mkdir(mode=0o755)
        (folder / "addr").write_text("127.0.0.1:9")
        with pytest.raises(NotPrivate, match="mode 0755, not a private folder"):
            FileRendezvous().lookup(run_id, 2)
        folder.chmod(0o700)
        (folder / "addr").chmod(0o644)
        with pytest.raises(NotPrivate, match="mode 0644, not a private file"):
            FileRendezvous().lookup(run_id, 2)
    finally:
        segment.unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
    assert run_resources(run_id) == []


def test_every_process_names_an_edge_s_folder_alike_whatever_its_temp_folder_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that first asks where the temp folder is while it is full (or gone,
    or not writable) names the edge's folder as one that asked before: a consumer that
    cannot make it there faults naming it, and no producer looks elsewhere (it waited
    out the readiness bound for a ring made in another folder)."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", None)  # as a process that asks first
    run_id = f"test-{uuid.uuid4().hex}"
    named = edge_dir(run_id, 1)
    assert named.parent == folder
    folder.rmdir()  # unusable when the next process asks
    monkeypatch.setattr(tempfile, "tempdir", None)
    assert edge_dir(run_id, 1) == named
    with pytest.raises(FileNotFoundError, match=str(named)):
        ShmMedium().create(run_id, 1, RingSpec(2, 64, 256), b"")
    assert ShmMedium().attach(run_id, 1, RingSpec(2, 64, 256), b"") is None
    assert run_resources(run_id) == []


def test_a_stranger_who_sees_an_edge_s_folder_made_cannot_take_its_segment_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer makes its edge's folder, then the segment. A stranger watching the temp
    folder (inotify) made a segment named as the folder the moment it appeared, before
    the consumer's: every run it raced faulted (``NameTaken``, or the producer's
    ``NotPrivate``). The folder's name says nothing of the segment's now: a segment, or a
    folder, under the other's name changes nothing."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    run_id = f"test-{uuid.uuid4().hex}"
    spec = RingSpec(2, 64, 256)
    planted = [SHM / edge_dir(run_id, 1).name, tmp_path / segment_name(run_id, 1)]
    os.close(os.open(planted[0], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    planted[1].mkdir(mode=0o700)
    try:
        ring = ShmMedium().create(run_id, 1, spec, b"")
        producer = ShmMedium().attach(run_id, 1, spec, b"")
        assert producer is not None
        ring.detach()
        producer.detach()
        ShmMedium().remove(run_id, 1)
        assert run_resources(run_id, [1]) == []
        assert planted[0].exists() and planted[1].is_dir()  # not the edge's: left
    finally:
        planted[0].unlink(missing_ok=True)
        planted[1].rmdir()
        ShmMedium().remove(run_id, 1)


#: A user of its own for the chain (the squatter is uid 65534): it may read this checkout
#: and its Python (``dac_override``), not remove another user's file from ``/dev/shm``.
_CHAIN_USER = ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups",
               "--inh-caps=+dac_override", "--ambient-caps=+dac_override"]  # fmt: skip


def test_a_strangers_segment_under_a_hop_s_name_is_left_to_it_and_the_rest_is_freed() -> None:
    """A stranger (uid 65534) made hop 1's segment before its consumer (which refused it:
    ``NameTaken``). An unprivileged chain's cleanup cannot remove it: it leaves it to its
    owner, logged, and frees every other hop (it raised ``PermissionError`` at hop 1,
    out of the launcher's run, and freed nothing after it)."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to make a segment of another user and run a chain's user")
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux), to run the cleanup as another user")
    run_id = f"test-{uuid.uuid4().hex}"
    squat = SHM / segment_name(run_id, 1)
    try:
        for hop in (0, 2):  # what the chain's user made of its hops 0 and 2
            folder = edge_dir(run_id, hop)
            folder.mkdir(mode=0o700)
            os.chown(folder, 1000, 1000)
            os.close(os.open(SHM / segment_name(run_id, hop), os.O_CREAT | os.O_EXCL, 0o600))
            os.chown(SHM / segment_name(run_id, hop), 1000, 1000)
        os.close(os.open(squat, os.O_CREAT | os.O_EXCL, 0o600))
        os.chown(squat, 65534, 65534)
        code = (
            "import sys; from runtime_cupy.hosts.local import LocalProcessHost; "
            "LocalProcessHost().cleanup(sys.argv[1], (0, 1, 2))"
        )
        proc = subprocess.run(
            [*_CHAIN_USER, sys.executable, "-c", code, run_id],
            capture_output=True, text=True, check=False, env=_env(), timeout=60,
        )  # fmt: skip
        if "setpriv:" in proc.stderr:
            pytest.skip(f"setpriv cannot run a chain's user here: {proc.stderr.strip()}")
        assert proc.returncode == 0, proc.stderr
        assert f"left the shared-memory segment /{squat.name} (a file of uid 65534" in proc.stderr
        assert run_resources(run_id) == [str(squat)]
    finally:
        squat.unlink(missing_ok=True)
        for hop in (0, 2):
            (SHM / segment_name(run_id, hop)).unlink(missing_ok=True)
            shutil.rmtree(edge_dir(run_id, hop), ignore_errors=True)
    assert run_resources(run_id) == []


def test_a_root_cleanup_leaves_a_strangers_folder_and_segments_logged_and_frees_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Root may remove anything: its cleanup removed a stranger's (uid 65534) folder,
    with what was in it, and segment squatted under a chain's hop names, silently. It
    leaves them to their owner, logged naming them and their owner, as an unprivileged
    cleanup does, and frees every hop its own processes made."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to make resources of another user (chown) and clean up as root")
    run_id = f"test-{uuid.uuid4().hex}"
    ours, theirs = (0, 4), (1, 2, 3)
    victim = Path(tempfile.mkdtemp()) / "victim.txt"
    victim.write_text("root's")
    squats = [
        edge_dir(run_id, 1),  # hop 1: a folder, with a file of the stranger's in it
        SHM / segment_name(run_id, 2),  # hop 2: a segment
        SHM / segment_name(run_id, 3),  # hop 3: a link to a file of root's
    ]
    try:
        for hop in ours:
            edge_dir(run_id, hop).mkdir(mode=0o700)
            os.close(os.open(SHM / segment_name(run_id, hop), os.O_CREAT | os.O_EXCL, 0o600))
        squats[0].mkdir(mode=0o777)
        (squats[0] / "strangers-file").write_text("theirs")
        os.close(os.open(squats[1], os.O_CREAT | os.O_EXCL, 0o666))
        squats[2].symlink_to(victim)
        for path in (*squats, squats[0] / "strangers-file"):
            os.lchown(path, 65534, 65534)
        with caplog.at_level("WARNING"):
            LocalProcessHost().cleanup(run_id, (*ours, *theirs))
        assert sorted(run_resources(run_id)) == sorted(str(p) for p in squats)
        assert (squats[0] / "strangers-file").read_text() == "theirs"
        assert victim.read_text() == "root's"
        assert f"left the folder {squats[0]} of edge 1 (a folder of uid 65534" in caplog.text
        assert f"left the shared-memory segment /{squats[1].name} (a file of uid 65534" in (
            caplog.text
        )
        assert f"/{squats[2].name} (a symbolic link of uid 65534" in caplog.text
    finally:
        shutil.rmtree(squats[0], ignore_errors=True)
        for path in (*squats[1:], victim):
            path.unlink(missing_ok=True)
        victim.parent.rmdir()
        for hop in ours:
            (SHM / segment_name(run_id, hop)).unlink(missing_ok=True)
            shutil.rmtree(edge_dir(run_id, hop), ignore_errors=True)
    assert run_resources(run_id) == []


def test_a_temp_folder_that_is_a_file_faults_the_setup_and_its_cleanup_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``TMPDIR`` a file: the consumer's setup fails naming the path, and removing the
    edge's folder (which could not be made) is no error: it raised
    ``NotADirectoryError`` out of the chain's cleanup, a traceback and no ``--json``."""
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    monkeypatch.setenv("TMPDIR", str(afile))
    run_id = f"test-{uuid.uuid4().hex}"
    with pytest.raises(NotADirectoryError, match=str(edge_dir(run_id, 1))):
        ShmMedium().create(run_id, 1, RingSpec(2, 64, 256), b"")
    remove_edge_dir(run_id, 1)  # no error
    ShmMedium().remove(run_id, 1)


def test_a_fifo_on_a_full_temp_folder_is_no_space_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``os.mkfifo``'s error names no path: "No space left on device" alone was the
    fault of a chain whose ``/tmp`` had no inode left."""

    def full(path: object, mode: int = 0o666) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "mkfifo", full)
    run_id = f"test-{uuid.uuid4().hex}"
    data, _ = signal_paths(run_id, 1)
    with pytest.raises(shm.NoSpace, match=f"no room for the edge's FIFO {data}: .* inodes"):
        ShmMedium().create(run_id, 1, RingSpec(2, 64, 256), b"")
    assert run_resources(run_id) == []


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_an_edge_folder_on_a_full_temp_folder_is_no_space_naming_it(
    monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """The edge's folder, made first (by a TCP consumer's address file and the shm
    medium alike), on a temp folder with no inode left was a bare ``OSError``: it is
    ``NoSpace`` naming the folder and what its temp folder has free."""
    real_mkdir = Path.mkdir

    def full(self: Path, *args: Any, **kwargs: Any) -> None:
        if self.name.startswith("gpp-"):
            raise OSError(code, os.strerror(code), str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", full)
    run_id = f"test-{uuid.uuid4().hex}"
    folder = edge_dir(run_id, 1)
    words = f"no room for the folder {folder} of edge 1: .* inodes and .* bytes free in "
    with pytest.raises(NoSpace, match=words):
        FileRendezvous().publish(run_id, 1, "127.0.0.1:4242")
    with pytest.raises(NoSpace, match=words):
        ShmMedium().create(run_id, 1, RingSpec(2, 64, 256), b"")
    assert run_resources(run_id) == []


@pytest.mark.parametrize("call", ["mkstemp", "write"])
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_an_address_file_on_a_full_temp_folder_is_no_space_naming_it(
    monkeypatch: pytest.MonkeyPatch, call: str, code: int
) -> None:
    """A TCP consumer's address file on a temp folder with no inode (``mkstemp``) or no
    byte (``os.write``) left was a bare ``OSError`` naming no file and no room; it is
    ``NoSpace`` naming the file and what its folder has free, and no partial file is
    left."""

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(tempfile if call == "mkstemp" else os, call, full)
    run_id = f"test-{uuid.uuid4().hex}"
    path = edge_dir(run_id, 1) / "addr"
    try:
        with pytest.raises(
            NoSpace, match=f"no room for the edge's address file {path}: .* inodes and .* bytes"
        ):
            FileRendezvous().publish(run_id, 1, "127.0.0.1:4242")
        assert os.listdir(path.parent) == []
    finally:
        remove_edge_dir(run_id, 1)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_shared_memory_folder_out_of_inodes_is_no_space_naming_it(
    monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """``shm_open`` failing for want of an inode (bytes to spare) was an untyped
    ``OSError`` naming the segment alone; it is ``NoSpace`` naming ``/dev/shm`` and what
    it has free, as a segment too big for it is, and nothing of the edge is left."""

    def no_inode(name: str, flags: int, mode: int = 0o777) -> int:
        raise OSError(code, os.strerror(code), name)

    monkeypatch.setattr(shm._posixshmem, "shm_open", no_inode)
    run_id = f"test-{uuid.uuid4().hex}"
    name = segment_name(run_id, 1)
    words = (
        f"no room for the shared-memory segment /{name}: .* inodes and .* bytes free in /dev/shm"
    )
    with pytest.raises(shm.NoSpace, match=words):
        ShmMedium().create(run_id, 1, RingSpec(2, 64, 256), b"")
    assert run_resources(run_id) == []


def test_a_read_only_shared_memory_folder_is_no_error_for_a_cleanup(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``/dev/shm`` read-only: removing a segment that could never be made raised
    ``OSError`` (EROFS) out of a TCP chain's cleanup after its run completed."""

    def read_only(name: str) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(shm._posixshmem, "shm_unlink", read_only)
    assert shm.unlink_segment(segment_name(f"test-{uuid.uuid4().hex}", 1)) is False
    assert "left the shared-memory segment" not in caplog.text  # none was there


def test_a_producer_out_of_descriptors_faults_its_setup_at_once_naming_it() -> None:
    """A TCP producer whose process has no descriptor left took it for a consumer not
    there yet: it tried again every few milliseconds (an INFO line each) until the
    readiness bound, whose fault named neither the stage's want nor the edge."""
    run_id = f"test-{uuid.uuid4().hex}"
    spec = RingSpec(2, 64, 256)
    consumer, producer = local_medium("tcp"), local_medium("tcp")
    ring = consumer.create(run_id, 1, spec, b"k" * 32)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, hard))
        with contextlib.suppress(OSError):
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        with pytest.raises(EdgeSetupError, match=r"edge 1: OSError: .*Too many open files"):
            producer.attach(run_id, 1, spec, b"k" * 32)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        ring.close()
        consumer.remove(run_id, 1)
    assert run_resources(run_id) == []
