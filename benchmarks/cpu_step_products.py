"""A decode step's weight products alone, per weight kind, and their share of the read
probe measured just before each pass.

    python benchmarks/cpu_step_products.py MODEL [--rows 1] [--threads 1] [--isa NAME]
        [--passes 8] [--probe] [--json OUT.json]

Every block's 2-D weights of the GGUF file ``MODEL`` (``attn_q`` .. ``ffn_down``, in a
decode step's order, block after block) and the head (``output.weight``, else the tied
embedding), each held as the CPU worker holds it (``_kernels.Matrix``, repacked where
its type repacks), multiplied by ``--rows`` rows of activations (8-bit, quantized in the
call, as a step's products are: ``--rows`` runs decoding in one batch), one product per
matrix per pass, ``--passes`` passes. The weights are read from memory on every pass
(a model of more bytes than the last-level cache: the 8B shape's files of
``cpu_decode.py --model-dir``), so a pass reads what a decode step reads, without the
step's other work (attention, norms, the program's calls).

Printed: per weight kind and type, the median pass's ms and GB/s (the matrix's bytes as
the file stores them over its time); the passes' total, median and best. With
``--probe``: before each pass, this machine's read bandwidth (``cpu_decode.py``'s
``csrc/read_probe.c``, as many threads as ``--threads``, best of 2 reads of 1 GiB),
and that pass's rate over it: on a shared host the probe moves between phases (by a
quarter at 1 thread, by half at 2 where the second core is busy elsewhere), and a
pass's rate over the probe just before it says how near the kernels come to what the
host gives at that moment. Nothing is asserted; run it several times and compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_decode import read_probe  # noqa: E402

from runtime_core.workers.cpu import _kernels  # noqa: E402
from runtime_core.workers.cpu.step_buffers import q_rows  # noqa: E402

#: a block's 2-D weights in a decode step's order
ORDER = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def step_matrices(path: Path) -> list[tuple[str, str, int, int, np.ndarray]]:
    """(kind, type, n_out, n_in, stored rows as bytes) of every 2-D weight a decode step
    multiplies, in its order: the blocks', then the head (the embedding when tied)."""
    reader = GGUFReader(path)
    by = {t.name: t for t in reader.tensors}
    blocks = sorted({int(n.split(".")[1]) for n in by if n.startswith("blk.")})
    names = [f"blk.{i}.{k}.weight" for i in blocks for k in ORDER if f"blk.{i}.{k}.weight" in by]
    names.append("output.weight" if "output.weight" in by else "token_embd.weight")
    out = []
    for name in names:
        t = by[name]
        n_in, n_out = int(t.shape[0]), int(t.shape[1])
        raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(n_out, -1)
        kind = "head" if not name.startswith("blk.") else name.split(".")[-2]
        out.append((kind, t.tensor_type.name, n_out, n_in, raw))
    return out


