"""Seeded exploration of chains of concurrent runs: every scenario keeps every
guarantee, the same seeds give the same bytes, and the checker catches every built-in
mutant."""

from __future__ import annotations

import json

import attrs
import pytest

import runtime_sim.cli
from runtime_sim.chain_driver import PLAIN
from runtime_sim.cli import main
from runtime_sim.explore import (
    CHECKED_RULES,
    MUTANT_RULES,
    MutantResult,
    Outcome,
    explore,
    report,
    report_json,
    run_scenario,
    self_test,
)
from runtime_sim.faults import FaultKind, FaultPlan
from runtime_sim.mutants import Mutation, parts_for
from runtime_sim.scenarios import scenario
from tests.support.import_graph import import_graph

#: Scenarios CI explores (each runs up to six runs, and reruns each run alone):
#: ``python -m runtime_sim explore --seeds 1000`` goes further.
CI_SEEDS = 150


def test_seeded_chain_scenarios_keep_every_guarantee() -> None:
    outcomes = explore(0, CI_SEEDS)
    rep = report(0, outcomes)
    assert rep["violations"] == []
    # The scenarios are varied enough to mean something: chains of one run and of
    # several, runs complete, fault and are cancelled, some scenarios end some runs and
    # not others, and every fault kind is drawn.
    assert sum(len(o.runs) > 1 for o in outcomes) > CI_SEEDS // 2
    assert sum(len(o.runs) == 1 for o in outcomes) > 10
    assert rep["runs"].get("completed", 0) > 200 and rep["runs"].get("faulted", 0) > 50
    assert rep["runs"].get("cancelled", 0) > 0
    assert rep["outcomes"].get("mixed", 0) > 10
    kinds = {f.split()[0] for o in outcomes for f in o.faults}
    assert kinds == {k.value for k in FaultKind}
    # ... and the chains: staggered arrivals, prompts in chunks, batches fuller than
    # their rows allow, runs waiting for the KV budget.
    chains = [scenario(seed) for seed in range(CI_SEEDS)]
    assert any(len({r.arrival_us for r in c.runs}) > 1 for c in chains)
    assert any(c.plan.prefill_chunk < max(len(r.prompt) for r in c.runs) for c in chains)
    assert any(c.plan.max_batch_rows < sum(len(r.prompt) for r in c.runs) for c in chains)
    assert any(
        c.plan.stages[0].kv_budget_bytes < len(c.runs) * c.plan.stages[0].kv_bytes for c in chains
    )
    # ... and the recoveries (issue 25): streams replayed after a loss, onto a spare,
    # over the remaining nodes, or ended when no node is left; a loss during a recovery.
    assert rep["recovered_streams"] > 20
    assert set(rep["replacements"]) == {
        "spare",
        "afresh",
        "unplaceable:insufficient_memory",  # nodes that hold only the largest stage
        "unplaceable:invalid_stage_count",  # a one-stage chain's host lost, no spare
    }
    assert rep["losses_during_recovery"] > 5
    assert any(c.recovery is None for c in chains) and any(c.recovery for c in chains)


def test_the_same_seed_gives_a_byte_identical_trace() -> None:
    for seed in (3, 17, 42):
        first, _, _ = run_scenario(scenario(seed))
        second, _, _ = run_scenario(scenario(seed))
        assert first.trace.dumps() == second.trace.dumps()
        assert first.trace.entries  # a trace was written
    assert run_scenario(scenario(3))[0].trace.dumps() != run_scenario(scenario(4))[0].trace.dumps()


def test_the_json_report_is_the_same_bytes_for_the_same_seeds() -> None:
    assert report_json(10, explore(10, 15)) == report_json(10, explore(10, 15))


def test_the_checker_catches_every_mutant_by_the_rule_its_bug_breaks() -> None:
    results = self_test()
    assert {r.mutation for r in results} == set(Mutation)
    for r in results:
        assert r.caught, r
        assert MUTANT_RULES[r.mutation] in r.rules
        assert set(r.rules) <= set(CHECKED_RULES), r  # every rule that fired is a listed one


