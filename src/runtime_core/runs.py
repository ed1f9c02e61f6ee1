"""What both runtimes do to plan a run on one host: read the model's facts once, size
the KV cache for the prompt and the tokens asked for, and plan an even split."""

from __future__ import annotations

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


class PlanRejected(ValueError):
    """The planner rejected the run; ``rejection`` says why."""

    def __init__(self, rejection: PlanRejection) -> None:
        self.rejection = rejection
        super().__init__(str(rejection))


def facts_for_run(model_path: str, *, prompt_len: int, max_tokens: int) -> ModelFacts:
    """The model's facts with ``max_seq_len`` just long enough for the prompt and the
    tokens asked for; ``ValueError`` past the model's context length."""
    facts = model_facts_from_gguf(model_path)
    needed = prompt_len + max_tokens
    if needed > facts.context_length:
        raise ValueError(
            f"prompt ({prompt_len}) + max_tokens ({max_tokens}) = {needed} exceeds the "
            f"model's context length {facts.context_length}"
        )
    return attrs.evolve(facts, max_seq_len=needed)


def plan_even(
    facts: ModelFacts, config: RuntimeConfig, orchestrator: str, nodes: tuple[NodeSpec, ...]
) -> RunPlan:
    """One stage per node, layers split evenly; ``PlanRejected`` if the planner says no."""
    result = plan_run(
        facts,
        config,
        NodePool(orchestrator, nodes),
        stage_count=len(nodes),
        placement=Placement.even([n.node_id for n in nodes]),
    )
    if isinstance(result, PlanRejection):
        raise PlanRejected(result)
    return result
