"""Standard error's reader gone (a pipe whose reader exited: a log collector that died, a
supervisor that closed its end) while a ``--json`` run writes its text there: the run
goes on, its object is printed on standard output, intact, and the exit status is the
run's (0, or 1 for a fault). It was 141, as for standard output's reader gone, with the
run cancelled at its first token and no object printed; a faulted run whose object was
printed exited 141 for its ``error: run faulted`` line. Its stages, whose standard error
is the same pipe, end as they would (status 0) and leave nothing."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runtime_cupy.test_process_cli import _env
from tests.support.hygiene import run_resources

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process


def _run_with_stderr_unread(
    argv: list[str], out: Path, nofile: int | None = None
) -> tuple[int, dict[str, object]]:
    """``argv``'s exit status and its one JSON object, standard error a pipe no one
    reads (closed before the command starts), ``nofile`` its descriptor limit."""

    def limited() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        with open(out, "w+") as stdout:
            proc = subprocess.run(
                [sys.executable, "-m", *argv, "--json"],
                stdout=stdout, stderr=write_end, check=False, env=_env(), timeout=120,
                preexec_fn=limited,
            )  # fmt: skip
            stdout.seek(0)
            text = stdout.read()
    finally:
        os.close(write_end)
    return proc.returncode, json.loads(text)


@pytest.mark.parametrize("package", ["runtime_cupy", "runtime_sim"])
def test_a_run_whose_stderr_reader_is_gone_completes_and_prints_its_object(
    tiny: str, tmp_path: Path, package: str
) -> None:
    argv = [package] + (["run"] if package == "runtime_sim" else [])
    argv += ["--model", tiny, "--stages", "2", "--prompt-ids", "1,2,3", "--max-tokens", "6"]
    status, doc = _run_with_stderr_unread(argv, tmp_path / "out.json")
    assert status == 0, doc
    assert doc["outcome"] == "completed" and len(doc["tokens"]) == 6, doc  # type: ignore[arg-type]
    assert doc["text"], doc  # there was text to write on standard error
    if package == "runtime_cupy":
        assert [s["exit_status"] for s in doc["stages"]] == [0, 0], doc  # type: ignore[attr-defined]
        assert run_resources(str(doc["chain_id"])) == []


def test_a_faulted_run_whose_stderr_reader_is_gone_exits_1_with_its_object(
    tiny: str, tmp_path: Path
) -> None:
    """The stages cannot be started (the descriptor limit): the fault's line on standard
    error is lost, its object and exit status are not."""
    argv = ["runtime_cupy", "--model", tiny, "--stages", "4", "--prompt-ids", "1,2"]
    status, doc = _run_with_stderr_unread(argv, tmp_path / "out.json", nofile=20)
    assert status == 1, doc
    assert doc["outcome"] == "faulted", doc
    assert "Too many open files" in str(doc["fault"]), doc
    assert run_resources(str(doc["chain_id"])) == []
