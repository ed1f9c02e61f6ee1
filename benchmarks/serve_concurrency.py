"""Concurrent streaming clients against the server (continuous batching, issue 22),
beside llama.cpp decoding the same model for as many sequences in one batch.

    python benchmarks/serve_concurrency.py [--model smollm2-135m] [--clients 1,2,4,8]
        [--prompt-tokens 32] [--tokens 48] [--long-prompt 2000]
        [--llamacpp-python /work/llamacpp-venv/bin/python] [--only-long-prompt]
        [--prefill-chunk 16] [--json]

Two servers (``python -m runtime_cupy serve``, the CPU worker, ``--max-concurrent 8``)
run at once, idle while the other is measured: **2 stages of 1 thread each** and **1
stage of 2 threads** (each stage takes its share of the host's cores). For each count
of clients, interleaved (server A, server B, llama.cpp; then the next count), the
clients (threads of a process of their own, one kept-alive connection each) send
``/v1/completions`` streams at the same moment: ``--prompt-tokens`` token ids each
(distinct, drawn from a generator seeded by the client's index), ``--tokens`` tokens,
greedy. Per configuration: aggregate tokens/s (every client's tokens over the wall time
from the first send to the last end), p50 and p99 of the time to first token and of the
gap between tokens (all clients' gaps together). The llama.cpp column is
``benchmarks/llamacpp_batch.py`` (run with ``--llamacpp-python``: llama-cpp-python's
low-level batch API, ``n`` sequences in one ``llama_decode`` a step, 2 threads, f32
cache), its aggregate decode tokens/s.

Then the long prompt: 4 streams decoding on each server, and a ``--long-prompt``-token
prompt arriving mid-way; the 4 streams' p99 inter-token gap while it is prefilled,
against their median gap.

Targets (issue 22): at 4 clients at least 2.0x our own 1-client aggregate; at 4 and at
8 at least 1.0x llama.cpp's aggregate for as many sequences; the long prompt stretches
the streams' p99 gap to at most 3x its median. Every figure is printed with the host's
load average: measured while other work runs, the figures spread; say so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.servers import ServerProcess

from runplan.models import resolve_model

ROOT = Path(__file__).resolve().parent.parent
LLAMACPP = Path("/work/llamacpp-venv/bin/python")


def prompt_ids(index: int, count: int, vocab: int) -> list[int]:
    """Distinct prompts: ids from a generator seeded by the client's index (no shared
    prefix), away from the special tokens at the vocabulary's start."""
    rng = np.random.default_rng(index)
    return [int(t) for t in rng.integers(100, min(vocab, 30_000), count)]


# -- the client process --------------------------------------------------------------


def stream_one(url: str, model: str, ids: list[int], tokens: int, gate: threading.Barrier) -> Any:
    """One streamed completion: when it was sent, each chunk's arrival, the tokens."""
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx2.Client(timeout=600) as client:
        client.get(f"{url}/health")  # the connection is open before the clocks start
        gate.wait()
        sent = time.monotonic()
        arrivals: list[float] = []
        used = 0
        with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    used = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    arrivals.append(time.monotonic())
        return {"sent": sent, "arrivals": arrivals, "tokens": used}


def client_main(spec: dict[str, Any]) -> int:
    """``--client SPEC``: ``clients`` streams at once (and, with ``late``, one more of
    ``late_tokens`` prompt tokens sent ``late_s`` after them); prints their timings."""
    n = spec["clients"]
    late = spec.get("late")
    gate = threading.Barrier(n + (1 if late else 0))
    out: list[Any] = [None] * (n + (1 if late else 0))

    def run(i: int, ids: list[int], tokens: int) -> None:
        out[i] = stream_one(spec["url"], spec["model"], ids, tokens, gate)

    threads = [
        threading.Thread(
            target=run,
            args=(i, prompt_ids(i, spec["prompt_tokens"], spec["vocab"]), spec["tokens"]),
        )
        for i in range(n)
    ]
    if late:

        def late_run() -> None:
            ids = prompt_ids(99, late["prompt_tokens"], spec["vocab"])
            with httpx2.Client(timeout=600) as client:
                client.get(f"{spec['url']}/health")
                gate.wait()
                time.sleep(late["after_s"])
                sent = time.monotonic()
                r = client.post(
                    f"{spec['url']}/v1/completions",
                    json={"model": spec["model"], "prompt": ids, "max_tokens": 1},
                )
                out[n] = {"sent": sent, "ended": time.monotonic(), "status": r.status_code}

        threads.append(threading.Thread(target=late_run))
    began = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"began": began, "streams": out[:n], "late": out[n] if late else None}))
    return 0


