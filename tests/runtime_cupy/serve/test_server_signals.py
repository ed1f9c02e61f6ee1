"""``python -m runtime_cupy serve`` and the signals a user sends it: Ctrl-C (SIGINT) stops
it, its stages with it; started with SIGINT ignored (a script's background job: a
non-interactive shell starts those so, that a Ctrl-C meant for the script leaves them
running), it keeps serving through a SIGINT and stops on SIGTERM."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import openai
import pytest

from tests.support.hygiene import wait_gone
from tests.support.servers import ServerProcess

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process


def _started(tiny_chat: str, tmp_path: Path, sigint_ignored: bool) -> ServerProcess:
    args = ["--model", tiny_chat, "--stages", "2", "--port", "0", "--context", "128"]
    server = ServerProcess(args, tmp_path / "server.log", sigint_ignored=sigint_ignored)
    server.wait_listening()
    server.wait_ready()
    return server


def _answers(server: ServerProcess) -> bool:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    # (the random model's greedy answer to "Hello" is <|endoftext|>, an end of generation)
    done = client.completions.create(model=model, prompt="Say hi", max_tokens=3, temperature=0)
    return done.usage is not None and done.usage.completion_tokens == 3


def test_ctrl_c_stops_the_server_and_its_stages(tiny_chat: str, tmp_path: Path) -> None:
    server = _started(tiny_chat, tmp_path, sigint_ignored=False)
    try:
        pids = list(server.stage_pids().values())
        assert len(pids) == 2, server.log()
        server.proc.send_signal(signal.SIGINT)
        # a supervisor's SIGTERM right after: the status is still the first signal's
        # (uvicorn raises the signals it caught again, the last first: it was 143)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 130, server.log()  # 128 + SIGINT, as a run
        assert not wait_gone(pids, 10.0), "stage processes outlived the server"
        assert "SIGINT: stopping" in server.log()
    finally:
        server.stop()


def test_started_with_sigint_ignored_it_serves_through_one(tiny_chat: str, tmp_path: Path) -> None:
    server = _started(tiny_chat, tmp_path, sigint_ignored=True)
    try:
        pids = list(server.stage_pids().values())
        server.proc.send_signal(signal.SIGINT)
        time.sleep(1.0)  # time for a handled SIGINT to have stopped it
        assert server.proc.poll() is None, server.log()
        assert server.health() == 200
        assert _answers(server)
        assert list(server.stage_pids().values()) == pids  # the same stages, none restarted
        assert "SIGINT" not in server.log()
    finally:
        assert server.stop() == 143, server.log()  # 128 + SIGTERM
    assert not wait_gone(pids, 10.0), "stage processes outlived the server"


def test_sigterm_while_the_stages_start_is_143_and_no_ready_after_stopping(
    smollm2_path: str, tmp_path: Path
) -> None:
    """SIGTERM once the server listens, its stages still starting: exit 143, as once it
    serves (it was 0 there, 143 before it listened), and no ``ready`` logged after
    ``stopping`` (the stages' start, done meanwhile, said so)."""
    args = ["--model", smollm2_path, "--stages", "3", "--port", "0"]
    server = ServerProcess(args, tmp_path / "server.log")
    try:
        server.wait_listening()
        server.health()  # answered: uvicorn runs, its handlers set (503: still starting)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 143, server.log()
        log = server.log()
        assert "SIGTERM: stopping" in log, log
        assert "ready:" not in log.split("SIGTERM: stopping", 1)[1], log
    finally:
        server.stop()
