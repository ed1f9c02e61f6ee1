"""One stage process: ``python -m runtime_cupy.process.stage_process ...``, started by the
local-process host (``hosts.local``) or a cluster host's supervisor. Its loop is
``stage_loop.StageProcess``; this module is its entry.

``main`` is the local host's side of a stage process: the chain's secret arrives as one
hex line on standard input (the chain's id is derived from it, ``keys.chain_id``); the
control channel is an inherited socket (``--control-fd``); a second inherited
descriptor, the read end of a pipe whose write end only the orchestrator holds
(``--lifeline-fd``), reaches end of file the moment the orchestrator's process is
gone, however it went. Either one closing is ``OrchestratorLost`` for every run held:
the stage stops them and ends, sending nothing more (an orchestrator still there, as
when a Ray stage's supervisor died, sees a lost stage and may recover from it); it logs
the loss once, naming what closed (which lifeline: the pid holding its write end), since
when, and when the orchestrator was last heard from. A
watchdog thread waits on the lifeline; if the loop has not finished ``--stop-ms`` after
the loss (a batch that runs on), it removes the chain's resources this stage owns and
exits.

Exit status: 0 after the channel closed while no run was held, 3 after the
orchestrator was lost while runs were held, 2 on bad usage, 4 when it could not start
its lifeline watchdog or heartbeat thread (threads, processes or address space ran out
on its host: its log's last line says which thread and the values of ``ulimit -u`` and
``ulimit -v`` where set; it was a ``RuntimeError`` traceback and status 1).
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from runplan import GgufSource, ProvisionStage, WorkerCapabilities
from runtime_core.threads import ThreadUnavailable
from runtime_core.workers.interface import BatchStep, Progress, TraceEvent, Worker, WorkerError
from runtime_cupy.edges.links import ProcessLinks
from runtime_cupy.edges.port import MEDIA
from runtime_cupy.hosts.local import local_medium
from runtime_cupy.process.control_channel import (
    ControlChannel,
)
from runtime_cupy.process.keys import BadSecret, chain_id, control_key, parse_secret, slice_key
from runtime_cupy.process.stage_loop import MakeMedium, NextSecret, StageProcess
from runtime_cupy.process.stage_loss import EXIT_NO_THREAD
from runtime_cupy.process.tracing import TraceLog
from runtime_cupy.slices.fetch import SliceFetcher, SliceOrigin
from runtime_cupy.slices.worker import sliced
from runtime_cupy.workers import WORKERS, WorkerUnavailable, make_worker

EXIT_USAGE = 2

log = logging.getLogger("runtime_cupy.process.stage_process")

#: ``make_worker(name, trace)``: the worker a stage process runs (by default from the
#: registry), its own events going to ``trace`` (the stage's trace, when it keeps one).
MakeWorker = Callable[[str, TraceEvent | None], Worker]
#: How long a stage told to join a new chain waits for its secret from its host.
SECRET_WAIT_S = 10.0


class NoSecret(OSError):
    """The host handed the stage no secret (in time, or at all)."""


def secret_lines(fd: int, timeout_s: float = SECRET_WAIT_S) -> NextSecret:
    """The secrets a local host writes on descriptor ``fd`` (the stage's standard
    input), one hex line each, the first at the start; each read waits at most
    ``timeout_s``."""
    pending = bytearray()

    def next_secret() -> bytes:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise NoSecret(f"no secret from the host within {timeout_s:.0f} s")
            chunk = os.read(fd, 4096)
            if not chunk:  # closed: what came is the last line (BadSecret says what)
                line, pending[:] = bytes(pending), b""
                return parse_secret(line.decode("ascii", "replace"))
            pending.extend(chunk)
        line, _, rest = bytes(pending).partition(b"\n")
        pending[:] = rest
        return parse_secret(line.decode("ascii", "replace"))

    return next_secret


class UnavailableWorker:
    """Stands in for a worker this process cannot load: configuring it fails, so each
    run's setup faults naming the reason instead of the stage dying."""

    capabilities: ClassVar[WorkerCapabilities] = WorkerCapabilities()
    kv_reserved_bytes = 0

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def configure(self, provision: ProvisionStage) -> None:
        raise WorkerError(self.reason)

    def bind(self, gguf_source: GgufSource, progress: Progress | None = None) -> None:
        raise WorkerError(self.reason)

    def execute_step(self, sequence: int, data: Any) -> Any:
        raise WorkerError(self.reason)

    def open_run(self, provision: ProvisionStage) -> None:
        raise WorkerError(self.reason)

    def execute_batch(self, steps: Sequence[BatchStep]) -> tuple[Any, ...]:
        raise WorkerError(self.reason)

    def close_run(self, run_id: str) -> None:
        pass

    def release(self) -> None:
        pass


