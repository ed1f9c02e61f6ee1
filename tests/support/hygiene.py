"""What the process-runtime tests check after every run: no process left, no shared
memory, edge folder (FIFOs, rendezvous files) or listening port left (Linux: /dev/shm
and /proc).

A test checks what it made itself, never the host: the processes that carry its tag
(``TAG_VARIABLE``, inherited by every process it starts) and the resources of the runs
it used (``RunLedger``). A run's resources are found from its id alone
(``run_resources``, which follows ``runtime_cupy.process.names``), so a stranger's
resource on the host, whatever its name, is never this test's."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from pathlib import Path

import attrs

from runtime_cupy.edges.live_chains import registry_dir
from runtime_cupy.edges.shm import segment_name
from runtime_cupy.process.names import PREFIX, edge_dir, temp_root

SHM = Path("/dev/shm")
TAG_VARIABLE = "GGUF_PIPELINE_TEST_TAG"


@attrs.define
class RunLedger:
    """The run ids one test used: every ``ProcessRun`` made in the test's process (the
    orchestrator of each run, cold or warm), and those a test learned from a process it
    started (``learn``: a driver's or the CLI's JSON naming its chain). A server process
    logs only its runs' labels (``names.run_label``), never their ids."""

    run_ids: set[str] = attrs.field(factory=set)

    def learn(self, run_ids: Iterable[str]) -> None:
        self.run_ids.update(run_ids)

    def resources(self) -> list[str]:
        """What is left on this host of the runs in the ledger."""
        return sorted({path for run_id in self.run_ids for path in run_resources(run_id)})

    def leftovers(self) -> list[str]:
        """What is left of the ledger's runs and held by no process but this one."""
        return [path for path in self.resources() if not users(path)]


#: The ledger of the test running now (``conftest.no_leftovers`` sets it).
current_ledger = RunLedger()


def learn_chain_ids(chain_ids: Iterable[str]) -> None:
    """Count the chains that a process this test started orchestrated as the test's own:
    their ids (``chain_id`` in the command line's ``--json``), which name their links'
    resources; a run's id names none of a chain's."""
    current_ledger.learn(chain_ids)


def _state(stat: Path) -> str:
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: any of its threads does (a zombie waiting for its parent
    counts as gone). A killed process's first thread is a zombie before the others
    have ended, and only once they all have can its parent reap it; so every thread
    counts, not the first alone."""
    try:  # reaped while this looks: gone (a glob of the folder raised on that)
        tasks = [Path(f"/proc/{pid}/task/{t}/stat") for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tasks = []
    stats = tasks or [Path(f"/proc/{pid}/stat")]
    return any(_state(stat) not in ("Z", "X") for stat in stats)


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until none of ``pids`` runs; those still running after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


#: Edge ids a plan of up to 62 stages numbers its edges with (the planner's 1..N+1), and
#: the hops of a chain of as many (0..N).
PLAN_EDGE_IDS = range(64)


def run_resources(run_id: str, edge_ids: Iterable[int] = PLAN_EDGE_IDS) -> list[str]:
    """What is left of one run or chain (``run_id``: a run's id, or a chain's, which
    names its links): each edge's or hop's segment and folder, by name."""
    assert run_id, "no run or chain id to look for"
    left = []
    for edge_id in edge_ids:
        segment, folder = SHM / segment_name(run_id, edge_id), edge_dir(run_id, edge_id)
        left += [str(p) for p in (segment, folder) if p.exists() or p.is_symlink()]
    return left


def tagged_processes(tag: str) -> list[int]:
    """Live processes started with ``TAG_VARIABLE=tag`` in their environment, but this
    one."""
    needle = f"{TAG_VARIABLE}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0") and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def held_links(pids: Iterable[int]) -> set[str]:
    """The names of links that ``pids`` map (segments in /dev/shm) or hold open (a
    segment, an edge folder or a file in it, a chain's entry in the registry of live
    chains), unlinked ones by their names. Not the registry's folder: every chain of
    this user on this host has its entry there, and a process opens the folder for a
    moment as it takes its chain's entry, so it is no chain's own and stays while any
    other chain lives."""
    shared = str(registry_dir())
    ours = (f"{SHM}/{PREFIX}", f"{temp_root()}/{PREFIX}")
    found: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                name = line.split(maxsplit=5)[-1].removesuffix(" (deleted)")
                if name.startswith(ours):
                    found.add(name)
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd).removesuffix(" (deleted)")
                    if target.startswith(ours) and target != shared:
                        found.add(target)
    return found


def users(path: str) -> list[int]:
    """Live processes but this one that map ``path`` (a shared-memory segment) or hold
    it, or a file in it (a FIFO folder), open."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if path.startswith(str(SHM)) and path in (entry / "maps").read_text():
                found.append(int(entry.name))
                continue
            for fd in (entry / "fd").iterdir():
                target = os.readlink(fd)
                if target == path or target.startswith(path + "/"):
                    found.append(int(entry.name))
                    break
        except OSError:  # gone, or not ours to read
            continue
    return [pid for pid in found if alive(pid)]


def _listening() -> dict[str, int]:
    """Socket inode -> local port of every TCP socket of the host in the LISTEN state."""
    found: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A":  # TCP_LISTEN
                found[fields[9]] = int(fields[1].rsplit(":", 1)[1], 16)
    return found


def _listening_inodes() -> set[str]:
    return set(_listening())


def listening_ports(pid: int) -> list[int]:
    """The local ports of the listening TCP sockets process ``pid`` holds open."""
    listening = _listening()
    return sorted(listening[s[8:-1]] for s in listening_sockets(pid) if s[8:-1] in listening)


def listening_sockets(pid: int) -> list[str]:
    """The listening TCP sockets process ``pid`` holds open (``socket:[inode]``)."""
    listening = _listening_inodes()
    held = []
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in listening:
                held.append(target)
    except OSError:
        return []
    return sorted(held)
