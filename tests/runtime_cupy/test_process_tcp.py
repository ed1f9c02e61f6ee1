"""Stage processes on one host with every edge forced onto TCP (``edges="tcp"``): the
simulator's tokens (NumPy worker, same prompt, seed and stage count), strangers on a
stage's port refused while the run completes, nothing left behind (the conftest checks
processes, segments, run folders and listening ports after every test; the kill tests
run over TCP too, in test_kill_stages.py, test_kill_orchestrator.py and
test_process_faults.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import runtime_sim
from runplan import RunPlan, SamplingConfig
from runplan.config import Timeouts
from runplan.messages import StopReason
from runplan.plan import ObjectKind
from runplan.record_header import HeaderDType, ObjectHeader
from runtime_cupy import generate
from runtime_cupy.api import plan_for
from runtime_cupy.edges import handshake as hs
from runtime_cupy.edges.tcp import FRAME, RECORD, split_address
from runtime_cupy.hosts.local import FileRendezvous
from runtime_cupy.process.keys import edge_key, new_secret
from runtime_cupy.process.launcher import ProcessRun
from tests.runtime_cupy.test_process_cli import _env
from tests.support.hosts import FaultyHost
from tests.support.hygiene import alive, learn_chain_ids, run_resources

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process


def test_tcp_edges_give_the_simulators_tokens(tiny: str) -> None:
    prompt = [5, 17, 42, 9]
    kwargs = {"stages": 3, "max_tokens": 8, "temperature": 0.9, "top_k": 20, "seed": 4}
    sim = runtime_sim.generate(tiny, prompt, **kwargs)  # type: ignore[arg-type]
    real = generate(tiny, prompt, edges="tcp", **kwargs)  # type: ignore[arg-type]
    assert real.outcome == sim.outcome == "completed"
    assert real.tokens == sim.tokens and len(real.tokens) == 8
    assert real.media == ("tcp",) * 4  # token-in, two activation edges, token-out
    assert all(s.returncode == 0 for s in real.stages)
    assert not [s.pid for s in real.stages if alive(s.pid)]
    assert run_resources(real.chain_id) == []


def test_the_cli_takes_edges_tcp(tiny: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "runtime_cupy", "--model", tiny, "--stages", "2",
         "--prompt-ids", "7,8,9", "--max-tokens", "4", "--edges", "tcp", "--json"],
        capture_output=True, text=True, check=False, env=_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    learn_chain_ids([doc["chain_id"]])
    assert doc["tokens"] == list(
        runtime_sim.generate(tiny, [7, 8, 9], stages=2, max_tokens=4).tokens
    )
    assert [e["medium"] for e in doc["edges"]] == ["tcp", "tcp", "tcp"]
    assert [e["kind"] for e in doc["edges"]] == ["token_in", "activation", "token_out"]


class Strangers:
    """Connects to edge ``edge_id``'s port as soon as its consumer publishes it, and
    plays what a stranger would: garbage, a wrong secret, the producer of another edge,
    a record without a handshake, and half a handshake left open."""

    def __init__(self, run_id: str, edge_id: int, secret: bytes) -> None:
        self.run_id, self.edge_id, self.secret = run_id, edge_id, secret
        self.socks: list[socket.socket] = []
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self._play()
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.done.set()

    def _connect(self, address: tuple[str, int]) -> socket.socket:
        sock = socket.create_connection(address, timeout=10)
        self.socks.append(sock)
        return sock

    def _play(self) -> None:
        rendezvous = FileRendezvous()
        deadline = time.monotonic() + 30
        found = None
        while found is None:
            assert time.monotonic() < deadline, "the consumer never published its port"
            found = rendezvous.lookup(self.run_id, self.edge_id)
            time.sleep(0.005)
        address = split_address(found)
        self._connect(address).sendall(b"\x16\x03\x01 not our protocol at all\n")
        key = edge_key(new_secret(), self.run_id, self.edge_id)
        self._connect(address).sendall(hs.hello(key, self.edge_id, 1, hs.new_nonce()))
        key = edge_key(self.secret, self.run_id, self.edge_id + 1)
        self._connect(address).sendall(hs.hello(key, self.edge_id + 1, 1, hs.new_nonce()))
        header = ObjectHeader(
            self.run_id, self.edge_id + 1, 0, ObjectKind.TOKEN, HeaderDType.U32, 1, 4
        )
        self._connect(address).sendall(FRAME.pack(RECORD, 132) + header.pack() + bytes(4))
        self._connect(address).sendall(hs.HELLO_MAGIC)  # half a handshake, then silence

    def close(self) -> None:
        self.thread.join(30)
        for sock in self.socks:
            sock.close()


def test_strangers_on_a_stages_port_are_refused_and_the_run_completes(
    tiny: str, tmp_path: Path
) -> None:
    prompt = [3, 1, 4, 1]
    timeouts = Timeouts(ready_ms=30_000, step_ms=20_000, edge_wait_ms=20_000, stop_ms=5_000)

    def plan_() -> RunPlan:
        plan, _ = plan_for(
            tiny, stages=2, prompt_len=len(prompt), max_tokens=5, sampling=SamplingConfig(),
            return_logits=False, timeouts=timeouts,
        )  # fmt: skip
        return plan

    clean = ProcessRun(plan_(), prompt, edges="tcp").run()
    # Stage 0 takes 2 s to set up: stage 1 listens for it meanwhile, and strangers come.
    plan = plan_()
    host = FaultyHost({0: ["setup-delay=2"]}, log_dir=tmp_path)
    run = ProcessRun(plan, prompt, edges="tcp", host=host)
    edge = 1  # stage 1's inbound link: hop 1 of the chain
    strangers = Strangers(run.chain_id, edge, run.secret)
    try:
        result = run.run()
    finally:
        strangers.close()
    assert strangers.error is None, strangers.error
    assert result.finished is not None and result.finished.outcome is StopReason.COMPLETED
    assert result.tokens == clean.tokens and len(result.tokens) == 5
    assert all(s.returncode == 0 for s in result.stages)
    log = (tmp_path / "stage-1.log").read_text()
    refusals = [line for line in log.splitlines() if "refused a connection" in line]
    assert len(refusals) == 5, log
    reasons = "\n".join(refusals)
    assert reasons.count("not a producer's handshake of this protocol") == 2
    assert "wrong key: the peer does not hold this run's secret" in reasons
    assert f"a producer of edge {edge + 1} (this is edge {edge})" in reasons
    assert "the edge has its producer, or is closed" in reasons  # the half handshake
    assert "producer 127.0.0.1" in log  # and the real producer got in
    assert run_resources(result.chain_id) == []
