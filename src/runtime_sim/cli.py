"""``python -m runtime_sim run ...`` and ``python -m runtime_sim explore ...``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from runplan.arguments import OneLineParser, add_version, non_negative_int, positive_int
from runplan.gguf_error import GgufError, GgufUnmapped
from runplan.json_errors import (
    MUTANTS_MISSED,
    RUN_FAULTED,
    TRACE_NOT_WRITTEN,
    VIOLATIONS,
    cancelled_command,
    cancelled_json,
    cancelled_status,
    cancelled_with,
    documents_printed,
    error_json,
    exception_json,
    fault_json,
    print_json,
)
from runplan.models import ModelNotFound, resolve_model
from runplan.terminal import CommandConsole, labelled, plain_console
from runtime_core.console import (
    TextStream,
    add_generation_arguments,
    check_generation_arguments,
    generation_options,
    prompt_ids,
    shown_figures,
)
from runtime_core.interrupt import cancellable, signal_named, sigterm_interrupts
from runtime_core.runs import PlanRejected
from runtime_core.tokenizer import Tokenizer, TokenizerError
from runtime_core.trace_file import write_trace
from runtime_core.workers.registry import CORE_WORKERS
from runtime_sim.api import (
    DEFAULT_WORKER,
    GenerateResult,
    LoadProgress,
    generate,
    generate_runs,
)
from runtime_sim.explore import CHECKED_RULES, explore, report, self_test
from runtime_sim.links import ORCHESTRATOR
from runtime_sim.trace import chrome_trace

EXIT_VIOLATION = 1
#: A model this host cannot map for want of memory (``GgufUnmapped``): the host's
#: resources fell short, not the input (as ``python -m runtime_cupy`` exits for it).
EXIT_RESOURCES = 1
EXIT_INPUT = 2


def _cmd_run(args: argparse.Namespace) -> int:
    err = CommandConsole(stderr=True)
    path = resolve_model(args.model)
    tokenizer = Tokenizer.from_gguf(path)
    prompt = prompt_ids(args, tokenizer)
    if args.runs > 1:
        return _run_many(args, path, tokenizer, prompt, err)
    stream = TextStream(tokenizer, sys.stderr if args.json else sys.stdout)
    progress, on_load = _load_bars(err)
    try:
        with progress:
            result = generate(
                path,
                prompt,
                **generation_options(args),
                worker=args.worker,
                on_token=stream,
                on_load=on_load,
                tokenizer=tokenizer,
            )
    except KeyboardInterrupt as exc:
        # Ctrl-C or SIGTERM tore the run down: what was generated so far, and "cancelled".
        signal_name = signal_named(exc)
        text = tokenizer.decode(stream.ids)
        stream.finish(text)
        if args.json:
            doc = {"tokens": stream.ids, "text": text, "outcome": "cancelled", "fault": None}
            print_json(doc | cancelled_json(signal_name))
        else:
            err.print("cancelled", highlight=False)
        return cancelled_status(signal_name)
    stream.finish(result.text)
    untraced: str | None = None  # why the trace could not be written
    if args.json:  # the trace first: its error is the object's (the result is printed)
        untraced = _write_trace(args.trace, result)
        doc = _result_json(result, len(prompt))
        if result.outcome == "cancelled":
            doc |= cancelled_json()
        elif result.outcome != "completed":
            doc |= fault_json(result.fault)
        elif untraced:
            doc |= error_json(TRACE_NOT_WRITTEN, untraced)
        print_json(doc)
    else:
        _print_summary(plain_console(soft_wrap=True), result, len(prompt))
        # after the result: a trace that cannot be written (a full disk) loses nothing else
        untraced = _write_trace(args.trace, result)
    return 0 if result.outcome == "completed" and not untraced else 1


def _load_bars(err: Console) -> tuple[Progress, LoadProgress]:
    """A bar on ``err`` for each stage as it loads (``loading stage N``), gone once the
    display ends; and the ``on_load`` that moves them."""
    progress = Progress(
        TextColumn("loading stage {task.fields[stage]}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
    )
    tasks: dict[int, TaskID] = {}

    def on_load(stage: int, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = progress.add_task("load", total=total, stage=stage)
        progress.update(tasks[stage], completed=done)

    return progress, on_load


def _run_many(
    args: argparse.Namespace, path: str, tokenizer: Tokenizer, prompt: list[int], err: Console
) -> int:
    """``--runs N``: N runs of the prompt in flight at once through one chain; Ctrl-C or
    SIGTERM ends them, the runs that had ended printed beside ``Cancelled`` (``runs``,
    each with its ``index``; with ``--json``)."""
    options = generation_options(args)
    ended: dict[int, dict[str, Any]] = {}

    def on_run_end(index: int, result: GenerateResult) -> None:
        ended[index] = {"index": index} | _result_json(result, len(prompt))

    progress, on_load = _load_bars(err)  # as one run shows its stages load
    with cancellable() as cancellation, progress:
        many = generate_runs(
            path,
            prompt,
            runs=args.runs,
            tokenizer=tokenizer,
            worker=args.worker,
            **options,
            on_run_end=on_run_end,
            on_load=on_load,
        )
    if cancellation.signal_name is not None:
        so_far = {"runs": [ended[i] for i in sorted(ended)]} if args.json else None
        return cancelled_with(so_far, cancellation.signal_name)
    rate = many.simulated_tokens_per_s
    untraced: str | None = None  # why the trace could not be written
    if args.json:  # the trace first: its error is the object's (the runs are printed)
        untraced = _write_trace(args.trace, many.runs[0])  # every run's is the chain's
        doc = {
            "runs": [{"index": i} | _result_json(r, len(prompt)) for i, r in enumerate(many.runs)],
            "simulated_tokens_per_s": None if rate is None else round(rate, 2),
            "wall_s": round(many.wall_s, 3),
        }
        failed = [r for r in many.runs if r.outcome != "completed"]
        if failed:
            doc |= error_json(
                RUN_FAULTED,
                f"{len(failed)} of {len(many.runs)} runs faulted: {failed[0].fault or '-'}",
            )
        elif untraced:
            doc |= error_json(TRACE_NOT_WRITTEN, untraced)
        print_json(doc)
    else:
        console = plain_console(soft_wrap=True)
        for i, r in enumerate(many.runs):
            status = r.outcome + (f" ({r.fault})" if r.fault else "")
            console.print(f"run {i}: {r.text!r} ({status})", highlight=False)
        shown = "-" if rate is None else f"{rate:.1f}"
        console.print(
            f"{args.runs} runs through {args.stages} simulated stages: "
            f"{sum(len(r.tokens) for r in many.runs)} tokens, simulated {shown} tokens/s "
            f"in all; wall {many.wall_s:.2f} s",
            highlight=False,
        )
        # after the runs: a trace that cannot be written (a full disk) loses nothing else
        untraced = _write_trace(args.trace, many.runs[0])
    return 0 if all(r.outcome == "completed" for r in many.runs) and not untraced else 1


def _write_trace(path: Path | None, result: GenerateResult) -> str | None:
    """The chain's trace in ``path`` (``--trace``; ``None``: none asked for); else one
    line on standard error saying why (and returned), nothing half-written left
    (``runtime_core.trace_file``)."""
    if path is None:
        return None
    trace = result.trace
    actors = [ORCHESTRATOR, *[s.node_id for s in result.plan.stages]]
    message = write_trace(path, json.dumps(chrome_trace(trace.entries if trace else [], actors)))
    if message is not None:
        plain_console(stderr=True, soft_wrap=True).print(
            labelled("error", "bold red", message), highlight=False
        )
    return message


def _timings(result: GenerateResult, prompt_len: int) -> dict[str, Any]:
    p = result.prediction
    sim_tps = 1e6 / result.simulated_tpot_us if result.simulated_tpot_us else None
    return {
        "prompt_tokens": prompt_len,
        "predicted_ttft_ms": round(p.ttft_us / 1000, 3),
        "predicted_tokens_per_s": round(p.tokens_per_s, 2),
        "simulated_ttft_ms": None
        if result.simulated_ttft_us is None
        else round(result.simulated_ttft_us / 1000, 3),
        "simulated_tokens_per_s": None if sim_tps is None else round(sim_tps, 2),
        "host_decode_tokens_per_s": None
        if result.wall_decode_tokens_per_s is None
        else round(result.wall_decode_tokens_per_s, 2),
        "wall_s": round(result.wall_s, 3),
    }


def _result_json(result: GenerateResult, prompt_len: int) -> dict[str, Any]:
    return {
        "tokens": list(result.tokens),
        "text": result.text,
        "outcome": result.outcome,
        "fault": result.fault,
        "stages": [
            {
                "stage_index": s.stage_index,
                "node_id": s.node_id,
                "layer_start": s.layer_start,
                "layer_end_exclusive": s.layer_end_exclusive,
            }
            for s in result.plan.stages
        ],
        "timings": _timings(result, prompt_len),
    }


def _print_summary(console: Console, result: GenerateResult, prompt_len: int) -> None:
    console.print(
        f"{result.plan.model.model_id} through {result.plan.stage_count} simulated stages",
        highlight=False,
    )
    table = Table(box=box.SIMPLE_HEAD)
    for col in ("stage", "node", "layers"):
        table.add_column(col)
    for s in result.plan.stages:
        table.add_row(str(s.stage_index), s.node_id, f"{s.layer_start}-{s.layer_end_exclusive - 1}")
    console.print(table)
    t = shown_figures(_timings(result, prompt_len))
    status = result.outcome + (f" ({result.fault})" if result.fault else "")
    console.print(
        f"{len(result.tokens)} tokens, {status}. tokens/s predicted "
        f"{t['predicted_tokens_per_s']}, simulated {t['simulated_tokens_per_s']}, "
        f"host decode {t['host_decode_tokens_per_s']}; wall {t['wall_s']} s",
        highlight=False,
    )


def _cmd_explore(args: argparse.Namespace) -> int:
    out = plain_console(soft_wrap=True)
    if args.rules:
        if args.json:
            print_json({"rules": list(CHECKED_RULES)})
        else:
            print("\n".join(CHECKED_RULES))  # one a line, unwrapped
        return 0
    if args.self_test:
        results = self_test()
        missed = [r.mutation.value for r in results if not r.caught]
        if args.json:
            doc: dict[str, Any] = {
                "mutants": [
                    {
                        "mutation": r.mutation.value,
                        "caught": r.caught,
                        "seed": r.seed,
                        "rules": list(r.rules),
                    }
                    for r in results
                ]
            }
            if missed:
                message = f"{len(missed)} of {len(results)} mutants missed: {', '.join(missed)}"
                doc |= error_json(MUTANTS_MISSED, message)
            print_json(doc)
        else:
            for r in results:
                verdict = "caught" if r.caught else "MISSED"
                out.print(
                    f"{r.mutation.value:<24} {verdict}  {', '.join(r.rules)}", highlight=False
                )
        return EXIT_VIOLATION if missed else 0
    began = time.perf_counter()
    outcomes = explore(args.start, args.seeds, max_runs=args.max_runs)
    if args.json:
        rep = report(args.start, outcomes)  # report_json's bytes
        if rep["violations"]:
            rep |= error_json(VIOLATIONS, _violations_message(rep))
        print_json(rep)
    else:
        rep = report(args.start, outcomes)
        spent = time.perf_counter() - began
        out.print(
            f"seeds {args.start}..{args.start + args.seeds - 1}: {rep['outcomes']}, "
            f"{rep['events']} events in {spent:.2f} s; {rep['recovered_streams']} streams "
            f"recovered, re-placements {rep['replacements']}, "
            f"{rep['losses_during_recovery']} losses during a recovery",
            highlight=False,
        )
        for v in rep["violations"]:
            detail = f"seed {v['seed']}: {v['rule']}: {v['detail']} (faults {v['faults']})"
            out.print(labelled("violation", "red", detail), highlight=False)
    return EXIT_VIOLATION if any(o.violations for o in outcomes) else 0


def _violations_message(rep: dict[str, Any]) -> str:
    """One line for an explore report's violations: how many, over which seeds, and the
    first (its seed reproduces it)."""
    found = rep["violations"]
    first = found[0]
    seeds = f"{rep['start']}..{rep['start'] + rep['seeds'] - 1}"
    return (
        f"{len(found)} violation{'s' if len(found) > 1 else ''} over seeds {seeds}; first: "
        f"seed {first['seed']}: {first['rule']}: {first['detail']}"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m runtime_sim",
        description="Run a GGUF model through a simulated pipeline, or explore seeded "
        "fault scenarios and check every guarantee.",
    )
    add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="generate text through N simulated stages",
        description="Generate text from a GGUF model through N simulated "
        "stages, each running the NumPy reference worker (or the CPU worker) over its "
        "layers.",
    )
    add_generation_arguments(run, stages_help="pipeline stages (default: 3)")
    run.add_argument(
        "--worker",
        choices=sorted(CORE_WORKERS.names),
        default=DEFAULT_WORKER,
        help="each stage's worker: numpy, the reference worker (default); cpu, the CPU "
        "worker the process runtime runs (quantized weights, compiled kernels)",
    )
    run.add_argument(
        "--runs",
        type=positive_int,
        default=1,
        help="runs of the prompt in flight at once through the chain, run i sampling "
        "with seed + i modulo 2**64 (1)",
    )
    run.set_defaults(func=_cmd_run, parser=run)

    ex = sub.add_parser(
        "explore",
        help="run seeded fault scenarios and check invariants",
        description="Run N seeded scenarios (random chain shapes, concurrent runs and "
        "faults, synthetic workers) and report every violated guarantee with the "
        "seed that reproduces it. Exit status 1 on any violation.",
    )
    ex.add_argument("--seeds", type=positive_int, default=200, help="how many scenarios (200)")
    ex.add_argument("--start", type=non_negative_int, default=0, help="the first seed (0)")
    ex.add_argument(
        "--max-runs",
        type=positive_int,
        default=6,
        help="each scenario draws 1 to N concurrent runs on its chain (6)",
    )
    ex.add_argument(
        "--json",
        action="store_true",
        help="one JSON report (no wall-clock figures: same seeds, same bytes)",
    )
    # --rules runs nothing: beside --self-test it once exited 0 with no mutant run
    what = ex.add_mutually_exclusive_group()
    what.add_argument(
        "--self-test",
        action="store_true",
        help="run the built-in mutants; exit 0 only if the checker catches each",
    )
    what.add_argument(
        "--rules",
        action="store_true",
        help="list every rule a scenario is checked against (its kind before the colon) "
        "and run nothing (not with --self-test)",
    )
    ex.set_defaults(func=_cmd_explore)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    began = documents_printed()  # the JSON documents printed before this command's
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "run":
        check_generation_arguments(args.parser, args)  # its errors name `run` and its --help
    try:
        with sigterm_interrupts():  # SIGTERM cancels the command as Ctrl-C does
            code: int = args.func(args)
    except GgufUnmapped as exc:  # a GgufError, but the host's fault, not the input's
        _print_error(args, exc)
        return EXIT_RESOURCES
    except (GgufError, ModelNotFound, PlanRejected, TokenizerError, ValueError) as exc:
        _print_error(args, exc)
        return EXIT_INPUT
    except KeyboardInterrupt as exc:  # before a run had a result to print, or just after
        as_json = getattr(args, "json", False)
        return cancelled_command(signal_named(exc), as_json=as_json, since=began)
    return code


def _print_error(args: argparse.Namespace, exc: Exception) -> None:
    if getattr(args, "json", False):
        print_json(exception_json(exc))
    else:
        plain_console(stderr=True, soft_wrap=True).print(
            labelled("error", "bold red", str(exc)), highlight=False
        )
