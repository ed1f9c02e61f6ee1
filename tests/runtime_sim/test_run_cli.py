"""``python -m runtime_sim run``: streamed text, one JSON object with --json, a Chrome
trace, and clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

import runtime_sim.cli
from runtime_sim.cli import main
from tests.fixtures.gguf_models import ModelShape, write_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_model(tmp_path_factory.mktemp("cli") / "tiny.gguf", ModelShape(n_layers=3)))


def test_json_is_the_only_thing_on_stdout(tiny: str) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "runtime_sim",
            "run",
            "--model",
            tiny,
            "--stages",
            "3",
            "--prompt",
            "the quick brown fox",
            "--max-tokens",
            "5",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["outcome"] == "completed" and len(doc["tokens"]) <= 5
    assert [s["layer_start"] for s in doc["stages"]] == [0, 1, 2]
    assert {"predicted_tokens_per_s", "simulated_tokens_per_s"} <= set(doc["timings"])
    assert doc["text"] in proc.stderr  # the streamed text went to stderr


def test_text_streams_to_stdout_and_a_trace_is_written(
    tiny: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.json"
    code = main(
        [
            "run",
            "--model",
            tiny,
            "--stages",
            "2",
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "4",
            "--trace",
            str(trace),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "tokens" in out and "stage" in out
    events = json.loads(trace.read_text())["traceEvents"]
    steps = [e for e in events if e.get("ph") == "X" and e["name"].startswith("step")]
    assert len({e["tid"] for e in steps}) == 2  # both stages' steps, on their own tracks
    waits = [e for e in events if e.get("ph") == "X" and e["name"] == "wait"]
    assert {e["tid"] for e in waits} == {e["tid"] for e in steps}  # the bubbles
    assert all(e["dur"] > 0 for e in waits)


def test_a_figure_there_is_none_of_is_a_dash_in_the_summary(
    tiny: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """One token has no decode step: the summary said "simulated None" (runtime_cupy's
    says "-")."""
    argv = ["run", "--model", tiny, "--prompt-ids", "1,2", "--stages", "1", "--max-tokens", "1"]
    assert main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "None" not in last and "simulated -," in last, last


def test_a_model_without_a_chat_template_is_a_clear_error(
    tiny: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--model", tiny, "--prompt", "hi", "--chat", "--json"]) == 2
    assert "chat_template" in json.loads(capsys.readouterr().out)["error"]["message"]


def test_a_missing_model_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--model", str(tmp_path / "nope.gguf"), "--prompt", "hi"]) == 2
    assert "no such file" in capsys.readouterr().err


class _CleaningTokenizer:
    """Decodes like a byte-level detokenizer: a space before punctuation is removed, and
    the first byte of a two-byte character alone decodes as U+FFFD."""

    vocab = SimpleNamespace(clean_spaces=True)  # (the clean-up's flag, as a vocabulary's)
    pieces: ClassVar[dict[int, bytes]] = {
        1: b"Hello",
        2: b" ",
        3: b".",
        4: b" World",
        5: b"!",
        6: b"\xc3",
        7: b"\xa9",
    }

    def token_bytes(self, token_id: int) -> bytes:
        return self.pieces[token_id]

    def decode_bytes(self, ids: list[int], *, clean_up: bool = True) -> bytes:
        data = b"".join(self.pieces[i] for i in ids)
        return data.replace(b" .", b".").replace(b" !", b"!") if clean_up else data

    def decode(self, ids: list[int], *, clean_up: bool = True) -> str:
        return self.decode_bytes(ids, clean_up=clean_up).decode("utf-8", "replace")


def test_streamed_text_survives_space_cleanup_and_partial_characters() -> None:
    import io

    from runtime_sim.cli import TextStream

    out = io.StringIO()
    tokenizer = _CleaningTokenizer()
    stream = TextStream(tokenizer, out)  # type: ignore[arg-type]
    ids = [1, 2, 3, 4, 6, 7, 2, 5]
    for i in ids:
        stream(i)
    stream.finish(tokenizer.decode(ids))
    assert out.getvalue() == "Hello. World\u00e9!\n"


@pytest.mark.parametrize("ids", ["4294967296", "999999", "1," * 300 + "1"])
def test_a_prompt_the_run_cannot_take_is_one_json_error(
    tiny: str, ids: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["run", "--model", tiny, "--prompt-ids", ids, "--max-tokens", "4", "--json"])
    assert code == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    error = json.loads(out)["error"]
    if ids.startswith("1,"):  # 300 tokens past the tiny model's context: the planner's
        assert (error["type"], error["code"]) == ("PlanRejected", "invalid_config"), error
    else:  # ids outside the vocabulary
        assert error["type"] == "PromptError", error
    assert error["message"]


@pytest.mark.parametrize(
    ("argv", "flag", "needle"),
    [
        (["explore", "--seeds", "-3"], "--seeds", "'-3'"),
        (["explore", "--seeds", "0"], "--seeds", "'0'"),
        (["run", "--prompt-ids", "1", "--trace", "/nonexistent-dir/t.json"], "--trace",
         "'/nonexistent-dir/t.json': No such file or directory"),
        (["run", "--prompt-ids", "1", "--trace", "/"], "--trace", "it is a directory"),
        (["run", "--prompt-ids", "1", "--stages", "-1"], "--stages", "'-1'"),
    ],
)  # fmt: skip
def test_a_bad_flag_is_one_line_naming_it_before_anything_runs(
    tiny: str, argv: list[str], flag: str, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if argv[0] == "run":
        argv = [*argv, "--model", tiny]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and needle in lines[0], lines


def test_a_trace_path_is_checked_without_leaving_a_file(tiny: str, tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    assert main(["run", "--model", tiny, "--prompt-ids", "1", "--max-tokens", "1",
                 "--stages", "1", "--trace", str(trace), "--json"]) == 0  # fmt: skip
    assert json.loads(trace.read_text())  # written after the run
    from runtime_core.console import writable_file

    fresh = tmp_path / "fresh.json"
    assert writable_file(str(fresh)) == fresh and not fresh.exists()


def test_a_trace_naming_a_file_of_the_model_is_refused_and_the_model_kept(
    tiny: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--trace`` naming the model's file (by another path too), one of its shards or
    their manifest: exit 2, one line naming the file, the model as it was (the
    trace replaced the model, exit 0)."""
    from runplan import model_facts_from_gguf
    from runplan.split import split_model, split_plan

    model = tmp_path / "model.gguf"
    model.write_bytes(Path(tiny).read_bytes())
    (tmp_path / "sub").mkdir()
    other_name = tmp_path / "sub" / ".." / "model.gguf"  # the same file, by device and inode
    plan = split_plan(model_facts_from_gguf(model), 2, None, "even")
    split_model(str(model), plan, tmp_path / "shards")  # type: ignore[arg-type]
    shard = next((tmp_path / "shards").glob("*.stage-1-of-2.gguf"))
    cases = [
        (str(model), str(model), model),
        (str(model), str(other_name), model),
        (str(tmp_path / "shards"), str(shard), shard),
        (str(tmp_path / "shards"), str(tmp_path / "shards" / "manifest.json"), None),
    ]
    for source, trace, kept in cases:
        before = kept.read_bytes() if kept else None
        with pytest.raises(SystemExit) as exc:
            main(["run", "--model", source, "--prompt-ids", "1", "--stages", "1",
                  "--trace", trace])  # fmt: skip
        assert exc.value.code == 2, trace
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--trace" in err[0] and "the model's file" in err[0], err
        if kept:
            assert kept.read_bytes() == before


