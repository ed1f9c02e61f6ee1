"""One assertion per clause of RUNPLAN_CONTRACT.md, named after it: ``assert_<clause>``
over a plan and its provisions (derived with ``provision_all`` when not given), and
optionally the planner inputs the plan was made from. A broken clause raises an
``AssertionError`` that quotes the clause and says what broke it.

Needs nothing beyond ``runplan`` (no Hypothesis, no pytest)::

    from runplan.testing import assert_contract, assert_stage_ranges_are_contiguous

    plan = my_planner(facts, config, pool, stage_count=2, placement=placement)
    assert_stage_ranges_are_contiguous(plan)
    assert_contract(plan, provisions_i_sent)  # every clause at once

A rejection where a plan was expected fails the assertion (except for the first
clause, which a typed rejection keeps). ``assert_unknown_node_id_rejects`` needs
``inputs=``: a plan does not carry its node pool.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from runplan.contract import CLAUSE, Outcome, PlanInputs, Verdict, check_clause, check_contract
from runplan.messages import ProvisionStage
from runplan.plan import RunPlan
from runplan.rejections import REJECTIONS, PlanRejection

Plan = RunPlan | PlanRejection  # a rejection where a plan was expected fails
Provisions = Sequence[ProvisionStage] | None
Inputs = PlanInputs | None
_FIRST = "planner_emits_exactly_one_runplan_or_a_typed_rejection"


def _lines(verdict: Verdict) -> str:
    items = list(verdict.problems)
    if verdict.rejection is not None:
        items.append(f"check_plan rejects the plan: {verdict.rejection}")
    return "".join(f"\n  - {item}" for item in items)


def _describe(result: object) -> str:
    if isinstance(result, PlanRejection):
        return f"the rejection {result}"
    return f"a {type(result).__name__}"


def _assert(name: str, plan: object, provisions: Provisions, inputs: PlanInputs | None) -> None:
    clause = CLAUSE[name]
    if isinstance(plan, PlanRejection):
        if name == _FIRST and REJECTIONS.get(plan.code) is type(plan):
            return  # a typed rejection, and nothing else, is what the clause allows
        if name == _FIRST:
            raise AssertionError(
                f"{clause.quote()} is broken: {type(plan).__name__} (code {plan.code!r}) is "
                "not one of the typed rejections (runplan.rejections.REJECTIONS)"
            )
        raise AssertionError(f"{clause.quote()}: expected a RunPlan, got {_describe(plan)}")
    if not isinstance(plan, RunPlan):
        raise AssertionError(
            f"{clause.quote()} is broken: expected a RunPlan, got {_describe(plan)}"
        )
    verdict = check_clause(name, plan, provisions, inputs=inputs)
    if verdict.outcome is Outcome.BROKEN:
        raise AssertionError(f"{clause.quote()} is broken:{_lines(verdict)}")
    if verdict.outcome is Outcome.NOT_CHECKED:
        raise ValueError(f"assert_{name} cannot check this clause: {verdict.note}")


def assert_contract(plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None) -> None:
    """Every clause at once; the error lists each broken clause. Clauses that need the
    planner's inputs are skipped when ``inputs`` is not given."""
    if not isinstance(plan, RunPlan):
        raise AssertionError(f"expected a RunPlan, got {_describe(plan)}")
    report = check_contract(plan, provisions, inputs=inputs)
    if report.broken:
        raise AssertionError(
            f"{len(report.broken)} clauses of RUNPLAN_CONTRACT.md are broken:"
            + "".join(f"\n{v.clause.quote()}{_lines(v)}" for v in report.broken)
        )


