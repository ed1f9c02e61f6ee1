"""A soak of the server: many clients of every kind at once for a while, stage processes
killed under them (``--kill-every``, with ``--recover``), and whether every answer was
still right.

    python benchmarks/serve_soak.py [--model smollm2-135m] [--stages 2] [--clients 10]
        [--seconds 120] [--max-concurrent 4] [--max-queue 6] [--prefill-chunk 8]
        [--edges auto|shm|tcp] [--kill-every 25] [--json]

One server (``python -m runtime_cupy serve``, the CPU worker, a key) and ``--clients``
threads of the official ``openai`` client and plain HTTP, each drawing, request after
request until ``--seconds`` have passed, one of:

- a greedy chat answer, whole or streamed: it must be the text the same prompt got
  alone before the soak (the same bits alone or batched, whatever else runs);
- a seeded sampled answer whole, then streamed: the two must be equal;
- ``n`` greedy choices (1-3): all the same text, the text the same request got first;
- a stop string (a space): the alone answer's first word;
- a completion of 1-39 tokens: the text and finish reason the same request got first;
- a stream the client drops after a few chunks (its run cancelled);
- a bad request (broken JSON, no messages, a negative ``max_tokens``, a temperature
  that is a word): 400.

A full queue's 429 is counted, not an error (the client waits 0.2 s). With
``--kill-every S`` (which adds ``--recover --max-recoveries 1000`` to the server) a
stage process, drawn at random, is killed (SIGKILL) every S seconds while the clients
run: the streams interrupted must continue on the re-placed chain, their text still
the alone text, and the server must have started stages again (its
``gguf_pipeline_stage_restarts_total``). After the
soak: nothing runs or waits (``/metrics``, waited for up to 60 s), ``/health`` is
200, each prompt's greedy answer is still the one before, and the server's log has no
traceback. Printed: the counts by outcome, the requests per second, and each check's
verdict; exit status 1 if one fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx2
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.servers import ServerProcess, idle, metrics

KEY = "soak-key"
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about rain.",
    "Count from one to ten.",
    "Explain gravity to a child in two sentences.",
    "List three colors.",
)
BAD_BODIES = (
    b"{",
    b'{"model": "M", "messages": []}',
    b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
    b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
)
KINDS = ("greedy", "greedy_stream", "seeded", "n", "stop", "completion", "dropped", "bad")
GREEDY_TOKENS = 48


class Busy(Exception):
    """The server said 429 (a full queue)."""


class Soak:
    """The clients' shared state: the alone answers, the counts, the first failures."""

    def __init__(self, base_url: str, model: str, alone: dict[str, str]) -> None:
        self.base_url = base_url
        self.model = model
        self.alone = alone
        self.counts = {k: 0 for k in (*KINDS, "busy_429", "wrong", "error")}
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.first: dict[tuple[object, ...], object] = {}  # a request's first answer

    def same_as_first(self, key: tuple[object, ...], answer: object) -> str | None:
        """None if ``answer`` is the first answer given to the same greedy request (the
        same text whatever else ran beside it), else what differs."""
        with self.lock:
            first = self.first.setdefault(key, answer)
        return None if answer == first else f"{key}: {answer!r} != first {first!r}"

    def count(self, outcome: str, failure: str | None = None) -> None:
        with self.lock:
            self.counts[outcome] += 1
            if failure is not None and len(self.failures) < 20:
                self.failures.append(failure)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=KEY, max_retries=0, timeout=300
        )

    def one(self, kind: str, rnd: random.Random, client: openai.OpenAI) -> str | None:
        """One request of ``kind``: None if right, else what was wrong."""
        prompt = rnd.choice(PROMPTS)
        messages: Any = [{"role": "user", "content": prompt}]
        chat = client.chat.completions
        if kind in ("greedy", "greedy_stream"):
            if kind == "greedy":
                r = chat.create(
                    model=self.model, messages=messages, max_tokens=GREEDY_TOKENS, temperature=0
                )
                text = r.choices[0].message.content or ""
            else:
                chunks = chat.create(
                    model=self.model,
                    messages=messages,
                    stream=True,
                    max_tokens=GREEDY_TOKENS,
                    temperature=0,
                )
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return (
                None
                if text == self.alone[prompt]
                else f"{kind}: {text!r} != {self.alone[prompt]!r}"
            )
        if kind == "seeded":
            seed = rnd.randrange(10_000)
            whole = chat.create(
                model=self.model, messages=messages, max_tokens=24, temperature=0.9, seed=seed
            )
            chunks = chat.create(
                model=self.model,
                messages=messages,
                max_tokens=24,
                temperature=0.9,
                seed=seed,
                stream=True,
            )
            a = whole.choices[0].message.content or ""
            b = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return None if a == b else f"seed {seed}: whole {a!r} != streamed {b!r}"
        if kind == "n":
            n = rnd.randrange(1, 4)
            r = chat.create(model=self.model, messages=messages, max_tokens=16, temperature=0, n=n)
            texts = [c.message.content for c in r.choices]
            if len(texts) != n or len(set(texts)) != 1:
                return f"n={n}: {texts!r}"
            return self.same_as_first(("chat", prompt, 16), texts[0])
        if kind == "stop":
            r = chat.create(
                model=self.model,
                messages=messages,
                max_tokens=GREEDY_TOKENS,
                temperature=0,
                stop=[" "],
            )
            want = self.alone[prompt].split(" ")[0]
            stopped = r.choices[0].message.content
            return None if stopped == want else f"stop: {stopped!r} != {want!r}"
        if kind == "completion":
            tokens = rnd.randrange(1, 40)
            c = client.completions.create(
                model=self.model, prompt=prompt, max_tokens=tokens, temperature=0
            )
            done = (c.choices[0].text, c.choices[0].finish_reason)
            return self.same_as_first(("completion", prompt, tokens), done)
        if kind == "dropped":
            body = {"model": self.model, "messages": messages, "max_tokens": 200, "stream": True}
            with httpx2.stream(
                "POST",
                f"{self.base_url}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {KEY}"},
                timeout=60,
            ) as stream:
                if stream.status_code == 429:
                    raise Busy
                if stream.status_code != 200:
                    return f"dropped stream: status {stream.status_code}"
                keep = rnd.randrange(1, 12)
                for i, _ in enumerate(stream.iter_lines()):
                    if i >= keep:
                        break
            return None
        bad = httpx2.post(
            f"{self.base_url}/v1/chat/completions",
            content=rnd.choice(BAD_BODIES),
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
            timeout=30,
        )
        if bad.status_code == 429:
            raise Busy
        if bad.status_code == 400:  # not 401 or 404: the key and the path are right
            return None
        return f"bad request: {bad.status_code} {bad.text[:80]}"

    def clients(self, count: int, seconds: float) -> None:
        def loop(index: int) -> None:
            rnd, client = random.Random(index), self.client()
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                kind = rnd.choice(KINDS)
                try:
                    wrong = self.one(kind, rnd, client)
                except (Busy, openai.RateLimitError):
                    self.count("busy_429")
                    time.sleep(0.2)
                    continue
                except Exception as e:  # every other failure is the soak's finding
                    self.count("error", f"{kind}: {e!r}"[:300])
                    continue
                self.count(kind if wrong is None else "wrong", wrong)

        threads = [threading.Thread(target=loop, args=(i,)) for i in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def greedy_answers(soak_client: openai.OpenAI, model: str) -> dict[str, str]:
    out = {}
    for p in PROMPTS:
        r = soak_client.chat.completions.create(
            model=model,
            max_tokens=GREEDY_TOKENS,
            temperature=0,
            messages=[{"role": "user", "content": p}],
        )
        out[p] = r.choices[0].message.content or ""
    return out


def killer(server: ServerProcess, every_s: float, until: float, killed: list[int]) -> None:
    rnd = random.Random(0)
    while time.monotonic() + every_s < until:
        time.sleep(every_s)
        pids = list(server.stage_pids().values())
        if pids:
            pid = rnd.choice(pids)
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--clients", type=int, default=10, help="client threads (10)")
    ap.add_argument("--seconds", type=float, default=120.0, help="how long they send (120)")
    ap.add_argument("--max-concurrent", type=int, default=4)
    ap.add_argument("--max-queue", type=int, default=6)
    ap.add_argument("--prefill-chunk", type=int, default=8)
    ap.add_argument("--edges", default="auto", choices=("auto", "shm", "tcp"))
    ap.add_argument(
        "--kill-every",
        type=float,
        default=0.0,
        help="kill a stage process every this many seconds (0: never); "
        "the server then runs with --recover",
    )
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args(argv)

    serve_args = [
        "--model",
        args.model,
        "--stages",
        str(args.stages),
        "--port",
        "0",
        "--max-concurrent",
        str(args.max_concurrent),
        "--max-queue",
        str(args.max_queue),
        "--prefill-chunk",
        str(args.prefill_chunk),
        "--edges",
        args.edges,
    ]
    if args.kill_every > 0:
        serve_args += ["--recover", "--max-recoveries", "1000"]
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(
            serve_args, Path(tmp) / "serve.log", dict(os.environ, GGUF_PIPELINE_API_KEY=KEY)
        )
        try:
            base = server.wait_listening()
            server.wait_ready(300)
            first = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=300)
            model = first.models.list().data[0].id
            soak = Soak(base, model, greedy_answers(first, model))
            killed: list[int] = []
            start = time.monotonic()
            if args.kill_every > 0:
                until = start + args.seconds
                threading.Thread(
                    target=killer, args=(server, args.kill_every, until, killed), daemon=True
                ).start()
            soak.clients(args.clients, args.seconds)
            wall = time.monotonic() - start
            auth = {"Authorization": f"Bearer {KEY}"}
            deadline = time.monotonic() + 60  # the dropped streams' runs end their step
            while not idle(base, auth) and time.monotonic() < deadline:
                time.sleep(0.1)
            m = metrics(base, auth)
            after = greedy_answers(first, model)
            health = server.health()
        finally:
            server.stop()
        log = server.log()
    answered = sum(soak.counts[k] for k in KINDS)
    checks = {
        "every answer right": soak.counts["wrong"] == 0,
        "no request failed": soak.counts["error"] == 0,
        "nothing runs or waits after": m["gguf_pipeline_runs_in_flight"] == 0
        and m["gguf_pipeline_queue_length"] == 0,
        "health 200 after": health == 200,
        "greedy answers unchanged after": after == soak.alone,
        "no traceback in the server's log": "Traceback" not in log,
    }
    if args.kill_every > 0:
        checks["stages started again after the kills"] = (
            len(killed) > 0 and m["gguf_pipeline_stage_restarts_total"] >= 1
        )
    result = {
        "model": model,
        "clients": args.clients,
        "seconds": round(wall, 1),
        "stages_killed": len(killed),
        "counts": soak.counts,
        "requests_per_s": round(answered / wall, 2),
        "failures": soak.failures,
        "checks": checks,
        "load_average": os.getloadavg(),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"{model}: {args.clients} clients for {wall:.0f} s, {len(killed)} stage "
            f"processes killed; load average {os.getloadavg()[0]:.1f}"
        )
        print("  " + ", ".join(f"{k} {v}" for k, v in soak.counts.items()))
        print(f"  {answered / wall:.1f} requests/s answered")
        for f in soak.failures:
            print(f"  failure: {f}")
        for name, ok in checks.items():
            print(f"  {name}: {'PASS' if ok else 'FAIL'}")
        for line in re.findall(r".*Traceback.*", log)[:5]:
            print(f"  log: {line}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
