"""Requests to runs: the queue in front of the warm chain, and continuous batching on
it: up to the chain's ``max_concurrent`` runs in flight at once, each request joining
the stages' batches at their next step and leaving them when it ends.

``Engine.prepare(request)`` turns a checked request into a prompt (the model's chat
template over the messages, or the completion's text or ids), its token limit and its
seed, refusing what the context cannot hold (``RequestError``): a text is first
measured against the context by its size (``Tokenizer.min_token_count``), so one too
long is refused without being tokenized; the server calls it in a thread, and the
tokenizer lets go of the interpreter while it merges, so the event loop goes on.
``submit`` admits its choices to a bounded queue, all or none (``QueueFull`` past
``max_queue`` waiting), and numbers them: requests start strictly in the order they
were admitted, which the log shows (``request #N queued`` ... ``started`` ...
``finished``). The runner thread starts the chain first (``GET /health`` says 503
until then), then starts each request as soon as fewer than ``max_concurrent`` run,
each in a thread of its own (the next one once this one's run has joined the chain)
that sends
its events (``Piece``, ``Finished``, ``Failed``) to the request's sink as tokens
arrive. ``Job.cancel()`` (a client that went away) takes a waiting request out of the
queue or cancels its run alone; the stages stay warm and the other runs go on. After a
chain fault (every run in flight ends naming its cause), once those runs have ended,
the runner starts the chain again (``/health`` says 503 and why meanwhile).
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from attrs import frozen

from runtime_core.chat import ChatTemplateError, NoChatTemplate
from runtime_core.runs import PlanRejected
from runtime_core.tokenizer import Tokenizer
from runtime_cupy.process.chain_runner import ChainRun
from runtime_cupy.process.names import run_label
from runtime_cupy.serve.chain import ChainError, WarmChain, WarmResult
from runtime_cupy.serve.logprobs import AnswerLogprobs, TokenLogprob
from runtime_cupy.serve.metrics import Metrics, RecoveryMetrics
from runtime_cupy.serve.requests import CompletionRequest, Message, RequestError
from runtime_cupy.serve.text import Answer

log = logging.getLogger("runtime_cupy.serve")

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
IDLE_CHECK_S = 1.0  # how often an idle runner looks for stages that went away


class QueueFull(Exception):
    """The queue holds ``max_queue`` waiting requests."""


# -- events a request's sink receives (from the runner thread) ------------------------


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
    """The request could not be answered: an HTTP status and an OpenAI error."""

    status: int
    message: str
    code: str
    type: str = "server_error"


Event = Piece | Finished | Failed
Sink = Callable[[Event], None]


# -- prompts ------------------------------------------------------------------------------


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
    return tokenizer.encode(chat_text(tokenizer, messages), add_special=True, parse_special=True)


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
    what the same request with ``n = 1`` samples, and each choice its own stream."""
    return (seed + index) % 2**64


# -- jobs ---------------------------------------------------------------------------------


#: What a request hears when the server stops under it.
SHUTTING_DOWN = "the server is shutting down"


class Tally:
    """The ends of one request's choices: the request counts once in the metrics, when
    its last choice ends, as the worst of their outcomes (``OUTCOME_RANK``, best
    first), and its prompt's tokens once if a choice was answered."""

    OUTCOME_RANK = ("completed", "cancelled", "rejected", "faulted")

    def __init__(self, choices: int) -> None:
        self._left = choices
        self._worst = 0
        self._answered = False
        self._lock = threading.Lock()

    def end(self, outcome: str) -> tuple[str, bool] | None:
        """One choice ended with ``outcome``: None while others go on, else the
        request's outcome and whether a choice was answered."""
        with self._lock:
            self._left -= 1
            self._worst = max(self._worst, self.OUTCOME_RANK.index(outcome))
            self._answered |= outcome == "completed"
            if self._left:
                return None
            return self.OUTCOME_RANK[self._worst], self._answered


