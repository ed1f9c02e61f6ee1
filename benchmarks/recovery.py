"""Recovery after a lost host on the process runtime (issue 25): the time from a host's
loss to the next token of the interrupted stream, broken into its parts.

    sudo python benchmarks/recovery.py [--model smollm2-135m] [--rounds 3] [--tokens 32]
                                       [--kill-after 8] [--json]

SmolLM2 in 3 stages on 3 test hosts (``tests/support/netns_hosts.py``: network and
mount namespaces on a bridge, no Ray; ``NetnsStageHost``), a 4th host the spare, every
link TCP; the orchestrator is this process (``serve.chain.WarmChain`` with
``recover=True``, the CPU worker). Each round makes fresh hosts and a fresh chain, runs
the prompt once unbroken, then again, and after ``--kill-after`` tokens kills every
process of stage 1's host (``TestHosts.lose``). Per round (medians last):

- detection: the kill to the interrupted run's end (its stage's control channel at end
  of file);
- teardown: the broken chain's other stages stopped and reaped, its links freed;
- re-plan: ``replace_lost`` over the live nodes (the spare takes stage 1's range);
- stage start: the new chain's 3 stage processes started (every stage anew: a new
  secret, new links);
- bind: the one-token run that binds every stage's slice (here: each host reads the
  model file, which the spare holds as a cached slice would be: on its own disk);
- replay prefill: the replay submitted to its first token (prompt + delivered tokens);
- total: the kill to the next token delivered (target: under 5 s);
- whether the stream's whole text is the unbroken run's.

Not measured: a spare *receiving* its slice (that transfer is the Ray host's,
``hosts.ray``; these test hosts share the file). Needs root (namespaces); without it,
says so and exits 0. Figures taken on a loaded machine are noisy: say so with them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = "The history of the printing press begins"
PARTS = ("detection", "teardown", "re-plan", "stage start", "bind", "replay prefill")
TARGET_S = 5.0


def one_round(model: str, tokens: int, kill_after: int) -> dict[str, Any]:
    from tests.support.netns_hosts import TestHosts
    from tests.support.netns_stages import NetnsStageHost

    from runplan import NodeSpec
    from runplan.config import Timeouts
    from runtime_core.tokenizer import Tokenizer
    from runtime_cupy.serve.chain import WarmChain

    hosts = TestHosts(4)
    with tempfile.TemporaryDirectory(dir="/var/tmp") as logs:
        hosts.up(Path(logs), ray=False)
        host = NetnsStageHost(hosts, (1, 2, 3), spares=(4,))
        try:
            big = 2**34
            chain = WarmChain(
                model,
                stages=3,
                host=host,
                edges="tcp",
                context=256,
                timeouts=Timeouts(ready_ms=120_000),
                recover=True,
                nodes=tuple(NodeSpec(f"stage-{i}", big) for i in range(3)),
                spares=(NodeSpec("spare-0", big),),
                max_concurrent=1,
            )
            prompt = Tokenizer.from_gguf(model).encode(PROMPT)
            killed: list[float] = []
            try:
                chain.start()
                unbroken = chain.generate(prompt, max_tokens=tokens).result

                def on_token(_: int, seen: list[int] = []) -> None:  # noqa: B006
                    seen.append(1)
                    if len(seen) == kill_after:
                        # Not on the chain's loop (this callback's thread): it goes on.
                        killed.append(time.monotonic())
                        threading.Thread(target=hosts.lose, args=(2,)).start()

                broken = chain.generate(prompt, max_tokens=tokens, on_token=on_token).result
                times = chain.recoveries.times
            finally:
                chain.close()
        finally:
            host.close()
            hosts.down()
    if len(times) != 1 or not killed:
        raise SystemExit(f"expected one recovery, got {len(times)}: {broken.fault}")
    t = times[0]
    parts = {
        "detection": t.ended_s - killed[0],
        "teardown": t.stopped_s - t.ended_s,
        "re-plan": t.placed_s - t.stopped_s,
        "stage start": t.started_s - t.placed_s,
        "bind": t.bound_s - t.started_s,
        "replay prefill": t.first_token_s - t.bound_s,
    }
    return {
        "parts_s": parts,
        "total_s": t.first_token_s - killed[0],
        "intact": broken.outcome == "completed" and broken.tokens == unbroken.tokens,
        "placed": [s.node_id for s in chain.template.stages],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--kill-after", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from tests.support.netns_hosts import shared_model, unavailable

    from runplan.models import resolve_model

    reason = unavailable()
    if reason is not None:
        print(f"skipped: {reason}", file=sys.stderr)
        return 0
    logging.basicConfig(level=logging.ERROR)
    rounds = []
    with shared_model(resolve_model(args.model)) as model:
        for _ in range(args.rounds):
            rounds.append(one_round(model, args.tokens, args.kill_after))
    medians = {p: statistics.median(r["parts_s"][p] for r in rounds) for p in PARTS}
    total = statistics.median(r["total_s"] for r in rounds)
    load = os.getloadavg()
    if args.json:
        out = {"rounds": rounds, "median_parts_s": medians, "median_total_s": total,
               "load_average": load}  # fmt: skip
        print(json.dumps(out, indent=2))
        return 0
    print(f"{args.model}: 3 stages on 3 hosts, a spare holding the file; a host lost after "
          f"{args.kill_after} of {args.tokens} tokens; {args.rounds} rounds "
          f"(load average {load[0]:.1f})")  # fmt: skip
    for p in PARTS:
        each = "  ".join(f"{r['parts_s'][p]:6.3f}" for r in rounds)
        print(f"  {p:<15} {each}   median {medians[p]:6.3f} s")
    each = "  ".join(f"{r['total_s']:6.3f}" for r in rounds)
    print(f"  {'total':<15} {each}   median {total:6.3f} s (target < {TARGET_S:.0f} s)")
    print(f"  stream intact (the unbroken text): {[r['intact'] for r in rounds]}")
    print(f"  new placement: {rounds[-1]['placed']}")
    print("  not measured: a spare receiving its slice (the Ray host's transfer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
