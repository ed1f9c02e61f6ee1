"""``runtime_cupy.generate``: run a GGUF model through N stage processes on this host and
return its tokens and text, with the signature and result fields of
``runtime_sim.generate``."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from attrs import frozen

from runplan import (
    RunPlan,
    RuntimeConfig,
    SamplingConfig,
)
from runplan.config import Timeouts
from runplan.fsm.orchestrator_machine import check_prompt
from runplan.models import resolve_model
from runtime_core.gguf_slice import check_whole_model
from runtime_core.runs import facts_for_run, plan_even, token_ids
from runtime_core.tokenizer import Tokenizer
from runtime_cupy.hosts.port import StageHost, StageProcessInfo
from runtime_cupy.hosts.ray.cluster import StageNode
from runtime_cupy.hosts.this_machine import place_stages
from runtime_cupy.process.chain_runner import ready_stage
from runtime_cupy.process.launcher import ORCHESTRATOR, OnEvent, ProcessRun, ProcessRunResult
from runtime_cupy.process.names import new_run_id
from runtime_cupy.process.tracing import Event
from runtime_cupy.slices.server import StageTransfer
from runtime_cupy.workers import DEFAULT_WORKER, activation_dtype, capabilities

#: ``progress(stage_index, done, total)``. Stage processes load on their own and
#: report readiness only, so it is called once per stage, with ``done == total == 1``.
LoadProgress = Callable[[int, int, int], None]


@frozen
class GenerateResult:
    tokens: tuple[int, ...]  # generated ids (EOS excluded)
    text: str  # decoded, invalid UTF-8 replaced
    outcome: str  # "completed", "faulted" or "cancelled"
    logits: tuple[npt.NDArray[np.float32], ...] | None  # per token, when asked for
    fault: str | None  # the run's one failure reason, naming the stage and node
    plan: RunPlan
    stages: tuple[StageProcessInfo, ...]  # pid, device and exit status of each stage
    fault_stage: int | None
    fault_node: str | None
    load_s: float | None  # stages started to the readiness barrier
    ttft_us: float | None  # barrier to the first token
    tpot_us: float | None  # per later token (decode), mean
    wall_s: float  # real time of the whole run, start-up and teardown included
    wall_decode_tokens_per_s: float | None  # decode tokens per second
    trace: tuple[Event, ...] | None = None  # Chrome trace events, when asked for
    media: tuple[str, ...] = ()  # how each edge of the plan moved its bytes: shm or tcp
    encrypted_edges: bool = False  # TCP edges encrypted their frames (else authenticated)
    chain_id: str = ""  # the chain that ran it: names its links (one per hop) on its hosts
    slices: tuple[StageTransfer, ...] = ()  # stages that asked for their slice of the model
    interrupted_by: str | None = None  # the signal that cancelled it (handle_signals)


def plan_for(
    model_path: str,
    *,
    stages: int,
    prompt_len: int,
    max_tokens: int,
    sampling: SamplingConfig,
    return_logits: bool,
    worker: str = DEFAULT_WORKER,
    gpus: Sequence[int] | None = None,
    timeouts: Timeouts | None = None,
    run_id: str | None = None,
    placement: str = "even",
    cluster: Sequence[StageNode] | None = None,
    max_concurrent_runs: int = 1,
    kv_dtype: str | None = None,
) -> tuple[RunPlan, tuple[int | None, ...]]:
    """The plan of a process run and each stage's GPU: layers split evenly (or by
    memory), a KV cache just long enough for the prompt and the tokens asked for (as the
    simulator plans). ``cluster``: the stages' nodes on a Ray cluster (else this host's).
    ``run_id``: by default 128 random bits (``names.new_run_id``); a run id given here
    names the run's resources on its hosts, so it must be as hard to guess.
    ``max_concurrent_runs``: the runs of a chain of these stages held at once (sizes
    each stage's KV budget; plans of one chain must agree on it). ``kv_dtype``: the KV
    cache's dtype (``workers.capabilities``; default: the worker's own)."""
    facts = facts_for_run(model_path, prompt_len=prompt_len, max_tokens=max_tokens)
    # WorkerUnavailable before looking for GPUs
    worker_capabilities = capabilities(worker, kv_dtype)
    check_whole_model(model_path, facts.num_layers, worker_capabilities)  # before any process
    if cluster is None:
        nodes, devices = place_stages(stages, worker, gpus)
    else:
        nodes, devices = tuple(n.spec for n in cluster), tuple(n.device for n in cluster)
    family, width = activation_dtype(worker, facts.architecture)
    config = RuntimeConfig(
        run_id=run_id or new_run_id("run"),
        max_tokens=max_tokens,
        activation_dtype_family=family,
        activation_dtype_width_bytes=width,
        sampling=sampling,
        return_logits=return_logits,
        timeouts=timeouts or Timeouts(),
        worker=worker_capabilities,
        max_concurrent_runs=max_concurrent_runs,
    )
    # The planner refuses a stage count below 1, or other than the cluster's nodes.
    return plan_even(facts, config, ORCHESTRATOR, nodes, placement, stage_count=stages), devices


def generate(
    model_path: str | os.PathLike[str],
    prompt_ids: Sequence[int],
    *,
    stages: int = 1,
    max_tokens: int = 16,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    return_logits: bool = False,
    on_token: Callable[[int], None] | None = None,
    on_load: LoadProgress | None = None,
    trace: bool = False,
    tokenizer: Tokenizer | None = None,
    worker: str = DEFAULT_WORKER,
    gpus: Sequence[int] | None = None,
    timeouts: Timeouts | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    on_event: OnEvent | None = None,
    edges: str = "auto",
    host: StageHost | None = None,
    ray_address: str | None = None,
    placement: str = "even",
    encrypt_edges: bool = False,
    on_slice: Callable[[StageTransfer], None] | None = None,
    kv_dtype: str | None = None,
    handle_signals: bool = False,
) -> GenerateResult:
    """Generate up to ``max_tokens`` tokens after ``prompt_ids`` through ``stages``
    stage processes, each running ``worker`` (``cpu``, the default; ``numpy``, the
    reference worker; or ``cuda``) over its layers.

    ``model_path`` is a GGUF file or a bundled model name (``smollm2-135m``).
    ``on_token(id)`` streams each generated token as the orchestrator consumes it; one
    that raises ends the run, and once every process is reaped ``generate`` raises what
    it raised (as ``runtime_sim.generate`` does).
    ``tokenizer`` saves loading the file's tokenizer again when the caller has it.
    ``gpus`` are the CUDA worker's GPUs (stage ``i`` on ``gpus[i % len(gpus)]``);
    ``timeouts`` bound every wait; ``log_dir`` keeps each stage's log (of the default
    host); ``on_event(kind, fields)`` sees what the launcher does (``spawned`` with each
    stage's pid, ``state``, ``injected``, ``consumed``, ``received``, ``stage_died``).
    ``edges``: ``auto`` (shared memory where both ends share a machine, else TCP),
    ``shm`` or ``tcp`` (TCP on one host too). ``host`` starts the stages (default: one
    OS process per stage on this machine, ``hosts.local.LocalProcessHost``).
    ``ray_address`` (``auto`` or ``HOST:PORT``) runs the stages on the live hosts of a
    Ray cluster instead (``hosts.ray``; this process becomes its driver; ``ValueError``
    with a ``host``, ``gpus`` or ``log_dir`` beside it), ``placement``
    splits the layers ``even`` or by ``memory``; a stage on a host that lacks the model
    gets its slice from this host (``runtime_cupy.slices``), and ``on_slice(transfer)``
    sees each one move (on other threads). Every frame on a TCP edge is authenticated;
    ``encrypt_edges`` encrypts it too (AES-256-GCM), for links across networks one does
    not trust (shared-memory edges stay on their host). ``kv_dtype`` (``f32``, ``f16``;
    default: the worker's own, float32 on the CPU worker): the stages' KV caches in
    that dtype, counted so by the planner. A run that faults or is
    cancelled returns with that outcome, every process reaped and every resource freed.
    Signals stay the caller's: Ctrl-C's ``KeyboardInterrupt`` (or what the caller's own
    SIGTERM handler does) tears the run down, then reaches the caller, as with
    ``runtime_sim.generate`` (a second Ctrl-C meanwhile stops waiting for the stages).
    ``handle_signals`` (the command line's): called from the main thread, SIGINT and
    SIGTERM cancel the run instead, which returns ``cancelled`` naming the signal
    (``interrupted_by``).
    Raises
    ``PlanRejected`` when the planner refuses the run, ``PromptError`` for a prompt it
    cannot run, ``GgufError`` for a file it cannot read, ``WorkerUnavailable`` for a
    worker this host cannot run, ``ValueError`` for edges that cannot be,
    ``ClusterError`` for a cluster that cannot be reached or has no room, ``TypeError``
    for a prompt token that is no token id (5.9, ``True``); all before any process
    starts.
    """
    path = resolve_model(model_path)
    cluster = ray_host = None
    if ray_address is not None:
        from runtime_cupy.hosts.ray import session
        from runtime_cupy.hosts.ray.host import RayHost

        session.refuse_own_stage_options(host, gpus, log_dir)
        session.connect(ray_address)
        cluster = session.stage_nodes(worker, stages)
        host = ray_host = RayHost(cluster, session.orchestrator_address())
        ray_host.on_slice_change = on_slice
    prompt = token_ids(prompt_ids)  # refuses 1.9 and True, keeps numpy ints
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    plan, devices = plan_for(
        path,
        stages=stages,
        prompt_len=len(prompt),
        max_tokens=max_tokens,
        sampling=sampling,
        return_logits=return_logits,
        worker=worker,
        gpus=gpus,
        timeouts=timeouts,
        placement=placement,
        cluster=cluster,
        kv_dtype=kv_dtype,
    )
    check_prompt(plan, prompt)  # PromptError here, before any stage process starts
    tokenizer = tokenizer or Tokenizer.from_gguf(path)

    def events(kind: str, fields: dict[str, Any]) -> None:
        if on_load is not None and (stage := ready_stage(kind, fields)) is not None:
            on_load(stage, 1, 1)
        if on_event is not None:
            on_event(kind, fields)

    began = time.perf_counter()
    run = ProcessRun(
        plan,
        prompt,
        worker=worker,
        devices=devices,
        on_token=on_token,
        on_event=events,
        log_dir=Path(log_dir) if log_dir is not None else None,
        trace=trace,
        host=host,
        edges=edges,
        encrypt_edges=encrypt_edges,
        handle_signals=handle_signals,
    )
    if ray_host is not None and cluster is not None:
        ray_host.prepare(n.node_id for n in cluster)  # their start-ups overlap
    result = run.run()
    wall = time.perf_counter() - began
    slices = ray_host.slice_transfers() if ray_host is not None else ()
    return summarize(plan, result, tokenizer, wall, return_logits, slices)


def summarize(
    plan: RunPlan,
    result: ProcessRunResult,
    tokenizer: Tokenizer,
    wall_s: float,
    return_logits: bool,
    slices: tuple[StageTransfer, ...] = (),
) -> GenerateResult:
    finished = result.finished
    outcome = finished.outcome.value.lower() if finished is not None else "cancelled"
    if outcome == "faulted" and result.interrupted_by is not None:
        # the signal that cancelled the run reached its stages as well (a control
        # group's SIGTERM, as systemd stops a service): their exits are the cancel's
        outcome = "cancelled"
    fault = fault_stage = fault_node = None
    if finished is None:
        fault = "the run was abandoned before its teardown finished"
    elif finished.fault is not None:
        fault_stage = finished.fault_stage
        if fault_stage is not None:
            fault_node = plan.stages[fault_stage].node_id
            host = next((s.host for s in result.stages if s.stage_index == fault_stage), None)
            where = f"node {fault_node}" + (f", host {host}" if host else "")
            fault = f"stage {fault_stage} ({where}): {finished.fault}"
        else:
            fault = f"orchestrator (node {plan.orchestrator_node_id}): {finished.fault}"
    times = result.token_times_s
    ttft = (times[0] - result.ready_s) * 1e6 if times and result.ready_s is not None else None
    tpot = (times[-1] - times[0]) / (len(times) - 1) * 1e6 if len(times) > 1 else None
    return GenerateResult(
        tokens=result.tokens,
        text=tokenizer.decode(list(result.tokens)),
        outcome=outcome,
        logits=result.logits if return_logits else None,
        fault=fault,
        interrupted_by=result.interrupted_by,
        plan=plan,
        stages=result.stages,
        fault_stage=fault_stage,
        fault_node=fault_node,
        load_s=None if result.ready_s is None else result.ready_s - result.started_s,
        ttft_us=ttft,
        tpot_us=tpot,
        wall_s=wall_s,
        wall_decode_tokens_per_s=1e6 / tpot if tpot else None,
        trace=result.trace,
        media=result.media,
        encrypted_edges=result.encrypted_edges,
        chain_id=result.chain_id,
        slices=slices,
    )
