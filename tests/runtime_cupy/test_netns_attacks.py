"""The attacks on TCP edges across test hosts (``tests/support/netns_hosts.py``, three
network and mount namespaces on a bridge, no Ray: ``tests/support/netns_stages.py``):
stage 0 on host 1, stage 1 on host 2, the orchestrator on this machine, a stranger on
host 3 who can write the rendezvous (as anyone who reaches an unauthenticated
key-value store can) and the network.

- A relay of the stranger's on host 3, in the middle of the edge from host 1 to host 2,
  holding no key: a record it changes, replays or injects, or credits it reorders,
  fault the run naming the edge and the frame; nothing of it reaches a step.
- With ``encrypt_edges`` an honest relay there passes the run through unchanged and
  reads nothing of the activations it carries.
- The stranger floods stage 1's port from host 3 while stage 0 cannot find it yet (the
  rendezvous holds the address back 1.5 s), and after, while stage 0 answers its
  handshake slowly (200 ms a try, a busy host): the run completes.

Root only (skipped with the reason elsewhere); the hosts go when the module ends."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from runplan import RunPlan, SamplingConfig
from runplan.config import Timeouts
from runtime_cupy.api import plan_for
from runtime_cupy.process.launcher import ProcessRun
from tests.runtime_cupy.test_process_cli import _env
from tests.support.edge_peers import made
from tests.support.hygiene import run_resources
from tests.support.netns_hosts import ROOT, TestHosts, hosts_up, shared_model
from tests.support.netns_stages import NetnsStageHost

#: Test hosts in network namespaces, real stage processes (make fast leaves these out).
pytestmark = [pytest.mark.netns, pytest.mark.process]

PROMPT = [3, 1, 4, 1, 5]
TIMEOUTS = Timeouts(ready_ms=60_000, step_ms=30_000, edge_wait_ms=30_000, stop_ms=5_000)
#: Stage 0 on host 1, stage 1 on host 2; host 3 is the stranger's.
WHERE = (1, 2)
ACTIVATIONS = 1  # the link from stage 0 to stage 1: hop 1 of the chain


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestHosts]:
    with hosts_up(3, tmp_path_factory.mktemp("netns-attacks")) as h:
        yield h


@pytest.fixture(scope="module")
def model(tiny: str) -> Iterator[str]:
    with shared_model(tiny) as path:
        yield path


def _plan(model: str) -> RunPlan:
    plan, _ = plan_for(
        model, stages=2, prompt_len=len(PROMPT), max_tokens=6, sampling=SamplingConfig(),
        return_logits=False, timeouts=TIMEOUTS,
    )  # fmt: skip
    return plan


def _run(
    hosts: TestHosts,
    model: str,
    *,
    encrypt: bool = False,
    setup: object = None,
    attach_delay: dict[int, float] | None = None,
) -> tuple[RunPlan, object, NetnsStageHost]:
    plan = _plan(model)
    host = NetnsStageHost(hosts, WHERE, attach_delay=attach_delay)
    if callable(setup):
        setup(host)
    try:
        result = ProcessRun(plan, PROMPT, edges="tcp", host=host, encrypt_edges=encrypt).run()
    finally:
        host.close()
    return plan, result, host


class StrangerRelay:
    """A relay on host 3 (``tests.support.edge_relay``), told the consumer's address
    when it is published, and told to producers of ``edge`` in its place."""

    def __init__(self, hosts: TestHosts, attack: str) -> None:
        command = [
            "nsenter", "-t", str(hosts.anchor(3)), "-m", "-n", f"--wd={ROOT}",
            sys.executable, "-m", "tests.support.edge_relay", "--upstream", "-",
            "--attack", attack, "--bind", hosts.address(3),
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env()
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.address = self.proc.stdout.readline().strip()
        assert self.address, "the relay did not start"
        self._told = False
        self._lock = threading.Lock()

    def detour(self, real: str) -> str:
        with self._lock:
            if not self._told:
                assert self.proc.stdin is not None
                self.proc.stdin.write(real + "\n")
                self.proc.stdin.flush()
                self._told = True
        return self.address

    def report(self) -> dict[str, object]:
        out, _ = self.proc.communicate(timeout=30)
        doc: dict[str, object] = json.loads(out.strip().splitlines()[-1])
        return doc


@pytest.fixture(scope="module")
def clean(hosts: TestHosts, model: str) -> tuple[int, ...]:
    _, result, _ = _run(hosts, model)
    finished = result.finished  # type: ignore[attr-defined]
    assert finished is not None and finished.fault is None, finished
    return tuple(result.tokens)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("attack", "fault", "stage"),
    [
        ("change@1", "(hop 1): frame 1 from the producer failed authentication", 1),
        ("replay@2", "(hop 1): frame 2 from the producer failed authentication", 1),
        ("inject@2", "(hop 1): frame 2 from the producer failed authentication", 1),
        ("reorder-credits@0", "(hop 1): frame 0 from the consumer failed auth", 0),
    ],
)
def test_a_strangers_relay_between_two_hosts_changes_nothing_unseen(
    hosts: TestHosts, model: str, clean: tuple[int, ...], attack: str, fault: str, stage: int
) -> None:
    relay = StrangerRelay(hosts, attack)

    def lie(host: NetnsStageHost) -> None:
        host.store.detours[ACTIVATIONS] = relay.detour

    _, result, _ = _run(hosts, model, setup=lie)
    report = relay.report()
    assert report["connections"] == 1 and report["done"], report
    finished = result.finished  # type: ignore[attr-defined]
    assert finished is not None and finished.fault is not None, result
    assert fault in str(finished.fault) and finished.fault_stage == stage, finished
    tokens = tuple(result.tokens)  # type: ignore[attr-defined]
    assert tokens == clean[: len(tokens)]
    assert run_resources(result.chain_id) == []  # type: ignore[attr-defined]


def test_an_encrypted_edge_between_two_hosts_shows_a_relay_nothing(
    hosts: TestHosts, model: str, clean: tuple[int, ...]
) -> None:
    relay = StrangerRelay(hosts, "pass")

    def lie(host: NetnsStageHost) -> None:
        host.store.detours[ACTIVATIONS] = relay.detour

    plan, result, _ = _run(hosts, model, encrypt=True, setup=lie)
    report = relay.report()
    finished = result.finished  # type: ignore[attr-defined]
    assert finished is not None and finished.fault is None, finished
    assert tuple(result.tokens) == clean  # type: ignore[attr-defined]
    records = [bytes.fromhex(r) for r in report["records"]]  # type: ignore[attr-defined]
    assert report["connections"] == 1 and len(records) == len(clean)
    assert not any(plan.run_id.encode() in r for r in records)  # the headers are sealed too


def test_a_flood_from_another_host_does_not_fail_the_run(
    hosts: TestHosts, model: str, clean: tuple[int, ...]
) -> None:
    command = [
        "nsenter", "-t", str(hosts.anchor(3)), "-m", "-n", f"--wd={ROOT}",
        sys.executable, "-m", "tests.support.edge_peers", "-", "--seconds", "3.5",
    ]  # fmt: skip
    floods = [
        subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env()
        )
        for _ in range(2)
    ]
    published: dict[str, float] = {}

    def hold_back(real: str) -> str | None:
        """The address only 1.5 s after it came; the flood from host 3 from the start."""
        if real not in published:
            published[real] = time.monotonic()
            for proc in floods:
                assert proc.stdin is not None
                proc.stdin.write(real + "\n")
                proc.stdin.close()
        return real if time.monotonic() - published[real] > 1.5 else None

    def setup(host: NetnsStageHost) -> None:
        host.store.detours[ACTIVATIONS] = hold_back

    _, result, _ = _run(hosts, model, setup=setup, attach_delay={0: 0.2})
    strangers = sum(made(proc) for proc in floods)
    finished = result.finished  # type: ignore[attr-defined]
    assert finished is not None and finished.fault is None, finished
    assert tuple(result.tokens) == clean  # type: ignore[attr-defined]
    assert strangers > 64, f"only {strangers} strangers came (a consumer keeps 64)"
    assert run_resources(result.chain_id) == []  # type: ignore[attr-defined]
