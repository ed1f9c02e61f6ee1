"""The checker of a recovering chain (issue 25), over every chain of a
``RecoveryRun``; each chain is also checked on its own by ``chain_checker``.

- **Unbroken stream**: what the caller of every stream received (each run's tokens from
  its sequence 0, chain after chain) is, token for token, what its run produces
  unbroken (alone on a fault-free chain, same seed, same worker): all of it when the
  stream completed, a prefix when a fault or a recovery ended it.
- **Replay's prompt**: every replay's run is given its stream's prompt plus every token
  the stream's caller received before it, in order (a model continues the stream only
  from that context; the synthetic worker's tokens do not depend on it, so the
  unbroken stream alone cannot show a replay that drops or shortens it).
- **One outcome, as the policy decides**: for every run a chain's end found ended, the
  checker asks the recovery policy itself (the action's, the runtime's value) with what
  it reads of the stream: a ``Recover`` must be followed by exactly one run of the
  stream on the next chain, or end the stream with the replay's refusal or the
  re-placement's ``Unplaceable``; an ``End`` ends the stream there. A stream is served by
  at most one run per chain, and nothing serves it after it ended.
- **No stale run accepted**: on a re-placed chain, every run id of an earlier chain is
  stale: a late provision of each earlier chain's first run is refused as ``STALE_RUN``
  at every stage, no stage sets up, steps or reports ready for a stale run, and the
  orchestrator delivers no stale run's token.
- **No lost host**: a re-placed chain places no stage on a host lost before it (with
  ``host_lost``, the host of every stage that died).
"""

from __future__ import annotations

from collections.abc import Callable

from runplan.replacement import Unplaceable
from runtime_core.recovery import End, Recover
from runtime_core.replay import Interrupted, ReplayRefused
from runtime_sim.chain_driver import RunSpec
from runtime_sim.chain_recovery import Epoch, RecoveryRun, Stream, dead_hosts
from runtime_sim.chain_rules import Violation
from runtime_sim.links import ORCHESTRATOR

STREAM_UNBROKEN = "recovery: every stream holds its unbroken run's tokens, recovered or not"
REPLAY_PROMPT = (
    "recovery: every replay's prompt is its stream's prompt plus the tokens delivered before it"
)
STREAM_ONE_OUTCOME = "recovery: every stream ends with one outcome, as the recovery policy decides"
STALE_NEVER_ACCEPTED = "recovery: no stale run id is ever accepted again"
LOST_HOST_UNUSED = "recovery: a re-placed chain places no stage on a lost host"

RECOVERY_RULES = (
    STREAM_UNBROKEN,
    REPLAY_PROMPT,
    STREAM_ONE_OUTCOME,
    STALE_NEVER_ACCEPTED,
    LOST_HOST_UNUSED,
)

#: Runs one run alone on a fault-free chain (same seed, same worker): its tokens.
Unbroken = Callable[[RunSpec], tuple[int, ...]]
#: What a stage does for a run it accepted.
_ACCEPTED = frozenset({"BeginSetup", "ExecuteStep", "SendToOrchestrator"})


def check_recovery(run: RecoveryRun, unbroken: Unbroken) -> list[Violation]:
    """Every violation of the recovery rules in ``run`` (empty when it kept them)."""
    out: list[Violation] = []
    if run.action is None:
        return out
    received = _received(run, out)
    for stream, got in zip(run.streams, received, strict=True):
        _unbroken(stream, tuple(got), unbroken, out)
    _replay_prompts(run, out)
    _outcomes(run, out)
    stale: set[str] = set()
    lost: set[str] = set()
    for n, epoch in enumerate(run.epochs):
        if n:
            _stale(epoch, n, stale, out)
            used = sorted(lost & {s.node_id for s in epoch.sim.plan.stages})
            if used:
                out.append(
                    Violation(
                        LOST_HOST_UNUSED,
                        0,
                        f"chain {n} places stages on {used}, lost before it",
                    )
                )
        stale |= {i for r in epoch.result.runs for i in r.chain_ids}
        if run.action.host_lost:
            lost |= dead_hosts(epoch)
    return out


def _received(run: RecoveryRun, out: list[Violation]) -> list[list[int]]:
    """The stream each caller read: the tokens its runs' callers received, chain after
    chain, each run's from its sequence 0 on (a replay's token ``s`` is its stream's
    next)."""
    streams: list[list[int]] = [[] for _ in run.streams]
    for n, epoch in enumerate(run.epochs):
        for s, r in zip(epoch.streams, epoch.result.runs, strict=True):
            for k, (_run_id, sequence, token) in enumerate(r.delivered):
                if sequence != k:
                    out.append(
                        Violation(
                            STREAM_UNBROKEN,
                            0,
                            f"chain {n}: the caller of {r.run_id!r} got sequence {sequence} "
                            f"as its token {k}",
                        )
                    )
                streams[s].append(token)
    return streams


def _unbroken(
    stream: Stream, got: tuple[int, ...], unbroken: Unbroken, out: list[Violation]
) -> None:
    alone = unbroken(stream.spec)
    same = alone == got if stream.outcome == "completed" else alone[: len(got)] == got
    if not same:
        out.append(
            Violation(
                STREAM_UNBROKEN,
                0,
                f"stream of {stream.run_ids[0]!r} ({stream.outcome}, through {stream.run_ids}) "
                f"got {list(got)}; unbroken {list(alone)}",
            )
        )


