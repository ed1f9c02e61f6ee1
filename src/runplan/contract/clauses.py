"""The clauses of RUNPLAN_CONTRACT.md as data: one row per bullet, in the spec's order,
each with a name (a Python identifier: ``assert_<name>`` in ``runplan.testing``,
``test_<name>`` in the clause suite) and the spec's own words."""

from __future__ import annotations

from attrs import frozen

from runplan._fields import str_field

FORMATION = "RunPlan Formation"
LAYERS = "Layer Assignment"
EDGES = "Edge Assignment"
PROVISIONING = "Provisioning Projection"
SPECS = "Object/Ring Spec Consistency"
AUTHORITY = "Authority / Rejection"

#: The spec's sections, in its order.
SECTIONS: tuple[str, ...] = (FORMATION, LAYERS, EDGES, PROVISIONING, SPECS, AUTHORITY)


@frozen
class Clause:
    name: str = str_field()
    section: str = str_field()
    text: str = str_field()  # the bullet of RUNPLAN_CONTRACT.md, word for word

    def quote(self) -> str:
        """``RUNPLAN_CONTRACT.md, <section>: "<text>"``."""
        return f'RUNPLAN_CONTRACT.md, {self.section}: "{self.text}"'


def _c(name: str, section: str, text: str) -> Clause:
    return Clause(name, section, text)


CLAUSES: tuple[Clause, ...] = (
    _c(
        "planner_emits_exactly_one_runplan_or_a_typed_rejection",
        FORMATION,
        "Given model facts, runtime config, intended node pool, stage count, and "
        "placement input, the planner either emits exactly one `RunPlan` or a typed "
        "rejection.",
    ),
    _c("planner_never_emits_a_partial_plan", FORMATION, "It never emits a partial plan."),
    _c(
        "planner_never_mutates_the_pool_or_derives_hidden_topology",
        FORMATION,
        "It never mutates the candidate pool or derives hidden topology outside the plan.",
    ),
    _c("stage_ranges_are_contiguous", LAYERS, "Stage ranges are contiguous."),
    _c("stage_ranges_do_not_overlap", LAYERS, "Stage ranges do not overlap."),
    _c(
        "union_covers_the_intended_gguf_block_range",
        LAYERS,
        "The union covers the intended GGUF block range.",
    ),
    _c(
        "every_stage_has_exactly_one_non_empty_range",
        LAYERS,
        "Every stage has exactly one non-empty assigned range unless the spec "
        "explicitly allows empty ranges.",
    ),
    _c(
        "stage_indices_are_0_to_stage_count_minus_1",
        LAYERS,
        "Stage indices are `0..stage_count-1`.",
    ),
    _c("every_edge_id_is_unique_within_the_run", EDGES, "Every edge id is unique within the run."),
    _c(
        "every_edge_has_exactly_one_producer_and_one_consumer",
        EDGES,
        "Every edge has exactly one producer and one consumer.",
    ),
    _c(
        "token_in_edge_is_orchestrator_to_stage_0",
        EDGES,
        "Token-in edge is `orchestrator -> stage 0`.",
    ),
    _c(
        "activation_edge_i_is_stage_i_to_stage_i_plus_1",
        EDGES,
        "Activation edge `i` is `stage i -> stage i + 1`.",
    ),
    _c(
        "token_out_edge_is_stage_n_minus_1_to_orchestrator",
        EDGES,
        "Token-out edge is `stage N-1 -> orchestrator`.",
    ),
    _c(
        "stages_do_not_derive_edge_ids",
        EDGES,
        "Stages do not derive edge ids from names, hashes, layer ranges, or peers.",
    ),
    _c(
        "deriving_provision_stage_is_deterministic",
        PROVISIONING,
        "For each `StagePlan`, deriving `ProvisionStage` is deterministic.",
    ),
    _c(
        "a_stage_receives_only_its_own_layer_range",
        PROVISIONING,
        "A stage receives only its own layer range.",
    ),
    _c(
        "a_stage_receives_one_inbound_and_one_outbound_edge_provision",
        PROVISIONING,
        "A stage receives exactly one inbound and one outbound edge provision.",
    ),
    _c(
        "outbound_provision_contains_the_consumer_node_id",
        PROVISIONING,
        "Outbound provision contains the consumer `node_id`.",
    ),
    _c(
        "inbound_provision_does_not_require_producer_address",
        PROVISIONING,
        "Inbound provision does not require producer actor address.",
    ),
    _c(
        "no_provision_contains_remote_actor_addresses",
        PROVISIONING,
        "No provision message contains remote actor addresses for data flow.",
    ),
    _c(
        "every_edge_has_an_object_spec_and_a_ring_spec",
        SPECS,
        "Every edge has an `ObjectSpec` and `RingSpec`.",
    ),
    _c(
        "activation_max_extent_follows_the_model_facts",
        SPECS,
        "Activation `max_extent` follows the model facts: "
        "`max_seq_len * hidden_dim * dtype_width_bytes`.",
    ),
    _c(
        "token_edges_use_token_specs_and_activation_edges_activation_specs",
        SPECS,
        "Token edges use token object specs, activation edges use activation object specs.",
    ),
    _c(
        "specs_are_copied_consistently_into_stage_provisions",
        SPECS,
        "Specs are copied consistently into stage provisions.",
    ),
    _c(
        "invalid_extent_alignment_dtype_width_or_layout_rejects",
        SPECS,
        "Invalid extent, alignment, dtype width, or unsupported shape/layout rejects the plan.",
    ),
    _c("unknown_node_id_rejects", AUTHORITY, "Unknown node id rejects."),
    _c("duplicate_stage_assignment_rejects", AUTHORITY, "Duplicate stage assignment rejects."),
    _c("missing_stage_rejects", AUTHORITY, "Missing stage rejects."),
    _c("invalid_stage_count_rejects", AUTHORITY, "Invalid stage count rejects."),
    _c("edge_endpoint_mismatch_rejects", AUTHORITY, "Edge endpoint mismatch rejects."),
    _c(
        "inconsistent_model_facts_reject",
        AUTHORITY,
        "Model facts inconsistent with requested stage layout reject.",
    ),
    _c(
        "planner_is_the_only_source_of_assignment",
        AUTHORITY,
        "The planner is the only source of stage, layer, edge, and object-spec assignment.",
    ),
)

#: The clauses by name.
CLAUSE: dict[str, Clause] = {c.name: c for c in CLAUSES}
