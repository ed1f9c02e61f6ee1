"""``python -m runtime_cupy serve``: an OpenAI-compatible HTTP API over warm stages.

    python -m runtime_cupy serve --model M --stages N [--worker W] [--host 127.0.0.1]
        [--port 8000] [--api-key KEY] [--max-queue Q] [--context C] [--edges E]
        [--ray-address auto|HOST:PORT] [--placement even|memory] [-v]

The stage processes start and bind once; the server listens at once (``GET /health``
says 503 until every stage is ready) and serves one request at a time on them, in the
order they arrived. The key comes from ``--api-key`` or ``GGUF_PIPELINE_API_KEY``;
without either, no key is asked for. It binds to 127.0.0.1 unless told otherwise.
Standard error says where it listens (``listening on http://HOST:PORT``) and logs each
request (``-v``: everything the runtime does). Ctrl-C or SIGTERM stops it: what runs
is cancelled and every stage process exits. With ``--ray-address`` the stages live on
the hosts of that Ray cluster (this process its driver), placed as ``python -m
runtime_cupy --ray-address`` places them.

Exit status: 0 after a stop, 1 if the stages could not be started, 2 for bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from runplan.gguf_header import GgufError
from runplan.models import DEFAULT_MODEL, ModelNotFound
from runtime_core.runs import PLACEMENTS, PlanRejected
from runtime_core.tokenizer import TokenizerError
from runtime_cupy.edges.choice import PREFERENCES
from runtime_cupy.hosts.ray.cluster import ClusterError
from runtime_cupy.serve.chain import ChainError, WarmChain
from runtime_cupy.workers import DEFAULT_WORKER, WORKERS, WorkerUnavailable

API_KEY_VARIABLE = "GGUF_PIPELINE_API_KEY"
EXIT_FAILED = 1
EXIT_INPUT = 2
#: What a command line that cannot be served raises before any process starts.
INPUT_ERRORS = (ClusterError, GgufError, ModelNotFound, PlanRejected, TokenizerError,
                ValueError, WorkerUnavailable)  # fmt: skip

log = logging.getLogger("runtime_cupy.serve")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def _gpus(text: str) -> list[int]:
    from runtime_cupy.cli import _gpus as gpus

    return gpus(text)


def add_chain_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the warm stages, shared by ``serve`` and ``chat``."""
    worker = DEFAULT_WORKER
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"a GGUF file or a bundled model name (default: {DEFAULT_MODEL})",
    )
    parser.add_argument("--stages", type=_positive, default=3, help="stage processes (3)")
    parser.add_argument(
        "--worker", choices=WORKERS, default=worker, help=f"the stages' worker ({worker})"
    )
    parser.add_argument(
        "--gpus", type=_gpus, default=None, help="GPUs of the cuda worker: 0,1 (default: all)"
    )
    parser.add_argument(
        "--edges", choices=PREFERENCES, default="auto", help="how edges move bytes (auto)"
    )
    parser.add_argument(
        "--context",
        type=_positive,
        default=None,
        help="tokens a request's prompt and answer may hold together (default: the "
        "model's context length)",
    )
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="keep each stage's log here (one host)"
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        help="keep the stages on the live hosts of a Ray cluster: auto (the cluster this "
        "machine belongs to) or HOST:PORT of its head; their logs go to Ray's worker logs",
    )
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="even",
        help="split the layers evenly (default) or in proportion to each node's memory",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the runtime does")


def chain_from(args: argparse.Namespace) -> WarmChain:
    """The warm chain the flags describe (not started)."""
    return WarmChain(
        args.model,
        stages=args.stages,
        worker=args.worker,
        gpus=args.gpus,
        edges=args.edges,
        context=args.context,
        log_dir=args.log_dir,
        ray_address=args.ray_address,
        placement=args.placement,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m runtime_cupy serve",
        description="Serve a GGUF model over an OpenAI-compatible HTTP API "
        "(POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, "
        "GET /metrics) from warm stage processes: started and bound once, one request "
        "at a time, in arrival order.",
    )
    add_chain_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (8000; 0: any free one)")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"the Bearer token every request must carry (or {API_KEY_VARIABLE}; default: none)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=16,
        help="requests that may wait behind the running one; more get 429 (16)",
    )
    return p


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(128)
    sock.set_inheritable(False)
    return sock


def _noted(signum: int, _frame: object) -> None:
    log.info("%s: stopping", signal.Signals(signum).name)


def _configure_logs(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("runtime_cupy.serve").setLevel(logging.INFO)
    logging.getLogger("runtime_cupy.slices").setLevel(logging.INFO)  # slices as they travel


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logs(args.verbose)
    try:
        import uvicorn

        from runtime_cupy.serve.app import build_app
        from runtime_cupy.serve.engine import Engine
    except ImportError as exc:
        print(f"error: serving needs the serve extra: pip install 'gguf-pipeline[serve]' ({exc})",
              file=sys.stderr)  # fmt: skip
        return EXIT_INPUT
    if args.max_queue < 0:
        print(f"error: --max-queue {args.max_queue} is negative", file=sys.stderr)
        return EXIT_INPUT
    api_key = args.api_key or os.environ.get(API_KEY_VARIABLE) or None
    try:
        chain = chain_from(args)
        sock = _listen(args.host, args.port)
    except INPUT_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return EXIT_INPUT
    engine = Engine(chain, max_queue=args.max_queue)
    config = uvicorn.Config(
        build_app(engine, api_key=api_key),
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)

    def stop_if_the_stages_fail() -> None:
        if not engine.wait_started():
            server.should_exit = True

    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    log.info("listening on http://%s:%d (model %s, %d %s stages; %s)", shown, port,
             chain.model_id, args.stages, args.worker,
             "a key is required" if api_key else "no key")  # fmt: skip
    engine.start()
    threading.Thread(target=stop_if_the_stages_fail, name="watch-start", daemon=True).start()
    # uvicorn handles SIGINT / SIGTERM while it runs, then raises the signal again under
    # the handlers it found: these, so that the stages are closed before we leave.
    previous = {s: signal.signal(s, _noted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        with contextlib.suppress(OSError):
            sock.close()
        log.info("stopping: closing the stages")
        engine.close()
    if engine.failure is not None:
        print(f"error: the stages could not be started: {engine.failure}", file=sys.stderr)
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["ChainError", "add_chain_arguments", "build_parser", "chain_from", "main"]
