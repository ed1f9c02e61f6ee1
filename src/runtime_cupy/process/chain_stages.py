"""The stages of a chain runner (``chain_runner.ChainRunner``, whose base
``ChainStages`` is): started, or kept from a re-placed chain, handed over, and watched:
what their control channels bring, their deaths and their silences.

Kept stages (issue 25). A chain re-placed after a loss keeps the stages whose node and
layer range are unchanged: ``kept`` hands the new runner those stages' handles, taken
from the broken runner (``hand_over``, which its ``close`` then leaves alone). ``start``
starts only the other stages; to each kept one it hands the new chain's secret through
its host (``hosts.port.JoinsChains``) and sends ``JoinChain``: the stage lets go of the
old chain's links and makes the new chain's, its process, worker and weights kept. The
old chain's links are freed by name when the broken runner closes, as ever. A kept
stage that does not join (its join failed, or the start broke off before it) is this
runner's to stop and reap at ``close``, as a stage it started.

Faults of the stages. A stage whose control channel reaches end of file has died
(however it died, SIGKILL included): ``StageDied``, and a stage that sends nothing, not
even a heartbeat, for ``timeouts.heartbeat_ms`` is killed and is ``StageSilent``; either
one is a fault of the chain (``chain_runner`` says what follows).

A death is heard before the link it broke. A stage whose neighbour died sees its link
to it break (a TCP reset) and reports an ``EDGE_FAULT``, which can reach the runner
before the dead stage's control channel closes: that report waits until the stages at
either end of the reporter's links have been looked at (``EDGE_PEER_WAIT_S`` at most),
and a neighbour found gone is the chain's fault (``process_died``, naming it) before the
broken link is heard (it was the healthy neighbour's ``edge_fault``, one run in twelve).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from runplan import RunPlan
from runplan.fsm import orchestrator as fsm
from runplan.messages import FaultKind, JoinChain, ProvisionStage, StageFault, StopRun
from runplan.shards import SliceParts
from runtime_core.chain_orchestrator import ChainOrchestrator
from runtime_core.kv_waits import KvWaits
from runtime_cupy.hosts.port import JoinsChains, StageHandle, StageHost, StageLaunch
from runtime_cupy.process.control_channel import ChannelBroken, Incoming, Refused, Unreadable
from runtime_cupy.process.keys import control_key
from runtime_cupy.process.tracing import Event, TraceLog

if TYPE_CHECKING:
    from runtime_cupy.process.chain_run import ChainRun
    from runtime_cupy.process.chain_runner import ChainRunner

# The chain runner's: its log lines keep their logger.
log = logging.getLogger("runtime_cupy.process.chain_runner")

#: How long a stage's report of a broken link waits for a neighbour's death to show
#: (its process reaped), at most: a killed process is reaped within milliseconds.
EDGE_PEER_WAIT_S = 0.25


@attrs.define(eq=False)
class RunnerStage:
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


class RunnerChannels:
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


class ChainStages:
    """The stages of a ``ChainRunner``, its base: what the runner holds of them is set
    by ``ChainRunner.__init__``."""

    template: RunPlan
    kept: dict[int, StageHandle]
    generation: int
    worker: str
    devices: tuple[int | None, ...]
    host: StageHost
    encrypt_edges: bool
    media: dict[int, str]
    secret: bytes
    chain_id: str
    trace: TraceLog
    _stage_events: list[Event]
    stages: list[RunnerStage]
    stage_by_node: dict[str, RunnerStage]
    orchestrator: ChainOrchestrator
    _runs: dict[str, ChainRun]
    kv_waits: KvWaits[ChainRun]
    dead: str | None

    if TYPE_CHECKING:

        def _emit(self, kind: str, **fields: Any) -> None: ...

    def start(self) -> None:
        """Start every stage of the chain but the kept ones, which join it (``OSError``
        if one cannot be started or joined; those started, and the kept ones that did
        not join, are then stopped by ``close``)."""
        try:
            self._start_stages()
        except BaseException:
            self._take_in_unjoined()
            raise

    def _take_in_unjoined(self) -> None:
        """The kept stages that did not join (their join failed, or the start broke off
        before it reached them) become this runner's stages, so that ``close`` stops
        and reaps them and lets go of their handles: no one else holds them (the broken
        runner handed them over), and a dropped handle kept its lifeline's descriptor,
        and on a Ray host its supervisor, for the life of the process."""
        joined = {s.index for s in self.stages}
        for index, handle in sorted(self.kept.items()):
            if index not in joined:
                stage = RunnerStage(handle, broken="it did not join the chain")
                self.stages.append(stage)
                self.stage_by_node[stage.node_id] = stage

    def _start_stages(self) -> None:
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
            kept = RunnerStage(self.host.start(launch, self.secret))
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
        kept = RunnerStage(handle)
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

    def _where(self, stage: RunnerStage) -> str:
        info = stage.handle.info()
        return f"node {stage.node_id!r} on host {info.host or 'this machine'} (pid {info.pid})"

    def _stage_died(
        self, stage: RunnerStage, note: str | None = None, *, cause: str | None = None
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

    def _stage_silent(self, stage: RunnerStage, silent_s: float) -> None:
        stage.gone = True
        event = fsm.StageSilent(
            stage.index, int(silent_s * 1000), stage.handle.channel.heard_s is not None
        )
        why = event.why()
        # the cause first, then the kill: a thread that sees the process gone (the warm
        # chain's health) reads why (it read "gone" when it looked in between)
        self.dead = self.dead or f"stage {stage.index} on {stage.node_id!r}: {why}"
        stage.handle.kill()
        log.warning("stage %d (%s) is silent: %s; killed", stage.index, stage.node_id, why)
        self.trace.instant("stage silent", stage=stage.index, why=why)
        self._emit("stage_silent", stage_index=stage.index, silent_s=silent_s)
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

    def _hear_deaths_first(self, reporter: RunnerStage) -> None:
        """``reporter`` says a link broke: a stage at the other end of one of its links
        that is gone (within ``EDGE_PEER_WAIT_S``) is heard dead first, the cause."""
        peers = [s for s in self.stages if not s.gone and abs(s.index - reporter.index) == 1]
        deadline = time.monotonic() + EDGE_PEER_WAIT_S
        while peers:
            gone = [s for s in peers if s.handle.exited()]
            for peer in gone:
                self._stage_died(peer)
            if gone or time.monotonic() >= deadline:
                return
            time.sleep(0.005)

    def _read_control(self, stage: RunnerStage) -> None:
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
                if isinstance(item.message, StageFault) and (
                    item.message.reason.kind is FaultKind.EDGE_FAULT
                ):
                    self._hear_deaths_first(stage)
                run = self._runs.get(str(getattr(item.message, "run_id", "")))
                self.kv_waits.heard(item.message, run, self.orchestrator.kv_reserved())
                self.orchestrator.handle(fsm.Received(item.sender, item.message))
            elif isinstance(item, Unreadable):  # signed: the stage's own
                log.error("stage %d's frame could not be read: %s", stage.index, item.reason)
                cause = f"its frame could not be read ({item.reason})"
                # a protocol fault of the chain (first: it stands), which recovery does not
                # retry: a stage placed again would speak the same
                self.orchestrator.stage_unreadable(stage.index, f"{self._where(stage)}: {cause}")
                stage.handle.kill()  # it speaks what this orchestrator cannot follow
                self._stage_died(stage, cause=cause)
            elif isinstance(item, Refused):
                log.warning("refused a frame from stage %d: %s", stage.index, item.reason)
        if channel.eof:
            self._stage_died(stage)
