"""Edges between processes on one host (EDGES_AND_WORKERS.md §2-§3): each edge is the
``runtime_core`` ring over a POSIX shared-memory segment, woken through two named FIFOs.

Every resource of an edge is named from ``(run_id, edge_id)`` alone (``names``: a tag
of each resource, unguessable without the run id, and the folder's saying nothing of
the segment's), so whoever tears a run down finds and frees all of it, also what a
killed process created:

    segment   /gpp-<segment tag>                 the ring: 64-byte control block, then slots
    FIFOs     <tmp>/gpp-<folder tag>/data        wakes the consumer (published, or closed)
              <tmp>/gpp-<folder tag>/space       wakes the producer (released, or closed)

The consumer's end makes the folder (mode 0700, never one that exists), the FIFOs in
it, then the segment (mode 0600, ``O_EXCL``) with every page of it reserved
(``posix_fallocate``): a name that is taken, or a ``/dev/shm`` without room for the
ring, is a setup fault naming the resource (``NameTaken``, ``NoSpace``) and leaves
nothing behind, instead of a SIGBUS at the first write to a page the file system cannot
give. The producer's end attaches once the segment exists at its full size, and only to
a segment, folder and FIFOs of this user closed to everyone else (``names.NotPrivate``
otherwise). A wake-up is one byte written to the FIFO (non-blocking; a full FIFO is
already a pending wake-up); a waiter polls the FIFO's descriptor and drains it. Both
ends open both FIFOs read-write, so neither open blocks and neither end sees
end-of-file.

Shared-memory edges carry no MAC: both ends are processes of one user on one host, and
the names, modes and checks above keep every other user out of the ring; what they do
not keep out (root, or this user's own processes) could read or change the stages'
memory as well.

Memory order. The producer writes a record's bytes into its slot, then the ``published``
counter (one aligned 8-byte store); the consumer reads the counter, then the slot. Each
of these is a separate call into CPython's C code, which the C compiler cannot reorder,
but the processor may: only a machine whose stores become visible to other cores in
program order, and whose loads are not reordered with older loads, makes this safe
without fences. x86-64 (total store order) is such a machine; ARM and POWER are not,
and Python has no portable fence. So this medium runs on x86-64 only and refuses
elsewhere (``EdgeSetupError``), where ``--edges tcp`` moves the bytes through the
kernel instead (whose system calls order them).
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import logging
import mmap
import os
import platform
import select
from pathlib import Path
from typing import Any

from runplan.plan import RingSpec
from runtime_core.own_files import describe, describe_stat
from runtime_core.ring import ring_bytes
from runtime_cupy.edges.port import EdgeSetupError, ProcessRing
from runtime_cupy.process.names import (
    PREFIX,
    NameTaken,
    NoSpace,
    check_private,
    check_stat,
    edge_dir,
    edge_tag,
    make_edge_dir,
    no_space,
    remove_edge_dir,
)
from runtime_cupy.process.poller import IN, Entry

# CPython's binding of shm_open / shm_unlink (what multiprocessing.shared_memory uses).
# Used directly so that no process starts multiprocessing's resource tracker, which
# would unlink segments behind our back when an attaching process exits.
_posixshmem: Any = importlib.import_module("_posixshmem")

log = logging.getLogger("runtime_cupy.edges.shm")

#: The longest shared-memory name (leading slash included) that macOS accepts.
MAX_SEGMENT_NAME = 31
#: Machines whose memory order makes a ring without fences safe (see the docstring).
ORDERED_MACHINES = ("x86_64", "amd64")
#: Where Linux shows shared-memory segments as files (for messages and free space).
SHM_DIR = Path("/dev/shm")

__all__ = [
    "MAX_SEGMENT_NAME",
    "PREFIX",
    "FifoSignal",
    "NoSpace",
    "Segment",
    "ShmMedium",
    "ShmRing",
    "remove_edge",
    "remove_run",
    "segment_name",
    "shm_supported",
    "signal_paths",
    "unlink_segment",
]


def shm_supported(machine: str | None = None) -> bool:
    """Whether shared-memory rings are safe on ``machine`` (default: this one)."""
    return (machine or platform.machine()).lower() in ORDERED_MACHINES


def segment_name(run_id: str, edge_id: int) -> str:
    """The shared-memory name of an edge's ring (without the leading slash)."""
    name = f"{PREFIX}{edge_tag(run_id, edge_id, 'segment')}"
    assert len(name) + 1 <= MAX_SEGMENT_NAME, name
    return name


def signal_paths(run_id: str, edge_id: int) -> tuple[Path, Path]:
    """The ``data`` and ``space`` FIFOs of an edge."""
    folder = edge_dir(run_id, edge_id)
    return folder / "data", folder / "space"


