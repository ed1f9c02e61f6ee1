"""A chain's runner that recovers (issue 25), in one process: the model of what the
process runtime and serve do with ``runtime_core.recovery``.

Streams run on a ``ChainRuns`` chain. When a fault ends runs, ``RecoveryPolicy``
decides for each; the chain is re-placed (``runplan.replacement.replace_lost``) over
the live nodes (the pool, less the nodes a test lost), a new ``ChainRuns`` comes up on
the new plan's nodes (the old run ids stale on it), and each recovered run is replayed
(``runtime_core.replay.plan_replay``), its tokens continuing its caller's stream: every
token a stream receives must be the stream's next (``stream_sequence``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from runplan import ModelFacts, NodePool, Placement, RunPlan, RuntimeConfig, plan_run
from runplan.fsm.orchestrator_actions import RunFinished
from runplan.messages import StopReason
from runplan.replacement import Replacement, Unplaceable, replace_lost
from runtime_core.chain_orchestrator import RunHandle
from runtime_core.recovery import End, EndReason, RecoveryPolicy
from runtime_core.replay import Interrupted, Replay, ReplayRefused, plan_replay
from runtime_core.workers.interface import Worker
from tests.support.chain_runs import ChainRuns

#: ``make(stage_index, node_id)``: the worker of a stage on a node.
MakeWorker = Callable[[int, str], Worker]


@attrs.define(eq=False)
class Stream:
    """One caller's stream: its prompt, the run now serving it (its plan, its replay if
    it is one), the tokens received in order, and its end."""

    prompt: tuple[int, ...]
    plan: RunPlan
    handle: RunHandle
    replay: Replay | None = None
    tokens: list[int] = attrs.field(factory=list)
    run_ids: list[str] = attrs.field(factory=list)
    ended: End | ReplayRefused | Unplaceable | None = None

    @property
    def finished(self) -> RunFinished | None:
        """How the run now serving the stream ended."""
        return self.handle.finished

    @property
    def completed(self) -> bool:
        """The stream got every token it was to get."""
        end, f = self.ended, self.handle.finished
        if isinstance(end, End) and end.reason is EndReason.ALREADY_ENDED:
            return True
        return isinstance(end, End) and f is not None and f.outcome is StopReason.COMPLETED


class RecoveringChain:
    """Streams over a chain that is re-placed and replayed after a loss."""

    def __init__(
        self,
        facts: ModelFacts,
        base: RuntimeConfig,
        pool: NodePool,
        placement: Placement,
        make: MakeWorker,
        policy: RecoveryPolicy | None = None,
    ) -> None:
        self.facts, self.base, self.pool, self.make = facts, base, pool, make
        self.policy = policy or RecoveryPolicy()
        self.placement = placement
        self.stage_count = len(placement.assignments) or len(placement.nodes)
        self.lost_nodes: set[str] = set()
        self.stale: set[str] = set()  # the run ids stale on the chain now up
        self.streams: dict[str, Stream] = {}  # by the id of the run serving it now
        self.replacements: list[Replacement] = []
        self.chain = self._chain(self._nodes(placement))

    # -- set-up --------------------------------------------------------------------------
    def _nodes(self, placement: Placement) -> list[str]:
        if placement.assignments:
            rows = sorted(placement.assignments, key=lambda a: a.stage_index)
            return [a.node_id for a in rows]
        return list(placement.nodes)

    def _chain(self, node_ids: Sequence[str]) -> ChainRuns:
        return ChainRuns(
            len(node_ids),
            lambda i: self.make(i, node_ids[i]),
            stopped_runs=frozenset(self.stale),
            node_ids=node_ids,
        )

    def live_pool(self) -> NodePool:
        return attrs.evolve(
            self.pool, nodes=tuple(n for n in self.pool.nodes if n.node_id not in self.lost_nodes)
        )

    def start(self, run_id: str, prompt: Sequence[int], **config: Any) -> Stream:
        """A new stream: run ``run_id`` with the base config's ``config`` fields changed."""
        cfg = attrs.evolve(self.base, run_id=run_id, **config)
        plan = plan_run(
            self.facts,
            cfg,
            self.live_pool(),
            stage_count=self.stage_count,
            placement=self.placement,
        )
        assert isinstance(plan, RunPlan), plan
        return self._add(plan, tuple(prompt), None, None)

    def _add(
        self, plan: RunPlan, prompt: tuple[int, ...], replay: Replay | None, stream: Stream | None
    ) -> Stream:
        def on_token(run_id: str, sequence: int, token_id: int) -> None:
            s = self.streams[run_id]
            at = s.replay.stream_sequence(sequence) if s.replay is not None else sequence
            assert at == len(s.tokens), f"{run_id}: token {at} of a stream of {len(s.tokens)}"
            s.tokens.append(token_id)

        handle = self.chain.orchestrator.add_run(plan, prompt, on_token=on_token)
        if stream is None:
            stream = Stream(prompt, plan, handle)
        else:
            stream.plan, stream.handle, stream.replay = plan, handle, replay
        stream.run_ids.append(plan.run_id)
        self.streams[plan.run_id] = stream
        return stream

    # -- faults ---------------------------------------------------------------------------
    def lose(self, stage_index: int, detail: str = "killed", *, host: bool = True) -> None:
        """Stage ``stage_index``'s process is gone (and its node with it when ``host``)."""
        if host:
            self.lost_nodes.add(self.chain.node_ids[stage_index])
        self.chain.kill(stage_index, detail)

    # -- the loop --------------------------------------------------------------------------
    def pump(self, rounds: int | None = None) -> None:
        """Run the chain (``rounds`` rounds, or until nothing more can run), recovering
        the runs a fault ends."""
        if rounds is not None:
            for _ in range(rounds):
                self.chain._round()
                self._settle()
            return
        while True:
            self.chain.pump()
            if not self._settle():
                return

    def _settle(self) -> bool:
        """Streams whose run ended: record the end, or recover; ``True`` if a new chain
        came up."""
        ended = [s for s in set(self.streams.values()) if s.ended is None]
        done = [(s, s.handle.finished) for s in ended if s.handle.finished is not None]
        if not done:
            return False
        cases = [(self._interrupted(s), f) for s, f in done if f is not None]
        decision = self.policy.decide_chain(
            cases, self.stage_count, chain_fault=self.chain.orchestrator.broken
        )
        by_run = {s.handle.run_id: (s, f) for s, f in done}
        for end in decision.end:
            by_run[end.run_id][0].ended = end
        if not decision.recover:
            return False
        return self._recover([by_run[r.run_id][0] for r in decision.recover], decision.lost_stages)

    def _interrupted(self, s: Stream) -> Interrupted:
        finished = s.handle.finished
        assert finished is not None
        delivered = list(finished.tokens)
        if s.replay is None:
            return Interrupted.of_plan(s.plan, s.prompt, delivered)
        return Interrupted.of_replay(s.replay, s.plan, delivered)

    def _recover(self, streams: list[Stream], lost_stages: Sequence[int]) -> bool:
        old_plan = streams[0].plan
        n = len(self.replacements) + 1
        new = replace_lost(
            old_plan,
            self.facts,
            attrs.evolve(self.base, run_id=f"placement-{n}"),
            self.live_pool(),
            lost_nodes=sorted(self.lost_nodes),
            lost_stages=lost_stages,
        )
        if isinstance(new, Unplaceable):
            for s in streams:
                s.ended = new
            return False
        self.replacements.append(new)
        # Everything of the old chain is stale on the new one, from its first message.
        self.stale |= set(self.chain.orchestrator.done) | set(self.streams)
        self.chain.orchestrator.close()
        self.placement = new.placement
        self.stage_count = new.plan.stage_count
        self.chain = self._chain([st.node_id for st in new.plan.stages])
        for s in streams:
            interrupted = self._interrupted(s)
            run_id = f"{s.run_ids[0]}~r{interrupted.recoveries + 1}"
            planned = plan_replay(
                interrupted, run_id, self.facts, self.base, self.live_pool(), self.placement
            )
            if isinstance(planned, ReplayRefused):
                s.ended = planned
                continue
            replay, plan = planned
            del self.streams[s.plan.run_id]
            self._add(plan, replay.prompt, replay, s)
        return True