def _replay_prompts(run: RecoveryRun, out: list[Violation]) -> None:
    """Each run of a re-placed chain was given its stream's prompt plus the tokens its
    stream's caller received on the chains before."""
    had: list[list[int]] = [[] for _ in run.streams]  # each stream's tokens so far
    for n, epoch in enumerate(run.epochs):
        for s, spec, r in zip(epoch.streams, epoch.sim.runs, epoch.result.runs, strict=True):
            if n:
                stream = run.streams[s]
                expected = tuple(stream.spec.prompt) + tuple(had[s])
                given = tuple(spec.prompt)
                if given != expected:
                    at = _first_difference(given, expected)
                    out.append(
                        Violation(
                            REPLAY_PROMPT,
                            0,
                            f"chain {n}: replay {r.run_id!r} of stream {s} was given a prompt "
                            f"of {len(given)} tokens; expected {len(stream.spec.prompt)} + "
                            f"{len(had[s])} delivered, first differing at position {at}",
                        )
                    )
            had[s].extend(token for _run_id, _sequence, token in r.delivered)


def _first_difference(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The first position where ``a`` and ``b`` differ (the shorter's length when one
    is a prefix of the other)."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _outcomes(run: RecoveryRun, out: list[Violation]) -> None:
    """Each chain's ended runs, the policy's decision for each (asked here, from the
    stream as the caller had it), and what followed."""
    assert run.action is not None
    policy = run.action.policy
    epochs = run.epochs
    offset = [0] * len(run.streams)  # tokens each stream had before its current run
    served: list[int | None] = [None] * len(run.streams)  # the last chain serving each
    for n, epoch in enumerate(epochs):
        after = epochs[n + 1].streams if n + 1 < len(epochs) else ()
        if len(set(epoch.streams)) != len(epoch.streams):
            out.append(Violation(STREAM_ONE_OUTCOME, 0, f"chain {n} serves a stream twice"))
        chain_fault = epoch.sim.orchestrator.controller.broken
        for k, s in enumerate(epoch.streams):
            stream = run.streams[s]
            if served[s] is not None and served[s] != n - 1:
                out.append(
                    Violation(STREAM_ONE_OUTCOME, 0, f"stream {s} served again on chain {n}")
                )
            served[s] = n
            spec = epoch.sim.runs[k]
            result = epoch.result.runs[k]
            finished = result.finished
            if finished is None:
                continue  # no end: the chain's own checker names it (liveness)
            plan = spec.plan
            interrupted = Interrupted(
                run_id=plan.run_id,
                prompt=spec.prompt,
                max_tokens=plan.max_tokens,
                eos_token_id=plan.model.eos_token_id,
                sampling=plan.sampling,
                delivered=finished.tokens,
                stream_offset=offset[s],
                recoveries=n,
                eog_token_ids=plan.model.eog_token_ids,
            )
            offset[s] += len(finished.tokens)
            decision = policy.decide(interrupted, finished, chain_fault=chain_fault)
            continued = s in after
            name = f"stream {s} (run {plan.run_id!r} of chain {n})"
            if isinstance(decision, Recover):
                # Continued on the next chain, or ended here by the recovery itself.
                refused = isinstance(stream.end, ReplayRefused | Unplaceable)
                if not continued and not refused:
                    out.append(
                        Violation(
                            STREAM_ONE_OUTCOME,
                            0,
                            f"{name}: the policy recovers it ({decision.cause}); it ended "
                            f"{stream.end}",
                        )
                    )
            elif (
                continued
                or not isinstance(stream.end, End)
                or stream.end.reason is not decision.reason
            ):
                out.append(
                    Violation(
                        STREAM_ONE_OUTCOME,
                        0,
                        f"{name}: the policy ends it ({decision.reason.value}); it "
                        + ("continued" if continued else f"ended {stream.end}"),
                    )
                )


def _stale(epoch: Epoch, n: int, stale: set[str], out: list[Violation]) -> None:
    """Chain ``n`` (after ``n`` chains, each of which sent a stale provision to each of
    its stages) accepted none of the ``stale`` run ids."""
    sim = epoch.sim
    sent = len(epoch.stale_forgeries)
    if sent != n * len(sim.stages):
        out.append(
            Violation(
                STALE_NEVER_ACCEPTED,
                0,
                f"chain {n}: {sent} stale provisions to {len(sim.stages)} stages, "
                f"{n} chains before it",
            )
        )
    for node, run_id, reason in epoch.stale_forgeries:
        if reason != "STALE_RUN":
            out.append(
                Violation(
                    STALE_NEVER_ACCEPTED,
                    0,
                    f"{node} answered a late provision of stale run {run_id!r} with {reason}",
                )
            )
    for time_us, actor, kind, what, d in sim.trace.entries:
        if kind != "act" or not d or d[0] not in stale:
            continue
        if (actor != ORCHESTRATOR and what in _ACCEPTED) or (
            actor == ORCHESTRATOR and what == "DeliverToken"
        ):
            out.append(
                Violation(STALE_NEVER_ACCEPTED, time_us, f"{actor}: {what} of stale run {d[0]!r}")
            )
