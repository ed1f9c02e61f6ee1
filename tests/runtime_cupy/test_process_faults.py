"""Faults that are not deaths: a step that fails, a wait that runs out, Ctrl-C, a stage
that cannot be started. Each ends with one outcome, every stage process reaped and
nothing left in /dev/shm."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from runplan.config import Timeouts
from runplan.resource_limits import with_limit
from runtime_cupy import generate
from runtime_cupy.cli.main import main as cli_main
from runtime_cupy.hosts.local import LocalProcessHost, LocalStageHandle
from runtime_cupy.hosts.port import StageLaunch
from tests.runtime_cupy.test_kill_orchestrator import ROOT, Driver
from tests.support.hosts import FaultyHost
from tests.support.hygiene import alive, held_links, learn_chain_ids, run_resources, wait_gone

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process


def test_a_failed_step_faults_the_run_naming_the_stage(tiny: str) -> None:
    timeouts = Timeouts(ready_ms=20_000, step_ms=20_000, edge_wait_ms=20_000, stop_ms=5_000)
    result = generate(
        tiny,
        [1, 2],
        stages=3,
        max_tokens=8,
        timeouts=timeouts,
        host=FaultyHost({1: ["step-fail=2"]}),
    )
    assert result.outcome == "faulted"
    assert result.fault_stage == 1 and result.fault_node == "stage-1"
    assert result.fault is not None and result.fault.startswith("stage 1 (node stage-1): ")
    assert "step_failure" in result.fault and "injected failure at sequence 2" in result.fault
    assert len(result.tokens) == 2  # sequences 0 and 1
    assert all(s.returncode == 0 for s in result.stages)  # the faulted stage stopped too
    assert not [s.pid for s in result.stages if alive(s.pid)]
    assert run_resources(result.chain_id) == []


def test_a_token_that_does_not_come_in_time_faults_the_run(tiny: str) -> None:
    # Stage 1 sleeps in step 1; the orchestrator waits step_ms per stage for a token,
    # then tears down; stage 1 cannot answer StopRun while it sleeps, so after the stop
    # bound it is killed.
    timeouts = Timeouts(ready_ms=20_000, step_ms=300, edge_wait_ms=20_000, stop_ms=1_000)
    prompt, stages = [1, 2], 3
    # What the run takes at most when it does what it should, from the timeouts alone:
    # every stage ready within ready_ms; token 0 (the prompt's rows through the stages)
    # and token 1 (which never comes) each waited for within token_limit_ms; then the
    # stop bound (stop_limit_ms) before the kill. The stage sleeps twice that, so a run
    # that waited for it would take longer than the bound.
    bound_ms = (
        timeouts.ready_ms
        + timeouts.token_limit_ms(stages, 1, len(prompt), 0, 1)
        + timeouts.token_limit_ms(stages, 1, 1, 0, 1)
        + timeouts.stop_limit_ms(len(prompt), 0)
    )
    sleep_s = 2 * bound_ms // 1000
    result = generate(
        tiny,
        prompt,
        stages=stages,
        max_tokens=8,
        timeouts=timeouts,
        host=FaultyHost({1: [f"step-delay=1:{sleep_s}"]}),
    )
    assert result.outcome == "faulted" and result.fault_stage is None
    assert result.fault == "orchestrator (node orchestrator): timeout: token 1 not produced in time"
    assert len(result.tokens) == 1
    codes = {s.stage_index: s.returncode for s in result.stages}
    assert codes == {0: 0, 1: -signal.SIGKILL, 2: 0}
    assert result.wall_s < bound_ms / 1000 < sleep_s
    assert run_resources(result.chain_id) == []


@pytest.mark.parametrize("edges", ["shm", "tcp"])
def test_ctrl_c_cancels_the_run_and_cleans_up(tiny: str, tmp_path: Path, edges: str) -> None:
    # Stage 1 sleeps 60 s in step 2: it cannot answer StopRun, so once the stop bound
    # (stop_ms and two steps' limits, Timeouts.stop_limit_ms: 8.6 s) ran out it is
    # killed.
    log = tmp_path / "driver.log"
    driver = Driver(tiny, {1: ["step-delay=2:60"]}, log, edges, step_ms=3_000)
    driver.until("token", 2)
    driver.until_logged("step 2 delayed")
    driver.proc.send_signal(signal.SIGINT)
    assert driver.proc.wait(30) == 130
    assert driver.proc.stdout is not None
    driver.until("outcome")
    assert wait_gone(driver.pids, 5) == []
    assert run_resources(driver.chain_id) == []
    driver.kill()


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_in_the_cli_is_a_cancelled_run(smollm2_path: str, signum: int, status: int) -> None:
    # SmolLM2's stages take seconds to load their weights: the signal comes while the
    # orchestrator waits at the readiness barrier. The exit status is 128 + the signal's
    # number, as a shell reports a process the signal ended (SIGTERM once exited 130).
    proc = cli_process("--model", smollm2_path, "--stages", "2", "--prompt-ids", "1,2",
                       "--max-tokens", "4", "--json")  # fmt: skip
    pids = _children(proc.pid, 2)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == status, err
    doc = json.loads(out)  # still exactly one JSON object on stdout
    learn_chain_ids([doc["chain_id"]])
    name = signal.Signals(signum).name
    assert doc["outcome"] == "cancelled" and doc["tokens"] == []
    assert doc["interrupted_by"] == name and doc["recoveries"] == 0  # as a run's object
    assert doc["error"] == {"type": "Cancelled", "message": f"cancelled by {name}"}
    assert err.strip().splitlines()[-1] == "cancelled"
    assert f"{name}: stopping the run (interrupt again to stop waiting)" in err, err
    assert wait_gone(list(pids.values()), 5) == []


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_in_a_recovering_run_is_one_json_object(
    smollm2_path: str, signum: int, status: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--recover --json``: Ctrl-C or SIGTERM while the warm chain binds prints the
    run's JSON (outcome ``cancelled``, the tokens so far, the signal) and exits 128 +
    the signal's number; it printed nothing else on standard output, and the chain is
    torn down: no stage process, no shared memory or FIFO of its links left, nothing in
    its temp folder. That folder is the test's own: in the host's, the registry of live
    chains (which a stage holds open as it lists its link) is shared by every chain of
    this user there, and stays while another one runs."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # the CLI's too (``cli_process``)
    proc = cli_process("--model", smollm2_path, "--stages", "2", "--prompt-ids", "1,2",
                       "--max-tokens", "4", "--recover", "--json")  # fmt: skip
    pids = list(_children(proc.pid, 2).values())
    deadline = time.monotonic() + 30
    while not (held := held_links(pids)) and time.monotonic() < deadline:
        time.sleep(0.01)  # the stages made their links: the chain is up, binding
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == status, err
    doc = json.loads(out)  # exactly one JSON object
    name = signal.Signals(signum).name
    assert doc["outcome"] == "cancelled" and doc["fault"] is None
    assert doc["interrupted_by"] == name and doc["recoveries"] == 0  # as a run's object
    assert doc["error"] == {"type": "Cancelled", "message": f"cancelled by {name}"}
    assert err.strip().splitlines()[-1] == "cancelled"
    assert wait_gone(pids, 10) == []
    assert held and not [p for p in held if os.path.lexists(p)]
    assert list(temp.iterdir()) == []


def cli_process(*args: str, text: bool = True) -> subprocess.Popen[Any]:
    """``python -m runtime_cupy ARGS`` of this checkout, its stdout and stderr piped."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    return subprocess.Popen(
        [sys.executable, "-m", "runtime_cupy", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=text,
    )


