"""Run in a network namespace of its own (``unshare -n``): three stage processes with
TCP edges over that namespace's loopback, the loopback link taken down after the second
token (no FIN, no reset: every packet is lost, as with a cut cable), and the run left to
notice.

    unshare -n python tests/support/silent_peer.py MODEL

Prints one JSON object: the outcome, the fault, the seconds from the cut to the run's
end, and the stages' exit statuses."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from runplan import SamplingConfig
from runplan.config import Timeouts
from runtime_cupy.api import plan_for
from runtime_cupy.process.launcher import ProcessRun


def main() -> int:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    prompt = [1, 2, 3]
    # Bounds far beyond the silent-peer bound, so that only it can end the run early.
    timeouts = Timeouts(ready_ms=30_000, step_ms=60_000, edge_wait_ms=60_000, stop_ms=3_000)
    plan, _ = plan_for(
        sys.argv[1], stages=3, prompt_len=len(prompt), max_tokens=40,
        sampling=SamplingConfig(), return_logits=False, timeouts=timeouts,
    )  # fmt: skip
    cut: list[float] = []
    tokens: list[int] = []

    def on_token(token: int) -> None:
        tokens.append(token)
        if len(tokens) == 2:
            subprocess.run(["ip", "link", "set", "lo", "down"], check=True)
            cut.append(time.monotonic())

    result = ProcessRun(plan, prompt, edges="tcp", on_token=on_token).run()
    finished = result.finished
    print(json.dumps({
        "run_id": plan.run_id,
        "chain_id": result.chain_id,
        "outcome": finished.outcome.value.lower() if finished else None,
        "fault": str(finished.fault) if finished and finished.fault else None,
        "tokens": len(result.tokens),
        "after_cut_s": result.ended_s - cut[0] if cut else None,
        "returncodes": [s.returncode for s in result.stages],
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