def test_several_runs_of_one_prompt_through_one_chain_each_equal_to_alone(
    tiny: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "--model", tiny, "--stages", "2", "--prompt-ids", "1,2,3"]
    trace = tmp_path / "trace.json"
    assert main([*argv, "--max-tokens", "4", "--runs", "3", "--json", "--trace", str(trace)]) == 0
    doc = json.loads(capsys.readouterr().out)
    events = json.loads(trace.read_text())["traceEvents"]
    steps = [e["name"] for e in events if e.get("ph") == "X" and e["name"].startswith("step")]
    assert any("sim-run-0" in n and "sim-run-1" in n for n in steps)  # a batch of two runs
    assert [r["outcome"] for r in doc["runs"]] == ["completed"] * 3
    assert doc["simulated_tokens_per_s"] > 0
    assert main([*argv, "--max-tokens", "4", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert all(r["tokens"] == alone["tokens"] for r in doc["runs"])  # greedy: batch-invariant


def test_the_cpu_worker_runs_as_the_readme_says(
    tiny: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--worker cpu``: the README's "reference or CPU worker" had no flag; greedy, the
    two workers agree on this model's tokens."""
    tokens = {}
    for worker in ("numpy", "cpu"):
        args = ["run", "--model", tiny, "--prompt-ids", "1,2,3", "--max-tokens", "4", "--json"]
        assert main([*args, "--worker", worker]) == 0
        tokens[worker] = json.loads(capsys.readouterr().out)["tokens"]
    assert tokens["cpu"] == tokens["numpy"] and tokens["cpu"]


def _run(tiny: str, *argv: str) -> int:
    return main(["run", "--model", tiny, "--prompt-ids", "1,2", "--max-tokens", "2", *argv])


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
@pytest.mark.parametrize("runs", ["1", "2"])
def test_a_trace_that_cannot_be_written_costs_nothing_of_the_result(
    tiny: str, runs: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A full disk (``/dev/full``): the result is printed, then one line naming the
    trace's path (with ``--json``, the object's error); exit status 1, no traceback."""
    assert _run(tiny, "--runs", runs, "--trace", "/dev/full", "--json") == 1
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    outcomes = [r["outcome"] for r in doc["runs"]] if runs == "2" else [doc["outcome"]]
    assert outcomes == ["completed"] * int(runs)
    assert doc["error"]["type"] == "TraceNotWritten", doc
    assert doc["error"]["message"] == "cannot write the trace to /dev/full: No space left on device"
    # the line as the command's other errors are (``error`` in red, then the message)
    assert captured.err.strip().splitlines()[-1] == f"error {doc['error']['message']}"
    assert "Traceback" not in captured.err
    assert _run(tiny, "--runs", runs, "--trace", "/dev/full") == 1
    captured = capsys.readouterr()
    assert "completed" in captured.out  # the result first
    assert captured.err.strip().splitlines()[-1].startswith("error cannot write the trace")
    assert "Traceback" not in captured.err


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's link is made with lchown, as root")
def test_a_link_another_user_plants_during_the_run_is_not_written_through(
    tiny: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The name checked when the command line was read is another user's link to a file
    of this user's by the time the trace is written: refused, the file left as it was."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    trace = tmp_path / "trace.json"
    real = runtime_sim.cli.generate

    def planted(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        trace.symlink_to(victim)  # as another user would, in a shared folder
        os.lchown(trace, 65534, 65534)
        return result

    monkeypatch.setattr(runtime_sim.cli, "generate", planted)
    assert _run(tiny, "--trace", str(trace), "--json") == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["outcome"] == "completed" and doc["error"]["type"] == "TraceNotWritten"
    assert "a symbolic link of uid 65534" in doc["error"]["message"], doc
    assert victim.read_text() == "precious\n" and trace.is_symlink()


def test_several_runs_show_the_stages_load_bars(
    tiny: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--runs N`` shows each stage's load as one run does (it showed nothing until
    the runs ended): the bars' ``on_load`` reaches ``generate_runs``."""
    seen: list[int] = []
    real = runtime_sim.cli.generate_runs

    def runs(*args: Any, on_load: Any = None, **kwargs: Any) -> Any:
        assert on_load is not None

        def load(stage: int, done: int, total: int) -> None:
            seen.append(stage)
            on_load(stage, done, total)

        return real(*args, on_load=load, **kwargs)

    monkeypatch.setattr(runtime_sim.cli, "generate_runs", runs)
    argv = ["run", "--model", tiny, "--prompt-ids", "1,2", "--stages", "2", "--max-tokens", "2"]
    assert main([*argv, "--runs", "2"]) == 0
    assert sorted(set(seen)) == [0, 1]


def test_a_refusal_of_runs_flags_together_names_run_and_its_help(
    tiny: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--chat with --prompt-ids is checked after parsing; its error names `run` and
    points at `run --help` (which lists both flags), as a per-flag error does."""
    with pytest.raises(SystemExit) as exc:
        main(["run", "--model", tiny, "--chat", "--prompt-ids", "1,2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "python -m runtime_sim run: error: argument --chat" in err, err
    assert "(see python -m runtime_sim run --help)" in err, err
