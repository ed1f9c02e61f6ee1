"""Contradictory planner inputs: each a ``Contradiction``, valid inputs with one thing
contradicting the contract and the rejection the contract demands for it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
from attrs import frozen
from hypothesis import strategies as st

from runplan.contract.subject import PlanInputs
from runplan.dtypes import DTypeFamily
from runplan.placement import Placement, PlacementStrategy, StageAssignment
from runplan.pool import NodeSpec
from runplan.rejections import (
    DuplicateNode,
    DuplicateStage,
    InconsistentModelFacts,
    InvalidAlignment,
    InvalidDtypeWidth,
    InvalidExtent,
    InvalidLayerRange,
    InvalidStageCount,
    MissingStage,
    PlanRejection,
    UnknownNode,
    UnsupportedLayout,
)
from runplan.testing.strategies.inputs import PLENTY, valid_plan_inputs


@frozen
class Contradiction:
    """Inputs with one contradiction, and what the contract demands of a planner given
    them: a rejection of type ``rejection`` carrying ``values``, because planning
    anyway would break ``clause``."""

    inputs: PlanInputs
    rejection: type[PlanRejection]
    clause: str
    what: str
    values: dict[str, Any] = attrs.field(factory=dict)


def _explicit() -> st.SearchStrategy[PlanInputs]:
    return valid_plan_inputs(placements=("explicit",))


def _rows(inputs: PlanInputs) -> list[StageAssignment]:
    return sorted(inputs.placement.assignments, key=lambda a: a.stage_index)


def _placed(inputs: PlanInputs, rows: Sequence[StageAssignment], **changes: Any) -> PlanInputs:
    return attrs.evolve(inputs, placement=Placement(assignments=tuple(rows)), **changes)


def _stage_nodes(inputs: PlanInputs) -> list[str]:
    """The node each stage is placed on, in stage order, whatever the placement's kind."""
    if inputs.placement.strategy is PlacementStrategy.EXPLICIT:
        return [row.node_id for row in _rows(inputs)]
    return list(inputs.placement.nodes)


def _stage_indices_asked(inputs: PlanInputs) -> bool:
    """Whether the placement says which stage each node hosts: a by-memory placement
    lists its nodes, and the planner chooses their order."""
    return inputs.placement.strategy is not PlacementStrategy.BY_MEMORY


def _renoded(inputs: PlanInputs, nodes: Sequence[str], **changes: Any) -> PlanInputs:
    """``inputs`` with stage ``i`` placed on ``nodes[i]``, the placement's kind kept."""
    placement = inputs.placement
    if placement.strategy is PlacementStrategy.EXPLICIT:
        rows = [attrs.evolve(row, node_id=n) for row, n in zip(_rows(inputs), nodes, strict=True)]
        return _placed(inputs, rows, **changes)
    return attrs.evolve(inputs, placement=attrs.evolve(placement, nodes=tuple(nodes)), **changes)


@st.composite
def unknown_node_inputs(draw: st.DrawFn) -> Contradiction:
    """A stage placed on a node the pool lacks, by an explicit row or in the node list of
    an even or by-memory placement (whose stage the rejection names only where the
    placement says: not for by-memory, whose order is the planner's)."""
    inputs = draw(valid_plan_inputs())
    known = {n.node_id for n in inputs.pool.nodes} | {inputs.pool.orchestrator_node_id}
    stranger = draw(st.text(min_size=1, max_size=8).filter(lambda s: s not in known))
    nodes = _stage_nodes(inputs)
    i = draw(st.integers(0, len(nodes) - 1))
    nodes[i] = stranger
    values: dict[str, Any] = {"node_id": stranger}
    if _stage_indices_asked(inputs):
        values["stage_index"] = i
    return Contradiction(
        _renoded(inputs, nodes),
        UnknownNode,
        "unknown_node_id_rejects",
        f"stage {i} placed on {stranger!r}, a node not in the pool",
        values,
    )


@st.composite
def duplicate_stage_inputs(draw: st.DrawFn) -> Contradiction:
    inputs = draw(_explicit())
    rows = _rows(inputs)
    extra = draw(st.sampled_from(rows))
    # The stage count may or may not count the extra row; either way it is a duplicate.
    stage_count = min(len(rows) + draw(st.integers(0, 1)), inputs.facts.num_layers)
    return Contradiction(
        _placed(inputs, [*rows, extra], stage_count=stage_count),
        DuplicateStage,
        "duplicate_stage_assignment_rejects",
        f"stage {extra.stage_index} placed twice",
        {"stage_index": extra.stage_index, "count": 2},
    )


