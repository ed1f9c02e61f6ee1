"""The pytest plugin of the clause suite, registered as the ``pytest11`` entry point
``runplan.testing.plugin`` (pytest loads it wherever gguf-pipeline is installed; it
does nothing unless asked).

It gives the suite (``runplan.testing.suite``) its ``runplan_planner`` fixture::

    python -m pytest --runplan-planner mypkg.plans:build_plan --pyargs runplan.testing.suite

- ``--runplan-planner MODULE:NAME`` (or ini ``runplan_planner``): the plan-building
  callable, called as ``planner(facts, config, pool, stage_count=N, placement=P)``
  and returning a ``RunPlan`` or a ``PlanRejection``; ``runplan:plan_run`` by default.
- ``--runplan-examples N``: Hypothesis examples per test of the suite (else the loaded
  profile's); the session's other tests, and the loaded profile, are left as they are
  (``suite_examples``, read by the suite's settings as its modules load).

Importing this module needs only pytest: Hypothesis is imported when the suite runs.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest

from runplan.contract import Planner

_PLANNER = pytest.StashKey[Planner]()
_SPEC = pytest.StashKey[str]()
_ASKED: dict[str, int] = {}  # "examples": --runplan-examples, while its session runs


def suite_examples() -> int | None:
    """``--runplan-examples`` of the session running (``None``: not given, or none)."""
    return _ASKED.get("examples")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("runplan", "RunPlan contract suite (runplan.testing.suite)")
    group.addoption(
        "--runplan-planner",
        metavar="MODULE:NAME",
        default=None,
        help="the plan-building callable the clause suite checks, called as "
        "NAME(facts, config, pool, stage_count=N, placement=P) "
        "(default: runplan:plan_run)",
    )
    group.addoption(
        "--runplan-examples",
        metavar="N",
        type=int,
        default=None,
        help="Hypothesis examples per clause test (default: the loaded profile's)",
    )
    parser.addini("runplan_planner", "default for --runplan-planner", default="")


def load_planner(spec: str) -> Planner:
    """The callable ``MODULE:NAME`` names; ``pytest.UsageError`` naming what is wrong."""
    module_name, sep, name = spec.partition(":")
    where = f"--runplan-planner {spec!r}"
    if not sep or not module_name or not name:
        raise pytest.UsageError(f"{where}: write MODULE:NAME, e.g. mypkg.plans:build_plan")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise pytest.UsageError(f"{where}: cannot import {module_name!r}: {exc}") from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise pytest.UsageError(f"{where}: {module_name!r} has no {name!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise pytest.UsageError(f"{where}: {name!r} is a {type(obj).__name__}, not callable")
    try:
        inspect.signature(obj).bind(None, None, None, stage_count=1, placement=None)
    except TypeError as exc:
        raise pytest.UsageError(
            f"{where}: cannot be called as {name}(facts, config, pool, stage_count=..., "
            f"placement=...): {exc}"
        ) from None
    except ValueError:
        pass  # no signature to inspect (a builtin): let the calls tell
    planner: Planner = obj
    return planner


def pytest_configure(config: pytest.Config) -> None:
    spec = config.getoption("runplan_planner") or config.getini("runplan_planner")
    if spec:
        config.stash[_PLANNER] = load_planner(spec)
        config.stash[_SPEC] = spec
    examples = config.getoption("runplan_examples")
    if examples is not None and examples < 1:
        raise pytest.UsageError(f"--runplan-examples {examples}: must be at least 1")
    _ASKED.pop("examples", None)
    if examples is not None:
        _ASKED["examples"] = examples  # for the suite's settings alone: no profile loaded


def pytest_unconfigure(config: pytest.Config) -> None:
    _ASKED.pop("examples", None)


def pytest_report_header(config: pytest.Config) -> str | None:
    spec = config.stash.get(_SPEC, None)
    return f"runplan contract suite: planner {spec}" if spec else None


@pytest.fixture(scope="session")
def runplan_planner(pytestconfig: pytest.Config) -> Planner:
    """The plan-building function the clause suite checks."""
    planner = pytestconfig.stash.get(_PLANNER, None)
    if planner is None:
        from runplan import plan_run

        return plan_run
    return planner
