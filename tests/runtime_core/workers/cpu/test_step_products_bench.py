"""benchmarks/cpu_step_products.py takes every 2-D weight a decode step multiplies, in the
step's order, and counts their bytes as the file stores them (read back with the gguf
package): for an untied and a tied head, with and without the read probe."""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path

import pytest
from benchmarks import cpu_step_products
from gguf import GGUFReader

from tests.support.random_model import RandomModel, write_random_model

CC = (shlex.split(os.environ.get("CC", "gcc")) or ["gcc"])[0]


def _expected(path: Path) -> tuple[list[str], int]:
    """The weights a step multiplies, in order, and their stored bytes (gguf's reading)."""
    by = {t.name: t for t in GGUFReader(path).tensors}
    names = [n for n in by if n.startswith("blk.") and len(by[n].shape) == 2]
    head = "output.weight" if "output.weight" in by else "token_embd.weight"
    return [*names, head], sum(int(by[n].n_bytes) for n in [*names, head])


@pytest.mark.parametrize("tied", [False, True])
def test_a_pass_reads_every_step_weight_once(tmp_path: Path, tied: bool) -> None:
    model = RandomModel(n_layers=2, hidden=256, ffn=512, vocab=512, qtype="Q4_0",
                        head_qtype="Q6_K", tied=tied)  # fmt: skip
    path = write_random_model(tmp_path / "m.gguf", model)
    names, nbytes = _expected(path)
    out = tmp_path / "r.json"
    report = cpu_step_products.main([str(path), "--passes", "2", "--rows", "3", "--json", str(out)])
    assert json.loads(out.read_text()) == report
    assert report["bytes_per_pass"] == nbytes
    assert len(names) == 2 * len(cpu_step_products.ORDER) + 1
    kinds = {(k["kind"], k["type"]): k for k in report["kinds"]}
    head_type = "Q4_0" if tied else "Q6_K"
    assert set(kinds) == {(k, "Q4_0") for k in cpu_step_products.ORDER} | {("head", head_type)}
    assert sum(k["bytes"] for k in kinds.values()) == nbytes
    assert all(k["ms"] > 0 for k in kinds.values())
    assert len(report["passes"]) == 2 and all(p["s"] > 0 for p in report["passes"])


@pytest.mark.skipif(shutil.which(CC) is None, reason=f"no {CC} to build the read probe")
def test_the_probe_beside_each_pass(tmp_path: Path) -> None:
    path = write_random_model(tmp_path / "m.gguf", RandomModel(n_layers=1))
    report = cpu_step_products.main([str(path), "--passes", "1", "--probe"])
    (p,) = report["passes"]
    assert p["probe_gb_s"] > 0.1 and p["of_probe"] == pytest.approx(p["gb_s"] / p["probe_gb_s"])


def test_an_instruction_set_this_processor_lacks_is_refused(tmp_path: Path) -> None:
    path = write_random_model(tmp_path / "m.gguf", RandomModel(n_layers=1))
    with pytest.raises(SystemExit) as e:
        cpu_step_products.main([str(path), "--isa", "no-such-set"])
    assert e.value.code == 2
