"""The rules a chain's runs keep, as data: each rule's name (``ALL_RULES``, the ring
rules of ``chain_ring_rules`` among them), the time bound of the liveness rules, and a
broken rule's record (``Violation``). ``chain_checker`` reads them off a simulation's
trace."""

from __future__ import annotations

from attrs import frozen

from runplan import RunPlan
from runplan.config import batch_runs, shared_batch_rows, shared_batches
from runtime_sim.chain_driver import RunSpec
from runtime_sim.chain_ring_rules import NO_OVERWRITE, PUBLISH_ORDER, RELEASE_AT_LOAD


@frozen
class Violation:
    rule: str
    time_us: int
    detail: str

    def __str__(self) -> str:
        return f"{self.rule} (t={self.time_us} us): {self.detail}"


PLAN = "plan: layer and edge assignment"
READY_BEFORE_INJECT = "readiness: a run's prompt injected before every stage reported StageReady"
READY_AFTER_SETUP = "readiness: StageReady before worker, shard and both links were ready"
PREFILL_IS_ZERO = "execution: a run's first step is sequence 0"
INCREASING = "execution: a run's steps strictly increasing (sequence, then chunk)"
LOADED_BEFORE_EXECUTE = "execution: a stage executes a record only after loading it"
SAME_SEQUENCE = "execution: a stage's output is its step's (run, sequence, chunk)"
CONSUME_BEFORE_INJECT = "execution: sequence s + 1 injected only after consuming token s"
ONE_OUTCOME = "termination: one terminal outcome per run"
NO_INJECT_AFTER_END = "termination: no injection after the run's outcome"
TEARDOWN_TO_ALL = "termination: teardown sent to every provisioned stage"
LIVENESS_OUTCOME = "liveness: one terminal outcome within the time bound"
LIVENESS_STOP_RUN = "liveness: StopRun reaches every provisioned stage still alive"
LIVENESS_STOPPED = "liveness: every stage still alive ends holding no run"
SECURITY = "security: forged input is rejected and changes nothing"
HARMLESS = "outcome: a run struck by no harmful fault completes, no stage faulting it"
ISOLATION = "isolation: a run's tokens reach only its caller, as its last stage made them"
BATCH_INVARIANCE = "batch invariance: a run's tokens equal its tokens when it runs alone"
KV_FREED = "memory: every KV reservation is freed at the chain's end"
ONE_BATCH = "batching: one batch at a time per stage"
ONE_STEP_PER_RUN = "batching: at most one step per run in a batch"
STEP_ORDER = "batching: a stage feeds each run's records in the order it loaded them"
KV_WITHIN_BUDGET = "memory: a stage's runs never reserve more KV cache than its budget"
KV_HELD_ENDS = "memory: a run held for KV memory is offered again or ends cancelled or faulted"
BATCHES_REPORTED = "batching: a stage's StageStopped messages report each of its batches once"

ALL_RULES = (
    PLAN,
    READY_BEFORE_INJECT,
    READY_AFTER_SETUP,
    PREFILL_IS_ZERO,
    INCREASING,
    LOADED_BEFORE_EXECUTE,
    SAME_SEQUENCE,
    CONSUME_BEFORE_INJECT,
    ONE_OUTCOME,
    NO_INJECT_AFTER_END,
    TEARDOWN_TO_ALL,
    NO_OVERWRITE,
    PUBLISH_ORDER,
    RELEASE_AT_LOAD,
    LIVENESS_OUTCOME,
    LIVENESS_STOP_RUN,
    LIVENESS_STOPPED,
    SECURITY,
    HARMLESS,
    ISOLATION,
    BATCH_INVARIANCE,
    KV_FREED,
    KV_WITHIN_BUDGET,
    KV_HELD_ENDS,
    ONE_BATCH,
    ONE_STEP_PER_RUN,
    STEP_ORDER,
    BATCHES_REPORTED,
)


def time_bound_us(plan: RunPlan) -> int:
    """When a run must have ended once it starts: every stage's setup, one token per
    allowed token (each bounded by the token timeout: the prompt's by its rows, at most
    the cache's length), the stop timeout, and slack for notices."""
    t = plan.timeouts
    batch_rows = max(
        shared_batch_rows(plan.max_batch_rows, s.kv_bytes, s.kv_budget_bytes) for s in plan.stages
    )
    slots = min(e.ring_spec.slot_count for e in plan.edges)
    most, positions = plan.max_batch_rows, plan.kv_positions
    batches = max(
        shared_batches(batch_runs(most, s.kv_bytes, s.kv_budget_bytes, positions), slots)
        for s in plan.stages
    )
    longest, size = plan.model.max_seq_len, plan.prefill_chunk
    chunks, rows = (-(-longest // size), size) if 0 < size < longest else (1, longest)
    prompt_ms = t.token_limit_ms(plan.stage_count, chunks, rows, batch_rows, batches)
    token_ms = t.token_limit_ms(plan.stage_count, 1, 1, batch_rows, batches)
    stop_ms = t.stop_limit_ms(rows, batch_rows)
    return (t.ready_ms + prompt_ms + plan.max_tokens * token_ms + stop_ms) * 1000 + 1_000_000


def chain_bound_us(runs: tuple[RunSpec, ...]) -> int:
    """When every run must have ended: the last arrival, then each run's bound in turn
    (a run may wait for every other to free its cache, or to take its tokens: its token
    timer starts again while the chain delivers tokens, a limited number of times)."""
    return max(r.arrival_us for r in runs) + sum(time_bound_us(r.plan) for r in runs)
