"""The chain runner: the stages of one chain, started once, and the orchestrator of
every run on it (CONCURRENT_RUNS.md), in one event loop.

``ChainRunner(template, ...)`` starts every stage of ``template``'s layout through a
``StageHost`` (by default ``hosts.local.LocalProcessHost``: one OS process per stage),
each with its control channel and the chain's secret (from which every party derives
the chain's id, ``keys.chain_id``, that names the chain's links: one per hop,
``edges.links``). ``loop()`` then drives ``ChainOrchestrator``: it waits, with a bound,
on the stages' control channels, its two token links and a wake-up pipe, and on each
run's timers. Runs are handed in from any thread (``submit``: a ``ChainRun`` whose
tokens go to its ``on_token`` as they come and whose ``wait()`` gives its outcome;
``ChainRun.cancel``), through a lock-guarded queue and a byte on the wake-up pipe; the
loop adds them at its next turn, so a run joins the stages' batches at their next step
and leaves when it ends.

Kept stages (issue 25). A chain re-placed after a loss keeps the stages whose node and
layer range are unchanged: ``kept`` hands the new runner those stages' handles, taken
from the broken runner (``hand_over``, which its ``close`` then leaves alone). ``start``
starts only the other stages; to each kept one it hands the new chain's secret through
its host (``hosts.port.JoinsChains``) and sends ``JoinChain``: the stage lets go of the
old chain's links and makes the new chain's, its process, worker and weights kept. The
old chain's links are freed by name when the broken runner closes, as ever.

Runs that wait for KV memory (``kv_waits``; a runner given ``run_ids``, as a warm
chain's is): a run that a stage refused (``ProvisionRefused``) while other runs held KV
cache on it does not end; it is offered again, under a new run id, when another run on
the chain ends (``ChainRun.former_ids``: its ids before). One that could never fit ends
faulted, its fault naming its size against the stage's whole budget.

Faults. A run's own fault ends that run alone. A stage whose control channel reaches end
of file has died (however it died, SIGKILL included): ``StageDied``, and a stage that
sends nothing, not even a heartbeat, for ``timeouts.heartbeat_ms`` is killed and is
``StageSilent``; either one, or a token link that breaks or stays full past
``edge_wait_ms``, is a fault of the chain: every run in flight ends ``FAULTED`` naming
the stage, its node, its host and the cause, and the chain is ``dead``: its owner makes
a new one (``serve.chain.WarmChain``). ``close()`` cancels what runs, waits for the
stages' ``StageStopped`` (each run's stop bound), closes the control channels (the
stages exit), reaps every stage (killed after a grace), and frees every resource of the
chain's links by name through the host, also those whose owner was killed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
from attrs import frozen

from runplan import RunPlan
from runplan.fsm import orchestrator as fsm
from runplan.messages import JoinChain, ProvisionStage, StopReason, StopRun
from runplan.plan import EdgePlan, OrchestratorEndpoint
from runplan.shards import SliceParts
from runtime_core.chain_orchestrator import (
    ChainOrchestrator,
    RunHandle,
    RunRefused,
    RunTimerFired,
)
from runtime_cupy.edges.choice import choose_medium
from runtime_cupy.edges.links import ProcessLinks, chain_hops
from runtime_cupy.hosts.local import LocalProcessHost
from runtime_cupy.hosts.port import JoinsChains, StageHandle, StageHost, StageLaunch
from runtime_cupy.process.control_channel import ChannelBroken, Incoming, Refused, Unreadable
from runtime_cupy.process.keys import chain_id, control_key, new_secret
from runtime_cupy.process.kv_waits import KvWaits
from runtime_cupy.process.names import run_label
from runtime_cupy.process.poller import IN, OUT, TROUBLE, Entry, Watch
from runtime_cupy.process.timers import RunDeadlines
from runtime_cupy.process.tracing import Event, TraceLog

log = logging.getLogger("runtime_cupy.process.chain_runner")

ORCHESTRATOR = "orchestrator"
RETRY_S = 0.002  # retry opening the token links
IDLE_WAKE_S = 0.5  # look at the stage processes at least this often
EXIT_GRACE_S = 3.0  # after the chain closed, how long stages get to exit before a kill
REAP_S = 5.0  # how long to wait for a killed stage

#: ``on_event(kind, fields)``: what the runner did (spawned, state, injected, ...).
OnEvent = Callable[[str, dict[str, Any]], None]
#: ``on_token(token_id)``: a run's next token, from the loop's thread.
OnToken = Callable[[int], None]
#: ``on_logits(logits)``: the raw logits the next token was sampled from (a run whose
#: plan returns logits), just before its ``on_token``, from the loop's thread.
OnLogits = Callable[[npt.NDArray[np.float32]], None]


@frozen
class RunOutcome:
    """How one run on the chain ended: its ``RunFinished`` (``None`` only when the loop
    broke off), its tokens and logits, and its times on the monotonic clock."""

    finished: fsm.RunFinished | None
    tokens: tuple[int, ...]
    logits: tuple[npt.NDArray[np.float32], ...]
    submitted_s: float
    ready_s: float | None  # its readiness barrier passed
    token_times_s: tuple[float, ...]
    ended_s: float


class ChainRun:
    """One run handed to the runner: ``cancel()`` and ``wait()`` from any thread."""

    def __init__(
        self,
        runner: ChainRunner,
        plan: RunPlan,
        prompt: tuple[int, ...],
        on_token: OnToken | None,
        on_done: Callable[[ChainRun], None] | None = None,
        on_logits: OnLogits | None = None,
    ) -> None:
        self.runner = runner
        self.on_done = on_done
        self.on_logits = on_logits
        self.plan = plan
        self.prompt = prompt
        self.on_token = on_token
        self.submitted_s = time.monotonic()
        self.ready_s: float | None = None
        self.token_times: list[float] = []
        self.handle: RunHandle | None = None
        self.outcome: RunOutcome | None = None
        self.error: Exception | None = None  # refused by the chain (PromptError, RunRefused)
        self.former_ids: tuple[str, ...] = ()  # its ids before it waited for KV memory
        self._done = threading.Event()

    @property
    def run_id(self) -> str:
        return self.plan.run_id

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self, why: str = "cancelled") -> None:
        """End this run (its caller went away, a stop string came); the others go on."""
        self.runner.cancel(self.run_id, why)

    def wait(self, timeout_s: float | None = None) -> RunOutcome | None:
        """The run's outcome once it ended (``None`` on timeout); raises what refused it."""
        self._done.wait(timeout_s)
        if self.error is not None:
            raise self.error
        return self.outcome

    def _token(self, run_id: str, sequence: int, token_id: int) -> None:
        self.token_times.append(time.monotonic())
        handle = self.handle
        if self.on_logits is not None and handle is not None and handle.logits:
            # Handed over, not kept: a long answer's logits would fill the memory.
            self.on_logits(handle.logits.pop())
        if self.on_token is not None:
            self.on_token(token_id)

    def _end(self) -> None:
        handle = self.handle
        finished = handle.finished if handle is not None else None
        tokens = handle.tokens if handle is not None else ()
        logits = tuple(handle.logits[: len(tokens)]) if handle is not None else ()
        self.outcome = RunOutcome(
            finished,
            tokens,
            logits,
            self.submitted_s,
            self.ready_s,
            tuple(self.token_times),
            time.monotonic(),
        )
        self._finish()

    def _refused(self, exc: Exception) -> None:
        self.error = exc
        self._finish()

    def _ended_unstarted(self, finished: fsm.RunFinished) -> None:
        """Ended before the chain took it (``finished``: its outcome and fault)."""
        self.outcome = RunOutcome(finished, (), (), self.submitted_s, None, (), time.monotonic())
        self._finish()

    def _finish(self) -> None:
        self._done.set()
        if self.on_done is not None:
            try:
                self.on_done(self)
            except Exception:  # the caller's: the chain goes on
                log.exception("run %s: on_done failed", run_label(self.run_id))