@st.composite
def duplicate_node_inputs(draw: st.DrawFn) -> Contradiction:
    """One node given two stages, or a stage on the orchestrator's node, by explicit rows
    or in the node list of an even or by-memory placement."""
    inputs = draw(valid_plan_inputs())
    nodes = _stage_nodes(inputs)
    clause = "duplicate_stage_assignment_rejects"
    if len(nodes) >= 2 and draw(st.booleans()):
        a, b = sorted(draw(st.sets(st.integers(0, len(nodes) - 1), min_size=2, max_size=2)))
        nodes[b] = nodes[a]
        values: dict[str, Any] = {"node_id": nodes[a]}
        if _stage_indices_asked(inputs):
            values["stage_indices"] = (a, b)
        return Contradiction(
            _renoded(inputs, nodes),
            DuplicateNode,
            clause,
            f"stages {a} and {b} both placed on {nodes[a]!r}",
            values,
        )
    orch = inputs.pool.orchestrator_node_id
    pool = attrs.evolve(inputs.pool, nodes=(*inputs.pool.nodes, NodeSpec(orch, PLENTY)))
    i = draw(st.integers(0, len(nodes) - 1))
    nodes[i] = orch
    return Contradiction(
        _renoded(inputs, nodes, pool=pool),
        DuplicateNode,
        clause,
        f"stage {i} placed on the orchestrator's node",
        {"node_id": orch},
    )


@st.composite
def missing_stage_inputs(draw: st.DrawFn) -> Contradiction:
    inputs = draw(_explicit())
    rows = _rows(inputs)
    gone = draw(st.integers(0, len(rows) - 1))
    # Re-number the missing stage out of range, keeping the row count.
    rows[gone] = attrs.evolve(rows[gone], stage_index=len(rows) + draw(st.integers(0, 5)))
    return Contradiction(
        _placed(inputs, rows),
        MissingStage,
        "missing_stage_rejects",
        f"no row for stage {gone}",
        {"stage_index": gone},
    )


@st.composite
def invalid_stage_count_inputs(draw: st.DrawFn) -> Contradiction:
    inputs = draw(valid_plan_inputs())
    n_layers = inputs.facts.num_layers
    bad = draw(
        st.integers(-5, 0)  # fewer than one stage
        | st.integers(n_layers + 1, n_layers + 40)  # more stages than layers
        | st.integers(1, n_layers).filter(lambda n: n != inputs.stage_count)  # not placed
    )
    return Contradiction(
        attrs.evolve(inputs, stage_count=bad),
        InvalidStageCount,
        "invalid_stage_count_rejects",
        f"stage_count {bad} for {inputs.stage_count} placed stages and {n_layers} layers",
        {"stage_count": bad},
    )


@st.composite
def invalid_layer_range_inputs(draw: st.DrawFn) -> Contradiction:
    """Explicit ranges with a gap, an overlap, an empty range or one beyond the model;
    ``clause`` is the layer-assignment clause a plan of them would break."""
    inputs = draw(_explicit())
    rows = _rows(inputs)
    n_layers = inputs.facts.num_layers
    kinds = ["empty", "beyond"]
    if any(r.layer_end_exclusive - r.layer_start >= 2 for r in rows):
        kinds.append("gap")
    if len(rows) >= 2:
        kinds.append("overlap")
    kind = draw(st.sampled_from(kinds))
    if kind == "empty":
        i = draw(st.integers(0, len(rows) - 1))
        rows[i] = attrs.evolve(rows[i], layer_end_exclusive=rows[i].layer_start)
        clause = "every_stage_has_exactly_one_non_empty_range"
    elif kind == "beyond":
        i = len(rows) - 1
        rows[i] = attrs.evolve(rows[i], layer_end_exclusive=n_layers + draw(st.integers(1, 9)))
        clause = "every_stage_has_exactly_one_non_empty_range"
    elif kind == "gap":
        wide = [j for j, r in enumerate(rows) if r.layer_end_exclusive - r.layer_start >= 2]
        i = draw(st.sampled_from(wide))
        rows[i] = attrs.evolve(rows[i], layer_start=rows[i].layer_start + 1)
        clause = "union_covers_the_intended_gguf_block_range"
    else:
        i = draw(st.integers(1, len(rows) - 1))
        rows[i] = attrs.evolve(rows[i], layer_start=rows[i].layer_start - 1)
        clause = "stage_ranges_do_not_overlap"
    return Contradiction(
        _placed(inputs, rows), InvalidLayerRange, clause, f"stage {i}'s range: {kind}"
    )


