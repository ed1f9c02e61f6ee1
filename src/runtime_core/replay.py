"""Deterministic replay: a run a chain fault interrupted continues, as a new run, the
very stream its caller was reading.

Our runs are deterministic: the same prompt, sampling settings and worker give the same
tokens. So a run interrupted after delivering ``k`` tokens is started again (on the
re-placed chain) as a new run whose

- prompt is the original prompt plus the ``k`` delivered tokens,
- sampler resumes where the interrupted one stood after ``k`` tokens
  (``SamplingConfig.tokens_delivered``: seeded sampling takes one draw per token, greedy
  none; ``Sampler.for_run``),
- ``max_tokens`` is the original's less ``k``, with the same end-of-sequence token (the
  plan's) and the caller's stop strings kept as they were (they apply to the stream's
  text, which the replay continues),

so its first token is the stream's token ``k`` (``Replay.stream_sequence``), and every
token after it is what the unbroken run would have produced. A replay interrupted in
turn is replayed the same way (``Interrupted.of_replay``): the counts add up.

``replay_of(interrupted, run_id, max_seq_len)`` gives the ``Replay`` or a
``ReplayRefused`` naming why: the stream had already ended (its end-of-sequence token
or ``max_tokens`` delivered), or its prompt plus what is left to generate exceeds the
chain's ``max_seq_len``. ``plan_replay`` also plans it (``plan_run`` onto the re-placed
chain's placement), refusing when the new stages' KV budget cannot hold its cache.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs
from attrs import frozen

from runplan import (
    ModelFacts,
    NodePool,
    Placement,
    PlanRejection,
    RunPlan,
    RuntimeConfig,
    SamplingConfig,
    plan_run,
)
from runplan._fields import int_field, int_tuple_field, str_field, tuple_field, typed_field
from runplan.rejections import InvalidConfig


@frozen
class Interrupted:
    """What the caller had of a run when its chain broke: the run's own prompt and
    settings, and the tokens it delivered before the fault. ``stream_offset``: tokens of
    the caller's stream before this run (a replay's; 0 for an original run);
    ``recoveries``: how many times the stream was recovered before."""

    run_id: str = str_field()
    prompt: tuple[int, ...] = int_tuple_field()
    max_tokens: int = int_field()
    eos_token_id: int = int_field()
    sampling: SamplingConfig = typed_field(SamplingConfig)
    delivered: tuple[int, ...] = int_tuple_field()
    stop: tuple[str, ...] = tuple_field(str, default=())
    stream_offset: int = int_field(default=0)
    recoveries: int = int_field(default=0)
    #: ids besides eos_token_id that end a stream (the plan's: end of turn, ...)
    eog_token_ids: tuple[int, ...] = int_tuple_field(default=())

    @classmethod
    def of_plan(
        cls,
        plan: RunPlan,
        prompt: Sequence[int],
        delivered: Sequence[int],
        *,
        stop: Sequence[str] = (),
    ) -> Interrupted:
        """An original run of ``plan`` on ``prompt`` that delivered ``delivered``."""
        return cls(
            run_id=plan.run_id,
            prompt=tuple(prompt),
            max_tokens=plan.max_tokens,
            eos_token_id=plan.model.eos_token_id,
            sampling=plan.sampling,
            delivered=tuple(delivered),
            stop=tuple(stop),
            eog_token_ids=plan.model.eog_token_ids,
        )

    @classmethod
    def of_replay(cls, replay: Replay, plan: RunPlan, delivered: Sequence[int]) -> Interrupted:
        """The replay ``replay`` (planned as ``plan``), interrupted in turn after it
        delivered ``delivered``."""
        return cls(
            run_id=plan.run_id,
            prompt=replay.prompt,
            max_tokens=plan.max_tokens,
            eos_token_id=plan.model.eos_token_id,
            sampling=plan.sampling,
            delivered=tuple(delivered),
            stop=replay.stop,
            stream_offset=replay.stream_offset,
            recoveries=replay.recoveries,
            eog_token_ids=plan.model.eog_token_ids,
        )

    @property
    def ended(self) -> bool:
        """The stream had ended before the fault: its end-of-sequence token or its last
        token was delivered."""
        d = self.delivered
        return len(d) >= self.max_tokens or (bool(d) and self.ends_stream(d[-1]))

    def ends_stream(self, token_id: int) -> bool:
        """Whether ``token_id`` ends the stream: EOS or another end of generation."""
        return token_id == self.eos_token_id or token_id in self.eog_token_ids


class ReplayRefusal(enum.Enum):
    ALREADY_ENDED = "ALREADY_ENDED"  # nothing is left to generate
    EXCEEDS_MAX_SEQ_LEN = "EXCEEDS_MAX_SEQ_LEN"  # prompt + delivered + the rest > context
    EXCEEDS_KV_BUDGET = "EXCEEDS_KV_BUDGET"  # a new stage's budget cannot hold its cache
    NOT_PLANNED = "NOT_PLANNED"  # the planner's rejection of the replay


@frozen(str=False)
class ReplayRefused:
    """No replay of ``run_id``: ``reason``, and what it stands on."""

    run_id: str = str_field()
    reason: ReplayRefusal = typed_field(ReplayRefusal)
    detail: str = str_field()
    rejection: PlanRejection | None = typed_field((PlanRejection, type(None)), default=None)

    def __str__(self) -> str:
        return f"run {self.run_id!r} not replayed: {self.reason.value.lower()}: {self.detail}"


@frozen
class Replay:
    """The run that continues an interrupted stream."""

    run_id: str = str_field()
    interrupted_run_id: str = str_field()
    prompt: tuple[int, ...] = int_tuple_field()
    max_tokens: int = int_field()
    sampling: SamplingConfig = typed_field(SamplingConfig)
    stop: tuple[str, ...] = tuple_field(str)
    # Tokens of the caller's stream before this run's first: its token of sequence s is
    # the stream's token stream_offset + s.
    stream_offset: int = int_field()
    # Recoveries of the stream, this one included.
    recoveries: int = int_field()

    def stream_sequence(self, sequence: int) -> int:
        """Where this run's token ``sequence`` falls in the caller's stream."""
        return self.stream_offset + sequence

    def config(self, base: RuntimeConfig) -> RuntimeConfig:
        """``base`` (the chain's run-wide settings) for this run: its id, ``max_tokens``,
        sampling, and its prompt's length where ``base`` gives prompt lengths."""
        return attrs.evolve(
            base,
            run_id=self.run_id,
            max_tokens=self.max_tokens,
            sampling=self.sampling,
            prompt_tokens=len(self.prompt) if base.prompt_tokens > 0 else 0,
        )


def replay_of(interrupted: Interrupted, run_id: str, max_seq_len: int) -> Replay | ReplayRefused:
    """The replay of ``interrupted`` as run ``run_id`` on a chain of ``max_seq_len``
    positions, or why there is none. ``ValueError`` for a run id that is the
    interrupted run's (it stays stale)."""
    if run_id == interrupted.run_id:
        raise ValueError(f"a replay takes a new run id; {run_id!r} is the interrupted run's")
    i = interrupted
    k = len(i.delivered)
    if i.ended:
        return ReplayRefused(
            i.run_id,
            ReplayRefusal.ALREADY_ENDED,
            f"{k} of max_tokens {i.max_tokens} delivered"
            + (
                ", the last the end-of-sequence token"
                if k and i.ends_stream(i.delivered[-1])
                else ""
            ),
        )
    prompt = i.prompt + i.delivered
    left = i.max_tokens - k
    needed = len(prompt) + left - 1  # the last token is not fed back
    if needed > max_seq_len:
        return ReplayRefused(
            i.run_id,
            ReplayRefusal.EXCEEDS_MAX_SEQ_LEN,
            f"{len(i.prompt)} prompt + {k} delivered tokens + {left} to generate need "
            f"{needed} positions; max_seq_len is {max_seq_len}",
        )
    sampling = attrs.evolve(i.sampling, tokens_delivered=i.sampling.tokens_delivered + k)
    return Replay(
        run_id=run_id,
        interrupted_run_id=i.run_id,
        prompt=prompt,
        max_tokens=left,
        sampling=sampling,
        stop=i.stop,
        stream_offset=i.stream_offset + k,
        recoveries=i.recoveries + 1,
    )


def plan_replay(
    interrupted: Interrupted,
    run_id: str,
    facts: ModelFacts,
    base: RuntimeConfig,
    pool: NodePool,
    placement: Placement,
) -> tuple[Replay, RunPlan] | ReplayRefused:
    """The replay of ``interrupted`` and its plan on the chain ``placement`` gives (the
    re-placed chain's: ``runplan.replacement.Replacement.placement``), with the chain's
    settings ``base``; or why not (the planner's rejection named)."""
    replay = replay_of(interrupted, run_id, facts.max_seq_len)
    if isinstance(replay, ReplayRefused):
        return replay
    stage_count = len(placement.assignments) or len(placement.nodes)
    planned = plan_run(
        facts, replay.config(base), pool, stage_count=stage_count, placement=placement
    )
    if isinstance(planned, PlanRejection):
        budget = isinstance(planned, InvalidConfig) and planned.field == "kv_budget_bytes"
        return ReplayRefused(
            interrupted.run_id,
            ReplayRefusal.EXCEEDS_KV_BUDGET if budget else ReplayRefusal.NOT_PLANNED,
            str(planned),
            planned,
        )
    return replay, planned
