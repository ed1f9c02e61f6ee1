"""What both runtimes do to plan a run on one host: read the model's facts once, size
the KV cache for the prompt and the tokens asked for, and plan an even split; and the
prompt token ids every entry point takes."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import attrs

from runplan import (
    ModelFacts,
    NodePool,
    NodeSpec,
    Placement,
    PlanRejection,
    RunPlan,
    RuntimeConfig,
    model_facts_from_gguf,
    plan_run,
)
from runplan.config import run_positions
from runplan.facts import context_limit
from runplan.picklable_error import PicklableError
from runplan.plan import U64_MAX
from runplan.planner import run_too_long


class PlanRejected(PicklableError, ValueError):
    """The planner rejected the run; ``rejection`` says why."""

    def __init__(self, rejection: PlanRejection) -> None:
        self.rejection = rejection
        super().__init__(str(rejection))


def token_id(value: Any) -> int:
    """``value`` as a token id (a NumPy integer as its value); ``TypeError`` for a bool
    (``True`` ran as token 1) or what is no integer (``int(5.9)`` ran as 5)."""
    if isinstance(value, bool):
        raise TypeError(f"{value!r} is a bool, not a token id")
    return operator.index(value)


def token_ids(prompt: Iterable[object]) -> tuple[int, ...]:
    """``prompt``'s token ids (``token_id``), checked before anything runs;
    ``TypeError`` naming the first that is none by its position."""
    ids: list[int] = []
    for j, t in enumerate(prompt):
        try:
            ids.append(token_id(t))
        except TypeError:
            raise TypeError(f"prompt token {j} is {t!r}, not a token id") from None
    return tuple(ids)


def run_seed(seed: int, index: int) -> int:
    """The sampling seed of run ``index`` of several started from ``seed``: ``seed +
    index`` modulo 2**64, so that run 0 samples what one run of ``seed`` samples and a
    seed near 2**64 - 1 gives every run a seed of its own. A ``seed`` outside
    ``0..2**64-1`` is left as it is, for the planner to refuse by name."""
    return (seed + index) % (U64_MAX + 1) if 0 <= seed <= U64_MAX else seed


def facts_for_run(model_path: str, *, prompt_len: int, max_tokens: int) -> ModelFacts:
    """The model's facts with ``max_seq_len`` just long enough for the prompt and the
    tokens asked for (``run_positions``: the last token generated is not fed back);
    past the model's context length, ``PlanRejected`` with the planner's rejection of a
    run too long for its ``max_seq_len`` (``invalid_config``, naming the prompt's tokens
    or ``max_tokens``). A ``max_tokens`` below 1 is left to the run's config check
    (``PlanRejected`` naming it), not made a ``max_seq_len`` the facts' check would name
    instead; and one that is no int (``numpy.int64(2)``) a ``TypeError`` naming it."""
    for name, value in (("max_tokens", max_tokens), ("prompt_len", prompt_len)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, not {type(value).__name__} ({value!r})")
    facts = model_facts_from_gguf(model_path)
    if max_tokens < 1:
        return facts
    limit = context_limit(facts)  # None: the file states none, the run's own length
    rejection = (
        None
        if limit is None
        else run_too_long(prompt_len, max_tokens, limit, "the model's context length")
    )
    if rejection is not None:
        raise PlanRejected(rejection)
    return attrs.evolve(facts, max_seq_len=run_positions(prompt_len, max_tokens))


#: What ``placement`` takes: layers split evenly, or in proportion to node memory.
PLACEMENTS = ("even", "memory")


def plan_even(
    facts: ModelFacts,
    config: RuntimeConfig,
    orchestrator: str,
    nodes: tuple[NodeSpec, ...],
    placement: str = "even",
    *,
    stage_count: int | None = None,
) -> RunPlan:
    """One stage per node, layers split evenly (``placement="memory"``: in proportion
    to node memory); ``PlanRejected`` if the planner says no. ``stage_count``: the
    stages the caller asked for (by default one per node), which the planner checks, so
    that a count below 1, for which no node was made, is refused naming that count."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r} (one of {', '.join(PLACEMENTS)})")
    ids = [n.node_id for n in nodes]
    result = plan_run(
        facts,
        config,
        NodePool(orchestrator, nodes),
        stage_count=len(nodes) if stage_count is None else stage_count,
        placement=Placement.even(ids) if placement == "even" else Placement.by_memory(ids),
    )
    if isinstance(result, PlanRejection):
        raise PlanRejected(result)
    return result
