"""Run ids, and the names of a run's resources on one host, derived from
``(run_id, edge_id)`` alone (EDGES_AND_WORKERS.md §3), so that whoever tears a run down
finds and frees all of them, also what a killed process made.

Unguessable. A run id the runtime makes carries 128 random bits (``new_run_id``), and
travels only inside the stages' authenticated control frames and the launcher's
process: a stage's command line shows the run's *label* (``run_label``, a hash of its
id), never the id itself. Each resource of an edge is named by a *tag* of its own
(``edge_tag``): 24 base-32 digits (120 bits) of a SHA-256 of ``(run_id, edge_id)``
under a label per resource (its folder, its ring's segment). So a stranger on the
host cannot name a resource of a run before the run makes it (to squat the name, or to
plant a folder or an address of its own there), and the names of one edge (which a
stranger can list in ``/dev/shm`` and ``/tmp`` once they exist, and watch being made)
say nothing about another's, nor one resource's name about the next one its consumer
makes: a folder named as its segment told a stranger watching ``/tmp`` the segment's
name before the consumer made it, in time to take it first. 120 bits: a stranger's
guess hits with probability 2^-120, and two honest edges of all the runs a host will
ever hold collide with a probability far below that of a hardware fault; and ``/gpp-``
with 24 digits stays two bytes under the 31 bytes that macOS allows a shared-memory
name. Lower-case base 32, because a file system may fold case (macOS's ``/tmp``).

Exclusive. Each edge's files live in its own folder, ``<tmp>/gpp-<folder tag>/``
(``<tmp>``: ``temp_root``, the same in every process of a chain), made by the edge's consumer
(``make_edge_dir``: ``mkdir`` with mode 0700, never reusing a folder that exists), so
a name that is taken is a setup fault naming it (``NameTaken``), and
the other end trusts a folder, FIFO or file of the edge only when it is what its
consumer made: of its type (never a symbolic link), this user's, and closed to
everyone else (``check_private``, else ``NotPrivate``). A file system with no room for
one of them (no byte, no inode, the quota spent) is a setup fault naming it and what is
left there (``NoSpace``, ``no_space``).
"""

from __future__ import annotations

import base64
import errno
import hashlib
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from runtime_core.own_files import describe, describe_stat
from runtime_cupy.edges.port import EdgeSetupError

log = logging.getLogger("runtime_cupy.process.names")

#: The prefix of every shared-memory segment and edge folder of this runtime.
PREFIX = "gpp-"
#: Random bytes in a run id the runtime makes.
RUN_ID_BYTES = 16
#: Base-32 digits of an edge's tag (5 bits each).
TAG_DIGITS = 24
#: The resources of an edge named by a tag, each under a label of its own.
_TAG_LABELS = {
    "folder": b"gguf-pipeline/resource-name/1\x00",
    "segment": b"gguf-pipeline/segment-name/1\x00",
}
_RUN_LABEL = b"gguf-pipeline/run-label/1\x00"


class NameTaken(FileExistsError):
    """A resource of an edge exists before its consumer made it (a stranger's squat, or a
    collision): a setup fault naming it and what holds it."""


class NotPrivate(PermissionError):
    """A resource of an edge that its consumer cannot have made (another owner, a mode
    open to others, a link, another type): never used."""


class NoSpace(EdgeSetupError):
    """A file system with no room for a resource of an edge (its folder, a ring's
    segment, its FIFOs, its address file): a setup fault naming it and the room left."""


def _room_left(folder: Path) -> str:
    """The inodes and bytes free in ``folder``'s file system, for a ``NoSpace``."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return "free space unknown"
    return f"{st.f_favail} inodes and {st.f_bavail * st.f_frsize} bytes free in {folder}"


def no_space(exc: OSError, what: str, folder: Path) -> NoSpace | None:
    """``NoSpace`` naming ``what`` and the room left in ``folder`` where ``exc`` says
    its file system is full (``ENOSPC``, ``EDQUOT``: a bare ``OSError`` names neither);
    ``None`` for any other error."""
    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    return NoSpace(f"no room for {what}: {_room_left(folder)} ({exc.strerror})")


def new_run_id(kind: str = "run") -> str:
    """``<kind>-`` and 128 random bits in hex: a run id no stranger can guess."""
    return f"{kind}-{secrets.token_hex(RUN_ID_BYTES)}"


def run_label(run_id: str) -> str:
    """What a command line or a log shows of a run: 12 hex digits of a labelled hash of
    its id (the id itself would name its resources)."""
    return hashlib.sha256(_RUN_LABEL + run_id.encode("utf-8")).hexdigest()[:12]


def edge_tag(run_id: str, edge_id: int, resource: str) -> str:
    """The 24 base-32 digits that name ``resource`` (``folder``, ``segment``) of edge
    ``edge_id`` of run ``run_id`` on a host: one tag says nothing of another's."""
    label = _TAG_LABELS[resource]
    data = label + run_id.encode("utf-8") + b"\x00" + str(edge_id).encode("ascii")
    digest = hashlib.sha256(data).digest()
    return base64.b32encode(digest).decode("ascii").lower()[:TAG_DIGITS]


