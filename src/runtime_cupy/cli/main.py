"""``python -m runtime_cupy --model PATH --stages N --prompt TEXT ...``: generate text
through N stage processes, with the flags and output of ``python -m runtime_sim run``
(``--ray-address``: on the hosts of a Ray cluster; ``python -m runtime_cupy plan``
prints the plan, in ``cli.plan``).

``--prompts-file FILE.jsonl`` runs every prompt of the file at once on one chain
(``batch.generate_batch``, in ``cli.prompts_file``) and prints one JSON line per
prompt as it completes; with ``--json``, one JSON object once every prompt is done
(``results``: those lines, in the file's order; ``prompts``, ``completed``,
``faulted``; ``error`` if one faulted); Ctrl-C or SIGTERM closes its chain and prints
what ended, beside ``Cancelled``.

Text streams to standard output as tokens arrive, then a summary; with ``--json``,
standard output is exactly one JSON object (``tokens``, ``text``, ``outcome``,
``fault``, ``stages``, ``timings``, ``slices``: bytes and seconds of each stage's slice
that travelled; ``recoveries``: the times ``--recover`` replayed the run after a
loss) and everything else goes to standard error. While slices of the model travel to
stages on other hosts, standard error shows a progress bar per stage. A run
that faults prints one line naming the stage, node and reason to standard error and
exits 1, as do stages that cannot be started (no descriptor left, ...) and a
``--trace`` that cannot be written (a full disk: said in one line after the result,
which is printed first; with ``--json``, the object's ``error``, ``TraceNotWritten``);
with ``--json``, a failure is the object's ``error`` (``runplan.json_errors``); Ctrl-C tears
the run down (waiting for the stages to stop; a second Ctrl-C stops waiting), prints
``cancelled`` and exits 130 (SIGTERM: the same, exiting 143, 128 + the signal's number
as a shell reports a process the signal ended; ``interrupted_by`` in ``--json``); bad
input exits 2. With
``--recover`` the run survives a lost stage process, host or link: the chain is placed
again over the live nodes and the run replayed there, its text going on where it
stopped (``serve.recovery``, at most ``--max-recoveries`` times); the
stages then start and bind as ``serve``'s do (``serve.chain.WarmChain``); Ctrl-C and
SIGTERM close that chain and end the run as without it (``runtime_core.interrupt``).

Subcommands beside it: ``python -m runtime_cupy plan ...`` (``cli.plan``),
``python -m runtime_cupy serve ...`` (an OpenAI-compatible HTTP
API over warm stages, ``cli.serve``), ``python -m runtime_cupy chat ...`` (a
terminal chat on warm stages, ``cli.chat``) and ``python -m runtime_cupy cache
list|clear`` (this host's slice cache, ``cli.cache``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import attrs
from rich.console import Console

from runplan.arguments import OneLineParser, add_version
from runplan.config import run_positions
from runplan.json_errors import (
    TRACE_NOT_WRITTEN,
    cancelled_command,
    cancelled_json,
    cancelled_status,
    documents_printed,
    error_json,
    exception_json,
    fault_json,
)
from runplan.models import resolve_model
from runplan.terminal import labelled, plain_console
from runtime_core.console import (
    TextStream,
    add_generation_arguments,
    check_generation_arguments,
    generation_options,
    prompt_ids,
)
from runtime_core.interrupt import signal_named, signal_of, sigterm_interrupts
from runtime_core.tokenizer import Tokenizer
from runtime_cupy.api import GenerateResult, generate
from runtime_cupy.cli.arguments import (
    EXIT_FAULTED,
    EXIT_INPUT,
    INPUT_ERRORS,
    RESOURCE_ERRORS,
    add_cluster,
    add_devices,
    add_recovery,
    add_verbose,
    add_worker,
    check_recovery_arguments,
    check_worker_arguments,
    configure_logs,
    stage_options,
)
from runtime_cupy.cli.json_stdout import json_stdout, write_json
from runtime_cupy.cli.prompts_file import _run_batch
from runtime_cupy.cli.run_output import _print_summary, _result_json, _write_trace
from runtime_cupy.cli.stages_starting import StagesStarting
from runtime_cupy.hosts.ray.session import left_at_the_end
from runtime_cupy.serve.chain import ChainError, WarmChain


def _run(args: argparse.Namespace) -> int:
    if args.prompts_file is None and args.max_concurrent is not None:
        raise ValueError("--max-concurrent is for a --prompts-file (one --prompt is one run)")
    if args.prompts_file is not None:
        if args.recover:
            raise ValueError("--recover runs one prompt (--prompt), not a --prompts-file")
        if args.trace is not None:
            raise ValueError("--trace records one prompt's run (--prompt), not a --prompts-file")
        return _run_batch(args)
    err = plain_console(stderr=True, soft_wrap=True)
    path = resolve_model(args.model)
    tokenizer = Tokenizer.from_gguf(path)
    prompt = prompt_ids(args, tokenizer)
    stream = TextStream(tokenizer, sys.stderr if args.json else sys.stdout)
    recoveries = 0
    with StagesStarting(err, args.stages) as starting:
        if args.recover:
            chain = _recovering_chain(args, path, prompt)
            chain.on_load = starting.on_load
            chain.show_slices(starting.on_slice)
            try:
                result = _generate_recovering(args, chain, prompt, stream)
            except KeyboardInterrupt as exc:  # the chain is closed: what came, "cancelled"
                return _cancelled(
                    args, stream, tokenizer, err, signal_of(exc), chain.recoveries.count
                )
            recoveries = chain.recoveries.count
        else:
            result = generate(
                path,
                prompt,
                **generation_options(args),
                on_token=stream,
                on_load=starting.on_load,
                tokenizer=tokenizer,
                **stage_options(args),
                on_slice=starting.on_slice,
                handle_signals=True,  # Ctrl-C and SIGTERM: a cancelled run, 130 / 143
            )
    stream.finish(result.text)
    untraced: str | None = None  # why the trace could not be written
    if args.json:  # the trace first: its error is the object's (the result is printed)
        untraced = None if args.trace is None else _write_trace(args.trace, result, err)
        doc = _result_json(result, len(prompt)) | {"recoveries": recoveries}
        if result.outcome == "faulted":
            doc |= fault_json(result.fault)
        elif result.outcome == "cancelled":
            doc |= cancelled_json(result.interrupted_by)
        elif untraced:
            doc |= error_json(TRACE_NOT_WRITTEN, untraced)
        write_json(doc)
    else:
        _print_summary(plain_console(soft_wrap=True), result, len(prompt), args.worker)
        # after the result: a trace that cannot be written (a full disk) loses nothing else
        untraced = None if args.trace is None else _write_trace(args.trace, result, err)
    if result.outcome == "completed":
        return EXIT_FAULTED if untraced else 0
    if result.outcome == "cancelled":
        err.print("cancelled", highlight=False)  # as runtime_sim run says it
        return cancelled_status(result.interrupted_by)
    err.print(f"error: run faulted: {result.fault or ''}", highlight=False)
    return EXIT_FAULTED


def _recovering_chain(args: argparse.Namespace, path: str, prompt: list[int]) -> WarmChain:
    """The warm chain of one ``--recover`` run: it recovers from a lost stage and counts
    the times (``chain.recoveries``)."""
    return WarmChain(
        path,
        stages=args.stages,
        **stage_options(args),
        context=max(2, run_positions(len(prompt), args.max_tokens)),
        trace=args.trace is not None,
        max_concurrent=1,
        recover=True,
        max_recoveries=args.max_recoveries,
    )


def _generate_recovering(
    args: argparse.Namespace, chain: WarmChain, prompt: list[int], stream: TextStream
) -> GenerateResult:
    """The run of a ``--recover`` run on its warm chain, started here and closed after;
    its ``load_s`` and ``wall_s`` count the chain's start and bind, as a run without
    ``--recover`` counts its stages' start and load."""
    # SIGTERM tears the chain down as Ctrl-C does; taken after the chain is made, which
    # connects to a Ray cluster (--ray-address), whose driver sets its own handler.
    with sigterm_interrupts():
        try:
            began = time.perf_counter()
            chain.start()
            start_s = time.perf_counter() - began
            run = chain.generate(
                prompt,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                seed=args.seed,
                on_token=stream,
            )
            handles = chain.handles()  # the stages that ran it last (after any recovery)
        finally:
            chain.close()
    result = run.result
    return attrs.evolve(
        result,
        load_s=start_s + (result.load_s or 0.0),
        wall_s=start_s + result.wall_s,
        # read after the close, which reaped them: how each ended, as a run without
        # --recover reports its stages
        stages=tuple(h.info() for h in handles) or result.stages,
    )


