"""A stage whose orchestrator is lost frees, by name, what its chain left on this host:
every hop, token-out (the orchestrator's ring) among them, also when the orchestrator
went between sending a run's provision and the stage's setup of it. The run's provision then
goes with the run; the chain's length comes from the stage's launch (``--stage-count``),
or from the provision the stage held when it heard of the loss."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from runplan import SamplingConfig
from runplan.provision import provision_stage
from runtime_cupy.api import plan_for
from runtime_cupy.edges import links as links_module
from runtime_cupy.edges.links import ProcessLinks, chain_hops
from runtime_cupy.process.control_channel import ControlChannel
from runtime_cupy.process.keys import chain_id, control_key
from runtime_cupy.process.stage_loop import StageProcess
from runtime_cupy.process.stage_loss import EXIT_LOST
from runtime_cupy.process.stage_process import UnavailableWorker
from runtime_cupy.process.tracing import TraceLog

SECRET = bytes(range(32))
STAGE = "stage-2"
ORCHESTRATOR = "orchestrator"


class NamingMedium:
    """A medium that only records which hops a process frees by name."""

    name = "shm"

    def __init__(self) -> None:
        self.removed: list[int] = []

    def create(self, *args: Any) -> Any:
        raise AssertionError("no ring is made before setup")

    def attach(self, *args: Any) -> Any:
        raise AssertionError("no ring is attached before setup")

    def remove(self, run_id: str, edge_id: int) -> None:
        self.removed.append(edge_id)


@pytest.mark.parametrize("launched_with_count", [True, False], ids=["launch", "provision"])
def test_a_stage_frees_every_hop_when_the_orchestrator_goes_before_setup(
    tiny: str, launched_with_count: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan, _ = plan_for(
        tiny, stages=3, prompt_len=3, max_tokens=4, sampling=SamplingConfig(), return_logits=False
    )
    provision = provision_stage(plan, 2)
    ours, theirs = socket.socketpair()
    key = control_key(SECRET, STAGE)
    orchestrator = ControlChannel(theirs, key, ORCHESTRATOR, STAGE)
    inbound, outbound = NamingMedium(), NamingMedium()
    freed: list[int] = []
    monkeypatch.setattr(links_module, "remove_edge", lambda _chain, hop: freed.append(hop))
    stage = StageProcess(
        stage_index=2,
        stage_count=3 if launched_with_count else None,
        node_id=STAGE,
        orchestrator_id=ORCHESTRATOR,
        channel=ControlChannel(ours, key, STAGE, ORCHESTRATOR),
        links=ProcessLinks(inbound, outbound, SECRET, chain_id(SECRET)),  # type: ignore[arg-type]
        worker=UnavailableWorker("not needed: setup never begins"),
        stop_s=2.0,
        trace=TraceLog(STAGE, enabled=False),
    )
    # The provision, then the orchestrator's end closes: the stage reads both at once.
    orchestrator.send(provision)
    orchestrator.close()  # sends what waits, then closes
    assert stage.run() == EXIT_LOST  # it held the run when it heard
    assert outbound.removed == [plan.stage_count]  # token-out, by the chain's name
    assert inbound.removed == []  # its own inbound ring was never made
    assert freed == list(chain_hops(plan.stage_count))  # what is left of every hop
