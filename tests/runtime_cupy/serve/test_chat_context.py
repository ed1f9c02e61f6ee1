"""``python -m runtime_cupy chat``'s conversation against the context (``cli.chat.Chat``),
on a stand-in chain and a prompt of one token per character of each message: a long
conversation drops its oldest turns while the answer would have less room than it may
take (``--max-tokens``, or half the context where that is less), keeps the system
prompt, and the answer is asked for at most the room that is left."""

from __future__ import annotations

import io
import os
import pty
import select
import sys
import time
from collections.abc import Sequence
from typing import Any

import attrs
import pytest

from runplan.config import run_positions
from runplan.interrupted import Interrupted
from runtime_core.chat import ChatTemplateError, NoChatTemplate
from runtime_cupy.cli import chat as chat_cli
from runtime_cupy.serve.requests import Message


@attrs.frozen
class _Result:
    outcome: str
    text: str
    fault: str | None = None


@attrs.frozen
class _Run:
    result: _Result


class _Chain:
    """A chain of ``context`` positions that answers ``ANSWER`` and records each prompt's
    length and ``max_tokens``."""

    ANSWER = "ok"

    def __init__(self, context: int) -> None:
        self.context = context
        self.tokenizer: Any = None
        self.asked: list[tuple[int, int]] = []

    def generate(self, ids: Sequence[int], *, max_tokens: int, **_: object) -> _Run:
        assert run_positions(len(ids), max_tokens) <= self.context
        self.asked.append((len(ids), max_tokens))
        return _Run(_Result("completed", self.ANSWER))


def _one_token_a_character(tokenizer: object, messages: Sequence[Message]) -> list[int]:
    return [0] * sum(len(m.content) for m in messages)


@pytest.fixture(autouse=True)
def _prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_cli, "chat_prompt", _one_token_a_character)
    monkeypatch.setattr(chat_cli, "TextStream", _Stream)


class _Stream:
    def __init__(self, tokenizer: object, out: io.StringIO) -> None:
        self.out = out

    def __call__(self, token_id: int) -> None:
        pass

    def finish(self, text: str) -> None:
        self.out.write(text + "\n")


def _chat(context: int, max_tokens: int, system: str | None = None) -> tuple[Any, _Chain]:
    chain = _Chain(context)
    err = io.StringIO()
    chat = chat_cli.Chat(chain, system=system, max_tokens=max_tokens, out=io.StringIO(), err=err)
    return chat, chain


def test_old_turns_go_while_the_answer_has_less_room_than_max_tokens() -> None:
    """Context 100, answers of up to 20 tokens: a prompt of at most 81 tokens leaves
    them their room; beyond, the oldest turn (a question and its answer) goes."""
    chat, chain = _chat(100, 20, system="s" * 10)
    assert chat.say("a" * 30) == _Chain.ANSWER  # 10 + 30 = 40
    assert chat.say("b" * 30) == _Chain.ANSWER  # 40 + 2 + 30 = 72
    assert chain.asked == [(40, 20), (72, 20)]
    assert chat.say("c" * 9) == _Chain.ANSWER  # 72 + 2 + 9 = 83: room 18 < 20
    # the first question and its answer dropped: 10 + 30 + 2 + 9 = 51, the system kept
    assert chain.asked[-1] == (51, 20)
    assert [m.content[0] for m in chat.turns] == ["b", "o", "c", "o"]
    assert "oldest turn is dropped" in chat.err.getvalue()


def test_a_prompt_that_leaves_two_tokens_of_room_drops_a_turn_for_a_real_answer() -> None:
    """A prompt that leaves the answer two positions once kept the conversation and
    asked for a two-token answer."""
    chat, chain = _chat(64, 512)
    chat.say("a" * 20)
    chat.say("b" * 41)  # 20 + 2 + 41 = 63 positions: two tokens of room
    assert chain.asked[-1] == (41, 24)  # the first turn dropped: room 64 - 41 + 1


def test_the_wanted_room_is_half_the_context_when_max_tokens_is_more() -> None:
    chat, chain = _chat(64, 10_000)
    chat.say("a" * 10)
    chat.say("b" * 20)  # 10 + 2 + 20 = 32: room 33 >= 32, kept
    assert chain.asked[-1] == (32, 33)
    chat.say("c" * 3)  # 32 + 2 + 3 = 37: room 28 < 32, the first turn goes
    assert chain.asked[-1] == (25, 40)


def test_a_lone_message_longer_than_the_room_wanted_still_runs_with_what_is_left() -> None:
    chat, chain = _chat(64, 32)
    assert chat.say("a" * 60) == _Chain.ANSWER
    assert chain.asked == [(60, 5)]


