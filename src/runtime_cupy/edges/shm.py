"""Edges between processes on one host (EDGES_AND_WORKERS.md §2-§3): each edge is the
``runtime_core`` ring over a POSIX shared-memory segment, woken through two named FIFOs.

Every resource of an edge is named from ``(run_id, edge_id)`` alone, so whoever tears a
run down finds and frees all of it, also what a killed process created:

    segment   /gpp-<tag>-<edge_id>              the ring: 64-byte control block, then slots
    FIFOs     <tmp>/gpp-<tag>/e<edge_id>.data    wakes the consumer (published, or closed)
              <tmp>/gpp-<tag>/e<edge_id>.space   wakes the producer (released, or closed)

``<tag>`` is the first 12 hex digits of the SHA-256 of the run id: names stay short
(a segment name is at most 31 bytes on macOS) and every resource of one run shares the
prefix ``gpp-<tag>``. The consumer's end creates the FIFOs, then the segment; the
producer's end attaches once the segment exists at its full size.

A wake-up is one byte written to the FIFO (non-blocking; a full FIFO is already a
pending wake-up); a waiter polls the FIFO's descriptor and drains it. Both ends open
both FIFOs read-write, so neither open blocks and neither end sees end-of-file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib
import mmap
import os
import select
import stat
import tempfile
from pathlib import Path
from typing import Any

from runplan import ProvisionStage, RunPlan
from runplan.header import HeaderCheck
from runplan.plan import RingSpec
from runtime_core.edges import ReceiveEnd, SendEnd
from runtime_core.ring import Ring, ring_bytes

# CPython's binding of shm_open / shm_unlink (what multiprocessing.shared_memory uses).
# Used directly so that no process starts multiprocessing's resource tracker, which
# would unlink segments behind our back when an attaching process exits.
_posixshmem: Any = importlib.import_module("_posixshmem")

#: The prefix of every shared-memory segment and run folder of this runtime.
PREFIX = "gpp-"
#: The longest shared-memory name (leading slash included) that macOS accepts.
MAX_SEGMENT_NAME = 31


def run_tag(run_id: str) -> str:
    """12 hex digits that stand for ``run_id`` in resource names."""
    return hashlib.sha256(run_id.encode("utf-8")).hexdigest()[:12]


def segment_name(run_id: str, edge_id: int) -> str:
    """The shared-memory name of an edge's ring (without the leading slash)."""
    name = f"{PREFIX}{run_tag(run_id)}-{edge_id}"
    if len(name) + 1 > MAX_SEGMENT_NAME:
        raise ValueError(f"edge id {edge_id} makes the segment name {name!r} too long")
    return name


def run_dir(run_id: str) -> Path:
    """The folder that holds a run's FIFOs."""
    return Path(tempfile.gettempdir()) / f"{PREFIX}{run_tag(run_id)}"


def signal_paths(run_id: str, edge_id: int) -> tuple[Path, Path]:
    """The ``data`` and ``space`` FIFOs of an edge."""
    folder = run_dir(run_id)
    return folder / f"e{edge_id}.data", folder / f"e{edge_id}.space"


# -- shared memory ---------------------------------------------------------------------


class Segment:
    """One mapped POSIX shared-memory segment."""

    def __init__(self, name: str, mapping: mmap.mmap) -> None:
        self.name = name
        self._mmap: mmap.mmap | None = mapping
        self.buf = memoryview(mapping)

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        """A new zero-filled segment; ``FileExistsError`` if the name is taken."""
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR
        fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            unlink_segment(name)
            raise
        finally:
            os.close(fd)
        return cls(name, mapping)

    @classmethod
    def attach(cls, name: str, size: int) -> Segment | None:
        """The existing segment, once it has ``size`` bytes; ``None`` before."""
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        except FileNotFoundError:
            return None
        try:
            if os.fstat(fd).st_size < size:
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


def unlink_segment(name: str) -> bool:
    """Remove a segment's name; ``False`` if there was none."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True


# -- wake-ups ----------------------------------------------------------------------------


class FifoSignal:
    """A ``runtime_core.ring.Signal`` between processes over a named FIFO.

    ``fileno()`` is readable while a wake-up is pending, so event loops can wait on
    several signals (and sockets) at once and then ``drain()``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        if not stat.S_ISFIFO(os.fstat(self._fd).st_mode):
            os.close(self._fd)
            raise OSError(errno.EINVAL, f"{path} is not a FIFO")

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


class Watch:
    """A poll object over a wake-up pipe's read end and a set of descriptors (``-1``
    for none), made anew only when the set changes: a run's steps wait on the same
    set, and building and registering a poll object per wait is a cost per hop."""

    def __init__(self, wake_fd: int) -> None:
        self._wake_fd = wake_fd
        self._watched: tuple[int, ...] | None = None
        self._poller = select.poll()

    def poll(self, fds: tuple[int, ...], timeout_ms: float) -> list[tuple[int, int]]:
        """``poll(2)`` on the wake-up pipe and ``fds`` (readable), for ``timeout_ms``."""
        if fds != self._watched:
            self._watched = fds
            self._poller = select.poll()
            for fd in (self._wake_fd, *fds):
                if fd >= 0:
                    self._poller.register(fd, select.POLLIN)
        return self._poller.poll(timeout_ms)


