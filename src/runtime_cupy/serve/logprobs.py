"""Log probabilities of an answer's tokens, as OpenAI's APIs show them.

A token's log probability is the log-softmax of the model's raw logits at its step
(before temperature, top-k and top-p: what the model gives, whatever the sampler then
did), computed in float64; its alternatives are the ``top`` most likely tokens of that
step, the most likely first (the lower id first on a tie). The chain hands the logits
over token by token (``WarmChain.generate``'s ``on_logits``) and keeps none.

- ``/v1/chat/completions`` (``logprobs: true``, ``top_logprobs`` 0-20):
  ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``;
- ``/v1/completions`` (``logprobs`` 0-5): ``{"tokens", "token_logprobs",
  "top_logprobs": [{token: logprob}, ...], "text_offset"}``.

A token's text is the bytes it stands for (special tokens as written), read as UTF-8;
a token whose bytes are not whole characters (part of an emoji's) is named by its bytes,
as OpenAI names it: ``bytes:\\xf0\\x9f`` (``bytes`` holds them too). Read as UTF-8,
every such token was U+FFFD: a completion's ``top_logprobs``, keyed by text, kept one
of them, the least likely one's value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
from attrs import frozen

from runtime_core.tokenizer import Tokenizer


@frozen
class TokenLogprob:
    """One generated token's log probability and its step's ``top`` alternatives
    (``(token_id, logprob)``, the most likely first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    #: where the token's text begins in the answer, in characters (a completion's
    #: ``text_offset``): the text decoded before it, an incomplete UTF-8 sequence at
    #: its end left out, so a token that ends inside a character does not move it
    offset: int = 0


def token_logprob(logits: npt.NDArray[np.float32], token_id: int, top: int) -> TokenLogprob:
    """``token_id``'s log probability under ``logits`` (one step's raw logits) and the
    ``top`` most likely tokens'."""
    z = np.asarray(logits, np.float32)  # float64 for the sum; a float32's order is its own
    peak = float(np.max(z))
    lse = peak + float(np.log(np.sum(np.exp(z.astype(np.float64) - peak))))
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        k = min(top, z.size)
        kth = np.partition(z, z.size - k)[z.size - k]  # the k-th largest
        ids = np.flatnonzero(z >= kth)  # every tie at the edge, then the lower ids first
        order = sorted(ids.tolist(), key=lambda i: (-z[i], i))[:k]
        best = tuple((int(i), float(z[i]) - lse) for i in order)
    return TokenLogprob(int(token_id), float(z[token_id]) - lse, best)


def _text(tokenizer: Tokenizer, token_id: int) -> tuple[str, bytes]:
    """A token's name (its text, or ``bytes:\\x..`` where its bytes are not whole
    characters) and its bytes."""
    data = tokenizer.token_bytes(token_id, special=True)
    try:
        return data.decode("utf-8"), data
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data), data


def _chat_entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    text, data = _text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(data)}


def chat_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's (or chunk's) ``logprobs`` object."""
    return {
        "content": [
            {
                **_chat_entry(tokenizer, e.token_id, e.logprob),
                "top_logprobs": [_chat_entry(tokenizer, i, lp) for i, lp in e.top],
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A completion choice's (or chunk's) ``logprobs`` object."""
    return {
        "tokens": [_text(tokenizer, e.token_id)[0] for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [_top_by_name(tokenizer, e.top) for e in entries],
        "text_offset": [e.offset for e in entries],
    }


class AnswerLogprobs:
    """One answer's log probabilities as its tokens come (the runner's thread): the
    chain hands each token's logits to ``logits``, then ``token`` keeps the token's
    entry; ``take`` gives the entries no piece of text carried yet. ``top`` ``None``: the
    request asked for none, and nothing is computed."""

    def __init__(self, top: int | None) -> None:
        self.top = top
        self.entries: list[TokenLogprob] = []
        self.sent = 0
        self._logits: npt.NDArray[np.float32] | None = None

    def logits(self, logits: npt.NDArray[np.float32]) -> None:
        self._logits = logits

    def token(self, token_id: int, offset: int = 0) -> None:
        """The entry of ``token_id``, whose text begins ``offset`` characters into the
        answer (``TokenLogprob.offset``)."""
        if self.top is not None and self._logits is not None:
            entry = token_logprob(self._logits, token_id, self.top)
            self.entries.append(attrs.evolve(entry, offset=offset))
            self._logits = None

    def take(self, limit: int | None = None) -> tuple[TokenLogprob, ...]:
        """The entries not sent yet, of the first ``limit`` (all: ``None``)."""
        end = len(self.entries) if limit is None else min(limit, len(self.entries))
        out = tuple(self.entries[self.sent : end])
        self.sent = max(self.sent, end)
        return out

    def counted(self, tokens: int) -> tuple[tuple[TokenLogprob, ...] | None, int]:
        """The entries of the answer's ``tokens`` counted tokens (``None``: not asked),
        and how many of them no piece carried."""
        if self.top is None:
            return None, 0
        kept = tuple(self.entries[:tokens])
        return kept, max(0, len(kept) - self.sent)


def _top_by_name(tokenizer: Tokenizer, top: Sequence[tuple[int, float]]) -> dict[str, float]:
    """A completion step's alternatives keyed by name, the most likely first: two tokens
    of the same bytes (a SentencePiece byte token beside the normal token of that byte)
    share a name, and the more likely one's value stands (it was the less likely one's)."""
    out: dict[str, float] = {}
    for token_id, logprob in top:
        out.setdefault(_text(tokenizer, token_id)[0], logprob)
    return out
