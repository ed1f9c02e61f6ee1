r"""An orchestrator in a process of its own, for tests that kill or interrupt it:

    python tests/support/orchestrator_driver.py \
        MODEL STAGES MAX_TOKENS FAULTS_JSON STOP_MS EDGES [STEP_MS [trace]]

Prints one JSON object per line to standard output as the run goes: ``{"run_id"}``,
``{"spawned": pid}`` per stage, ``{"ready": index}`` per ready stage, ``{"token": id}``
per token, and at the end ``{"outcome", "fault", "tokens", "returncodes"}``; exits 0
when the run completed, 1 when it faulted, 130 when it was cancelled (SIGINT and
SIGTERM cancel it, as the command line's run: ``handle_signals``). ``FAULTS_JSON``
maps stage indices to the faults ``tests.support.hosts.FaultyHost`` plays there;
``STEP_MS`` is the timeouts' ``step_ms`` (20 s when not given); ``trace``: the stages
keep a trace (``ProcessRun(trace=True)``)."""

from __future__ import annotations

import json
import sys

from runplan import SamplingConfig
from runplan.config import Timeouts
from runplan.messages import StageReady
from runtime_cupy.api import plan_for
from runtime_cupy.process.launcher import ProcessRun
from tests.support.hosts import FaultyHost


def say(**fields: object) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def main() -> int:
    model, stages, max_tokens, faults, stop_ms, edges = sys.argv[1:7]
    step_ms = int(sys.argv[7]) if len(sys.argv) > 7 else 20_000
    trace = sys.argv[8:] == ["trace"]
    prompt = [1, 2, 3]
    timeouts = Timeouts(ready_ms=20_000, step_ms=step_ms, edge_wait_ms=20_000, stop_ms=int(stop_ms))
    plan, devices = plan_for(
        model,
        stages=int(stages),
        prompt_len=len(prompt),
        max_tokens=int(max_tokens),
        sampling=SamplingConfig(),
        return_logits=False,
        timeouts=timeouts,
    )

    def on_event(kind: str, fields: dict[str, object]) -> None:
        if kind == "spawned":
            say(spawned=fields["pid"])
        if kind == "received" and isinstance(fields["message"], StageReady):
            say(ready=fields["message"].stage_index)

    run = ProcessRun(
        plan,
        prompt,
        devices=devices,
        on_token=lambda t: say(token=t),
        on_event=on_event,
        host=FaultyHost({int(k): v for k, v in json.loads(faults).items()}),
        edges=edges,
        trace=trace,
        handle_signals=True,  # as the command line's: SIGINT / SIGTERM cancel the run
    )
    say(run_id=plan.run_id, chain_id=run.chain_id)
    result = run.run()
    finished = result.finished
    outcome = finished.outcome.value.lower() if finished is not None else "abandoned"
    say(
        outcome=outcome,
        fault=str(finished.fault) if finished is not None and finished.fault else None,
        tokens=list(result.tokens),
        returncodes=[s.returncode for s in result.stages],
    )
    return {"completed": 0, "faulted": 1}.get(outcome, 130)


if __name__ == "__main__":
    sys.exit(main())