def temp_root() -> Path:
    """Where the edges' folders live on this host: the first of ``$TMPDIR``, ``$TEMP``,
    ``$TMP`` that is set, else ``/tmp``, as every process of a chain names it (they share
    the environment and the working folder: one that is relative is made absolute
    against it, as ``tempfile`` does, so that every name of an edge is absolute, as the
    registry of live chains lists them). Not ``tempfile.gettempdir()``: it tries a file
    there once per process and, if that fails (the folder full, missing or not
    writable), moves on to another, so two processes of one chain could look for an
    edge in two places, and its producer wait out the readiness bound for a ring made
    elsewhere. A folder that cannot hold an edge's is a setup fault naming it
    (``OSError``) instead."""
    for name in ("TMPDIR", "TEMP", "TMP"):
        value = os.environ.get(name)
        if value:
            return Path(os.path.abspath(value))
    return Path("/tmp")


def edge_dir(run_id: str, edge_id: int) -> Path:
    """The folder of an edge's files on this host (FIFOs, the rendezvous address)."""
    return temp_root() / f"{PREFIX}{edge_tag(run_id, edge_id, 'folder')}"


def make_edge_dir(run_id: str, edge_id: int) -> Path:
    """Make the edge's folder, mode 0700; ``NameTaken`` if anything is there already,
    ``NoSpace`` if its file system has no room for it."""
    folder = edge_dir(run_id, edge_id)
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        raise NameTaken(
            f"the folder {folder} of edge {edge_id} exists before its consumer made it "
            f"({describe(folder)}): refused, never reused"
        ) from None
    except OSError as exc:
        full = no_space(exc, f"the folder {folder} of edge {edge_id}", folder.parent)
        if full is not None:
            raise full from None
        raise
    return folder


def check_private(path: Path | str, kind: str) -> os.stat_result:
    """``lstat(path)`` if it is a ``kind`` (``folder``, ``FIFO``, ``file``) of this
    user, closed to group and others; ``NotPrivate`` naming it if not,
    ``FileNotFoundError`` if nothing is there."""
    st = os.lstat(path)
    return check_stat(st, path, kind)


#: What each kind of resource must be. A shared-memory segment is a regular file where
#: the system shows one (Linux's tmpfs); elsewhere anything but a link.
def _not_a_link(mode: int) -> bool:
    return not stat.S_ISLNK(mode)


_KIND_TESTS: dict[str, Callable[[int], bool]] = {
    "folder": stat.S_ISDIR,
    "FIFO": stat.S_ISFIFO,
    "file": stat.S_ISREG,
    "segment": _not_a_link,
}


def check_stat(st: os.stat_result, path: Path | str, kind: str) -> os.stat_result:
    """``st`` (of ``path``) if it describes a private ``kind`` of this user (see
    ``check_private``); ``NotPrivate`` if not."""
    mode = stat.S_IMODE(st.st_mode)
    if not _KIND_TESTS[kind](st.st_mode) or st.st_uid != os.geteuid() or mode & 0o077:
        raise NotPrivate(
            f"{path} is {describe_stat(st)}, not a private {kind} of this user "
            f"(uid {os.geteuid()}): refused"
        )
    return st


def remove_edge_dir(run_id: str, edge_id: int) -> None:
    """Remove the edge's folder and what is in it, if it is this user's (missing is fine;
    a symbolic link in its place is left alone). Another user's, made under the edge's
    name before its consumer (a stranger's squat, which the consumer refused:
    ``NameTaken``), is left to its owner and logged, also where this user could remove
    it (root): a cleanup frees only what this user's processes made."""
    remove_own_folder(edge_dir(run_id, edge_id), f"edge {edge_id}")


def remove_own_folder(folder: Path, what: str) -> None:
    """Remove ``folder`` (the folder of ``what``, for the log) and what is in it, as
    ``remove_edge_dir`` says: only if it is this user's and no symbolic link."""
    try:
        st = os.lstat(folder)
    except OSError:  # none there; or no folder could be made there (TMPDIR a file, or
        return  # not searchable: ENOTDIR, EACCES), so none was: the cleanup goes on
    if st.st_uid != os.geteuid():
        log.warning(
            "left the folder %s of %s (%s): not this user's to remove",
            folder,
            what,
            describe_stat(st),
        )
        return
    if stat.S_ISLNK(st.st_mode):
        return
    shutil.rmtree(folder, ignore_errors=True)
