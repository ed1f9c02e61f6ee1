"""Warm stages: the stage processes of one model, started and bound once, serving
many runs at once (CONCURRENT_RUNS.md: a chain).

``WarmChain(model, stages=N).start()`` starts a chain (``process.chain_runner``): every
stage through the host port (a local process each by default, or whatever host is
given), the chain's links made once, the chain's loop in a thread of its own; then one
short run binds every stage's slice, and the chain is ``ready``. Each
``generate(...)`` is one run of the MVP on it, from any thread and as many at once as
the stages' KV budget holds (sized by ``max_concurrent`` full-length runs, which shorter
runs outnumber; more wait for memory, first come first started):
a new run id, a plan of the same stages (same nodes, layer ranges, GGUF source, cache
length, budget and batch settings), ``ProvisionStage`` to every stage, the readiness
barrier, the prompt, teardown. The stages' workers keep the weights they bound, so a
run's time to first token holds no load; its KV cache and sampler are its own, and the
stages batch the next rows of every run they hold into one worker call.

A run's own fault ends that run alone; a fault of the chain ends every run in flight,
and the chain is started again before the next request (``chain_health``).

With ``ray_address`` (``auto`` or ``HOST:PORT``) the stages live on the hosts of a Ray
cluster (``hosts.ray``, this process its driver), placed as ``runtime_cupy.generate``
places them (``placement`` ``even`` or ``memory``). A stage on a host without the model
gets its slice from this host (``runtime_cupy.slices``), logged as it moves
(``waiting_for`` says what is still on its way).

With ``recover=True`` a run a lost stage process, host or link interrupted is not
failed: the chain is re-placed over the live nodes and the run replayed on it, its
tokens continuing its caller's stream (``serve.recovery``; at most ``max_recoveries``
per stream), unless the model's files changed since the stages started
(``chain_errors.SourceChanged``: the stages kept would hold the old weights).

``generate``, ``ready`` and a run's ``cancel`` may be called from any thread; ``start``,
``recover`` and ``close`` from the owner's. None of ``generate``, ``start``, ``recover``
and ``close`` may be called from a run's callback (``on_token``, ``on_logits``,
``on_done``), which runs on the chain's own thread: each would wait for that thread, and
raises ``ChainError`` at once (``submit`` does not wait). A chain is its maker process's:
in a forked child those and ``submit`` raise ``ChainError`` naming that process, and
``close`` (or the child's copy collected) stops nothing of the owner's.

``WarmChain`` is made here, from three bases of their own modules: ``chain_plans``
(``ChainPlans``: its runs' plans), ``chain_health`` (``ChainHealth``: ready or not, why,
started again and re-placed) and ``chain_runs`` (``ChainRuns``: ``generate``, ``submit``,
``result``); its errors are ``chain_errors``'s. ``ChainError``, ``ChainClosing`` (a
``ChainError``: a run handed over as the chain closes), ``Unplaced``, ``WarmResult`` and
``OnRun`` are importable from here too.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from runplan import NodeSpec, Placement, SamplingConfig, model_facts_from_gguf
from runplan.config import Timeouts
from runplan.facts import context_limit
from runplan.models import resolve_model
from runplan.plan import U64_MAX
from runtime_core.gguf_slice import check_whole_model
from runtime_core.recovery import DEFAULT_MAX_RECOVERIES, RecoveryPolicy
from runtime_core.runs import PLACEMENTS
from runtime_core.tokenizer import Tokenizer
from runtime_cupy.hosts.local import LocalProcessHost
from runtime_cupy.hosts.port import StageHandle, StageHost
from runtime_cupy.hosts.this_machine import place_stages
from runtime_cupy.process.chain_runner import ChainRunner
from runtime_cupy.process.keys import new_secret
from runtime_cupy.serve.chain_errors import ChainClosing, ChainError, Unplaced
from runtime_cupy.serve.chain_health import ChainHealth, stop_dropped
from runtime_cupy.serve.chain_plans import ChainPlans, new_serve_run_id
from runtime_cupy.serve.chain_runs import ChainRuns, OnRun, WarmResult
from runtime_cupy.serve.recovery import Recoveries, Replacer
from runtime_cupy.slices.progress import SliceLog, describe
from runtime_cupy.workers import DEFAULT_WORKER, capabilities

if TYPE_CHECKING:
    from runtime_cupy.hosts.ray.host import RayHost
    from runtime_cupy.slices.server import StageTransfer

__all__ = [
    "DEFAULT_MAX_CONCURRENT",
    "DEFAULT_PREFILL_CHUNK",
    "ChainClosing",
    "ChainError",
    "OnRun",
    "Unplaced",
    "WarmChain",
    "WarmResult",
]

log = logging.getLogger("runtime_cupy.serve.chain")

#: Full-length runs each stage's KV budget holds when not told (it sizes the budget; it
#: does not bound the runs in flight).
DEFAULT_MAX_CONCURRENT = 4
#: Rows of a prompt per prefill record: a long prompt goes through the stages in chunks
#: of this many rows, each batched with the decode rows of the runs in flight, so that
#: their next tokens wait for one chunk, not for the whole prompt (0: whole prompts up
#: to the batch's rows). A chunk's time grows with its position (its attention over
#: the positions before it): near position 2,000 of SmolLM2 on the CPU worker a 64-row
#: chunk took ~1 s a stage, a 16-row one ~0.45 s (docs/benchmarks.md), and the prompt as
#: a whole took no longer in chunks of 16.
DEFAULT_PREFILL_CHUNK = 16


def whole_number(name: str, value: object, least: int | None) -> int:
    """``value`` of the argument ``name``: an integer (not a bool), at least ``least``
    (``None``: any); ``TypeError`` or ``ValueError`` naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, not {value!r}")
    if least is not None and value < least:
        raise ValueError(f"{name} {value} is not at least {least}")
    return value


