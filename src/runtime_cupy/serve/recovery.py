"""A warm chain's runs that survive the loss of a stage (issue 25): re-placement and
deterministic replay on the process runtime (``serve.chain.WarmChain`` with
``recover=True``; ``serve``, ``chat`` and ``python -m runtime_cupy --recover``).

``run_stream(chain, ...)`` runs one caller's stream. When its run ends ``FAULTED``,
``runtime_core.recovery.RecoveryPolicy`` decides: a lost stage process, host or link
(and recoveries left) is recovered, any other end stands. To recover, the chain is
re-placed (``WarmChain.replace`` through a ``Replacer``: ``replace_lost`` over the
live nodes, this machine's stage nodes, where a lost process is started again, or the
live hosts of the Ray cluster, a spare first), then a new chain
comes up on the new plan (a new secret, so new link names and keys; the old run ids are
never used again) and binds its slices: only its new stages start and bind; the stages
whose node and layers are unchanged keep their process and weights and join it
(``JoinChain``). Then the stream's run is replayed
(``runtime_core.replay``): its prompt plus the tokens already delivered, its sampler
resumed after them, its tokens handed to the same ``on_token``, so the caller's stream
goes on as if unbroken. Several streams a fault ended share one re-placement: the
first to get there makes it, the others find the new chain up.

A re-placement the planner refuses (``Unplaceable``) ends the stream with the
rejection named, and the chain reports it as its trouble (the server unhealthy with
the reason) until a later ``recover`` places it. A stream whose recoveries are spent,
its last loss mid-run or while the new chain started, ends with its fault and ``not
recovered: ... no recovery left (--max-recoveries N)`` (``spent``).

``Recoveries`` counts them (and their seconds: from the interrupted run's end to the
replay's first token) for ``/metrics``, each as its replay's first token arrives (a
replay that ends completed with none, as it ends); the
log names the lost node, the cause and the new placement.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs
from attrs import frozen

from runplan import ModelFacts, NodePool, NodeSpec, RunPlan, RuntimeConfig, SamplingConfig
from runplan.messages import StopReason
from runplan.replacement import Replacement, Unplaceable, replace_lost
from runtime_core.recovery import End, EndReason, RecoveryPolicy
from runtime_core.replay import Interrupted, Replay, ReplayRefused, replay_of
from runtime_cupy.hosts.port import KnowsLiveNodes, StageHost
from runtime_cupy.process.chain_run import ChainRun, OnLogits, RunOutcome
from runtime_cupy.process.chain_runner import ORCHESTRATOR, ChainRunner
from runtime_cupy.serve.chain_errors import SourceChanged, unplaced

if TYPE_CHECKING:
    from runtime_cupy.serve.chain import OnRun, WarmChain, WarmResult

log = logging.getLogger("runtime_cupy.serve.recovery")


@frozen
class RecoveryTimes:
    """One stream's recovery on the monotonic clock: its run ended by the fault (the
    loss detected), the new plan made, the broken chain stopped (its kept stages handed
    over), the new stages started and the kept ones joined, bound, and the replay's
    first token delivered. When another stream's recovery brought the chain up, the
    chain's times are that one's."""

    ended_s: float
    stopped_s: float
    placed_s: float
    started_s: float
    bound_s: float
    first_token_s: float

    @property
    def seconds(self) -> float:
        return self.first_token_s - self.ended_s


#: Recoveries a chain keeps the details of (the newest): a server whose stages keep
#: dying kept every one, a run plan each, for as long as it ran.
KEPT = 64


class Recoveries:
    """How many streams were recovered and their seconds; how many times the chain was
    placed again (``placements``, the chain's generation); the newest ``KEPT``
    replacements and streams' times (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.seconds = 0.0
        self.placements = 0
        self.replacements: deque[Replacement] = deque(maxlen=KEPT)
        self.times: deque[RecoveryTimes] = deque(maxlen=KEPT)

    def recovered(self, times: RecoveryTimes) -> None:
        with self._lock:
            self.count += 1
            self.seconds += times.seconds
            self.times.append(times)

    def placed(self, replacement: Replacement) -> None:
        with self._lock:
            self.placements += 1
            self.replacements.append(replacement)


def describe_placement(old: RunPlan, replacement: Replacement) -> str:
    """The new chain's stages as the log shows them, and how each lost range was placed
    (``old``: the plan that lost them): on a spare node, or its stage started again on
    its own node (a process lost, its node live), or the whole model placed afresh."""
    rows = [
        f"stage {s.stage_index} on {s.node_id!r} (layers {s.layer_start}..{s.layer_end_exclusive})"
        for s in replacement.plan.stages
    ]
    if not replacement.on_spares:
        return f"{'; '.join(rows)} (placed afresh)"
    hows = []
    for i in replacement.lost_stages:
        was, now = old.stages[i].node_id, replacement.plan.stages[i].node_id
        if now == was:
            hows.append(f"stage {i} started again on its own node {now!r}")
        else:
            hows.append(f"stage {i}'s range on spare node {now!r}")
    return f"{'; '.join(rows)} ({'; '.join(hows)})"


def kept_stages(old: RunPlan, new: Replacement) -> tuple[int, ...]:
    """The stages of ``new`` that keep their process: ``Replacement.kept`` stages at the
    same index, node and layers of a chain of as many stages (a stage whose place in the
    pipeline changes binds anew)."""
    if new.plan.stage_count != old.stage_count:
        return ()
    return tuple(
        i
        for i in new.kept
        if (a := old.stages[i]).node_id == (b := new.plan.stages[i]).node_id
        and (a.layer_start, a.layer_end_exclusive) == (b.layer_start, b.layer_end_exclusive)
    )


def explained_loss(
    runner: ChainRunner, lost: Sequence[int], live: Sequence[str]
) -> tuple[int, ...]:
    """The stages a chain lost: ``lost`` (what the policy read off the runs' faults:
    both ends of a broken link, as which end failed is not known), but when a stage
    process of the chain is gone (died, or silent and killed) or its node is no longer
    among the ``live`` nodes, that is the loss: a link its neighbours saw break with it
    was its link, not theirs, and they keep their weights."""
    gone = {h.stage_index for h in runner.handles() if h.exited()} | runner.gone_stages
    gone |= {s.stage_index for s in runner.template.stages if s.node_id not in live}
    return tuple(sorted(gone)) if gone else tuple(lost)


class Replacer:
    """Where a warm chain goes after a loss: the nodes it may be placed on (its stages'
    and its ``spares``, and those a host that ``KnowsLiveNodes`` reports), each with its
    GPU; the stages it lost and has not placed again; the last re-placement the planner
    refused. ``WarmChain`` re-places itself through it (under its own lock)."""

    def __init__(
        self,
        host: StageHost,
        worker: str,
        nodes: Sequence[NodeSpec],
        devices: Sequence[int | None],
        spares: Sequence[NodeSpec],
        recoveries: Recoveries,
    ) -> None:
        self.host = host
        self.worker = worker
        self.recoveries = recoveries
        self.known = {n.node_id: n for n in (*nodes, *spares)}
        self.device_of = {n.node_id: d for n, d in zip(nodes, devices, strict=True)}
        self.device_of.update((n.node_id, None) for n in spares if n.node_id not in self.device_of)
        self.lost: tuple[int, ...] | None = None  # stages lost and not yet placed again
        self.unplaceable: Unplaceable | None = None
        self.live: tuple[str, ...] = ()  # the live nodes the last placement was over

    @property
    def placeable(self) -> bool:
        """The last re-placement found a plan (or none was needed)."""
        return self.unplaceable is None

    def live_pool(self) -> NodePool:
        """The nodes the chain may be placed on now: those its host says are live
        (``KnowsLiveNodes``: a Ray cluster's live hosts), else the chain's nodes and
        spares, every one taken as live (a lost process starts again where it was)."""
        if not isinstance(self.host, KnowsLiveNodes):
            return NodePool(ORCHESTRATOR, tuple(self.known.values()))
        known = [(n, self.device_of[n.node_id]) for n in self.known.values()]
        live = self.host.live_nodes(known, self.worker)
        for spec, device in live:
            self.known.setdefault(spec.node_id, spec)
            self.device_of.setdefault(spec.node_id, device)
        return NodePool(ORCHESTRATOR, tuple(spec for spec, _ in live))

    def lose(self, runner: ChainRunner, lost_stages: Sequence[int], cause: str) -> None:
        """``runner``'s chain lost ``lost_stages`` (as the policy read them; a gone
        process or a departed node explains them: ``explained_loss``) by ``cause``."""
        live = [n.node_id for n in self.live_pool().nodes]
        lost = explained_loss(runner, lost_stages, live)
        if not lost:  # nothing known lost (a chain fault with every stage there)
            return
        nodes = sorted({runner.template.stages[i].node_id for i in lost})
        log.warning("lost stages %s on %s: %s", list(lost), nodes, cause)
        self.lost = lost

    def place(
        self, template: RunPlan, facts: ModelFacts, config: RuntimeConfig
    ) -> Replacement | Unplaceable:
        """``template``'s chain over the live nodes without the lost stages
        (``replace_lost``), logged; a new plan is counted (``Recoveries.placed``)."""
        assert self.lost is not None, "no stage lost"
        pool = self.live_pool()
        self.live = tuple(n.node_id for n in pool.nodes)
        new = replace_lost(template, facts, config, pool, lost_stages=self.lost)
        if isinstance(new, Unplaceable):
            self.unplaceable = new
            log.error("%s", unplaced(new, self.live))
            return new
        self.unplaceable = None
        self.lost = None
        log.warning("lost nodes %s; new placement: %s", list(new.lost_nodes),
                    describe_placement(template, new))  # fmt: skip
        self.recoveries.placed(new)
        return new

    def nodes_of(self, plan: RunPlan) -> tuple[tuple[NodeSpec, ...], tuple[int | None, ...]]:
        """The nodes of ``plan``'s stages and their GPUs, in stage order."""
        nodes = tuple(self.known[s.node_id] for s in plan.stages)
        return nodes, tuple(self.device_of[s.node_id] for s in plan.stages)


def _times(lost_at: float, marks: dict[str, float], first_token_s: float) -> RecoveryTimes:
    """A recovery's times: the loss detected at ``lost_at``, the chain's start (its
    ``heal_marks``), the replay's first token at ``first_token_s``."""
    return RecoveryTimes(
        ended_s=lost_at,
        stopped_s=marks.get("stopped", lost_at),
        placed_s=marks.get("placed", lost_at),
        started_s=marks.get("started", lost_at),
        bound_s=marks.get("bound", lost_at),
        first_token_s=first_token_s,
    )


def spent(policy: RecoveryPolicy) -> str:
    """What a stream's fault says once its recoveries are spent, whether the last was
    lost mid-run or while its new chain still started: the limit and its flag."""
    return f"no recovery left (--max-recoveries {policy.max_recoveries})"


@attrs.define
class _Segment:
    """One run of a stream: the run, how it ended, and its replay (None: the first)."""

    run: ChainRun
    outcome: RunOutcome
    replay: Replay | None


def run_stream(
    chain: WarmChain,
    policy: RecoveryPolicy,
    prompt: tuple[int, ...],
    max_tokens: int,
    sampling: SamplingConfig,
    on_token: Callable[[int], None] | None,
    on_run: OnRun | None,
    on_logits: OnLogits | None = None,
) -> WarmResult:
    """One caller's stream on ``chain``: its run, and its replays after each loss the
    policy recovers; the result holds every token of the stream (``on_logits``: each
    new token's raw logits, the replays' too)."""
    began = time.perf_counter()
    run = chain.submit(
        prompt, max_tokens=max_tokens, sampling=sampling, on_token=on_token, on_logits=on_logits
    )
    outcome = run.wait_for_caller(on_run)
    segments = [_Segment(run, outcome, None)]
    interrupted = Interrupted.of_plan(run.plan, prompt, outcome.tokens)
    not_recovered: str | None = None
    while True:
        last = segments[-1]
        finished = last.outcome.finished
        if finished is None:
            break
        decision = policy.decide(
            interrupted, finished, chain_fault=last.run.runner.orchestrator.broken
        )
        if isinstance(decision, End):
            if decision.reason is EndReason.RECOVERIES_SPENT:
                log.warning("run %s not recovered: %s", decision.run_id, decision.detail)
                not_recovered = spent(policy)
            break
        lost = decision.lost_stages(last.run.plan.stage_count)
        cause = str(finished.fault)
        lost_at = last.outcome.ended_s  # the loop ended the run: the loss detected
        try:
            chain.replace(last.run.runner, lost, cause)
        except Exception as exc:  # ChainError: unplaceable, or the new chain did not bind
            not_recovered = str(exc)
            if isinstance(exc, SourceChanged):
                break  # the model's files changed: no replay holds the stream's model
            if chain.closed:
                break  # closed meanwhile: no recovery was spent, none will come
            if not chain.placeable:
                break
            if interrupted.recoveries + 1 < policy.max_recoveries:
                interrupted = attrs.evolve(interrupted, recoveries=interrupted.recoveries + 1)
                continue  # the new chain was lost in turn while binding: once more
            not_recovered = f"{not_recovered}; {spent(policy)}"
            break
        replay = replay_of(interrupted, chain.run_id(), chain.context)
        if isinstance(replay, ReplayRefused):
            not_recovered = str(replay)
            break
        first = threading.Event()

        def forward(
            token_id: int, first: threading.Event = first, lost_at: float = lost_at
        ) -> None:
            if not first.is_set():  # the stream goes on: recovered (counted for /metrics)
                first.set()
                chain.recoveries.recovered(_times(lost_at, chain.heal_marks, time.monotonic()))
            if on_token is not None:
                on_token(token_id)

        try:
            run = chain.submit_replay(replay, forward, on_logits)
        except Exception as exc:  # the new chain broke again before the replay went in
            not_recovered = str(exc)
            break
        log.warning(
            "run %s replayed as %s after %d tokens (recovery %d of the stream)",
            interrupted.run_id,
            replay.run_id,
            replay.stream_offset,
            replay.recoveries,
        )
        outcome = run.wait_for_caller(on_run)
        ended = outcome.finished
        if not first.is_set() and ended is not None and ended.outcome is StopReason.COMPLETED:
            first.set()  # ended well with no token (the stream's last was the interrupted
            # run's, the next ends generation): recovered too, its end its first token
            chain.recoveries.recovered(_times(lost_at, chain.heal_marks, outcome.ended_s))
        segments.append(_Segment(run, outcome, replay))
        interrupted = Interrupted.of_replay(replay, run.plan, outcome.tokens)
        not_recovered = None
    return _stream_result(chain, segments, time.perf_counter() - began, not_recovered)


def _stream_result(
    chain: WarmChain, segments: list[_Segment], wall_s: float, not_recovered: str | None
) -> WarmResult:
    """The last run's result with every token and token time of the stream."""
    first, last = segments[0], segments[-1]
    tokens = tuple(t for s in segments for t in s.outcome.tokens)
    times = tuple(t for s in segments for t in s.outcome.token_times_s)
    whole = attrs.evolve(
        last.outcome,
        tokens=tokens,
        logits=(),  # serve keeps none (on_logits takes them as they come)
        submitted_s=first.outcome.submitted_s,
        ready_s=first.outcome.ready_s,
        token_times_s=times,
    )
    last.run.outcome = whole
    result = chain.result(last.run, wall_s)
    if not_recovered is not None and result.result.fault is not None:
        fault = f"{result.result.fault}; not recovered: {not_recovered}"
        result = attrs.evolve(result, result=attrs.evolve(result.result, fault=fault))
    return result