def clients(
    url: str, model: str, vocab: int, args: argparse.Namespace, n: int, late: Any = None
) -> Any:
    spec = {
        "url": url,
        "model": model,
        "vocab": vocab,
        "clients": n,
        "prompt_tokens": args.prompt_tokens,
        "tokens": args.tokens,
        "late": late,
    }
    done = subprocess.run(
        [sys.executable, __file__, "--client", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(result: Any) -> dict[str, Any]:
    streams = result["streams"]
    starts = min(s["sent"] for s in streams)
    ends = max(s["arrivals"][-1] for s in streams if s["arrivals"])
    tokens = sum(s["tokens"] for s in streams)
    ttft = [s["arrivals"][0] - s["sent"] for s in streams if s["arrivals"]]
    gaps = [b - a for s in streams for a, b in zip(s["arrivals"], s["arrivals"][1:], strict=False)]
    return {
        "tokens": tokens,
        "tokens_per_s": tokens / (ends - starts),
        "ttft_p50_ms": percentile(ttft, 50) * 1e3,
        "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "gap_p50_ms": percentile(gaps, 50) * 1e3,
        "gap_p99_ms": percentile(gaps, 99) * 1e3,
    }


def long_prompt(result: Any) -> dict[str, Any]:
    """The streams' gaps while the long prompt was in (sent to answered) against their
    median gap over the whole run."""
    late = result["late"]
    gaps_all, gaps_during = [], []
    for s in result["streams"]:
        for a, b in zip(s["arrivals"], s["arrivals"][1:], strict=False):
            gaps_all.append(b - a)
            if b >= late["sent"] and a <= late["ended"]:
                gaps_during.append(b - a)
    median = statistics.median(gaps_all)
    p99 = percentile(gaps_during or gaps_all, 99)
    return {
        "gap_median_ms": median * 1e3,
        "gap_p99_during_ms": p99 * 1e3,
        "ratio": p99 / median,
        "long_prompt_s": late["ended"] - late["sent"],
        "status": late["status"],
    }


def llamacpp(model: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    done = subprocess.run(
        [
            str(args.llamacpp_python),
            str(ROOT / "benchmarks" / "llamacpp_batch.py"),
            *("--model", model, "--threads", "2", "--sequences", str(n)),
            *("--prompt-tokens", str(args.prompt_tokens), "--tokens", str(args.tokens)),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    )
    row = json.loads(done.stdout.strip().splitlines()[-1])
    return {"tokens_per_s": row["tokens_per_s"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--clients", default="1,2,4,8")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--long-prompt", type=int, default=2000)
    p.add_argument("--llamacpp-python", type=Path, default=LLAMACPP)
    p.add_argument("--only-long-prompt", action="store_true", help="the long prompt alone")
    p.add_argument("--prefill-chunk", type=int, default=None, help="the servers' (default theirs)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--client", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:
        return client_main(json.loads(args.client))
    counts = [] if args.only_long_prompt else [int(c) for c in args.clients.split(",")]
    model = str(resolve_model(args.model))
    from runtime_core.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(model)
    vocab = len(tok.vocab.tokens)
    context = str(max(args.long_prompt + 64, args.prompt_tokens + args.tokens) + 16)
    servers = {}
    folder = Path(tempfile.mkdtemp(prefix="serve-concurrency-"))
    for name, stages in (("2 stages x 1 thread", 2), ("1 stage x 2 threads", 1)):
        server = ServerProcess(
            ["--model", model, "--stages", str(stages), "--worker", "cpu", "--port", "0",
             "--max-concurrent", "8", "--max-queue", "16", "--context", context,
             *(["--prefill-chunk", str(args.prefill_chunk)] if args.prefill_chunk else [])],
            folder / f"server-{stages}.log",
        )  # fmt: skip
        server.wait_listening(120)
        server.wait_ready(300)
        servers[name] = server
    rows: list[dict[str, Any]] = []
    facts: dict[str, Any] = {"load": os.getloadavg(), "cores": os.cpu_count(), "rows": rows}
    try:
        served = json.loads(httpx2.get(f"{next(iter(servers.values())).base_url}/v1/models").text)
        served_model = served["data"][0]["id"]
        for n in counts:
            for name, server in servers.items():
                row = summarize(clients(server.base_url, served_model, vocab, args, n))
                rows.append({"config": name, "clients": n, **row})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            row = llamacpp(model, n, args)
            rows.append({"config": "llama.cpp 2 threads", "clients": n, **row})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        late = {"prompt_tokens": args.long_prompt, "after_s": 1.0}
        for name, server in servers.items():
            result = clients(server.base_url, served_model, vocab, args, 4, late)
            rows.append({"config": name, "long_prompt": long_prompt(result)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        for server in servers.values():
            server.stop()
    facts["load_after"] = os.getloadavg()
    if args.json:
        print(json.dumps(facts))
    else:
        print(f"load average before {facts['load']}, after {facts['load_after']}")
        for row in rows:
            print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