def _free_bytes() -> str:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return "free space unknown"
    return f"{st.f_bavail * st.f_frsize} bytes free in {SHM_DIR}"


def _make_fifo(path: Path) -> None:
    """Make the FIFO ``path`` (mode 0600); ``NoSpace`` naming it and the room left where
    its file system has none (``os.mkfifo``'s own error names no path)."""
    try:
        os.mkfifo(path, 0o600)
    except OSError as exc:
        full = no_space(exc, f"the edge's FIFO {path}", path.parent)
        if full is not None:
            raise full from None
        raise OSError(exc.errno, exc.strerror, str(path)) from None


# -- shared memory ---------------------------------------------------------------------


class Segment:
    """One mapped POSIX shared-memory segment."""

    def __init__(self, name: str, mapping: mmap.mmap) -> None:
        self.name = name
        self._mmap: mmap.mmap | None = mapping
        self.buf = memoryview(mapping)

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        """A new zero-filled segment, mode 0600, every page reserved; ``NameTaken`` if
        the name exists, ``NoSpace`` if the file system cannot hold ``size`` bytes or
        has no inode left for the segment's name."""
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR
        try:
            fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        except FileExistsError:
            raise NameTaken(
                f"the shared-memory segment /{name} exists before its consumer made it "
                f"({describe(SHM_DIR / name)}): refused, never reused"
            ) from None
        except OSError as exc:
            full = no_space(exc, f"the shared-memory segment /{name}", SHM_DIR)
            if full is None:
                raise
            raise full from None
        try:
            _reserve(fd, name, size)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            unlink_segment(name)
            raise
        finally:
            os.close(fd)
        return cls(name, mapping)

    @classmethod
    def attach(cls, name: str, size: int) -> Segment | None:
        """The existing segment, once it has ``size`` bytes; ``None`` before;
        ``names.NotPrivate`` if it is not this user's alone."""
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        except FileNotFoundError:
            return None
        try:
            st = check_stat(os.fstat(fd), "/" + name, "segment")
            if st.st_size < size:
                return None  # created, not yet sized: try again
            return cls(name, mmap.mmap(fd, size))
        finally:
            os.close(fd)

    def close(self) -> None:
        """Unmap (once no view of the buffer is left; else when the last one goes)."""
        with contextlib.suppress(BufferError):  # a view of it is still exported
            self.buf.release()
        mapping, self._mmap = self._mmap, None
        if mapping is not None:
            with contextlib.suppress(BufferError):
                mapping.close()


def _reserve(fd: int, name: str, size: int) -> None:
    """Give the segment ``size`` bytes with every page reserved, so that no write to it
    can later find the file system full (a SIGBUS); where ``posix_fallocate`` is
    missing, only its size."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None:
        os.ftruncate(fd, size)
        return
    try:
        fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            raise
        raise NoSpace(
            f"no space for the shared-memory segment /{name}: {size} bytes asked, "
            f"{_free_bytes()} ({exc.strerror})"
        ) from None


def unlink_segment(name: str) -> bool:
    """Remove a segment's name; ``False`` if there was none, or if it is not this user's:
    another user's, made under an edge's name before its consumer (a stranger's squat,
    which the consumer refused: ``NameTaken``), is left to its owner and logged, also
    where this user could remove it (root), so that the rest of a cleanup goes on and
    frees only what this user's processes made. Where the system shows no segment as a
    file (macOS), one this user cannot remove is left alike."""
    try:
        st: os.stat_result | None = os.lstat(SHM_DIR / name)
    except OSError:  # none there, or no folder that shows segments: the unlink says
        st = None
    if st is not None and st.st_uid != os.geteuid():
        log.warning(
            "left the shared-memory segment /%s (%s): not this user's to remove",
            name,
            describe_stat(st),
        )
        return False
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    except PermissionError:
        log.warning(
            "left the shared-memory segment /%s (%s): not this user's to remove",
            name,
            describe(SHM_DIR / name),
        )
        return False
    except OSError as exc:  # a read-only /dev/shm (EROFS): no segment could be made
        if os.path.lexists(SHM_DIR / name):
            log.warning("left the shared-memory segment /%s: %s", name, exc.strerror or exc)
        return False
    return True


# -- wake-ups ----------------------------------------------------------------------------


class FifoSignal:
    """A ``runtime_core.ring.Signal`` between processes over a named FIFO.

    ``fileno()`` is readable while a wake-up is pending, so event loops can wait on
    several signals (and sockets) at once and then ``drain()``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            check_stat(os.fstat(self._fd), path, "FIFO")
        except BaseException:
            os.close(self._fd)
            raise

    def fileno(self) -> int:
        return self._fd

    def notify(self) -> None:
        try:
            os.write(self._fd, b"!")
        except BlockingIOError:  # full: a wake-up is pending anyway
            return  # (not contextlib.suppress: this runs at every hop)

    def drain(self) -> None:
        try:
            while len(os.read(self._fd, 4096)) == 4096:  # a short read emptied it
                pass
        except BlockingIOError:
            return

    def wait(self, timeout_s: float) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.poll(max(0.0, timeout_s) * 1000.0)
        self.drain()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# -- rings -------------------------------------------------------------------------------


