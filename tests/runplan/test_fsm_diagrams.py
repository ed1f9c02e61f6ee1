"""The committed state diagrams are the ones the transition tables generate."""

from __future__ import annotations

from pathlib import Path

import pytest

from runplan.fsm.__main__ import DIAGRAMS, render

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize("name", sorted(DIAGRAMS))
def test_committed_diagram_is_current(name: str) -> None:
    committed = (DOCS / name).read_text()
    assert committed == render(name), (
        f"docs/{name} is stale: regenerate it with `python -m runplan.fsm docs`"
    )


@pytest.mark.parametrize("name", sorted(DIAGRAMS))
def test_every_state_appears_in_its_diagram(name: str) -> None:
    from runplan.fsm import orchestrator, stage

    states = (orchestrator if "orchestrator" in name else stage).State
    text = render(name)
    for state in states:
        assert state.name in text
