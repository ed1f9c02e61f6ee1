"""NumPy reference worker on SmolLM2-135M: decode speed and resident memory.

    python benchmarks/reference_decode.py [--tokens 64] [--repeat 3] [--json]

- Decode: one stage holding every block (first and last at once), fed its own sampled
  token each step, as a one-stage pipeline is. Prints tokens/s of the decode steps
  (the prefill of the prompt is timed apart). Target (issue 4): >= 40 tokens/s on
  the 2-core CI-class machine; llama.cpp does about 165 there with 2 threads.
- Memory: in a fresh subprocess per case, the resident set (VmRSS, and its anonymous
  part) after ``bind`` and one step of a stage holding the first, middle or last third
  of the blocks of a 3-stage plan, and of a stage holding all of them; and of the same
  interpreter with everything imported but nothing bound. Target: a third of the
  blocks under 45% of the whole model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from runplan import (
    NodePool,
    NodeSpec,
    Placement,
    PlanRejection,
    ProvisionStage,
    RuntimeConfig,
    StageAssignment,
    model_facts_from_gguf,
    plan_run,
    provision_all,
)
from runplan.models import resolve_model
from runtime_core.workers.interface import TokenOutput
from runtime_core.workers.reference.worker import ReferenceWorker

MODEL = "smollm2-135m"
# "The capital of France is" as llama.cpp tokenizes it for SmolLM2.
PROMPT = [504, 3575, 282, 4649, 314]
CASES = ("imports", "first", "middle", "last", "all")


def provisions(ranges: list[tuple[int, int]], max_seq_len: int) -> tuple[ProvisionStage, ...]:
    facts = model_facts_from_gguf(resolve_model(MODEL), max_seq_len=max_seq_len)
    nodes = tuple(NodeSpec(f"n{i}", 2**40) for i in range(len(ranges)))
    rows = tuple(StageAssignment(i, f"n{i}", a, b) for i, (a, b) in enumerate(ranges))
    plan = plan_run(
        facts,
        RuntimeConfig(run_id="bench", max_tokens=max_seq_len),
        NodePool(orchestrator_node_id="orch", nodes=nodes),
        stage_count=len(ranges),
        placement=Placement(assignments=rows),
    )
    assert not isinstance(plan, PlanRejection), plan
    return provision_all(plan)


def decode_speed(n_tokens: int, repeat: int) -> dict[str, float]:
    n_layers = model_facts_from_gguf(resolve_model(MODEL)).num_layers
    (prov,) = provisions([(0, n_layers)], max_seq_len=len(PROMPT) + n_tokens + 1)
    worker = ReferenceWorker()
    worker.configure(prov)
    t0 = time.perf_counter()
    worker.bind(prov.gguf_source)
    bind_s = time.perf_counter() - t0
    rates, prefills = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = worker.execute_step(0, np.array(PROMPT, dtype=np.uint32))
        t1 = time.perf_counter()
        for k in range(1, n_tokens + 1):
            assert isinstance(out, TokenOutput)
            out = worker.execute_step(k, np.array([out.token_id], dtype=np.uint32))
        t2 = time.perf_counter()
        prefills.append(t1 - t0)
        rates.append(n_tokens / (t2 - t1))
    return {
        "bind_s": bind_s,
        "prefill_s": min(prefills),
        "decode_tokens_per_s_median": float(np.median(rates)),
        "decode_tokens_per_s_best": max(rates),
        "decode_tokens": n_tokens,
        "repeat": repeat,
    }


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def rss_case(case: str) -> dict[str, int | str]:
    """Run in a fresh process: bind one stage of ``case`` and take one step."""
    n_layers = model_facts_from_gguf(resolve_model(MODEL)).num_layers
    if case != "imports":
        third = [(0, n_layers // 3), (n_layers // 3, 2 * n_layers // 3)]
        third.append((2 * n_layers // 3, n_layers))
        index = {"first": 0, "middle": 1, "last": 2, "all": 0}[case]
        provs = provisions([(0, n_layers)] if case == "all" else third, max_seq_len=64)
        prov = provs[index]
        worker = ReferenceWorker()
        worker.configure(prov)
        worker.bind(prov.gguf_source)
        if prov.is_first:
            data: np.ndarray = np.array(PROMPT, dtype=np.uint32)
        else:
            data = np.random.default_rng(0).standard_normal(
                (len(PROMPT), prov.model.hidden_dim), dtype=np.float32
            )
        worker.execute_step(0, data)
        layers = f"{prov.layer_start}..{prov.layer_end_exclusive - 1}"
    else:
        layers = "-"
    return {
        "case": case,
        "layers": layers,
        "rss_kib": _status_kib("VmRSS"),
        "rss_anon_kib": _status_kib("RssAnon"),
        "rss_file_kib": _status_kib("RssFile"),
        "peak_kib": _status_kib("VmHWM"),
    }


def memory() -> list[dict[str, int | str]]:
    rows = []
    for case in CASES:
        out = subprocess.run(
            [sys.executable, __file__, "--rss-case", case],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        rows.append(json.loads(out))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rss-case", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_case:
        print(json.dumps(rss_case(args.rss_case)))
        return
    speed = decode_speed(args.tokens, args.repeat)
    mem = memory()
    full = next(r for r in mem if r["case"] == "all")
    if args.json:
        print(json.dumps({"decode": speed, "memory": mem}))
        return
    print(
        f"SmolLM2-135M Q4_1, one stage of all blocks: decode "
        f"{speed['decode_tokens_per_s_median']:.1f} tokens/s (median of {args.repeat} runs "
        f"of {args.tokens} tokens; best {speed['decode_tokens_per_s_best']:.1f}), prefill of "
        f"{len(PROMPT)} tokens {speed['prefill_s'] * 1e3:.0f} ms, bind {speed['bind_s']:.2f} s"
    )
    print(f"{'stage':8} {'blocks':7} {'RSS MiB':>8} {'anon MiB':>9} {'peak MiB':>9} {'of all':>7}")
    for r in mem:
        share = int(r["rss_kib"]) / int(full["rss_kib"])
        print(
            f"{r['case']:8} {r['layers']:7} {int(r['rss_kib']) / 1024:8.1f} "
            f"{int(r['rss_anon_kib']) / 1024:9.1f} {int(r['peak_kib']) / 1024:9.1f} {share:7.1%}"
        )


if __name__ == "__main__":
    main()
