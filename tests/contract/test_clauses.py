"""The contract as data and as checks (``runplan.contract``, ``runplan.testing``):
the clause table is the spec's, every clause has its assertion and its suite test,
and each clause check fails on the plans that break it and only on those: compared
with ``check_plan``, an independent reading of the same contract."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

import runplan.testing
from runplan import (
    Placement,
    RunPlan,
    StageAssignment,
    check_plan,
    plan_run,
    provision_all,
)
from runplan.contract import (
    CLAUSE,
    CLAUSES,
    REJECTION_CLAUSES,
    SECTIONS,
    Outcome,
    check_clause,
    check_contract,
)
from runplan.plan import EdgeKind, Layout, ObjectKind
from runplan.rejections import REJECTIONS
from runplan.testing import suite
from runplan.testing.strategies import Tampering
from tests.support.strategies import PlanInputs, tamperings, valid_plan_inputs

SPEC = Path(__file__).resolve().parents[3] / "shared" / "spec" / "RUNPLAN_CONTRACT.md"
NEEDS_INPUTS = {"unknown_node_id_rejects"}


def _plan(inputs: PlanInputs) -> RunPlan:
    plan = plan_run(inputs.facts, inputs.config, inputs.pool, **inputs.kwargs())
    assert isinstance(plan, RunPlan), plan
    return plan


def _spec_bullets(text: str) -> list[tuple[str, str]]:
    """(section, bullet) for every bullet of the spec, continuation lines joined."""
    out: list[tuple[str, str]] = []
    section = ""
    for line in text.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif line.startswith("- "):
            out.append((section, line[2:].strip()))
        elif line.startswith("  ") and line.strip() and out and out[-1][0] == section:
            out[-1] = (section, f"{out[-1][1]} {line.strip()}")
    return out


@pytest.mark.skipif(
    not SPEC.exists(), reason=f"the shared spec is not beside the repository at {SPEC}"
)
def test_the_clause_table_is_the_specs_bullets_word_for_word() -> None:
    assert [(c.section, c.text) for c in CLAUSES] == _spec_bullets(SPEC.read_text())
    assert tuple(dict.fromkeys(c.section for c in CLAUSES)) == SECTIONS


def test_every_clause_has_one_assertion_named_after_it() -> None:
    assertions = {n for n in runplan.testing.__all__ if n.startswith("assert_")}
    assert assertions - {"assert_contract", "assert_rejected"} == {
        f"assert_{c.name}" for c in CLAUSES
    }
    for c in CLAUSES:
        assert c.text in getattr(runplan.testing, f"assert_{c.name}").__doc__.replace("\n    ", " ")


def test_every_clause_has_a_suite_test_named_after_it() -> None:
    modules = sorted(Path(suite.__file__).parent.glob("test_*.py"))
    names = {m for p in modules for m in re.findall(r"^def (test_\w+)\(", p.read_text(), re.M)}
    for c in CLAUSES:
        assert f"test_{c.name}" in names, c.name


def test_every_rejection_code_is_reported_under_a_clause() -> None:
    assert set(REJECTION_CLAUSES) == set(REJECTIONS)
    assert all(c in CLAUSE for names in REJECTION_CLAUSES.values() for c in names)


@given(valid_plan_inputs())
def test_plans_from_plan_run_keep_every_clause(inputs: PlanInputs) -> None:
    plan = _plan(inputs)
    with_inputs = check_contract(plan, provision_all(plan), inputs=inputs)
    assert [v.clause.name for v in with_inputs.verdicts if v.outcome is not Outcome.HOLDS] == []
    alone = check_contract(plan)
    assert {v.clause.name for v in alone.verdicts if v.outcome is Outcome.NOT_CHECKED} == (
        NEEDS_INPUTS
    )
    assert alone.holds and alone.rejection is None and not alone.provisions_given


@given(valid_plan_inputs(), st.data())
def test_each_tampering_breaks_its_clause_and_the_assertion_quotes_it(
    inputs: PlanInputs, data: st.DataObject
) -> None:
    t: Tampering = data.draw(tamperings(_plan(inputs)))
    report = check_contract(t.plan, t.provisions)
    verdict = report.verdict(t.breaks)
    assert verdict.outcome is Outcome.BROKEN, (t.what, report.broken)
    clause = CLAUSE[t.breaks]
    with pytest.raises(AssertionError) as caught:
        getattr(runplan.testing, f"assert_{t.breaks}")(t.plan, t.provisions)
    assert f'{clause.section}: "{clause.text}" is broken' in str(caught.value)
    if t.rejection is None:  # the provisions, not the plan
        assert check_plan(t.plan) is t.plan
        assert report.rejection is None
    else:
        assert isinstance(check_plan(t.plan), t.rejection)
        assert report.rejection == check_plan(t.plan)
        # The rejection is reported under one clause, and that clause is broken.
        blamed = [v for v in report.verdicts if v.rejection is not None]
        assert len(blamed) == 1 and blamed[0].clause.name in REJECTION_CLAUSES[t.rejection.code]


# -- the clause checks and check_plan agree ------------------------------------------


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    """(path, leaf) for every int, str and enum inside the plan's stages and edges."""
    if attrs.has(type(value)):
        return [
            p
            for f in attrs.fields(type(value))
            for p in _paths(getattr(value, f.name), (*prefix, f.name))
        ]
    if isinstance(value, tuple):
        return [p for i, v in enumerate(value) for p in _paths(v, (*prefix, i))]
    return [(prefix, value)]