class Job:
    """One admitted choice of a request. ``cancel()`` from any thread."""

    def __init__(
        self, engine: Engine, prepared: Prepared, number: int, sink: Sink, tally: Tally
    ) -> None:
        kind = "chatcmpl" if prepared.request.endpoint == "chat" else "cmpl"
        self.id = f"{kind}-{uuid.uuid4().hex[:24]}"
        self.number = number
        self.prepared = prepared
        self.sink = sink
        self.tally = tally
        self.arrived_s = time.monotonic()
        self.created = int(time.time())
        self._engine = engine
        self._lock = threading.Lock()
        self._run: ChainRun | None = None
        self.cancelled = False
        self.interrupted = False  # the server is shutting down: the run ends, the client told
        self.stopped = False  # a stop string came: the run ends early, the answer is whole
        #: set once the job's run has joined the chain, or the job ended before it could
        self.submitted = threading.Event()

    def cancel(self) -> None:
        """The client went away: out of the queue, or its run cancelled."""
        with self._lock:
            if self.cancelled:
                return
            self.cancelled = True
            run = self._run
        if run is not None:
            run.cancel("the client went away")
        else:
            self._engine._drop(self)

    def interrupt(self) -> None:
        """The server is shutting down: the run is cancelled, and the client (still there)
        told so (a 503, or an error event on its stream)."""
        with self._lock:
            self.interrupted = True
            run = self._run
        if run is not None:
            run.cancel(SHUTTING_DOWN)

    def _attach(self, run: ChainRun) -> None:
        log.info("request #%d (%s) runs as %s", self.number, self.id, run_label(run.plan.run_id))
        with self._lock:
            self._run = run
            cancel = self.cancelled
            interrupted = self.interrupted
        self.submitted.set()
        if cancel:
            run.cancel("the client went away")
        elif interrupted:
            run.cancel(SHUTTING_DOWN)

    def _detach(self) -> None:
        """The run is over: nothing cancels it any more."""
        with self._lock:
            self._run = None

    def _stop_early(self) -> None:
        with self._lock:
            self.stopped = True
            run = self._run
        if run is not None:
            run.cancel("a stop string")


