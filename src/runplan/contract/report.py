"""``check_contract``: every clause of RUNPLAN_CONTRACT.md over one plan and its
provisions, each with a verdict. A clause is broken by what its own check finds, or
by the rejection ``check_plan`` returns for a guarantee of that clause."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from attrs import frozen

from runplan._fields import str_field, tuple_field, typed_field
from runplan.check import check_plan
from runplan.contract import plan_clauses as pc
from runplan.contract import provision_clauses as qc
from runplan.contract import spec_clauses as sc
from runplan.contract.clauses import CLAUSE, CLAUSES, Clause
from runplan.contract.plan_clauses import Check
from runplan.contract.subject import NotChecked, PlanInputs, Subject, make_subject
from runplan.messages import ProvisionStage
from runplan.plan import RunPlan
from runplan.rejections import PlanRejection

#: The check of each clause, by clause name.
CHECKS: dict[str, Check] = {
    "planner_emits_exactly_one_runplan_or_a_typed_rejection": pc.one_plan_or_rejection,
    "planner_never_emits_a_partial_plan": pc.never_partial,
    "planner_never_mutates_the_pool_or_derives_hidden_topology": pc.no_hidden_topology,
    "stage_ranges_are_contiguous": pc.contiguous,
    "stage_ranges_do_not_overlap": pc.no_overlap,
    "union_covers_the_intended_gguf_block_range": pc.union_covers,
    "every_stage_has_exactly_one_non_empty_range": pc.non_empty,
    "stage_indices_are_0_to_stage_count_minus_1": pc.indices,
    "every_edge_id_is_unique_within_the_run": pc.unique_edge_ids,
    "every_edge_has_exactly_one_producer_and_one_consumer": pc.one_producer_one_consumer,
    "token_in_edge_is_orchestrator_to_stage_0": pc.token_in,
    "activation_edge_i_is_stage_i_to_stage_i_plus_1": pc.activation,
    "token_out_edge_is_stage_n_minus_1_to_orchestrator": pc.token_out,
    "stages_do_not_derive_edge_ids": pc.edge_ids_handed,
    "deriving_provision_stage_is_deterministic": qc.deterministic,
    "a_stage_receives_only_its_own_layer_range": qc.own_layer_range,
    "a_stage_receives_one_inbound_and_one_outbound_edge_provision": qc.one_inbound_one_outbound,
    "outbound_provision_contains_the_consumer_node_id": qc.outbound_consumer,
    "inbound_provision_does_not_require_producer_address": qc.inbound_needs_no_producer,
    "no_provision_contains_remote_actor_addresses": qc.no_remote_addresses,
    "every_edge_has_an_object_spec_and_a_ring_spec": sc.object_and_ring_specs,
    "activation_max_extent_follows_the_model_facts": sc.activation_extent,
    "token_edges_use_token_specs_and_activation_edges_activation_specs": (
        sc.token_and_activation_specs
    ),
    "specs_are_copied_consistently_into_stage_provisions": sc.copied_into_provisions,
    "invalid_extent_alignment_dtype_width_or_layout_rejects": sc.valid_specs,
    "unknown_node_id_rejects": pc.known_nodes,
    "duplicate_stage_assignment_rejects": pc.no_duplicate_assignment,
    "missing_stage_rejects": pc.no_missing_stage,
    "invalid_stage_count_rejects": pc.valid_stage_count,
    "edge_endpoint_mismatch_rejects": pc.named_endpoints,
    "inconsistent_model_facts_reject": pc.consistent_facts,
    "planner_is_the_only_source_of_assignment": pc.only_source,
}

_LAYER_CLAUSES = (
    "stage_ranges_are_contiguous",
    "stage_ranges_do_not_overlap",
    "union_covers_the_intended_gguf_block_range",
    "every_stage_has_exactly_one_non_empty_range",
)
_RUN_WIDE = ("planner_emits_exactly_one_runplan_or_a_typed_rejection",)

#: The clauses a ``check_plan`` rejection of each code is reported under: the first
#: of them that its own check finds broken, else the first.
REJECTION_CLAUSES: dict[str, tuple[str, ...]] = {
    "unknown_node": ("unknown_node_id_rejects",),
    "duplicate_node": ("duplicate_stage_assignment_rejects",),
    "duplicate_stage": ("duplicate_stage_assignment_rejects",),
    "missing_stage": ("missing_stage_rejects",),
    "invalid_stage_count": ("invalid_stage_count_rejects",),
    "invalid_layer_range": _LAYER_CLAUSES,
    "edge_endpoint_mismatch": ("edge_endpoint_mismatch_rejects",),
    "duplicate_edge_id": ("every_edge_id_is_unique_within_the_run",),
    "inconsistent_model_facts": ("inconsistent_model_facts_reject",),
    "invalid_extent": ("invalid_extent_alignment_dtype_width_or_layout_rejects",),
    "invalid_alignment": ("invalid_extent_alignment_dtype_width_or_layout_rejects",),
    "invalid_dtype_width": ("invalid_extent_alignment_dtype_width_or_layout_rejects",),
    "unsupported_layout": ("invalid_extent_alignment_dtype_width_or_layout_rejects",),
    # A plan with a setting no run can have is one the planner should have rejected.
    "invalid_config": _RUN_WIDE,
    "unsupported_model": _RUN_WIDE,
    "insufficient_memory": _RUN_WIDE,
    # Stages or edges that disagree with the rest of the plan: not a whole plan.
    "inconsistent_plan": ("planner_never_emits_a_partial_plan",),
}


class Outcome(enum.Enum):
    HOLDS = "holds"
    BROKEN = "broken"
    NOT_CHECKED = "not_checked"  # nothing to look at without the planner's inputs


@frozen
class Verdict:
    clause: Clause = typed_field(Clause)
    outcome: Outcome = typed_field(Outcome)
    problems: tuple[str, ...] = tuple_field(str, default=())  # what the clause's check found
    rejection: PlanRejection | None = typed_field((PlanRejection, type(None)), default=None)
    note: str = str_field(default="")  # why it was not checked

    @property
    def holds(self) -> bool:
        return self.outcome is not Outcome.BROKEN

    def explain(self) -> str:
        """One line: what broke the clause (or why it was not checked)."""
        parts = list(self.problems[:1])
        if len(self.problems) > 1:
            parts[0] += f" (and {len(self.problems) - 1} more)"
        if self.rejection is not None:
            parts.append(f"check_plan rejects it: {self.rejection}")
        return "; ".join(parts) or self.note


@frozen
class ContractReport:
    verdicts: tuple[Verdict, ...] = tuple_field(Verdict)
    rejection: PlanRejection | None = typed_field((PlanRejection, type(None)))  # check_plan's
    provisions_given: bool = typed_field(bool)

    @property
    def holds(self) -> bool:
        """Every clause holds (those not checked do not count as broken)."""
        return all(v.holds for v in self.verdicts)

    @property
    def broken(self) -> tuple[Verdict, ...]:
        return tuple(v for v in self.verdicts if v.outcome is Outcome.BROKEN)

    def verdict(self, name: str) -> Verdict:
        return next(v for v in self.verdicts if v.clause.name == name)


_MAX_PROBLEMS = 20


def _run(name: str, subject: Subject, rejection: PlanRejection | None) -> Verdict:
    clause = CLAUSE[name]
    problems: list[str] = []
    note = ""
    try:
        for problem in CHECKS[name](subject):
            problems.append(problem)
            if len(problems) == _MAX_PROBLEMS:
                break
    except NotChecked as exc:
        note = str(exc)
    outcome = Outcome.BROKEN if problems or rejection else Outcome.HOLDS
    if note and outcome is Outcome.HOLDS:
        outcome = Outcome.NOT_CHECKED
    return Verdict(clause, outcome, tuple(problems), rejection, note)


def _attribute(rejection: PlanRejection | None, verdicts: dict[str, Verdict]) -> str | None:
    """The clause a ``check_plan`` rejection is reported under."""
    if rejection is None:
        return None
    candidates = REJECTION_CLAUSES.get(rejection.code, _RUN_WIDE)
    return next((c for c in candidates if verdicts[c].problems), candidates[0])


def check_contract(
    plan: RunPlan,
    provisions: Sequence[ProvisionStage] | None = None,
    *,
    inputs: PlanInputs | None = None,
) -> ContractReport:
    """Every clause over ``plan`` and ``provisions`` (derived with ``provision_all``
    when not given). With the planner's ``inputs``, clauses are also checked against
    them (node pool, facts, config); without, a clause that needs them is not
    checked."""
    subject = make_subject(plan, provisions, inputs)
    rejection = check_plan(plan)
    found = None if isinstance(rejection, RunPlan) else rejection
    verdicts = {c.name: _run(c.name, subject, None) for c in CLAUSES}
    blamed = _attribute(found, verdicts)
    if blamed is not None:
        verdicts[blamed] = _run(blamed, subject, found)
    return ContractReport(tuple(verdicts.values()), found, provisions is not None)


def check_clause(
    name: str,
    plan: RunPlan,
    provisions: Sequence[ProvisionStage] | None = None,
    *,
    inputs: PlanInputs | None = None,
) -> Verdict:
    """The verdict on one clause (by name, see ``CLAUSES``)."""
    if name not in CLAUSE:
        raise KeyError(f"no clause named {name!r}")
    subject = make_subject(plan, provisions, inputs)
    result = check_plan(plan)
    found = None if isinstance(result, RunPlan) else result
    candidates = REJECTION_CLAUSES.get(found.code, _RUN_WIDE) if found is not None else ()
    if name not in candidates:
        return _run(name, subject, None)
    verdicts = {c: _run(c, subject, None) for c in candidates}
    return _run(name, subject, found) if _attribute(found, verdicts) == name else verdicts[name]
