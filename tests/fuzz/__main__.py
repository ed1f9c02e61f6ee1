"""``python -m tests.fuzz [--facts N] [--deep N] [--seed S]`` (``make fuzz``): fuzz the
GGUF readers with ``N`` mutants through the facts alone and ``N`` through every stage,
and print what they did: mutants, seconds, refusals by stage and kind, how many reached
each stage. Exit status 1 (and Hypothesis's smallest failing mutant) on an untyped error
or a mutant past its time limit."""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from tests.fuzz.pipeline import Tally, fuzz, load_bases
from tests.fuzz.test_gguf_fuzz import WEIGHTS


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    parser.add_argument("--facts", type=int, default=100_000, help="mutants through the facts")
    parser.add_argument("--deep", type=int, default=2_000, help="mutants through every stage")
    parser.add_argument("--seed", type=int, default=None, help="Hypothesis seed (default: new)")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    print(f"seed {seed} (python -m tests.fuzz --seed {seed} runs these mutants again)")
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gguf-fuzz-") as work:
        bases = load_bases(Path(work))
        print(
            f"bases read in {time.perf_counter() - began:.1f} s: "
            + ", ".join(f"{b.name} ({len(b.targets)} fields)" for b in bases)
        )
        for name, n, deep in (("facts only", args.facts, False), ("every stage", args.deep, True)):
            tally = Tally(f"GGUF fuzz, {name}")
            try:
                fuzz(bases, WEIGHTS, n, tally, deep=deep, seed=seed, progress_every=10_000)
            finally:
                print("\n".join(tally.lines()), flush=True)
    print(f"total {time.perf_counter() - began:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