def assert_rejected(
    result: object,
    expected: type[PlanRejection],
    *,
    clause: str,
    values: Mapping[str, Any] | None = None,
) -> None:
    """``result`` is a rejection of type ``expected`` carrying ``values`` (by field; a
    list and the tuple a rejection carries compare equal, as ``--json`` prints tuples);
    else an ``AssertionError`` quoting ``clause`` (a clause name). ``ValueError`` for a
    clause name that is none, or a key of ``values`` that is no field of ``expected``,
    and ``TypeError`` for an ``expected`` that is no rejection class: mistakes in the
    test, not in the planner."""
    if clause not in CLAUSE:
        close = difflib.get_close_matches(str(clause), CLAUSE, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"no clause named {clause!r}{hint} (runplan.contract.CLAUSE's keys)")
    if not (isinstance(expected, type) and issubclass(expected, PlanRejection)):
        raise TypeError(
            f"expected must be a PlanRejection class (runplan.rejections.REJECTIONS), "
            f"not {expected!r}"
        )
    names = attrs.fields_dict(expected)
    unknown = [key for key in (values or {}) if key not in names]
    if unknown:
        raise ValueError(
            f"{expected.__name__} has no field {unknown[0]!r} to compare "
            f"(its fields: {', '.join(names)})"
        )
    quote = CLAUSE[clause].quote()
    if not isinstance(result, expected):
        raise AssertionError(
            f"{quote} is broken: expected a {expected.__name__} rejection "
            f"({expected.code!r}), got {_describe(result)}"
        )
    fields = attrs.asdict(result, recurse=False)
    for key, want in (values or {}).items():
        if _as_lists(fields[key]) != _as_lists(want):
            raise AssertionError(
                f"{quote}: the {expected.__name__} rejection carries {key}="
                f"{fields[key]!r}, not the offending {want!r}: {result}"
            )


def _as_lists(value: object) -> object:
    """``value`` with its tuples as lists: a rejection carries tuples, and ``--json``
    prints them as lists, which a test may compare them to."""
    if isinstance(value, tuple | list):
        return [_as_lists(v) for v in value]
    return value


# -- one per clause, in the spec's order ---------------------------------------------


