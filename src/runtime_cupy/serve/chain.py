"""Warm stages: the stage processes of one model, started and bound once, serving one
run after another (the spec's deferred "warm reuse", with the MVP's state machines
unchanged).

``WarmChain(model, stages=N).start()`` starts every stage through the host port
(``StageLaunch(warm=True)``: a local process each by default, or whatever host is
given) and makes one short run, which binds every stage's slice; the chain is then
``ready``. Each ``generate(...)`` is one run of the MVP: a new run id, a plan of the
same stages (same nodes, layer ranges, GGUF source and cache length), ``ProvisionStage``
to every stage, the readiness barrier, the prompt, teardown (``launcher.ProcessRun``
over the warm handles). A stage provisioned for a slice it has bound reuses its
weights (``runtime_core.workers.kept_weights``), so a later run's time to first token holds
no load and its trace no ``bind`` span; its KV cache and sampler are the run's own.
The stages' machines keep every stopped run's id stale, so a stale or replayed
message is refused across runs (§10).

A stage that died (killed, or gone after a fault), did not confirm its stop, or whose
fault ended a run is started again, and bound by a short run, before the next request;
the request it broke ends with its fault, which names the stage, node and cause. A
stage whose *setup* failed (a resource name taken, no room for a ring) is kept: the
request ends with that named fault, and the next run, whose names are new, goes on.
Between runs a thread (``idle_watch.IdleWatch``) reads the stages' control channels:
a stage that went silent (no heartbeat within ``timeouts.heartbeat_ms``: stopped, hung)
or away while idle is named at once. Until the chain is whole again it is not
``ready`` and ``trouble`` says why.

With ``ray_address`` (``auto`` or ``HOST:PORT``) the stages live on the hosts of a Ray
cluster (``hosts.ray``, this process its driver), placed as ``runtime_cupy.generate``
places them (``placement`` ``even`` or ``memory``); a stage started again goes to the
node its plan names, under a new supervisor. A stage on a host without the model gets
its slice from this host (``runtime_cupy.slices``), logged as it moves
(``waiting_for`` says what is still on its way).

One run at a time: ``generate`` and ``close`` are for one thread (the server's runner,
or the terminal chat); ``ready`` and a run's ``cancel`` may be called from any.
"""

from __future__ import annotations

import contextlib
import logging
import select
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from attrs import frozen

from runplan import RunPlan, RuntimeConfig, SamplingConfig, model_facts_from_gguf
from runplan.config import Timeouts
from runplan.dtypes import DTypeFamily
from runplan.models import resolve_model
from runplan.plan import OrchestratorEndpoint
from runplan.shards import SliceParts
from runtime_core.runs import PLACEMENTS, plan_even
from runtime_core.tokenizer import Tokenizer
from runtime_cupy.api import GenerateResult, summarize
from runtime_cupy.edges.choice import choose_medium
from runtime_cupy.hosts.local import LocalProcessHost
from runtime_cupy.hosts.port import StageHandle, StageHost, StageLaunch
from runtime_cupy.hosts.this_machine import place_stages
from runtime_cupy.process.control_channel import Incoming
from runtime_cupy.process.keys import new_secret
from runtime_cupy.process.launcher import ORCHESTRATOR, ProcessRun
from runtime_cupy.process.names import new_run_id, run_label
from runtime_cupy.serve.idle_watch import IdleWatch
from runtime_cupy.slices.progress import SliceLog, describe
from runtime_cupy.workers import DEFAULT_WORKER, capabilities

if TYPE_CHECKING:
    from runtime_cupy.hosts.ray.host import RayHost

log = logging.getLogger("runtime_cupy.serve.chain")

CLOSE_GRACE_S = 5.0  # how long stages get to exit once their channels close
REAP_S = 5.0

#: ``on_run(run)``: the run about to start, for its caller to cancel.
OnRun = Callable[[ProcessRun], None]


def _new_serve_run_id() -> str:
    return new_run_id("serve")


class ChainError(RuntimeError):
    """The chain cannot serve: its stages could not be started or bound."""


@frozen
class WarmResult:
    """One run on the warm chain: ``result`` as ``runtime_cupy.generate`` returns it,
    ``started_s`` and ``first_token_s`` on the monotonic clock (run start to its
    first token: provisioning, barrier, prefill), and the stages started again before
    the run (``restarted``, by index)."""

    result: GenerateResult
    prompt_tokens: int
    started_s: float
    first_token_s: float | None
    restarted: tuple[int, ...] = ()

    @property
    def ttft_s(self) -> float | None:
        """Time to first token from the start of the run."""
        return None if self.first_token_s is None else self.first_token_s - self.started_s


