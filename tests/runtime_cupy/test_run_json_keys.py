"""``python -m runtime_cupy --json``: the object docs/runtime.md describes is the one a run
prints, key for key (docs/json-output.md sends the reader to each command's page)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from runtime_cupy.cli.main import main
from runtime_cupy.slices.progress import figures
from runtime_cupy.slices.server import StageTransfer

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process

PAGE = Path(__file__).resolve().parents[2] / "docs" / "runtime.md"
HEADING = "## A run's JSON object (`python -m runtime_cupy --json`)"


def _documented() -> dict[str, Any]:
    """The example object of the page's section on a run's JSON."""
    _, found, section = PAGE.read_text().partition(HEADING)
    assert found, f"docs/runtime.md has no section {HEADING!r}"
    block = re.search(r"```json\n(.*?)```", section, re.DOTALL)
    assert block is not None, f"docs/runtime.md: no JSON example under {HEADING!r}"
    return json.loads(block.group(1))


def _keys(doc: dict[str, Any]) -> dict[str, set[str]]:
    """The object's keys, and those of its lists' first items and of ``timings``."""
    keys = {"": set(doc), "timings": set(doc["timings"])}
    for name in ("stages", "edges", "slices"):
        if doc[name]:
            keys[name] = set(doc[name][0])
    return keys


def test_the_documented_object_is_the_one_a_run_prints(
    tiny: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", tiny, "--stages", "2", "--prompt-ids", "1,2", "--max-tokens", "2"]
    assert main([*argv, "--worker", "numpy", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["slices"] == []  # every stage on this host: the slices' keys below
    printed["slices"] = figures([StageTransfer(1, "b", "10.0.0.2", "done")])
    documented = _documented()
    assert _keys(documented) == _keys(printed), (documented, printed)
