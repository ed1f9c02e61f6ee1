"""benchmarks/cpu_isa_steps.py decodes with every set it names, in one process, in
turn: each set's rounds, its time over the first set's, and the same greedy tokens from
every set (the sets compute the same bits)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks import cpu_isa_steps

from runtime_core.workers.cpu import _kernels
from tests.support.random_model import RandomModel, write_random_model


def test_every_set_decodes_the_same_tokens_in_turn(tmp_path: Path) -> None:
    path = write_random_model(tmp_path / "m.gguf", RandomModel(n_layers=2, qtype="Q4_0"))
    isas = ["portable", _kernels.isas()[-1]]
    out = tmp_path / "r.json"
    report = cpu_isa_steps.main([str(path), "--isas", ",".join(isas), "--batch", "1,2",
                                 "--tokens", "2", "--rounds", "3", "--json", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == report
    assert [(r["threads"], r["batch"]) for r in report["results"]] == [(1, 1), (1, 2)]
    for r in report["results"]:
        assert r["same_tokens"] is True
        assert list(r["sets"]) == isas
        first, *_ = r["sets"].values()
        assert first["over_first"] == 1.0
        for fig in r["sets"].values():
            assert len(fig["rounds_ms"]) == 3 and fig["best_ms"] == min(fig["rounds_ms"]) > 0


def test_a_set_this_processor_lacks_is_refused(tmp_path: Path) -> None:
    path = write_random_model(tmp_path / "m.gguf", RandomModel(n_layers=1))
    with pytest.raises(SystemExit) as e:
        cpu_isa_steps.main([str(path), "--isas", "avx2,no-such-set"])
    assert e.value.code == 2
