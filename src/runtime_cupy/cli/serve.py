"""``python -m runtime_cupy serve``: an OpenAI-compatible HTTP API over warm stages.

    python -m runtime_cupy serve --model M --stages N [--worker W] [--host 127.0.0.1]
        [--port 8000] [--api-key-file PATH | GGUF_PIPELINE_API_KEY=KEY] [--max-queue Q]
        [--context C] [--edges E] [--encrypt-edges] [--max-connections N]
        [--client-timeout S]
        [--ray-address auto|HOST:PORT] [--placement even|memory] [-v]

Every option is checked before anything starts: a bad one is one line naming it and
its value, exit status 2 (a port outside 0..65535, a log folder that is not a
writable folder, GPUs for a worker that runs on the CPU, ...). The stage processes
then start and bind once; the server listens at once (``GET /health`` says 503 until
every stage is ready) and serves the requests on them as they arrived, each of a
request's ``n`` choices a run of its own: up to ``--max-concurrent`` runs at once (each
joins the stages' batches at their next step and leaves them when it ends), at most
``--max-queue`` more wait their turn, and a request that would make more wait gets 429
(unless none runs or waits).

The key comes from ``GGUF_PIPELINE_API_KEY`` or the first line of ``--api-key-file``;
without either, no key is asked for. A key on the command line is visible to every
user of the machine (``ps``): ``--api-key`` is refused, saying so. An empty key is
refused (it would silently turn the check off), and so is one with a character a
Bearer token cannot carry.

Connections are bounded (``serve.connections``): at most ``--max-connections``, and
fewer when the descriptor limit (``RLIMIT_NOFILE``, raised to its hard limit first)
leaves less room beside the descriptors kept for the stages; a client has
``--client-timeout`` seconds to send its request. It binds to 127.0.0.1 unless told
otherwise. Standard error says where it listens (``listening on http://HOST:PORT``)
and logs each request (``-v``: everything the runtime does). Ctrl-C or SIGTERM stops
it: each request waiting or running is answered at once (503 "the server is shutting
down", or an error event on its stream), its run cancelled, and every stage process
exits (the stop leaves after ``CLOSE_BOUND_S`` if stages still starting hold it: they
stop on their own once this process is gone). With ``--ray-address`` the
stages live on the hosts of that Ray cluster (this process its driver), placed as
``python -m runtime_cupy --ray-address`` places them.

Exit status: 130 after Ctrl-C and 143 after SIGTERM (128 + the signal's number, as a
run and a chat end; whenever it comes: the modules loading, the stages starting, or
serving), 1 if the stages could not be started, 2 for bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import resource
import signal
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from runplan.arguments import OneLineParser, non_negative_int, positive_int
from runplan.json_errors import cancelled_status
from runtime_core.bounded_lines import LinesRefused, read_lines
from runtime_cupy.cli.arguments import (
    EXIT_INPUT,
    INPUT_ERRORS,
    RESOURCE_ERRORS,
    add_chain_arguments,
    chain_from,
    check_chain_arguments,
    configure_logs,
    port_number,
    positive_seconds,
)
from runtime_cupy.serve.chain import ChainError

API_KEY_VARIABLE = "GGUF_PIPELINE_API_KEY"
#: The most bytes of ``--api-key-file``'s first line read for the key (``/dev/zero``, or
#: a large file with no line feed, was read whole into memory).
KEY_LINE_LIMIT = 4096
#: How long a stop waits for the stages to stop before it leaves (each stage process
#: also stops on its own once this process is gone: its lifeline).
CLOSE_BOUND_S = 30.0

EXIT_FAILED = 1
#: Descriptors kept for the stages whatever the connections take: the server's own
#: (listening socket, event loop) and the chain's (per stage its control channel and
#: lifeline; while one starts again its pipes, socket pair and log; a run's wake-up
#: pipe and token edges), with room to spare.
RESERVED_FDS = 32
RESERVED_FDS_PER_STAGE = 12
#: Fewer connections than this and the server could not answer /health beside a request.
MIN_CONNECTIONS = 4
BACKLOG = 128
log = logging.getLogger("runtime_cupy.serve")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m runtime_cupy serve",
        description="Serve a GGUF model over an OpenAI-compatible HTTP API "
        "(POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, "
        "GET /metrics) from warm stage processes started and bound once: up to "
        "--max-concurrent runs at once (a request's n choices are n runs), batched by "
        "the stages, the others wait in arrival order.",
    )
    add_chain_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument(
        "--logprobs",
        action="store_true",
        help="serve log probabilities (chat's logprobs and top_logprobs, completions' "
        "logprobs): every token then carries the model's logits over the last link "
        "(4 bytes per vocabulary entry)",
    )
    p.add_argument("--port", type=port_number, default=8000, help="port (8000; 0: any free one)")
    p.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help="a file whose first line is the Bearer token every request but GET /health "
        f"must carry (or {API_KEY_VARIABLE}; default: no key)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"refused: a key on the command line is visible to every user (ps); use "
        f"{API_KEY_VARIABLE} or --api-key-file",
    )
    p.add_argument(
        "--max-queue",
        type=non_negative_int,
        default=16,
        help="runs that may wait while --max-concurrent run (a request's n choices are n "
        "runs); a request that would make more wait gets 429, unless none runs or waits "
        "(16)",
    )
    p.add_argument(
        "--max-connections",
        type=positive_int,
        default=256,
        help="open connections at most (256; fewer if the descriptor limit leaves less room)",
    )
    p.add_argument(
        "--client-timeout",
        type=positive_seconds,
        default=10.0,
        help="seconds a client may take to send a request's head, or its body, or to take "
        "some of its answer once the connection's buffers are full (10)",
    )
    return p


class KeyRefused(ValueError):
    """An API key the server will not serve with (the message never holds the key)."""


def api_key_from(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """The key every request but ``GET /health`` must carry: from
    ``GGUF_PIPELINE_API_KEY`` or the first line of ``--api-key-file`` (``None``: neither
    gives one; only that line is read, up to ``KEY_LINE_LIMIT`` bytes); ``KeyRefused``
    for a key on the command line, two sources, a file that cannot be read or whose first
    line is longer, an empty key, or one with a character a Bearer token cannot carry."""
    if args.api_key is not None:
        raise KeyRefused(
            "--api-key is refused: a key on the command line is visible to every user of "
            f"this machine (ps); put it in {API_KEY_VARIABLE} or in a file given to "
            "--api-key-file"
        )
    variable = environ.get(API_KEY_VARIABLE)
    path: Path | None = args.api_key_file
    if path is not None and variable is not None:
        raise KeyRefused(f"both {API_KEY_VARIABLE} and --api-key-file give a key: give one")
    if path is not None:
        where = f"--api-key-file {str(path)!r}"
        try:
            lines = read_lines(path, line_limit=KEY_LINE_LIMIT, total_limit=KEY_LINE_LIMIT + 1,
                               max_lines=1)  # fmt: skip
            key = next((line.strip() for _, line in lines), "")
        except (OSError, LinesRefused) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise KeyRefused(f"{where}: cannot read the key ({why})") from None
    elif variable is not None:
        where, key = API_KEY_VARIABLE, variable.strip()
    else:
        return None
    if not key:
        raise KeyRefused(
            f"{where}: the key is empty, which would turn the key check off (to serve "
            f"without a key, give none)"
        )
    bad = next((c for c in key if not "!" <= c <= "~"), None)
    if bad is not None:
        raise KeyRefused(
            f"{where}: the key holds {bad!r}, which a Bearer token cannot carry (printable "
            "ASCII, no spaces)"
        )
    return key


def connection_room(stages: int, wanted: int, extra: int = 0) -> int:
    """How many connections the server may hold: ``wanted``, or fewer when the
    descriptor limit (first raised to its hard limit) leaves less room beside those open
    now, those kept for ``stages`` stages and ``extra`` more that the connections may
    take beyond their number (while some close); ``ValueError`` when it leaves fewer
    than ``MIN_CONNECTIONS``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft == resource.RLIM_INFINITY:
        return wanted
    try:
        in_use = len(os.listdir("/proc/self/fd")) - 1  # not the listing's own
    except OSError:
        in_use = 16
    reserve = RESERVED_FDS + RESERVED_FDS_PER_STAGE * stages
    room = soft - in_use - reserve - extra
    if room < MIN_CONNECTIONS:
        raise ValueError(
            f"the descriptor limit (ulimit -n) of {soft} leaves room for {max(0, room)} "
            f"connections beside the {in_use} open and the {reserve} kept for {stages} "
            f"stages; the server needs at least {MIN_CONNECTIONS}: raise the limit"
        )
    return min(wanted, room)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(BACKLOG)
    sock.set_inheritable(False)
    return sock


