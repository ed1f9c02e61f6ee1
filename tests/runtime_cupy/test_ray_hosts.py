"""Stages on three real hosts: each its own network and mount namespace (a private
``/dev/shm`` and ``/tmp``), joined by a bridge, with a Ray head in the first and a Ray
worker in each other (``tests/support/netns_hosts.py``); the orchestrator is a driver
on the head's host (``ray_driver.py``). Three stages on three hosts give the tokens of
``runtime_sim`` (NumPy worker); then each cross-host fault ends the run cleanly: a stage
process SIGKILLed, the network to a host cut mid-decode (no FIN), the orchestrator
killed, a whole host lost. Hosts that cannot see the GGUF file (an empty file system
mounted over its folder) get their slices from the orchestrator's host, byte-exact, and
start from their cache the next time; a cache on a full disk is a named fault. After
each: no stage process, shared-memory segment, run folder or listening port of the run
on any host.
Root only (skipped with the reason elsewhere)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import runtime_sim
from runplan.cpus import usable_cpus
from runplan.gguf_header import GgufHeader
from runplan.shards import SliceParts, slice_tensor_names
from runtime_cupy.edges.shm import segment_name
from runtime_cupy.process.names import edge_dir, run_label
from runtime_cupy.process.streams import SILENT_PEER_S
from tests.support.netns_hosts import ROOT, TestHosts, hosts_up, shared_model
from tests.support.ray_checks import (
    STAGE_ENTRY,
    cmdline,
    run_processes,
    supervisors,
    wait_until,
)

#: Ray hosts in network namespaces, real stage processes (make fast leaves these out).
pytestmark = [pytest.mark.ray, pytest.mark.netns, pytest.mark.process]

pytest.importorskip("ray", reason="the Ray host needs Ray (the test extra has it)")

DRIVER = Path(__file__).parents[1] / "support" / "ray_driver.py"
STOP_S, EDGE_S = 5.0, 20.0  # ray_driver.TIMEOUTS
#: A loaded 2-core machine's slack on top of every bound below.
SLACK_S = 30.0
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestHosts]:
    with hosts_up(3, tmp_path_factory.mktemp("ray-hosts"), ray=True) as h:
        yield h


@pytest.fixture(scope="module")
def model(tiny: str) -> Iterator[str]:
    with shared_model(tiny) as path:
        yield path


class Driver:
    """A run on the hosts, driven from the head's host."""

    def __init__(self, hosts: TestHosts, model: str, *extra: str) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
        env.pop("GGUF_PIPELINE_TEST_TAG", None)
        args = [str(DRIVER), "--address", hosts.head_address, "--model", model, *extra]
        self.proc = subprocess.Popen(
            hosts.driver(args), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def _next(self, timeout_s: float) -> dict[str, Any]:
        while True:
            try:
                line = self.lines.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(f"the driver said nothing in {timeout_s} s") from None
            if line is None:
                raise AssertionError("the driver ended early:\n" + "".join(self.stderr[-40:]))
            with contextlib.suppress(ValueError):
                doc: dict[str, Any] = json.loads(line)
                return doc

    def paused(self) -> dict[str, Any]:
        doc = self._next(240)
        assert "paused" in doc, doc
        return dict(doc["paused"])

    def resume(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def result(self) -> dict[str, Any]:
        doc = self._next(240)
        assert "outcome" in doc, doc
        self.proc.wait(60)
        return doc

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


def _pids(paused: dict[str, Any]) -> dict[int, int]:
    return {int(k): int(v) for k, v in paused["pids"].items()}


def _listeners_of_ours(hosts: TestHosts, i: int) -> list[str]:
    """Listening TCP sockets in host ``i``'s network namespace held by a stage process
    or a driver (Ray's own are Ray's)."""
    table = hosts.on_host(i, "cat /proc/net/tcp /proc/net/tcp6 2>/dev/null")
    inodes = {f[9] for f in (line.split() for line in table.splitlines()[1:])
              if len(f) > 9 and f[3] == "0A"}  # fmt: skip
    ours = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        line = cmdline(int(entry.name))
        if STAGE_ENTRY not in line and "ray_driver.py" not in line:
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    ours.append(f"{line.split()[0]} (pid {entry.name}) listens")
    return ours


def _left_on(hosts: TestHosts, i: int, run_id: str) -> list[str]:
    """What of the run's chain (``run_id``: the chain's id) is left on host ``i``: its
    links' segments and folders, by name (a chain of three stages has hops 0 to 3)."""
    names = [f"/dev/shm/{segment_name(run_id, e)} {edge_dir(run_id, e)}" for e in range(0, 4)]
    out = hosts.on_host(i, f"ls -d {' '.join(names)} 2>/dev/null").split()
    mine = set(hosts.pids(i))
    out += [f"stage process {p}" for p in run_processes(run_id) if p in mine]
    return out + _listeners_of_ours(hosts, i)


def _assert_nothing_left(hosts: TestHosts, run_id: str, on: tuple[int, ...] = (1, 2, 3)) -> None:
    for i in on:
        left = wait_until(lambda i=i: _left_on(hosts, i, run_id), 20)  # type: ignore[misc]
        assert left == [], f"left on host {i}: {left}"
    # No stage supervisor either (the runs of this module are over): Ray ended them.
    assert wait_until(lambda: _supervisors(hosts), 60) == []


def _supervisors(hosts: TestHosts) -> list[int]:
    """The stage supervisors on the test's hosts."""
    return supervisors(p for i in range(1, hosts.count + 1) for p in hosts.pids(i))


def _ensure_three_hosts(hosts: TestHosts, tmp_path: Path) -> None:
    """A host whose Ray node went (Ray declared it dead after a cut) starts anew."""
    for i in (2, 3):
        if hosts.anchors[i].poll() is not None:
            hosts.lose(i)
            hosts.start_ray(i, tmp_path)
            hosts.wait_started(i)


def _threads_of(pid: int) -> str | None:
    """The ``OMP_NUM_THREADS`` a process started with."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    env = dict(item.decode().split("=", 1) for item in raw if b"=" in item)
    return env.get("OMP_NUM_THREADS")


def test_three_stages_on_three_hosts_give_the_simulators_tokens(
    hosts: TestHosts, model: str
) -> None:
    driver = Driver(hosts, model, "--max-tokens", "8", "--pause-at", "2")
    pids = _pids(driver.paused())
    # Each stage, alone on its host, takes that host's CPUs. They ran one thread each:
    # Ray sets OMP_NUM_THREADS=1 in an actor that asks for no CPU, and the stage kept
    # it (and the launcher split a host's CPUs between the chain's stages on every host).
    assert os.environ.get("OMP_NUM_THREADS") is None  # the hosts' own environment sets none
    assert [_threads_of(pids[i]) for i in range(3)] == [str(usable_cpus())] * 3
    driver.resume()
    doc = driver.result()
    expected = runtime_sim.generate(model, PROMPT, stages=3, max_tokens=8)  # NumPy worker
    assert doc["outcome"] == "completed", doc
    assert doc["tokens"] == list(expected.tokens)
    assert [s["host"] for s in doc["stages"]] == [hosts.address(i) for i in (1, 2, 3)]
    assert [s["node_id"] for s in doc["stages"]] == [f"{hosts.address(i)}/cpu0" for i in (1, 2, 3)]
    # The orchestrator shares the head's host with stage 0: shared memory; TCP elsewhere.
    assert doc["media"] == ["shm", "tcp", "tcp", "tcp"]
    assert all(s["returncode"] == 0 for s in doc["stages"])
    _assert_nothing_left(hosts, doc["chain_id"])


def _hidden(
    hosts: TestHosts, folder: Path, on: tuple[int, ...]
) -> contextlib.AbstractContextManager[None]:
    """The model's folder looks empty on hosts ``on``: an empty file system mounted over
    it in their mount namespaces (the file is really not there for their processes)."""

    @contextlib.contextmanager
    def hidden() -> Iterator[None]:
        for i in on:
            hosts.on_host(i, f"mount -t tmpfs -o size=64k tmpfs {folder}")
            assert hosts.on_host(i, f"ls {folder}").split() == [], f"host {i} sees the model"
        try:
            yield
        finally:
            for i in on:
                hosts.on_host(i, f"umount {folder}")

    return hidden()


def _transfers(hosts: TestHosts, i: int) -> list[dict[str, Any]]:
    """What host ``i``'s stages wrote of their slices (``<cache>/transfers.jsonl``)."""
    cache = os.environ["GGUF_PIPELINE_CACHE"]  # tests/conftest.py: each host's own /tmp
    text = hosts.on_host(i, f"cat {cache}/transfers.jsonl 2>/dev/null")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _slice_bytes(model: str, layers: list[int], index: int, count: int) -> int:
    header = GgufHeader.read(model)
    parts = SliceParts(layers[0], layers[1], index == 0, index == count - 1)
    return sum(header.tensors[n].n_bytes for n in slice_tensor_names(header.tensors, parts))


def test_hosts_without_the_model_file_get_their_slices_then_start_from_their_cache(
    hosts: TestHosts, model: str
) -> None:
    # The tokens of a run where every host has the file are runtime_sim's (the first test).
    expected = list(runtime_sim.generate(model, PROMPT, stages=3, max_tokens=8).tokens)
    with _hidden(hosts, Path(model).parent, on=(2, 3)):
        doc = Driver(hosts, model, "--max-tokens", "8").result()
        assert doc["outcome"] == "completed", doc
        assert doc["tokens"] == expected
        # Stage 0 shares the orchestrator's host; stages 1 and 2 received their slices.
        slices = {t["stage_index"]: t for t in doc["slices"]}
        assert sorted(slices) == [1, 2]
        for i, t in slices.items():
            expected_bytes = _slice_bytes(model, doc["layers"][i], i, 3)
            assert t["state"] == "done" and t["host"] == hosts.address(i + 1), t
            assert t["tensor_bytes"] == expected_bytes
            assert t["sent_bytes"] == t["header_bytes"] + expected_bytes
            # Measured on the receiving host: what it read off its socket (its stage's
            # supervisor fetched the slice while the stage started; the stage's bind
            # then found it in the cache).
            lines = _transfers(hosts, i + 1)
            assert [x["outcome"] for x in lines[-2:]] == ["received", "cache"], lines
            line = lines[-2]
            assert line["host"] == hosts.address(i + 1)
            assert line["tensor_bytes_received"] == expected_bytes
            assert line["header_bytes"] == t["header_bytes"]
            assert line["socket_bytes"] == t["received_bytes"]
            assert 0 < line["socket_bytes"] - t["sent_bytes"] < 1024  # handshake, frames
        # The next run transfers nothing: every stage starts from its host's cache.
        again = Driver(hosts, model, "--max-tokens", "8").result()
        assert again["outcome"] == "completed" and again["tokens"] == expected, again
        assert again["slices"] == []
        for i in (2, 3):
            line = _transfers(hosts, i)[-1]
            assert (line["outcome"], line["socket_bytes"]) == ("cache", 0), line
    _assert_nothing_left(hosts, doc["chain_id"])


def test_with_encrypted_edges_the_hosts_get_their_slices_encrypted(
    hosts: TestHosts, model: str
) -> None:
    # The launch's encrypt_edges reaches both ends of each slice's transfer (the Ray
    # host's slice server, the supervisor's prefetch): they agree, or the run faults.
    cache = os.environ["GGUF_PIPELINE_CACHE"]
    for i in (2, 3):
        hosts.on_host(i, f"rm -rf {cache}/slices")
    before = {i: len(_transfers(hosts, i)) for i in (2, 3)}
    expected = list(runtime_sim.generate(model, PROMPT, stages=3, max_tokens=4).tokens)
    with _hidden(hosts, Path(model).parent, on=(2, 3)):
        doc = Driver(hosts, model, "--max-tokens", "4", "--encrypt-edges").result()
    assert doc["outcome"] == "completed", doc
    assert doc["tokens"] == expected
    slices = {t["stage_index"]: t for t in doc["slices"]}
    assert sorted(slices) == [1, 2]
    for i, t in slices.items():
        assert t["state"] == "done" and t["host"] == hosts.address(i + 1), t
        # The supervisor's prefetch received it (asked for encrypted, agreed in the
        # handshake: no failed fetch before it), the stage's bind found it in the cache.
        lines = _transfers(hosts, i + 1)[before[i + 1] :]
        assert [x["outcome"] for x in lines] == ["received", "cache"], lines
        assert all(x["encrypted"] is True for x in lines), lines
        assert lines[0]["tensor_bytes_received"] == t["tensor_bytes"]
    _assert_nothing_left(hosts, doc["chain_id"])


def test_a_full_cache_disk_on_a_host_is_a_named_fault_and_the_run_after_succeeds(
    hosts: TestHosts, model: str
) -> None:
    cache = os.environ["GGUF_PIPELINE_CACHE"]
    # The last of 3 stages of an even split holds the last blocks and the head.
    blocks = GgufHeader.read(model).integer("llama.block_count")
    last = [blocks - blocks // 3, blocks]
    size = _slice_bytes(model, last, 2, 3) // 2  # the header fits, not every tensor
    # mode 0700: a tmpfs is 1777 by default, a cache open to all, refused
    hosts.on_host(3, f"mkdir -p {cache} && mount -t tmpfs -o size={size},mode=0700 tmpfs {cache}")
    try:
        with _hidden(hosts, Path(model).parent, on=(3,)):
            doc = Driver(hosts, model, "--max-tokens", "2").result()
        assert doc["outcome"] == "faulted" and doc["fault_stage"] == 2, doc
        assert doc["layers"][2] == last
        fault = doc["fault"]
        assert f"stage 2 (node {hosts.address(3)}/cpu0, host {hosts.address(3)})" in fault
        assert f"to host {hosts.address(3)}" in fault, fault
        # found before a tensor travels: the cache's folder, the bytes needed and free
        assert f"the slice's tensors need {_slice_bytes(model, last, 2, 3)} bytes" in fault, fault
        assert f"on the disk of the cache {cache}, " in fault and " are free" in fault, fault
        assert "no cache entry was made" in fault, fault
        left = hosts.on_host(3, f"find {cache}/slices {cache}/tmp -mindepth 1 2>/dev/null")
        assert left.split() == [], left  # no entry, nothing half-written
    finally:
        hosts.on_host(3, f"umount {cache}")
    with _hidden(hosts, Path(model).parent, on=(3,)):
        after = Driver(hosts, model, "--max-tokens", "2").result()
    assert after["outcome"] == "completed", after
    assert after["tokens"] == list(
        runtime_sim.generate(model, PROMPT, stages=3, max_tokens=2).tokens
    )
    _assert_nothing_left(hosts, doc["chain_id"])


def test_a_remote_stage_process_killed_mid_decode(hosts: TestHosts, model: str) -> None:
    driver = Driver(hosts, model, "--max-tokens", "40", "--pause-at", "2")
    pids = _pids(driver.paused())
    assert pids[1] in hosts.pids(2)  # stage 1's process lives on host 2
    os.kill(pids[1], signal.SIGKILL)
    driver.resume()
    doc = driver.result()
    assert doc["outcome"] == "faulted" and doc["fault_stage"] == 1, doc
    assert f"stage 1 (node {hosts.address(2)}/cpu0, host {hosts.address(2)})" in doc["fault"]
    assert "killed by SIGKILL" in doc["fault"], doc["fault"]
    codes = [s["returncode"] for s in doc["stages"]]
    assert codes == [0, -signal.SIGKILL, 0], codes  # the others stopped on StopRun
    assert doc["ended_s"] - doc["resumed_s"] < STOP_S + EDGE_S + SILENT_PEER_S + SLACK_S
    _assert_nothing_left(hosts, doc["chain_id"])


def test_the_network_to_a_host_cut_mid_decode(hosts: TestHosts, model: str, tmp_path: Path) -> None:
    driver = Driver(hosts, model, "--max-tokens", "40", "--pause-at", "2")
    pids = _pids(driver.paused())
    # Each host has its stage's supervisor (so that the checks for none below can fail).
    for i in (1, 2, 3):
        assert supervisors(hosts.pids(i)), f"no supervisor seen on host {i}"
    hosts.cut(3)
    try:
        driver.resume()
        doc = driver.result()
        assert doc["outcome"] == "faulted", doc
        # The first to notice names itself: the cut host's stage (its channel went
        # silent) or its neighbour (its edge to it did); either way, its host.
        stage = doc["fault_stage"]
        assert stage in (1, 2), doc
        assert f"host {hosts.address(stage + 1)}" in doc["fault"], doc["fault"]
        bound = STOP_S + EDGE_S + SILENT_PEER_S
        assert doc["ended_s"] - doc["resumed_s"] < bound + SLACK_S, doc
        codes = [s["returncode"] for s in doc["stages"]]
        assert codes[:2] == [0, 0], codes  # the reachable stages stopped on StopRun
        # The cut host's stage stops on its own, cut off, within the bound; so does its
        # supervisor.
        assert wait_until(lambda: pids[2] in hosts.pids(3), bound + SLACK_S) is False
        assert wait_until(lambda: supervisors(hosts.pids(3)), 20) == []
    finally:
        hosts.mend(3)
    # Nothing resumes when the link comes back.
    assert wait_until(lambda: run_processes(doc["chain_id"]), 10) == []
    assert wait_until(lambda: _supervisors(hosts), 60) == []
    _assert_nothing_left(hosts, doc["chain_id"])
    _ensure_three_hosts(hosts, tmp_path)


def test_the_orchestrator_killed_mid_decode(hosts: TestHosts, model: str, tmp_path: Path) -> None:
    _ensure_three_hosts(hosts, tmp_path)
    driver = Driver(hosts, model, "--max-tokens", "40", "--pause-at", "2")
    paused = driver.paused()
    run_id = str(paused["chain_id"])  # never on a command line: each shows its label
    labels = {cmdline(pid).split("--run-label ")[1].split()[0] for pid in _pids(paused).values()}
    assert labels == {run_label(run_id)}
    driver.kill()
    # Every stage stops on its own (its control connection closed), on every host.
    gone = wait_until(lambda: run_processes(run_id), STOP_S + SILENT_PEER_S + SLACK_S)
    assert gone == [], gone
    _assert_nothing_left(hosts, run_id)


def test_a_whole_host_lost_mid_decode(hosts: TestHosts, model: str, tmp_path: Path) -> None:
    _ensure_three_hosts(hosts, tmp_path)
    driver = Driver(hosts, model, "--max-tokens", "40", "--pause-at", "2")
    driver.paused()
    hosts.lose(2)  # every process of host 2: its Ray node, the supervisor, the stage
    driver.resume()
    doc = driver.result()
    assert doc["outcome"] == "faulted", doc
    stage = doc["fault_stage"]
    assert stage in (0, 1, 2), doc
    assert f"host {hosts.address(stage + 1)}" in doc["fault"], doc["fault"]
    if stage == 1:
        assert hosts.address(2) in doc["fault"]
    assert doc["ended_s"] - doc["resumed_s"] < STOP_S + EDGE_S + SILENT_PEER_S + SLACK_S
    codes = {s["stage_index"]: s["returncode"] for s in doc["stages"]}
    assert codes[0] == 0 and codes[2] == 0, codes  # the live hosts' stages stopped
    assert hosts.pids(2) == []  # nothing of the lost host runs
    _assert_nothing_left(hosts, doc["chain_id"], on=(1, 3))
