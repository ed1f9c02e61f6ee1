"""Attacks on a whole run's TCP edges, on loopback, as a stranger would play them:

- a relay in the middle of the token-in edge that holds no key (``DetourHost``: the
  orchestrator is told the relay's address) changes the prompt's record, or reorders
  the consumer's credits: the run faults naming the edge and the frame that failed,
  and no token computed from a tampered record reaches the caller (replayed and
  injected records: ``test_tcp_attacks.py``, and between hosts ``test_netns_attacks.py``);
- with ``encrypt_edges`` an honest relay passes the run through unchanged and reads
  nothing of its records (without it, it reads them, but changes none unseen);
- strangers flood the port of a stage's consumer while its producer is still setting
  up (idle connections, garbage, half handshakes, by the hundred): the run completes.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from runplan import RunPlan, SamplingConfig
from runplan.config import Timeouts
from runtime_cupy.api import plan_for
from runtime_cupy.process.launcher import ProcessRun
from tests.runtime_cupy.test_process_cli import _env
from tests.support.edge_peers import made
from tests.support.hosts import DetourHost, FaultyHost
from tests.support.hygiene import listening_ports, run_resources

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process

PROMPT = [3, 1, 4, 1, 5]
TIMEOUTS = Timeouts(ready_ms=30_000, step_ms=20_000, edge_wait_ms=20_000, stop_ms=5_000)


def _plan(tiny: str, max_tokens: int = 6) -> RunPlan:
    plan, _ = plan_for(
        tiny, stages=2, prompt_len=len(PROMPT), max_tokens=max_tokens,
        sampling=SamplingConfig(), return_logits=False, timeouts=TIMEOUTS,
    )  # fmt: skip
    return plan


@pytest.fixture(scope="module")
def clean_tokens(tiny: str) -> tuple[int, ...]:
    result = ProcessRun(_plan(tiny), PROMPT, edges="tcp").run()
    assert result.finished is not None and result.finished.fault is None
    return result.tokens


@pytest.mark.parametrize(
    ("attack", "fault"),
    [
        ("change@0", "(hop {edge}): frame 0 from the producer failed authentication"),
        ("reorder-credits@0", "(hop {edge}) closed: frame 0 from the consumer failed auth"),
    ],
)
def test_a_relay_in_the_middle_of_an_edge_changes_nothing_unseen(
    tiny: str, clean_tokens: tuple[int, ...], attack: str, fault: str
) -> None:
    plan = _plan(tiny)
    edge = 0  # token-in: hop 0 of the chain
    host = DetourHost(edge, attack)
    try:
        result = ProcessRun(plan, PROMPT, edges="tcp", host=host).run()
    finally:
        host.close()
    assert host.relay is not None and host.relay.done, "the relay never got to its attack"
    finished = result.finished
    assert finished is not None and finished.fault is not None, result.tokens
    assert fault.format(edge=edge) in str(finished.fault), finished.fault
    # What came out before the tampered record is the clean run's; nothing after it.
    assert result.tokens == clean_tokens[: len(result.tokens)]
    assert run_resources(result.chain_id) == []


def test_an_encrypted_run_shows_a_relay_nothing_and_passes_unchanged(
    tiny: str, clean_tokens: tuple[int, ...]
) -> None:
    seen: dict[bool, bytes] = {}
    for encrypt in (False, True):
        plan = _plan(tiny)
        host = DetourHost(0, "pass")  # token-in: hop 0 of the chain
        try:
            result = ProcessRun(plan, PROMPT, edges="tcp", host=host, encrypt_edges=encrypt).run()
        finally:
            host.close()
        assert result.finished is not None and result.finished.fault is None
        assert result.tokens == clean_tokens
        assert result.encrypted_edges is encrypt
        assert host.relay is not None and len(host.relay.records) == len(clean_tokens)
        seen[encrypt] = b"".join(host.relay.records)
        # The run id is in every record's header: in clear unless encrypted.
        assert (plan.run_id.encode() in seen[encrypt]) is not encrypt


class Flooder:
    """Processes of strangers, started before the run (so that they are up when it
    listens), that flood stage ``index``'s port for ``seconds`` once it listens."""

    def __init__(self, index: int, seconds: float, processes: int = 2) -> None:
        self.index = index
        command = [sys.executable, "-m", "tests.support.edge_peers", "-"]
        command += ["--seconds", str(seconds)]
        self.procs = [
            subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env()
            )
            for _ in range(processes)
        ]
        self.thread: threading.Thread | None = None

    def on_event(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == "spawned" and fields["stage_index"] == self.index:
            self.thread = threading.Thread(target=self._aim, args=(int(fields["pid"]),))
            self.thread.start()

    def _aim(self, pid: int) -> None:
        deadline = time.monotonic() + 60
        ports: list[int] = []
        while not ports and time.monotonic() < deadline:
            ports = listening_ports(pid)
            time.sleep(0.005)
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(f"127.0.0.1:{ports[0] if ports else 9}\n")
            proc.stdin.close()

    def connections(self) -> int:
        if self.thread is not None:
            self.thread.join(60)
        return sum(made(proc) for proc in self.procs)


def test_a_flood_on_a_stages_port_during_setup_does_not_fail_the_run(
    tiny: str, clean_tokens: tuple[int, ...], tmp_path: Path
) -> None:
    """Stage 0 takes 2 s to set up, and answers its consumer's handshake slowly (each
    try to attach 200 ms: a busy host); meanwhile (and after) two processes flood stage
    1's port with strangers: connections begun by the thousand, held by the hundred,
    garbage, half handshakes. Stage 0's connection is never pushed out for them."""
    plan = _plan(tiny)
    flooder = Flooder(index=1, seconds=4.0)
    host = FaultyHost({0: ["setup-delay=2", "attach-delay=0.2"]}, log_dir=tmp_path)
    result = ProcessRun(plan, PROMPT, edges="tcp", host=host, on_event=flooder.on_event).run()
    strangers = flooder.connections()
    finished = result.finished
    assert finished is not None and finished.fault is None, finished
    assert result.tokens == clean_tokens
    # More strangers came than the port keeps, so some were pushed out, never stage 0.
    log = (tmp_path / "stage-1.log").read_text()
    assert strangers > 64 and "pushed out" in log, (strangers, log[-2000:])
    assert "producer 127.0.0.1" in log
    assert run_resources(result.chain_id) == []
