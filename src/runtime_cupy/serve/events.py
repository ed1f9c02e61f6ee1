"""What a request's sink hears of its run, from the runner's threads: ``Piece`` (more of
the answer's text, as tokens arrive), then ``Finished`` (the whole answer) or ``Failed``
(an HTTP status and an OpenAI error)."""

from __future__ import annotations

from collections.abc import Callable

from attrs import frozen

from runtime_cupy.serve.logprobs import TokenLogprob


@frozen
class Piece:
    """More of the answer's text, and the log probabilities of the tokens taken in since
    the last piece (a request that asks for them)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@frozen
class Finished:
    """The answer is whole: ``finish_reason`` ``stop`` (EOS or a stop string) or
    ``length`` (the token limit)."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    #: Every counted token's log probability (``None``: not asked); the last ``unsent``
    #: of them went out with no piece (a stream sends them with its end).
    logprobs: tuple[TokenLogprob, ...] | None = None
    unsent: int = 0

    @property
    def tail(self) -> tuple[TokenLogprob, ...] | None:
        """The log probabilities no piece carried (``None``: none)."""
        if not self.logprobs or not self.unsent:
            return None
        return self.logprobs[len(self.logprobs) - self.unsent :]


@frozen
class Failed:
    """The request could not be answered: an HTTP status and an OpenAI error;
    ``retry_after_s``: when it is worth asking again (``Retry-After``), where known."""

    status: int
    message: str
    code: str
    type: str = "server_error"
    retry_after_s: int | None = None


Event = Piece | Finished | Failed
Sink = Callable[[Event], None]
