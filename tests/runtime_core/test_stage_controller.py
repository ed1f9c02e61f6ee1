"""The stage controller drives the stage machine with a worker, a control channel and
two edge ends. A fake worker (arithmetic on the payload) keeps this about wiring."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from runplan import GgufSource, ProvisionStage, WorkerCapabilities, provision_all
from runplan.fsm import stage as fsm
from runplan.messages import FaultKind, StageFault, StageReady, StageStopped, StopReason, StopRun
from runplan.plan import OBJECT_HEADER_BYTES, ObjectKind
from runplan.record_header import HeaderDType, ObjectHeader
from runtime_core.edge_ends import ReceiveEnd, SendEnd
from runtime_core.in_process_edges import LocalEdges
from runtime_core.ring import Ring
from runtime_core.stage_controller import StageController
from runtime_core.workers.interface import TokenOutput, WorkerError
from tests.support.strategies import ORCHESTRATOR, small_plan


class FakeWorker:
    """Adds ``stage_index + 1`` to every activation; the first stage embeds ids as
    ``id`` in every column; the last stage's token is its last row's value mod 7."""

    capabilities: ClassVar[WorkerCapabilities] = WorkerCapabilities()

    def __init__(self, fail_at: int | None = None, fail_bind: bool = False) -> None:
        self.fail_at = fail_at
        self.fail_bind = fail_bind
        self.provision: ProvisionStage | None = None
        self.bound = False
        self.released = 0
        self.steps: list[int] = []

    def configure(self, provision: ProvisionStage) -> None:
        self.provision = provision

    def bind(self, gguf_source: GgufSource, progress: Any = None) -> None:
        if self.fail_bind:
            raise WorkerError("no such tensor")
        self.bound = True

    def execute_step(self, sequence: int, data: Any) -> Any:
        assert self.provision is not None and self.bound
        self.steps.append(sequence)
        if sequence == self.fail_at:
            raise WorkerError("out of memory")
        p = self.provision
        hidden = p.model.hidden_dim
        if p.is_first:
            x = np.repeat(np.asarray(data, np.float32)[:, None], hidden, axis=1)
        else:
            x = np.asarray(data, np.float32)
        x = x + (p.stage_index + 1)
        if p.is_last:
            return TokenOutput(
                int(x[-1, 0]) % 7, x[-1].astype(np.float32) if p.return_logits else None
            )
        return x.astype(np.float32)

    def release(self) -> None:
        self.released += 1


class Rings(LocalEdges):
    """The in-process transport, with the rings of one run by edge id."""

    token_out: ReceiveEnd

    def by_edge(self, edge_id: int) -> Ring:
        (ring,) = [r for (_, e), r in self.rings.items() if e == edge_id]
        return ring


class Recorder:
    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.timers: set[fsm.Timer] = set()

    def send(self, message: Any) -> None:
        self.sent.append(message)

    def start(self, timer: fsm.Timer, ms: int) -> None:
        self.timers.add(timer)

    def cancel(self, timer: fsm.Timer) -> None:
        self.timers.discard(timer)


def _controllers(
    plan: Any, rings: Rings, workers: list[FakeWorker]
) -> list[tuple[StageController, Recorder]]:
    out = []
    for provision, worker in zip(provision_all(plan), workers, strict=True):
        rec = Recorder()
        c = StageController(provision.node_id, ORCHESTRATOR, worker, rings, rec, rec)
        c.handle(fsm.Received(ORCHESTRATOR, provision))
        out.append((c, rec))
    return out


def _setup(controllers: list[tuple[StageController, Recorder]], rings: Rings, plan: Any) -> None:
    rings.token_out = rings.open_token_out(plan)  # the orchestrator's end
    for c, _ in controllers:
        c.run_setup()
    for c, _ in reversed(controllers):  # consumers' rings exist by now
        assert c.try_attach_outbound()


def _inject(rings: Rings, plan: Any, sequence: int, ids: list[int]) -> None:
    edge = plan.token_in
    SendEnd(rings.by_edge(edge.edge_id), plan.run_id, edge.edge_id, edge.object_spec).send(
        sequence, len(ids), HeaderDType.U32, np.array(ids, "<u4").tobytes(), 1.0
    )


def _pump(controllers: list[tuple[StageController, Recorder]]) -> None:
    for _ in range(10):
        for c, _ in controllers:
            if c.poll_inbound() and c.step_pending:
                c.run_step()


def _token(rings: Rings, plan: Any, sequence: int) -> tuple[int, Any]:
    end = rings.token_out
    record = end.receive(1.0)
    assert record.header.sequence == sequence
    values = np.frombuffer(record.payload, "<u4")
    logits = (
        np.frombuffer(record.payload[4:], "<f4").copy() if record.header.extent_bytes > 4 else None
    )
    token = int(values[0])
    end.release(record)
    return token, logits


def test_a_three_stage_pipeline_runs_prefill_and_decode() -> None:
    plan = small_plan(3, return_logits=True)
    rings = Rings()
    workers = [FakeWorker() for _ in range(3)]
    controllers = _controllers(plan, rings, workers)
    _setup(controllers, rings, plan)
    for i, (c, rec) in enumerate(controllers):
        assert c.state is fsm.State.READY
        assert rec.sent == [StageReady(plan.run_id, i, plan.stages[i].node_id)]
        assert fsm.Timer.SETUP not in rec.timers
    _inject(rings, plan, 0, [1, 2, 3])
    _pump(controllers)
    token, logits = _token(rings, plan, 0)
    # id 3 (the last row) + 1 + 2 + 3 in each of 8 columns.
    assert token == 9 % 7 and logits is not None and list(logits) == [9.0] * 8
    _inject(rings, plan, 1, [token])
    _pump(controllers)
    assert _token(rings, plan, 1)[0] == (2 + 6) % 7
    assert [w.steps for w in workers] == [[0, 1]] * 3
    for c, _ in controllers:  # every slot released after its step
        assert c.inbound is not None and c.inbound.ring.holding == 0


def test_a_failed_step_is_reported_and_the_slot_released() -> None:
    plan = small_plan(2)
    rings = Rings()
    controllers = _controllers(plan, rings, [FakeWorker(), FakeWorker(fail_at=0)])
    _setup(controllers, rings, plan)
    _inject(rings, plan, 0, [5])
    _pump(controllers)
    c, rec = controllers[1]
    assert c.state is fsm.State.FAULTED
    fault = rec.sent[-1]
    assert isinstance(fault, StageFault) and fault.reason.kind is FaultKind.STEP_FAILURE
    assert "out of memory" in fault.reason.detail
    assert c.inbound is not None and c.inbound.ring.holding == 0


def test_a_bind_failure_is_a_setup_fault() -> None:
    plan = small_plan(1)
    rings = Rings()
    ((c, rec),) = _controllers(plan, rings, [FakeWorker(fail_bind=True)])
    c.run_setup()
    assert c.state is fsm.State.FAULTED
    assert rec.sent[-1].reason.kind is FaultKind.SETUP_FAILURE
    assert "no such tensor" in rec.sent[-1].reason.detail


def test_a_bad_record_is_an_edge_fault() -> None:
    plan = small_plan(1)
    rings = Rings()
    ((c, rec),) = _controllers(plan, rings, [FakeWorker()])
    _setup([(c, rec)], rings, plan)
    ring = rings.by_edge(plan.token_in.edge_id)
    slot = ring.try_reserve()
    assert slot is not None
    bad = ObjectHeader(
        plan.run_id, plan.token_in.edge_id, 0, ObjectKind.ACTIVATION, HeaderDType.F32, 1, 4
    )  # an activation on a token edge
    ring.slot(slot)[:OBJECT_HEADER_BYTES] = bad.pack()
    ring.publish(slot)
    assert c.poll_inbound()
    assert c.state is fsm.State.FAULTED
    assert rec.sent[-1].reason.kind is FaultKind.EDGE_FAULT


def test_a_record_of_another_run_is_discarded_without_a_fault() -> None:
    plan = small_plan(1)
    rings = Rings()
    ((c, rec),) = _controllers(plan, rings, [FakeWorker()])
    _setup([(c, rec)], rings, plan)
    edge = plan.token_in
    SendEnd(rings.by_edge(edge.edge_id), "run-9", edge.edge_id, edge.object_spec).send(
        0, 1, HeaderDType.U32, np.array([1], "<u4").tobytes(), 1.0
    )
    assert c.poll_inbound()
    assert c.state is fsm.State.READY and c.inbound is not None and c.inbound.ring.holding == 0
    assert not c.step_pending


def test_stop_run_releases_everything_and_reports_stopped() -> None:
    plan = small_plan(2)
    rings = Rings()
    workers = [FakeWorker(), FakeWorker()]
    controllers = _controllers(plan, rings, workers)
    _setup(controllers, rings, plan)
    for i, (c, rec) in enumerate(controllers):
        c.handle(fsm.Received(ORCHESTRATOR, StopRun(plan.run_id, StopReason.COMPLETED)))
        assert c.release_pending
        c.run_release()
        assert c.state is fsm.State.STOPPED and workers[i].released == 1
        assert rec.sent[-1] == StageStopped(plan.run_id, i, plan.stages[i].node_id)
    # Each stage closed the ring it made (its inbound edge); the token-out ring is the
    # orchestrator's to close.
    for p in provision_all(plan):
        assert rings.by_edge(p.inbound.edge_id).closed
    assert not rings.by_edge(plan.token_out.edge_id).closed


def test_outbound_waits_for_its_consumer() -> None:
    plan = small_plan(2)
    rings = Rings()
    (first, _), (second, _) = _controllers(plan, rings, [FakeWorker(), FakeWorker()])
    rings.open_token_out(plan)
    first.run_setup()
    assert not first.try_attach_outbound() and first.outbound_pending
    assert first.state is fsm.State.PREPARING
    second.run_setup()
    assert first.try_attach_outbound() and first.state is fsm.State.READY


def test_f16_activations_cross_the_edge() -> None:
    plan = small_plan(2, activation_width=2)
    assert plan.edges[1].object_spec.dtype_width_bytes == 2
    rings = Rings()
    controllers = _controllers(plan, rings, [F16Worker(), F16Worker()])
    _setup(controllers, rings, plan)
    _inject(rings, plan, 0, [2])
    _pump(controllers)
    assert _token(rings, plan, 0)[0] == 5 % 7


class F16Worker(FakeWorker):
    def execute_step(self, sequence: int, data: Any) -> Any:
        out = super().execute_step(sequence, data)
        return out if isinstance(out, TokenOutput) else out.astype(np.float16)


def test_a_faulted_stage_never_publishes_its_pending_output() -> None:
    plan = small_plan(2)
    rings = Rings()
    controllers = _controllers(plan, rings, [FakeWorker(), FakeWorker()])
    _setup(controllers, rings, plan)
    first, _ = controllers[0]
    # Fill stage 1's inbound ring so that stage 0's output has nowhere to go.
    edge = plan.edge(plan.stages[1].inbound_edge)
    filler = SendEnd(rings.by_edge(edge.edge_id), plan.run_id, edge.edge_id, edge.object_spec)
    row = np.zeros((1, plan.model.hidden_dim), np.float32).tobytes()
    for sequence in (0, 1):
        assert filler.try_send(sequence, 1, HeaderDType.F32, row)
    _inject(rings, plan, 0, [4])
    assert first.poll_inbound() and first.step_pending
    first.run_step()
    assert first.output_pending and first.state is fsm.State.EXECUTING
    first.handle(fsm.TimerFired(fsm.Timer.STEP))  # the step ran out of time
    assert first.state is fsm.State.FAULTED and not first.output_pending
    ring = rings.by_edge(edge.edge_id)
    ring.release(ring.wait_acquire(1.0))  # space at last
    assert not first.try_publish_output()
    assert ring.published == 2  # nothing more was published


def test_the_orchestrator_refuses_a_token_of_another_run_and_takes_its_own() -> None:
    from runtime_core.orchestrator_controller import OrchestratorController

    plan = small_plan(1, max_tokens=3)
    rings = Rings()
    rec = Recorder()
    orch = OrchestratorController(plan, (1, 2), _Channels(), rings, rec)
    orch.start()
    rings.open_inbound(provision_all(plan)[0])  # stage 0's ring exists
    assert orch.try_open_endpoints()
    orch.handle(_ready(plan, 0))
    assert orch.state.name == "RUNNING"
    edge = plan.token_out
    ring = rings.by_edge(edge.edge_id)
    token = np.array([5], "<u4").tobytes()
    SendEnd(ring, "another-run", edge.edge_id, edge.object_spec).send(
        0, 1, HeaderDType.U32, token, 1.0
    )
    assert orch.poll_tokens()
    assert orch.state.name == "RUNNING" and orch.machine.consumed == ()
    SendEnd(ring, plan.run_id, edge.edge_id, edge.object_spec).send(
        0, 1, HeaderDType.U32, token, 1.0
    )
    assert orch.poll_tokens()
    assert orch.machine.consumed == (5,)


class _Channels:
    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []

    def send(self, node_id: str, message: Any) -> None:
        self.sent.append((node_id, message))


def _ready(plan: Any, index: int) -> Any:
    from runplan.fsm import orchestrator as ofsm

    node = plan.stages[index].node_id
    return ofsm.Received(node, StageReady(plan.run_id, index, node))


def test_a_stage_that_does_not_trace_its_steps_still_traces_rejections() -> None:
    provision = provision_all(small_plan(1, max_tokens=3))[0]
    traced: list[str] = []
    rec = Recorder()
    c = StageController(
        provision.node_id,
        ORCHESTRATOR,
        FakeWorker(),
        Rings(),
        rec,
        rec,
        trace=lambda kind, _fields: traced.append(kind),
        trace_steps=False,
    )
    c.handle(fsm.Received(ORCHESTRATOR, provision))  # a state change: untraced
    c.handle(fsm.Received("intruder", provision))
    assert c.state is fsm.State.PREPARING
    assert traced == ["reject"]
