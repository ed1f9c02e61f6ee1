"""A warm chain's runs that survive the loss of a stage (issue 25): re-placement and
deterministic replay on the process runtime (``serve.chain.WarmChain`` with
``recover=True``; ``serve``, ``chat`` and ``python -m runtime_cupy --recover``).

``run_stream(chain, ...)`` runs one caller's stream. When its run ends ``FAULTED``,
``runtime_core.recovery.RecoveryPolicy`` decides: a lost stage process, host or link
(and recoveries left) is recovered, any other end stands. To recover, the chain is
re-placed (``replace_chain``): ``runplan.replacement.replace_lost`` over the live
nodes (this machine's stage nodes, where a lost process is started again; or the live
hosts of the Ray cluster, a spare first), then a new chain comes up on the new plan
(every stage a new process, a new secret, so new link names and keys; the old run ids
are never used again) and binds its slices. Then the stream's run is replayed
(``runtime_core.replay``): its prompt plus the tokens already delivered, its sampler
resumed after them, its tokens handed to the same ``on_token``, so the caller's stream
goes on as if unbroken. Several streams a fault ended share one re-placement: the
first to get there makes it, the others find the new chain up.

A re-placement the planner refuses (``Unplaceable``) ends the stream with the
rejection named, and the chain reports it as its trouble (the server unhealthy with
the reason) until a later ``recover`` places it.

``Recoveries`` counts them (and their seconds: from the interrupted run's end to the
replay's first token) for ``/metrics``; the log names the lost node, the cause and the
new placement.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import attrs
from attrs import frozen
from prometheus_client.core import CounterMetricFamily, Metric

from runplan import SamplingConfig
from runplan.replacement import Replacement
from runtime_core.recovery import End, EndReason, RecoveryPolicy
from runtime_core.replay import Interrupted, Replay, ReplayRefused, replay_of
from runtime_cupy.process.chain_runner import ChainRun, RunOutcome

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


class Recoveries:
    """How many streams were recovered and their seconds (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.seconds = 0.0
        self.replacements: list[Replacement] = []
        self.times: list[RecoveryTimes] = []

    def recovered(self, times: RecoveryTimes) -> None:
        with self._lock:
            self.count += 1
            self.seconds += times.seconds
            self.times.append(times)

    def placed(self, replacement: Replacement) -> None:
        with self._lock:
            self.replacements.append(replacement)


class RecoveryMetrics:
    """``gguf_pipeline_recoveries_total`` (streams replayed after a loss) and
    ``gguf_pipeline_recovery_seconds_total`` (their time from the interrupted run's end
    to the replay's first token), read when scraped."""

    def __init__(self, recoveries: Callable[[], Recoveries]) -> None:
        self.recoveries = recoveries

    def collect(self) -> Iterator[Metric]:
        r = self.recoveries()
        yield CounterMetricFamily(
            "gguf_pipeline_recoveries", "Streams replayed on a re-placed chain", r.count
        )
        yield CounterMetricFamily(
            "gguf_pipeline_recovery_seconds",
            "Seconds from a lost stage to the replay's first token, summed",
            r.seconds,
        )


def describe_placement(replacement: Replacement) -> str:
    """The new chain's stages as the log shows them."""
    rows = [
        f"stage {s.stage_index} on {s.node_id!r} (layers {s.layer_start}..{s.layer_end_exclusive})"
        for s in replacement.plan.stages
    ]
    how = "the lost ranges on spare nodes" if replacement.on_spares else "placed afresh"
    return f"{'; '.join(rows)} ({how})"


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
) -> WarmResult:
    """One caller's stream on ``chain``: its run, and its replays after each loss the
    policy recovers; the result holds every token of the stream."""
    began = time.perf_counter()
    run = chain.submit(prompt, max_tokens=max_tokens, sampling=sampling, on_token=on_token)
    if on_run is not None:
        on_run(run)
    outcome = _wait(run)
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
            break
        lost = decision.lost_stages(last.run.plan.stage_count)
        cause = str(finished.fault)
        lost_at = last.outcome.ended_s  # the loop ended the run: the loss detected
        try:
            chain.replace(last.run.runner, lost, cause)
        except Exception as exc:  # ChainError: unplaceable, or the new chain did not bind
            not_recovered = str(exc)
            if interrupted.recoveries + 1 < policy.max_recoveries and chain.placeable:
                interrupted = attrs.evolve(interrupted, recoveries=interrupted.recoveries + 1)
                continue  # the new chain was lost in turn while binding: once more
            break
        replay = replay_of(interrupted, chain.run_id(), chain.context)
        if isinstance(replay, ReplayRefused):
            not_recovered = str(replay)
            break
        first = threading.Event()

        def forward(token_id: int, first: threading.Event = first) -> None:
            first.set()
            if on_token is not None:
                on_token(token_id)

        try:
            run = chain.submit_replay(replay, forward)
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
        if on_run is not None:
            on_run(run)
        outcome = _wait(run)
        marks = chain.heal_marks
        chain.recoveries.recovered(
            RecoveryTimes(
                ended_s=lost_at,
                stopped_s=marks.get("stopped", lost_at),
                placed_s=marks.get("placed", lost_at),
                started_s=marks.get("started", lost_at),
                bound_s=marks.get("bound", lost_at),
                first_token_s=outcome.token_times_s[0]
                if outcome.token_times_s
                else outcome.ended_s,
            )
        )
        segments.append(_Segment(run, outcome, replay))
        interrupted = Interrupted.of_replay(replay, run.plan, outcome.tokens)
        not_recovered = None
    return _stream_result(chain, segments, time.perf_counter() - began, not_recovered)


def _wait(run: ChainRun) -> RunOutcome:
    outcome = run.wait()
    assert outcome is not None  # wait() without a bound returns the outcome or raises
    return outcome


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
        logits=(),
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
