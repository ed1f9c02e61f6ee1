"""``runtime_sim.generate``: run a real GGUF model through an N-stage simulated pipeline
with a real worker (the NumPy reference worker by default, or the CPU worker), and
return its tokens and text."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from attrs import frozen

from runplan import (
    NodeSpec,
    RunPlan,
    RuntimeConfig,
    SamplingConfig,
)
from runplan.fsm import orchestrator as ofsm
from runplan.models import resolve_model
from runtime_core.gguf_slice import check_whole_model
from runtime_core.runs import facts_for_run, plan_even, run_seed, token_ids
from runtime_core.tokenizer import Tokenizer
from runtime_core.workers.registry import CORE_WORKERS
from runtime_sim.chain_driver import ChainSimulation, RunResult, RunSpec, SimSettings
from runtime_sim.links import ORCHESTRATOR
from runtime_sim.timing import Prediction, TimingModel, f32_stage_costs
from runtime_sim.trace import Trace

#: The simulator's worker unless told: the reference worker (``runtime_core``'s
#: workers are the choices: ``numpy`` or ``cpu``).
DEFAULT_WORKER = "numpy"
#: ``progress(stage_index, bytes_done, bytes_total)`` while a stage loads its weights.
LoadProgress = Callable[[int, int, int], None]


@frozen
class GenerateResult:
    tokens: tuple[int, ...]  # generated ids (EOS excluded)
    text: str  # decoded, invalid UTF-8 replaced
    outcome: str  # "completed", "faulted" or "cancelled"
    logits: tuple[npt.NDArray[np.float32], ...] | None  # per token, when asked for
    fault: str | None  # the run's one failure reason, if it faulted
    plan: RunPlan
    prediction: Prediction  # the timing model's forecast for this plan
    simulated_ttft_us: float | None  # virtual time from the barrier to the first token
    simulated_tpot_us: float | None  # virtual time per later token
    wall_s: float  # real time the host took, weights loading included
    wall_decode_tokens_per_s: float | None  # real decode speed of the host's workers
    trace: Trace | None = None  # the simulation's trace, when asked for


def plan_for(
    model_path: str,
    *,
    stages: int,
    prompt_len: int,
    max_tokens: int,
    sampling: SamplingConfig,
    return_logits: bool,
    run_id: str = "sim-run",
    worker: str = DEFAULT_WORKER,
    concurrent_runs: int = 1,
) -> RunPlan:
    """The plan of a simulated run of ``worker``: one node per stage, layers split
    evenly, a KV cache just long enough for the prompt and the tokens asked for (each
    stage's budget holds ``concurrent_runs`` such caches). A file no stage could run is
    refused here, as every stage would refuse it (``check_whole_model``: ``GgufError``
    or ``UnsupportedModel`` naming the key or tensor), before anything runs."""
    facts = facts_for_run(model_path, prompt_len=prompt_len, max_tokens=max_tokens)
    capabilities = CORE_WORKERS.capabilities(worker)
    check_whole_model(model_path, facts.num_layers, capabilities)
    nodes = tuple(NodeSpec(f"stage-{i}", 64 * 2**30) for i in range(stages))
    config = RuntimeConfig(
        run_id=run_id,
        max_tokens=max_tokens,
        sampling=sampling,
        return_logits=return_logits,
        worker=capabilities,
        prompt_tokens=prompt_len,
        max_concurrent_runs=concurrent_runs,
    )
    return plan_even(facts, config, ORCHESTRATOR, nodes, stage_count=stages)


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
    timing: TimingModel | None = None,
    trace: bool = False,
    tokenizer: Tokenizer | None = None,
    worker: str = DEFAULT_WORKER,
) -> GenerateResult:
    """Generate up to ``max_tokens`` tokens after ``prompt_ids`` through ``stages``
    simulated stages, each running ``worker`` over its layers: ``numpy``, the NumPy
    reference worker (the default), or ``cpu``, the CPU worker the process runtime runs
    by default (``WorkerUnavailable`` where its kernels are not built).

    ``model_path`` is a GGUF file or a bundled model name (``smollm2-135m``).
    ``on_token(id)`` streams each generated token as the orchestrator consumes it; what
    it raises ends the run and ``generate`` raises it (as ``runtime_cupy.generate`` does,
    once its processes are reaped).
    ``tokenizer`` saves loading the file's tokenizer again when the caller has it.
    Raises ``PlanRejected`` when the planner refuses the run, ``GgufError`` or
    ``TokenizerError`` for a file it cannot read, ``GgufError`` or ``UnsupportedModel``
    for one every stage would refuse (``check_whole_model``), ``TypeError`` for a prompt
    token that is no token id (5.9, ``True``), before anything runs.
    """
    path = resolve_model(model_path)
    prompt = token_ids(prompt_ids)  # refuses 1.9 and True, keeps numpy ints
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    plan = plan_for(
        path,
        stages=stages,
        prompt_len=len(prompt),
        max_tokens=max_tokens,
        sampling=sampling,
        return_logits=return_logits,
        worker=worker,
    )
    tokenizer = tokenizer or Tokenizer.from_gguf(path)  # a file it cannot read fails first
    start = time.perf_counter()
    result, sim = run_plan(
        plan, prompt, on_token=on_token, on_load=on_load, timing=timing, trace=trace, worker=worker
    )
    wall = time.perf_counter() - start
    return summarize(plan, prompt, result, sim, tokenizer, wall, return_logits)


@frozen
class ConcurrentResult:
    """Several runs of one prompt through one simulated chain."""

    runs: tuple[GenerateResult, ...]  # by run, each with its own sampling seed
    simulated_tokens_per_s: float | None  # every run's tokens over the virtual time they took
    wall_s: float


def generate_runs(
    model_path: str | os.PathLike[str],
    prompt_ids: Sequence[int],
    *,
    runs: int,
    stages: int = 1,
    max_tokens: int = 16,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    timing: TimingModel | None = None,
    trace: bool = False,
    tokenizer: Tokenizer | None = None,
    worker: str = DEFAULT_WORKER,
    on_run_end: Callable[[int, GenerateResult], None] | None = None,
    on_load: LoadProgress | None = None,
) -> ConcurrentResult:
    """``runs`` runs of ``prompt_ids`` in flight at once through one chain of ``stages``
    simulated stages (run ``i`` samples with seed ``seed + i`` modulo 2**64), batched on each stage
    as the chain controllers batch them. ``on_run_end(i, result)`` as run ``i`` ends,
    while the others go on (what a Ctrl-C then leaves a caller; ``wall_s``: so far);
    ``on_load`` sees each stage load, as ``generate``'s does. Raises as ``generate``
    does."""
    if runs < 1:
        raise ValueError(f"runs {runs} is not at least 1")
    path = resolve_model(model_path)
    prompt = token_ids(prompt_ids)
    plans = [
        plan_for(
            path,
            stages=stages,
            prompt_len=len(prompt),
            max_tokens=max_tokens,
            sampling=SamplingConfig(
                temperature=temperature, top_k=top_k, top_p=top_p, seed=run_seed(seed, i)
            ),
            return_logits=False,
            run_id=f"sim-run-{i}",
            worker=worker,
            concurrent_runs=runs,
        )
        for i in range(runs)
    ]
    tokenizer = tokenizer or Tokenizer.from_gguf(path)
    start = time.perf_counter()

    def ended(i: int, result: RunResult, sim: ChainSimulation) -> None:
        if on_run_end is not None:
            wall = time.perf_counter() - start
            on_run_end(i, summarize(plans[i], prompt, result, sim, tokenizer, wall, False))

    results, sim = run_plans(
        [RunSpec(plan, prompt) for plan in plans],
        timing=timing,
        trace=trace,
        worker=worker,
        on_run_end=ended,
        on_load=on_load,
    )
    wall = time.perf_counter() - start
    each = tuple(
        summarize(plan, prompt, result, sim, tokenizer, wall, False)
        for plan, result in zip(plans, results, strict=True)
    )
    times = [t for r in results for t in r.token_times_us]
    readies = [r.ready_us for r in results if r.ready_us is not None]
    rate = None
    if times and readies and max(times) > min(readies):
        rate = len(times) * 1e6 / (max(times) - min(readies))
    return ConcurrentResult(each, rate, wall)


def run_plan(
    plan: RunPlan,
    prompt: tuple[int, ...],
    *,
    on_token: Callable[[int], None] | None = None,
    on_load: LoadProgress | None = None,
    timing: TimingModel | None = None,
    trace: bool = False,
    worker: str = DEFAULT_WORKER,
) -> tuple[RunResult, ChainSimulation]:
    """Simulate ``plan`` with one ``worker`` per stage: a chain of one run."""
    results, sim = run_plans(
        [RunSpec(plan, prompt)],
        on_token=(lambda _run, _seq, token: on_token(token)) if on_token else None,
        on_load=on_load,
        timing=timing,
        trace=trace,
        worker=worker,
    )
    return results[0], sim


def run_plans(
    runs: Sequence[RunSpec],
    *,
    on_token: Callable[[str, int, int], None] | None = None,
    on_load: LoadProgress | None = None,
    timing: TimingModel | None = None,
    trace: bool = False,
    worker: str = DEFAULT_WORKER,
    on_run_end: Callable[[int, RunResult, ChainSimulation], None] | None = None,
) -> tuple[tuple[RunResult, ...], ChainSimulation]:
    """Simulate ``runs`` through one chain (their plans share its stages), with one
    ``worker`` per stage: each run's result, in the order given (``on_run_end(i, result,
    sim)`` as run ``i`` ends). ``PromptError`` for a prompt its run cannot take."""
    for spec in runs:  # a prompt a run cannot take fails here, before anything runs
        ofsm.OrchestratorMachine.for_plan(spec.plan, spec.prompt)
    settings = SimSettings(timing=timing or TimingModel())
    plan = runs[0].plan
    workers: list[Any] = [CORE_WORKERS.make_worker(worker) for _ in plan.stages]
    sim = ChainSimulation(
        runs,
        workers,
        f32_stage_costs(plan),
        settings=settings,
        on_token=on_token,
        on_load=on_load,
        on_run_end=(lambda i: on_run_end(i, sim.result_of(i), sim)) if on_run_end else None,
        trace=trace,
        wall_clock=True,
    )
    return sim.run().runs, sim


def summarize(
    plan: RunPlan,
    prompt: tuple[int, ...],
    result: RunResult,
    sim: ChainSimulation,
    tokenizer: Tokenizer,
    wall_s: float,
    return_logits: bool,
) -> GenerateResult:
    finished = result.finished
    outcome = finished.outcome.value.lower() if finished is not None else "faulted"
    fault = None
    if result.refused is not None:
        fault = result.refused
    elif finished is None:
        fault = "the run did not end"
    elif finished.fault is not None:
        where = f"stage {finished.fault_stage}: " if finished.fault_stage is not None else ""
        fault = where + str(finished.fault)
    times = result.token_times_us
    ttft = (times[0] - result.ready_us) if times and result.ready_us is not None else None
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    return GenerateResult(
        tokens=result.tokens,
        text=tokenizer.decode(list(result.tokens)),
        outcome=outcome,
        logits=result.logits[: len(result.tokens)] if return_logits else None,
        fault=fault,
        plan=plan,
        prediction=sim.settings.timing.predict(plan, sim.costs, len(prompt)),
        simulated_ttft_us=ttft,
        simulated_tpot_us=tpot,
        wall_s=wall_s,
        wall_decode_tokens_per_s=sim.wall_decode_tokens_per_s(),
        trace=sim.trace if sim.trace.enabled else None,
    )