class _Interrupted(_Chain):
    """Ctrl-C while the answer streams (``at_run``: after the run began) or before."""

    def __init__(
        self, context: int, *, at_run: bool, signal: KeyboardInterrupt | None = None
    ) -> None:
        super().__init__(context)
        self.at_run = at_run
        self.signal = signal or KeyboardInterrupt()
        self.cancelled: list[str] = []

    def generate(self, ids: Sequence[int], *, max_tokens: int, **kw: Any) -> _Run:
        if self.at_run:
            kw["on_run"](self)
        raise self.signal

    def cancel(self, why: str) -> None:
        self.cancelled.append(why)

    def result(self, run: object) -> _Run:
        assert run is self and self.cancelled
        return _Run(_Result("cancelled", "half an"))


def test_ctrl_c_while_the_answer_streams_stops_the_run_and_keeps_what_it_wrote() -> None:
    chain = _Interrupted(64, at_run=True)
    chat = chat_cli.Chat(chain, max_tokens=16, out=io.StringIO(), err=io.StringIO())
    assert chat.say("a question") == "half an"
    assert chain.cancelled == ["stopped by Ctrl-C"]  # the run does not go on
    assert [(m.role, m.content) for m in chat.turns] == [
        ("user", "a question"),
        ("assistant", "half an"),
    ]
    assert "(stopped)" in chat.err.getvalue()


def test_ctrl_c_before_the_run_began_forgets_the_question() -> None:
    chain = _Interrupted(64, at_run=False)
    chat = chat_cli.Chat(chain, max_tokens=16, out=io.StringIO(), err=io.StringIO())
    with pytest.raises(KeyboardInterrupt):
        chat.say("a question")
    assert chat.turns == [] and chain.cancelled == []


def test_sigterm_while_the_answer_streams_ends_the_chat() -> None:
    """SIGTERM (``Interrupted``, which each ``__main__`` raises for it) is no Ctrl-C to
    shrug off: it goes up (the chat's ``main`` closes the chain, exit 143), the
    question forgotten."""
    chain = _Interrupted(64, at_run=True, signal=Interrupted("SIGTERM"))
    chat = chat_cli.Chat(chain, max_tokens=16, out=io.StringIO(), err=io.StringIO())
    with pytest.raises(Interrupted):
        chat.say("a question")
    assert chat.turns == []