def _make_fifo(path: Path) -> None:
    path.parent.mkdir(mode=0o700, exist_ok=True)
    os.mkfifo(path, 0o600)


# -- rings -------------------------------------------------------------------------------


class ShmRing(Ring):
    """A ring in a shared-memory segment with FIFO wake-ups."""

    def __init__(
        self, spec: RingSpec, segment: Segment, data: FifoSignal, space: FifoSignal
    ) -> None:
        super().__init__(spec, segment.buf, data, space)
        self.segment = segment
        self.data_signal = data
        self.space_signal = space

    @classmethod
    def create(cls, run_id: str, edge_id: int, spec: RingSpec) -> ShmRing:
        """The consumer's end: make the FIFOs, then the segment (``FileExistsError``
        if this edge of this run already has its consumer)."""
        data_path, space_path = signal_paths(run_id, edge_id)
        _make_fifo(data_path)
        _make_fifo(space_path)
        data, space = FifoSignal(data_path), FifoSignal(space_path)
        try:
            segment = Segment.create(segment_name(run_id, edge_id), ring_bytes(spec))
        except BaseException:
            data.close()
            space.close()
            raise
        return cls(spec, segment, data, space)

    @classmethod
    def attach(cls, run_id: str, edge_id: int, spec: RingSpec) -> ShmRing | None:
        """The producer's end, once the consumer made the ring; ``None`` before."""
        segment = Segment.attach(segment_name(run_id, edge_id), ring_bytes(spec))
        if segment is None:
            return None
        data_path, space_path = signal_paths(run_id, edge_id)
        try:
            data = FifoSignal(data_path)
        except FileNotFoundError:
            segment.close()
            return None
        try:
            space = FifoSignal(space_path)
        except FileNotFoundError:
            data.close()
            segment.close()
            return None
        return cls(spec, segment, data, space)

    def detach(self) -> None:
        """Close this process's hold on the ring (the names stay until removed)."""
        with contextlib.suppress(BufferError):
            self._release_buffer()
        self.segment.close()
        self.data_signal.close()
        self.space_signal.close()


def remove_edge(run_id: str, edge_id: int) -> None:
    """Unlink an edge's segment and FIFOs, whoever made them (missing ones are fine)."""
    unlink_segment(segment_name(run_id, edge_id))
    for path in signal_paths(run_id, edge_id):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def remove_run(run_id: str, edge_ids: tuple[int, ...] | list[int]) -> None:
    """Unlink every resource of a run's edges and its folder, if empty."""
    for edge_id in edge_ids:
        remove_edge(run_id, edge_id)
    remove_run_dir(run_id)


def remove_run_dir(run_id: str) -> None:
    """Remove the run's folder if it is empty (another process may still own FIFOs in
    it; whoever removes the last one removes the folder)."""
    with contextlib.suppress(FileNotFoundError, OSError):
        run_dir(run_id).rmdir()


# -- the transport ------------------------------------------------------------------------


class ProcessEdges:
    """The ``Transport`` of a stage process and the ``OrchestratorTransport`` of the
    launcher: receive ends make their ring, send ends attach to their consumer's."""

    def __init__(self) -> None:
        self.rings: dict[int, ShmRing] = {}

    def _create(self, run_id: str, edge_id: int, spec: RingSpec) -> ShmRing:
        ring = self.rings[edge_id] = ShmRing.create(run_id, edge_id, spec)
        return ring

    def _attach(self, run_id: str, edge_id: int, spec: RingSpec) -> ShmRing | None:
        ring = ShmRing.attach(run_id, edge_id, spec)
        if ring is not None:
            self.rings[edge_id] = ring
        return ring

    # -- stages ----------------------------------------------------------------------
    def open_inbound(self, provision: ProvisionStage) -> ReceiveEnd:
        edge = provision.inbound
        ring = self._create(provision.run_id, edge.edge_id, edge.ring_spec)
        check = HeaderCheck.for_edge(
            provision.run_id, edge.edge_id, edge.object_spec, provision.model.hidden_dim
        )
        return ReceiveEnd(ring, check)

    def open_outbound(self, provision: ProvisionStage) -> SendEnd | None:
        edge = provision.outbound
        ring = self._attach(provision.run_id, edge.edge_id, edge.ring_spec)
        if ring is None:
            return None
        return SendEnd(ring, provision.run_id, edge.edge_id, edge.object_spec)

    # -- the orchestrator ------------------------------------------------------------------
    def open_token_out(self, plan: RunPlan) -> ReceiveEnd:
        edge = plan.token_out
        ring = self._create(plan.run_id, edge.edge_id, edge.ring_spec)
        check = HeaderCheck.for_edge(
            plan.run_id, edge.edge_id, edge.object_spec, plan.model.hidden_dim
        )
        return ReceiveEnd(ring, check)

    def open_token_in(self, plan: RunPlan) -> SendEnd | None:
        edge = plan.token_in
        ring = self._attach(plan.run_id, edge.edge_id, edge.ring_spec)
        if ring is None:
            return None
        return SendEnd(ring, plan.run_id, edge.edge_id, edge.object_spec)

    def ring(self, edge_id: int) -> ShmRing | None:
        return self.rings.get(edge_id)

    def close(self) -> None:
        """Detach every ring this process opened."""
        for ring in self.rings.values():
            ring.detach()
        self.rings.clear()