class WarmChain:
    """The stages of ``model`` split evenly over ``stages`` processes of ``worker``,
    kept warm. ``context``: the cache length of every run (default: the model's
    context length); a run's prompt plus its tokens must fit it. ``host`` starts the
    stages (default: ``LocalProcessHost`` with ``log_dir``); ``ray_address``: on the
    hosts of that Ray cluster instead, the layers split by ``placement`` (``even`` or
    ``memory``); ``edges``: ``auto``, ``shm`` or ``tcp`` (``encrypt_edges``: TCP edges
    encrypt their frames, not only authenticate them); ``trace``: record Chrome
    trace events of every run. ``run_ids()`` gives each run its id (by default 128
    random bits, ``names.new_run_id``: the id names the run's resources on its hosts,
    so it must be as hard to guess). Raises ``ClusterError`` for a cluster that cannot
    be reached or has no room, before any process starts."""

    def __init__(
        self,
        model: str,
        *,
        stages: int = 3,
        worker: str = DEFAULT_WORKER,
        gpus: Sequence[int] | None = None,
        edges: str = "auto",
        host: StageHost | None = None,
        context: int | None = None,
        timeouts: Timeouts | None = None,
        trace: bool = False,
        log_dir: Path | None = None,
        ray_address: str | None = None,
        placement: str = "even",
        run_ids: Callable[[], str] | None = None,
        encrypt_edges: bool = False,
    ) -> None:
        if ray_address is not None and (host, gpus, log_dir) != (None, None, None):
            raise ValueError(
                "the stages on a Ray cluster (--ray-address) take its live hosts and GPUs "
                "and log to Ray's worker logs: give no host, gpus (--gpus) or log_dir "
                "(--log-dir) with it"
            )
        if placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {placement!r} (one of {', '.join(PLACEMENTS)})")
        self.path = resolve_model(model)
        facts = model_facts_from_gguf(self.path)
        if context is not None and not 1 < context <= facts.context_length:
            raise ValueError(
                f"context {context} is not in 2..{facts.context_length} (the model's "
                "context length)"
            )
        self.facts = attrs.evolve(facts, max_seq_len=context or facts.context_length)
        self.tokenizer = Tokenizer.from_gguf(self.path)
        self.worker = worker
        self.capabilities = capabilities(worker)  # WorkerUnavailable before any process
        self._ray_host: RayHost | None = None
        if ray_address is not None:
            from runtime_cupy.hosts.ray import session
            from runtime_cupy.hosts.ray.host import RayHost

            session.connect(ray_address)
            cluster = session.stage_nodes(worker, stages)
            self.nodes = tuple(n.spec for n in cluster)
            self.devices = tuple(n.device for n in cluster)
            verbose = logging.getLogger("runtime_cupy.hosts.ray").isEnabledFor(logging.INFO)
            level = "INFO" if verbose else "WARNING"
            host = self._ray_host = RayHost(
                cluster, session.orchestrator_address(), log_level=level
            )
            self._ray_host.on_slice_change = SliceLog()  # serve logs slices as they move
        else:
            self.nodes, self.devices = place_stages(stages, worker, gpus)
        self.placement = placement
        self.edges = edges
        self.encrypt_edges = encrypt_edges
        self.host: StageHost = host or LocalProcessHost(log_dir=log_dir)
        self.timeouts = timeouts or Timeouts()
        self.trace = trace
        self.secret = new_secret()
        self.chain_id = new_run_id("chain")
        self._run_ids = run_ids or _new_serve_run_id
        self._lock = threading.Lock()  # guards the handles for readers on other threads
        self._handles: dict[int, StageHandle] = {}
        self._warm = False  # every stage bound by a run since it started
        self._closed = False
        self._lost: dict[int, str] = {}  # stages found silent or gone while idle: why
        #: Why the chain is not whole (a stage broken, silent, gone), until it is again.
        self.trouble: str | None = None
        self._watch = IdleWatch(self.handles, self.timeouts.heartbeat_ms / 1000.0, self._on_lost)
        self._watching = False
        self.restarts = 0  # stages started again after they broke
        self.bind_run: WarmResult | None = None  # the last run that bound the stages
        # The stages' plan, once: PlanRejected / ValueError before any process starts.
        template = self.plan(f"{self.chain_id}-plan", max_tokens=1, sampling=SamplingConfig())
        self.layout = tuple(
            (s.stage_index, s.node_id, s.layer_start, s.layer_end_exclusive)
            for s in template.stages
        )
        self._media = {e.edge_id: self._medium(template, e) for e in template.edges}
        self._launches = tuple(self._launch(template, s.stage_index) for s in template.stages)

    # -- plans ---------------------------------------------------------------------
    @property
    def context(self) -> int:
        return self.facts.max_seq_len

    @property
    def model_id(self) -> str:
        return self.facts.model_id

    def plan(self, run_id: str, *, max_tokens: int, sampling: SamplingConfig) -> RunPlan:
        """The plan of one run on these stages (``PlanRejected`` if the planner says no)."""
        half = self.worker == "cuda"  # the CUDA worker moves f16 activations
        config = RuntimeConfig(
            run_id=run_id,
            max_tokens=max_tokens,
            activation_dtype_family=DTypeFamily.FLOAT,
            activation_dtype_width_bytes=2 if half else 4,
            sampling=sampling,
            timeouts=self.timeouts,
            worker=self.capabilities,
        )
        return plan_even(self.facts, config, ORCHESTRATOR, self.nodes, self.placement)

    def _medium(self, plan: RunPlan, edge: Any) -> str:
        def node(endpoint: Any) -> str:
            if isinstance(endpoint, OrchestratorEndpoint):
                return plan.orchestrator_node_id
            return str(endpoint.node_id)

        same = self.host.same_host(node(edge.producer), node(edge.consumer))
        return choose_medium(self.edges, same, edge.edge_id)

    def _launch(self, plan: RunPlan, index: int) -> StageLaunch:
        stage = plan.stages[index]
        return StageLaunch(
            run_id=self.chain_id,
            stage_index=index,
            stage_count=plan.stage_count,
            node_id=stage.node_id,
            orchestrator_id=plan.orchestrator_node_id,
            worker=self.worker,
            inbound_medium=self._media[stage.inbound_edge],
            outbound_medium=self._media[stage.outbound_edge],
            stop_ms=plan.timeouts.stop_ms,
            heartbeat_ms=plan.timeouts.heartbeat_ms,
            device=self.devices[index],
            trace=self.trace,
            warm=True,
            encrypt_edges=self.encrypt_edges,
            source=plan.model.gguf_source,
            parts=SliceParts.of_stage(stage),
        )

    # -- the stages ----------------------------------------------------------------
    def start(self) -> None:
        """Start every stage and bind its slice (one run of one token); ``ChainError``
        if they cannot be."""
        if self._closed:
            raise ChainError("the chain is closed")
        with self._watch.paused():
            self._heal()
        if not self._watching:
            self._watching = True
            self._watch.start()

    @property
    def ready(self) -> bool:
        """Every stage started, bound, and still there and heard (any thread)."""
        with self._lock:
            handles = list(self._handles.values())
        return (
            self._warm
            and not self._closed
            and not self._lost
            and len(handles) == len(self._launches)
            and not any(h.exited() for h in handles)
        )

    def _on_lost(self, index: int, why: str) -> None:
        """The idle watch found a stage silent or gone (its thread)."""
        log.warning("%s: it will be started again", why)
        self._lost[index] = why
        self.trouble = why

    def waiting_for(self) -> list[str]:
        """What the chain waits for before it serves (nothing once ready): each stage's
        slice still travelling to its host (bytes, rate, time left), else its stages."""
        if self.ready:
            return []
        host = self._ray_host
        moving = [describe(t) for t in host.slice_transfers() if t.moving] if host else []
        if moving:
            return moving
        with self._lock:
            started = len(self._handles)
        total = len(self._launches)
        if started < total:
            return [f"stages to start: {started} of {total} started"]
        return [f"the {total} stages to bind their slices of the model"]

    def pids(self) -> tuple[int, ...]:
        """Each stage's process id, by stage index."""
        with self._lock:
            return tuple(self._handles[i].info().pid for i in sorted(self._handles))

    def handles(self) -> tuple[StageHandle, ...]:
        with self._lock:
            return tuple(self._handles[i] for i in sorted(self._handles))

    def _gone(self, handle: StageHandle) -> bool:
        """Whether a stage went away while idle: its process ended or its channel
        closed. What it sent between runs is read and dropped (logged)."""
        if handle.exited():
            return True
        channel = handle.channel
        fd = channel.fileno()
        if fd < 0 or channel.eof:
            return True
        with contextlib.suppress(OSError, ValueError):
            while select.select([fd], [], [], 0)[0]:
                items = channel.receive()
                for item in items:
                    what = type(item.message).__name__ if isinstance(item, Incoming) else item
                    log.warning("stage %d sent between runs: %s", handle.stage_index, what)
                if channel.eof or not items:
                    break
        return channel.eof

    def _heal(self) -> tuple[int, ...]:
        """Start the stages that are missing or gone and bind them; the indices
        started (their first run binds them)."""
        for index, handle in list(self._handles.items()):
            lost = self._lost.pop(index, None)
            if lost is not None or self._gone(handle):
                reason = lost or handle.exit_reason() or "its control channel closed"
                log.warning("stage %d (%s) is gone (%s): starting it again",
                            index, handle.node_id, reason)  # fmt: skip
                self.trouble = self.trouble or reason
                self._retire(index)
        started: list[int] = []
        if self._ray_host is not None:  # their supervisors' start-ups overlap
            self._ray_host.prepare(
                launch.node_id for launch in self._launches
                if launch.stage_index not in self._handles
            )  # fmt: skip
        for launch in self._launches:
            if launch.stage_index in self._handles:
                continue
            try:
                handle = self.host.start(launch, self.secret)
            except OSError as exc:
                self.trouble = f"stage {launch.stage_index} could not be started: {exc}"
                raise ChainError(self.trouble) from exc
            with self._lock:
                self._handles[launch.stage_index] = handle
            log.info("stage %d (%s) started: pid %d",
                     launch.stage_index, launch.node_id, handle.info().pid)  # fmt: skip
            started.append(launch.stage_index)
        if started or not self._warm:
            self._warm = False
            self._bind_all()
        return tuple(started)

    def _bind_all(self) -> None:
        """One run of one token: every stage binds its slice (those that hold it reuse
        it); ``ChainError`` naming the fault if it fails."""
        prompt = (self.tokenizer.vocab.bos_id or 0,)
        outcome = self.bind_run = self._run(prompt, 1, SamplingConfig(), None, None)
        result = outcome.result
        if result.outcome != "completed":
            self.trouble = f"the stages could not be bound: {result.fault or result.outcome}"
            raise ChainError(self.trouble)
        self._warm = True
        self.trouble = None
        log.info("warm: %d stages bound in %.2f s", len(self._launches), result.wall_s)

    def _retire(self, index: int) -> None:
        with self._lock:
            handle = self._handles.pop(index, None)
        if handle is None:
            return
        self.restarts += 1
        if not handle.exited():
            handle.kill()
        handle.wait(REAP_S)
        handle.close()
        handle.trace_events()

    # -- runs ----------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        on_token: Callable[[int], None] | None = None,
        on_run: OnRun | None = None,
    ) -> WarmResult:
        """One run of ``prompt_ids`` on the warm stages (started again first if any is
        gone). Raises ``ChainError`` when the stages cannot be brought up, and what
        ``ProcessRun`` raises for a prompt it cannot run (``PromptError``) and the
        planner for settings it refuses (``PlanRejected``); a run that faults or is
        cancelled returns with that outcome."""
        if self._closed:
            raise ChainError("the chain is closed")
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        with self._watch.paused():
            restarted = self._heal()
            outcome = self._run(tuple(prompt_ids), max_tokens, sampling, on_token, on_run)
        return attrs.evolve(outcome, restarted=restarted)

    def _run(
        self,
        prompt: tuple[int, ...],
        max_tokens: int,
        sampling: SamplingConfig,
        on_token: Callable[[int], None] | None,
        on_run: OnRun | None,
    ) -> WarmResult:
        run_id = self._run_ids()
        plan = self.plan(run_id, max_tokens=max_tokens, sampling=sampling)
        began = time.perf_counter()
        run = ProcessRun(
            plan,
            prompt,
            worker=self.worker,
            devices=self.devices,
            host=self.host,
            edges=self.edges,
            on_token=on_token,
            trace=self.trace,
            stages=self.handles(),
            secret=self.secret,
            encrypt_edges=self.encrypt_edges,
        )
        if on_run is not None:
            on_run(run)
        outcome = run.run()
        result = summarize(plan, outcome, self.tokenizer, time.perf_counter() - began, False)
        for index in outcome.broken:
            log.warning("stage %d is broken after run %s: it will be started again",
                        index, run_label(run_id))  # fmt: skip
            self._retire(index)
        if outcome.broken:
            self._warm = False
            broke = f"stages {list(outcome.broken)} broke in run {run_label(run_id)}"
            self.trouble = result.fault or broke
        times = outcome.token_times_s
        return WarmResult(
            result=result,
            prompt_tokens=len(prompt),
            started_s=outcome.started_s,
            first_token_s=times[0] if times else None,
        )

    def recover(self) -> tuple[int, ...]:
        """Start and bind the stages that broke (after a run that broke them, so that
        the next request finds the chain warm); the indices started."""
        with self._watch.paused():
            return self._heal()

    # -- the end -------------------------------------------------------------------
    def close(self) -> None:
        """Stop every stage: its control channel closes, it exits; one that does not
        within ``CLOSE_GRACE_S`` is killed. Idempotent."""
        self._closed = True
        self._watch.close()
        with self._lock:
            handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            with contextlib.suppress(OSError):
                handle.channel.close()
        deadline = time.monotonic() + CLOSE_GRACE_S
        for handle in handles:
            if not handle.wait(deadline - time.monotonic()):
                log.warning("stage %d did not exit: killing it", handle.stage_index)
                handle.kill()
        for handle in handles:
            handle.wait(REAP_S)
            handle.close()
            handle.trace_events()  # frees what is left of its trace

    def __enter__(self) -> WarmChain:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