@st.composite
def inconsistent_facts_inputs(draw: st.DrawFn) -> Contradiction:
    inputs = draw(valid_plan_inputs())
    f = inputs.facts
    what, broken = draw(
        st.sampled_from(
            [
                ("no layers", attrs.evolve(f, num_layers=0)),
                ("hidden_dim 0", attrs.evolve(f, hidden_dim=0)),
                ("more kv heads than heads", attrs.evolve(f, head_count_kv=f.head_count + 1)),
                ("a block size missing", attrs.evolve(f, block_bytes=f.block_bytes[:-1])),
                ("a block of 0 bytes", attrs.evolve(f, block_bytes=(0, *f.block_bytes[1:]))),
                ("eos outside the vocabulary", attrs.evolve(f, eos_token_id=f.vocab_size)),
                (
                    "an end token outside the vocabulary",
                    attrs.evolve(f, eog_token_ids=(f.eos_token_id, f.vocab_size)),
                ),
                ("an empty vocabulary", attrs.evolve(f, vocab_size=0)),
                ("max_seq_len 0", attrs.evolve(f, max_seq_len=0)),
            ]
        )
    )
    return Contradiction(
        attrs.evolve(inputs, facts=broken),
        InconsistentModelFacts,
        "inconsistent_model_facts_reject",
        what,
    )


@st.composite
def invalid_spec_inputs(draw: st.DrawFn) -> Contradiction:
    """An extent that overflows, an alignment that is not a power of two, a
    dtype width its family lacks, or integer activations (no such layout)."""
    inputs = draw(valid_plan_inputs())
    clause = "invalid_extent_alignment_dtype_width_or_layout_rejects"
    kind = draw(st.sampled_from(["extent", "alignment", "width", "layout"]))
    if kind == "extent":
        seq_len = draw(st.integers(2**64, 2**70))
        facts = attrs.evolve(inputs.facts, max_seq_len=seq_len)
        return Contradiction(
            attrs.evolve(inputs, facts=facts), InvalidExtent, clause, f"max_seq_len {seq_len}"
        )
    if kind == "alignment":
        a = draw(st.integers(-8, 2**12).filter(lambda a: a <= 0 or a & (a - 1)))
        config = attrs.evolve(inputs.config, ring_alignment=a)
        return Contradiction(
            attrs.evolve(inputs, config=config),
            InvalidAlignment,
            clause,
            f"ring alignment {a}",
            {"alignment": a},
        )
    if kind == "width":
        family = draw(st.sampled_from([DTypeFamily.FLOAT, DTypeFamily.BFLOAT]))
        valid = {DTypeFamily.FLOAT: {2, 4}, DTypeFamily.BFLOAT: {2}}[family]
        width = draw(st.integers(-1, 16).filter(lambda w: w not in valid))
        config = attrs.evolve(
            inputs.config, activation_dtype_family=family, activation_dtype_width_bytes=width
        )
        return Contradiction(
            attrs.evolve(inputs, config=config),
            InvalidDtypeWidth,
            clause,
            f"activations {family.value} of {width} bytes",
            {"dtype_width_bytes": width},
        )
    config = attrs.evolve(
        inputs.config, activation_dtype_family=DTypeFamily.UINT, activation_dtype_width_bytes=4
    )
    return Contradiction(
        attrs.evolve(inputs, config=config), UnsupportedLayout, clause, "integer activations"
    )


def contradictory_plan_inputs() -> st.SearchStrategy[Contradiction]:
    """Any of the contradictions above."""
    return st.one_of(
        unknown_node_inputs(),
        duplicate_stage_inputs(),
        duplicate_node_inputs(),
        missing_stage_inputs(),
        invalid_stage_count_inputs(),
        invalid_layer_range_inputs(),
        inconsistent_facts_inputs(),
        invalid_spec_inputs(),
    )