def activations(rows: int, n_in: int, n_out: int, seed: int) -> tuple[np.ndarray, ...]:
    """``rows`` random activation rows x, the buffers ``_kernels.linear`` quantizes them
    into (q, d, s, g), and the output y."""
    return (
        np.random.default_rng(seed).standard_normal((rows, n_in)).astype(np.float32),
        q_rows(np.zeros, rows, n_in),
        np.zeros((rows, n_in // 32), np.float32),
        np.zeros((rows, n_in // 32), np.float32),
        np.zeros((rows, n_in // 16), np.int32),
        np.zeros((rows, n_out), np.float32),
    )


def probe_rate(probe: Path, threads: int) -> float:
    """Bytes a second ``threads`` threads read (the probe, 1 GiB, best of 2)."""
    done = subprocess.run(
        [str(probe), str(threads), "1024", "2"], capture_output=True, text=True, check=True
    )
    return float(done.stdout.split()[0])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="a GGUF file")
    ap.add_argument("--rows", type=int, default=1, help="activation rows (1: one run's decode)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--isa", default=None, help=f"one of {', '.join(_kernels.isas())} (the best)")
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("--probe", action="store_true", help="the read probe before each pass")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.rows < 1 or args.threads < 1 or args.passes < 1:
        ap.error("--rows, --threads and --passes are at least 1")
    if args.isa is not None and args.isa not in _kernels.isas():
        ap.error(f"--isa {args.isa}: this processor runs {', '.join(_kernels.isas())}")
    probe: Path | None = None
    if args.probe:
        built = read_probe()  # built in a folder removed at exit
        if not isinstance(built, Path):
            ap.error(f"--probe: the read probe did not build: {built}")
        probe = built

    rows, isa = args.rows, ({"isa": args.isa} if args.isa else {})
    mats: list[tuple[str, str, Any, int, tuple[np.ndarray, ...]]] = []
    for kind, qtype, n_out, n_in, raw in step_matrices(args.model):
        m = _kernels.Matrix([(raw, qtype, n_out, n_in, 0)], repack=True)
        mats.append((kind, qtype, m, raw.nbytes, activations(rows, n_in, n_out, len(mats))))
    total_bytes = sum(nb for _, _, _, nb, _ in mats)

    times: dict[tuple[str, str], list[float]] = defaultdict(list)
    passes: list[dict[str, float]] = []
    for _ in range(args.passes):
        before = probe_rate(probe, args.threads) if probe else None
        per: dict[tuple[str, str], float] = defaultdict(float)
        t_pass = 0.0
        for kind, qtype, m, _, (x, q, d, s, g, y) in mats:
            t0 = time.perf_counter()
            _kernels.linear(m, rows, x, q, d, s, g, True, True, y, None, False, args.threads, **isa)
            dt = time.perf_counter() - t0
            per[(kind, qtype)] += dt
            t_pass += dt
        for key, dt in per.items():
            times[key].append(dt)
        row = {"s": t_pass, "gb_s": total_bytes / t_pass / 1e9}
        if before is not None:
            row["probe_gb_s"] = before / 1e9
            row["of_probe"] = total_bytes / t_pass / before
        passes.append(row)

    bytes_by: dict[tuple[str, str], int] = defaultdict(int)
    for kind, qtype, _, nb, _ in mats:
        bytes_by[(kind, qtype)] += nb
    print(
        f"{args.model.name}: {len(mats)} matrices, {total_bytes / 1e6:.1f} MB a pass, "
        f"{rows} row(s), {args.threads} thread(s), the {args.isa or _kernels.isas()[-1]} "
        f"set, {args.passes} passes"
    )
    kinds = []
    for key, dts in times.items():
        med = statistics.median(dts)
        kinds.append({"kind": key[0], "type": key[1], "ms": 1e3 * med,
                      "gb_s": bytes_by[key] / med / 1e9, "bytes": bytes_by[key]})  # fmt: skip
        print(f"  {key[0]:12} {key[1]:7} {1e3 * med:8.3f} ms {bytes_by[key] / med / 1e9:6.1f} GB/s")
    totals = [p["s"] for p in passes]
    print(
        f"  a pass: median {1e3 * statistics.median(totals):.2f} ms "
        f"({total_bytes / statistics.median(totals) / 1e9:.1f} GB/s), best {1e3 * min(totals):.2f}"
    )
    if probe:
        for i, p in enumerate(passes):
            print(
                f"  pass {i}: probe {p['probe_gb_s']:5.1f} GB/s, products {p['gb_s']:5.1f} "
                f"GB/s, {p['of_probe']:.0%} of the probe"
            )
        share = statistics.median(p["of_probe"] for p in passes)
        print(f"  median pass: {share:.0%} of the probe measured just before it")
    report = {"model": str(args.model), "rows": rows, "threads": args.threads,
              "isa": args.isa, "bytes_per_pass": total_bytes, "kinds": kinds,
              "passes": passes}  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
