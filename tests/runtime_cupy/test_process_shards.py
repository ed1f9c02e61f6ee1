"""Shards written by ``python -m runplan split`` run through ``python -m runtime_cupy
--model DIR``: each stage process loads its own shard, and the tokens are the whole
file's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runplan.cli import main as runplan_main
from runtime_cupy.cli.main import main

pytestmark = pytest.mark.process


def _tokens(model: str, stages: int, capsys: pytest.CaptureFixture[str]) -> list[int]:
    args = ["--model", model, "--stages", str(stages), "--prompt-ids", "7,8,9",
            "--max-tokens", "6", "--json"]  # fmt: skip
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["outcome"] == "completed", doc
    tokens: list[int] = doc["tokens"]
    return tokens


def test_shards_give_the_whole_files_tokens_through_the_process_runtime(
    tiny: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "shards"
    assert runplan_main(["split", tiny, "--stages", "3", "--out", str(out)]) == 0
    capsys.readouterr()
    whole = _tokens(tiny, 3, capsys)
    assert _tokens(str(out / "manifest.json"), 3, capsys) == whole
