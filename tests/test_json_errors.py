"""Every ``--json`` command line of the project, failing: standard output is one JSON
object with ``error: {type, message, ...}`` (``runplan.json_errors``,
docs/json-output.md), whatever failed (a bad model path, a malformed GGUF, a refused
plan, a bad flag value, an unreadable input, a faulted run)."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import pytest

import runtime_sim.cli
from runplan.cli import main as runplan_main
from runplan.json_errors import cancelled_command, documents_printed, print_json
from runtime_cupy.cli.main import main as cupy_main
from runtime_sim.cli import main as sim_main
from tests.fixtures.gguf_models import ModelShape, write_model

Main = Callable[[Sequence[str]], int]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("json-errors")
    bad = root / "bad.gguf"
    bad.write_bytes(b"GGUF but not really")
    plan = root / "plan.json"
    plan.write_text('{"plan": 3}')
    return {
        "model": str(write_model(root / "tiny.gguf", ModelShape(n_layers=4))),
        "bad": str(bad),
        "missing": str(root / "nowhere.gguf"),
        "plan": str(plan),
        "out": str(root / "shards"),
    }


def _sim(argv: Sequence[str]) -> int:
    return sim_main(["run", "--prompt-ids", "1,2", "--max-tokens", "2", *argv])


def _cupy_plan(argv: Sequence[str]) -> int:
    return cupy_main(["plan", *argv])


# (the command, its arguments with {model}, {bad}, ... filled in, exit status, error type)
CASES: list[tuple[str, Main, list[str], int, str]] = [
    ("runplan facts: malformed GGUF", runplan_main, ["facts", "{bad}"], 1, "GgufError"),
    ("runplan plan: missing model", runplan_main,
     ["plan", "{missing}", "--nodes", "a=1GiB"], 1, "ModelNotFound"),
    ("runplan plan: refused", runplan_main,
     ["plan", "{model}", "--nodes", "a=1KiB,b=1GiB"], 2, "PlanRejected"),
    ("runplan plan: bad flag value", runplan_main,
     ["plan", "{model}", "--nodes", "a=lots"], 2, "UsageError"),
    ("runplan split: refused", runplan_main,
     ["split", "{model}", "--stages", "9", "--out", "{out}"], 2, "PlanRejected"),
    ("runplan split: no --stages nor --nodes", runplan_main,
     ["split", "{model}", "--out", "{out}"], 2, "UsageError"),
    ("runplan split: --stages 0", runplan_main,
     ["split", "{model}", "--stages", "0", "--out", "{out}"], 2, "UsageError"),
    ("runplan check: not a plan", runplan_main, ["check", "{plan}"], 1, "UnreadableInput"),
    ("runtime_cupy: malformed GGUF", cupy_main,
     ["--model", "{bad}", "--prompt-ids", "1"], 2, "GgufError"),
    ("runtime_cupy: bad flag value", cupy_main,
     ["--model", "{model}", "--prompt-ids", "1", "--stages", "0"], 2, "UsageError"),
    ("runtime_cupy: --chat with --prompt-ids", cupy_main,
     ["--model", "{model}", "--prompt-ids", "1", "--chat"], 2, "UsageError"),
    ("runtime_sim run: --chat with --prompt-ids", sim_main,
     ["run", "--model", "{model}", "--prompt-ids", "1", "--chat"], 2, "UsageError"),
    ("runtime_cupy plan: missing model", _cupy_plan, ["--model", "{missing}"], 2, "ModelNotFound"),
    ("runtime_cupy plan: refused", _cupy_plan,
     ["--model", "{model}", "--stages", "9"], 2, "PlanRejected"),
    ("runtime_cupy plan: bad flag value", _cupy_plan,
     ["--model", "{model}", "--max-seq-len", "-5"], 2, "UsageError"),
    ("runtime_sim run: missing model", _sim, ["--model", "{missing}"], 2, "ModelNotFound"),
    ("runtime_sim run: refused", _sim, ["--model", "{model}", "--stages", "9"], 2, "PlanRejected"),
    ("runtime_sim run: bad flag value", _sim,
     ["--model", "{model}", "--temperature", "warm"], 2, "UsageError"),
    ("runtime_sim explore: bad flag value", sim_main,
     ["explore", "--seeds", "0"], 2, "UsageError"),
]  # fmt: skip


def _error_of(out: str) -> dict[str, Any]:
    """The one JSON object of ``out``, checked for the common shape; its ``error``."""
    assert out.endswith("\n") and out.count("\n") == 1, out  # exactly one object, one line
    doc = json.loads(out)
    assert isinstance(doc, dict) and isinstance(doc.get("error"), dict), doc
    error: dict[str, Any] = doc["error"]
    assert isinstance(error.get("type"), str) and error["type"], error
    assert isinstance(error.get("message"), str) and error["message"].strip(), error
    assert "\n" not in error["message"], error
    return error


def _run(main: Main, argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # a usage error: argparse exits
        assert isinstance(exc.code, int)
        return exc.code


@pytest.mark.parametrize(
    ("command", "main", "argv", "status", "kind"), CASES, ids=[c[0] for c in CASES]
)
def test_a_failing_json_command_prints_one_error_object(
    files: dict[str, str],
    command: str,
    main: Main,
    argv: list[str],
    status: int,
    kind: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _run(main, [a.format(**files) for a in argv] + ["--json"]) == status, command
    error = _error_of(capsys.readouterr().out)
    assert error["type"] == kind, error
    if kind == "PlanRejected":  # the rejection's code and values, typed
        assert isinstance(error["code"], str) and error["message"].startswith(error["code"])
        assert len(error) > 3, error


# Flags that no parser knows (the top parser reports them, and it has no --json) and
# --json abbreviated (argparse takes --js for it): (the command, its arguments).
UNKNOWN_FLAGS: list[tuple[str, Main, list[str]]] = [
    ("runplan facts", runplan_main, ["facts", "{model}", "--json", "--bogus"]),
    ("runplan plan", runplan_main, ["plan", "{model}", "--nodes", "a=1GiB", "--json", "--bogus"]),
    ("runplan check", runplan_main, ["check", "{plan}", "--json", "--bogus"]),
    ("runplan split", runplan_main, ["split", "{model}", "--stages", "2", "--out", "{out}",
                                     "--json", "--bogus"]),
    ("runtime_sim run", sim_main, ["run", "--prompt", "hi", "--json", "--bogus"]),
    ("runtime_sim explore: a flag of run's", sim_main, ["explore", "--model", "{bad}", "--json"]),
    ("runtime_cupy: --js", cupy_main, ["--model", "{model}", "--prompt", "hi", "--js",
                                       "--stages", "0"]),
    ("runplan plan: --js", runplan_main, ["plan", "{model}", "--nodes", "a=1GiB", "--js",
                                          "--bogus"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("command", "main", "argv"), UNKNOWN_FLAGS, ids=[c[0] for c in UNKNOWN_FLAGS]
)
def test_an_unknown_flag_with_json_is_one_usage_error(
    files: dict[str, str],
    command: str,
    main: Main,
    argv: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _run(main, [a.format(**files) for a in argv]) == 2, command
    error = _error_of(capsys.readouterr().out)
    assert error["type"] == "UsageError", error


def test_json_after_a_double_dash_is_an_operand_not_the_flag(
    files: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(runplan_main, ["facts", "--bogus", "--", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--bogus" in captured.err


def test_a_bad_flag_without_json_prints_nothing_on_stdout(
    files: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(runplan_main, ["plan", files["model"], "--nodes", "a=lots"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--nodes" in captured.err


def test_a_command_line_without_json_is_not_read_as_asking_for_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``serve`` and ``chat`` have no ``--json``: a usage error stays on standard error."""
    assert _run(cupy_main, ["serve", "--port", "x", "--json"]) == 2
    assert _run(cupy_main, ["chat", "--stages", "x", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--port" in captured.err and "--stages" in captured.err


def test_a_refused_runplan_plan_keeps_its_rejection_object(
    files: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert runplan_main(["plan", files["model"], "--nodes", "a=1KiB,b=1GiB", "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["rejection"] == {k: v for k, v in doc["error"].items() if k != "type"}
    assert doc["error"]["code"] == "insufficient_memory" and doc["error"]["device"] == "a"


def test_a_faulted_simulated_run_is_its_result_and_an_error(
    files: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = runtime_sim.cli.generate

    def faulted(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        return attrs.evolve(result, outcome="faulted", fault="stage 1 (node n1): boom")

    monkeypatch.setattr(runtime_sim.cli, "generate", faulted)
    assert _sim(["--model", files["model"], "--json"]) == 1
    out = capsys.readouterr().out
    error = _error_of(out)
    assert error == {"type": "RunFaulted", "message": "run faulted: stage 1 (node n1): boom"}
    doc = json.loads(out)
    assert doc["outcome"] == "faulted" and doc["fault"] == "stage 1 (node n1): boom"


def test_a_cache_that_cannot_be_used_is_one_error_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GGUF_PIPELINE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("GGUF_PIPELINE_CACHE_LIMIT", "lots")
    assert cupy_main(["cache", "list", "--json"]) == 2
    error = _error_of(capsys.readouterr().out)
    assert error["type"] == "CacheError" and "'lots'" in error["message"]


@pytest.mark.parametrize("where", ["before the run", "during the run"])
def test_a_cancelled_simulated_run_is_one_error_object(
    files: dict[str, str],
    where: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Ctrl-C: before a run began, the object is the error alone; during it, the run's
    result (outcome ``cancelled``) with the error beside it."""

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    name = "resolve_model" if where == "before the run" else "generate"
    monkeypatch.setattr(runtime_sim.cli, name, interrupted)
    assert _sim(["--model", files["model"], "--json"]) == 130
    out = capsys.readouterr().out
    assert _error_of(out) == {"type": "Cancelled", "message": "cancelled"}
    if where == "during the run":
        assert json.loads(out)["outcome"] == "cancelled"


class SigtermNotTaken(Exception):
    """SIGTERM reached the test's own handler: the command did not take it."""


def _sigterm_self(signum: int = signal.SIGTERM) -> None:
    """``signum`` (SIGTERM) to this process, and the wait for its handler (it runs at
    once)."""
    os.kill(os.getpid(), signum)
    for _ in range(500):
        time.sleep(0.01)
    raise AssertionError("SIGTERM raised nothing")


@pytest.fixture
def sigterm_fallback() -> Iterator[None]:
    """SIGTERM that no command takes fails the test (it would end pytest)."""

    def fallback(_signum: int, _frame: object) -> None:
        raise SigtermNotTaken

    previous = signal.signal(signal.SIGTERM, fallback)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("where", ["before the run", "during the run"])
@pytest.mark.usefixtures("sigterm_fallback")
def test_a_simulated_run_that_sigterm_ends_is_one_cancelled_object(
    files: dict[str, str],
    where: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SIGTERM cancels ``runtime_sim run`` as Ctrl-C does (it ended the process, no
    JSON): exit 143, ``Cancelled`` naming it; during the run, the tokens so far."""

    def terminated_before(*args: Any, **kwargs: Any) -> Any:
        _sigterm_self()

    def terminated_during(*args: Any, on_token: Callable[[int], None], **kwargs: Any) -> Any:
        on_token(5)
        on_token(7)
        _sigterm_self()

    if where == "before the run":
        monkeypatch.setattr(runtime_sim.cli, "resolve_model", terminated_before)
    else:
        monkeypatch.setattr(runtime_sim.cli, "generate", terminated_during)
    assert _sim(["--model", files["model"], "--json"]) == 143
    out = capsys.readouterr().out
    assert _error_of(out) == {"type": "Cancelled", "message": "cancelled by SIGTERM"}
    if where == "during the run":
        doc = json.loads(out)
        assert doc["outcome"] == "cancelled" and doc["tokens"] == [5, 7]
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the fallback, given back


def test_ctrl_c_before_a_process_run_is_one_error_object(
    files: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import runtime_cupy.cli.main

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(runtime_cupy.cli.main, "resolve_model", interrupted)
    assert cupy_main(["--model", files["model"], "--prompt-ids", "1", "--json"]) == 130
    assert _error_of(capsys.readouterr().out) == {"type": "Cancelled", "message": "cancelled"}


def test_a_document_a_signal_interrupts_as_it_is_flushed_counts_as_printed() -> None:
    """Python raises a signal's ``KeyboardInterrupt`` as the flush returns, the document
    written: it counts, so that no ``Cancelled`` object follows it."""

    class FlushedThenInterrupted(io.StringIO):
        def flush(self) -> None:
            super().flush()
            raise KeyboardInterrupt

    out = FlushedThenInterrupted()
    before = documents_printed()
    with pytest.raises(KeyboardInterrupt):
        print_json({"outcome": "completed"}, out)
    assert documents_printed() == before + 1
    assert out.getvalue() == '{"outcome": "completed"}\n'


def test_a_document_json_cannot_hold_is_not_counted_as_printed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``print_json`` of a value JSON cannot hold raises before anything is written: no
    document counts, so a Ctrl-C that follows still prints the ``Cancelled`` object."""
    out = io.StringIO()
    before = documents_printed()
    with pytest.raises(TypeError):
        print_json({"x": object()}, out)
    assert (documents_printed(), out.getvalue()) == (before, "")
    assert cancelled_command(None, as_json=True, since=before) == 130
    assert _error_of(capsys.readouterr().out) == {"type": "Cancelled", "message": "cancelled"}


@pytest.mark.parametrize("command", ["runtime_cupy", "runtime_sim"])
def test_ctrl_c_right_after_a_run_printed_its_object_prints_no_second_one(
    files: dict[str, str],
    command: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A Ctrl-C that comes once the run's object is printed, before the command returns
    (its handlers given back): ``cancelled`` and 130, and standard output still that one
    object (the command's own except printed the ``Cancelled`` object after it)."""
    import runtime_cupy.cli.main

    def printed_then_interrupted(args: Any) -> int:
        write = runtime_cupy.cli.main.write_json if command == "runtime_cupy" else print_json
        write({"outcome": "completed"})
        raise KeyboardInterrupt

    argv = ["--model", files["model"], "--prompt-ids", "1", "--json"]
    if command == "runtime_cupy":
        monkeypatch.setattr(runtime_cupy.cli.main, "_run", printed_then_interrupted)
        status = cupy_main(argv)
    else:
        monkeypatch.setattr(runtime_sim.cli, "_cmd_run", printed_then_interrupted)
        status = sim_main(["run", *argv])
    out, err = capsys.readouterr()
    assert (status, err.splitlines()[-1:]) == (130, ["cancelled"]), err
    assert out.count("\n") == 1 and json.loads(out) == {"outcome": "completed"}, out


@pytest.mark.parametrize(
    ("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"]
)
@pytest.mark.usefixtures("sigterm_fallback")
def test_a_cancelled_prompts_file_keeps_the_prompts_that_ended(
    files: dict[str, str],
    tmp_path: Path,
    signum: int,
    status: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--prompts-file --json``, Ctrl-C or SIGTERM after two of three prompts ended:
    their ``results`` and counts beside the ``Cancelled`` error (Ctrl-C's object was the
    error alone; SIGTERM ended the process, no JSON), the batch closed, 128 + the
    signal's number."""
    import runtime_cupy.cli.prompts_file as batch_cli

    closed: list[bool] = []

    def two_then_the_signal(*args: Any, **kwargs: Any) -> Iterator[tuple[int, Any]]:
        try:
            yield 2, SimpleNamespace(tokens=(4, 5), text="ab", outcome="completed", fault=None)
            yield 0, SimpleNamespace(tokens=(6,), text="c", outcome="faulted", fault="boom")
            _sigterm_self(signum)
        finally:
            closed.append(True)

    monkeypatch.setattr(batch_cli, "generate_batch", two_then_the_signal)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [1]}\n{"prompt_ids": [2]}\n{"prompt_ids": [3]}\n')
    argv = ["--model", files["model"], "--prompts-file", str(prompts), "--json"]
    assert cupy_main(argv) == status
    out = capsys.readouterr().out
    name = signal.Signals(signum).name
    assert _error_of(out) == {"type": "Cancelled", "message": f"cancelled by {name}"}
    doc = json.loads(out)
    assert [(r["index"], r["tokens"], r["outcome"]) for r in doc["results"]] == [
        (0, [6], "faulted"),
        (2, [4, 5], "completed"),
    ]
    assert (doc["prompts"], doc["completed"], doc["faulted"]) == (3, 1, 1)
    assert closed == [True]


@pytest.mark.parametrize(
    ("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"]
)
@pytest.mark.usefixtures("sigterm_fallback")
def test_cancelled_simulated_runs_keep_the_runs_that_ended(
    files: dict[str, str],
    signum: int,
    status: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``runtime_sim run --runs 3 --json``, Ctrl-C or SIGTERM once the first run ended
    (the real simulation; the signal sent as that run is reported): that run beside the
    ``Cancelled`` error (the object was the error alone), as ``--prompts-file`` does."""
    real = runtime_sim.cli.generate_runs

    def the_signal_after_the_first_end(
        *args: Any, on_run_end: Callable[[int, Any], None], **kwargs: Any
    ) -> Any:
        def ended(index: int, result: Any) -> None:
            on_run_end(index, result)
            _sigterm_self(signum)

        return real(*args, on_run_end=ended, **kwargs)

    monkeypatch.setattr(runtime_sim.cli, "generate_runs", the_signal_after_the_first_end)
    assert _sim(["--model", files["model"], "--runs", "3", "--json"]) == status
    out = capsys.readouterr().out
    name = signal.Signals(signum).name
    assert _error_of(out) == {"type": "Cancelled", "message": f"cancelled by {name}"}
    (run,) = json.loads(out)["runs"]
    assert run["index"] in (0, 1, 2)
    assert (run["outcome"], len(run["tokens"])) == ("completed", 2)


@pytest.mark.parametrize(
    ("main", "argv"),
    [
        (_sim, ["--max-tokens", "100000"]),
        (cupy_main, ["--prompt-ids", "1,2", "--max-tokens", "100000"]),
    ],
    ids=["runtime_sim run", "runtime_cupy"],
)
def test_a_run_past_the_context_is_the_planner_s_invalid_config(
    files: dict[str, str], capsys: pytest.CaptureFixture[str], main: Main, argv: list[str]
) -> None:
    """As ``runplan plan`` refuses a run its ``max_seq_len`` cannot hold: a ValueError
    without a code once."""
    assert main(["--model", files["model"], *argv, "--json"]) == 2
    error = _error_of(capsys.readouterr().out)
    assert (error["type"], error["code"], error["field"]) == (
        "PlanRejected",
        "invalid_config",
        "prompt_tokens",
    )
    assert "2 prompt tokens + max_tokens 100000 need 100001 positions" in error["message"]
    assert "the model's context length is" in error["message"]


def test_a_max_seq_len_past_the_context_names_the_flag(
    files: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """It named a prompt of 0 tokens and ``max_tokens``, flags no one gave."""
    assert _cupy_plan(["--model", files["model"], "--max-seq-len", "100000000", "--json"]) == 2
    error = _error_of(capsys.readouterr().out)
    assert error["message"].startswith("--max-seq-len 100000000 is past the model's context")
    assert "max_tokens" not in error["message"]
