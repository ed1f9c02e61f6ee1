"""One orchestrator machine and N stage machines wired through an in-memory harness:
control messages in flight as a bundle (delivered in any order, dropped or
duplicated), setup work, steps and timers completing in any order, processes dying at
any point, forged messages arriving. One ``@invariant`` per guarantee of
PIPELINE_ORCHESTRATION_MVP.md §11, named after it, and a rule per §10 rejection.

The harness plays the runtimes' part faithfully: a stage controller reads its inbound
edge only when its machine is READY, a step writes its output object (same sequence)
before ``StepCompleted``, and rings deliver in publish order without loss.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from runplan import EdgeKind, OrchestratorEndpoint, RunPlan, StageEndpoint
from runplan.fsm import orchestrator as o
from runplan.fsm import stage as s
from runplan.messages import (
    ProvisionStage,
    RewireEdge,
    StageReady,
    StopReason,
    StopRun,
)
from tests.support.strategies import ORCHESTRATOR, STRANGER, small_plan

VOCAB = 6
EOS = 0
# Faults happen on one draw in ten, so that most runs get somewhere before one strikes.
RARE = st.integers(0, 9)


@attrs.frozen
class Envelope:
    """A control message in flight. ``serial`` tells duplicates of one send apart from
    two sends of equal messages."""

    serial: int
    sender: str
    dest: str
    message: Any


@attrs.frozen
class Obj:
    """A record on an edge."""

    edge_id: int
    sequence: int
    rows: int
    run_id: str
    token_id: int | None = None


class Protocol(RuleBasedStateMachine):
    messages = Bundle("messages")

    # -- setup -------------------------------------------------------------------

    @initialize(
        target=messages,
        stage_count=st.integers(1, 4),
        max_tokens=st.integers(1, 5),
        prompt=st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=3),
    )
    def start(self, stage_count: int, max_tokens: int, prompt: list[int]) -> Any:
        self.plan: RunPlan = small_plan(stage_count, max_tokens=max_tokens, vocab=VOCAB, eos=EOS)
        self.prompt = tuple(prompt)
        self.orch = o.OrchestratorMachine.for_plan(self.plan, self.prompt)
        self.orch_alive = True
        self.nodes = [st_.node_id for st_ in self.plan.stages]
        self.stages = {n: s.StageMachine.new(n, ORCHESTRATOR) for n in self.nodes}
        self.alive = set(self.nodes)
        self.serial = 0
        self.in_flight: dict[int, Envelope] = {}  # what the bundle holds, for teardown
        # Work the runtimes owe the machines, by node ("orch" for the orchestrator).
        self.setup_pending: dict[str, set[s.SetupPart]] = {n: set() for n in self.nodes}
        self.step_pending: dict[str, int | None] = dict.fromkeys(self.nodes)
        self.release_pending: set[str] = set()
        self.endpoints_pending = False
        self.death_notices: list[int] = []
        self.lost_notices: set[str] = set()
        self.stage_timers: dict[str, set[s.Timer]] = {n: set() for n in self.nodes}
        self.orch_timers: set[o.Timer] = set()
        self.edges: dict[int, deque[Obj]] = {e.edge_id: deque() for e in self.plan.edges}
        # The trace the invariants read.
        self.setup_seen: dict[str, set[s.SetupPart]] = {n: set() for n in self.nodes}
        self.ready_reported: dict[str, set[s.SetupPart] | None] = dict.fromkeys(self.nodes)
        self.ready_received: set[int] = set()
        self.injected: list[tuple[int, int, frozenset[int], tuple[int, ...]]] = []
        self.consumed: list[int] = []
        self.loaded: dict[str, list[int]] = {n: [] for n in self.nodes}
        self.executed: dict[str, list[tuple[int, int]]] = {n: [] for n in self.nodes}
        self.step_inputs: dict[str, list[int | None]] = {n: [] for n in self.nodes}
        self.written: list[tuple[str, Obj]] = []
        self.outcomes: list[StopReason] = []
        self.finished: list[o.RunFinished] = []
        self.stop_sent: set[int] = set()
        self.provision_sent: set[int] = set()  # stages the harness saw provisioned
        self.inject_after_outcome = False
        return multiple(*self._orch_step(o.Start()))

    # -- carrying out actions --------------------------------------------------------

    def _envelope(self, sender: str, dest: str, message: Any) -> Envelope:
        self.serial += 1
        env = Envelope(self.serial, sender, dest, message)
        self.in_flight[env.serial] = env
        return env

    def _orch_step(self, event: Any) -> list[Envelope]:
        if not self.orch_alive:
            return []
        before = self.orch.outcome
        self.orch, actions = o.step(self.orch, event)
        if before is None and self.orch.outcome is not None:
            self.outcomes.append(self.orch.outcome)
        out: list[Envelope] = []
        for a in actions:
            if isinstance(a, o.SendProvision):
                self.provision_sent.add(a.stage_index)
                out.append(self._envelope(ORCHESTRATOR, a.node_id, a.message))
            elif isinstance(a, o.SendStopRun):
                self.stop_sent.add(a.stage_index)
                out.append(self._envelope(ORCHESTRATOR, a.node_id, a.message))
            elif isinstance(a, o.OpenTokenEndpoints):
                self.endpoints_pending = True
            elif isinstance(a, o.InjectTokens):
                if self.outcomes:
                    self.inject_after_outcome = True
                self.injected.append(
                    (
                        a.sequence,
                        len(a.token_ids),
                        frozenset(self.ready_received),
                        tuple(self.consumed),
                    )
                )
                token_in = self.plan.token_in.edge_id
                self.edges[token_in].append(
                    Obj(token_in, a.sequence, len(a.token_ids), self.plan.run_id)
                )
            elif isinstance(a, o.StartTimer):
                self.orch_timers.add(a.timer)
            elif isinstance(a, o.CancelTimer):
                self.orch_timers.discard(a.timer)
            elif isinstance(a, o.RunFinished):
                self.finished.append(a)
        return out

    def _stage_step(self, node: str, event: Any) -> list[Envelope]:
        if node not in self.alive:
            return []
        machine = self.stages[node]
        if isinstance(event, s.SetupDone) and machine.state is s.State.PREPARING:
            self.setup_seen[node].add(event.part)
        machine, actions = s.step(machine, event)
        self.stages[node] = machine
        out: list[Envelope] = []
        for a in actions:
            if isinstance(a, s.BeginSetup):
                self.setup_pending[node] = set(s.SetupPart)
                self.setup_seen[node] = set()
            elif isinstance(a, s.SendToOrchestrator):
                if isinstance(a.message, StageReady):
                    self.ready_reported[node] = set(self.setup_seen[node])
                out.append(self._envelope(node, ORCHESTRATOR, a.message))
            elif isinstance(a, s.ExecuteStep):
                self.step_pending[node] = a.sequence
                self.executed[node].append((a.sequence, len(self.loaded[node])))
                # The step's input: the object the controller loaded last.
                self.step_inputs[node].append(self.loaded[node][-1] if self.loaded[node] else None)
            elif isinstance(a, s.ReleaseRun):
                self.step_pending[node] = None
                self.setup_pending[node] = set()
                self.release_pending.add(node)
            elif isinstance(a, s.StartTimer):
                self.stage_timers[node].add(a.timer)
            elif isinstance(a, s.CancelTimer):
                self.stage_timers[node].discard(a.timer)
        return out

    def _deliver(self, env: Envelope) -> list[Envelope]:
        if env.sender == ORCHESTRATOR and not self.orch_alive:
            return []  # its channels closed with it: what it sent and was unread is gone
        if env.dest == ORCHESTRATOR:
            if isinstance(env.message, StageReady) and self.orch.state is o.State.WAITING_READY:
                m = env.message
                if (
                    (
                        m.run_id,
                        self.nodes[m.stage_index] if m.stage_index < len(self.nodes) else None,
                    )
                    == (self.plan.run_id, env.sender)
                    == (m.run_id, m.node_id)
                ):
                    self.ready_received.add(m.stage_index)
            return self._orch_step(o.Received(env.sender, env.message))
        return self._stage_step(env.dest, s.Received(env.sender, env.message))

    # -- rules: the network --------------------------------------------------------

    @rule(target=messages, env=consumes(messages))
    def deliver(self, env: Envelope) -> Any:
        """Deliver a message (a second time, if ``advance`` already did: a duplicate)."""
        self.in_flight.pop(env.serial, None)
        return multiple(*self._deliver(env))

    @rule(target=messages, data=st.data(), steps=st.integers(1, 12))
    def advance(self, data: st.DataObject, steps: int) -> Any:
        """A burst of progress without faults: deliver in-flight messages and finish
        owed work, in an order Hypothesis picks."""
        sent: list[Envelope] = []
        for _ in range(steps):
            options = self._progress_options()
            if not options:
                break
            sent += options[data.draw(st.integers(0, len(options) - 1))]()
        return multiple(*sent)

    @rule(target=messages, env=messages)
    def duplicate(self, env: Envelope) -> Any:
        """Deliver a copy; the original stays in flight."""
        return multiple(*self._deliver(env))

    @rule(target=messages, env=consumes(messages), chance=RARE)
    def drop(self, env: Envelope, chance: int) -> Any:
        if chance:  # most of the time the message goes through after all
            self.in_flight.pop(env.serial, None)
            return multiple(*self._deliver(env))
        self.in_flight.pop(env.serial, None)
        return multiple()

    # -- rules: runtime work completing ------------------------------------------------

    @precondition(lambda self: any(self.setup_pending[n] for n in self.alive))
    @rule(target=messages, data=st.data())
    def finish_setup_part(self, data: st.DataObject) -> Any:
        node = data.draw(st.sampled_from(sorted(n for n in self.alive if self.setup_pending[n])))
        part = data.draw(st.sampled_from(sorted(self.setup_pending[node], key=lambda p: p.value)))
        self.setup_pending[node].discard(part)
        if data.draw(st.integers(0, 19)) == 0:
            return multiple(*self._stage_step(node, s.SetupFailed(part, "injected")))
        return multiple(*self._stage_step(node, s.SetupDone(part)))

    @precondition(lambda self: self.endpoints_pending and self.orch_alive)
    @rule(target=messages, ok=st.integers(0, 19))
    def finish_endpoints(self, ok: int) -> Any:
        self.endpoints_pending = False
        event = o.EndpointsReady() if ok else o.EndpointFault("injected")
        return multiple(*self._orch_step(event))

    @precondition(
        lambda self: any(
            n in self.alive and self.stages[n].state is s.State.READY and self._inbound(n)
            for n in self.nodes
        )
    )
    @rule(target=messages, data=st.data())
    def load_object(self, data: st.DataObject) -> Any:
        """A stage controller reads its inbound edge while its machine is READY."""
        nodes = [
            n
            for n in sorted(self.alive)
            if self.stages[n].state is s.State.READY and self._inbound(n)
        ]
        node = data.draw(st.sampled_from(nodes))
        obj = self._inbound(node).popleft()
        self.loaded[node].append(obj.sequence)
        if obj.sequence == 0 and self.stages[node].provision.stage_index == 0:
            assert obj.rows == len(self.prompt)
        return multiple(
            *self._stage_step(node, s.ObjectLoaded(obj.run_id, obj.edge_id, obj.sequence))
        )

    def _inbound(self, node: str) -> deque[Obj]:
        provision = self.stages[node].provision
        return self.edges[provision.inbound.edge_id] if provision else deque()

    @precondition(lambda self: any(self.step_pending[n] is not None for n in self.alive))
    @rule(target=messages, data=st.data(), token=st.integers(0, VOCAB - 1))
    def finish_step(self, data: st.DataObject, token: int) -> Any:
        node = data.draw(
            st.sampled_from(sorted(n for n in self.alive if self.step_pending[n] is not None))
        )
        sequence = self.step_pending[node]
        assert sequence is not None
        self.step_pending[node] = None
        if data.draw(st.integers(0, 19)) == 0:
            return multiple(*self._stage_step(node, s.StepFailed(sequence, "injected")))
        provision = self.stages[node].provision
        assert provision is not None
        out_edge = provision.outbound.edge_id
        obj = Obj(out_edge, sequence, 1, provision.run_id, token if provision.is_last else None)
        self.edges[out_edge].append(obj)
        self.written.append((node, obj))
        return multiple(*self._stage_step(node, s.StepCompleted(sequence)))

    @precondition(
        lambda self: (
            self.orch_alive
            and self.orch.state is o.State.RUNNING
            and bool(self.edges[self.plan.token_out.edge_id])
        )
    )
    @rule(target=messages)
    def consume_token(self) -> Any:
        obj = self.edges[self.plan.token_out.edge_id].popleft()
        assert obj.token_id is not None
        self.consumed.append(obj.sequence)
        return multiple(*self._orch_step(o.TokenConsumed(obj.sequence, obj.token_id)))

    @precondition(lambda self: bool(self.release_pending & self.alive))
    @rule(target=messages, data=st.data())
    def finish_release(self, data: st.DataObject) -> Any:
        node = data.draw(st.sampled_from(sorted(self.release_pending & self.alive)))
        self.release_pending.discard(node)
        return multiple(*self._stage_step(node, s.Released()))

    # -- rules: time and death ---------------------------------------------------------

    @precondition(lambda self: self.orch_alive and bool(self.orch_timers))
    @rule(target=messages, data=st.data(), chance=RARE)
    def orchestrator_timer_fires(self, data: st.DataObject, chance: int) -> Any:
        if chance:
            return multiple()
        timer = data.draw(st.sampled_from(sorted(self.orch_timers, key=lambda t: t.value)))
        self.orch_timers.discard(timer)
        return multiple(*self._orch_step(o.TimerFired(timer)))

    @precondition(lambda self: any(self.stage_timers[n] for n in self.alive))
    @rule(target=messages, data=st.data(), chance=RARE)
    def stage_timer_fires(self, data: st.DataObject, chance: int) -> Any:
        if chance:
            return multiple()
        node = data.draw(st.sampled_from(sorted(n for n in self.alive if self.stage_timers[n])))
        timer = data.draw(st.sampled_from(sorted(self.stage_timers[node], key=lambda t: t.value)))
        self.stage_timers[node].discard(timer)
        return multiple(*self._stage_step(node, s.TimerFired(timer)))

    @precondition(lambda self: bool(self.alive))
    @rule(data=st.data(), chance=RARE)
    def stage_process_dies(self, data: st.DataObject, chance: int) -> None:
        if chance:
            return
        node = data.draw(st.sampled_from(sorted(self.alive)))
        self.alive.discard(node)
        self.death_notices.append(self.nodes.index(node))

    @precondition(lambda self: bool(self.death_notices) and self.orch_alive)
    @rule(target=messages)
    def orchestrator_notices_a_death(self) -> Any:
        return multiple(*self._orch_step(o.StageDied(self.death_notices.pop(0), "killed")))

    @precondition(lambda self: self.orch_alive)
    @rule(target=messages, chance=RARE)
    def caller_cancels(self, chance: int) -> Any:
        if chance:
            return multiple()
        return multiple(*self._orch_step(o.Cancel("caller")))

    @precondition(lambda self: self.orch_alive)
    @rule(chance=RARE)
    def orchestrator_process_dies(self, chance: int) -> None:
        if chance:
            return
        self.orch_alive = False
        self.lost_notices = set(self.alive)

    @precondition(lambda self: bool(self.lost_notices & self.alive))
    @rule(target=messages, data=st.data())
    def stage_notices_the_orchestrator_is_gone(self, data: st.DataObject) -> Any:
        node = data.draw(st.sampled_from(sorted(self.lost_notices & self.alive)))
        self.lost_notices.discard(node)
        return multiple(*self._stage_step(node, s.OrchestratorLost()))

    # -- rules: §10 rejections (forged input changes nothing) ---------------------------

    def _refused(self, node: str, event: Any, reason: s.RejectReason) -> None:
        before = self.stages[node]
        after, actions = s.step(before, event)
        assert after == before, f"{event} changed the machine"
        rejects = [a for a in actions if isinstance(a, s.Reject)]
        assert [r.reason for r in rejects] == [reason], actions
        assert not any(isinstance(a, s.SendToOrchestrator | s.ExecuteStep) for a in actions)

    @precondition(lambda self: bool(self.alive))
    @rule(data=st.data())
    def provisioning_from_anyone_but_the_orchestrator_is_rejected(
        self, data: st.DataObject
    ) -> None:
        node = data.draw(st.sampled_from(sorted(self.alive)))
        sender = data.draw(st.sampled_from([STRANGER, *[n for n in self.nodes if n != node]]))
        provision = self.plan_provision(node)
        self._refused(node, s.Received(sender, provision), s.RejectReason.UNAUTHORIZED_SENDER)

    @precondition(lambda self: bool(self.alive))
    @rule(data=st.data())
    def unknown_run_id_is_rejected(self, data: st.DataObject) -> None:
        node = data.draw(st.sampled_from(sorted(self.alive)))
        run = "never-seen"
        provision = self.plan_provision(node)
        event = data.draw(
            st.sampled_from(
                [
                    s.Received(ORCHESTRATOR, StopRun(run, StopReason.CANCELLED)),
                    s.ObjectLoaded(run, provision.inbound.edge_id, 0),
                ]
            )
        )
        self._refused(node, event, s.RejectReason.UNKNOWN_RUN)

    @precondition(lambda self: any(self.stages[n].stale_runs for n in self.alive))
    @rule(data=st.data())
    def stale_run_id_is_rejected(self, data: st.DataObject) -> None:
        node = data.draw(
            st.sampled_from(sorted(n for n in self.alive if self.stages[n].stale_runs))
        )
        provision = self.plan_provision(node)
        event = data.draw(
            st.sampled_from(
                [
                    s.Received(ORCHESTRATOR, provision),
                    s.Received(ORCHESTRATOR, StopRun(provision.run_id, StopReason.FAULTED)),
                    s.ObjectLoaded(provision.run_id, provision.inbound.edge_id, 0),
                ]
            )
        )
        if self.stages[node].state in (s.State.UNPROVISIONED, s.State.STOPPED) or not (
            isinstance(event, s.Received) and isinstance(event.message, ProvisionStage)
        ):
            self._refused(node, event, s.RejectReason.STALE_RUN)

    @precondition(
        lambda self: any(
            self.stages[n].state
            in (
                s.State.PREPARING,
                s.State.READY,
                s.State.EXECUTING,
                s.State.FAULTED,
                s.State.STOPPING,
            )
            for n in self.alive
        )
    )
    @rule(data=st.data())
    def duplicate_provisioning_for_an_active_run_is_rejected(self, data: st.DataObject) -> None:
        node = data.draw(
            st.sampled_from(
                sorted(
                    n
                    for n in self.alive
                    if self.stages[n].state not in (s.State.UNPROVISIONED, s.State.STOPPED)
                )
            )
        )
        provision = self.stages[node].provision
        self._refused(node, s.Received(ORCHESTRATOR, provision), s.RejectReason.DUPLICATE_PROVISION)

    @precondition(
        lambda self: any(
            self.stages[n].state in (s.State.READY, s.State.EXECUTING, s.State.FAULTED)
            for n in self.alive
        )
    )
    @rule(data=st.data(), edge_id=st.integers(0, 20))
    def edge_ids_not_in_the_provision_are_rejected(self, data: st.DataObject, edge_id: int) -> None:
        node = data.draw(
            st.sampled_from(
                sorted(
                    n
                    for n in self.alive
                    if self.stages[n].state in (s.State.READY, s.State.EXECUTING, s.State.FAULTED)
                )
            )
        )
        provision = self.stages[node].provision
        assert provision is not None
        if edge_id == provision.inbound.edge_id:
            edge_id += 100
        self._refused(
            node, s.ObjectLoaded(provision.run_id, edge_id, 0), s.RejectReason.UNKNOWN_EDGE
        )

    @precondition(lambda self: bool(self.alive))
    @rule(data=st.data())
    def rewiring_requests_from_another_stage_are_rejected(self, data: st.DataObject) -> None:
        node = data.draw(st.sampled_from(sorted(self.alive)))
        sender = data.draw(st.sampled_from([n for n in self.nodes if n != node] or [STRANGER]))
        edge = self.plan_provision(node).outbound.edge_id
        self._refused(
            node,
            s.Received(sender, RewireEdge(self.plan.run_id, edge, sender)),
            s.RejectReason.REWIRE_FORBIDDEN,
        )

    @precondition(lambda self: any(self.stages[n].state is s.State.READY for n in self.alive))
    @rule(data=st.data(), offset=st.integers(1, 3))
    def an_object_out_of_sequence_faults_the_stage(self, data: st.DataObject, offset: int) -> None:
        """Checked on a copy: the harness's rings never reorder, so a stage would
        otherwise never see one."""
        node = data.draw(
            st.sampled_from(sorted(n for n in self.alive if self.stages[n].state is s.State.READY))
        )
        before = self.stages[node]
        assert before.provision is not None
        wrong = data.draw(
            st.sampled_from([before.next_sequence + offset, max(0, before.next_sequence - offset)])
        )
        if wrong == before.next_sequence:
            wrong += offset
        after, actions = s.step(
            before, s.ObjectLoaded(before.provision.run_id, before.provision.inbound.edge_id, wrong)
        )
        assert after.state is s.State.FAULTED
        assert not any(isinstance(a, s.ExecuteStep) for a in actions)
        (fault,) = [a.message for a in actions if isinstance(a, s.SendToOrchestrator)]
        assert fault.reason.kind.value == "SEQUENCE_VIOLATION"

    @rule(
        sender=st.sampled_from([STRANGER, ORCHESTRATOR]),
        run_id=st.sampled_from(["run-1", "other-run"]),
        index=st.integers(0, 4),
    )
    def forged_stage_messages_change_nothing_at_the_orchestrator(
        self, sender: str, run_id: str, index: int
    ) -> None:
        """A StageReady from a node that is not the stage's, or about another run."""
        node = self.nodes[index] if index < len(self.nodes) else STRANGER
        if sender == node and run_id == self.plan.run_id:
            run_id = "other-run"
        before = self.orch
        after, actions = o.step(before, o.Received(sender, StageReady(run_id, index, node)))
        assert after == before
        assert not any(isinstance(a, o.InjectTokens | o.SendStopRun) for a in actions)

    def plan_provision(self, node: str) -> ProvisionStage:
        return self.orch.provisions[self.nodes.index(node)]

    # -- invariants: §11, one per guarantee -------------------------------------------------

    @invariant()
    def stage_layer_ranges_are_contiguous(self) -> None:
        provisions = self._provisions_seen()
        for a, b in itertools.pairwise(provisions):
            if a.stage_index + 1 == b.stage_index:
                assert a.layer_end_exclusive == b.layer_start

    @invariant()
    def stage_layer_ranges_do_not_overlap(self) -> None:
        layers = [
            layer
            for p in self._provisions_seen()
            for layer in range(p.layer_start, p.layer_end_exclusive)
        ]
        assert len(layers) == len(set(layers))

    @invariant()
    def union_of_stage_layer_ranges_covers_the_gguf_block_range(self) -> None:
        covered = {
            layer
            for p in self.orch.provisions
            for layer in range(p.layer_start, p.layer_end_exclusive)
        }
        assert covered == set(range(self.plan.model.num_layers))

    @invariant()
    def every_stage_has_exactly_one_assigned_range(self) -> None:
        assert [p.stage_index for p in self.orch.provisions] == list(range(len(self.nodes)))
        for p in self.orch.provisions:
            assert p.layer_start < p.layer_end_exclusive

    @invariant()
    def every_edge_id_is_unique_within_a_run(self) -> None:
        ids = [e.edge_id for e in self.plan.edges]
        assert len(ids) == len(set(ids))
        for p in self.orch.provisions:
            assert p.inbound.edge_id in self.edges and p.outbound.edge_id in self.edges

    @invariant()
    def every_edge_has_exactly_one_producer_and_one_consumer(self) -> None:
        for node, obj in self.written:
            producers = {n for n, w in self.written if w.edge_id == obj.edge_id}
            assert producers == {node}
        consumers: dict[int, set[str]] = {}
        for p in self.orch.provisions:
            consumers.setdefault(p.inbound.edge_id, set()).add(p.node_id)
        assert all(len(c) == 1 for c in consumers.values())

    @invariant()
    def token_in_is_produced_by_the_orchestrator_and_consumed_by_stage_0(self) -> None:
        edge = self.plan.token_in
        assert edge.kind is EdgeKind.TOKEN_IN
        assert edge.producer == OrchestratorEndpoint(ORCHESTRATOR)
        assert self.orch.provisions[0].inbound.edge_id == edge.edge_id
        assert all(w.edge_id != edge.edge_id for _, w in self.written)

    @invariant()
    def token_out_is_produced_by_stage_n_minus_1_and_consumed_by_the_orchestrator(
        self,
    ) -> None:
        edge = self.plan.token_out
        assert edge.kind is EdgeKind.TOKEN_OUT and edge.consumer == OrchestratorEndpoint(
            ORCHESTRATOR
        )
        for node, obj in self.written:
            if obj.edge_id == edge.edge_id:
                assert node == self.nodes[-1]

    @invariant()
    def activation_edge_i_is_produced_by_stage_i_and_consumed_by_stage_i_plus_1(self) -> None:
        for i, edge in enumerate(self.plan.edges[1:-1]):
            assert edge.producer == StageEndpoint(self.nodes[i], i)
            assert edge.consumer == StageEndpoint(self.nodes[i + 1], i + 1)
            for node, obj in self.written:
                if obj.edge_id == edge.edge_id:
                    assert node == self.nodes[i]

    @invariant()
    def orchestrator_does_not_inject_prompt_tokens_before_every_stage_reports_ready(
        self,
    ) -> None:
        for sequence, _, ready, _ in self.injected:
            if sequence == 0:
                assert ready == set(range(len(self.nodes)))

    @invariant()
    def stage_does_not_report_ready_before_worker_shard_and_both_edges_are_ready(self) -> None:
        for parts in self.ready_reported.values():
            if parts is not None:
                assert parts == set(s.SetupPart)

    @invariant()
    def prefill_is_sequence_0(self) -> None:
        for sequence, rows, _, _ in self.injected:
            assert rows == (len(self.prompt) if sequence == 0 else 1)
        for executed in self.executed.values():
            if executed:
                assert executed[0][0] == 0

    @invariant()
    def decode_sequences_are_strictly_increasing(self) -> None:
        for executed in self.executed.values():
            sequences = [seq for seq, _ in executed]
            assert all(a < b for a, b in itertools.pairwise(sequences))
        injected = [seq for seq, _, _, _ in self.injected]
        assert injected == list(range(len(injected)))

    @invariant()
    def stage_executes_sequence_s_only_after_loading_inbound_object_s(self) -> None:
        for node, executed in self.executed.items():
            for sequence, n_loaded in executed:
                assert sequence in self.loaded[node][:n_loaded]

    @invariant()
    def stage_output_uses_the_same_sequence_as_its_input(self) -> None:
        # A step's output carries the ExecuteStep's sequence (the harness writes it so);
        # that sequence must be the one of the object the step was given.
        for node, executed in self.executed.items():
            for (sequence, _), given in zip(executed, self.step_inputs[node], strict=True):
                assert sequence == given, f"{node} ran step {sequence} on object {given}"

    @invariant()
    def orchestrator_injects_s_plus_1_only_after_consuming_token_s(self) -> None:
        for sequence, _, _, consumed in self.injected:
            if sequence > 0:
                assert sequence - 1 in consumed

    @invariant()
    def each_run_has_one_terminal_outcome(self) -> None:
        assert len(self.outcomes) <= 1
        assert len(self.finished) <= 1
        if self.finished:
            assert self.finished[0].outcome is self.outcomes[0]
            assert self.orch.state is o.State.DONE

    @invariant()
    def after_a_run_faults_the_orchestrator_stops_injecting(self) -> None:
        assert not self.inject_after_outcome

    @invariant()
    def teardown_is_sent_to_every_stage_provisioned_for_the_run(self) -> None:
        # Judged by what the harness saw sent, not by the machine's own bookkeeping.
        if self.orch.state in (o.State.TEARING_DOWN, o.State.DONE):
            assert self.stop_sent == self.provision_sent

    @invariant()
    def orchestrator_owns_eos_and_max_tokens(self) -> None:
        """Not a numbered guarantee of §11 but the orchestrator's duty (§2, §5): no token
        object after EOS or after ``max_tokens`` tokens, and a completed run ended by
        one of them."""
        tokens = self.orch.consumed
        for sequence, _, _, consumed in self.injected:
            seen = tokens[: len(consumed)]
            if sequence > 0:
                assert EOS not in seen and len(seen) < self.plan.max_tokens
        if self.finished and self.finished[0].outcome is StopReason.COMPLETED:
            assert tokens and (tokens[-1] == EOS or len(tokens) == self.plan.max_tokens)
            assert self.finished[0].tokens == tuple(t for t in tokens if t != EOS)

    def _provisions_seen(self) -> list[ProvisionStage]:
        return sorted(
            (m.provision for m in self.stages.values() if m.provision is not None),
            key=lambda p: p.stage_index,
        )

    # -- liveness: with no more faults, every run ends -------------------------------------

    def teardown(self) -> None:
        """Liveness: with no more faults, the run ends in one outcome, and once the
        orchestrator process exits every stage still alive stops on its own."""
        if not hasattr(self, "plan"):
            return
        self._drain()
        if self.orch_alive:
            assert self.orch.state is o.State.DONE, self.orch
            assert len(self.finished) == 1 and len(self.outcomes) == 1
            event(f"outcome {self.finished[0].outcome.value}, {len(self.consumed)} tokens")
            self.orch_alive = False  # the launcher exits; its channels close
            self.lost_notices = set(self.alive)
        else:
            event("orchestrator died")
        self._drain()
        for node in self.alive:
            assert self.stages[node].state in (s.State.UNPROVISIONED, s.State.STOPPED), node

    def _drain(self) -> None:
        for _ in range(10_000):
            options = self._progress_options()
            if options:
                options[0]()
            elif self.orch_alive and self.orch.state is not o.State.DONE and self.orch_timers:
                timer = sorted(self.orch_timers, key=lambda t: t.value)[0]
                self.orch_timers.discard(timer)
                self._orch_step(o.TimerFired(timer))
            else:
                return
        raise AssertionError("no quiescence after 10,000 steps")

    def _progress_options(self) -> list[Callable[[], list[Envelope]]]:
        """Every piece of work that can happen next without a fault, as thunks that do
        it and return the messages it sends."""
        options: list[Callable[[], list[Envelope]]] = []

        def deliver(env: Envelope) -> list[Envelope]:
            self.in_flight.pop(env.serial, None)
            return self._deliver(env)

        options += [partial(deliver, env) for env in self.in_flight.values()]
        for node in sorted(self.alive):
            for part in sorted(self.setup_pending[node], key=lambda p: p.value):
                options.append(partial(self._finish_setup, node, part))
            if self.stages[node].state is s.State.READY and self._inbound(node):
                options.append(partial(self._load, node))
            if self.step_pending[node] is not None:
                options.append(partial(self._finish_step, node, 1))
            if node in self.release_pending:
                options.append(partial(self._release, node))
            if node in self.lost_notices and not self.orch_alive:
                options.append(partial(self._lost, node))
        if self.orch_alive:
            if self.endpoints_pending:
                options.append(self._endpoints)
            if self.orch.state is o.State.RUNNING and self.edges[self.plan.token_out.edge_id]:
                options.append(self._consume)
            if self.death_notices:
                options.append(self._notice_death)
        return options

    def _finish_setup(self, node: str, part: s.SetupPart) -> list[Envelope]:
        self.setup_pending[node].discard(part)
        return self._stage_step(node, s.SetupDone(part))

    def _load(self, node: str) -> list[Envelope]:
        obj = self._inbound(node).popleft()
        self.loaded[node].append(obj.sequence)
        if obj.sequence == 0 and self.stages[node].provision.stage_index == 0:
            assert obj.rows == len(self.prompt)
        return self._stage_step(node, s.ObjectLoaded(obj.run_id, obj.edge_id, obj.sequence))

    def _finish_step(self, node: str, token: int) -> list[Envelope]:
        sequence = self.step_pending[node]
        assert sequence is not None
        self.step_pending[node] = None
        provision = self.stages[node].provision
        assert provision is not None
        obj = Obj(
            provision.outbound.edge_id,
            sequence,
            1,
            provision.run_id,
            token if provision.is_last else None,
        )
        self.edges[obj.edge_id].append(obj)
        self.written.append((node, obj))
        return self._stage_step(node, s.StepCompleted(sequence))

    def _release(self, node: str) -> list[Envelope]:
        self.release_pending.discard(node)
        return self._stage_step(node, s.Released())

    def _lost(self, node: str) -> list[Envelope]:
        self.lost_notices.discard(node)
        return self._stage_step(node, s.OrchestratorLost())

    def _endpoints(self) -> list[Envelope]:
        self.endpoints_pending = False
        return self._orch_step(o.EndpointsReady())

    def _consume(self) -> list[Envelope]:
        obj = self.edges[self.plan.token_out.edge_id].popleft()
        assert obj.token_id is not None
        self.consumed.append(obj.sequence)
        return self._orch_step(o.TokenConsumed(obj.sequence, obj.token_id))

    def _notice_death(self) -> list[Envelope]:
        return self._orch_step(o.StageDied(self.death_notices.pop(0), "killed"))


Protocol.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestProtocol = Protocol.TestCase