def _replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, tuple):
        return (*value[:head], _replace(value[head], rest, new), *value[head + 1 :])
    return attrs.evolve(value, **{head: _replace(getattr(value, head), rest, new)})


_ENUMS = {EdgeKind: list(EdgeKind), ObjectKind: list(ObjectKind), Layout: list(Layout)}


@st.composite
def mutated_plans(draw: st.DrawFn, plan: RunPlan) -> RunPlan:
    """``plan`` with one leaf of its model, stages or edges changed."""
    leaves = [
        (path, leaf)
        for path, leaf in _paths(plan)
        if path[0] in ("model", "stages", "edges", "orchestrator_node_id")
        and isinstance(leaf, int | str | EdgeKind | ObjectKind | Layout)
        and not isinstance(leaf, bool)
    ]
    path, leaf = draw(st.sampled_from(leaves))
    if isinstance(leaf, str):
        new: Any = draw(st.sampled_from([f"{leaf}x", "", "node-0", "orchestrator"]))
    elif isinstance(leaf, int):
        new = draw(st.sampled_from([leaf + 1, leaf - 1, 0, 2 * leaf + 1]))
    else:
        new = draw(st.sampled_from(_ENUMS[type(leaf)]))
    try:
        return _replace(plan, path, new)
    except (TypeError, ValueError):  # a value the field's type refuses
        return plan


@given(valid_plan_inputs(), st.data())
def test_the_clause_checks_find_a_problem_exactly_when_check_plan_rejects(
    inputs: PlanInputs, data: st.DataObject
) -> None:
    plan = data.draw(mutated_plans(_plan(inputs)))
    report = check_contract(plan)
    found = [p for v in report.verdicts for p in v.problems]
    rejected = check_plan(plan) is not plan
    assert bool(found) == rejected, (found, check_plan(plan))
    assert report.holds == (not rejected)


def test_check_clause_names_an_unknown_clause() -> None:
    with pytest.raises(KeyError, match="no clause named 'stage_ranges_are_nice'"):
        check_clause("stage_ranges_are_nice", _small())


def _small() -> RunPlan:
    from tests.support.strategies import small_plan

    return small_plan(2)


def test_an_assertion_that_needs_the_inputs_says_so() -> None:
    with pytest.raises(ValueError, match="node pool"):
        runplan.testing.assert_unknown_node_id_rejects(_small())