@attrs.define(eq=False)
class _Stage:
    """The runner's state of one stage: its host's handle and what befell it."""

    handle: StageHandle
    gone: bool = False  # its death was fed to the orchestrator
    broken: str | None = None  # a send failed

    @property
    def index(self) -> int:
        return self.handle.stage_index

    @property
    def node_id(self) -> str:
        return self.handle.node_id


class _Channels:
    """The orchestrator's ``StageChannels``. A failed send is noted and handled by the
    loop (the machines are not re-entered from inside their own actions)."""

    def __init__(self, runner: ChainRunner) -> None:
        self.runner = runner

    def send(self, node_id: str, message: ProvisionStage | StopRun) -> None:
        stage = self.runner.stage_by_node.get(node_id)
        if stage is None or stage.gone or stage.handle.channel.eof:
            return
        self.runner.trace.instant(f"send {type(message).__name__}", to=node_id)
        try:
            stage.handle.channel.send(message)
        except ChannelBroken as exc:
            stage.broken = f"control channel broke ({exc})"


class ChainRunner:
    """The stages of ``template``'s layout (every run on the chain has the same stage
    facts: nodes, layer ranges, GGUF source, cache length, budgets) and the loop of the
    runs on them. ``worker`` is the registry's name of the stages' worker; ``devices[i]``
    the GPU of stage ``i`` on its machine; ``host`` starts the stages; ``edges`` is
    ``auto``, ``shm`` or ``tcp`` (``encrypt_edges``: TCP links encrypt their frames, not
    only authenticate them)."""

    def __init__(
        self,
        template: RunPlan,
        *,
        worker: str = "numpy",
        devices: Sequence[int | None] | None = None,
        host: StageHost | None = None,
        edges: str = "auto",
        encrypt_edges: bool = False,
        trace: bool = False,
        on_event: OnEvent | None = None,
        secret: bytes | None = None,
        kept: Mapping[int, StageHandle] | None = None,
        generation: int = 0,
        run_ids: Callable[[], str] | None = None,
    ) -> None:
        # ``kept``: stages of a chain this one replaces, by stage index, that join this
        # chain instead of being started (``hosts.port.JoinsChains`` handles of the same
        # node, index and layers); ``generation``: the chain's re-placements so far.
        self.template = template
        self.kept = dict(kept or {})
        self.generation = generation
        for index, handle in self.kept.items():
            stage = template.stages[index] if 0 <= index < template.stage_count else None
            if (
                stage is None
                or stage.node_id != handle.node_id
                or not isinstance(handle, JoinsChains)
            ):
                raise ValueError(f"stage {index} ({handle.node_id!r}) cannot join this chain")
        self.worker = worker
        self.devices = tuple(devices) if devices is not None else (None,) * template.stage_count
        if len(self.devices) != template.stage_count:
            raise ValueError(f"{len(self.devices)} devices for {template.stage_count} stages")
        self.host: StageHost = host or LocalProcessHost()
        self.encrypt_edges = encrypt_edges
        self.media = {e.edge_id: self._medium(e, edges) for e in template.edges}  # ValueError
        self.secret = secret if secret is not None else new_secret()
        self.chain_id = chain_id(self.secret)
        self.on_event = on_event
        self.trace = TraceLog(ORCHESTRATOR, enabled=trace)
        self._stage_events: list[Event] = []
        self._trace_from = 0  # the orchestrator's events before it were handed out
        self.links = ProcessLinks(
            self.host.medium(self.media[template.token_out.edge_id], encrypt_edges),
            self.host.medium(self.media[template.token_in.edge_id], encrypt_edges),
            self.secret,
            self.chain_id,
        )
        self.timers: RunDeadlines[fsm.Timer] = RunDeadlines()
        self.stages: list[_Stage] = []
        self.stage_by_node: dict[str, _Stage] = {}
        self.orchestrator = ChainOrchestrator(
            _Channels(self), self.links, self.timers, trace=self._on_trace
        )
        self._lock = threading.Lock()
        self._adds: list[ChainRun] = []
        self._cancels: list[tuple[str, str]] = []
        self._runs: dict[str, ChainRun] = {}  # submitted and not yet ended
        #: Runs refused for KV memory that wait for another run's end (``kv_waits``;
        #: ``None``: no ``run_ids``, such a run ends faulted).
        self.kv_waits = KvWaits(run_ids) if run_ids is not None else None
        self._closing = False
        self._abandon = False
        self._over = False  # the loop returned for good: nothing takes a run handed over
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._waiter = Watch()
        self._open_at = 0.0
        self._inject_since: float | None = None
        self.closed = False
        #: Why the chain cannot serve any more (a chain fault), once it cannot.
        self.dead: str | None = None

    def _medium(self, edge: EdgePlan, preference: str) -> str:
        def node(endpoint: Any) -> str:
            if isinstance(endpoint, OrchestratorEndpoint):
                return self.template.orchestrator_node_id
            return str(endpoint.node_id)

        same = self.host.same_host(node(edge.producer), node(edge.consumer))
        return choose_medium(preference, same, edge.edge_id)

    @property
    def media_names(self) -> tuple[str, ...]:
        """How each edge of the layout moves its bytes, in plan order."""
        return tuple(self.media[e.edge_id] for e in self.template.edges)

    # -- events ----------------------------------------------------------------------------
    def _emit(self, kind: str, **fields: Any) -> None:
        if self.on_event is not None:
            self.on_event(kind, fields)

    def _on_trace(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == "state":
            run = self._runs.get(str(fields.get("run_id")))
            log.info(
                "run %s: %s -> %s (%s)",
                run_label(str(fields.get("run_id"))),
                fields["from"],
                fields["to"],
                fields["event"],
            )
            if fields["to"] == "RUNNING" and run is not None and run.ready_s is None:
                run.ready_s = time.monotonic()
        elif kind == "reject":
            log.warning("orchestrator rejected %s", {k: str(v) for k, v in fields.items()})
        elif kind == "protocol_violation":
            log.warning(
                "orchestrator protocol violation: %s in %s", fields["kind"], fields["state"]
            )
        elif kind == "chain_fault":
            log.warning("chain fault: %s", fields["reason"])
        if self.trace.enabled:
            self.trace.instant(kind, **{k: str(v) for k, v in fields.items()})
        if self.on_event is not None:
            self.on_event(kind, fields)

    # -- the stages ------------------------------------------------------------------------
    def start(self) -> None:
        """Start every stage of the chain but the kept ones, which join it (``OSError``
        if one cannot be started or joined; those started are then stopped by
        ``close``)."""
        plan = self.template
        for stage in plan.stages:
            if stage.stage_index in self.kept:
                self._join(self.kept[stage.stage_index])
                continue
            launch = StageLaunch(
                run_id=self.chain_id,
                stage_index=stage.stage_index,
                stage_count=plan.stage_count,
                host_stages=sum(
                    self.host.same_host(other.node_id, stage.node_id) for other in plan.stages
                ),
                node_id=stage.node_id,
                orchestrator_id=plan.orchestrator_node_id,
                worker=self.worker,
                inbound_medium=self.media[stage.inbound_edge],
                outbound_medium=self.media[stage.outbound_edge],
                stop_ms=plan.timeouts.stop_ms,
                heartbeat_ms=plan.timeouts.heartbeat_ms,
                device=self.devices[stage.stage_index],
                trace=self.trace.enabled,
                warm=True,
                encrypt_edges=self.encrypt_edges,
                source=plan.model.gguf_source,
                parts=SliceParts.of_stage(stage),
            )
            kept = _Stage(self.host.start(launch, self.secret))
            self.stages.append(kept)
            self.stage_by_node[kept.node_id] = kept
            pid = kept.handle.info().pid
            log.info("stage %d (%s) started: pid %d", kept.index, kept.node_id, pid)
            self._emit(
                "spawned",
                stage_index=kept.index,
                node_id=kept.node_id,
                pid=pid,
                chain_id=self.chain_id,
            )

    def _join(self, handle: StageHandle) -> None:
        """A kept stage joins this chain: the new secret through its host, then
        ``JoinChain`` on its control channel (``OSError`` if either cannot go)."""
        assert isinstance(handle, JoinsChains)
        index = handle.stage_index
        stage = self.template.stages[index]
        handle.hand_secret(self.secret)
        join = JoinChain(
            node_id=stage.node_id,
            stage_index=index,
            stage_count=self.template.stage_count,
            inbound_medium=self.media[stage.inbound_edge],
            outbound_medium=self.media[stage.outbound_edge],
            generation=self.generation,
        )
        self.trace.instant("send JoinChain", to=stage.node_id)
        try:  # the channel's key changes with the secret (control_channel.py says how)
            handle.channel.send_join(join, control_key(self.secret, stage.node_id))
        except ChannelBroken as exc:
            raise OSError(f"stage {index} cannot be told to join: {exc}") from exc
        kept = _Stage(handle)
        self.stages.append(kept)
        self.stage_by_node[kept.node_id] = kept
        pid = handle.info().pid
        log.info("stage %d (%s) kept: pid %d joins the chain", index, kept.node_id, pid)
        self._emit("joined", stage_index=index, node_id=kept.node_id, pid=pid)

    def handles(self) -> tuple[StageHandle, ...]:
        return tuple(s.handle for s in self.stages)

    @property
    def gone_stages(self) -> frozenset[int]:
        """The stages known gone: died, or silent and killed."""
        return frozenset(s.index for s in self.stages if s.gone)

    def hand_over(self, indices: Sequence[int]) -> dict[int, StageHandle]:
        """Take the live stages of ``indices`` out of this (broken, no longer looping)
        runner for a new chain to keep: ``close`` leaves them running. A stage gone,
        exited or whose channel broke is not handed over."""
        out: dict[int, StageHandle] = {}
        for stage in list(self.stages):
            if stage.index not in indices or stage.gone or stage.broken is not None:
                continue
            if not isinstance(stage.handle, JoinsChains):  # its host cannot re-key it
                continue
            if stage.handle.exited() or stage.handle.channel.eof:
                continue
            self.stages.remove(stage)
            del self.stage_by_node[stage.node_id]
            self._stage_events += stage.handle.trace_events()
            out[stage.index] = stage.handle
        return out

    @property
    def whole(self) -> bool:
        """Every stage started and none known gone, and no chain fault (any thread)."""
        return (
            self.dead is None
            and bool(self.stages)
            and not any(s.gone or s.handle.exited() for s in self.stages)
        )

    # -- any thread --------------------------------------------------------------------------
    def submit(
        self,
        plan: RunPlan,
        prompt: Sequence[int],
        on_token: OnToken | None = None,
        *,
        on_done: Callable[[ChainRun], None] | None = None,
        on_logits: OnLogits | None = None,
    ) -> ChainRun:
        """Hand a run to the loop (any thread); it starts at the loop's next turn, or
        ends at once refused (``ChainRun.wait`` raises ``PromptError`` or
        ``RunRefused``) or faulted (the chain is dead or closing). ``on_done(run)``
        when it ended (from the loop's thread); ``on_logits`` takes each token's logits
        (a plan that returns them), which the run's outcome then does not hold."""
        run = ChainRun(self, plan, tuple(int(t) for t in prompt), on_token, on_done, on_logits)
        with self._lock:
            late = self._over
            if not late:
                self._adds.append(run)
        if late:
            self._end_late(run)
        else:
            self._wake()
        return run

    def _end_late(self, run: ChainRun) -> None:
        """A run handed over once the loop returned for good (the chain dead, closing or
        closed): it ends at once, as the loop's next turn would have ended it, faulted
        with the chain's fault (``ChainOrchestrator.add_run``'s) or refused as closing.
        It waited for ever: a stage that died as the chain came up ended the loop before
        the run that binds the stages was handed over."""
        broken = self.orchestrator.broken
        if broken is not None and not self._closing:
            log.info("run %s: the chain is dead: %s", run_label(run.run_id), self.dead)
            run._ended_unstarted(fsm.RunFinished(StopReason.FAULTED, (), broken, None, ()))
        else:
            run._refused(
                RuntimeError(f"the chain is closing{f': {self.dead}' if self.dead else ''}")
            )

    def cancel(self, run_id: str, why: str = "cancelled") -> None:
        """End one run (any thread, or a signal handler)."""
        with self._lock:
            self._cancels.append((run_id, why))
        self._wake()

    def request_close(self, *, abandon: bool = False) -> None:
        """Ask the loop to cancel every run and return once they ended (any thread);
        ``abandon``: return at once, not waiting for the stages' stops."""
        self._closing = True
        self._abandon = self._abandon or abandon
        self._wake()

    def _wake(self) -> None:
        # Under the lock that close() takes to close the pipe: never a write to a
        # descriptor closed (and perhaps reused by then).
        with self._lock, contextlib.suppress(OSError):
            if self._wake_w >= 0:
                os.write(self._wake_w, b"!")

    def batch_counts(self) -> dict[int, dict[int, int]]:
        """The batches each stage reported so far in its ``StageStopped`` messages:
        stage index -> rows -> batches (any thread; not to be changed)."""
        return self.orchestrator.batch_counts

    def kv_in_use(self) -> tuple[tuple[int, int, int], ...]:
        """Each stage's KV cache held by the runs in flight: ``(stage_index, bytes,
        budget_bytes)`` (any thread)."""
        held = self.orchestrator.kv_reserved()
        return tuple(
            (s.stage_index, held.get(s.stage_index, 0), s.kv_budget_bytes)
            for s in self.template.stages
        )

    @property
    def in_flight(self) -> int:
        """Runs submitted and not yet ended."""
        return len(self._runs) + len(self._adds) + len(self.kv_waits or ())

    # -- the loop ---------------------------------------------------------------------------
    def loop(self, until: Callable[[], bool] | None = None) -> None:
        """Drive the chain until ``until()`` holds, or until it was asked to close (or is
        dead) and no run is left (in the thread that owns the runner)."""
        o = self.orchestrator
        cancelled_all = False
        with self._lock:
            self._over = False
        while True:
            self._take_handoffs()
            for stage in self.stages:
                if stage.broken is not None and not stage.gone:
                    self._stage_died(stage, stage.broken)
            if self._closing and not cancelled_all:
                cancelled_all = True
                for run_id in list(o.runs):
                    o.cancel(run_id, "the chain is closing")
            now = time.monotonic()
            if o.links_pending and now >= self._open_at and not o.try_open_links():
                self._open_at = now + RETRY_S
            if o.inject_pending:
                self._inject(now)
            else:
                self._inject_since = None
            while o.wants_tokens and o.poll_tokens():
                pass
            self._end_runs()
            if o.broken is not None and self.dead is None:
                self.dead = str(o.broken)
            if self._closing or self.dead is not None:
                self._end_held()
            if until is not None and until():
                return
            if (self._closing or self.dead is not None) and not self._runs and self._end_loop():
                return
            if self._abandon and self._end_loop(abandon=True):
                return
            self._wait()

    def _end_loop(self, *, abandon: bool = False) -> bool:
        """Whether the loop returns for good now: not while a run handed over waits to be
        taken (unless ``abandon``); from then on ``submit`` ends a run at once."""
        with self._lock:
            if self._adds and not abandon:
                return False
            self._over = True
            return True

    def _take_handoffs(self) -> None:
        with self._lock:
            adds, self._adds = self._adds, []
            cancels, self._cancels = self._cancels, []
        o = self.orchestrator
        for run in adds:
            if self._closing:
                run._refused(RuntimeError("the chain is closing"))
                continue
            if run.plan.token_out.ring_spec != self.template.token_out.ring_spec:
                run._refused(
                    RunRefused(
                        run.run_id,
                        "its token-out records (with or without logits) are not the chain's",
                    )
                )
                continue
            try:
                run.handle = o.add_run(run.plan, run.prompt, on_token=run._token)
            except ValueError as exc:  # PromptError, RunRefused
                run._refused(exc)
                continue
            self._runs[run.run_id] = run
            log.info("run %s added (%d in flight)", run_label(run.run_id), len(self._runs))
        for run_id, why in cancels:
            held = self.kv_waits.take(run_id) if self.kv_waits is not None else None
            if held is not None:
                finished = fsm.RunFinished(StopReason.CANCELLED, (), None, None, ())
                held._ended_unstarted(finished)
                continue
            o.cancel(self._current_id(run_id), why)

    def _current_id(self, run_id: str) -> str:
        """The id of the run that had ``run_id`` before it waited for KV memory and was
        offered again (``run_id`` itself when none did)."""
        if run_id in self.orchestrator.runs:
            return run_id
        again = next((r for r in self._runs.values() if run_id in r.former_ids), None)
        return again.run_id if again is not None else run_id

    def _end_runs(self) -> None:
        waits = self.kv_waits
        for run_id, run in list(self._runs.items()):
            if run.handle is not None and run.handle.finished is not None:
                del self._runs[run_id]
                live = not self._closing and self.dead is None
                if waits is not None and live and waits.holds(run):
                    log.info("run %s waits for KV memory", run_label(run_id))
                    continue
                run._end()
                if waits is not None:
                    waits.ended()
        if waits is not None and not self._closing and self.dead is None:
            for run in waits.due():
                self._offer_again(run)

    def _offer_again(self, run: ChainRun) -> None:
        """A run held for KV memory is offered to the chain again (its new run id)."""
        try:
            run.handle = self.orchestrator.add_run(run.plan, run.prompt, on_token=run._token)
        except ValueError as exc:  # not for the plan it was first added with
            run._refused(exc)
            return
        self._runs[run.run_id] = run
        log.info("run %s offered again for KV memory", run_label(run.run_id))

    def _end_held(self) -> None:
        """The chain closes or is dead: the runs held for KV memory end (cancelled, or
        faulted with the chain's fault)."""
        if self.kv_waits is None:
            return
        broken = self.orchestrator.broken
        for run in self.kv_waits.take_all():
            if broken is not None and not self._closing:
                run._ended_unstarted(fsm.RunFinished(StopReason.FAULTED, (), broken, None, ()))
            else:
                finished = fsm.RunFinished(StopReason.CANCELLED, (), None, None, ())
                run._ended_unstarted(finished)

    def _inject(self, now: float) -> None:
        o = self.orchestrator
        if o.try_inject():
            self._inject_since = None
            return
        if self._inject_since is None:
            self._inject_since = now
        elif now - self._inject_since > self.template.timeouts.edge_wait_ms / 1000.0:
            self._inject_since = None
            o.link_fault("token-in: no free slot in time")

    def _where(self, stage: _Stage) -> str:
        info = stage.handle.info()
        return f"node {stage.node_id!r} on host {info.host or 'this machine'} (pid {info.pid})"

    def _stage_died(
        self, stage: _Stage, note: str | None = None, *, cause: str | None = None
    ) -> None:
        """``stage`` is gone: ``cause`` why (this runner ended it), else how its process
        ended, else ``note``."""
        if stage.gone:
            return
        stage.gone = True
        if cause is None:
            stage.handle.wait(0.5)  # say how it died (a killed process is reaped at once)
        why = cause or stage.handle.exit_reason() or note or "its control channel closed"
        log.warning("stage %d (%s) is gone: %s", stage.index, stage.node_id, why)
        self.trace.instant("stage died", stage=stage.index, why=why)
        self._emit("stage_died", stage_index=stage.index, detail=why)
        where = self._where(stage)
        self.dead = self.dead or f"stage {stage.index} ({where}) is gone: {why}"
        self.orchestrator.handle(fsm.StageDied(stage.index, f"{where}: {why}"))

    def _stage_silent(self, stage: _Stage, silent_s: float) -> None:
        stage.gone = True
        stage.handle.kill()
        event = fsm.StageSilent(
            stage.index, int(silent_s * 1000), stage.handle.channel.heard_s is not None
        )
        why = event.why()
        log.warning("stage %d (%s) is silent: %s; killed", stage.index, stage.node_id, why)
        self.trace.instant("stage silent", stage=stage.index, why=why)
        self._emit("stage_silent", stage_index=stage.index, silent_s=silent_s)
        self.dead = self.dead or f"stage {stage.index} on {stage.node_id!r}: {why}"
        self.orchestrator.handle(event)

    def _check_silence(self, now: float) -> None:
        bound = self.template.timeouts.heartbeat_ms / 1000.0
        for stage in self.stages:
            silent = stage.handle.channel.silent_s(now)
            if not stage.gone and silent is not None and silent > bound:
                # What came while this process did not run (stopped, swapped out, a slow
                # callback) since its poll is heard first: the silence may be its own.
                self._read_control(stage)
                silent = stage.handle.channel.silent_s(time.monotonic())
                if not stage.gone and silent is not None and silent > bound:
                    self._stage_silent(stage, silent)

    def _silence_the_unheard(self) -> None:
        """A run was not ready in time: a stage that has not said a word since it
        started (stopped or stuck before its first beat) is taken for silent and killed.
        It holds no step, and nothing else would end the run's teardown for it but the
        stop bound (minutes)."""
        for stage in self.stages:
            if not stage.gone and stage.handle.channel.heard_s is None:
                self._read_control(stage)  # what came meanwhile is heard first
                if not stage.gone and stage.handle.channel.heard_s is None:
                    self._stage_silent(stage, self.template.timeouts.ready_ms / 1000.0)

    def _wait(self) -> None:
        o = self.orchestrator
        channels: dict[int, _Stage] = {}
        entries: list[Entry] = [(self._wake_r, IN)]
        for stage in self.stages:
            channel = stage.handle.channel
            if not stage.gone and channel.fileno() >= 0:
                mine = channel.watch()
                if mine:
                    channels[channel.fileno()] = stage
                    entries += mine
        entries += self.links.watch(want_input=o.wants_tokens, want_space=o.inject_pending)
        now = time.monotonic()
        until = now + IDLE_WAKE_S
        due = self.timers.next_due()
        if due is not None and due < until:
            until = due
        bound = self.template.timeouts.heartbeat_ms / 1000.0
        for stage in self.stages:
            heard = stage.handle.channel.heard_s
            if not stage.gone and heard is not None:
                until = min(until, heard + bound)
        if o.links_pending:
            until = min(until, self._open_at)
        if self._inject_since is not None:
            until = min(until, self._inject_since + self.template.timeouts.edge_wait_ms / 1000.0)
        ready = self._waiter.poll(tuple(entries), (until - now) * 1000.0)
        for fd, events in ready:
            if fd == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            elif fd in channels:
                stage = channels[fd]
                if events & OUT:
                    try:
                        stage.handle.channel.flush()
                    except ChannelBroken as exc:
                        stage.broken = f"control channel broke ({exc})"
                if events & (IN | TROUBLE):
                    self._read_control(stage)
            else:
                self.links.ready(fd, events)
        for run_id, timer in self.timers.expired(time.monotonic()):
            log.warning("run %s: orchestrator timer %s ran out", run_label(run_id), timer.name)
            o.handle(RunTimerFired(run_id, timer))
            if timer is fsm.Timer.READY:
                self._silence_the_unheard()
        self._check_silence(time.monotonic())  # after reading: what waited was heard
        if not ready:
            for stage in self.stages:  # a stage gone without closing its channel
                if not stage.gone and stage.handle.exited():
                    self._stage_died(stage)

    def _read_control(self, stage: _Stage) -> None:
        channel = stage.handle.channel
        for item in channel.receive():
            if stage.gone:  # ended by an item before: what it sent after is not heard
                break
            if isinstance(item, Incoming) and item.sender != stage.node_id:
                log.warning(
                    "refused a frame on stage %d's channel signed as %r", stage.index, item.sender
                )
            elif isinstance(item, Incoming):
                name = type(item.message).__name__
                log.info("received %s from %r", name, item.sender)
                self.trace.instant(f"recv {name}", sender=item.sender)
                self._emit("received", sender=item.sender, message=item.message)
                if self.kv_waits is not None:
                    run = self._runs.get(str(getattr(item.message, "run_id", "")))
                    self.kv_waits.heard(item.message, run, self.orchestrator.kv_reserved())
                self.orchestrator.handle(fsm.Received(item.sender, item.message))
            elif isinstance(item, Unreadable):  # signed: the stage's own
                log.error("stage %d's frame could not be read: %s", stage.index, item.reason)
                stage.handle.kill()  # it speaks what this orchestrator cannot follow
                self._stage_died(stage, cause=f"its frame could not be read ({item.reason})")
            elif isinstance(item, Refused):
                log.warning("refused a frame from stage %d: %s", stage.index, item.reason)
        if channel.eof:
            self._stage_died(stage)

    # -- the end ---------------------------------------------------------------------------
    def close(self) -> None:
        """Cancel what runs (waiting for the stages' stops unless abandoned), then stop
        every stage, reap it (killed after a grace) and free the chain's links by name.
        From the loop's thread, once ``loop`` returned (or was never run). Idempotent."""
        if self.closed:
            return
        if self._runs or self._adds:
            self.request_close()
            with contextlib.suppress(Exception):
                self.loop()
        self.closed = True
        for run in list(self._runs.values()):  # the loop broke off: they end unfinished
            run._end()
        self._runs.clear()
        self._end_held()
        with self._lock:
            adds, self._adds = self._adds, []
            self._over = True
        for run in adds:
            run._refused(RuntimeError("the chain is closing"))
        for stage in self.stages:  # what waits to leave goes, then the channel closes
            with contextlib.suppress(OSError):
                stage.handle.channel.flush()
            with contextlib.suppress(OSError):
                stage.handle.channel.close()
        deadline = time.monotonic() + EXIT_GRACE_S
        for stage in self.stages:
            stage.handle.wait(deadline - time.monotonic())
        for stage in self.stages:
            if not stage.handle.exited():
                log.warning("stage %d (%s) did not exit: killing it", stage.index, stage.node_id)
                stage.handle.kill()
        for stage in self.stages:
            stage.handle.wait(REAP_S)
            self._stage_events += stage.handle.trace_events()
            stage.handle.close()
        self.orchestrator.close()
        self.links.detach()
        self._waiter.forget()
        self.host.cleanup(self.chain_id, chain_hops(self.template.stage_count))
        with self._lock:
            fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def trace_events(self) -> list[Event]:
        """The Chrome trace events of the orchestrator and of every stage since the last
        call (the first call's: since the chain started)."""
        if not self.closed:
            for stage in self.stages:
                self._stage_events += stage.handle.trace_events()
        mine, self._trace_from = self.trace.events[self._trace_from :], len(self.trace.events)
        theirs, self._stage_events = self._stage_events, []
        return self.trace.metadata() + mine + theirs