# -- entry point ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m runtime_cupy.process.stage_process",
        description="One pipeline stage process (started by the runtime_cupy launcher's "
        "local-process host; the stages' secret is read from standard input).",
    )
    p.add_argument(
        "--run-label",
        required=True,
        help="the run's label, or a warm stage's chain's (for logs and ps; never the run "
        "id, which names the run's resources)",
    )
    p.add_argument("--stage-index", type=int, required=True)
    p.add_argument(
        "--stage-count",
        type=int,
        default=None,
        help=(
            "the chain's stages (a stage whose orchestrator is lost frees every hop of "
            "the chain on its host)"
        ),
    )
    p.add_argument("--node-id", required=True)
    p.add_argument("--orchestrator-id", required=True)
    p.add_argument("--control-fd", type=int, required=True, help="inherited control socket")
    p.add_argument("--lifeline-fd", type=int, required=True, help="inherited lifeline pipe")
    p.add_argument("--worker", choices=WORKERS, default="numpy")
    p.add_argument("--inbound", choices=MEDIA, default="shm", help="how the inbound edge moves")
    p.add_argument("--outbound", choices=MEDIA, default="shm", help="how the outbound edge moves")
    p.add_argument("--stop-ms", type=int, default=10_000)
    p.add_argument(
        "--encrypt-edges",
        action="store_true",
        help="encrypt the frames of TCP edges (AES-256-GCM), not only authenticate them, "
        "and ask for the slice (--slice-server) encrypted",
    )
    p.add_argument(
        "--heartbeat-ms",
        type=int,
        default=5_000,
        help="the orchestrator's bound on this stage's silence: beat four times as often",
    )
    p.add_argument(
        "--warm",
        action="store_true",
        help="accepted for older launchers: every stage serves runs (several at once, one "
        "after another, keeping its bound weights) until its control channel closes",
    )
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--trace-file", type=Path, default=None)
    p.add_argument(
        "--slice-server",
        default=None,
        help="HOST:PORT of the orchestrator's slice server: where this stage gets its slice "
        "of the model when its host lacks it (runtime_cupy.slices)",
    )
    p.add_argument("--slice-source-key", default=None, help="the plan's source's content key")
    return p


def main(
    argv: Sequence[str] | None = None,
    make: MakeWorker = make_worker,
    media: MakeMedium = local_medium,
) -> int:
    """A stage process of the local host; ``make(name, trace)`` makes its worker (a stage
    entry of another kind may wrap the registry's), ``media(name, encrypt)`` its edges' media
    (another host's stage entry gives its own: ``hosts.ray.stage_entry``)."""
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s stage {args.stage_index} ({args.node_id}, pid {os.getpid()}) "
        "%(levelname)s %(message)s",
    )
    secrets = secret_lines(sys.stdin.fileno())  # the first now, a new chain's later
    try:
        secret = secrets()
    except (BadSecret, NoSecret) as exc:
        log.error("%s", exc)
        return EXIT_USAGE
    sock = socket.socket(fileno=args.control_fd)
    key = control_key(secret, args.node_id)
    channel = ControlChannel(sock, key, args.node_id, args.orchestrator_id)
    trace = TraceLog(args.node_id, enabled=args.trace_file is not None)
    worker: Worker
    try:
        worker = make(args.worker, trace.instant if trace.enabled else None)
    except WorkerUnavailable as exc:
        log.error("%s", exc)
        worker = UnavailableWorker(str(exc))
    if args.slice_server is not None:
        origin = SliceOrigin(args.slice_server, args.slice_source_key or "")
        key = slice_key(secret, args.node_id)
        fetcher = SliceFetcher(origin, args.stage_index, key, encrypt=args.encrypt_edges)
        worker = sliced(worker, fetcher)
    stage = StageProcess(
        stage_index=args.stage_index,
        stage_count=args.stage_count,
        node_id=args.node_id,
        orchestrator_id=args.orchestrator_id,
        channel=channel,
        links=ProcessLinks(
            media(args.inbound, args.encrypt_edges),
            media(args.outbound, args.encrypt_edges),
            secret,
            chain_id(secret),
        ),
        lifeline_fd=args.lifeline_fd,
        worker=worker,
        stop_s=args.stop_ms / 1000.0,
        trace=trace,
        trace_file=args.trace_file,
        heartbeat_s=args.heartbeat_ms / 1000.0 if args.heartbeat_ms > 0 else None,
        secrets=secrets,
        media=media,
        encrypt_edges=args.encrypt_edges,
    )
    # SIGTERM, and SIGHUP (the terminal of the session it was started from went away,
    # with its orchestrator), stop the stage as a lost orchestrator does: its resources
    # freed, not left behind by the signal's default.
    for lost in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(lost, lambda number, _: stage.notice_loss(signal.Signals(number).name))
    log.info("started (run %s)", args.run_label)
    try:
        code = stage.run()
    except ThreadUnavailable as exc:  # processes or threads ran out on this host
        log.error("%s", exc)
        code = EXIT_NO_THREAD
    finally:
        stage.save_trace()  # or, its orchestrator gone, the file and its folder removed
    log.info("exiting with status %d", code)
    return code


def exit_now(status: int) -> None:
    """Leave at once: the run's resources are freed, and tearing the interpreter down
    (NumPy, mapped weights) would only delay the end of file the orchestrator waits on."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_now(main())
