"""benchmarks/cpu_builds_ab.py loads several builds of the kernels into one process and
times their products in turn: each build's rounds, its time over the first's, and
whether every build gave the same bits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks import cpu_builds_ab

from runtime_core.workers.cpu import _kernels
from tests.support.random_model import RandomModel, write_random_model

ROOT = Path(__file__).resolve().parents[4]


def test_one_build_twice_on_two_sets_gives_the_same_bits(tmp_path: Path) -> None:
    """The build named once by its tree, once by its file."""
    best = _kernels.isas()[-1]
    out = tmp_path / "r.json"
    so = _kernels.__file__
    report = cpu_builds_ab.main([f"{ROOT}@portable", f"{so}@{best}", "--types", "Q4_0,Q6_K",
                                 "--rows", "1,3", "--n-out", "64", "--n-in", "512",
                                 "--rounds", "2", "--json", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == report
    cases = [(r["type"], r["rows"]) for r in report["results"]]
    assert cases == [("Q4_0", 1), ("Q4_0", 3), ("Q6_K", 1), ("Q6_K", 3)]
    for r in report["results"]:
        assert r["same_bits"] is True
        assert [b["isa"] for b in r["builds"]] == ["portable", best]
        for b in r["builds"]:
            assert len(b["rounds_ms"]) == 2 and min(b["rounds_ms"]) > 0
            assert b["median_ms"] == pytest.approx(sum(b["rounds_ms"]) / 2)  # two rounds' median


def test_a_tree_without_a_build_or_a_set_it_lacks_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no built _kernels module"):
        cpu_builds_ab.main([str(tmp_path)])
    for bad in ([f"{ROOT}@no-such-set"], [str(ROOT), "--types", "Q4_O"],
                [str(ROOT), "--types", "Q4_K", "--n-in", "576"]):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            cpu_builds_ab.main(bad)
        assert e.value.code == 2


def test_a_models_step_products_on_two_sets_give_the_same_bits(tmp_path: Path) -> None:
    """--model: a pass over the step's products per build per round, the sets' bits equal."""
    model = RandomModel(n_layers=1, hidden=256, ffn=512, vocab=512, qtype="Q4_0",
                        head_qtype="Q6_K")  # fmt: skip
    path = write_random_model(tmp_path / "m.gguf", model)
    best = _kernels.isas()[-1]
    report = cpu_builds_ab.main([f"{ROOT}@portable", f"{ROOT}@{best}", "--model", str(path),
                                 "--rows", "1,2", "--threads", "2", "--rounds", "3"])  # fmt: skip
    assert [(r["rows"], r["threads"]) for r in report["results"]] == [(1, 2), (2, 2)]
    for r in report["results"]:
        assert r["same_bits"] is True
        assert [b["isa"] for b in r["builds"]] == ["portable", best]
        assert all(len(b["rounds_ms"]) == 3 and min(b["rounds_ms"]) > 0 for b in r["builds"])
        assert r["builds"][0]["over_first"] == 1.0
    with pytest.raises(SystemExit) as e:
        cpu_builds_ab.main([str(ROOT), "--model", str(tmp_path / "none.gguf")])
    assert e.value.code == 2
