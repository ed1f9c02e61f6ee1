"""The plans of a warm chain's runs (``serve.chain.WarmChain``, whose base
``ChainPlans`` is): every run has the chain's stage facts (nodes, layer ranges, cache
length, KV budget, batch rows, whether tokens carry logits) and its own prompt length,
token limit and sampling; placed evenly (or by memory) until a re-placement gives its
rows.
"""

from __future__ import annotations

from typing import Any

from runplan import (
    ModelFacts,
    NodePool,
    NodeSpec,
    Placement,
    PlanRejection,
    RunPlan,
    RuntimeConfig,
    SamplingConfig,
    WorkerCapabilities,
    plan_run,
)
from runplan.config import Timeouts
from runplan.plan import OrchestratorEndpoint
from runplan.validate import U32_MAX
from runtime_core.runs import PlanRejected, plan_even
from runtime_cupy.edges.choice import choose_medium
from runtime_cupy.hosts.port import StageHost
from runtime_cupy.process.chain_runner import ORCHESTRATOR
from runtime_cupy.process.names import new_run_id
from runtime_cupy.workers import activation_dtype


def new_serve_run_id() -> str:
    return new_run_id("serve")


class ChainPlans:
    """The plans of a ``WarmChain``'s runs, its base: the chain's settings they take
    are set by ``WarmChain.__init__``."""

    facts: ModelFacts
    worker: str
    capabilities: WorkerCapabilities
    timeouts: Timeouts
    nodes: tuple[NodeSpec, ...]
    placement: str
    _placement: Placement | None
    host: StageHost
    edges: str
    max_concurrent: int
    kv_budget_bytes: int
    prefill_chunk: int
    logprobs: bool

    def _runs_in_budget(self) -> int:
        """How many full-length runs (the whole context) the smallest stage's KV budget
        holds, at most ``max_concurrent_runs``' 2**32 - 1 (a budget past any host's
        memory then refused by the planner naming it, not a run count never given);
        ``ValueError`` naming the stage when it holds none."""
        budget, self.kv_budget_bytes = self.kv_budget_bytes, 0
        self.max_concurrent = 1
        try:  # one full-length run's cache on each stage: the planner's figures
            alone = self.plan(new_serve_run_id(), max_tokens=1, sampling=SamplingConfig())
        finally:
            self.kv_budget_bytes = budget
        runs, index, need = min(
            (budget // s.kv_bytes, s.stage_index, s.kv_bytes) for s in alone.stages
        )
        if runs < 1:
            raise ValueError(
                f"a KV budget of {budget} bytes holds no full-length run on stage {index}: "
                f"one needs {need} bytes (a smaller context needs less)"
            )
        return min(runs, U32_MAX)

    @property
    def context(self) -> int:
        return self.facts.max_seq_len

    @property
    def model_id(self) -> str:
        return self.facts.model_id

    def plan(
        self,
        run_id: str,
        *,
        max_tokens: int,
        sampling: SamplingConfig,
        prompt_tokens: int = 0,
    ) -> RunPlan:
        """The plan of one run on these stages (``PlanRejected`` if the planner says
        no): every run has the chain's stage facts (cache length, KV budget:
        ``kv_budget_bytes`` or ``max_concurrent`` full-length runs, batch rows, and
        whether tokens come with their logits: ``logprobs``) and its own prompt length
        and token limit."""
        config = self._config(run_id, max_tokens, sampling, prompt_tokens)
        if self._placement is None:
            return plan_even(self.facts, config, ORCHESTRATOR, self.nodes, self.placement)
        pool = NodePool(ORCHESTRATOR, self.nodes)
        planned = plan_run(
            self.facts, config, pool, stage_count=len(self.nodes), placement=self._placement
        )
        if isinstance(planned, PlanRejection):
            raise PlanRejected(planned)
        return planned

    def _config(
        self, run_id: str, max_tokens: int, sampling: SamplingConfig, prompt_tokens: int
    ) -> RuntimeConfig:
        """A run's settings: the chain's (whether its tokens carry logits, ``logprobs``,
        included: the chain's token link is made for one kind of record, by the plan it
        starts with, a re-placed chain's too) and the run's own."""
        family, width = activation_dtype(self.worker, self.facts.architecture)
        return RuntimeConfig(
            run_id=run_id,
            max_tokens=max_tokens,
            activation_dtype_family=family,
            activation_dtype_width_bytes=width,
            sampling=sampling,
            timeouts=self.timeouts,
            worker=self.capabilities,
            prompt_tokens=prompt_tokens,
            max_concurrent_runs=self.max_concurrent,
            kv_budget_bytes=self.kv_budget_bytes,
            prefill_chunk=self.prefill_chunk,
            return_logits=self.logprobs,
        )

    def _medium(self, plan: RunPlan, edge: Any) -> str:
        def node(endpoint: Any) -> str:
            if isinstance(endpoint, OrchestratorEndpoint):
                return plan.orchestrator_node_id
            return str(endpoint.node_id)

        same = self.host.same_host(node(edge.producer), node(edge.consumer))
        return choose_medium(self.edges, same, edge.edge_id)
