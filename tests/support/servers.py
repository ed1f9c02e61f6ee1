"""Servers for the tests, on loopback:

- ``ServerProcess``: ``python -m runtime_cupy serve ...`` as a user starts it, its
  standard error in a file (where it says where it listens and logs every request).
- ``InProcessServer``: the same application on uvicorn (``StoppingServer``, as the
  command runs it) in a thread of the test, over a
  ``WarmChain`` whose host the test chooses (a host that plays faults: a slow step);
  ``serving(engine)`` starts its stages, serves, and stops both after.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx2
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from runtime_cupy.cli.serve import _listen
from runtime_cupy.serve.app import build_app
from runtime_cupy.serve.engine import Engine
from runtime_cupy.serve.shutdown import StoppingServer

LISTENING = re.compile(r"listening on http://([\d.]+):(\d+)")
STAGE_STARTED = re.compile(r"stage (\d+) \(\S+\) started: pid (\d+)")
RUN_STARTED = re.compile(r"request #\d+ \(\S+\) runs as (\S+)")


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def metrics(base_url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """Every sample of ``GET /metrics``: ``name{label=value,...}`` -> value."""
    text = httpx2.get(f"{base_url}/metrics", headers=headers or {}).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def idle(base_url: str, headers: dict[str, str] | None = None) -> bool:
    m = metrics(base_url, headers)
    return (
        m["gguf_pipeline_requests_running"] == 0
        and m["gguf_pipeline_runs_waiting_for_memory"] == 0
        and m["gguf_pipeline_queue_length"] == 0
    )


_WITH_NOFILE = (
    "import os, resource, sys; n = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); os.execv(sys.argv[2], sys.argv[2:])"
)
# as a non-interactive shell starts a background job (an ignored disposition survives exec)
_SIGINT_IGNORED = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


class ServerProcess:
    """``python -m runtime_cupy serve ARGS``."""

    def __init__(
        self,
        args: Sequence[str],
        log: Path,
        env: dict[str, str] | None = None,
        *,
        nofile: int | None = None,
        sigint_ignored: bool = False,
    ):
        # ``nofile``: the server's descriptor limit (RLIMIT_NOFILE, soft and hard), set
        # by a first interpreter that then becomes the server (exec); ``sigint_ignored``:
        # the server started with SIGINT ignored, the same way.
        self.log_path = log
        self._log = log.open("wb")
        command = [sys.executable, "-m", "runtime_cupy", "serve", *args]
        if nofile is not None:
            command = [sys.executable, "-c", _WITH_NOFILE, str(nofile), *command]
        if sigint_ignored:
            command = [sys.executable, "-c", _SIGINT_IGNORED, *command]
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env if env is not None else dict(os.environ),
        )
        self.base_url = ""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_listening(self, timeout_s: float = 60.0) -> str:
        def found() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited {self.proc.returncode}:\n{self.log()}")
            return LISTENING.search(self.log()) is not None

        wait_for(found, timeout_s, "the server to listen")
        match = LISTENING.search(self.log())
        assert match is not None
        self.base_url = f"http://{match.group(1)}:{match.group(2)}"
        return self.base_url

    @property
    def address(self) -> tuple[str, int]:
        host, _, port = self.base_url.removeprefix("http://").rpartition(":")
        return host, int(port)

    def health(self) -> int:
        return httpx2.get(f"{self.base_url}/health").status_code

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        wait_for(lambda: self.health() == 200, timeout_s, "GET /health to say 200")

    def stage_pids(self) -> dict[int, int]:
        """Each stage's latest process id, from the log."""
        return {int(i): int(pid) for i, pid in STAGE_STARTED.findall(self.log())}

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def run_labels(self) -> list[str]:
        """The labels of the runs of the requests it logged (with ``-v``): a server
        shows a run's label (``names.run_label``), never its id."""
        return RUN_STARTED.findall(self.log())


class InProcessServer:
    """The application on uvicorn in a thread, on a free port of 127.0.0.1."""

    def __init__(self, engine: Engine, *, api_key: str | None = None, graceful_s: int = 2) -> None:
        self.engine = engine
        self.sock = _listen("127.0.0.1", 0)
        port = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(
            build_app(engine, api_key=api_key),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=graceful_s,
        )
        self.server = StoppingServer(config, engine)  # as cli.serve runs it
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        wait_for(lambda: self.server.started, 30.0, "uvicorn to start")

    def client(self) -> openai.OpenAI:
        """The official client on this server's ``/v1``, without retries (a test sees
        every answer the server gives)."""
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="none", max_retries=0)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30.0)
        with contextlib.suppress(OSError):
            self.sock.close()
        self.engine.close()


@contextlib.contextmanager
def serving(engine: Engine, timeout_s: float = 120.0) -> Iterator[InProcessServer]:
    """``engine`` served in this process once its stages are started and bound (within
    ``timeout_s``: else the test fails with the engine's failure); stopped after, the
    stages with it, whatever happened."""
    server = InProcessServer(engine)
    try:
        engine.start()
        assert engine.wait_started(timeout_s), engine.failure
        yield server
    finally:
        server.stop()