class WarmChain(ChainPlans, ChainHealth, ChainRuns):
    """The stages of ``model`` split evenly over ``stages`` processes of ``worker``,
    kept warm. ``context``: the cache length of every run (default: the model's
    context length); a run's prompt plus its tokens must fit it. ``host`` starts the
    stages (default: ``LocalProcessHost`` with ``log_dir``); ``ray_address``: on the
    hosts of that Ray cluster instead, the layers split by ``placement`` (``even`` or
    ``memory``); ``edges``: ``auto``, ``shm`` or ``tcp`` (``encrypt_edges``: TCP edges
    encrypt their frames, not only authenticate them); ``trace``: record Chrome
    trace events of every run. ``run_ids()`` gives each run its id (by default 128
    random bits, ``names.new_run_id``); ``secrets()`` gives each chain started its secret
    (by default 32 random bytes): the chain's id, which names its links on its hosts, is
    derived from it. ``prefill_chunk``: rows of a prompt per prefill record (a long
    prompt's chunks interleave with the other runs' decode steps). ``recover``: a run
    a lost stage process, host or link interrupted is replayed on the re-placed chain,
    at most ``max_recoveries`` times per stream (``serve.recovery``), over the live
    nodes: a Ray cluster's, else the stages' nodes and ``spares`` (``NodeSpec``s the
    host can start a stage on; a lost range goes to a spare first). ``logprobs``: every
    token comes with its raw logits (``4 * n_vocab`` bytes more on the last link), for
    callers that take them (``generate``'s ``on_logits``). ``nodes``: the
    stages' nodes (one each) instead of this machine's (``place_stages``). ``kv_dtype``
    (``f32``, ``f16``; default: the worker's own): the runs' KV caches in that dtype,
    counted so in every plan and KV budget (``workers.capabilities``).
    ``max_concurrent``: the full-length runs (caches of the whole ``context``) each
    stage's KV budget holds, without ``kv_budget_bytes`` (the spec's
    ``max_concurrent_runs``): it sizes the budget, and does not bound the runs in
    flight; shorter runs fit more at once, and a run the budget has no room for waits
    for another's end (``kv_waits``). The server (``serve.engine``) bounds its requests
    in flight by it (``--max-concurrent``). Raises
    ``ClusterError`` for a cluster that cannot be reached or has no room, before any
    process starts."""

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
        max_concurrent: int | None = None,
        secrets: Callable[[], bytes] | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        kv_budget_bytes: int | None = None,
        recover: bool = False,
        max_recoveries: int = DEFAULT_MAX_RECOVERIES,
        nodes: Sequence[NodeSpec] | None = None,
        spares: Sequence[NodeSpec] = (),
        logprobs: bool = False,
        kv_dtype: str | None = None,
    ) -> None:
        self.logprobs = logprobs
        stages = whole_number("stages", stages, 1)  # -2 was named "stage_count 0"
        if context is not None:  # '64' gave "'<' not supported"; its range below
            context = whole_number("context", context, None)
        if max_concurrent is not None:
            max_concurrent = whole_number("max_concurrent", max_concurrent, 1)
        # 2.5 fell through to attrs inside RuntimeConfig; its range: the plan's
        prefill_chunk = whole_number("prefill_chunk", prefill_chunk, None)
        if kv_budget_bytes is not None:  # 3e7 was named max_concurrent_runs by attrs
            kv_budget_bytes = whole_number("kv_budget_bytes", kv_budget_bytes, 1)
        spares = tuple(spares)
        for spare in spares:
            if not isinstance(spare, NodeSpec):
                raise TypeError(f"spares holds {spare!r}, not a NodeSpec")
        if nodes is not None and (ray_address is not None or len(nodes) != stages):
            raise ValueError(
                f"nodes names the {stages} stages' nodes (one each), on this machine or "
                f"where the host puts them, not on a Ray cluster; {len(nodes)} given"
            )
        if ray_address is not None:
            from runtime_cupy.hosts.ray.session import refuse_own_stage_options

            refuse_own_stage_options(host, gpus, log_dir)
        if placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {placement!r} (one of {', '.join(PLACEMENTS)})")
        self.path = resolve_model(model)
        facts = model_facts_from_gguf(self.path)
        limit = context_limit(facts)
        if context is None and limit is None:
            raise ValueError(
                f"{self.path}: the model's file states no context length "
                f"({facts.architecture}.context_length 0, which llama.cpp runs at the "
                "context its caller gives): give the context (--context)"
            )
        if context is not None and not 1 < context <= (limit or context):
            bound = f"in 2..{limit} (the model's context length)" if limit else "2 or more"
            raise ValueError(f"context {context} is not {bound}")
        self.facts = attrs.evolve(facts, max_seq_len=context or facts.context_length)
        self.tokenizer = Tokenizer.from_gguf(self.path)
        self.worker = worker
        # WorkerUnavailable (ValueError for a kv_dtype it does not hold) before any process
        self.capabilities = capabilities(worker, kv_dtype)
        check_whole_model(self.path, facts.num_layers, self.capabilities)  # likewise
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
                cluster,
                session.orchestrator_address(),
                log_level=level,
                silence_s=(timeouts or Timeouts()).heartbeat_ms / 1000,
            )
            self._ray_host.on_slice_change = SliceLog()  # serve logs slices as they move
        elif nodes is not None:
            self.nodes, self.devices = tuple(nodes), (None,) * stages
        else:
            self.nodes, self.devices = place_stages(stages, worker, gpus)
        self.placement = placement
        self._placement: Placement | None = None  # explicit rows once re-placed
        self.policy = RecoveryPolicy(max_recoveries) if recover else None  # ValueError
        self.recoveries = Recoveries()
        self.edges = edges
        self.encrypt_edges = encrypt_edges
        self.host: StageHost = host or LocalProcessHost(log_dir=log_dir)
        # Where the chain may go after a loss: its nodes, its spares, the live ones.
        self.replacer = Replacer(
            self.host, worker, self.nodes, self.devices, spares, self.recoveries
        )
        self.timeouts = timeouts or Timeouts()
        self.trace = trace
        self._run_ids = run_ids or new_serve_run_id
        self._secrets = secrets or new_secret
        self.prefill_chunk = prefill_chunk
        self.kv_budget_bytes = kv_budget_bytes or 0  # 0: max_concurrent full-length runs
        self.max_concurrent = max_concurrent or DEFAULT_MAX_CONCURRENT
        if self.kv_budget_bytes > U64_MAX:  # a u64 in every plan and provision
            raise ValueError(f"kv_budget_bytes {self.kv_budget_bytes} is past 2**64 - 1")
        self._lock = threading.Lock()  # guards the runner for readers on other threads
        self._heal_lock = threading.RLock()  # one thread starts the chain again
        self._runner: ChainRunner | None = None
        self._thread: threading.Thread | None = None
        self._threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()  # the chain's
        # the running chain, for a finalizer that holds no reference to self: a chain
        # dropped without close() once kept its stages, links and thread until exit
        self._running: list[tuple[ChainRunner, threading.Thread]] = []
        self._owner = os.getpid()  # a forked child's copy stops nothing of it
        dropped = weakref.finalize(self, stop_dropped, self._running, self._owner)
        dropped.atexit = False  # at exit the host reaps the stages (the finalizer's thread
        # would be cut short)
        self._closing: ChainRunner | None = None  # a runner being stopped
        self._batches_before: dict[int, dict[int, int]] = {}  # of the chains stopped
        self._warm = False  # every stage bound by a run since the chain started
        self._closed = False
        self.on_load: Callable[[int, int, int], None] | None = None  # ChainHealth's
        self._trouble: str | None = None
        self._source = None  # the model's files as they were when the stages started
        self._sources = weakref.WeakKeyDictionary()  # those each chain's stages read
        self.restarts = 0  # stages started again after the chain broke
        self.kept: tuple[int, ...] = ()  # stages the last start kept (weights and process)
        #: When the last start of the chain had the broken one stopped, placed the
        #: stages, started them and bound them (monotonic seconds, by those names).
        self.heal_marks: dict[str, float] = {}
        self.bind_run: WarmResult | None = None  # the last run that bound the stages
        self.chain_id = ""  # the running chain's id (names its links)
        # The stages' plan, once: PlanRejected / ValueError before any process starts.
        if max_concurrent is None and self.kv_budget_bytes:
            self.max_concurrent = self._runs_in_budget()
        template = self.plan(new_serve_run_id(), max_tokens=1, sampling=SamplingConfig())
        self.layout = tuple(
            (s.stage_index, s.node_id, s.layer_start, s.layer_end_exclusive)
            for s in template.stages
        )
        self.template = template
        choose = {e.edge_id: self._medium(template, e) for e in template.edges}
        del choose  # ValueError now for edges that cannot be

    def show_slices(self, on_slice: Callable[[StageTransfer], None]) -> None:
        """``on_slice(transfer)`` as each stage's slice moves to a Ray host without the
        model (in place of the log lines; on other threads): a command's bars. Nothing
        on one host."""
        if self._ray_host is not None:
            self._ray_host.on_slice_change = on_slice

    # -- the chain -----------------------------------------------------------------
    def start(self) -> None:
        """Start the chain and bind every stage's slice (one run of one token);
        ``ChainError`` if they cannot be. Interrupted (Ctrl-C), the stages started are
        stopped and reaped, and ``start`` may be called again."""
        self._not_on_chain_thread("start")
        if self._closed:
            raise ChainError("the chain is closed")
        with self._heal_lock:
            self._heal()

    @property
    def in_flight(self) -> int:
        """Runs on the chain now (any thread)."""
        runner = self._runner
        return runner.in_flight if runner is not None else 0

    def waiting_for(self) -> list[str]:
        """What the chain waits for before it serves (nothing once ready): each stage's
        slice still travelling to its host (bytes, rate, time left), else its stages."""
        if self.ready:
            return []
        host = self._ray_host
        moving = [describe(t) for t in host.slice_transfers() if t.moving] if host else []
        if moving:
            return moving
        started = len(self.handles())
        total = len(self.layout)
        if started < total:
            return [f"stages to start: {started} of {total} started"]
        return [f"the {total} stages to bind their slices of the model"]

    def kv_in_use(self) -> tuple[tuple[int, int, int], ...]:
        """Each stage's KV cache held by the runs in flight: ``(stage_index, bytes,
        budget_bytes)`` (any thread; none before the chain started)."""
        runner = self._runner
        return runner.kv_in_use() if runner is not None else ()

    def pids(self) -> tuple[int, ...]:
        """Each stage's process id, by stage index."""
        return tuple(h.info().pid for h in self.handles())

    def handles(self) -> tuple[StageHandle, ...]:
        with self._lock:
            runner = self._runner
        return runner.handles() if runner is not None else ()

    # -- the end -------------------------------------------------------------------
    def close(self) -> None:
        """Stop the chain: runs cancelled, every stage's channel closed and the stage
        reaped (killed after a grace), the links freed; a chain a recovery is starting
        meanwhile is stopped as it comes up. Idempotent. ``ChainError`` from
        the chain's own thread (a run's callback), which it would wait for. Interrupted
        (Ctrl-C) while it waits for the stages' stops, it stops waiting: the stages are
        killed at once and reaped and the links freed before the interrupt goes on
        (further interrupts meanwhile are held until then). A chain
        dropped without ``close`` is stopped so when it is collected. In a forked child
        of the process that made the chain, ``close`` (and the collection) stop nothing:
        the child's copy is closed, the owner's stages and links left to the owner."""
        if os.getpid() != self._owner:  # no lock: a thread may have held it at the fork
            self._closed = True
            self._runner = self._thread = None
            self._running.clear()
            return
        self._not_on_chain_thread("close")
        self._closed = True
        self._stop_runner()

    def __enter__(self) -> WarmChain:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
