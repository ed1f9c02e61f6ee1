"""The CPU worker's greedy runs of tiny fixture models, as one JSON line: run as
``python -m tests.support.isa_greedy [--isa NAME] MODEL...`` (MODEL: a ``tiny.json``
entry's name), in an interpreter on an emulated processor
(``test_cpu_other_processors.py``) or here.

It prints ``{"isas": the sets this processor runs, "chosen": the set the worker took,
"runs": {model: {"tokens": [...], "logits": sha256 of every step's logits}}}``."""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

from runtime_core.workers.cpu.kernels import checked_isa, host_isas
from runtime_core.workers.cpu.worker import CpuWorker
from tests.fixtures.llamacpp_fixtures import load_doc, model_file
from tests.support.chain import provisions, run


def greedy_runs(names: list[str], isa: str | None, folder: Path) -> dict[str, Any]:
    """Each named model's greedy tokens and the digest of its logits, on ``isa``."""
    doc = load_doc("tiny")
    entries = {m["name"]: m for m in doc["models"]}
    runs: dict[str, Any] = {}
    for name in names:
        provs = provisions(model_file(entries[name], folder), 1, max_seq_len=64)
        outs = run(provs, lambda: CpuWorker(isa=isa), doc["prompt"], doc["greedy_tokens"])
        digest = hashlib.sha256()
        for out in outs:
            assert out.logits is not None
            digest.update(out.logits.tobytes())
        runs[name] = {"tokens": [o.token_id for o in outs], "logits": digest.hexdigest()}
    return {"isas": list(host_isas()), "chosen": checked_isa(isa), "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--isa", default=None, help="the set to force (default: the best)")
    parser.add_argument("models", nargs="+")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        print(json.dumps(greedy_runs(args.models, args.isa, Path(folder))))


if __name__ == "__main__":
    main()
