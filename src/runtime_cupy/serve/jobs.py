"""Jobs: one admitted choice of a request each (``Job``), which the client may cancel from
any thread (out of the queue, or its run cancelled alone), and the tally of a request's
choices (``Tally``), which counts it once in the metrics when its last choice ends."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING

from runtime_cupy.process.chain_run import ChainRun
from runtime_cupy.process.names import run_label
from runtime_cupy.serve.events import Sink
from runtime_cupy.serve.prompts import Prepared

if TYPE_CHECKING:
    from runtime_cupy.serve.engine import Engine

log = logging.getLogger("runtime_cupy.serve")

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


def answer_id(endpoint: str) -> str:
    """A new id of an answer (every choice's chunks and the whole answer carry it)."""
    kind = "chatcmpl" if endpoint == "chat" else "cmpl"
    return f"{kind}-{uuid.uuid4().hex[:24]}"


class Job:
    """One admitted choice of a request. ``cancel()`` from any thread. ``id``: the
    answer's, the same for every choice of a request (``answer_id``; a new one when
    not given)."""

    def __init__(
        self,
        engine: Engine,
        prepared: Prepared,
        number: int,
        sink: Sink,
        tally: Tally,
        id: str | None = None,
    ) -> None:
        self.id = id if id is not None else answer_id(prepared.request.endpoint)
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

    @property
    def label(self) -> str:
        """What the log calls it: the answer's id, and the choice's index where there
        are several (``chatcmpl-...[1]``; one word, as a log reader splits them)."""
        if self.prepared.request.n == 1:
            return self.id
        return f"{self.id}[{self.prepared.index}]"

    @property
    def waiting_for_memory(self) -> bool:
        """Its run waits for KV memory on the chain (``ChainRun.waiting_for_memory``),
        not running (any thread)."""
        run = self._run
        return run is not None and run.waiting_for_memory

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
        log.info("request #%d (%s) runs as %s", self.number, self.label, run_label(run.plan.run_id))
        with self._lock:
            self._run = run
            cancel = self.cancelled
            interrupted = self.interrupted
            stopped = self.stopped
        self.submitted.set()
        if cancel:
            run.cancel("the client went away")
        elif interrupted:
            run.cancel(SHUTTING_DOWN)
        elif stopped:  # a replay after a loss, of an answer a stop string had ended: it
            run.cancel("a stop string")  # ran to its end unseen, and the answer waited

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
