"""What a service installs: ``runplan`` (planning and ``python -m runplan check``) and
``runplan.testing``'s assertions need neither Hypothesis nor pytest; the plugin needs
pytest only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from runplan import wire
from tests.support.strategies import small_plan

WITHOUT = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None  # importing it now raises ImportError
{body}
loaded = [m for m, v in sys.modules.items() if v and m.split(".")[0] in {blocked!r}]
assert not loaded, loaded
"""


def _python_without(blocked: tuple[str, ...], body: str) -> subprocess.CompletedProcess[str]:
    code = WITHOUT.format(blocked=blocked, body=body)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_runplan_its_check_command_and_the_assertions_need_no_test_dependencies(
    tmp_path: Path,
) -> None:
    plan_file = tmp_path / "plan.json"
    plan_file.write_bytes(wire.dumps(small_plan(2)))
    body = f"""
import runplan, runplan.contract, runplan.testing, runplan.testing.assertions
from runplan.testing import assert_contract, assert_stage_ranges_are_contiguous
from runplan.cli import main
assert main(["check", {str(plan_file)!r}]) == 0
"""
    done = _python_without(("hypothesis", "pytest", "_pytest"), body)
    assert done.returncode == 0, done.stderr
    assert "32 clauses: 31 pass, 0 broken, 1 not checked" in done.stdout


def test_without_hypothesis_the_plugin_imports_and_the_strategies_say_what_to_install() -> None:
    body = """
import runplan.testing.plugin
try:
    import runplan.testing.strategies
except ImportError as exc:
    print(exc)
"""
    done = _python_without(("hypothesis",), body)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "runplan.testing.strategies needs Hypothesis: pip install 'gguf-pipeline[testing]'"
    )
