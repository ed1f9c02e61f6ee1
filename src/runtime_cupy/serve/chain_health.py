"""The health of a warm chain (``serve.chain.WarmChain``, whose base ``ChainHealth``
is): whether it is ``ready`` and, until it is whole again, its ``trouble``; the chain
started again after a fault (``_heal``: the broken runner stopped, a new one started in
a thread of its own and bound by one short run), and re-placed over the live nodes after
a loss (issue 25, ``serve.recovery.Replacer``), keeping the stages it can: none when the
model's files changed since the stages started (``chain_source``), and a stream's
recovery is then refused (``SourceChanged``).

A fault of the chain (a stage that died or went silent, a link cut) ends every run in
flight, each naming the stage, its node, its host and the cause; the chain is then
started again (every stage, a new secret and so new link names) and bound before the
next request. The chain's loop watches the stages' channels and heartbeats at all times,
between runs too. Until the chain is whole again it is not ``ready`` and ``trouble``
says why.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from runplan import ModelFacts, NodeSpec, Placement, RunPlan, RuntimeConfig, SamplingConfig
from runplan.replacement import Replacement, Unplaceable
from runplan.resource_limits import with_limit
from runtime_core.interrupt import to_the_end
from runtime_core.recovery import RecoveryPolicy
from runtime_core.tokenizer import Tokenizer
from runtime_cupy.hosts.port import StageHandle, StageHost
from runtime_cupy.process.chain_runner import ChainRunner, OnEvent, ready_stage
from runtime_cupy.serve.chain_errors import ChainError, SourceChanged, Unplaced
from runtime_cupy.serve.chain_source import SourceFiles
from runtime_cupy.serve.recovery import Recoveries, Replacer, kept_stages

if TYPE_CHECKING:
    from runtime_cupy.process.chain_run import OnLogits
    from runtime_cupy.serve.chain_runs import OnRun, WarmResult

# The warm chain's: its log lines keep their logger.
log = logging.getLogger("runtime_cupy.serve.chain")


def added_counts(
    a: dict[int, dict[int, int]], b: dict[int, dict[int, int]]
) -> dict[int, dict[int, int]]:
    """Batch counts (stage -> rows -> batches) of ``a`` and ``b`` together (new dicts)."""
    out = {stage: dict(rows) for stage, rows in a.items()}
    for stage, rows in b.items():
        mine = out.setdefault(stage, {})
        for n, batches in rows.items():
            mine[n] = mine.get(n, 0) + batches
    return out


def stop_dropped(running: list[tuple[ChainRunner, threading.Thread]], owner: int) -> None:
    """A chain collected without ``close()`` (``WarmChain``'s finalizer): its running
    chain stopped, its stages reaped and its links freed, from a thread of its own (the
    collection may happen on any thread, the chain's own included, which it joins). In a
    forked child of ``owner`` (the process that made the chain) nothing is stopped: the
    stages and links are the owner's."""
    if os.getpid() != owner:
        running.clear()
        return

    def stop(runner: ChainRunner, thread: threading.Thread) -> None:
        runner.request_close()
        thread.join()
        runner.close()

    for runner, thread in running:
        threading.Thread(target=stop, args=(runner, thread), name="chain-dropped").start()
    running.clear()


def _weakly(method: Callable[[str, dict[str, Any]], None]) -> OnEvent:
    """``method`` of a chain as its runner's ``on_event``, holding no reference to the
    chain (the runner's thread would keep a dropped chain alive, never collected)."""
    ref = weakref.WeakMethod(method)

    def call(kind: str, fields: dict[str, Any]) -> None:
        bound = ref()
        if bound is not None:
            bound(kind, fields)

    return call


def _serve_chain(runner: ChainRunner, keep_broken: bool) -> None:
    """The chain's thread: its loop until it is closed or broken and its runs ended,
    then its end (a broken chain's stages reaped and its links freed at once), unless
    ``keep_broken``: the chain's owner then ends it (``WarmChain._stop_runner``), and a
    broken chain's live stages wait for the re-placement, which keeps those it can
    (``WarmChain.replace``)."""
    try:
        runner.loop()
    finally:
        if not keep_broken:
            runner.close()


class ChainHealth:
    """The health of a ``WarmChain``, its base: what it holds of the chain is set by
    ``WarmChain.__init__``."""

    worker: str
    devices: tuple[int | None, ...]
    host: StageHost
    edges: str
    encrypt_edges: bool
    trace: bool
    facts: ModelFacts
    tokenizer: Tokenizer
    template: RunPlan
    layout: tuple[tuple[int, str, int, int], ...]
    nodes: tuple[NodeSpec, ...]
    _placement: Placement | None
    policy: RecoveryPolicy | None
    recoveries: Recoveries
    replacer: Replacer
    _run_ids: Callable[[], str]
    _secrets: Callable[[], bytes]
    _lock: threading.Lock
    _heal_lock: threading.RLock
    _runner: ChainRunner | None
    _thread: threading.Thread | None
    _threads: weakref.WeakSet[threading.Thread]
    _running: list[tuple[ChainRunner, threading.Thread]]
    _closing: ChainRunner | None
    _batches_before: dict[int, dict[int, int]]
    _warm: bool
    _closed: bool
    _owner: int  # the process that made the chain (os.getpid())
    _trouble: str | None
    _source: SourceFiles | None
    _sources: weakref.WeakKeyDictionary[ChainRunner, SourceFiles]
    restarts: int
    kept: tuple[int, ...]
    heal_marks: dict[str, float]
    bind_run: WarmResult | None
    chain_id: str
    #: ``on_load(stage, 1, 1)`` as each stage is bound while the chain starts (a
    #: command's progress: ``runtime_cupy.api.generate``'s ``on_load``)
    on_load: Callable[[int, int, int], None] | None

    if TYPE_CHECKING:

        def _config(
            self, run_id: str, max_tokens: int, sampling: SamplingConfig, prompt_tokens: int
        ) -> RuntimeConfig: ...

        def _run(
            self,
            prompt: tuple[int, ...],
            max_tokens: int,
            sampling: SamplingConfig,
            on_token: Callable[[int], None] | None,
            on_run: OnRun | None,
            on_logits: OnLogits | None = None,
        ) -> WarmResult: ...

    def _in_owner(self, call: str) -> None:
        """``ChainError`` when ``call`` comes from a forked child of the process that made
        the chain (a pre-fork server's worker): the stages, links and the chain's thread
        are that process's (a child that used or closed its copy once faulted the owner's
        runs, killed its stages and unlinked its links)."""
        if os.getpid() != self._owner:
            raise ChainError(
                f"{call}() called in process {os.getpid()}, a fork of process {self._owner}, "
                "whose chain this is: a forked copy of a chain cannot use its stages "
                "(make a chain in this process)"
            )

    def _not_on_chain_thread(self, call: str) -> None:
        """``ChainError`` when ``call`` comes from the chain's own thread (an ``on_token``
        or ``on_logits``, an ``on_done``), which it would wait for: it hung for good, and
        every run and ``close`` with it; or from a forked child (``_in_owner``)."""
        self._in_owner(call)
        if threading.current_thread() in self._threads:
            raise ChainError(
                f"{call}() called from the chain's own thread (a run's callback), which it "
                "would wait for: call it from another thread (submit() does not wait)"
            )

    @property
    def ready(self) -> bool:
        """The chain started, bound, and not broken (any thread)."""
        with self._lock:
            runner = self._runner
        return self._warm and not self._closed and runner is not None and runner.whole

    @property
    def trouble(self) -> str | None:
        """Why the chain is not whole (a stage broken, silent, gone), until it is again
        (any thread)."""
        runner = self._runner
        if runner is not None and runner.dead is not None:
            return runner.dead
        return self._trouble

    @trouble.setter
    def trouble(self, why: str | None) -> None:
        self._trouble = why

    def _heal(self, lost: str | None = None) -> tuple[int, ...]:
        """Start the chain again if it is not whole (a stage gone or silent, a chain
        fault), or if it ``lost`` a stage (a link a stage saw break, which need not make
        the chain's fault), and bind it; the stage indices started."""
        runner = self._runner
        # whole: no chain fault and no stage known gone (a stage the runner has just
        # marked gone, while it waits to say how it died, is not whole yet not dead)
        if lost is None and runner is not None and runner.whole and self._warm:
            return ()
        if runner is not None:
            why = runner.dead or next(
                (h.exit_reason() or "gone" for h in runner.handles() if h.exited()), lost or "gone"
            )
            log.warning("the chain is broken (%s): starting it again", why)
            self.trouble = self.trouble or why
            if self.policy is not None and self.replacer.lost is None:
                # broken with no stream to recover (idle): what it lost is placed again
                # now, not once the same plan failed to start on a node that is gone
                self.replacer.lose(runner, (), why)
        marks: dict[str, float] = {}
        keep: tuple[int, ...] = ()
        if self.replacer.lost is not None:
            try:
                new = self._place_again()
            except ChainError:  # no placement over the live nodes: nothing is kept
                self._stop_runner()
                raise
            marks["placed"] = time.monotonic()
            if runner is not None:
                keep = kept_stages(runner.template, new)
        changed = self._source.changes() if keep and self._source is not None else None
        if changed is not None:  # the kept stages' weights are not the files' any more
            log.warning("%s: every stage starts again", changed)
            keep = ()
        kept = self._stop_runner(keep)
        if runner is not None:
            self.restarts += len(runner.template.stages) - len(kept)
        marks["stopped"] = time.monotonic()
        marks.setdefault("placed", marks["stopped"])
        for index, handle in sorted(kept.items()):
            log.info("stage %d (%s) kept: pid %d keeps its weights",
                     index, handle.node_id, handle.info().pid)  # fmt: skip
        runner = ChainRunner(
            self.template,
            worker=self.worker,
            devices=self.devices,
            host=self.host,
            edges=self.edges,
            encrypt_edges=self.encrypt_edges,
            trace=self.trace,
            secret=self._secrets(),
            kept=kept,
            generation=self.recoveries.placements,
            run_ids=self._run_ids,
            on_event=_weakly(self._starting),
        )
        self._warm = False
        if not kept:  # every stage reads the files as they are now
            self._source = SourceFiles.now(self.facts.gguf_source.paths)
        if self._source is not None:  # what this chain's stages read
            self._sources[runner] = self._source
        try:
            runner.start()
        except OSError as exc:
            self.trouble = with_limit(
                f"the stages could not be started: {exc}", exc.errno, spawning=True
            )
            self._lost_coming_up(runner, self.trouble)
            runner.close()
            raise ChainError(self.trouble) from exc
        except BaseException:  # Ctrl-C: the stages started so far are reaped
            runner.close()
            raise
        keep_broken = self.policy is not None
        thread = threading.Thread(
            target=_serve_chain, args=(runner, keep_broken), name="chain", daemon=True
        )
        with self._lock:
            closed = self._closed
            if not closed:
                self._runner, self._thread = runner, thread
                self._running[:] = [(runner, thread)]
        if closed:  # closed while its stages started: close() found no chain to stop
            runner.close()
            raise ChainError("the chain is closed")
        self._threads.add(thread)
        self.chain_id = runner.chain_id
        thread.start()
        marks["started"] = time.monotonic()
        for handle in runner.handles():
            if handle.stage_index not in kept:
                log.info("stage %d (%s) started: pid %d",
                         handle.stage_index, handle.node_id, handle.info().pid)  # fmt: skip
        try:
            self._bind_all()
        except BaseException as exc:
            # not only ChainError: a Ctrl-C, or a run id refused, once left the stages
            # running unbound, and each later start returned at once, never ready
            if isinstance(exc, ChainError):
                self._lost_coming_up(runner, str(exc))
            self._stop_runner()  # the next start makes a new chain
            raise
        marks["bound"] = time.monotonic()
        self.heal_marks = marks
        self.kept = tuple(sorted(kept))
        return tuple(i for i in range(len(self.layout)) if i not in kept)

    # -- re-placement (issue 25: serve.recovery.Replacer) -----------------------------
    @property
    def closed(self) -> bool:
        """``close()`` was called: no chain comes up again (a recovery ends)."""
        return self._closed

    @property
    def placeable(self) -> bool:
        """The last re-placement found a plan (or none was needed)."""
        return self.replacer.placeable

    def replace(self, lost_from: ChainRunner, lost_stages: Sequence[int], cause: str) -> None:
        """Re-place the chain ``lost_from`` was after it lost ``lost_stages`` (by
        ``cause``) and bring the new chain up, unless another stream did already (any
        thread). ``ChainError`` when there is no placement over the live nodes (its
        rejection named) or the new chain cannot be started or bound; ``SourceChanged``
        when the model's files changed since the stages started (the chain is left
        broken: its next start starts every stage again)."""
        with self._heal_lock:
            if self._closed:
                raise ChainError("the chain is closed")
            # the files lost_from's stages read (a chain started since may read others)
            source = self._sources.get(lost_from)
            changed = source.changes() if source is not None else None
            if changed is not None:
                raise SourceChanged(changed)
            if self._runner is not lost_from and self.ready:
                return  # another stream's recovery brought the new chain up
            if self._runner is not lost_from:  # a newer chain, itself broken or never up
                self._heal()
                return
            self.replacer.lose(lost_from, lost_stages, cause)
            self._heal(lost=cause)

    def _lost_coming_up(self, runner: ChainRunner, cause: str) -> None:
        """A recovering chain's new ``runner`` failed to start or bind: what it lost (a
        stage gone, a node no longer live) is re-placed by the next start, which would
        otherwise start the same plan again, on a node that may be gone."""
        if self.policy is not None:
            self.replacer.lose(runner, (), cause)

    def _place_again(self) -> Replacement:
        """The chain's plan over the live nodes without its lost stages, adopted;
        ``ChainError`` naming the planner's rejection when there is none."""
        config = self._config(self._run_ids(), 1, SamplingConfig(), 0)
        new = self.replacer.place(self.template, self.facts, config)
        if isinstance(new, Unplaceable):
            error = Unplaced(new, self.replacer.live)
            self.trouble = str(error)
            raise error
        self._placement = new.placement
        self.template = new.plan
        self.nodes, self.devices = self.replacer.nodes_of(new.plan)
        self.layout = tuple(
            (s.stage_index, s.node_id, s.layer_start, s.layer_end_exclusive)
            for s in new.plan.stages
        )
        return new

    def _stop_runner(self, keep: Sequence[int] = ()) -> dict[int, StageHandle]:
        """Stop the running chain; the live stages of ``keep`` are handed over (left
        running, for the next chain to keep) and returned by index. Interrupted while
        it waits for the stages' stops (Ctrl-C), it stops waiting: every stage is
        stopped (killed at once, none kept) and the links freed before the interrupt
        goes on; further interrupts meanwhile are held until then."""
        with self._lock:
            runner, thread = self._runner, self._thread
            self._runner = self._thread = None
            self._running.clear()
            self._closing = runner
        if runner is None:
            return {}
        runner.request_close()
        # the runner's state was cleared: none would stop it later, so an interrupt
        # (Ctrl-C, again and again) stops the waiting, not the stopping
        interrupt = None
        if thread is not None:
            interrupt = to_the_end(thread.join, lambda: runner.request_close(abandon=True))
        kept = runner.hand_over(keep) if keep and interrupt is None else {}
        try:
            runner.close()  # raises its own first interrupt once done
        finally:
            with self._lock:  # its batches stay counted
                self._batches_before = added_counts(self._batches_before, runner.batch_counts())
                self._closing = None
        if interrupt is not None:
            raise interrupt
        return kept

    def batch_counts(self) -> dict[int, dict[int, int]]:
        """The batches each stage ran since this chain was made, counted by rows (stage
        index -> rows -> batches), as the stages reported them when runs stopped:
        chains stopped and started again included, the one that binds included (any
        thread)."""
        with self._lock:
            counts = self._batches_before
            for runner in (self._closing, self._runner):
                if runner is not None:
                    counts = added_counts(counts, runner.batch_counts())
        return counts

    def _starting(self, kind: str, fields: dict[str, Any]) -> None:
        """The chain's events as it starts: each stage bound, to ``on_load`` (the chain's
        thread; none once it is warm, when each run's stages say they are ready)."""
        on_load = self.on_load
        if on_load is not None and not self._warm:
            stage = ready_stage(kind, fields)
            if stage is not None:
                on_load(stage, 1, 1)

    def _bind_all(self) -> None:
        """One run of one token: every stage binds its slice; ``ChainError`` naming the
        fault if it fails."""
        prompt = (self.tokenizer.vocab.bos_id or 0,)
        outcome = self.bind_run = self._run(prompt, 1, SamplingConfig(), None, None)
        result = outcome.result
        if result.outcome != "completed":
            self.trouble = f"the stages could not be bound: {result.fault or result.outcome}"
            raise ChainError(self.trouble)
        self._warm = True
        self.trouble = None
        log.info("warm: %d stages bound in %.2f s", len(self.layout), result.wall_s)

    def recover(self) -> tuple[int, ...]:
        """Start the chain again when it broke (after a chain fault, so that the next
        request finds it warm); the stage indices started."""
        self._not_on_chain_thread("recover")
        if self._closed:
            return ()
        with self._heal_lock:
            return self._heal()
