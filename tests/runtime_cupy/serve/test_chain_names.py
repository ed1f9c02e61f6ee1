"""The names of a warm chain's runs, against a stranger on the host.

The stranger reads every stage process's command line (``ps`` shows them to everyone),
guesses the ids of the next runs from what it sees (the chain's id and a counter after
it: ``X``, ``X-r1``, ``X-r2``, ...), and takes every name those runs would use before
they do, by this runtime's naming and by the naming before it (a 12-digit SHA-256
prefix per run): zero-byte files at their shared-memory segments, or open folders
where their edges' files go, whose address files it then points at a relay of its own.
Nothing of it touches a run: run ids are 128 random bits, no command line shows one, and
every request completes with the tokens of a run nobody attacked.

The chain's links are named from its id, derived from its secret (``keys.chain_id``):
a collision that still happens (forced here through the chain's ``secrets`` port) is
one setup fault naming the resource and what holds it; the chain does not start, and
the next one (a new secret, new names) goes on.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest

from runtime_cupy import generate
from runtime_cupy.edges.shm import segment_name
from runtime_cupy.edges.tcp import split_address
from runtime_cupy.process.keys import chain_id, new_secret
from runtime_cupy.process.names import edge_dir
from runtime_cupy.serve.chain import ChainError, WarmChain
from tests.support.edge_relay import Relay
from tests.support.hosts import FaultyHost
from tests.support.hygiene import SHM
from tests.support.ray_checks import cmdline

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process

PROMPT = [5, 77, 30, 12, 9]
NOBODY = 65534
#: How many runs ahead the stranger guesses, and the edges of each (2 stages: 1 to 3).
GUESSES, EDGES = 20, (1, 2, 3)


def _flags(pid: int) -> list[str]:
    words = cmdline(pid).split()
    return [words[i + 1] for i, w in enumerate(words[:-1]) if w in ("--run-id", "--run-label")]


class Stranger:
    """Takes the names of the runs it can guess from the stages' command lines; with
    ``relay``, points every address file that appears in its folders at a relay that
    changes a record (``change@1``)."""

    def __init__(self, pids: tuple[int, ...], what: str) -> None:
        self.what = what
        self.made: list[Path] = []
        self.held: list[int] = []  # its squats held open: in use, no test session's to clear
        self.relays: list[Relay] = []
        self.pointed: list[Path] = []
        seen = {x for pid in pids for x in _flags(pid)}
        self.guesses = sorted(
            {g for x in seen for g in (x, *(f"{x}-r{n}" for n in range(GUESSES)))}
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _names(self, run_id: str) -> tuple[list[str], list[Path]]:
        """Segments and folders of ``run_id``, by both namings."""
        before = hashlib.sha256(run_id.encode()).hexdigest()[:12]
        segments = [f"gpp-{before}-{e}" for e in EDGES] + [segment_name(run_id, e) for e in EDGES]
        folders = [Path(tempfile.gettempdir()) / f"gpp-{before}"]
        folders += [edge_dir(run_id, e) for e in EDGES]
        return segments, folders

    def squat(self) -> None:
        for run_id in self.guesses:
            segments, folders = self._names(run_id)
            if self.what == "shm":
                for name in segments:
                    with contextlib.suppress(FileExistsError):
                        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY
                        self.held.append(os.open(SHM / name, flags, 0o666))
                        self.made.append(SHM / name)
            else:
                for folder in folders:
                    with contextlib.suppress(FileExistsError):
                        folder.mkdir()
                        folder.chmod(0o777)
                        self.held.append(os.open(folder, os.O_RDONLY))
                        self.made.append(folder)
        if self.what == "folders":
            self._thread = threading.Thread(target=self._point, daemon=True)
            self._thread.start()

    def _point(self) -> None:
        """Point every address file that appears in the folders at a relay."""
        while not self._stop.is_set():
            for folder in self.made:
                for path in folder.glob("*addr"):
                    if path in self.pointed:
                        continue
                    with contextlib.suppress(OSError, ValueError):
                        upstream = split_address(path.read_text().strip())
                        relay = Relay(lambda u=upstream: u, "change@1")  # type: ignore[misc]
                        self.relays.append(relay)
                        tmp = folder / ".stranger"
                        tmp.write_text(f"{relay.address[0]}:{relay.address[1]}")
                        os.replace(tmp, path)
                        self.pointed.append(path)
            time.sleep(0.002)

    def leave(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        for relay in self.relays:
            relay.close()
        for fd in self.held:
            os.close(fd)
        for path in self.made:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()


@pytest.fixture(scope="module")
def clean(tiny: str) -> tuple[int, ...]:
    return generate(tiny, PROMPT, stages=2, max_tokens=8).tokens


@pytest.mark.parametrize("what", ["shm", "folders"])
def test_a_stranger_cannot_take_the_names_of_the_next_runs(
    tiny: str, clean: tuple[int, ...], what: str, tmp_path: Path
) -> None:
    # Stage 0 sets up slowly, so that a stranger pointing address files would win the
    # race to its lookup, if it could name the file.
    edges, host = ("auto", None) if what == "shm" else ("tcp", FaultyHost({0: ["setup-delay=1"]}))
    with WarmChain(tiny, stages=2, edges=edges, host=host, context=64) as chain:
        stranger = Stranger(chain.pids(), what)
        assert stranger.guesses, "the stranger saw nothing to guess from"
        stranger.squat()
        try:
            for _ in range(2):
                run = chain.generate(PROMPT, max_tokens=8)
                assert run.result.outcome == "completed", run.result.fault
                assert run.result.tokens == clean
                assert run.restarted == ()
        finally:
            stranger.leave()
        assert chain.restarts == 0
    assert stranger.pointed == [] and not any(r.connections for r in stranger.relays)


def _another_users(path: Path, *, folder: bool) -> int:
    """A segment or edge folder of another user at ``path``, held open (in use: another
    test session on the host leaves it alone); the descriptor."""
    if folder:
        path.mkdir(mode=0o777)
        path.chmod(0o777)
        (path / "addr").write_text("127.0.0.1:9")  # an address of its own, planted
        (path / "addr").chmod(0o666)
        fd = os.open(path, os.O_RDONLY)
    else:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    os.chown(path, NOBODY, NOBODY)
    return fd


@pytest.mark.parametrize("edges", ["shm", "tcp"])
def test_a_link_name_taken_anyway_is_one_named_fault_and_the_next_chain_goes_on(
    tiny: str, clean: tuple[int, ...], edges: str
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root, to make a resource of another user (chown)")
    taken = new_secret()
    secrets = iter([taken, new_secret()])  # the first chain's names are taken, not the next's
    name = chain_id(taken)
    squat = SHM / segment_name(name, 1) if edges == "shm" else edge_dir(name, 1)
    held = _another_users(squat, folder=edges == "tcp")
    try:
        chain = WarmChain(tiny, stages=2, edges=edges, secrets=secrets.__next__, context=64)
        try:
            with pytest.raises(ChainError) as refused:
                chain.start()
            fault = str(refused.value)
            assert "setup_failure" in fault and str(squat).removeprefix(str(SHM)) in fault
            assert f"uid {NOBODY}" in fault, fault
            chain.start()  # a new chain: a new secret, new names
            ok = chain.generate(PROMPT, max_tokens=8)
            assert ok.result.outcome == "completed", ok.result.fault
            assert ok.result.tokens == clean
        finally:
            chain.close()
    finally:
        os.close(held)
        if squat.is_dir():
            shutil.rmtree(squat, ignore_errors=True)
        else:
            squat.unlink(missing_ok=True)