def _cancelled(
    args: argparse.Namespace,
    stream: TextStream,
    tokenizer: Tokenizer,
    err: Console,
    signal_name: str,
    recoveries: int,
) -> int:
    """Ctrl-C or SIGTERM (``signal_name``) ended a ``--recover`` run (its warm chain,
    closed, gives no result): the tokens streamed so far, with ``--json`` as one object
    of the result's fields and the times the run was recovered, and ``cancelled`` (130;
    143 for SIGTERM), as a run without ``--recover`` ends."""
    text = tokenizer.decode(stream.ids)
    stream.finish(text)
    if args.json:
        write_json(
            {"tokens": list(stream.ids), "text": text, "outcome": "cancelled", "fault": None,
             "interrupted_by": signal_name, "recoveries": recoveries}
            | cancelled_json(signal_name)
        )  # fmt: skip
    err.print("cancelled", highlight=False)
    return cancelled_status(signal_name)


def build_parser() -> argparse.ArgumentParser:
    run = OneLineParser(
        prog="python -m runtime_cupy",
        description="Generate text from a GGUF model through N stage processes on this "
        "host or on the hosts of a Ray cluster (one OS process per stage, shared-memory "
        "or TCP edges between them).",
        epilog="Also: 'python -m runtime_cupy plan --help' (the plan against this host or "
        "a Ray cluster), 'python -m runtime_cupy serve --help' (an OpenAI-compatible HTTP "
        "API over warm stages), 'python -m runtime_cupy chat --help' (a terminal chat) and "
        "'python -m runtime_cupy cache list|clear' (this host's cache of model slices).",
    )
    add_version(run)
    add_generation_arguments(run, stages_help="stage processes (default: 3)", prompts_file=True)
    add_worker(run)
    add_devices(run)
    add_cluster(run)
    add_recovery(run)
    add_verbose(run)
    return run