def _configure_logs(verbose: bool) -> None:
    configure_logs(verbose)
    logging.getLogger("runtime_cupy.serve").setLevel(logging.INFO)
    logging.getLogger("runtime_cupy.slices").setLevel(logging.INFO)  # slices as they travel


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_chain_arguments(parser, args)
    _configure_logs(args.verbose)
    try:
        import uvicorn

        from runtime_cupy.serve.app import build_app
        from runtime_cupy.serve.connections import (
            ConnectionGuard,
            ConnectionLimits,
            QuietLog,
            bounded_h11,
            guarded_listener,
        )
        from runtime_cupy.serve.engine import Engine
        from runtime_cupy.serve.host_header import loopback_names
        from runtime_cupy.serve.shutdown import StoppingServer
    except ImportError as exc:
        print(f"error: serving needs the serve extra: pip install 'gguf-pipeline[serve]' ({exc})",
              file=sys.stderr)  # fmt: skip
        return EXIT_INPUT
    try:
        api_key = api_key_from(args, os.environ)
        overhead = ConnectionLimits(0, 1.0).descriptors  # beyond max_connections
        connections = connection_room(args.stages, args.max_connections, overhead)
        chain = chain_from(args)
        sock = _listen(args.host, args.port)
    except RESOURCE_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except INPUT_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return EXIT_INPUT
    engine = Engine(chain, max_queue=args.max_queue)
    guard = ConnectionGuard(ConnectionLimits(connections, args.client_timeout))
    sock = guarded_listener(sock, guard)
    config = uvicorn.Config(
        build_app(
            engine,
            api_key=api_key,
            client_timeout_s=args.client_timeout,
            host_names=loopback_names(sock.getsockname()[0]),  # as bound: 127.1 too
        ),
        http=bounded_h11(guard),
        backlog=BACKLOG,
        timeout_keep_alive=max(1, math.ceil(args.client_timeout)),
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=5,
    )
    QuietLog().install()  # after uvicorn configured its loggers
    server = StoppingServer(config, engine)

    def stop_if_the_stages_fail() -> None:
        if not engine.wait_started():
            server.should_exit = True

    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    log.info("listening on http://%s:%d (model %s, %d %s stages; %s; at most %d "
             "connections)", shown, port, chain.model_id, args.stages, args.worker,
             "a key is required" if api_key else "no key", connections)  # fmt: skip
    engine.start()
    threading.Thread(target=stop_if_the_stages_fail, name="watch-start", daemon=True).start()
    # uvicorn handles SIGINT / SIGTERM while it runs, then raises the signal again under
    # the handlers it found: these, so that the stages are closed before we leave. One
    # ignored at the start (SIGINT in a script's background job) stays ignored.
    stopped_by: list[int] = []  # the signal that stopped it

    def noted(signum: int, _frame: object) -> None:
        stopped_by.append(signum)
        log.info("%s: stopping", signal.Signals(signum).name)

    previous = {
        s: signal.signal(s, noted)
        for s in (signal.SIGINT, signal.SIGTERM)
        if signal.getsignal(s) != signal.SIG_IGN
    }
    try:
        server.run(sockets=[sock])
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        with contextlib.suppress(OSError):
            sock.close()
        log.info("stopping: closing the stages")
        if not engine.close(CLOSE_BOUND_S):  # stages still starting: the close waits on them
            log.warning("the stages did not stop within %.0f s: leaving them (each stops "
                        "once this process is gone)", CLOSE_BOUND_S)  # fmt: skip
    # as a run or a chat that a signal ended: 130, 143; the first that came (uvicorn
    # raises those it caught again, the last first)
    first = server.first_signal if server.first_signal is not None else next(iter(stopped_by), None)
    if first is not None:
        return cancelled_status(signal.Signals(first).name)
    if engine.failure is not None:
        print(f"error: the stages could not be started: {engine.failure}", file=sys.stderr)
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["ChainError", "api_key_from", "build_parser", "connection_room", "main"]