class Engine:
    """The queue and the runner of ``chain``."""

    def __init__(self, chain: WarmChain, *, max_queue: int = 16) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue {max_queue} is negative")
        self.chain = chain
        self.tokenizer = chain.tokenizer
        self.max_queue = max_queue
        self.model_names = (chain.model_id,)
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._numbers = 0
        self._running: set[Job] = set()
        self._closing = False
        self.failure: str | None = None  # why the chain could not start, once it could not
        self._backoff = 0.0  # seconds between tries to start broken stages again
        self._retry_at = 0.0
        self.metrics = Metrics(
            queued=lambda: len(self._queue),
            running=lambda: len(self._running),
            ready=lambda: self.ready,
            restarts=lambda: self.chain.restarts,
            in_flight=lambda: self.chain.in_flight,
            kv=self.chain.kv_in_use,
            batches=self.chain.batch_counts,
        )
        self.metrics.registry.register(RecoveryMetrics(lambda: self.chain.recoveries))
        self._thread = threading.Thread(target=self._serve, name="runner", daemon=True)
        self._job_threads: set[threading.Thread] = set()
        self._started = threading.Event()  # the chain is up (or failed to come up)
        self._closer: threading.Thread | None = None  # close's thread, once started

    # -- the server's side ----------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.chain.ready and self.failure is None

    def start(self) -> None:
        """Start the runner: it brings the chain up, then serves the queue."""
        self._thread.start()

    def wait_started(self, timeout_s: float | None = None) -> bool:
        """Wait until the chain is up or failed; whether it is up."""
        self._started.wait(timeout_s)
        return self.failure is None and self._started.is_set()

    def prepare(self, request: CompletionRequest) -> Prepared:
        """The prompt, token limit and seed of ``request``; ``RequestError`` for what
        the model or its context cannot take."""
        tok = self.tokenizer
        if request.logprobs is not None and not self.chain.logprobs:
            raise RequestError(
                "logprobs: this server was started without --logprobs (its tokens come "
                "without the model's logits)",
                param="logprobs",
                code="unsupported_parameter",
            )
        param = "messages" if request.endpoint == "chat" else "prompt"
        context = self.chain.context
        if request.endpoint == "chat":
            try:
                text = chat_text(tok, request.messages)
            except NoChatTemplate:
                raise RequestError(
                    f"the model {self.chain.model_id!r} has no chat template: use /v1/completions",
                    param="messages",
                    code="no_chat_template",
                ) from None
            except ChatTemplateError as exc:
                raise RequestError(
                    f"the chat template refused the messages: {exc}", param="messages"
                ) from None
            self._check_size(text, param)
            ids = tok.encode(text, add_special=True, parse_special=True)
        elif isinstance(request.prompt, str):
            self._check_size(request.prompt, param)
            ids = tok.encode(request.prompt, add_special=True, parse_special=True)
        else:
            ids = list(request.prompt)
            vocab = len(tok.vocab.tokens)
            for i, token in enumerate(ids):
                if token >= vocab:
                    raise RequestError(
                        f"prompt[{i}] is {token}, outside the vocabulary 0..{vocab - 1}",
                        param=f"prompt[{i}]",
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

    def _check_size(self, text: str, param: str) -> None:
        """Refuse, before tokenizing it, a text that holds more tokens than the context
        whatever they are: its bytes over ``context * longest_token_bytes``."""
        tok, context = self.tokenizer, self.chain.context
        fewest = tok.min_token_count(text)
        if fewest > context:
            limit = context * tok.longest_token_bytes
            size = len(text.encode("utf-8", "surrogatepass"))
            raise RequestError(
                f"This model's maximum context length is {context} tokens; the prompt "
                f"({param}) holds at least {fewest}: it has {size} bytes, and a prompt "
                f"over {limit} bytes ({context} tokens of at most {tok.longest_token_bytes} "
                "bytes) is refused before it is tokenized",
                param=param,
                code="context_length_exceeded",
            )

    def submit(self, choices: Sequence[Prepared], sink_of: Callable[[int], Sink]) -> list[Job]:
        """Admit a request's choices (``Prepared.choices``; ``sink_of(index)``: each
        one's sink), all of them or none: ``QueueFull`` when they would make more than
        ``max_queue`` wait (those that start at once, in the chain's free places after
        the ones already waiting, do not wait). A server with nothing running or waiting
        admits any request (else one of more choices than ``max_queue`` could never be
        admitted)."""
        with self._cond:
            if self._closing:
                raise QueueFull(SHUTTING_DOWN)
            waiting = len(self._queue)
            # Places are free only on a chain that starts runs (not while it starts or
            # heals: then every choice waits).
            free = max(0, self.chain.max_concurrent - len(self._running)) if self.chain.ready else 0
            would_wait = max(0, waiting + len(choices) - free)
            if would_wait > self.max_queue and (self._running or self._queue):
                raise QueueFull(
                    f"{waiting} requests wait (--max-queue {self.max_queue}) and "
                    + (f"this one's {len(choices)} choices" if len(choices) > 1 else "this one")
                    + f" would make {would_wait} wait ({free} of --max-concurrent "
                    f"{self.chain.max_concurrent} free)"
                )
            jobs = []
            tally = Tally(len(choices))
            for prepared in choices:
                self._numbers += 1
                job = Job(self, prepared, self._numbers, sink_of(prepared.index), tally)
                self._queue.append(job)
                jobs.append(job)
                log.info(
                    "request #%d (%s) queued: %d prompt tokens, up to %d tokens; %d waiting",
                    job.number,
                    job.id,
                    len(prepared.prompt_ids),
                    prepared.max_tokens,
                    len(self._queue),
                )
            self._cond.notify()
        return jobs

    def _drop(self, job: Job) -> None:
        with self._cond:
            try:
                self._queue.remove(job)
            except ValueError:
                return
        log.info("request #%d (%s) left the queue: the client went away", job.number, job.id)
        self._count(job, "cancelled")

    def _count(self, job: Job, outcome: str) -> None:
        """``job`` ended with ``outcome``: its request counts in the metrics once its
        last choice has ended (``Tally``)."""
        ended = job.tally.end(outcome)
        if ended is not None:
            request, answered = ended
            prompt = len(job.prepared.prompt_ids) if answered else 0
            self.metrics.request(job.prepared.request.endpoint, request, prompt_tokens=prompt)

    def close(self, timeout_s: float | None = None) -> bool:
        """Stop taking requests: each waiting one is answered 503, each running one's run
        is cancelled and its client told (``Job.interrupt``), then the chain closes, on a
        thread of its own (once, from any thread: a signal's handler may start it).
        Whether all of it ended within ``timeout_s`` (``None``: wait for it; 0: start it
        and return)."""
        with self._cond:
            if self._closer is None:
                self._closer = threading.Thread(target=self._close, name="close", daemon=True)
                self._closer.start()
            closer = self._closer
        closer.join(timeout_s)
        return not closer.is_alive()

    def _close(self) -> None:
        with self._cond:
            self._closing = True
            waiting = list(self._queue)
            self._queue.clear()
            running = list(self._running)
            self._cond.notify_all()
        for job in waiting:
            self._deliver(job, Failed(503, SHUTTING_DOWN, "shutting_down"))
        for job in running:
            job.interrupt()
        if self._thread.ident is not None:  # started: it closes the chain as it ends
            self._thread.join()
        else:
            self.chain.close()

    # -- the runner thread ----------------------------------------------------------------
    def _serve(self) -> None:
        try:
            try:
                self.chain.start()
            except ChainError as exc:
                self.failure = str(exc)
                log.error("the stages could not be started: %s", exc)
                return
            finally:
                self._started.set()
            log.info("ready: %d stages, pids %s", len(self.chain.pids()), self.chain.pids())
            limit = self.chain.max_concurrent
            while True:
                with self._cond:
                    while not self._closing and (not self._queue or len(self._running) >= limit):
                        if not self._cond.wait(IDLE_CHECK_S):
                            break  # idle: a look at the chain
                    if self._closing:
                        break
                    job = None
                    if self._queue and len(self._running) < limit and self.chain.ready:
                        job = self._queue.popleft()
                        self._running.add(job)
                    idle = not self._running
                if job is None:
                    if idle:
                        self._recover()
                        if self._backoff > 0:  # the chain could not be started again
                            self._fail_waiting()
                    if not self.chain.ready:
                        with self._cond:  # runs of a broken chain end first, then recovery
                            self._cond.wait(IDLE_CHECK_S / 10)
                    continue
                thread = threading.Thread(
                    target=self._run_job, args=(job,), name=f"request-{job.number}", daemon=True
                )
                self._job_threads.add(thread)
                log.info("request #%d (%s) started", job.number, job.id)
                thread.start()
                # The next request starts once this one's run has joined the chain (or
                # ended before it could): runs join in the order requests were admitted.
                while not job.submitted.wait(IDLE_CHECK_S) and thread.is_alive():
                    pass
        finally:
            for thread in list(self._job_threads):
                thread.join()
            self.chain.close()
            with self._cond:
                self._closing = True
                waiting = list(self._queue)
                self._queue.clear()
            for job in waiting:
                reason = self.failure or SHUTTING_DOWN
                self._deliver(job, Failed(503, reason, "unavailable"))

    def _fail_waiting(self) -> None:
        """The chain could not be started again: the requests waiting get a 503."""
        with self._cond:
            waiting = list(self._queue)
            self._queue.clear()
        reason = self.chain.trouble or "the stages are not up"
        for job in waiting:
            self._finish(job, "faulted", Failed(503, reason, "stages_unavailable"))

    def _run_job(self, job: Job) -> None:
        try:
            self._run(job)
        except Exception as exc:  # a bug: the request gets an error, the server goes on
            log.exception("request #%d failed", job.number)
            self._deliver(job, Failed(500, f"internal error: {exc}", "internal_error"))
        finally:
            job.submitted.set()
            with self._cond:
                self._running.discard(job)
                self._job_threads.discard(threading.current_thread())
                self._cond.notify_all()

    def _recover(self) -> None:
        """Start again what broke; after a failure, try again later and later (up to a
        minute) rather than at every idle turn."""
        now = time.monotonic()
        if self._closing or self.chain.ready or now < self._retry_at:
            return
        try:
            restarted = self.chain.recover()
        except ChainError as exc:
            self._backoff = min(60.0, max(1.0, 2 * self._backoff))
            self._retry_at = time.monotonic() + self._backoff
            log.error("the stages could not be started again (next try in %.0f s): %s",
                      self._backoff, exc)  # fmt: skip
            return
        self._backoff, self._retry_at = 0.0, 0.0
        if restarted:
            log.warning("stages %s started again", list(restarted))

    def _deliver(self, job: Job, event: Event) -> None:
        try:
            job.sink(event)
        except Exception:  # the request's side is gone (its loop closed): nothing to tell
            log.debug("request #%d: event not delivered", job.number, exc_info=True)

    def _run(self, job: Job) -> None:
        p = job.prepared
        r = p.request
        answer = Answer(self.tokenizer, r.stop)
        times: list[float] = []
        answer_logprobs = AnswerLogprobs(r.logprobs)

        def on_token(token_id: int) -> None:
            if job.cancelled or answer.stopped:
                return
            times.append(time.monotonic())
            answer_logprobs.token(token_id, answer.text.chars)  # the text before it
            piece = answer.push(token_id)
            if piece:
                self._deliver(job, Piece(piece, answer_logprobs.take()))
            if answer.stopped:
                job._stop_early()

        try:
            run = self.chain.generate(
                p.prompt_ids,
                max_tokens=p.max_tokens,
                temperature=r.temperature,
                top_k=r.top_k,
                top_p=r.top_p,
                seed=p.seed,
                on_token=on_token,
                on_run=job._attach,
                on_logits=answer_logprobs.logits if r.logprobs is not None else None,
            )
        except ChainError as exc:
            self._finish(job, "faulted", Failed(503, str(exc), "stages_unavailable"))
            return
        except (PlanRejected, ValueError) as exc:  # refused settings a check let through
            failed = Failed(400, str(exc), "invalid_value", "invalid_request_error")
            self._finish(job, "rejected", failed)
            return
        finally:
            job._detach()
        self._answer(job, run, answer, times, answer_logprobs)

    def _answer(
        self,
        job: Job,
        run: WarmResult,
        answer: Answer,
        times: list[float],
        answer_logprobs: AnswerLogprobs,
    ) -> None:
        result = run.result
        p = job.prepared
        if job.cancelled:
            self._finish(job, "cancelled", None, tokens=answer.tokens)
            return
        if job.stopped or result.outcome == "completed":
            rest = answer.finish(None if job.stopped else result.text)
            stopped = job.stopped or answer.stopped or len(result.tokens) < p.max_tokens
            tokens = answer.tokens if job.stopped else len(result.tokens)
            if rest:
                self._deliver(job, Piece(rest, answer_logprobs.take(tokens)))
            ttft = times[0] - job.arrived_s if times else None
            tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
            self.metrics.answered(tokens, ttft, tpot)
            entries, unsent = answer_logprobs.counted(tokens)
            finished = Finished(answer.content, "stop" if stopped else "length",
                                len(p.prompt_ids), tokens, entries, unsent)  # fmt: skip
            self._finish(job, "completed", finished, tokens=tokens)
            return
        if result.outcome == "cancelled":
            failed = Failed(503, f"the run was cancelled: {SHUTTING_DOWN}", "cancelled")
            self._finish(job, "cancelled", failed, tokens=answer.tokens)  # those it was sent
            return
        failed = Failed(500, f"the pipeline failed: {result.fault}", "pipeline_fault")
        self._finish(job, "faulted", failed, tokens=answer.tokens)

    def _finish(self, job: Job, outcome: str, event: Event | None, *, tokens: int = 0) -> None:
        log.info("request #%d (%s) finished: %s, %d tokens%s", job.number, job.id, outcome,
                 tokens, f" ({event.message})" if isinstance(event, Failed) else "")  # fmt: skip
        self._count(job, outcome)
        if event is not None:
            self._deliver(job, event)

    def describe(self) -> dict[str, Any]:
        """For logs and /health."""
        return {
            "ready": self.ready,
            "waiting": len(self._queue),
            "running": len(self._running),
            "failure": self.failure,
            "trouble": self.chain.trouble,
        }