class ShmRing(ProcessRing):
    """A ring in a shared-memory segment with FIFO wake-ups."""

    def __init__(
        self, spec: RingSpec, segment: Segment, data: FifoSignal, space: FifoSignal
    ) -> None:
        super().__init__(spec, segment.buf, data, space)
        self.segment = segment
        self.data_signal = data
        self.space_signal = space
        self._consumer = True

    @classmethod
    def create(cls, run_id: str, edge_id: int, spec: RingSpec) -> ShmRing:
        """The consumer's end: make the folder and its FIFOs, then the segment
        (``NameTaken`` if any of them exists, ``NoSpace`` if ``/dev/shm`` is short);
        a failure leaves nothing of them."""
        data_path, space_path = signal_paths(run_id, edge_id)
        make_edge_dir(run_id, edge_id)
        signals: list[FifoSignal] = []
        try:
            for path in (data_path, space_path):
                _make_fifo(path)
                signals.append(FifoSignal(path))
            segment = Segment.create(segment_name(run_id, edge_id), ring_bytes(spec))
        except BaseException:
            for signal in signals:
                signal.close()
            remove_edge_dir(run_id, edge_id)
            raise
        data, space = signals
        return cls(spec, segment, data, space)

    @classmethod
    def attach(cls, run_id: str, edge_id: int, spec: RingSpec) -> ShmRing | None:
        """The producer's end, once the consumer made the ring; ``None`` before;
        ``names.NotPrivate`` for a segment, folder or FIFO its consumer cannot have made."""
        segment = Segment.attach(segment_name(run_id, edge_id), ring_bytes(spec))
        if segment is None:
            return None
        data_path, space_path = signal_paths(run_id, edge_id)
        signals: list[FifoSignal] = []
        try:
            check_private(data_path.parent, "folder")
            for path in (data_path, space_path):
                signals.append(FifoSignal(path))
        except FileNotFoundError:
            for signal in signals:
                signal.close()
            segment.close()
            return None
        except BaseException:
            for signal in signals:
                signal.close()
            segment.close()
            raise
        data, space = signals
        ring = cls(spec, segment, data, space)
        ring._consumer = False
        return ring

    # -- what the event loop waits on ---------------------------------------------------
    def watch(self, want: bool) -> tuple[Entry, ...]:
        if not want:
            return ()
        signal = self.data_signal if self._consumer else self.space_signal
        fd = signal.fileno()
        return ((fd, IN),) if fd >= 0 else ()

    def ready(self, fd: int, events: int) -> None:
        (self.data_signal if self._consumer else self.space_signal).drain()

    def detach(self) -> None:
        """Close this process's hold on the ring (the names stay until removed)."""
        with contextlib.suppress(BufferError):
            self._release_buffer()
        self.segment.close()
        self.data_signal.close()
        self.space_signal.close()


class ShmMedium:
    """Shared memory, for both ends of an edge on one host (x86-64 only)."""

    name = "shm"

    def _check(self) -> None:
        if not shm_supported():
            raise EdgeSetupError(
                f"shared-memory edges need x86-64's store order; this machine is "
                f"{platform.machine()!r}: use --edges tcp"
            )

    def create(self, run_id: str, edge_id: int, spec: RingSpec, key: bytes) -> ShmRing:
        self._check()
        return ShmRing.create(run_id, edge_id, spec)

    def attach(self, run_id: str, edge_id: int, spec: RingSpec, key: bytes) -> ShmRing | None:
        self._check()
        return ShmRing.attach(run_id, edge_id, spec)

    def remove(self, run_id: str, edge_id: int) -> None:
        remove_edge(run_id, edge_id)


def remove_edge(run_id: str, edge_id: int) -> None:
    """Unlink an edge's segment and its folder of FIFOs, whichever of this user's
    processes made them (missing ones are fine; another user's are left, logged)."""
    unlink_segment(segment_name(run_id, edge_id))
    remove_edge_dir(run_id, edge_id)


def remove_run(run_id: str, edge_ids: tuple[int, ...] | list[int]) -> None:
    """Unlink every shared-memory resource of a run's edges."""
    for edge_id in edge_ids:
        remove_edge(run_id, edge_id)
