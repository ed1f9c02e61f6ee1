"""Recovery after a lost host on the process runtime (issue 25): the time from a host's
loss to the next token of the interrupted stream, broken into its parts.

    sudo python benchmarks/recovery.py [--model smollm2-135m] [--rounds 3] [--tokens 32]
                                       [--kill-after 8] [--ray] [--json]

SmolLM2 in 3 stages on 3 test hosts (``tests/support/netns_hosts.py``: network and
mount namespaces on a bridge, no Ray; ``NetnsStageHost``), a 4th host the spare, every
link TCP; the orchestrator is this process (``serve.chain.WarmChain`` with
``recover=True``, the CPU worker). Each round makes fresh hosts and a fresh chain, runs
the prompt once unbroken, then again, and after ``--kill-after`` tokens kills every
process of stage 1's host (``TestHosts.lose``). Per round (medians last):

- detection: the kill to the interrupted run's end (its stage's control channel at end
  of file);
- re-plan: ``replace_lost`` over the live nodes (the spare takes stage 1's range);
- teardown: the broken chain stopped: its lost stage reaped, its links freed, its
  other stages (kept: same node and layers) handed to the new chain;
- stage start: the new chain's stage on the spare started, and the kept stages told to
  join the new chain's links (a new secret: new link names and keys);
- bind: the one-token run that binds the new stage's slice (here: the spare reads the
  model file, which it holds as a cached slice would be: on its own disk); the kept
  stages reuse the weights they bound;
- replay prefill: the replay submitted to its first token (prompt + delivered tokens);
- total: the kill to the next token delivered (target: under 5 s);
- whether the stream's whole text is the unbroken run's.

With ``--ray`` the spare *receives* its slice: the hosts run a Ray cluster (a node
each), the orchestrator is a driver on the head's host (``--ray-address``'s chain,
``hosts.ray``) whose model file is in the head's private ``/tmp``, so every other host
gets its slice from it (``runtime_cupy.slices``), the spare too once stage 1 is placed
there; "stage start" then holds the spare's supervisor start and its slice's journey,
and detection is the lost supervisor's RPC failing. One round per cluster (a Ray
cluster takes tens of seconds to come up).

Needs root (namespaces); without it, says so and exits 0. Figures taken on a loaded
machine are noisy: say so with them.
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
PARTS = ("detection", "re-plan", "teardown", "stage start", "bind", "replay prefill")
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
    parts = parts_of(times[0], killed[0])
    total = parts.pop("total")
    return {
        "parts_s": parts,
        "total_s": total,
        "intact": broken.outcome == "completed" and broken.tokens == unbroken.tokens,
        "placed": [s.node_id for s in chain.template.stages],
        "kept": list(chain.kept),
    }


def parts_of(times: Any, killed_s: float) -> dict[str, float]:
    """The parts of one recovery (``serve.recovery.RecoveryTimes``) and its total."""
    return {
        "detection": times.ended_s - killed_s,
        "re-plan": times.placed_s - times.ended_s,
        "teardown": times.stopped_s - times.placed_s,
        "stage start": times.started_s - times.stopped_s,
        "bind": times.bound_s - times.started_s,
        "replay prefill": times.first_token_s - times.bound_s,
        "total": times.first_token_s - killed_s,
    }


def ray_driver(address: str, model: str, tokens: int, kill_after: int) -> int:
    """In the head's namespaces: the chain on the cluster, the kill asked of the parent
    (a ``{"kill": ...}`` line; the chain goes on), which says on standard input when it
    began (the monotonic clock is the machine's, whatever the namespace)."""
    import shutil

    from runplan.config import Timeouts
    from runtime_core.tokenizer import Tokenizer
    from runtime_cupy.hosts.ray import session
    from runtime_cupy.serve.chain import WarmChain

    shutil.copy(model, "/tmp/model.gguf")  # the head's private /tmp: no other host has it
    session.connect(address)
    while len(session.hosts()) < 4:
        time.sleep(0.5)
    timeouts = Timeouts(ready_ms=120_000, step_ms=30_000, edge_wait_ms=20_000, stop_ms=5_000)
    chain = WarmChain("/tmp/model.gguf", stages=3, ray_address=address, recover=True,
                      context=256, max_concurrent=1, timeouts=timeouts)  # fmt: skip
    prompt = Tokenizer.from_gguf("/tmp/model.gguf").encode(PROMPT)
    killed: list[float] = []
    try:
        chain.start()
        unbroken = chain.generate(prompt, max_tokens=tokens).result

        def on_token(_: int, seen: list[int] = []) -> None:  # noqa: B006
            seen.append(1)
            if len(seen) == kill_after:
                print(json.dumps({"kill": chain.layout[1][1]}), flush=True)

        broken = chain.generate(prompt, max_tokens=tokens, on_token=on_token).result
        killed.append(float(sys.stdin.readline()))
        times = chain.recoveries.times
        out = {
            "intact": broken.outcome == "completed" and broken.tokens == unbroken.tokens,
            "placed": [s[1] for s in chain.layout],
            "kept": list(chain.kept),
            "parts_s": parts_of(times[0], killed[0]) if len(times) == 1 else None,
            "fault": broken.fault,
        }
    finally:
        chain.close()
    print(json.dumps({"result": out}), flush=True)
    return 0


def ray_round(model: str, tokens: int, kill_after: int) -> dict[str, Any]:
    """One round on a fresh Ray cluster of 4 test hosts (host 4 the spare)."""
    import subprocess

    from tests.support.netns_hosts import TestHosts

    hosts = TestHosts(4)
    with tempfile.TemporaryDirectory(dir="/var/tmp") as logs:
        try:
            hosts.up(Path(logs))
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
            args = [str(Path(__file__).resolve()), "--driver", hosts.head_address, "--model",
                    model, "--tokens", str(tokens), "--kill-after", str(kill_after)]  # fmt: skip
            with open(Path(logs) / "driver.log", "w") as err:
                proc = subprocess.Popen(hosts.driver(args), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=err, text=True,
                                        env=env)  # fmt: skip
                assert proc.stdin is not None and proc.stdout is not None
                result: dict[str, Any] | None = None
                for line in proc.stdout:
                    try:
                        doc = json.loads(line)
                    except ValueError:
                        continue  # Ray's own lines
                    if "kill" in doc:
                        began = time.monotonic()
                        hosts.lose(2)
                        proc.stdin.write(f"{began}\n")
                        proc.stdin.flush()
                    elif "result" in doc:
                        result = doc["result"]
                proc.wait(300)
            if result is None or result["parts_s"] is None:
                tail = (Path(logs) / "driver.log").read_text()[-2000:]
                raise SystemExit(f"no recovery measured: {result}\n{tail}")
        finally:
            hosts.down()
    parts = result["parts_s"]
    return {"parts_s": parts, "total_s": parts.pop("total"), "intact": result["intact"],
            "placed": result["placed"], "kept": result["kept"]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--kill-after", type=int, default=8)
    parser.add_argument("--ray", action="store_true", help="the spare receives its slice")
    parser.add_argument("--driver", default=None, help=argparse.SUPPRESS)  # --ray's driver
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.driver is not None:
        return ray_driver(args.driver, args.model, args.tokens, args.kill_after)
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
            if args.ray:
                rounds.append(ray_round(model, args.tokens, args.kill_after))
            else:
                rounds.append(one_round(model, args.tokens, args.kill_after))
    medians = {p: statistics.median(r["parts_s"][p] for r in rounds) for p in PARTS}
    total = statistics.median(r["total_s"] for r in rounds)
    load = os.getloadavg()
    if args.json:
        out = {"rounds": rounds, "median_parts_s": medians, "median_total_s": total,
               "load_average": load}  # fmt: skip
        print(json.dumps(out, indent=2))
        return 0
    spare = "receiving its slice (Ray)" if args.ray else "holding the file"
    print(f"{args.model}: 3 stages on 3 hosts, a spare {spare}; a host lost after "
          f"{args.kill_after} of {args.tokens} tokens; {args.rounds} rounds "
          f"(load average {load[0]:.1f})")  # fmt: skip
    for p in PARTS:
        each = "  ".join(f"{r['parts_s'][p]:6.3f}" for r in rounds)
        print(f"  {p:<15} {each}   median {medians[p]:6.3f} s")
    each = "  ".join(f"{r['total_s']:6.3f}" for r in rounds)
    print(f"  {'total':<15} {each}   median {total:6.3f} s (target < {TARGET_S:.0f} s)")
    print(f"  stream intact (the unbroken text): {[r['intact'] for r in rounds]}")
    print(f"  new placement: {rounds[-1]['placed']}; stages kept: {rounds[-1]['kept']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
