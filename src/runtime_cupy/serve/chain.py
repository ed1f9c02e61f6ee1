"""Warm stages: the stage processes of one model, started and bound once, serving
many runs at once (CONCURRENT_RUNS.md: a chain).

``WarmChain(model, stages=N).start()`` starts a chain (``process.chain_runner``): every
stage through the host port (a local process each by default, or whatever host is
given), the chain's links made once, the chain's loop in a thread of its own; then one
short run binds every stage's slice, and the chain is ``ready``. Each
``generate(...)`` is one run of the MVP on it, from any thread and as many at once as
the stages' KV budget holds (``max_concurrent``; more wait, first come first started):
a new run id, a plan of the same stages (same nodes, layer ranges, GGUF source, cache
length, budget and batch settings), ``ProvisionStage`` to every stage, the readiness
barrier, the prompt, teardown. The stages' workers keep the weights they bound, so a
run's time to first token holds no load; its KV cache and sampler are its own, and the
stages batch the next rows of every run they hold into one worker call.

A run's own fault ends that run alone. A fault of the chain (a stage that died or went
silent, a link cut) ends every run in flight, each naming the stage, its node, its host
and the cause; the chain is then started again (every stage, a new secret and so new
link names) and bound before the next request. The chain's loop watches the stages' channels and
heartbeats at all times, between runs too. Until the chain is whole again it is not
``ready`` and ``trouble`` says why.

With ``ray_address`` (``auto`` or ``HOST:PORT``) the stages live on the hosts of a Ray
cluster (``hosts.ray``, this process its driver), placed as ``runtime_cupy.generate``
places them (``placement`` ``even`` or ``memory``). A stage on a host without the model
gets its slice from this host (``runtime_cupy.slices``), logged as it moves
(``waiting_for`` says what is still on its way).

With ``recover=True`` a run a lost stage process, host or link interrupted is not
failed: the chain is re-placed over the live nodes and the run replayed on it, its
tokens continuing its caller's stream (``serve.recovery``; at most ``max_recoveries``
per stream).

``generate``, ``ready`` and a run's ``cancel`` may be called from any thread; ``start``,
``recover`` and ``close`` from the owner's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from attrs import frozen

from runplan import (
    NodePool,
    NodeSpec,
    Placement,
    PlanRejection,
    RunPlan,
    RuntimeConfig,
    SamplingConfig,
    model_facts_from_gguf,
    plan_run,
)
from runplan.config import Timeouts
from runplan.dtypes import DTypeFamily
from runplan.models import resolve_model
from runplan.plan import OrchestratorEndpoint
from runplan.replacement import Replacement, Unplaceable
from runtime_core.gguf_slice import check_whole_model
from runtime_core.recovery import DEFAULT_MAX_RECOVERIES, RecoveryPolicy
from runtime_core.replay import Replay
from runtime_core.runs import PLACEMENTS, PlanRejected, plan_even
from runtime_core.tokenizer import Tokenizer
from runtime_cupy.api import GenerateResult, summarize
from runtime_cupy.edges.choice import choose_medium
from runtime_cupy.hosts.local import LocalProcessHost
from runtime_cupy.hosts.port import StageHandle, StageHost
from runtime_cupy.hosts.this_machine import place_stages
from runtime_cupy.process.chain_run import ChainRun, OnLogits
from runtime_cupy.process.chain_runner import ORCHESTRATOR, ChainRunner
from runtime_cupy.process.keys import new_secret
from runtime_cupy.process.launcher import run_result
from runtime_cupy.process.names import new_run_id, run_label
from runtime_cupy.serve.recovery import Recoveries, Replacer, kept_stages, run_stream, unplaced
from runtime_cupy.slices.progress import SliceLog, describe
from runtime_cupy.workers import DEFAULT_WORKER, capabilities

if TYPE_CHECKING:
    from runtime_cupy.hosts.ray.host import RayHost

log = logging.getLogger("runtime_cupy.serve.chain")


#: ``on_run(run)``: the run about to start, for its caller to cancel.
OnRun = Callable[[ChainRun], None]
#: Runs in flight at once when not told (the stages' KV budget holds as many).
DEFAULT_MAX_CONCURRENT = 4
#: Rows of a prompt per prefill record: a long prompt goes through the stages in chunks
#: of this many rows, each batched with the decode rows of the runs in flight, so that
#: their next tokens wait for one chunk, not for the whole prompt (0: whole prompts up
#: to the batch's rows). A chunk's time grows with its position (its attention over
#: the positions before it): near position 2,000 of SmolLM2 on the CPU worker a 64-row
#: chunk took ~1 s a stage, a 16-row one ~0.45 s (docs/benchmarks.md), and the prompt as
#: a whole took no longer in chunks of 16.
DEFAULT_PREFILL_CHUNK = 16


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


def _new_serve_run_id() -> str:
    return new_run_id("serve")


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


class ChainError(RuntimeError):
    """The chain cannot serve: its stages could not be started or bound."""


class Unplaced(ChainError):
    """The chain lost stages and the planner finds no placement over the ``live`` nodes
    (``unplaceable``: its rejection, naming the lost nodes and stages); it is the
    chain's trouble until a later start places it."""

    def __init__(self, unplaceable: Unplaceable, live: Sequence[str]) -> None:
        self.unplaceable = unplaceable
        self.live = tuple(live)
        super().__init__(unplaced(unplaceable, self.live))


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


