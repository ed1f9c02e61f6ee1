"""``python -m runtime_cupy``: the flags and output of ``runtime_sim run``; one JSON object
on stdout with ``--json``; a faulted run exits non-zero with one line naming the stage,
node and reason."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest

import runtime_cupy
import runtime_cupy.cli.main
import runtime_sim
from runtime_cupy.api import generate
from runtime_cupy.cli.main import main
from runtime_cupy.serve.chain import WarmChain
from tests.runtime_cupy.test_kill_orchestrator import ROOT
from tests.runtime_cupy.test_process_faults import _children, cli_process
from tests.support.hosts import FaultyHost
from tests.support.hygiene import learn_chain_ids, wait_gone

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    return env


def test_json_is_the_only_thing_on_stdout(tiny: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "runtime_cupy", "--model", tiny, "--stages", "3",
         "--prompt-ids", "7,8,9", "--max-tokens", "5", "--worker", "numpy", "--json"],
        capture_output=True,
        text=True,
        check=False,
        env=_env(),
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # exactly one object: json.loads refuses anything more
    learn_chain_ids([doc["chain_id"]])
    assert doc["outcome"] == "completed" and doc["fault"] is None
    assert doc["tokens"] == list(
        runtime_sim.generate(tiny, [7, 8, 9], stages=3, max_tokens=5).tokens
    )
    assert [s["layer_start"] for s in doc["stages"]] == [0, 2, 3]
    assert all(s["exit_status"] == 0 and s["pid"] > 0 for s in doc["stages"])
    assert {"ttft_ms", "decode_tokens_per_s", "load_s", "wall_s"} <= set(doc["timings"])
    assert doc["slices"] == []  # every stage on this host: no slice travelled
    assert doc["text"] in proc.stderr  # the streamed text went to stderr


def test_text_streams_to_stdout_and_a_trace_is_written(
    tiny: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.json"
    code = main(
        ["--model", tiny, "--stages", "2", "--prompt-ids", "1,2,3,4,5",
         "--max-tokens", "4", "--trace", str(trace)]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "2 stage processes" in out and "4 tokens, completed" in out
    events = json.loads(trace.read_text())["traceEvents"]
    steps = [e for e in events if e.get("ph") == "X" and e["name"].startswith("step")]
    assert len({e["pid"] for e in steps}) == 2  # both stages' steps, on their own tracks
    assert {e["name"] for e in steps} >= {"step 0", "step 1", "step 2", "step 3"}
    # Prefill moves the prompt's rows, decode one row per hop.
    loaded = [e["args"] for e in events if e["name"] == "loaded"]
    assert {(a["sequence"], a["rows"]) for a in loaded if a["sequence"] == 0} == {(0, 5)}
    assert {a["rows"] for a in loaded if a["sequence"] > 0} == {1}
    assert len(loaded) == 2 * 4  # each stage loaded sequences 0..3
    names = {e["args"]["name"] for e in events if e.get("ph") == "M"}
    assert {"orchestrator", "stage-0", "stage-1"} <= names


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
def test_a_trace_that_cannot_be_written_costs_nothing_of_the_result(
    tiny: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A full disk (``/dev/full``: every write fails, no space left): the run's JSON is
    printed first, then one line naming the trace's path; exit status 1; the device the
    user named is left where it is."""
    argv = ["--model", tiny, "--prompt-ids", "1,2", "--max-tokens", "3", "--json"]
    assert main([*argv, "--trace", "/dev/full"]) == 1
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["outcome"] == "completed"
    assert doc["error"]["type"] == "TraceNotWritten"  # the exit status's reason, in the object
    assert doc["error"]["message"].startswith("cannot write the trace to /dev/full"), doc
    lines = captured.err.strip().splitlines()
    assert lines[-1].startswith("error: cannot write the trace to /dev/full"), lines
    assert "Traceback" not in captured.err
    assert Path("/dev/full").is_char_device()


def test_a_full_standard_output_during_a_run_is_one_error_line(tiny: str) -> None:
    """Tokens streamed to ``/dev/full``: exit 1 and the one line naming standard output,
    with no traceback before it (the failed write in ``on_token`` was logged as a bug,
    its traceback with it)."""
    if not os.path.exists("/dev/full"):
        pytest.skip("this host has no /dev/full")
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "runtime_cupy", "--model", tiny, "--stages", "1",
             "--prompt-ids", "7,8,9", "--max-tokens", "8", "--worker", "numpy"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
            env=_env(),
            timeout=120,
        )  # fmt: skip
    assert (proc.returncode, proc.stderr) == (
        1,
        "error: cannot write standard output: No space left on device\n",
    )


