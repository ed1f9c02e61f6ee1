"""``python -m runplan check``: plans from ``plan_run`` pass; tampered plans name the
broken clause and exit 2; unreadable input exits 1 with one line, no traceback."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runplan import RunPlan, plan_run, provision_all, wire
from runplan.cli import main
from runplan.contract import CLAUSE, CLAUSES
from runplan.testing.strategies import Tampering
from tests.support.strategies import PlanInputs, small_plan, tamperings, valid_plan_inputs

ISSUE_TAMPERINGS = [
    "duplicate edge id",
    "range gap",
    "swapped endpoints",
    "foreign layer range",
    "extent off by one",
]


def _unchecked(message: object) -> object:
    """A message as the wire writes it, without ``wire.dumps``'s refusal of values no
    peer reads (a tampered plan may hold one, a negative integer: the check must read
    the document and refuse it)."""
    return wire._converter.unstructure(message, unstructure_as=wire.WireMessage)


def _document(plan: RunPlan, provisions: tuple[object, ...] | None = None) -> bytes:
    if provisions is None:
        return json.dumps(_unchecked(plan)).encode()
    doc = {
        "plan": _unchecked(plan),
        "provisions": [_unchecked(p) for p in provisions],
    }
    return json.dumps(doc).encode()


def _check(tmp: Path, data: bytes, *flags: str) -> int:
    path = tmp / "plan.json"
    path.write_bytes(data)
    return main(["check", str(path), *flags])


def _run(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "runplan", *args],
        input=stdin,
        capture_output=True,
        timeout=120,
        check=False,
    )


@settings(max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(valid_plan_inputs(), st.booleans())
def test_plans_from_plan_run_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], inputs: PlanInputs, given_too: bool
) -> None:
    plan = plan_run(inputs.facts, inputs.config, inputs.pool, **inputs.kwargs())
    assert isinstance(plan, RunPlan)
    provisions = provision_all(plan) if given_too else None
    assert _check(tmp_path, _document(plan, provisions), "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["holds"] is True and "error" not in out
    assert out["provisions"] == ("given" if given_too else "derived")
    assert [c["name"] for c in out["clauses"]] == [c.name for c in CLAUSES]
    verdicts = {c["name"]: c["verdict"] for c in out["clauses"]}
    assert verdicts.pop("unknown_node_id_rejects") == "not_checked"  # a plan has no pool
    assert set(verdicts.values()) == {"holds"}


def test_the_plan_commands_json_read_from_standard_input_passes(
    smollm2_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", smollm2_path, "--nodes", "a=2GiB,b=2GiB,c=2GiB", "--json"]) == 0
    planned = capsys.readouterr().out.encode()
    checked = _run("check", "-", stdin=planned)  # a real process reading a real pipe
    assert checked.returncode == 0, checked.stdout + checked.stderr
    text = checked.stdout.decode()
    assert text.startswith("standard input: run 'run-1', 3 stages, 4 edges")
    for clause in CLAUSES:
        assert clause.text in text
    assert text.count("  pass  ") == len(CLAUSES) - 1 and "FAIL" not in text
    assert text.rstrip().endswith("32 clauses: 31 pass, 0 broken, 1 not checked")


def test_the_runtime_plan_commands_json_passes(
    smollm2_path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What ``python -m runtime_cupy plan --json`` prints: its ``stages`` key (each
    stage's memory and host) describes the plan and is not checked (it was refused:
    "unknown key 'stages'")."""
    from runtime_cupy.cli.main import main as runtime_main

    assert runtime_main(["plan", "--model", smollm2_path, "--stages", "2", "--json"]) == 0
    document = tmp_path / "plan.json"
    document.write_text(capsys.readouterr().out)
    assert "stages" in json.loads(document.read_text())
    assert main(["check", str(document), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["holds"] is True


def _tampered(kind: str) -> Tampering:
    """A tampering of ``kind`` of a three-stage plan, drawn by Hypothesis."""
    plan = small_plan(3)
    found: list[Tampering] = []

    @settings(max_examples=1, database=None, derandomize=True)
    @given(tamperings(plan, kinds=[kind]))
    def draw(t: Tampering) -> None:
        found.append(t)

    draw()
    return found[0]


@pytest.mark.parametrize("kind", ISSUE_TAMPERINGS)
def test_a_tampered_plan_names_the_broken_clause_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    t = _tampered(kind)
    clause = CLAUSE[t.breaks]
    assert _check(tmp_path, _document(t.plan, t.provisions)) == 2
    lines = capsys.readouterr().out.splitlines()
    assert f"  FAIL  {clause.text}" in lines
    why = lines[lines.index(f"  FAIL  {clause.text}") + 1]
    assert why.startswith("        ") and why.strip()  # what broke it, on the next line
    assert "broken" in lines[-1] and " 0 broken" not in lines[-1]
    assert _check(tmp_path, _document(t.plan, t.provisions), "--json") == 2
    out = json.loads(capsys.readouterr().out)
    assert out["holds"] is False
    # a failing command's object has an error (docs/json-output.md), the report beside it
    assert out["error"]["type"] == "ContractBroken" and set(out["error"]) == {"type", "message"}
    assert t.breaks in out["error"]["message"] and out["summary"] in out["error"]["message"]
    (verdict,) = [c for c in out["clauses"] if c["name"] == t.breaks]
    assert verdict["verdict"] == "broken" and (verdict["problems"] or verdict["rejection"])
    if t.rejection is not None:
        assert out["rejection"]["code"] == t.rejection.code


@settings(max_examples=20, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(valid_plan_inputs(), st.data())
def test_every_tampering_exits_2_naming_its_clause_or_1_naming_an_unwritable_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], inputs: PlanInputs, data: st.DataObject
) -> None:
    plan = plan_run(inputs.facts, inputs.config, inputs.pool, **inputs.kwargs())
    assert isinstance(plan, RunPlan)
    t = data.draw(tamperings(plan))
    try:
        for message in (t.plan, *(t.provisions or ())):
            wire.loads(wire.dumps(message))
    except wire.WireError as error:
        # A value no document can hold (a negative alignment: the wire's integers are
        # unsigned) makes the document unreadable: exit 1, the value named, no verdict.
        assert _check(tmp_path, _document(t.plan, t.provisions), "--json") == 1, t.what
        out = json.loads(capsys.readouterr().out)
        assert out["error"]["type"] == "UnreadableInput"
        assert str(error).rpartition(": ")[2] in out["error"]["message"], t.what
        return
    assert _check(tmp_path, _document(t.plan, t.provisions), "--json") == 2
    out = json.loads(capsys.readouterr().out)
    assert {c["name"]: c["verdict"] for c in out["clauses"]}[t.breaks] == "broken", t.what


_PLAN = json.loads(wire.dumps(small_plan(2)))
_PROVISION = json.loads(wire.dumps(provision_all(small_plan(2))[0]))
GARBAGE = {
    "not json": b"this is not a plan",
    "binary": bytes(range(256)),
    "empty": b"",
    "a list": b"[1, 2]",
    "another message": wire.dumps(provision_all(small_plan(2))[0]),
    "a key missing": json.dumps({k: v for k, v in _PLAN.items() if k != "edges"}).encode(),
    "an extra key": json.dumps({"plan": _PLAN, "provision": []}).encode(),
    "provisions not a list": json.dumps({"plan": _PLAN, "provisions": _PROVISION}).encode(),
    "a plan among the provisions": json.dumps({"plan": _PLAN, "provisions": [_PLAN]}).encode(),
    "NaN": json.dumps({**_PLAN, "max_tokens": float("nan")}).encode(),
    "a float for an int": json.dumps({**_PLAN, "max_tokens": 4.0}).encode(),
}


@pytest.mark.parametrize("name", sorted(GARBAGE))
def test_unreadable_input_exits_1_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    assert _check(tmp_path, GARBAGE[name]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: ")
    assert _check(tmp_path, GARBAGE[name], "--json") == 1
    captured = capsys.readouterr()
    assert set(json.loads(captured.out)) == {"error"} and captured.out.count("\n") == 1


def test_garbage_and_missing_files_exit_1_without_a_traceback(tmp_path: Path) -> None:
    for args, stdin in (
        (("check", "-"), bytes(range(256)) * 3),
        (("check", str(tmp_path / "absent.json")), b""),
    ):
        done = _run(*args, stdin=stdin)
        assert done.returncode == 1, (args, done)
        assert done.stdout == b""
        err = done.stderr.decode()
        assert err.count("\n") == 1 and err.startswith("error: "), err
        assert "Traceback" not in err


def test_a_folder_is_unreadable_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith(f"error: {tmp_path}: cannot read it: ")


def _stdin(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))


def test_stdin_is_named_standard_input(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _stdin(monkeypatch, b"[]")
    assert main(["check", "-"]) == 1
    assert capsys.readouterr().err.startswith("error: standard input: ")
    _stdin(monkeypatch, wire.dumps(attrs.evolve(small_plan(2), max_tokens=0)))  # no run has it
    assert main(["check", "-"]) == 2
    text = capsys.readouterr().out
    assert text.startswith("standard input: run 'run-1'")
    first = CLAUSE["planner_emits_exactly_one_runplan_or_a_typed_rejection"]
    assert f"  FAIL  {first.text}" in text and "invalid_config: max_tokens = 0" in text
