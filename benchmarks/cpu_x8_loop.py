"""One x8 kernel alone in a loop, this checkout's against another's, side by side.

    python benchmarks/cpu_x8_loop.py [--types Q4_0,Q4_1,Q8_0,Q4_K,Q5_K,Q6_K]
        [--isas avx2,avxvnni,avx512] [--rows 1,2] [--shapes 1024x4096,14336x4096]
        [--passes 1000] [--repeat 5] [--baseline DIR] [--json OUT.json]

The CPU worker's products of 8-row groups (``csrc/x8_kernels.h``, the 256-bit entries
the module calls: ``x8_q4_k`` and its peers) compiled by ``gcc`` with the module's flags
into a small program (``benchmarks/csrc/x8_loop.c``) that times them over a matrix of
random groups: no Python, thread pool or quantization of the activations in the way,
so that a change to a kernel shows above this machine's noise. ``--isas``: the
instruction sets' 256-bit builds, as ``dot_avx2.c``, ``dot_avxvnni.c`` and
``dot_avx512.c`` define them (those this processor lacks are skipped, with the
reason); the module's AVX-512 set also has 512-bit and one-stream kernels not timed
here (``benchmarks/cpu_repack.py`` times what the module runs). ``--baseline DIR``:
also builds DIR's ``src/runtime_core/workers/cpu/csrc`` (a checkout of another commit)
and runs the two in turn, ``--repeat`` times each; every figure is the best pass of
all. The first shape stays in cache, the second is read from memory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSRC = Path("src/runtime_core/workers/cpu/csrc")
LOOP = ROOT / "benchmarks" / "csrc" / "x8_loop.c"
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=gnu11"]

#: type: (entry, bytes of a group block, 32-element chunks in a block) (repack.h)
TYPES = {
    "Q4_0": ("x8_q4_0", 144, 1),
    "Q4_1": ("x8_q4_1", 160, 1),
    "Q8_0": ("x8_q8_0", 272, 1),
    "Q4_K": ("x8_q4_k", 1184, 8),
    "Q5_K": ("x8_q5_k", 1440, 8),
    "Q6_K": ("x8_q6_k", 1680, 8),
}
#: set: (X8_TARGET, X8_VNNI, extra definitions, /proc/cpuinfo flags it needs)
ISAS = {
    "avx2": ("avx2,f16c", 0, [], ("avx2", "f16c")),
    "avxvnni": (
        "avx2,f16c,avxvnni",
        1,
        ["-DX8_DOT256=_mm256_dpbusd_avx_epi32"],
        ("avx2", "f16c", "avx_vnni"),
    ),
    "avx512": (
        "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
        1,
        [],
        ("avx2", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    ),
}


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def build(csrc: Path, qtype: str, isa: str, out: Path) -> Path:
    fn, block, chunks = TYPES[qtype]
    target, vnni, extra, _ = ISAS[isa]
    exe = out / f"{qtype}-{isa}"
    defs = [
        f'-DX8_TARGET="{target}"',
        f"-DX8_VNNI={vnni}",
        f"-DLOOP_FN={fn}",
        f"-DLOOP_BYTES={block}",
        f"-DLOOP_CHUNKS={chunks}",
        *extra,
    ]
    cmd = ["gcc", *FLAGS, f"-I{csrc}", *defs, str(LOOP), "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return exe


def run(exe: Path, shape: tuple[int, int], rows: int, passes: int) -> float:
    args = [str(exe), str(shape[0]), str(shape[1]), str(rows), str(passes)]
    return float(subprocess.run(args, check=True, capture_output=True, text=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--isas", default=",".join(ISAS))
    parser.add_argument("--rows", default="1", help="activation rows, a list (1: decode)")
    parser.add_argument("--shapes", default="1024x4096,14336x4096")
    parser.add_argument("--passes", type=int, default=0, help="passes a run (0: by size)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each build, in turn")
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()

    flags = cpu_flags()
    isas = []
    for isa in args.isas.split(","):
        missing = [f for f in ISAS[isa][3] if f not in flags]
        if missing:
            print(f"{isa}: skipped (this processor lacks {', '.join(missing)})")
        else:
            isas.append(isa)
    shapes = [(int(s.split("x")[0]), int(s.split("x")[1])) for s in args.shapes.split(",")]
    trees = {"this": ROOT / CSRC}
    if args.baseline:
        trees["baseline"] = args.baseline.resolve() / CSRC
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in args.types.split(","):
            for isa in isas:
                exes = {}
                for name, tree in trees.items():
                    (Path(tmp) / name).mkdir(exist_ok=True)
                    exes[name] = build(tree, qtype, isa, Path(tmp) / name)
                for shape in shapes:
                    n_out, n_in = shape
                    _, block, chunks = TYPES[qtype]
                    nbytes = n_out // 8 * (n_in // 32 // chunks) * block
                    for rows in (int(r) for r in args.rows.split(",")):
                        passes = args.passes or max(3, int(4e8 / nbytes / rows))
                        best = dict.fromkeys(exes, float("inf"))
                        for _ in range(args.repeat):
                            for name, exe in exes.items():
                                best[name] = min(best[name], run(exe, shape, rows, passes))
                        row = {"type": qtype, "isa": isa, "shape": list(shape), "rows": rows}
                        row.update({f"{k}_ms": v for k, v in best.items()})
                        figures.append(row)
                        line = (
                            f"{n_out:5} x {n_in} {qtype} {isa:8} {rows:2} row(s): "
                            f"{best['this']:8.4f} ms ({nbytes / best['this'] / 1e6:5.1f} GB/s)"
                        )
                        if "baseline" in best:
                            line += (
                                f", baseline {best['baseline']:8.4f} ms: "
                                f"x{best['baseline'] / best['this']:.2f}"
                            )
                        print(line, flush=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
