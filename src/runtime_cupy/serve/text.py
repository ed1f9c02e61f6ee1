"""The text of an answer as it streams: tokens to text pieces (``IncrementalText``),
cut at the first stop string (``StopStrings``).

``Answer`` is what the runner keeps per request: ``push(token)`` gives the text to send
now (nothing that could still turn out to be the start of a stop string, and nothing
past one), ``finish(final_text)`` what is left once the run ends. The pieces sent add
up to the answer's text, which ends before the first stop string (OpenAI's rule: the
stop string itself is not returned).
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime_core.console import IncrementalText
from runtime_core.tokenizer import Tokenizer


class StopStrings:
    """Cuts a stream of text before the first occurrence of any of ``stops``. Text is
    held back while its end could be the beginning of a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of ``text`` (after what is pending) that is safe to send."""
        if self.stopped or not text:
            return ""
        if not self.stops:
            return text
        buffer = self.pending + text
        cut = min((i for i in (buffer.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.pending = ""
            return buffer[:cut]
        keep = self._held(buffer)
        self.pending = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def holds_stop(self, text: str) -> bool:
        """Whether what is pending and then ``text`` hold a stop string."""
        buffer = self.pending + text
        return not self.stopped and any(s in buffer for s in self.stops)

    def _held(self, buffer: str) -> int:
        """The length of the longest end of ``buffer`` that begins a stop string."""
        longest = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buffer)), longest, -1):
                if buffer.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def flush(self) -> str:
        """What is pending, once nothing more comes (it was no stop string)."""
        rest, self.pending = ("" if self.stopped else self.pending), ""
        return rest


class Answer:
    """One answer's text: tokens in, pieces to send out, cut at a stop string. It goes
    on from its prompt, as llama.cpp's server answers, a completion and a chat answer
    alike: each token's piece with the space before it (a SentencePiece vocabulary's
    first token included: ``" fox"`` after ``"The quick brown"``), so that an echoed
    prompt and its answer do not run together and a stop string may begin with that
    space (``IncrementalText``'s ``continues``)."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.text = IncrementalText(tokenizer, continues=True)
        self.stops = StopStrings(stops)
        self.sent: list[str] = []
        self.tokens = 0  # tokens taken in before the answer stopped

    @property
    def stopped(self) -> bool:
        """A stop string came: the run can end."""
        return self.stops.stopped

    def push(self, token_id: int) -> str:
        if self.stops.stopped:
            return ""
        self.tokens += 1
        piece = self.stops.feed(self.text.push(token_id))
        # The whitespace the text holds back may end a stop string ("\n") already.
        if self.stops.holds_stop(self.text.held):
            piece += self.stops.feed(self.text.held)
        if piece:
            self.sent.append(piece)
        return piece

    def finish(self, tokens: Sequence[int] | None = None) -> str:
        """The rest to send once the run is over; ``tokens``: every generated token
        (``None``: the run was cut short, keep what came)."""
        rest = ""
        if tokens is not None and not self.stops.stopped:
            tail = self.text.finish(self.tokenizer.decode(tokens, continues=True))
            rest = self.stops.feed(tail or "")
        rest += self.stops.flush()
        if rest:
            self.sent.append(rest)
        return rest

    @property
    def content(self) -> str:
        return "".join(self.sent)