def _children(pid: int, count: int) -> dict[int, int]:
    """Stage index -> pid of the ``count`` stage processes of ``pid``, once they run."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                args = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid and b"runtime_cupy.process.stage_process" in args:
                found[int(args[args.index(b"--stage-index") + 1])] = int(entry.name)
        if len(found) == count:
            return found
        time.sleep(0.01)
    raise AssertionError(f"{count} stage processes of {pid} did not start")


_START = LocalProcessHost.start


def _start_one(host: LocalProcessHost, launch: StageLaunch, secret: bytes) -> LocalStageHandle:
    """Starts stage 0, then has no descriptor left for stage 1's pipes (``EMFILE``, as
    ``subprocess.Popen`` raises it under a low ``ulimit -n``)."""
    if launch.stage_index >= 1:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
    return _START(host, launch, secret)


class _NoDescriptors(LocalProcessHost):
    start = _start_one


def test_a_stage_that_cannot_be_started_faults_the_run_and_stops_the_others(
    tiny: str,
) -> None:
    result = generate(tiny, [1, 2], stages=3, max_tokens=4, host=_NoDescriptors())
    assert result.outcome == "faulted", result
    assert result.fault == "orchestrator (node orchestrator): setup_failure: " + with_limit(
        "the stages could not be started: [Errno 24] Too many open files", errno.EMFILE
    )
    assert result.tokens == ()
    started = [s.pid for s in result.stages if s.pid is not None]
    assert len(started) == 1 and not [pid for pid in started if alive(pid)]
    assert run_resources(result.chain_id) == []


@pytest.mark.parametrize("flag", ["--recover", "--prompts-file"])
def test_stages_that_cannot_be_started_are_one_error_from_the_cli(
    tiny: str,
    tmp_path: Path,
    flag: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(LocalProcessHost, "start", _start_one)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2]}\n')
    given = ["--prompts-file", str(prompts)] if flag == "--prompts-file" else [flag]
    prompt = [] if flag == "--prompts-file" else ["--prompt-ids", "1,2"]
    argv = ["--model", tiny, "--stages", "2", "--max-tokens", "2", *prompt, *given, "--json"]
    assert cli_main(argv) == 1
    error = json.loads(capsys.readouterr().out)["error"]
    assert error == {
        "type": "ChainError",
        "message": with_limit(
            "the stages could not be started: [Errno 24] Too many open files", errno.EMFILE
        ),
    }


def test_a_run_whose_kv_cache_a_stage_refuses_twice_alone_never_fits(tiny: str) -> None:
    """One run (``ProcessRun``, as ``python -m runtime_cupy run`` runs it): nothing else
    holds memory, so a stage that refuses its KV cache (``ProvisionRefused``; here the
    faulty worker finds no room for the 1st and 2nd runs it opens) ends it as the chain
    runner ends such a run, offered again once alone: faulted, naming what it needs
    against the stage's whole budget, and that it never fits."""
    result = generate(
        tiny, [1, 2], stages=2, max_tokens=4, host=FaultyHost({1: ["kv-full=1", "kv-full=2"]})
    )
    assert result.outcome == "faulted", result
    assert result.fault_stage == 1 and result.tokens == ()
    needed, budget = result.plan.stages[1].kv_bytes, result.plan.stages[1].kv_budget_bytes
    fault = result.fault or ""
    assert fault.startswith("stage 1 (node stage-1): kv_cache_unavailable: "), fault
    assert f"the run's KV cache needs {needed} bytes" in fault
    assert f"of the stage's whole budget of {budget} free" in fault
    assert fault.endswith("no other run on the chain holds any of it to free: it never fits")
    assert not [s.pid for s in result.stages if alive(s.pid)]
    assert run_resources(result.chain_id) == []


def test_a_run_refused_once_alone_is_offered_again_and_completes(tiny: str) -> None:
    """A stage may still hold what a run stopping on it held when the planner counts it
    free: one run refused once is offered again alone (as on a chain of many runs), and
    completes with the tokens it gets unrefused."""
    alone = generate(tiny, [1, 2], stages=2, max_tokens=4)
    result = generate(tiny, [1, 2], stages=2, max_tokens=4, host=FaultyHost({1: ["kv-full=1"]}))
    assert result.outcome == "completed", result.fault
    assert result.tokens == alone.tokens
    assert run_resources(result.chain_id) == []