def test_a_killed_stage_exits_non_zero_with_one_line_naming_it(smollm2_path: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime_cupy", "--model", smollm2_path, "--stages", "3",
         "--prompt-ids", "504,3575,282,4649,314", "--max-tokens", "64"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
    )  # fmt: skip
    pids = _children(proc.pid, 3)
    assert proc.stdout is not None
    assert proc.stdout.read(1)  # the first token's text streamed: the run is decoding
    os.kill(pids[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    last = err.decode().strip().splitlines()[-1]
    assert last.startswith("error: run faulted: stage 1 (node stage-1): process_died: ")
    assert last.endswith("killed by SIGKILL")
    assert "faulted" in out.decode()  # the summary says so too
    assert wait_gone(list(pids.values()), 5) == []


def test_a_faulted_run_with_json_is_its_result_and_an_error(
    tiny: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Standard output is the run's result with ``error`` (``RunFaulted``) beside it, as
    every failing ``--json`` command's object has (docs/json-output.md)."""
    monkeypatch.setattr(
        runtime_cupy.cli.main, "generate", partial(generate, host=FaultyHost({1: ["step-fail=2"]}))
    )
    argv = ["--model", tiny, "--stages", "3", "--prompt-ids", "1,2", "--max-tokens", "8"]
    assert main([*argv, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["outcome"] == "faulted" and doc["fault"].startswith("stage 1 (node stage-1): ")
    assert doc["error"] == {"type": "RunFaulted", "message": f"run faulted: {doc['fault']}"}
    learn_chain_ids([doc["chain_id"]])


def test_a_model_without_a_chat_template_is_a_clear_error(
    tiny: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--model", tiny, "--prompt", "hi", "--chat", "--json"]) == 2
    assert "chat_template" in json.loads(capsys.readouterr().out)["error"]["message"]


def test_the_cuda_worker_on_a_host_without_it_is_a_clear_error(
    tiny: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        import cupy  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
    except Exception:
        pass
    else:
        pytest.skip("CuPy is installed here")
    assert main(["--model", tiny, "--prompt-ids", "1", "--worker", "cuda", "--json"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["type"] == "WorkerUnavailable" and "CuPy" in error["message"]
    # gguf-pipeline is not on PyPI: the way that works is an extra from a checkout
    assert "pip install -e '.[cuda12]'" in error["message"]
    assert "'.[cuda13]'" in error["message"]
    for flags in ((), ("--kv-dtype", "f16")):  # the flag's check leaves it to the run
        assert main(["--model", tiny, "--prompt-ids", "1", "--worker", "cuda", *flags]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "pip install -e '.[cuda12]'" in lines[0], lines


def test_with_recover_a_killed_stage_is_replaced_and_the_text_goes_on(smollm2_path: str) -> None:
    prompt = [504, 3575, 282, 4649, 314]
    unbroken = runtime_cupy.generate(smollm2_path, prompt, stages=3, max_tokens=48)
    proc = cli_process("--model", smollm2_path, "--stages", "3", "--prompt-ids",
                       ",".join(map(str, prompt)), "--max-tokens", "48", "--recover",
                       text=False)  # fmt: skip
    pids = _children(proc.pid, 3)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.read(1)  # the first token's text streamed: the run is decoding
    assert first
    os.kill(pids[1], signal.SIGKILL)
    out = first + proc.stdout.read()
    err = proc.stderr.read()
    assert proc.wait(120) == 0, err.decode()
    assert out.decode().startswith(unbroken.text), (out.decode(), unbroken.text)
    assert f"{len(unbroken.tokens)} tokens, completed" in out.decode()  # EOS, or 48
    assert "lost stages [1] on ['stage-1']" in err.decode() and "SIGKILL" in err.decode()
    assert wait_gone(list(pids.values()), 5) == []


def test_with_recover_the_json_counts_the_recoveries(smollm2_path: str) -> None:
    """``--recover --json``: the run's object says how many times it was recovered
    (``recoveries``), its tokens the unbroken run's."""
    prompt = [504, 3575, 282, 4649, 314]
    unbroken = runtime_cupy.generate(smollm2_path, prompt, stages=2, max_tokens=32)
    proc = cli_process("--model", smollm2_path, "--stages", "2", "--prompt-ids",
                       ",".join(map(str, prompt)), "--max-tokens", "32", "--recover", "--json",
                       text=False)  # fmt: skip
    pids = _children(proc.pid, 2)
    assert proc.stdout is not None and proc.stderr is not None
    text = b""
    while unbroken.text[:12].encode() not in text:  # the first tokens' text: decoding
        chunk = proc.stderr.read(1)
        assert chunk, "standard error ended before the text came"
        text += chunk
    os.kill(pids[0], signal.SIGKILL)
    out = proc.stdout.read()
    proc.stderr.read()
    assert proc.wait(120) == 0
    doc = json.loads(out)
    assert doc["recoveries"] == 1 and doc["tokens"] == list(unbroken.tokens), doc
    # the stages that ran it last, each as it ended (reaped at the chain's close): the
    # killed stage 0's replacement, not the killed process (once: every status null)
    assert [s["exit_status"] for s in doc["stages"]] == [0, 0], doc["stages"]
    assert doc["stages"][0]["pid"] != pids[0], (doc["stages"], pids)
    assert wait_gone(list(pids.values()), 5) == []


def test_with_recover_the_timings_count_the_chains_start(
    tiny: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--recover --json``: ``load_s`` and ``wall_s`` count the chain's start and bind,
    as a run without ``--recover`` counts its stages' (they once held only the run on
    the chain already warm: a load of a few ms). The chain's start, timed here around
    ``WarmChain.start``, is within both (no ratio of timings: a loaded host stretched
    the close that the test's own clock counts)."""
    started: list[float] = []
    start = WarmChain.start

    def timed_start(chain: WarmChain, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return start(chain, *args, **kwargs)
        finally:
            started.append(time.perf_counter() - began)

    monkeypatch.setattr(WarmChain, "start", timed_start)
    began = time.perf_counter()
    code = main(["--model", tiny, "--stages", "2", "--prompt-ids", "7,8,9", "--max-tokens",
                 "4", "--worker", "numpy", "--recover", "--json"])  # fmt: skip
    took = time.perf_counter() - began
    assert code == 0
    timings = json.loads(capsys.readouterr().out)["timings"]
    assert len(started) == 1, started
    rounding = 0.001  # the JSON's milliseconds
    assert started[0] - rounding <= timings["load_s"] <= timings["wall_s"] <= took, (
        timings, started, took)  # fmt: skip


def test_max_concurrent_takes_a_prompts_file(tiny: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--model", tiny, "--prompt-ids", "1,2", "--max-concurrent", "4"])
    assert code == 2
    assert "--max-concurrent is for a --prompts-file" in capsys.readouterr().err


def test_the_prompts_file_takes_the_gpus_named(
    tiny: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--gpus`` reaches the batch's chain (it was once dropped without a word): named
    for a worker that runs on the CPU, the chain refuses them, naming them."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2]}\n')
    code = main(
        ["--model", tiny, "--worker", "numpy", "--gpus", "0", "--prompts-file", str(prompts)]
    )
    assert code == 2
    assert "GPUs [0] were named" in capsys.readouterr().err


def test_a_single_run_on_a_cluster_refuses_gpus(
    tiny: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--ray-address A --gpus N`` ran on the cluster's GPUs, ``--gpus`` dropped
    without a word (serve, chat and ``--recover`` refuse it): refused, exit 2, before
    connecting (no cluster listens at the address, which would be another error)."""
    argv = ["--model", tiny, "--prompt-ids", "1,2", "--ray-address", "127.0.0.1:1", "--gpus", "7"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "give no host, gpus (--gpus) or log_dir (--log-dir)" in err, err
    assert "no Ray cluster" not in err, err
    with pytest.raises(ValueError, match="give no host, gpus"):
        generate(tiny, [1, 2], ray_address="127.0.0.1:1", gpus=[7])


@pytest.mark.parametrize("flags", [["--recover"], ["--trace", "t.json"]])
def test_recover_and_trace_take_one_prompt_not_a_file(
    tiny: str, tmp_path: Path, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    flags = [str(tmp_path / f) if f.endswith(".json") else f for f in flags]
    code = main(["--model", tiny, "--prompts-file", str(prompts), *flags])
    assert code == 2
    assert f"{flags[0]} " in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--trace", "/nonexistent-dir/t.json"], "'/nonexistent-dir/t.json'"),
        (["--trace", "/"], "'/': it is a directory"),
        (["--stages", "-1"], "'-1'"),
        (["--stages", "0"], "'0'"),
        (["--max-recoveries", "-1"], "--max-recoveries: '-1' is negative"),
        (["--max-recoveries", "two"], "--max-recoveries: 'two' is not an integer"),
        # taken and ignored before: a lost stage ended the run all the same
        (["--max-recoveries", "2"], "--max-recoveries: 2 recoveries need --recover"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it_before_any_process_starts(
    tiny: str, flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--model", tiny, "--prompt-ids", "1,2", "--max-tokens", "2", *flags])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing ran
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and flags[0] in lines[0] and needle in lines[0], lines


def test_a_run_that_never_started_prints_no_none_timings(tiny: str, tmp_path: Path) -> None:
    """A run whose links cannot be made (``TMPDIR`` a folder that does not exist) faults
    before its first token: its summary line shows ``-`` for the timings it never had
    (it printed ``None``), beside the one line naming the fault."""
    env = {**_env(), "TMPDIR": str(tmp_path / "absent")}
    proc = subprocess.run(
        [sys.executable, "-m", "runtime_cupy", "--model", tiny, "--prompt-ids", "1,2",
         "--max-tokens", "2", "--worker", "numpy"],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    summary = next(line for line in proc.stdout.splitlines() if "tokens, faulted" in line)
    assert "None" not in summary and "load - s" in summary, summary