def _subcommand(name: str, argv: Sequence[str]) -> int:
    if name == "plan":
        from runtime_cupy.cli.plan import main as plan

        return plan(argv)
    if name == "serve":
        from runtime_cupy.cli.serve import main as serve

        return serve(argv)
    if name == "cache":
        from runtime_cupy.cli.cache import main as cache

        return cache(argv)
    from runtime_cupy.cli.chat import main as chat

    return chat(argv)


SUBCOMMANDS = ("plan", "serve", "chat", "cache")


def _error(args: argparse.Namespace, exc: Exception) -> None:
    if args.json:
        write_json(exception_json(exc))
    else:
        plain_console(stderr=True, soft_wrap=True).print(
            labelled("error", "bold red", str(exc)), highlight=False
        )


def main(argv: Sequence[str] | None = None) -> int:
    began = documents_printed()  # the JSON documents printed before this command's
    given = list(sys.argv[1:] if argv is None else argv)
    if given and given[0] in SUBCOMMANDS:
        return _subcommand(given[0], given[1:])
    parser = build_parser()
    if given and not given[0].startswith("-"):  # a mistyped command (it said --prompt is due)
        parser.error(f"unknown command {given[0]!r} (commands: {', '.join(SUBCOMMANDS)})")
    args = parser.parse_args(given)
    check_generation_arguments(parser, args)
    check_worker_arguments(parser, args)
    check_recovery_arguments(parser, args)
    configure_logs(args.verbose)
    # Whatever else writes to stdout goes to stderr, Ray's driver too until it is left.
    with json_stdout(args.json), left_at_the_end():
        try:
            return _run(args)
        except RESOURCE_ERRORS as exc:
            _error(args, exc)
            return EXIT_FAULTED
        except INPUT_ERRORS as exc:
            _error(args, exc)
            return EXIT_INPUT
        except ChainError as exc:  # --recover's or --prompts-file's stages could not start
            _error(args, exc)
            return EXIT_FAULTED
        except KeyboardInterrupt as exc:  # before a run (or a batch) had a result to print,
            # or just after it printed one (SIGTERM while the model is read, ...)
            return cancelled_command(
                signal_named(exc), as_json=args.json, since=began, write=write_json
            )
