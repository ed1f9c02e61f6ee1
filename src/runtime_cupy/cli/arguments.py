"""The flags every ``python -m runtime_cupy`` command shares (``main``, ``plan``,
``serve``, ``chat``), what they read, and the errors a command line reports as bad
input (exit status 2) before any process starts."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from runplan.arguments import non_negative_int, parse_size, positive_int
from runplan.gguf_error import GgufError, GgufUnmapped
from runplan.models import DEFAULT_MODEL, MODEL_HELP, ModelNotFound
from runtime_core.recovery import DEFAULT_MAX_RECOVERIES
from runtime_core.runs import PLACEMENTS, PlanRejected
from runtime_core.tokenizer import TokenizerError
from runtime_cupy.edges.choice import PREFERENCES
from runtime_cupy.hosts.ray.cluster import ClusterError
from runtime_cupy.serve.chain import DEFAULT_PREFILL_CHUNK, WarmChain
from runtime_cupy.workers import (
    DEFAULT_WORKER,
    KV_WIDTHS,
    WORKERS,
    WorkerUnavailable,
    capabilities,
)

#: The exit statuses of ``python -m runtime_cupy``: a run that faulted (or stages that
#: could not start), and bad input.
EXIT_FAULTED = 1
EXIT_INPUT = 2

#: What a sound command line meets where this host's resources are short (a model that
#: cannot be mapped under an address-space limit): exit 1, caught before ``INPUT_ERRORS``
#: (of which it is a kind).
RESOURCE_ERRORS = (GgufUnmapped,)
#: What a command line that cannot be run raises before any process starts.
INPUT_ERRORS = (ClusterError, GgufError, ModelNotFound, PlanRejected, TokenizerError,
                ValueError, WorkerUnavailable)  # fmt: skip


def stage_processes(n: int) -> str:
    """``n`` stage processes, counted in words: ``1 stage process``, ``3 stage
    processes``."""
    return f"{n} stage process" if n == 1 else f"{n} stage processes"


def gpu_list(text: str) -> list[int]:
    """An ``argparse`` type: ``0,1`` as a list of GPU indices."""
    try:
        gpus = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad GPU list {text!r}: write 0,1") from None
    if not gpus or any(g < 0 for g in gpus):
        raise argparse.ArgumentTypeError("GPU indices are non-negative integers, at least one")
    return gpus


def port_number(text: str) -> int:
    """An ``argparse`` type: a TCP port, 0..65535 (0: any free one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0..65535; 0: any free one)")
    return value


def positive_seconds(text: str) -> float:
    """An ``argparse`` type: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def writable_folder(text: str) -> Path:
    """An ``argparse`` type: a folder this user can write in (a log folder)."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder")
    if not os.access(path, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder this user can write in")
    return path


def add_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=MODEL_HELP,
    )


