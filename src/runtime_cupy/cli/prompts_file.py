"""``python -m runtime_cupy --prompts-file FILE.jsonl``: every prompt of the file at once
on one chain (``batch.generate_batch``), one JSON line per prompt as it completes; with
``--json``, one JSON object once every prompt is done (``results``: those lines, in
the file's order; ``prompts``, ``completed``, ``faulted``; ``error`` if one faulted);
Ctrl-C or SIGTERM closes its chain and prints what ended, beside ``Cancelled``. A line
of the file that is no prompt is a ``PromptsFileError`` naming its line."""

from __future__ import annotations

import argparse
import json
from collections.abc import Generator
from pathlib import Path
from typing import Any

from rich.console import Console

from runplan.json_errors import RUN_FAULTED, cancelled_with, error_json
from runplan.models import resolve_model
from runplan.terminal import plain_console
from runtime_core.bounded_lines import LinesRefused, read_lines
from runtime_core.console import encode_prompt, generation_options
from runtime_core.interrupt import cancellable
from runtime_core.tokenizer import Tokenizer
from runtime_cupy.api import GenerateResult
from runtime_cupy.batch import BatchError, generate_batch
from runtime_cupy.cli.arguments import EXIT_FAULTED, stage_options
from runtime_cupy.cli.json_stdout import write_json
from runtime_cupy.cli.stages_starting import StagesStarting

#: The most bytes of one line of ``--prompts-file``, and of the whole file (``/dev/zero``,
#: or any file without line feeds, was read whole into memory).
PROMPT_LINE_LIMIT = 16 << 20
PROMPTS_FILE_LIMIT = 256 << 20


class PromptsFileError(ValueError):
    """A line of ``--prompts-file`` that is no prompt, named by its line number, or a
    file that is not read (past a bound, not UTF-8, a folder: ``_read_prompts``)."""


def _read_prompts(
    path: Path, tokenizer: Tokenizer, chat: bool
) -> tuple[list[list[int]], list[int]]:
    """Each line of a JSON Lines file: ``{"prompt": TEXT}`` (encoded as ``--prompt``
    is) or ``{"prompt_ids": [IDS]}`` (refused with ``chat``, as ``--chat --prompt-ids``
    is: the template wraps a text, and the ids ran unwrapped without a word); blank
    lines skipped; and each prompt's line number. Lines end at a line feed only (JSON
    text may hold U+2028 and the like raw); a byte-order mark at the start is skipped.
    A line of more than ``PROMPT_LINE_LIMIT`` bytes, a file of more than
    ``PROMPTS_FILE_LIMIT`` or text that is not UTF-8 is refused
    (``runtime_core.bounded_lines``); a FIFO (``<(command)``) is read."""
    prompts, numbers = [], []
    lines = read_lines(path, line_limit=PROMPT_LINE_LIMIT, total_limit=PROMPTS_FILE_LIMIT)
    while True:
        try:
            number, line = next(lines)
        except StopIteration:
            break
        except (OSError, LinesRefused) as exc:
            raise PromptsFileError(f"--prompts-file {str(path)!r}: {exc}") from None
        if not line.strip():
            continue
        numbers.append(number)
        where = f"--prompts-file {str(path)!r} line {number}"
        try:
            item = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:  # nested too deep: the latter
            raise PromptsFileError(f"{where}: not JSON ({exc})") from None
        if isinstance(item, dict) and isinstance(item.get("prompt"), str) and len(item) == 1:
            prompts.append(encode_prompt(item["prompt"], tokenizer, chat=chat))
        elif (
            isinstance(item, dict)
            and len(item) == 1
            and isinstance(item.get("prompt_ids"), list)
            and all(type(t) is int and t >= 0 for t in item["prompt_ids"])
        ):
            if chat:
                raise PromptsFileError(
                    f"{where}: --chat wraps a text prompt in the chat template; "
                    '{"prompt_ids": [IDS]} are tokens already'
                )
            prompts.append(list(item["prompt_ids"]))
        else:
            raise PromptsFileError(
                f'{where}: {line[:80]!r} is neither {{"prompt": TEXT}} nor {{"prompt_ids": [IDS]}}'
            )
    if not prompts:
        raise PromptsFileError(f"--prompts-file {str(path)!r} holds no prompt")
    return prompts, numbers