def _drop_logits(logits: Any) -> None:
    """A run's logits that nobody takes."""


class WarmChain:
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
    stages' nodes (one each) instead of this machine's (``place_stages``). Raises
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
    ) -> None:
        self.logprobs = logprobs
        if nodes is not None and (ray_address is not None or len(nodes) != stages):
            raise ValueError(
                f"nodes names the {stages} stages' nodes (one each), on this machine or "
                f"where the host puts them, not on a Ray cluster; {len(nodes)} given"
            )
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
                cluster, session.orchestrator_address(), log_level=level
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
        self._run_ids = run_ids or _new_serve_run_id
        self._secrets = secrets or new_secret
        self.prefill_chunk = prefill_chunk
        if kv_budget_bytes is not None and kv_budget_bytes < 1:
            raise ValueError(f"kv_budget_bytes {kv_budget_bytes} is not at least 1")
        self.kv_budget_bytes = kv_budget_bytes or 0  # 0: max_concurrent full-length runs
        if max_concurrent is not None and max_concurrent < 1:
            raise ValueError(f"max_concurrent {max_concurrent} is not at least 1")
        self.max_concurrent = max_concurrent or DEFAULT_MAX_CONCURRENT
        self._lock = threading.Lock()  # guards the runner for readers on other threads
        self._heal_lock = threading.RLock()  # one thread starts the chain again
        self._runner: ChainRunner | None = None
        self._thread: threading.Thread | None = None
        self._closing: ChainRunner | None = None  # a runner being stopped
        self._batches_before: dict[int, dict[int, int]] = {}  # of the chains stopped
        self._warm = False  # every stage bound by a run since the chain started
        self._closed = False
        self._trouble: str | None = None
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
        template = self.plan(_new_serve_run_id(), max_tokens=1, sampling=SamplingConfig())
        self.layout = tuple(
            (s.stage_index, s.node_id, s.layer_start, s.layer_end_exclusive)
            for s in template.stages
        )
        self.template = template
        choose = {e.edge_id: self._medium(template, e) for e in template.edges}
        del choose  # ValueError now for edges that cannot be

    # -- plans ---------------------------------------------------------------------
    def _runs_in_budget(self) -> int:
        """How many full-length runs (the whole context) the smallest stage's KV budget
        holds; ``ValueError`` naming the stage when it holds none."""
        budget, self.kv_budget_bytes = self.kv_budget_bytes, 0
        self.max_concurrent = 1
        try:  # one full-length run's cache on each stage: the planner's figures
            alone = self.plan(_new_serve_run_id(), max_tokens=1, sampling=SamplingConfig())
        finally:
            self.kv_budget_bytes = budget
        runs, index, need = min(
            (budget // s.kv_bytes, s.stage_index, s.kv_bytes) for s in alone.stages
        )
        if runs < 1:
            raise ValueError(
                f"a KV budget of {budget} bytes holds no full-length run on stage {index}: "
                f"one needs {need} bytes (a smaller context needs less)"
            )
        return runs

    @property
    def context(self) -> int:
        return self.facts.max_seq_len

    @property
    def model_id(self) -> str:
        return self.facts.model_id

    def plan(
        self,
        run_id: str,
        *,
        max_tokens: int,
        sampling: SamplingConfig,
        prompt_tokens: int = 0,
    ) -> RunPlan:
        """The plan of one run on these stages (``PlanRejected`` if the planner says
        no): every run has the chain's stage facts (cache length, KV budget:
        ``kv_budget_bytes`` or ``max_concurrent`` full-length runs, batch rows, and
        whether tokens come with their logits: ``logprobs``) and its own prompt length
        and token limit."""
        config = self._config(run_id, max_tokens, sampling, prompt_tokens)
        if self._placement is None:
            return plan_even(self.facts, config, ORCHESTRATOR, self.nodes, self.placement)
        pool = NodePool(ORCHESTRATOR, self.nodes)
        planned = plan_run(
            self.facts, config, pool, stage_count=len(self.nodes), placement=self._placement
        )
        if isinstance(planned, PlanRejection):
            raise PlanRejected(planned)
        return planned

    def _config(
        self, run_id: str, max_tokens: int, sampling: SamplingConfig, prompt_tokens: int
    ) -> RuntimeConfig:
        """A run's settings: the chain's (whether its tokens carry logits, ``logprobs``,
        included: the chain's token link is made for one kind of record, by the plan it
        starts with, a re-placed chain's too) and the run's own."""
        half = self.worker == "cuda"  # the CUDA worker moves f16 activations
        return RuntimeConfig(
            run_id=run_id,
            max_tokens=max_tokens,
            activation_dtype_family=DTypeFamily.FLOAT,
            activation_dtype_width_bytes=2 if half else 4,
            sampling=sampling,
            timeouts=self.timeouts,
            worker=self.capabilities,
            prompt_tokens=prompt_tokens,
            max_concurrent_runs=self.max_concurrent,
            kv_budget_bytes=self.kv_budget_bytes,
            prefill_chunk=self.prefill_chunk,
            return_logits=self.logprobs,
        )

    def _medium(self, plan: RunPlan, edge: Any) -> str:
        def node(endpoint: Any) -> str:
            if isinstance(endpoint, OrchestratorEndpoint):
                return plan.orchestrator_node_id
            return str(endpoint.node_id)

        same = self.host.same_host(node(edge.producer), node(edge.consumer))
        return choose_medium(self.edges, same, edge.edge_id)

    # -- the chain -----------------------------------------------------------------
    def start(self) -> None:
        """Start the chain and bind every stage's slice (one run of one token);
        ``ChainError`` if they cannot be."""
        if self._closed:
            raise ChainError("the chain is closed")
        with self._heal_lock:
            self._heal()

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

    def _heal(self, lost: str | None = None) -> tuple[int, ...]:
        """Start the chain again if it is not whole (a stage gone or silent, a chain
        fault), or if it ``lost`` a stage (a link a stage saw break, which need not make
        the chain's fault), and bind it; the stage indices started."""
        runner = self._runner
        # whole: no chain fault and no stage known gone (a stage the runner has just
        # marked gone, while it waits to say how it died, is not whole yet not dead)
        if lost is None and runner is not None and runner.whole:
            return ()
        if runner is not None:
            why = runner.dead or next(
                (h.exit_reason() or "gone" for h in runner.handles() if h.exited()), lost or "gone"
            )
            log.warning("the chain is broken (%s): starting it again", why)
            self.trouble = self.trouble or why
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
            generation=len(self.recoveries.replacements),
            run_ids=self._run_ids,
        )
        self._warm = False
        try:
            runner.start()
        except OSError as exc:
            self.trouble = f"the stages could not be started: {exc}"
            self._lost_coming_up(runner, self.trouble)
            runner.close()
            raise ChainError(self.trouble) from exc
        keep_broken = self.policy is not None
        thread = threading.Thread(
            target=_serve_chain, args=(runner, keep_broken), name="chain", daemon=True
        )
        with self._lock:
            self._runner, self._thread = runner, thread
        self.chain_id = runner.chain_id
        thread.start()
        marks["started"] = time.monotonic()
        for handle in runner.handles():
            if handle.stage_index not in kept:
                log.info("stage %d (%s) started: pid %d",
                         handle.stage_index, handle.node_id, handle.info().pid)  # fmt: skip
        try:
            self._bind_all()
        except ChainError as exc:
            self._lost_coming_up(runner, str(exc))
            self._stop_runner()  # the next start makes a new chain
            raise
        marks["bound"] = time.monotonic()
        self.heal_marks = marks
        self.kept = tuple(sorted(kept))
        return tuple(i for i in range(len(self.layout)) if i not in kept)

    # -- re-placement (issue 25: serve.recovery.Replacer) -----------------------------
    @property
    def placeable(self) -> bool:
        """The last re-placement found a plan (or none was needed)."""
        return self.replacer.placeable

    def replace(self, lost_from: ChainRunner, lost_stages: Sequence[int], cause: str) -> None:
        """Re-place the chain ``lost_from`` was after it lost ``lost_stages`` (by
        ``cause``) and bring the new chain up, unless another stream did already (any
        thread). ``ChainError`` when there is no placement over the live nodes (its
        rejection named) or the new chain cannot be started or bound."""
        with self._heal_lock:
            if self._closed:
                raise ChainError("the chain is closed")
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

    def run_id(self) -> str:
        """A new run id."""
        return self._run_ids()

    def submit_replay(
        self,
        replay: Replay,
        on_token: Callable[[int], None],
        on_logits: OnLogits | None = None,
    ) -> ChainRun:
        """Hand the chain the replay of an interrupted run (``ChainError`` when the chain
        is not up); ``on_logits``: its tokens' raw logits, as ``submit``'s."""
        runner = self._runner
        if runner is None or not self.ready:
            raise ChainError(self.trouble or "the chain is not up")
        plan = self.plan(
            replay.run_id,
            max_tokens=replay.max_tokens,
            sampling=replay.sampling,
            prompt_tokens=len(replay.prompt),
        )
        log.info(
            "run %s replays %s", run_label(replay.run_id), run_label(replay.interrupted_run_id)
        )
        return runner.submit(plan, replay.prompt, on_token, on_logits=self._logits_to(on_logits))

    def _stop_runner(self, keep: Sequence[int] = ()) -> dict[int, StageHandle]:
        """Stop the running chain; the live stages of ``keep`` are handed over (left
        running, for the next chain to keep) and returned by index."""
        with self._lock:
            runner, thread = self._runner, self._thread
            self._runner = self._thread = None
            self._closing = runner
        if runner is None:
            return {}
        runner.request_close()
        if thread is not None:
            thread.join()
        kept = runner.hand_over(keep) if keep else {}
        runner.close()
        with self._lock:  # its batches stay counted
            self._batches_before = added_counts(self._batches_before, runner.batch_counts())
            self._closing = None
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
        on_logits: OnLogits | None = None,
    ) -> WarmResult:
        """One run of ``prompt_ids`` on the chain (any thread; it joins the runs in
        flight). Raises ``ChainError`` when the chain is not up, and what the chain
        raises for a prompt it cannot run (``PromptError``) and the planner for settings
        it refuses (``PlanRejected``); a run that faults or is cancelled returns with
        that outcome. ``on_logits``: each token's raw logits (before temperature, top-k
        and top-p), just before its ``on_token``; the result then holds none."""
        if self._closed:
            raise ChainError("the chain is closed")
        restarted: tuple[int, ...] = ()
        with self._heal_lock:  # a chain broken while no run is in flight starts again
            if not self.ready and self.in_flight == 0:
                restarted = self._heal()
        if not self.ready:
            raise ChainError(self.trouble or "the chain is not up")
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        outcome = self._run(tuple(prompt_ids), max_tokens, sampling, on_token, on_run, on_logits)
        return attrs.evolve(outcome, restarted=restarted)

    def _run(
        self,
        prompt: tuple[int, ...],
        max_tokens: int,
        sampling: SamplingConfig,
        on_token: Callable[[int], None] | None,
        on_run: OnRun | None,
        on_logits: OnLogits | None = None,
    ) -> WarmResult:
        if self.policy is not None and self._warm:
            return run_stream(
                self, self.policy, prompt, max_tokens, sampling, on_token, on_run, on_logits
            )
        began = time.perf_counter()
        run = self.submit(
            prompt, max_tokens=max_tokens, sampling=sampling, on_token=on_token, on_logits=on_logits
        )
        if on_run is not None:
            on_run(run)
        run.wait()
        return self.result(run, time.perf_counter() - began)

    def submit(
        self,
        prompt: Sequence[int],
        *,
        max_tokens: int,
        sampling: SamplingConfig,
        on_token: Callable[[int], None] | None = None,
        on_done: Callable[[ChainRun], None] | None = None,
        on_logits: OnLogits | None = None,
    ) -> ChainRun:
        """Hand one run to the chain and return at once (any thread): ``run.wait()``,
        then ``result(run)``. ``on_done(run)`` when it ended (from the chain's thread).
        Raises ``ChainError`` when the chain is not up, ``PlanRejected`` for settings the
        planner refuses."""
        runner = self._runner
        if runner is None:
            raise ChainError(self.trouble or "the chain is not up")
        plan = self.plan(
            self._run_ids(),
            max_tokens=max_tokens,
            sampling=sampling,
            prompt_tokens=len(prompt),
        )
        return runner.submit(
            plan, prompt, on_token, on_done=on_done, on_logits=self._logits_to(on_logits)
        )

    def _logits_to(self, on_logits: OnLogits | None) -> OnLogits | None:
        """Where a run's logits go: ``on_logits``; on a chain whose tokens come with
        logits (``logprobs``), nowhere for a run that does not take them (kept, a long
        answer's would fill the memory)."""
        if on_logits is not None and not self.logprobs:
            raise ValueError(
                "the chain was started without logprobs: its tokens come without logits"
            )
        if on_logits is None and self.logprobs:
            return _drop_logits
        return on_logits

    def result(self, run: ChainRun, wall_s: float | None = None) -> WarmResult:
        """What an ended run gave (``wait`` raises what refused it: ``PromptError``)."""
        outcome = run.wait()
        assert outcome is not None
        runner = run.runner
        wall = wall_s if wall_s is not None else outcome.ended_s - outcome.submitted_s
        result = summarize(run.plan, run_result(runner, outcome), self.tokenizer, wall, False)
        if runner.dead is not None and self.replacer.placeable:
            self.trouble = result.fault or runner.dead
        times = outcome.token_times_s
        return WarmResult(
            result=result,
            prompt_tokens=len(run.prompt),
            started_s=outcome.submitted_s,
            first_token_s=times[0] if times else None,
        )

    def recover(self) -> tuple[int, ...]:
        """Start the chain again when it broke (after a chain fault, so that the next
        request finds it warm); the stage indices started."""
        if self._closed:
            return ()
        with self._heal_lock:
            return self._heal()

    # -- the end -------------------------------------------------------------------
    def close(self) -> None:
        """Stop the chain: runs cancelled, every stage's channel closed and the stage
        reaped (killed after a grace), the links freed. Idempotent."""
        self._closed = True
        self._stop_runner()

    def __enter__(self) -> WarmChain:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