def add_stages(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stages", type=positive_int, default=3, help="stage processes (3)")


def add_worker(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--worker",
        choices=WORKERS,
        default=DEFAULT_WORKER,
        help="cpu: quantized weights and compiled kernels on the CPU (default); numpy: "
        "the reference worker (readable, float32, slow); cuda: the CUDA worker",
    )
    parser.add_argument(
        "--kv-dtype",
        choices=tuple(KV_WIDTHS),
        default=None,
        help="the KV caches' dtype, as the planner counts them and every stage holds them: "
        "f16 halves their memory (more runs in a stage's KV budget) and what attention reads, "
        "as llama.cpp's default cache does (default: the worker's own: f32 for cpu and "
        "numpy, f16 for cuda; numpy holds f32 only)",
    )


def check_worker_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--kv-dtype`` against ``--worker`` (one line and exit status 2). A worker this
    host cannot run is left to the command, which names it as it does without the flag."""
    if args.kv_dtype is None:
        return
    try:
        capabilities(args.worker, args.kv_dtype)
    except WorkerUnavailable:
        return
    except ValueError as exc:
        parser.error(f"argument --kv-dtype: {exc}")


def add_devices(parser: argparse.ArgumentParser) -> None:
    """``--gpus``, ``--edges`` and ``--encrypt-edges``: where a stage computes and how
    its edges move bytes."""
    parser.add_argument(
        "--gpus",
        type=gpu_list,
        default=None,
        help="GPUs of the cuda worker, stage i on the (i mod n)-th: 0,1 (default: all)",
    )
    parser.add_argument(
        "--edges",
        choices=PREFERENCES,
        default="auto",
        help="how edges move bytes: auto (shared memory where both ends share a host, "
        "else TCP; default), shm, or tcp (TCP on one host too, for tests and comparison)",
    )
    parser.add_argument(
        "--encrypt-edges",
        action="store_true",
        help="encrypt the frames of TCP edges (AES-256-GCM), for links across networks "
        "one does not trust; without it they are authenticated (HMAC-SHA256) only",
    )


def add_cluster(parser: argparse.ArgumentParser) -> None:
    """``--ray-address`` and ``--placement``: which hosts, and how the layers split."""
    parser.add_argument(
        "--ray-address",
        default=None,
        help="the stages on the live hosts of a Ray cluster: auto (the cluster this "
        "machine belongs to) or HOST:PORT of its head (default: this host); stages on "
        "other hosts log to Ray's worker logs",
    )
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="even",
        help="split the layers evenly (default) or in proportion to each node's memory",
    )


def add_recovery(parser: argparse.ArgumentParser) -> None:
    """``--recover`` and ``--max-recoveries``: runs survive a lost stage (issue 25)."""
    parser.add_argument(
        "--recover",
        action="store_true",
        help="when a stage process, host or link is lost, place the chain again over the "
        "live nodes and replay each interrupted run there, continuing its stream (once "
        "the chain is up: a stage lost while the stages first start and bind is an "
        "error; python -m runtime_cupy takes it with one --prompt, not a --prompts-file)",
    )
    parser.add_argument(
        "--max-recoveries",
        type=non_negative_int,
        default=None,
        help=f"recoveries per stream with --recover, then the fault ends it, naming this "
        f"flag: a new chain lost while it starts counts as one (default "
        f"{DEFAULT_MAX_RECOVERIES})",
    )


def check_recovery_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--max-recoveries`` without ``--recover`` (it was taken and did nothing) is a
    usage error; without the flag, its default."""
    if args.max_recoveries is not None and not args.recover:
        parser.error(
            f"argument --max-recoveries: {args.max_recoveries} recoveries need --recover "
            "(without it a lost stage ends the run)"
        )
    if args.max_recoveries is None:
        args.max_recoveries = DEFAULT_MAX_RECOVERIES


def add_verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the runtime does")


def configure_logs(verbose: bool) -> None:
    """Logs to standard error: the runtime's INFO lines with ``-v``, else warnings."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )


def add_chain_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the warm stages, shared by ``serve`` and ``chat``."""
    add_model(parser)
    add_stages(parser)
    add_worker(parser)
    add_devices(parser)
    parser.add_argument(
        "--context",
        type=positive_int,
        default=None,
        help="positions of each run's KV cache: a request's prompt and its answer hold at "
        "most one token more, the answer's last never being fed back (default: the model's "
        "context length; required for a file that states none, context_length 0)",
    )
    parser.add_argument(
        "--log-dir",
        type=writable_folder,
        default=None,
        help="keep each stage's log in this folder (one host), as stage-<i>.log: a file of "
        "this user's, appended to; a link, FIFO or another user's file there is refused",
    )
    parser.add_argument(
        "--max-concurrent",
        type=positive_int,
        default=None,
        help="runs in flight at once on the chain, batched by its stages (default: as "
        "many full-length runs as the smallest stage's --kv-budget holds, else 4); "
        "without --kv-budget each stage's KV budget holds this many full-length runs",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=positive_int,
        default=DEFAULT_PREFILL_CHUNK,
        help="rows of a prompt per prefill record: the runs decoding beside a long prompt "
        f"wait for one such chunk a step (default {DEFAULT_PREFILL_CHUNK}; smaller: shorter "
        "waits, slower prompts)",
    )
    parser.add_argument(
        "--kv-budget",
        type=kv_budget_size,
        default=None,
        help="KV cache each stage may hold for all its runs (e.g. 512MiB); runs beyond "
        "it wait for room (default: --max-concurrent full-length runs)",
    )
    add_cluster(parser)
    add_recovery(parser)
    add_verbose(parser)


def kv_budget_size(text: str) -> int:
    """``--kv-budget``: a size of at least one byte."""
    size = parse_size(text)
    if size < 1:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: a KV budget holds at least 1 byte")
    return size


def check_chain_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What no single flag of ``add_chain_arguments`` can check alone (one line and exit
    status 2). (With ``--ray-address`` the chain refuses ``--gpus`` whatever the
    worker.)"""
    check_worker_arguments(parser, args)
    check_recovery_arguments(parser, args)
    if args.gpus is not None and args.worker != "cuda" and args.ray_address is None:
        parser.error(
            f"argument --gpus: {','.join(map(str, args.gpus))} names GPUs, but the "
            f"{args.worker} worker runs on the CPU (--gpus is for --worker cuda)"
        )


def stage_options(args: argparse.Namespace) -> dict[str, Any]:
    """Where and how the stages run, as every command that starts them takes it (the
    flags of ``add_worker``, ``add_devices`` and ``add_cluster``): the keyword arguments
    of ``WarmChain``, ``generate`` and ``generate_batch`` alike, so that no command
    drops one (``--prompts-file`` once dropped four without a word)."""
    return {
        "worker": args.worker,
        "kv_dtype": args.kv_dtype,
        "gpus": args.gpus,
        "edges": args.edges,
        "encrypt_edges": args.encrypt_edges,
        "ray_address": args.ray_address,
        "placement": args.placement,
    }


def chain_from(args: argparse.Namespace) -> WarmChain:
    """The warm chain the flags of ``add_chain_arguments`` describe (not started)."""
    return WarmChain(
        args.model,
        stages=args.stages,
        **stage_options(args),
        context=args.context,
        log_dir=args.log_dir,
        max_concurrent=args.max_concurrent,
        kv_budget_bytes=args.kv_budget,
        prefill_chunk=args.prefill_chunk,
        recover=args.recover,
        max_recoveries=args.max_recoveries,
        logprobs=getattr(args, "logprobs", False),  # serve's flag
    )
