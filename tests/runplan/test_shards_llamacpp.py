"""The shards ``split`` writes are the files llama.cpp read: ``scripts/check_shards_llamacpp.py``
(run with a Python that has llama-cpp-python) recorded what llama.cpp's GGUF library and
model loader read of SmolLM2's three shards (``tests/fixtures/llamacpp/shards.json``);
here the same split, made now and read by the gguf package, must show the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from runplan import RunPlan, model_facts_from_gguf
from runplan.gguf_header import GgufHeader
from runplan.split import split_model, split_plan

RECORD = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp" / "shards.json"


@pytest.fixture(scope="module")
def shards(smollm2_path: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    plan = split_plan(model_facts_from_gguf(smollm2_path), 3, None, "even")
    assert isinstance(plan, RunPlan)
    out = tmp_path_factory.mktemp("smollm2-3")
    split_model(smollm2_path, plan, out)
    return out


def test_split_writes_what_llama_cpp_read(shards: Path) -> None:
    record = json.loads(RECORD.read_text())
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["source"] == record["source"]
    assert [e["file"] for e in manifest["shards"]] == [s["file"] for s in record["shards"]]
    for read in record["shards"]:
        ours = gguf.GGUFReader(shards / read["file"])
        data_offset = ours.data_offset
        assert data_offset == read["data_offset"]
        tensors = [
            [t.name, int(t.tensor_type), int(t.data_offset) - data_offset, int(t.n_bytes)]
            for t in ours.tensors
        ]
        assert tensors == read["tensors"]
        assert len([k for k in ours.fields if not k.startswith("GGUF.")]) == read["n_kv"]
        for key, value in read["keys"].items():
            got = ours.fields[key].contents()
            assert (len(got) if isinstance(got, list) else got) == value, key
        header = GgufHeader.read(shards / read["file"])
        assert header.array_length("tokenizer.ggml.tokens") == read["n_vocab"]


@pytest.mark.parametrize("what", ["missing", "a file"])
def test_the_script_says_a_folder_without_a_manifest_in_one_line(tmp_path: Path, what: str) -> None:
    """``scripts/check_shards_llamacpp.py`` given a folder that is missing or a file: one
    line naming it, exit 2 (a ``FileNotFoundError`` traceback), with llama-cpp-python or
    without it (checked before it is needed)."""
    folder = tmp_path / "shards"
    if what == "a file":
        folder.write_text("x\n")
    script = Path(__file__).resolve().parents[2] / "scripts" / "check_shards_llamacpp.py"
    done = subprocess.run([sys.executable, str(script), str(folder)], capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert f"error: {str(folder)!r}: no shard manifest to read there" in last, done.stderr
    assert "Traceback" not in done.stderr
