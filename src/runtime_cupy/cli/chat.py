"""``python -m runtime_cupy chat``: a terminal chat on warm stages.

    python -m runtime_cupy chat --model M --stages N [--worker W] [--system TEXT]
        [--max-tokens T] [--temperature T] [--top-k K] [--top-p P] [--seed S]
        [--ray-address auto|HOST:PORT] [--placement even|memory]

The stages start and bind once (``serve.chain.WarmChain``); then each line typed is a
user turn: the model's chat template over the whole conversation so far, the answer
streamed as it is generated. ``/reset`` starts a new conversation, ``/exit`` (or
Ctrl-D) leaves; Ctrl-C stops the answer being written (what was written stays in the
conversation) and the chat goes on; SIGTERM ends the chat (its stages closed,
``cancelled`` on standard error, exit 143; so does a Ctrl-C while the stages start,
exit 130), at once at the prompt too (``line_input``: one that came while readline
wrote waited for the Enter key). A conversation that leaves an answer less room
than ``--max-tokens`` (or half the context, where that is less) loses its oldest turns
(the system prompt stays), with a note; a message too long for the context, or one the
chat template refuses, is forgotten and the conversation kept as it was. The answer goes
to standard output; everything else to standard error.

Exit status: 0 after ``/exit``, 1 if the stages could not be started, 2 for bad input
(a model without a chat template, or one that fails, before the stages start),
130 for a Ctrl-C while they start, 143 for SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

from runplan import SamplingConfig
from runplan.arguments import OneLineParser
from runplan.interrupted import Interrupted
from runplan.json_errors import cancelled_status
from runplan.validate import check_sampling
from runtime_core.console import TextStream, add_sampling_arguments
from runtime_core.interrupt import signal_of
from runtime_core.tokenizer import TokenizerError
from runtime_cupy.cli.arguments import (
    EXIT_INPUT,
    INPUT_ERRORS,
    RESOURCE_ERRORS,
    add_chain_arguments,
    chain_from,
    check_chain_arguments,
    configure_logs,
    stage_processes,
)
from runtime_cupy.cli.line_input import read_line
from runtime_cupy.serve.chain import ChainError, WarmChain
from runtime_cupy.serve.prompts import chat_prompt, chat_text
from runtime_cupy.serve.requests import Message

if TYPE_CHECKING:
    from runtime_cupy.process.chain_run import ChainRun

EXIT_FAILED = 1
HELP = "/reset starts over, /exit (or Ctrl-D) leaves, Ctrl-C stops an answer"


class Chat:
    """A conversation on ``chain``: ``say(text)`` streams the answer to ``out``."""

    def __init__(
        self,
        chain: WarmChain,
        *,
        system: str | None = None,
        max_tokens: int = 512,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        out: TextIO = sys.stdout,
        err: TextIO = sys.stderr,
    ) -> None:
        self.chain = chain
        self.system = system
        self.max_tokens = max_tokens
        self.temperature, self.top_k, self.top_p, self.seed = temperature, top_k, top_p, seed
        self.out = out
        self.err = err
        self.turns: list[Message] = []

    def reset(self) -> None:
        self.turns = []

    def _messages(self, turns: Sequence[Message]) -> list[Message]:
        head = [Message("system", self.system)] if self.system else []
        return head + list(turns)

    def check_template(self) -> None:
        """Render a first turn: ``TokenizerError`` (``NoChatTemplate``,
        ``ChatTemplateError``) for a model whose chat template is missing or fails, found
        before its stages start."""
        chat_text(self.chain.tokenizer, self._messages([Message("user", "Hello")]))

    def _prompt(self, turns: list[Message]) -> tuple[list[int], list[Message]]:
        """The prompt of the conversation ``turns`` and the turns it holds: the oldest
        dropped (the system prompt stays) while it leaves the answer less room than it
        may take: ``max_tokens``, or half the context where that is less (a long
        conversation keeps room for a real answer, not one token). ``turns`` is left as
        it is: a message then refused keeps the conversation it came to."""
        tok = self.chain.tokenizer
        wanted = max(1, min(self.max_tokens, self.chain.context // 2))
        ids = chat_prompt(tok, self._messages(turns))
        while self._room(ids) < wanted and len(turns) > 1:  # the question asked stays
            pair = turns[0].role == "user" and turns[1].role == "assistant"
            turns = turns[2:] if pair and len(turns) > 2 else turns[1:]
            ids = chat_prompt(tok, self._messages(turns))
        return ids, turns

    def _room(self, ids: Sequence[int]) -> int:
        """The most tokens an answer to the prompt ``ids`` may have in the context (a run
        takes ``run_positions(prompt, max_tokens)`` positions)."""
        return self.chain.context - max(len(ids), 1) + 1

    def say(self, text: str) -> str | None:
        """One turn: the answer's text (``None`` if the turn failed: it is forgotten, and
        the conversation is as it was before it)."""
        try:
            ids, turns = self._prompt([*self.turns, Message("user", text)])
        except TokenizerError as exc:  # the chat template raised for this conversation
            self.err.write(f"error: {exc}\n")
            return None
        room = self._room(ids)
        if room < 1:
            self.err.write(f"error: the message needs {len(ids)} tokens; the context holds "
                           f"{self.chain.context}\n")  # fmt: skip
            return None
        if len(turns) <= len(self.turns):
            self.err.write("(the conversation outgrew the context: its oldest turn is dropped)\n")
        self.turns = turns
        stream = TextStream(self.chain.tokenizer, self.out)
        runs: list[ChainRun] = []
        try:
            result = self.chain.generate(
                ids,
                max_tokens=min(self.max_tokens, room),
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                seed=self.seed,
                on_token=stream,
                on_run=runs.append,
            ).result
        except KeyboardInterrupt as exc:  # Ctrl-C: the run stops, what it wrote stays
            if not runs or isinstance(exc, Interrupted):  # before the run began, SIGTERM
                self.turns.pop()  # the question is forgotten
                raise
            runs[-1].cancel("stopped by Ctrl-C")
            try:
                result = self.chain.result(runs[-1]).result
            except KeyboardInterrupt:  # a second Ctrl-C stops waiting: no answer to keep
                self.turns.pop()  # (two user turns in a row fail a template that alternates)
                raise
        if result.outcome == "faulted":
            self.out.write("\n")
            self.err.write(f"error: {result.fault}\n")
            self.turns.pop()
            self.chain.recover()
            return None
        stream.finish(result.text)
        if result.outcome == "cancelled":
            self.err.write("(stopped)\n")
        self.turns.append(Message("assistant", result.text))
        return result.text


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m runtime_cupy chat",
        description="Chat with a GGUF model in the terminal, on warm stage processes "
        f"(started and bound once). {HELP}.",
    )
    add_chain_arguments(p)
    p.add_argument("--system", default=None, help="a system prompt")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per answer at most (512)")
    add_sampling_arguments(p)
    return p


def _loop(chat: Chat) -> None:
    while True:
        try:
            line = read_line("> ")  # a signal while readline writes is handled too
        except EOFError:
            print()
            return
        except KeyboardInterrupt as exc:  # at the prompt: a fresh line, as a shell does
            print()
            if isinstance(exc, Interrupted):  # SIGTERM: the chat ends
                raise
            continue
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            return
        if text == "/reset":
            chat.reset()
            print("(a new conversation)", file=sys.stderr)
            continue
        if text.startswith("/") and text.split()[0] in ("/help", "/?"):
            print(HELP, file=sys.stderr)
            continue
        try:
            chat.say(line)
        except KeyboardInterrupt as exc:  # between the run's own handling: the turn is over
            print("\n(stopped)", file=sys.stderr)
            if isinstance(exc, Interrupted):  # SIGTERM: the chat ends
                raise


def _read_any_bytes(stdin: TextIO) -> None:
    """Bytes typed or piped in that are not in the locale's encoding read as U+FFFD, as
    the tokenizer reads invalid UTF-8: under a strict UTF-8 locale they ended the chat
    in a ``UnicodeDecodeError``."""
    if isinstance(stdin, io.TextIOWrapper):
        stdin.reconfigure(errors="replace")


def _edit_lines() -> None:
    """``input()`` through GNU readline where Python has it: in a terminal without it,
    a line is read in canonical mode, and one pasted longer than 4095 bytes was cut
    there without a word."""
    with contextlib.suppress(ImportError):  # without it, the terminal's line editing
        import readline  # noqa: F401 (imported for what it does to input())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_chain_arguments(parser, args)
    configure_logs(args.verbose)
    _read_any_bytes(sys.stdin)
    _edit_lines()
    if args.max_tokens < 1:
        print(f"error: --max-tokens {args.max_tokens} is not at least 1", file=sys.stderr)
        return EXIT_INPUT
    # before any stage starts (a bad --temperature failed the first turn, a traceback)
    sampling = SamplingConfig(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )
    rejection = check_sampling(sampling)
    if rejection is not None:
        print(f"error: {rejection}", file=sys.stderr)
        return EXIT_INPUT
    try:
        chain = chain_from(args)
    except RESOURCE_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except INPUT_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    try:
        chat = Chat(
            chain,
            system=args.system,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
        )
        try:  # before any stage starts (a model without a template failed the first turn)
            chat.check_template()
        except TokenizerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_INPUT
        print(f"starting {stage_processes(args.stages)} of {chain.model_id} ...", file=sys.stderr)
        try:
            chain.start()
        except ChainError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_FAILED
        print(f"ready ({HELP})", file=sys.stderr)
        _loop(chat)
        return 0
    except KeyboardInterrupt as exc:  # Ctrl-C while the stages start, SIGTERM: 130, 143
        print("cancelled", file=sys.stderr)  # as a run says it
        return cancelled_status(signal_of(exc))
    finally:
        chain.close()


if __name__ == "__main__":
    sys.exit(main())