def test_explore_cli_json_and_exit_status(capsys: object) -> None:
    assert main(["explore", "--seeds", "10", "--start", "5", "--json"]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    rep = json.loads(out)
    assert rep["seeds"] == 10 and rep["start"] == 5 and rep["violations"] == []
    assert "wall" not in out and "seconds" not in out
    assert main(["explore", "--self-test"]) == 0


def test_explore_json_with_a_violation_or_a_missed_mutant_has_an_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The explorer run with a built-in mutant: its scenarios break a rule.
    s = attrs.evolve(scenario(3), eos_after=None, faults=FaultPlan(), recovery=None)
    _result, _sim, violations = run_scenario(s, Mutation.SKIP_STOP_RUN)
    assert violations
    broken = Outcome(3, ("completed",), 1, tuple(violations), (), 1, 1)

    def mutated(start: int, count: int, *, max_runs: int = 6) -> list[Outcome]:
        return [broken]

    monkeypatch.setattr(runtime_sim.cli, "explore", mutated)
    assert main(["explore", "--seeds", "1", "--start", "3", "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert len(rep["violations"]) == len(violations)  # the report, the error beside it
    assert rep["error"]["type"] == "Violations" and set(rep["error"]) == {"type", "message"}
    first = violations[0]
    assert rep["error"]["message"] == (
        f"{len(violations)} violation{'s' if len(violations) > 1 else ''} over seeds 3..3; "
        f"first: seed 3: {first.rule}: {first.detail}"
    )

    missed = [MutantResult(Mutation.SKIP_STOP_RUN, False, None, ())]
    monkeypatch.setattr(runtime_sim.cli, "self_test", lambda: missed)
    assert main(["explore", "--self-test", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["mutants"][0]["caught"] is False
    assert doc["error"] == {
        "type": "MutantsMissed",
        "message": "1 of 1 mutants missed: SKIP_STOP_RUN",
    }


def test_explore_text_lines_are_whole_in_a_pipe(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Written to a pipe or a file, explore's text was cut into 80-column lines (a bare
    rich console): one record became two or three lines, half of it for ``grep``. And
    its violations' label was rich markup, which a seed's detail could break."""
    monkeypatch.delenv("COLUMNS", raising=False)
    s = attrs.evolve(scenario(3), eos_after=None, faults=FaultPlan(), recovery=None)
    _result, _sim, violations = run_scenario(s, Mutation.SKIP_STOP_RUN)
    broken = Outcome(3, ("completed",), 1, tuple(violations), (), 1, 1)
    monkeypatch.setattr(runtime_sim.cli, "explore", lambda *_a, **_k: [broken])
    assert main(["explore", "--seeds", "1", "--start", "3"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + len(violations), lines
    assert lines[0].startswith("seeds 3..3: ") and len(lines[0]) > 80, lines[0]
    first = violations[0]
    assert lines[1].startswith(f"violation seed 3: {first.rule}: {first.detail} (faults ")


def test_a_negative_first_seed_is_a_usage_error(capsys: object) -> None:
    """A seed is a u64 everywhere else: ``--start -1`` once ran seeds -1..1."""
    with pytest.raises(SystemExit) as exc:
        main(["explore", "--seeds", "3", "--start", "-1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert "--start" in err and "'-1' is negative" in err, err


def test_explore_lists_the_rules_it_checks_and_every_violation_is_one(capsys: object) -> None:
    assert main(["explore", "--rules", "--json"]) == 0
    rules = json.loads(capsys.readouterr().out)["rules"]  # type: ignore[attr-defined]
    assert rules == list(CHECKED_RULES) and len(set(rules)) == len(rules)
    assert all(":" in rule for rule in rules)  # its kind, then what it guarantees
    assert set(MUTANT_RULES.values()) <= set(rules)
    assert main(["explore", "--rules"]) == 0
    assert capsys.readouterr().out.splitlines() == rules  # type: ignore[attr-defined]


def test_rules_beside_self_test_is_a_usage_error(capsys: object) -> None:
    """--rules runs nothing: beside --self-test it once exited 0 with no mutant run,
    against --self-test's 'exit 0 only if the checker catches each'."""
    with pytest.raises(SystemExit) as exc:
        main(["explore", "--self-test", "--rules", "--json"])
    assert exc.value.code == 2
    captured = capsys.readouterr()  # type: ignore[attr-defined]
    error = json.loads(captured.out)["error"]
    assert error["type"] == "UsageError"
    assert "--rules" in error["message"] and "--self-test" in error["message"]


def test_each_mutant_enters_as_one_subclassed_part_and_production_knows_none() -> None:
    # The simulator's own modules never import the mutants: a bug enters only through
    # the Parts port of the one simulation that asks for it.
    graph = import_graph()
    users = sorted(m for m, deps in graph.items() if "runtime_sim.mutants" in deps)
    assert users == ["runtime_sim.explore"]
    fields = ("ring", "stage_controller", "orchestrator_controller", "orchestrator", "recoverer")
    for mutation in Mutation:
        parts = parts_for(mutation)
        assert parts.mutant == mutation.value and PLAIN.mutant is None
        swapped = [f for f in fields if getattr(parts, f) is not getattr(PLAIN, f)]
        assert len(swapped) == 1, (mutation, swapped)
        assert issubclass(getattr(parts, swapped[0]), getattr(PLAIN, swapped[0]))


def test_records_dropped_with_a_stopped_run_are_no_order_violation() -> None:
    # Seed 930: a run stops with two prefill chunks waiting at a stage (dropped with it)
    # and its next chunk arrives after: discarded at once, not fed out of order.
    _result, _sim, violations = run_scenario(scenario(930))
    assert violations == []


@pytest.mark.parametrize("seed", [5150, 1298])
def test_a_duplicated_stage_stopped_counts_its_batches_once(seed: int) -> None:
    # Seeds 5150 and 1298: a StageStopped duplicated (and reordered) on its way: its
    # batches were counted twice ("node-1 ran batches {1: 1}, reported {1: 2}").
    _result, _sim, violations = run_scenario(scenario(seed))
    assert violations == []
