"""Offline batches (vLLM's ``LLM.generate(prompts)`` habit): many prompts over one
chain, up to ``max_concurrent`` prompts in flight at once (the rest wait for room, first
given, first started), each result yielded as it completes.

``generate_batch(model, prompts, ...)`` starts a chain of ``stages`` stage processes
(``serve.chain.WarmChain``, its cache length the longest prompt plus ``max_tokens - 1``,
its KV budget for ``max_concurrent`` such runs: by default every prompt up to
``DEFAULT_BATCH_RUNS``, halved until the planner finds the hosts' memory holds their
caches, so that a file of many prompts runs on a host that cannot hold them all at
once; a ``max_concurrent`` given is taken as it is, or refused), hands it
every prompt as a run of its own, and yields ``(index, GenerateResult)`` in the order
the runs end; the chain is closed (every process reaped, every link freed) when the
iterator is exhausted or closed. Each run samples with its own sampler from ``seed``
(two equal prompts with equal settings give equal tokens). ``python -m runtime_cupy
--prompts-file FILE.jsonl`` is its command line (``cli.prompts_file``).
"""

from __future__ import annotations

import itertools
import os
import queue
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import TYPE_CHECKING

from runplan import ModelFacts, SamplingConfig, model_facts_from_gguf
from runplan.config import run_positions
from runplan.facts import context_limit
from runplan.models import resolve_model
from runplan.picklable_error import PicklableError
from runplan.rejections import InsufficientMemory
from runtime_core.runs import PlanRejected, token_id
from runtime_cupy.api import GenerateResult, LoadProgress
from runtime_cupy.process.chain_run import ChainRun
from runtime_cupy.serve.chain import WarmChain
from runtime_cupy.workers import DEFAULT_WORKER

if TYPE_CHECKING:
    from runtime_cupy.slices.server import StageTransfer

#: Prompts in flight at once by default (fewer where the hosts' memory holds fewer runs'
#: caches): a batch of decode rows this long reads each weight once for all of them.
DEFAULT_BATCH_RUNS = 64