def test_a_rejection_where_a_plan_was_expected_fails_the_assertion_quoting_the_clause() -> None:
    rejection = check_plan(attrs.evolve(_small(), max_tokens=0))
    assert not isinstance(rejection, RunPlan)
    with pytest.raises(AssertionError, match=re.escape('"Stage ranges are contiguous."')):
        runplan.testing.assert_stage_ranges_are_contiguous(rejection)
    runplan.testing.assert_planner_emits_exactly_one_runplan_or_a_typed_rejection(rejection)
    with pytest.raises(AssertionError, match="expected a UnknownNode rejection"):
        runplan.testing.assert_rejected(
            _small(), REJECTIONS["unknown_node"], clause="unknown_node_id_rejects"
        )


def test_assert_contract_passes_a_whole_plan_and_lists_every_broken_clause() -> None:
    plan = _small()
    runplan.testing.assert_contract(plan, provision_all(plan))
    edges = list(plan.edges)
    edges[2] = attrs.evolve(edges[2], edge_id=edges[1].edge_id)
    tampered = attrs.evolve(plan, edges=tuple(edges))
    with pytest.raises(AssertionError) as caught:
        runplan.testing.assert_contract(tampered)
    broken = check_contract(tampered).broken
    assert str(caught.value).startswith(f"{len(broken)} clauses of RUNPLAN_CONTRACT.md are broken:")
    for v in broken:
        assert v.clause.quote() in str(caught.value)
    assert CLAUSE["every_edge_id_is_unique_within_the_run"] in [v.clause for v in broken]


def test_a_plan_that_is_not_its_explicit_placement_breaks_formation() -> None:
    """A planner that swapped the nodes of an explicit placement, or moved its cut,
    passed every clause: the plan must be its placement's rows."""
    from tests.support.strategies import small_plan_inputs

    facts, config, pool = small_plan_inputs(2)
    node0, node1 = (n.node_id for n in pool.nodes[:2])
    placement = Placement(
        assignments=(StageAssignment(0, node0, 0, 1), StageAssignment(1, node1, 1, 4))
    )
    inputs = PlanInputs(facts, config, pool, 2, placement)
    plan = plan_run(facts, config, pool, stage_count=2, placement=placement)
    assert isinstance(plan, RunPlan)
    name = "planner_emits_exactly_one_runplan_or_a_typed_rejection"
    assert check_contract(plan, inputs=inputs).verdict(name).outcome is Outcome.HOLDS
    nodes = (node1, node0)
    swapped = attrs.evolve(
        plan, stages=tuple(attrs.evolve(st, node_id=nodes[st.stage_index]) for st in plan.stages)
    )
    verdict = check_contract(swapped, inputs=inputs).verdict(name)
    assert verdict.outcome is Outcome.BROKEN
    assert f"stage 0 is on {node1!r} over blocks [0, 1); the placement assigns it {node0!r}" in (
        str(verdict.problems)
    )


def test_a_plan_whose_stages_are_not_on_its_even_placement_s_nodes_breaks_formation() -> None:
    """An even placement puts stage ``i`` on ``nodes[i]``: a planner that reversed the
    nodes passed every clause."""
    from tests.support.strategies import small_plan_inputs

    facts, config, pool = small_plan_inputs(2)
    node0, node1 = (n.node_id for n in pool.nodes[:2])
    inputs = PlanInputs(facts, config, pool, 2, Placement.even((node0, node1)))
    name = "planner_emits_exactly_one_runplan_or_a_typed_rejection"
    plan = plan_run(facts, config, pool, **inputs.kwargs())
    assert isinstance(plan, RunPlan)
    assert check_contract(plan, inputs=inputs).verdict(name).outcome is Outcome.HOLDS
    reversed_plan = plan_run(
        facts, config, pool, stage_count=2, placement=Placement.even((node1, node0))
    )
    assert isinstance(reversed_plan, RunPlan)
    verdict = check_contract(reversed_plan, inputs=inputs).verdict(name)
    assert verdict.outcome is Outcome.BROKEN
    assert f"stage 0 is on {node1!r}; the even placement of nodes" in str(verdict.problems)