def _run_batch(args: argparse.Namespace) -> int:
    """Every prompt of ``--prompts-file`` on one chain; one JSON line per prompt as it
    completes (``index``, ``tokens``, ``text``, ``outcome``, ``fault``), or with
    ``--json`` one object once all are done (``_batch_json``; each completion a line on
    standard error meanwhile); exit 1 if any faulted."""
    path = resolve_model(args.model)
    tokenizer = Tokenizer.from_gguf(path)
    prompts, lines = _read_prompts(args.prompts_file, tokenizer, args.chat)
    options = generation_options(args)
    options.pop("trace")
    err = plain_console(stderr=True, soft_wrap=True)
    starting = StagesStarting(err, args.stages)  # as a single run shows its stages start
    with starting:
        try:
            batch = generate_batch(
                path, prompts, **options, **stage_options(args),
                max_concurrent=args.max_concurrent,
                on_load=starting.on_load, on_slice=starting.on_slice,
            )  # fmt: skip
        except BatchError as exc:  # a prompt the model cannot run: named by its line
            if exc.index is None:
                raise
            where = f"--prompts-file {str(args.prompts_file)!r} line {lines[exc.index]}"
            raise PromptsFileError(f"{where}: {exc}") from None
        return _results(args, batch, prompts, lines, err)


def _results(
    args: argparse.Namespace,
    batch: Generator[tuple[int, GenerateResult], None, None],
    prompts: list[list[int]],
    lines: list[int],
    err: Console,
) -> int:
    """The batch's results as its prompts end (``_run_batch``), its exit status."""
    faulted = 0
    results: list[dict[str, Any]] = []
    # SIGTERM ends the batch as Ctrl-C does; taken once the chain is made, which connects
    # to a Ray cluster (--ray-address), whose driver sets its own handler. The prompts
    # that ended stay the batch's.
    with cancellable() as cancellation:
        try:
            for index, result in batch:
                line = {
                    "index": index,
                    "tokens": list(result.tokens),
                    "text": result.text,
                    "outcome": result.outcome,
                    "fault": result.fault,
                }
                faulted += result.outcome != "completed"
                if args.json:
                    results.append(line)
                    err.print(
                        f"prompt {index} (line {lines[index]}): {result.outcome}, "
                        f"{len(result.tokens)} tokens ({len(results)} of {len(prompts)} "
                        "done)",
                        highlight=False,
                    )
                else:
                    write_json(line)
        finally:
            batch.close()  # the chain closed, whatever ended the loop
    if cancellation.signal_name is not None:
        doc = _batch_json(results, len(prompts)) if args.json else None
        return cancelled_with(doc, cancellation.signal_name, write_json)
    if args.json:
        write_json(_batch_json(results, len(prompts)))
    return EXIT_FAULTED if faulted else 0


def _batch_json(results: list[dict[str, Any]], prompts: int) -> dict[str, Any]:
    """``--prompts-file`` with ``--json``: one object, ``results`` (each prompt that
    ended, in the file's order), ``prompts`` (the file's), ``completed`` and ``faulted``
    (counts of ``results``), and ``error`` (``RunFaulted``, naming the first) when a
    prompt did not complete."""
    results = sorted(results, key=lambda r: r["index"])
    failed = [r for r in results if r["outcome"] != "completed"]
    doc: dict[str, Any] = {
        "results": results,
        "prompts": prompts,
        "completed": len(results) - len(failed),
        "faulted": len(failed),
    }
    if failed:
        first = failed[0]
        message = (
            f"{len(failed)} of {len(results)} prompts did not complete; prompt "
            f"{first['index']}: {first['outcome']}: {first['fault'] or '-'}"
        )
        doc |= error_json(RUN_FAULTED, message)
    return doc
