"""Requests to prompts: ``prepare(chain, request)`` turns a checked request into a prompt
(the model's chat template over the messages, or the completion's text or ids), its token
limit and its seed, refusing what the context cannot hold (``RequestError``): a text is
first measured against the context by its size (``Tokenizer.min_token_count``), so one too
long is refused without being tokenized; the server calls it in a thread, and the
tokenizer lets go of the interpreter while it merges, so the event loop goes on. Each
choice of a request (``Prepared.choices``) is a run of its own, with its own seed
(``choice_seed``)."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
from attrs import frozen

from runtime_core.chat import ChatTemplateError, NoChatTemplate
from runtime_core.runs import run_seed
from runtime_core.tokenizer import Tokenizer
from runtime_cupy.serve.requests import CompletionRequest, Message, RequestError

if TYPE_CHECKING:
    from runtime_cupy.serve.chain import WarmChain

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def chat_text(tokenizer: Tokenizer, messages: Sequence[Message]) -> str:
    """The text of a conversation: the model's chat template over it, with the
    assistant's turn opened. A message's ``name``, where given, is the template's to use
    (as Hugging Face's ``apply_chat_template`` hands it on; most templates ignore it)."""
    return tokenizer.apply_chat_template(
        [
            {"role": m.role, "content": m.content}
            | ({"name": m.name} if m.name is not None else {})
            for m in messages
        ],
        add_generation_prompt=True,
    )


def chat_prompt(tokenizer: Tokenizer, messages: Sequence[Message]) -> list[int]:
    """The prompt of a conversation, as ``python -m runtime_cupy --chat`` encodes it."""
    return tokenizer.encode_chat(chat_text(tokenizer, messages))


@frozen
class Prepared:
    """A request (one of its choices) ready to run."""

    request: CompletionRequest
    prompt_ids: tuple[int, ...]
    max_tokens: int
    seed: int
    index: int = 0  # the choice

    def choices(self) -> tuple[Prepared, ...]:
        """One per choice the request asks for (``n``), each with its seed
        (``choice_seed``)."""
        return tuple(
            attrs.evolve(self, index=i, seed=choice_seed(self.seed, i))
            for i in range(self.request.n)
        )


def choice_seed(seed: int, index: int) -> int:
    """The sampler's seed of choice ``index`` of a request of ``seed`` (its own, or a
    random one when it gave none): ``seed + index`` modulo 2**64, so choice 0 samples
    what the same request with ``n = 1`` samples, and each choice its own stream
    (``runtime_core.runs.run_seed``, as ``runtime_sim``'s ``--runs``)."""
    return run_seed(seed, index)


def prepare(chain: WarmChain, request: CompletionRequest) -> Prepared:
    """The prompt, token limit and seed of ``request`` on ``chain``; ``RequestError`` for
    what the model or its context cannot take."""
    tok = chain.tokenizer
    if request.logprobs is not None and not chain.logprobs:
        raise RequestError(
            "logprobs: this server was started without --logprobs (its tokens come "
            "without the model's logits)",
            param="logprobs",
            code="unsupported_parameter",
        )
    param = "messages" if request.endpoint == "chat" else "prompt"
    context = chain.context
    if request.endpoint == "chat":
        try:
            text = chat_text(tok, request.messages)
        except NoChatTemplate:
            raise RequestError(
                f"the model {chain.model_id!r} has no chat template: use /v1/completions",
                param="messages",
                code="no_chat_template",
            ) from None
        except ChatTemplateError as exc:
            raise RequestError(
                f"the chat template refused the messages: {exc}", param="messages"
            ) from None
        _check_size(chain, text, param)
        ids = tok.encode_chat(text)
    elif isinstance(request.prompt, str):
        _check_size(chain, request.prompt, param)
        ids = tok.encode(request.prompt, add_special=True, parse_special=True)
    else:
        ids = list(request.prompt)
        vocab = len(tok.vocab.tokens)
        for i, token in enumerate(ids):
            if token >= vocab:
                where = f"{request.prompt_param}[{i}]"
                raise RequestError(
                    f"{where} is {token}, outside the vocabulary 0..{vocab - 1}",
                    param=where,
                    code="invalid_value",
                )
    if not ids:
        raise RequestError(f"{param} holds no tokens", param=param, code="invalid_value")
    if len(ids) > context:
        raise RequestError(
            f"This model's maximum context length is {context} tokens; the prompt "
            f"({param}) holds {len(ids)}",
            param=param,
            code="context_length_exceeded",
        )
    room = context - len(ids) + 1  # the last token generated needs no position
    limit = request.max_tokens
    if limit is None:
        limit = room if request.endpoint == "chat" else min(room, COMPLETION_MAX_TOKENS)
    elif limit > room:
        raise RequestError(
            f"{request.max_tokens_param} is {limit}; this model's maximum context length "
            f"is {context} tokens and the prompt ({param}) holds {len(ids)}, which "
            f"leaves room for {room}",
            param=request.max_tokens_param,
            code="context_length_exceeded",
        )
    seed = request.seed if request.seed is not None else secrets.randbits(64)
    return Prepared(request, tuple(ids), limit, seed)


def _check_size(chain: WarmChain, text: str, param: str) -> None:
    """Refuse, before tokenizing it, a text that holds more tokens than the context
    whatever they are: its bytes over ``context * longest_token_bytes``, those that may
    come out as no token not counted (``Tokenizer.min_token_count``)."""
    tok, context = chain.tokenizer, chain.context
    fewest = tok.min_token_count(text)
    if fewest > context:
        limit = context * tok.longest_token_bytes
        size = len(text.encode("utf-8", "surrogatepass"))
        raise RequestError(
            f"This model's maximum context length is {context} tokens; the prompt "
            f"({param}) holds at least {fewest}: it has {size} bytes, and a prompt "
            f"over {limit} bytes ({context} tokens of at most {tok.longest_token_bytes} "
            "bytes; bytes that may come out as no token not counted) is refused before it "
            "is tokenized",
            param=param,
            code="context_length_exceeded",
        )
