"""A run on the test hosts (``tests/support/netns_hosts.py``), started in the head's
network and mount namespaces:

    python tests/support/ray_driver.py --address HEAD:PORT --model PATH --hosts N \
        [--stages N] [--max-tokens N] [--pause-at K] [--copy-model-to PATH]

It waits for ``--hosts`` live hosts, runs ``runtime_cupy.generate`` on them (NumPy
worker) and prints one JSON object with what happened. With ``--pause-at K`` it stops
the run after its K-th token: it prints ``{"paused": ...}`` (the run id, each stage's
pid) as a line and reads one line from standard input before going on, so
that the test can do its fault to a run in mid-decode; ``resumed_s`` in the result is
when it went on (monotonic, this machine's clock); ``slices`` what each stage's slice
of the model did that travelled from the orchestrator's host."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from typing import Any

from runplan.config import Timeouts
from runplan.messages import StageReady
from runtime_cupy import generate
from runtime_cupy.hosts.ray import session
from runtime_cupy.slices.progress import figures

#: Bounds beyond the silent-peer bound: a cut link is noticed by keepalive, not by them.
TIMEOUTS = Timeouts(ready_ms=90_000, step_ms=30_000, edge_wait_ms=20_000, stop_ms=5_000)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--pause-at", type=int, default=None)
    p.add_argument("--copy-model-to", default=None)
    p.add_argument("--edges", default="auto")
    p.add_argument("--encrypt-edges", action="store_true")
    args = p.parse_args()
    model = args.model
    if args.copy_model_to:  # a path only this host has
        shutil.copy(model, args.copy_model_to)
        model = args.copy_model_to
    session.connect(args.address)
    deadline = time.monotonic() + 120
    while len({h.address for h in session.hosts()}) < args.hosts:
        if time.monotonic() > deadline:
            print(json.dumps({"error": f"fewer than {args.hosts} hosts came up"}))
            return 1
        time.sleep(0.5)
    pids: dict[int, int] = {}
    tokens: list[int] = []
    resumed: list[float] = []
    run_id: list[str] = []
    chain_id: list[str] = []

    def on_event(kind: str, fields: dict[str, Any]) -> None:
        if kind == "spawned":
            pids[int(fields["stage_index"])] = int(fields["pid"])
            chain_id[:] = [str(fields["chain_id"])]
        if kind == "received" and isinstance(fields.get("message"), StageReady):
            run_id[:] = [fields["message"].run_id]

    def on_token(token: int) -> None:
        tokens.append(token)
        if len(tokens) == args.pause_at:
            paused = {
                "pids": pids,
                "tokens": len(tokens),
                "run_id": run_id[0],
                "chain_id": chain_id[0],
            }
            print(json.dumps({"paused": paused}), flush=True)
            sys.stdin.readline()
            resumed.append(time.monotonic())

    began = time.monotonic()
    result = generate(
        model,
        [1, 2, 3],
        stages=args.stages,
        max_tokens=args.max_tokens,
        worker="numpy",
        ray_address=args.address,
        edges=args.edges,
        encrypt_edges=args.encrypt_edges,
        timeouts=TIMEOUTS,
        on_event=on_event,
        on_token=on_token,
    )
    print(
        json.dumps(
            {
                "run_id": result.plan.run_id,
                "chain_id": result.chain_id,
                "outcome": result.outcome,
                "fault": result.fault,
                "fault_stage": result.fault_stage,
                "tokens": list(result.tokens),
                "media": list(result.media),
                "stages": [
                    {"stage_index": s.stage_index, "node_id": s.node_id, "host": s.host,
                     "pid": s.pid, "returncode": s.returncode}
                    for s in result.stages
                ],
                "layers": [[s.layer_start, s.layer_end_exclusive] for s in result.plan.stages],
                "slices": figures(result.slices),
                "wall_s": time.monotonic() - began,
                "ended_s": time.monotonic(),
                "resumed_s": resumed[0] if resumed else None,
            }
        ),
        flush=True,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