@pytest.mark.parametrize("where", ["at the prompt", "during an answer"])
def test_sigterm_ends_the_chat_loop_where_ctrl_c_goes_on(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = iter(["a question", "/exit"])

    def typed(_prompt: str) -> str:
        if where == "at the prompt":
            raise Interrupted("SIGTERM")
        return next(lines)

    class Saying:
        def say(self, line: str) -> None:
            raise Interrupted("SIGTERM")

    monkeypatch.setattr("builtins.input", typed)
    with pytest.raises(Interrupted):
        chat_cli._loop(Saying())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("flags", "needle"),
    [(["--temperature", "-1"], "sampling.temperature"), (["--top-p", "0"], "sampling.top_p"),
     (["--seed", "-1"], "sampling.seed"), (["--temperature", "nan"], "sampling.temperature"),
     (["--top-k", "4294967296"], "sampling.top_k = 4294967296: must be in 0..4294967295 (0: off)"),
     (["--top-k", "-1"], "must be in 0..4294967295 (0: off)")],
)  # fmt: skip
def test_a_bad_sampling_flag_is_refused_before_any_stage_starts(
    flags: list[str], needle: str, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    """It once started the stages and failed the first turn with a traceback."""

    def no_chain(args: Any) -> None:
        raise AssertionError("a chain was made")

    monkeypatch.setattr(chat_cli, "chain_from", no_chain)
    assert chat_cli.main(["--worker", "cpu", *flags]) == chat_cli.EXIT_INPUT == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines


def test_the_sampling_flags_help_names_their_defaults() -> None:
    text = " ".join(chat_cli.build_parser().format_help().split())
    assert "keep the k likeliest (0: off, the default)" in text
    assert "nucleus mass (1: off, the default)" in text


def test_the_question_asked_is_never_dropped() -> None:
    """A turn left without its answer (a user turn first) is dropped alone, not with the
    question after it."""
    chat, chain = _chat(64, 32)
    chat.turns = [Message("user", "x" * 30)]
    assert chat.say("b" * 30) == _Chain.ANSWER  # 60 positions: the first turn goes alone
    assert chain.asked == [(30, 32)]
    assert [m.content[0] for m in chat.turns] == ["b", "o"]


def test_a_message_longer_than_the_context_is_refused_and_forgotten() -> None:
    chat, chain = _chat(64, 32)
    assert chat.say("a" * 65) is None
    assert chain.asked == [] and chat.turns == []
    assert "needs 65 tokens; the context holds 64" in chat.err.getvalue()


def test_a_refused_message_keeps_the_conversation_it_came_to() -> None:
    """The oldest turns were dropped for good while room was sought for a message that
    was then refused: the model forgot the whole conversation."""
    chat, chain = _chat(64, 32)
    assert chat.say("a" * 20) == _Chain.ANSWER
    assert chat.say("b" * 70) is None  # longer than the context, whatever is dropped
    assert [(m.role, m.content) for m in chat.turns] == [("user", "a" * 20), ("assistant", "ok")]
    assert "oldest turn" not in chat.err.getvalue()
    assert chat.say("c" * 5) == _Chain.ANSWER
    assert chain.asked[-1] == (27, 32)  # 20 + 2 + 5: the first turn is still there


def test_a_chat_template_that_raises_forgets_the_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """A template's error went up through the chat's loop, a traceback."""

    def alternate(tokenizer: object, messages: Sequence[Message]) -> list[int]:
        if len(messages) > 1 and messages[-1].role == messages[-2].role:
            raise ChatTemplateError("Conversation roles must alternate user/assistant")
        return [0] * sum(len(m.content) for m in messages)

    monkeypatch.setattr(chat_cli, "chat_prompt", alternate)
    chat, chain = _chat(64, 16)
    chat.turns = [Message("user", "left without an answer")]
    assert chat.say("a question") is None
    assert "error: Conversation roles must alternate" in chat.err.getvalue()
    assert chain.asked == [] and [m.content for m in chat.turns] == ["left without an answer"]


class _InterruptedTwice(_Interrupted):
    def result(self, run: object) -> _Run:
        raise KeyboardInterrupt  # while the cancelled run is awaited


def test_a_second_ctrl_c_forgets_the_question_left_without_an_answer() -> None:
    """It kept the question: the next one followed it, two user turns in a row, which a
    template whose roles alternate (Gemma's) refuses."""
    chain = _InterruptedTwice(64, at_run=True)
    chat = chat_cli.Chat(chain, max_tokens=16, out=io.StringIO(), err=io.StringIO())
    chat.turns = [Message("user", "first"), Message("assistant", "ok")]
    with pytest.raises(KeyboardInterrupt):
        chat.say("a question")
    assert chain.cancelled == ["stopped by Ctrl-C"]
    assert [m.content for m in chat.turns] == ["first", "ok"]


class _NoTemplate:
    def apply_chat_template(self, *args: object, **kwargs: object) -> str:
        raise NoChatTemplate("m.gguf")


def test_a_model_without_a_chat_template_is_refused_before_its_stages_start(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stages started, and the first message ended the chat in a traceback."""

    class Unstarted(_Chain):
        closed = False

        def start(self) -> None:
            raise AssertionError("the stages started")

        def close(self) -> None:
            self.closed = True

    chain = Unstarted(64)
    chain.tokenizer = _NoTemplate()
    monkeypatch.setattr(chat_cli, "chain_from", lambda args: chain)
    assert chat_cli.main(["--worker", "cpu"]) == chat_cli.EXIT_INPUT
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "m.gguf: the file has no chat template" in lines[0], lines
    assert chain.closed


class _Templated:
    def apply_chat_template(self, *args: object, **kwargs: object) -> str:
        return ""


def test_bytes_not_in_utf_8_on_stdin_are_read_as_replacement_characters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under a strict UTF-8 locale, ``input()`` raised ``UnicodeDecodeError`` for them:
    the chat ended in a traceback."""

    class Started(_Chain):
        model_id = "m"

        def start(self) -> None:
            pass

        def close(self) -> None:
            pass

    chain = Started(64)
    chain.tokenizer = _Templated()
    said: list[str] = []

    def prompt(tokenizer: object, messages: Sequence[Message]) -> list[int]:
        said.append(messages[-1].content)
        return [0]

    monkeypatch.setattr(chat_cli, "chain_from", lambda args: chain)
    monkeypatch.setattr(chat_cli, "chat_prompt", prompt)
    piped = io.TextIOWrapper(io.BytesIO(b"Hi\n\xff\xfe hello\n"), encoding="utf-8")
    monkeypatch.setattr("sys.stdin", piped)
    assert chat_cli.main(["--worker", "cpu"]) == 0
    assert said == ["Hi", "\ufffd\ufffd hello"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="a pseudo-terminal needs fork")
def test_a_line_longer_than_the_terminal_s_own_buffer_is_read_whole() -> None:
    """In a terminal, ``input()`` without readline reads in canonical mode: a pasted line
    past 4095 bytes was cut there without a word."""
    script = (
        "from runtime_cupy.cli.chat import _edit_lines\n"
        "_edit_lines()\n"
        "print('GOT', len(input('> ')))\n"
    )
    pid, fd = pty.fork()
    if pid == 0:  # the child: the chat's reading of a line, on the pseudo-terminal
        os.execv(sys.executable, [sys.executable, "-c", script])
    try:
        out = b""
        deadline = time.monotonic() + 30
        for end in (b"> ", b"GOT"):  # the prompt (reading has begun), then the length
            while end not in out or not out.endswith((b"> ", b"\n")):
                assert time.monotonic() < deadline, out[-200:]
                if select.select([fd], [], [], 0.2)[0]:
                    out += os.read(fd, 65536)
            if end == b"> ":
                os.write(fd, b"ab " * 1700 + b"\n")  # 5101 bytes
    finally:
        os.waitpid(pid, 0)
    assert b"GOT 5100" in out, out[-200:]