class BatchError(PicklableError, ValueError):
    """Prompts that no batch can run (none; one with no tokens, with a token that is no
    token id or is outside the vocabulary, or too long for the context with
    ``max_tokens``), named; ``index``: the prompt's (``None``: the batch's)."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


def listed(prompts: Iterable[Iterable[int]]) -> list[tuple[int, ...]]:
    """``prompts`` taken once, each as a tuple: a generator of prompts was used up by the
    checks and the batch then failed "max() arg is an empty sequence", and a 2-D array
    "the truth value of an array ... is ambiguous". ``BatchError`` naming what is no
    iterable of prompts, or the prompt that is no sequence of tokens."""
    try:
        whole = list(prompts)
    except TypeError:
        raise BatchError(
            f"prompts must be an iterable of prompts, not {type(prompts).__name__}"
        ) from None
    out: list[tuple[int, ...]] = []
    for i, prompt in enumerate(whole):
        try:
            out.append(tuple(prompt))
        except TypeError:
            raise BatchError(f"prompt {i} is {prompt!r}, not a sequence of token ids", i) from None
    return out


def check_prompts(prompts: Sequence[Sequence[int]], max_tokens: int, facts: ModelFacts) -> None:
    """``BatchError`` naming the first prompt the model cannot run: before a chain
    starts, so that one prompt does not fail the batch with the chain's message, which
    names no prompt."""
    if len(prompts) == 0:
        raise BatchError("no prompts")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise BatchError(f"prompt {i} holds no tokens", i)
        for j, t in enumerate(prompt):
            try:
                token_id(t)  # 5.9, "5" or True is no token id (5.9 ran as 5, True as 1)
            except TypeError:
                raise BatchError(f"prompt {i}: token {j} is {t!r}, not a token id", i) from None
        outside = next((j for j, t in enumerate(prompt) if not 0 <= t < facts.vocab_size), None)
        if outside is not None:
            raise BatchError(
                f"prompt {i}: token {outside} is {prompt[outside]}, outside the vocabulary "
                f"0..{facts.vocab_size - 1}",
                i,
            )
        needed = run_positions(len(prompt), max_tokens)
        limit = context_limit(facts)  # None: the file states none
        if limit is not None and needed > limit:
            raise BatchError(
                f"prompt {i} holds {len(prompt)} tokens: with max_tokens {max_tokens} it "
                f"needs {needed} positions (the last token generated is not fed back), "
                f"past the model's context length {facts.context_length}",
                i,
            )


def generate_batch(
    model_path: str | os.PathLike[str],
    prompts: Iterable[Iterable[int]],
    *,
    stages: int = 1,
    max_tokens: int = 16,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    worker: str = DEFAULT_WORKER,
    gpus: Sequence[int] | None = None,
    edges: str = "auto",
    encrypt_edges: bool = False,
    ray_address: str | None = None,
    placement: str = "even",
    max_concurrent: int | None = None,
    kv_dtype: str | None = None,
    on_load: LoadProgress | None = None,
    on_slice: Callable[[StageTransfer], None] | None = None,
) -> Generator[tuple[int, GenerateResult], None, None]:
    """Generate up to ``max_tokens`` tokens after each of ``prompts`` on one chain;
    yields ``(index, result)`` as each run ends. ``prompts``: any iterable of prompts (a
    list, a generator, a 2-D array), each a sequence of token ids, taken once.
    ``BatchError`` (``listed``, ``check_prompts``) for no prompts or one the model cannot
    run, before any process starts; the planner's and the chain's errors as
    ``runtime_cupy.generate`` raises them. ``on_load`` and ``on_slice`` see the chain's
    stages start as ``generate``'s do (each stage bound; each slice moving to a Ray
    host)."""
    path = str(resolve_model(model_path))
    taken = listed(prompts)
    check_prompts(taken, max_tokens, model_facts_from_gguf(path))
    longest = max(len(p) for p in taken)
    context = max(2, run_positions(longest, max_tokens))  # WarmChain's least is 2

    def chain_of(runs: int) -> WarmChain:  # PlanRejected before any process starts
        return WarmChain(
            path,
            stages=stages,
            worker=worker,
            gpus=gpus,
            edges=edges,
            encrypt_edges=encrypt_edges,
            ray_address=ray_address,
            placement=placement,
            context=context,
            max_concurrent=runs,
            kv_dtype=kv_dtype,
        )

    if max_concurrent is not None:
        chain = chain_of(max_concurrent)
    else:
        runs = min(len(taken), DEFAULT_BATCH_RUNS)
        while True:
            try:
                chain = chain_of(runs)
                break
            except PlanRejected as e:
                if runs == 1 or not isinstance(e.rejection, InsufficientMemory):
                    raise
                runs //= 2
    chain.on_load = on_load
    if on_slice is not None:
        chain.show_slices(on_slice)
    return _results(chain, taken, max_tokens, SamplingConfig(temperature, top_k, top_p, seed))


def _results(
    chain: WarmChain,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    sampling: SamplingConfig,
) -> Generator[tuple[int, GenerateResult], None, None]:
    """Every prompt on ``chain``, at most its ``max_concurrent`` submitted at once (the
    chain admits runs by their KV bytes, so short prompts beside a long one would all
    run): the next prompt in order is submitted as a run ends."""
    ended: queue.SimpleQueue[ChainRun] = queue.SimpleQueue()
    waiting = iter(enumerate(prompts))
    runs: dict[int, int] = {}  # id of a submitted run -> its prompt's index

    def submit_next() -> None:
        for index, prompt in itertools.islice(waiting, 1):
            run = chain.submit(prompt, max_tokens=max_tokens, sampling=sampling, on_done=ended.put)
            runs[id(run)] = index

    try:
        chain.start()
        for _ in range(min(chain.max_concurrent, len(prompts))):
            submit_next()
        for _ in range(len(prompts)):
            run = ended.get()
            submit_next()
            yield runs[id(run)], chain.result(run).result
    finally:
        chain.close()
