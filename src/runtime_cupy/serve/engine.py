"""Requests to runs: the queue in front of the warm chain, and continuous batching on
it: up to the chain's ``max_concurrent`` runs in flight at once, each request joining
the stages' batches at their next step and leaving them when it ends.

A started request whose run the chain holds for KV memory (a stage refused its cache,
or the stages' budgets have no room for it yet: CONCURRENT_RUNS.md §5) keeps its place
among the ``max_concurrent``: it is offered again at the next end of a run on the chain,
before the request that takes that run's place joins, so requests that came later never
overtake it for ever; freed, its place would let a new run take the memory it waits
for, and the chain hold more runs than its budget is sized for. It is not counted as
running: ``gguf_pipeline_runs_waiting_for_memory`` counts it (``metrics``).

``Engine.prepare(request)`` turns a checked request into a prompt, its token limit and
its seed (``prompts.prepare``). ``submit`` admits its choices to a bounded queue, all or
none (``QueueFull`` past ``max_queue`` waiting), and numbers them: requests start
strictly in the order they were admitted, which the log shows (``request #N queued`` ...
``started`` ... ``finished``). The runner thread starts the chain first (``GET /health``
says 503 until then), then starts each request as soon as fewer than ``max_concurrent``
run, each in a thread of its own (the next one once this one's run has joined the chain)
that sends its events (``Piece``, ``Finished``, ``Failed``) to the request's sink as
tokens arrive (``answers.Answers``). ``Job.cancel()`` (a client that went away) takes a
waiting request out of the queue or cancels its run alone; the stages stay warm and the
other runs go on. After a chain fault (every run in flight ends naming its cause), once
those runs have ended, the runner starts the chain again (``/health`` says 503 and why
meanwhile).
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence

from runtime_core.threads import thread_refused
from runtime_cupy.serve.answers import Answers
from runtime_cupy.serve.chain import ChainError, WarmChain
from runtime_cupy.serve.events import Failed, Sink
from runtime_cupy.serve.jobs import SHUTTING_DOWN, Job, Tally, answer_id
from runtime_cupy.serve.metrics import Metrics, RecoveryMetrics
from runtime_cupy.serve.prompts import Prepared, prepare
from runtime_cupy.serve.requests import CompletionRequest
from runtime_cupy.serve.stopping import Stopping

log = logging.getLogger("runtime_cupy.serve")

IDLE_CHECK_S = 1.0  # how often an idle runner looks for stages that went away


class QueueFull(Exception):
    """The queue holds ``max_queue`` waiting requests."""


class ShuttingDown(Exception):
    """The server is stopping: it admits no request (a 503, as for those it was holding,
    not a 429, whose ``Retry-After`` sends a client back to a server going away)."""


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
        self._closed = threading.Event()  # the close ended (on its thread or the caller's)
        self._starting_close_on: int | None = None  # the thread in close's first call
        #: set once the engine closes: a request still reading its body is answered 503
        self.stopping = Stopping()
        self.failure: str | None = None  # why the chain could not start, once it could not
        self._backoff = 0.0  # seconds between tries to start broken stages again
        self._retry_at = 0.0
        self.metrics = Metrics(
            queued=lambda: len(self._queue),
            started=self._started_jobs,
            ready=lambda: self.ready,
            restarts=lambda: self.chain.restarts,
            in_flight=lambda: self.chain.in_flight,
            kv=self.chain.kv_in_use,
            batches=self.chain.batch_counts,
        )
        self.metrics.registry.register(RecoveryMetrics(lambda: self.chain.recoveries))
        self._answers = Answers(chain, self.metrics)
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
        """The prompt, token limit and seed of ``request`` (``prompts.prepare``);
        ``RequestError`` for what the model or its context cannot take."""
        return prepare(self.chain, request)

    def submit(self, choices: Sequence[Prepared], sink_of: Callable[[int], Sink]) -> list[Job]:
        """Admit a request's choices (``Prepared.choices``; ``sink_of(index)``: each
        one's sink), all of them or none: ``ShuttingDown`` once the server stops,
        ``QueueFull`` when they would make more than
        ``max_queue`` wait (those that start at once, in the chain's free places after
        the ones already waiting, do not wait). A server with nothing running or waiting
        admits any request (else one of more choices than ``max_queue`` could never be
        admitted)."""
        with self._cond:
            if self._closing:
                raise ShuttingDown(SHUTTING_DOWN)
            waiting = len(self._queue)
            # Places are free only on a chain that starts runs (not while it starts or
            # heals: then every choice waits).
            free = max(0, self.chain.max_concurrent - len(self._running)) if self.chain.ready else 0
            would_wait = max(0, waiting + len(choices) - free)
            if would_wait > self.max_queue and (self._running or self._queue):
                raise QueueFull(
                    # the queue holds choices (a request of n choices is n of them)
                    f"{waiting} {'choice waits' if waiting == 1 else 'choices wait'} "
                    f"(--max-queue {self.max_queue}) and "
                    + (f"this one's {len(choices)} choices" if len(choices) > 1 else "this one")
                    + f" would make {would_wait} wait ({free} of --max-concurrent "
                    f"{self.chain.max_concurrent} free)"
                )
            jobs = []
            tally = Tally(len(choices))
            answer = answer_id(choices[0].request.endpoint) if choices else None
            for prepared in choices:
                self._numbers += 1
                sink = sink_of(prepared.index)
                job = Job(self, prepared, self._numbers, sink, tally, answer)
                self._queue.append(job)
                jobs.append(job)
                log.info(
                    "request #%d (%s) queued: %d prompt tokens, up to %d tokens; %d waiting",
                    job.number,
                    job.label,
                    len(prepared.prompt_ids),
                    prepared.max_tokens,
                    len(self._queue),
                )
            self._cond.notify()
        return jobs

    def _started_jobs(self) -> tuple[int, int]:
        """The started choices: those running, and those whose run waits for KV memory
        (held by the chain: they keep their place among ``max_concurrent``)."""
        with self._cond:
            started = list(self._running)
        waiting = sum(1 for job in started if job.waiting_for_memory)
        return len(started) - waiting, waiting

    def _drop(self, job: Job) -> None:
        with self._cond:
            try:
                self._queue.remove(job)
            except ValueError:
                return
        log.info("request #%d (%s) left the queue: the client went away", job.number, job.label)
        self._answers.count(job, "cancelled")

    def close(self, timeout_s: float | None = None) -> bool:
        """Stop taking requests: each waiting one is answered 503, each running one's run
        is cancelled and its client told (``Job.interrupt``), then the chain closes, on a
        thread of its own (once, from any thread: a signal's handler may start it), or,
        where that thread cannot start (``can't start new thread``: ``ulimit -u``, a
        cgroup's ``pids.max``), on the caller's, whatever ``timeout_s``. Whether all of
        it ended within ``timeout_s`` (``None``: wait for it; 0: start it and return).
        The application's handlers hear of it at once (``stopping``)."""
        self.stopping.set()
        with self._cond:
            if self._starting_close_on == threading.get_ident():
                return False  # a signal's handler, run while this thread starts the close
            first = self._closer is None
            if first:
                self._closer = threading.Thread(target=self._close, name="close", daemon=True)
                self._starting_close_on = threading.get_ident()
        if first:
            try:
                self._begin_close()
            finally:
                self._starting_close_on = None
        return self._closed.wait(timeout_s)

    def _begin_close(self) -> None:
        """Start the closing thread; where it cannot start, close on this thread (the
        chain's processes were left running, every later close returning False)."""
        assert self._closer is not None
        try:
            self._closer.start()
        except RuntimeError as exc:  # can't start new thread
            log.warning("closing on the caller's thread: the closing thread cannot start (%s)",
                        exc)  # fmt: skip
            self._close()

    def _close(self) -> None:
        try:
            with self._cond:
                self._closing = True
                waiting = list(self._queue)
                self._queue.clear()
                running = list(self._running)
                self._cond.notify_all()
            for job in waiting:  # counted, as the running ones are: their tallies close
                self._answers.finish(job, "cancelled", Failed(503, SHUTTING_DOWN, "shutting_down"))
            for job in running:
                job.interrupt()
            if self._thread.ident is not None:  # started: it closes the chain as it ends
                self._thread.join()
            else:
                self.chain.close()
        finally:
            self._closed.set()

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
            with self._cond:
                stopping = self._closing
            if not stopping:  # a stop that came while they started said "stopping" already
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
                log.info("request #%d (%s) started", job.number, job.label)
                if not self._start_job_thread(job, thread):
                    continue
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
            outcome = "faulted" if self.failure else "cancelled"
            for job in waiting:
                reason = self.failure or SHUTTING_DOWN
                self._answers.finish(job, outcome, Failed(503, reason, "unavailable"))

    def _start_job_thread(self, job: Job, thread: threading.Thread) -> bool:
        """Start ``job``'s thread; whether it started. A thread the host cannot start
        (``RuntimeError: can't start new thread``: a limit on threads, processes or
        address space) ends that request alone with a 503 naming the cause, and the
        runner goes on serving: only started threads are joined as it ends."""
        with self._cond:
            self._job_threads.add(thread)
        try:
            thread.start()
        except RuntimeError as exc:
            with self._cond:
                self._job_threads.discard(thread)
                self._running.discard(job)
                self._cond.notify_all()
            job.submitted.set()
            reason = thread_refused("the server could not start a thread for the request", exc)
            log.error("request #%d (%s): %s", job.number, job.label, reason)
            self._answers.finish(job, "faulted", Failed(503, reason, "unavailable"))
            return False
        return True

    def _fail_waiting(self) -> None:
        """The chain could not be started again: the requests waiting get a 503, whose
        ``Retry-After`` is the time to the next try (without it, the ``openai`` library
        retries twice within 2 s, and meets the same 503 while the next try is seconds
        off)."""
        with self._cond:
            waiting = list(self._queue)
            self._queue.clear()
        reason = self.chain.trouble or "the stages are not up"
        retry = max(1, math.ceil(self._retry_at - time.monotonic()))
        for job in waiting:
            failed = Failed(503, reason, "stages_unavailable", retry_after_s=retry)
            self._answers.finish(job, "faulted", failed)

    def _run_job(self, job: Job) -> None:
        try:
            self._answers.run(job)
        except Exception as exc:  # a bug: the request gets an error, the server goes on
            log.exception("request #%d failed", job.number)
            failed = Failed(500, f"internal error: {exc}", "internal_error")
            self._answers.finish(job, "faulted", failed)
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
