"""The clause suite through the pytest plugin (``--runplan-planner``), run the way a
service runs it in CI: a separate pytest over ``--pyargs runplan.testing.suite``. A
planner that skips a layer, or reuses an edge id, fails naming the clause; ``plan_run``
passes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from runplan.contract import CLAUSE, CLAUSES
from runplan.testing.plugin import load_planner

#: Minutes, not seconds (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.slow

WRONG_PLANNERS = '''
import attrs
from runplan import RunPlan, plan_run


def skips_a_layer(facts, config, pool, stage_count, placement):
    """plan_run's plan, with the last layer in no stage."""
    plan = plan_run(facts, config, pool, stage_count=stage_count, placement=placement)
    if not isinstance(plan, RunPlan):
        return plan
    last = plan.stages[-1]
    short = attrs.evolve(last, layer_end_exclusive=last.layer_end_exclusive - 1)
    return attrs.evolve(plan, stages=(*plan.stages[:-1], short))


def reuses_an_edge_id(facts, config, pool, stage_count, placement):
    """plan_run's plan, with the token-out edge given the token-in edge's id."""
    plan = plan_run(facts, config, pool, stage_count=stage_count, placement=placement)
    if not isinstance(plan, RunPlan):
        return plan
    reused = plan.edges[0].edge_id
    edges = (*plan.edges[:-1], attrs.evolve(plan.edges[-1], edge_id=reused))
    stages = (*plan.stages[:-1], attrs.evolve(plan.stages[-1], outbound_edge=reused))
    return attrs.evolve(plan, edges=edges, stages=stages)


def takes_two(facts, config):
    raise AssertionError("never called")
'''

# Few examples and no shrinking: a wrong planner fails on every input, and CI time is
# the budget here (the suite proper runs in tests/contract/ at full strength).
QUICK_PROFILE = """
from hypothesis import Phase, settings
settings.register_profile(
    "quick", max_examples=4, phases=[Phase.explicit, Phase.generate], deadline=None, database=None
)
settings.load_profile("quick")
"""


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A service's checkout: its planners, and a Hypothesis profile for its CI."""
    root = tmp_path_factory.mktemp("service")
    (root / "wrong_planners.py").write_text(WRONG_PLANNERS)
    (root / "quick_profile.py").write_text(QUICK_PROFILE)
    return root


def _suite(service: Path, *args: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "quick_profile",
            "-q",
            "--tb=short",
            "-rfs",
            *args,
            "--pyargs",
            "runplan.testing.suite",
        ],
        cwd=service,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


def _failed(output: str) -> set[str]:
    return set(re.findall(r"^FAILED \S+::(test_\w+)", output, re.M))


def test_plan_run_passes_the_whole_suite(service: Path) -> None:
    code, out = _suite(service, "--runplan-planner", "runplan:plan_run")
    assert code == 0, out
    passed = int(re.search(r"(\d+) passed", out)[1])  # type: ignore[index]
    assert passed >= len(CLAUSES) and "failed" not in out and "skipped" not in out


@pytest.mark.parametrize(
    ("planner", "clause"),
    [
        ("skips_a_layer", "union_covers_the_intended_gguf_block_range"),
        ("reuses_an_edge_id", "every_edge_id_is_unique_within_the_run"),
    ],
)
def test_a_wrong_planner_fails_naming_the_clause(service: Path, planner: str, clause: str) -> None:
    code, out = _suite(service, "--runplan-planner", f"wrong_planners:{planner}")
    assert code == 1, out
    assert f"test_{clause}" in _failed(out)
    c = CLAUSE[clause]
    assert f'RUNPLAN_CONTRACT.md, {c.section}: "{c.text}" is broken' in out
    # Clauses the planner keeps still pass: the suite names what is broken, not everything.
    assert "test_stage_ranges_do_not_overlap" not in _failed(out)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("no_such_module:plan", "cannot import 'no_such_module'"),
        ("wrong_planners:absent", "'wrong_planners' has no 'absent'"),
        ("wrong_planners", "write MODULE:NAME"),
        ("wrong_planners:takes_two", "cannot be called as takes_two(facts, config, pool"),
    ],
)
def test_a_bad_planner_option_names_what_is_wrong(
    service: Path, monkeypatch: pytest.MonkeyPatch, spec: str, says: str
) -> None:
    monkeypatch.syspath_prepend(str(service))
    with pytest.raises(pytest.UsageError, match=re.escape(says)):
        load_planner(spec)


def test_a_bad_planner_option_is_a_one_line_usage_error(service: Path) -> None:
    code, out = _suite(service, "--runplan-planner", "wrong_planners:absent")
    assert code == pytest.ExitCode.USAGE_ERROR, out
    assert (
        out.strip()
        == "ERROR: --runplan-planner 'wrong_planners:absent': 'wrong_planners' has no 'absent'"
    )


OWN_TESTS = """
from hypothesis import given, settings, strategies as st


def test_the_loaded_profile_is_the_service_s():
    assert settings.default.max_examples == 4


@given(st.uuids())
def test_own_property(u):
    pass
"""


def test_runplan_examples_sets_the_suite_s_examples_alone(service: Path) -> None:
    """``--runplan-examples 2`` in a session that runs the service's own tests too:
    the suite's tests run 2 examples each, the service's own keep its profile's 4 (the
    option once loaded a profile of its own for the whole session)."""
    (service / "test_own.py").write_text(OWN_TESTS)
    code, out = _suite(
        service,
        "--runplan-planner",
        "runplan:plan_run",
        "--runplan-examples",
        "2",
        "--hypothesis-show-statistics",
        "test_own.py",
    )
    assert code == 0, out
    counts = {
        name: int(n)
        for name, n in re.findall(
            r"::(test_\w+):\n(?:.*\n)*?\s+- (\d+) passing\b", out, re.MULTILINE
        )
    }
    assert counts["test_own_property"] == 4, out
    suite = {name: n for name, n in counts.items() if name != "test_own_property"}
    assert len(suite) >= len(CLAUSES) and max(suite.values()) <= 2, suite
