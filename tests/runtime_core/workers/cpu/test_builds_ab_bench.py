"""benchmarks/cpu_builds_ab.py loads several builds of the kernels into one process and
times their products in turn: each build's rounds, its time over the first's, and
whether every build gave the same bits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks import cpu_builds_ab

from runtime_core.workers.cpu import _kernels

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