def test_a_plan_with_a_stage_on_a_node_its_by_memory_placement_lacks_breaks_formation() -> None:
    """A by-memory placement's nodes in another order keep the clause (the order is the
    planner's: docs/examples/contract_ci puts the biggest first); a node it does not list
    breaks it."""
    from tests.support.strategies import small_plan_inputs

    facts, config, pool = small_plan_inputs(3)
    node0, node1, node2 = (n.node_id for n in pool.nodes[:3])
    inputs = PlanInputs(facts, config, pool, 2, Placement.by_memory((node0, node1)))
    name = "planner_emits_exactly_one_runplan_or_a_typed_rejection"
    for nodes, outcome in (((node1, node0), Outcome.HOLDS), ((node0, node2), Outcome.BROKEN)):
        plan = plan_run(facts, config, pool, stage_count=2, placement=Placement.by_memory(nodes))
        assert isinstance(plan, RunPlan)
        verdict = check_contract(plan, inputs=inputs).verdict(name)
        assert verdict.outcome is outcome, verdict.problems
    assert f"stage 1 is on {node2!r}, a node the by-memory placement" in str(verdict.problems)


def test_a_plan_whose_cuts_are_not_an_even_placement_s_breaks_formation() -> None:
    """An even placement gives the first ``num_layers % n`` stages one block more."""
    from tests.support.strategies import small_plan_inputs

    facts, config, pool = small_plan_inputs(2)
    nodes = tuple(n.node_id for n in pool.nodes[:2])
    inputs = PlanInputs(facts, config, pool, 2, Placement.even(nodes))
    plan = plan_run(facts, config, pool, **inputs.kwargs())
    assert isinstance(plan, RunPlan)
    first, second = plan.stages
    moved = attrs.evolve(
        plan,
        stages=(
            attrs.evolve(first, layer_end_exclusive=first.layer_end_exclusive - 1),
            attrs.evolve(second, layer_start=second.layer_start - 1),
        ),
    )
    name = "planner_emits_exactly_one_runplan_or_a_typed_rejection"
    verdict = check_contract(moved, inputs=inputs).verdict(name)
    assert verdict.outcome is Outcome.BROKEN
    assert "the even placement of" in str(verdict.problems)


def test_assert_rejected_compares_a_list_to_the_tuple_a_rejection_carries() -> None:
    """Values written as lists (as ``--json`` prints a rejection's tuples) once failed
    the assertion, blaming the planner: "carries stage_indices=(0, 1), not the
    offending [0, 1]"."""
    duplicate_node = REJECTIONS["duplicate_node"]
    rejection = duplicate_node("a", (0, 1), "one node hosts one stage")
    clause = "duplicate_stage_assignment_rejects"
    runplan.testing.assert_rejected(
        rejection, duplicate_node, clause=clause, values={"stage_indices": [0, 1]}
    )
    with pytest.raises(AssertionError, match="not the offending \\[1, 0\\]"):
        runplan.testing.assert_rejected(
            rejection, duplicate_node, clause=clause, values={"stage_indices": [1, 0]}
        )


def test_assert_rejected_names_a_mistake_in_the_test_itself() -> None:
    """A clause name that is none, a value of a field the rejection lacks, or a code
    where the class belongs: a ``ValueError`` or ``TypeError`` naming it, not a bare
    ``KeyError`` nor an ``AssertionError`` that blames the planner."""
    unknown_node = REJECTIONS["unknown_node"]
    rejection = unknown_node("zz", 1)
    clause = "unknown_node_id_rejects"
    runplan.testing.assert_rejected(
        rejection, unknown_node, clause=clause, values={"node_id": "zz"}
    )
    with pytest.raises(
        ValueError, match="no clause named 'unknown_node_id_reject' \\(did you mean"
    ):
        runplan.testing.assert_rejected(rejection, unknown_node, clause="unknown_node_id_reject")
    with pytest.raises(ValueError, match="UnknownNode has no field 'nosuch'"):
        runplan.testing.assert_rejected(
            rejection, unknown_node, clause=clause, values={"nosuch": None}
        )
    with pytest.raises(TypeError, match="not 'unknown_node'"):
        runplan.testing.assert_rejected(rejection, "unknown_node", clause=clause)  # type: ignore[arg-type]