def assert_planner_emits_exactly_one_runplan_or_a_typed_rejection(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """RunPlan Formation: Given model facts, runtime config, intended node pool, stage count,
    and placement input, the planner either emits exactly one `RunPlan` or a typed
    rejection."""
    _assert("planner_emits_exactly_one_runplan_or_a_typed_rejection", plan, provisions, inputs)


def assert_planner_never_emits_a_partial_plan(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """RunPlan Formation: It never emits a partial plan."""
    _assert("planner_never_emits_a_partial_plan", plan, provisions, inputs)


def assert_planner_never_mutates_the_pool_or_derives_hidden_topology(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """RunPlan Formation: It never mutates the candidate pool or derives hidden topology
    outside the plan."""
    _assert("planner_never_mutates_the_pool_or_derives_hidden_topology", plan, provisions, inputs)


def assert_stage_ranges_are_contiguous(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Layer Assignment: Stage ranges are contiguous."""
    _assert("stage_ranges_are_contiguous", plan, provisions, inputs)


def assert_stage_ranges_do_not_overlap(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Layer Assignment: Stage ranges do not overlap."""
    _assert("stage_ranges_do_not_overlap", plan, provisions, inputs)


def assert_union_covers_the_intended_gguf_block_range(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Layer Assignment: The union covers the intended GGUF block range."""
    _assert("union_covers_the_intended_gguf_block_range", plan, provisions, inputs)


def assert_every_stage_has_exactly_one_non_empty_range(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Layer Assignment: Every stage has exactly one non-empty assigned range unless the spec
    explicitly allows empty ranges."""
    _assert("every_stage_has_exactly_one_non_empty_range", plan, provisions, inputs)


def assert_stage_indices_are_0_to_stage_count_minus_1(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Layer Assignment: Stage indices are `0..stage_count-1`."""
    _assert("stage_indices_are_0_to_stage_count_minus_1", plan, provisions, inputs)


def assert_every_edge_id_is_unique_within_the_run(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Edge Assignment: Every edge id is unique within the run."""
    _assert("every_edge_id_is_unique_within_the_run", plan, provisions, inputs)


def assert_every_edge_has_exactly_one_producer_and_one_consumer(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Edge Assignment: Every edge has exactly one producer and one consumer."""
    _assert("every_edge_has_exactly_one_producer_and_one_consumer", plan, provisions, inputs)


def assert_token_in_edge_is_orchestrator_to_stage_0(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Edge Assignment: Token-in edge is `orchestrator -> stage 0`."""
    _assert("token_in_edge_is_orchestrator_to_stage_0", plan, provisions, inputs)


def assert_activation_edge_i_is_stage_i_to_stage_i_plus_1(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Edge Assignment: Activation edge `i` is `stage i -> stage i + 1`."""
    _assert("activation_edge_i_is_stage_i_to_stage_i_plus_1", plan, provisions, inputs)


def assert_token_out_edge_is_stage_n_minus_1_to_orchestrator(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Edge Assignment: Token-out edge is `stage N-1 -> orchestrator`."""
    _assert("token_out_edge_is_stage_n_minus_1_to_orchestrator", plan, provisions, inputs)


def assert_stages_do_not_derive_edge_ids(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Edge Assignment: Stages do not derive edge ids from names, hashes, layer ranges, or
    peers."""
    _assert("stages_do_not_derive_edge_ids", plan, provisions, inputs)


def assert_deriving_provision_stage_is_deterministic(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Provisioning Projection: For each `StagePlan`, deriving `ProvisionStage` is
    deterministic."""
    _assert("deriving_provision_stage_is_deterministic", plan, provisions, inputs)


def assert_a_stage_receives_only_its_own_layer_range(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Provisioning Projection: A stage receives only its own layer range."""
    _assert("a_stage_receives_only_its_own_layer_range", plan, provisions, inputs)


def assert_a_stage_receives_one_inbound_and_one_outbound_edge_provision(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Provisioning Projection: A stage receives exactly one inbound and one outbound edge
    provision."""
    _assert(
        "a_stage_receives_one_inbound_and_one_outbound_edge_provision", plan, provisions, inputs
    )


def assert_outbound_provision_contains_the_consumer_node_id(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Provisioning Projection: Outbound provision contains the consumer `node_id`."""
    _assert("outbound_provision_contains_the_consumer_node_id", plan, provisions, inputs)


def assert_inbound_provision_does_not_require_producer_address(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Provisioning Projection: Inbound provision does not require producer actor address."""
    _assert("inbound_provision_does_not_require_producer_address", plan, provisions, inputs)


def assert_no_provision_contains_remote_actor_addresses(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Provisioning Projection: No provision message contains remote actor addresses for data
    flow."""
    _assert("no_provision_contains_remote_actor_addresses", plan, provisions, inputs)


def assert_every_edge_has_an_object_spec_and_a_ring_spec(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Object/Ring Spec Consistency: Every edge has an `ObjectSpec` and `RingSpec`."""
    _assert("every_edge_has_an_object_spec_and_a_ring_spec", plan, provisions, inputs)


def assert_activation_max_extent_follows_the_model_facts(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Object/Ring Spec Consistency: Activation `max_extent` follows the model facts:
    `max_seq_len * hidden_dim * dtype_width_bytes`."""
    _assert("activation_max_extent_follows_the_model_facts", plan, provisions, inputs)


def assert_token_edges_use_token_specs_and_activation_edges_activation_specs(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Object/Ring Spec Consistency: Token edges use token object specs, activation edges use
    activation object specs."""
    _assert(
        "token_edges_use_token_specs_and_activation_edges_activation_specs",
        plan,
        provisions,
        inputs,
    )


def assert_specs_are_copied_consistently_into_stage_provisions(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Object/Ring Spec Consistency: Specs are copied consistently into stage provisions."""
    _assert("specs_are_copied_consistently_into_stage_provisions", plan, provisions, inputs)


def assert_invalid_extent_alignment_dtype_width_or_layout_rejects(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Object/Ring Spec Consistency: Invalid extent, alignment, dtype width, or unsupported
    shape/layout rejects the plan."""
    _assert("invalid_extent_alignment_dtype_width_or_layout_rejects", plan, provisions, inputs)


def assert_unknown_node_id_rejects(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Authority / Rejection: Unknown node id rejects."""
    _assert("unknown_node_id_rejects", plan, provisions, inputs)


def assert_duplicate_stage_assignment_rejects(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Authority / Rejection: Duplicate stage assignment rejects."""
    _assert("duplicate_stage_assignment_rejects", plan, provisions, inputs)


def assert_missing_stage_rejects(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Authority / Rejection: Missing stage rejects."""
    _assert("missing_stage_rejects", plan, provisions, inputs)


def assert_invalid_stage_count_rejects(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Authority / Rejection: Invalid stage count rejects."""
    _assert("invalid_stage_count_rejects", plan, provisions, inputs)


def assert_edge_endpoint_mismatch_rejects(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Authority / Rejection: Edge endpoint mismatch rejects."""
    _assert("edge_endpoint_mismatch_rejects", plan, provisions, inputs)


def assert_inconsistent_model_facts_reject(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Authority / Rejection: Model facts inconsistent with requested stage layout reject."""
    _assert("inconsistent_model_facts_reject", plan, provisions, inputs)


def assert_planner_is_the_only_source_of_assignment(
    plan: Plan, provisions: Provisions = None, *, inputs: Inputs = None
) -> None:
    """Authority / Rejection: The planner is the only source of stage, layer, edge, and
    object-spec assignment."""
    _assert("planner_is_the_only_source_of_assignment", plan, provisions, inputs)


__all__ = [
    "assert_a_stage_receives_one_inbound_and_one_outbound_edge_provision",
    "assert_a_stage_receives_only_its_own_layer_range",
    "assert_activation_edge_i_is_stage_i_to_stage_i_plus_1",
    "assert_activation_max_extent_follows_the_model_facts",
    "assert_contract",
    "assert_deriving_provision_stage_is_deterministic",
    "assert_duplicate_stage_assignment_rejects",
    "assert_edge_endpoint_mismatch_rejects",
    "assert_every_edge_has_an_object_spec_and_a_ring_spec",
    "assert_every_edge_has_exactly_one_producer_and_one_consumer",
    "assert_every_edge_id_is_unique_within_the_run",
    "assert_every_stage_has_exactly_one_non_empty_range",
    "assert_inbound_provision_does_not_require_producer_address",
    "assert_inconsistent_model_facts_reject",
    "assert_invalid_extent_alignment_dtype_width_or_layout_rejects",
    "assert_invalid_stage_count_rejects",
    "assert_missing_stage_rejects",
    "assert_no_provision_contains_remote_actor_addresses",
    "assert_outbound_provision_contains_the_consumer_node_id",
    "assert_planner_emits_exactly_one_runplan_or_a_typed_rejection",
    "assert_planner_is_the_only_source_of_assignment",
    "assert_planner_never_emits_a_partial_plan",
    "assert_planner_never_mutates_the_pool_or_derives_hidden_topology",
    "assert_rejected",
    "assert_specs_are_copied_consistently_into_stage_provisions",
    "assert_stage_indices_are_0_to_stage_count_minus_1",
    "assert_stage_ranges_are_contiguous",
    "assert_stage_ranges_do_not_overlap",
    "assert_stages_do_not_derive_edge_ids",
    "assert_token_edges_use_token_specs_and_activation_edges_activation_specs",
    "assert_token_in_edge_is_orchestrator_to_stage_0",
    "assert_token_out_edge_is_stage_n_minus_1_to_orchestrator",
    "assert_union_covers_the_intended_gguf_block_range",
    "assert_unknown_node_id_rejects",
]
