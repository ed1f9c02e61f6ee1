"""``python -m runtime_cupy chat`` driven through a pseudo-terminal, as a person types:

- two turns: the second answer is the one the model gives to the whole conversation
  (the first question, the first answer, the second question) through the chat
  template, which differs from its answer to the second question alone;
- ``/reset`` forgets the conversation; Ctrl-C stops an answer being written and the
  chat goes on; ``/exit`` leaves with status 0 and no stage left behind.

Expected answers are ``runtime_cupy.generate``'s (the chat's worker, greedy, the same
stage count) on the prompt the chat template makes of each conversation.
"""

from __future__ import annotations

import contextlib
import os
import pty
import select
import signal
import sys
import time

import pytest

from runtime_core.tokenizer import Tokenizer
from runtime_cupy import generate
from runtime_cupy.serve.prompts import chat_prompt
from runtime_cupy.serve.requests import Message
from runtime_cupy.workers import DEFAULT_WORKER
from tests.support.hygiene import held_links, wait_gone

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process

if not sys.platform.startswith("linux"):
    pytest.skip("pseudo-terminals as Linux has them", allow_module_level=True)

MAX_TOKENS = 200
WORKER = DEFAULT_WORKER
PROMPT = b"\r\n> "


class Terminal:
    """A program on a pseudo-terminal: what it wrote, and keys typed to it."""

    def __init__(self, argv: list[str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the program, with the terminal as its own
            try:
                # As a shell starts a foreground program: Ctrl-C's signal neither ignored
                # nor blocked, whatever the test process had (an ignored disposition
                # and a blocked mask survive exec, and Python keeps SIGINT ignored then).
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_SETMASK, set())
                os.execv(argv[0], argv)
            finally:
                os._exit(127)
        self.screen = b""

    def read_until(self, marker: bytes, start: int, timeout_s: float = 120.0) -> int:
        """Read until ``marker`` appears at or after ``start``; where it begins."""
        deadline = time.monotonic() + timeout_s
        while (at := self.screen.find(marker, start)) < 0:
            if time.monotonic() > deadline:
                raise AssertionError(f"no {marker!r} after {timeout_s} s in:\n{self.text()}")
            ready, _, _ = select.select([self.fd], [], [], 0.2)
            if ready:
                try:
                    self.screen += os.read(self.fd, 1 << 16)
                except OSError:  # the program is gone
                    raise AssertionError(f"the program ended:\n{self.text()}") from None
        return at

    def type(self, keys: bytes) -> int:
        """Type ``keys``; where what they bring begins on the screen."""
        start = len(self.screen)
        os.write(self.fd, keys)
        return start

    def say(self, line: str) -> str:
        """Type a line and read the answer up to the next prompt."""
        start = self.type(line.encode() + b"\r")
        echoed = self.read_until(line.encode() + b"\r\n", start) + len(line) + 2
        end = self.read_until(PROMPT, echoed)
        return self.screen[echoed:end].decode(errors="replace").replace("\r\n", "\n")

    def text(self) -> str:
        return self.screen.decode(errors="replace")

    def wait(self, timeout_s: float = 60.0) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                ready, _, _ = select.select([self.fd], [], [], 0.2)
                if ready:
                    self.screen += os.read(self.fd, 1 << 16)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        os.close(self.fd)
        raise AssertionError(f"the chat did not exit:\n{self.text()}")


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (the chat's stage processes), from /proc."""
    found: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(c) for c in f.read().split()]
    return found


def answer(model: str, tok: Tokenizer, turns: list[tuple[str, str]]) -> str:
    ids = chat_prompt(tok, [Message(role, text) for role, text in turns])
    result = generate(model, ids, stages=2, max_tokens=MAX_TOKENS, worker=WORKER)
    assert result.outcome == "completed", result.fault
    return result.text


def test_a_conversation_in_the_terminal(tiny_chat: str) -> None:
    tok = Tokenizer.from_gguf(tiny_chat)
    first = answer(tiny_chat, tok, [("user", "hello")])
    second = answer(tiny_chat, tok, [("user", "hello"), ("assistant", first), ("user", "again")])
    alone = answer(tiny_chat, tok, [("user", "again")])
    assert second != alone, "the test needs turns whose answer depends on the history"
    story = chat_prompt(tok, [Message("user", "Tell me a story.")])
    long = generate(tiny_chat, story, stages=2, max_tokens=MAX_TOKENS, worker=WORKER)
    assert len(long.tokens) == MAX_TOKENS, "the test needs an answer long enough to stop"

    argv = [sys.executable, "-m", "runtime_cupy", "chat", "--model", tiny_chat,
            "--stages", "2", "--worker", WORKER, "--max-tokens", str(MAX_TOKENS)]  # fmt: skip
    term = Terminal(argv)
    try:
        term.read_until(b"> ", 0)
        assert term.say("hello") == first
        assert term.say("again") == second
        start = term.type(b"/reset\r")
        term.read_until(PROMPT, term.read_until(b"a new conversation", start))
        assert term.say("again") == alone
        # Ctrl-C while an answer is being written: it stops, the chat goes on.
        start = term.type(b"/reset\r")
        term.read_until(PROMPT, term.read_until(b"a new conversation", start))
        start = term.type(b"Tell me a story.\r")
        echoed = term.read_until(b"story.\r\n", start) + len(b"story.\r\n")
        term.read_until(long.text[:1].encode(), echoed)
        term.type(b"\x03")
        term.read_until(b"(stopped)", echoed)
        end = term.read_until(PROMPT, echoed)
        cut = term.screen[echoed:end].decode(errors="replace").replace("\r\n", "\n")
        assert "(stopped)" in cut
        written = cut.split("(stopped)")[0].replace("^C", "").rstrip("\n")  # ^C: the echo
        assert 0 < len(written) < len(long.text) and long.text.startswith(written)
        assert term.say("hello") != ""  # still chatting (after the story and its stop)
        term.type(b"/exit\r")
        assert term.wait() == 0
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(term.pid, signal.SIGKILL)
            os.waitpid(term.pid, 0)


def test_sigterm_at_the_prompt_says_cancelled(tiny_chat: str) -> None:
    """SIGTERM ends the chat with ``cancelled`` on its last line, as a run says it, and
    exit 143 (it ended with no word). Sent once the prompt waits for a key (one that
    comes while readline writes: the next test)."""
    argv = [sys.executable, "-m", "runtime_cupy", "chat", "--model", tiny_chat,
            "--stages", "2", "--worker", WORKER, "--max-tokens", "8"]  # fmt: skip
    term = Terminal(argv)
    try:
        term.read_until(b"> ", 0)
        time.sleep(0.5)  # readline in its select() by now
        os.kill(term.pid, signal.SIGTERM)
        assert term.wait() == 143, term.text()
        assert term.text().rstrip().splitlines()[-1] == "cancelled", term.text()
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(term.pid, signal.SIGKILL)
            os.waitpid(term.pid, 0)


def test_sigterm_that_readline_was_writing_through_ends_the_chat(tiny_chat: str) -> None:
    """SIGTERM that comes while readline is not waiting for a key but writing (the echo
    of a key, to a terminal whose output Ctrl-S holds): the chat still ends at once, exit
    143, its stages gone, with no key typed after. The signal interrupted the write, and
    the chat then waited for the Enter key (CPython's readline handles a signal only
    when its wait for a key is interrupted)."""
    argv = [sys.executable, "-m", "runtime_cupy", "chat", "--model", tiny_chat,
            "--stages", "2", "--worker", WORKER, "--max-tokens", "8"]  # fmt: skip
    term = Terminal(argv)
    try:
        term.read_until(b"> ", 0)
        stages = children(term.pid)
        assert len(stages) == 2, stages
        time.sleep(0.5)  # readline in its select() by now
        term.type(b"\x13")  # Ctrl-S: the terminal holds the output
        time.sleep(0.2)
        term.type(b"h")  # readline's echo of it waits for the terminal
        time.sleep(0.5)
        os.kill(term.pid, signal.SIGTERM)
        time.sleep(0.5)
        term.type(b"\x11")  # Ctrl-Q: the output goes on (the terminal takes the key)
        assert term.wait(20) == 143, term.text()
        assert term.text().rstrip().splitlines()[-1] == "cancelled", term.text()
        assert not wait_gone(stages, 10.0), "stage processes outlived the chat"
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(term.pid, signal.SIGKILL)
            os.waitpid(term.pid, 0)


def test_a_closed_terminal_leaves_no_stage_and_no_resource_behind(tiny_chat: str) -> None:
    """The terminal goes away under the chat (a closed window, a dropped ssh session): the
    kernel hangs up its session, SIGHUP to the chat and its stage processes. The stages
    end as on a lost orchestrator, freeing the rings and folders they made; before, SIGHUP's
    default ended them at once and left those in /dev/shm and /tmp."""
    argv = [sys.executable, "-m", "runtime_cupy", "chat", "--model", tiny_chat,
            "--stages", "2", "--worker", WORKER, "--max-tokens", "8"]  # fmt: skip
    term = Terminal(argv)
    try:
        term.read_until(b"> ", 0)
        assert term.say("hello") != ""  # a run went through: every link is made
        stages = children(term.pid)
        assert len(stages) == 2, stages
        held = held_links(stages)
        assert held, "the stages hold their links' resources"
        os.kill(term.pid, signal.SIGKILL)  # the session leader gone: the terminal hangs up
        os.waitpid(term.pid, 0)
        os.close(term.fd)
        deadline = time.monotonic() + 30
        while any(os.path.exists(f"/proc/{pid}") for pid in stages):
            assert time.monotonic() < deadline, "the stages did not end"
            time.sleep(0.1)
        left = sorted(p for p in held if os.path.exists(p))
        assert left == [], left
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(term.pid, signal.SIGKILL)
            os.waitpid(term.pid, 0)
