"""The committed state diagrams are the ones the transition tables generate."""

from __future__ import annotations

from pathlib import Path

import pytest

from runplan.fsm.diagrams import DIAGRAMS, main, render

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


def test_the_command_writes_both_and_help_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--help`` once made a folder named ``--help`` and wrote the diagrams in it."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0 and "usage: python -m runplan.fsm" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        main(["--bogus"])
    assert exited.value.code == 2
    assert list(tmp_path.iterdir()) == []
    assert main([str(tmp_path / "out")]) == 0
    for name in DIAGRAMS:
        assert (tmp_path / "out" / name).read_text() == render(name)
