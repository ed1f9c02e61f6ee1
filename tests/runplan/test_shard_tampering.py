"""Shards changed after ``split`` wrote them: refused where they are read (headers only)
and where they are split again (every tensor hashed), naming the file and what differs."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from runplan import GgufError, model_facts_from_gguf
from runplan.cli import main
from runplan.gguf_header import GgufHeader
from runplan.shard_file import write_shard
from runplan.shards import MANIFEST_NAME, ShardKeys, SliceParts
from runtime_core.errors import UnsupportedModel
from runtime_core.gguf_slice import open_stage_slice
from tests.fixtures.gguf_models import ModelShape, write_model

SHAPE = ModelShape(n_layers=5, tied=True, rope_freqs=True, quant="Q8_0")


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = write_model(tmp_path_factory.mktemp("src") / "tiny.gguf", SHAPE)
    out = tmp_path_factory.mktemp("shards") / "tiny-3"
    assert main(["split", str(model), "--stages", "3", "--out", str(out)]) == 0
    return out


def _entries(folder: Path) -> list[dict[str, object]]:
    entries: list[dict[str, object]] = json.loads((folder / MANIFEST_NAME).read_text())["shards"]
    return entries


def _edit_in_place(path: Path, key: str, value: float) -> None:
    """``key``'s value in ``path`` overwritten with ``value``, same type and size."""
    reader = gguf.GGUFReader(path)
    field = reader.fields[key]
    offset = field.offset + sum(p.nbytes for p in field.parts[:-1])
    data = np.array([value], field.parts[-1].dtype).tobytes()
    del reader
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_a_shard_whose_metadata_was_edited_is_refused_naming_it_and_the_key(
    shards: Path, tmp_path: Path
) -> None:
    """Each stage takes its hyperparameters from its own first shard: stage 1's
    ``rope.freq_base`` edited ran on silently, its output otherwise; only the slice
    server, hashing every tensor, refused it."""
    bad = tmp_path / "bad"
    shutil.copytree(shards, bad)
    entry = _entries(bad)[1]
    shard = bad / str(entry["file"])
    _edit_in_place(shard, "llama.rope.freq_base", 10.0)
    match = rf"{shard}.*llama\.rope\.freq_base.*stored otherwise in {shard} than in .*stage-0-of-3"
    with pytest.raises(GgufError, match=match):
        model_facts_from_gguf(bad)
    parts = SliceParts(**entry["parts"])  # type: ignore[arg-type]
    with pytest.raises(GgufError, match=match):  # a stage reading shards 0 and 1
        open_stage_slice(bad, 0, parts.layer_start + 1, is_first=True, is_last=False)


def test_shards_whose_tensor_changed_are_not_split_again(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``split`` of a manifest hashes every tensor: a shard's flipped byte was written
    into fresh shards recording the damaged bytes, and the slice server's check
    (``recorded_problem``) then passed."""
    bad = tmp_path / "bad"
    shutil.copytree(shards, bad)
    shard = bad / str(_entries(bad)[2]["file"])
    tensor = next(t for t in gguf.GGUFReader(shard).tensors if t.name.startswith("blk."))
    with open(shard, "r+b") as f:
        f.seek(tensor.data_offset)
        byte = f.read(1)
        f.seek(tensor.data_offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = tmp_path / "again"
    assert main(["split", str(bad), "--stages", "2", "--out", str(out), "--json"]) == 1
    message = json.loads(capsys.readouterr().out)["error"]["message"]
    assert f"{bad / MANIFEST_NAME}: will not split it again: tensor {tensor.name!r}" in message
    assert str(shard) in message and "changed after it was split" in message, message
    assert not out.exists() or not list(out.iterdir())


def test_a_tensor_missing_from_a_shard_is_blamed_on_that_shard(
    shards: Path, tmp_path: Path
) -> None:
    """A stage reading shards 0 and 1, shard 1 rewritten (its own keys) without one of
    its block's tensors: the error named shard 0, the stage's first file."""
    bad = tmp_path / "bad"
    shutil.copytree(shards, bad)
    entry = _entries(bad)[1]
    shard = bad / str(entry["file"])
    parts = SliceParts(**entry["parts"])  # type: ignore[arg-type]
    header = GgufHeader.read(shard)
    dropped = f"blk.{parts.layer_start}.attn_q.weight"
    recorded = dict(zip(header.tensors, header.strings(ShardKeys.TENSOR_SHA256), strict=True))
    write_shard(
        header,
        [n for n in header.tensors if n != dropped],
        parts,
        header.string(ShardKeys.SOURCE),
        recorded,
        header.string(ShardKeys.MODEL_ID),
        tmp_path / "rewritten.gguf",
    )
    del header
    os.replace(tmp_path / "rewritten.gguf", shard)
    with pytest.raises(UnsupportedModel, match="a tensor the stage needs is missing") as exc:
        open_stage_slice(bad, 0, parts.layer_start + 1, is_first=True, is_last=False)
    assert (exc.value.path, exc.value.tensor) == (str(shard), dropped)


def test_facts_on_a_shard_names_its_manifest_only_where_it_is_the_shard_named(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The manifest beside a shard was said to name it on its file name alone: another
    stage's shard, or another model's, at that name was called stage i of n."""
    swapped = tmp_path / "swapped"
    shutil.copytree(shards, swapped)
    first, second = (swapped / str(e["file"]) for e in _entries(swapped)[1:])
    first.rename(tmp_path / "x.gguf")
    second.rename(first)
    (tmp_path / "x.gguf").rename(second)
    other = tmp_path / "other"
    shutil.copytree(shards, other)
    doc = json.loads((other / MANIFEST_NAME).read_text())
    (other / MANIFEST_NAME).write_text(json.dumps({**doc, "source": "sha256:" + "0" * 64}))
    for file in (first, second, other / str(_entries(other)[1]["file"])):
        assert main(["facts", str(file), "--json"]) == 0
        facts = json.loads(capsys.readouterr().out)["shard"]
        assert (facts["manifest"], facts["stage_index"], facts["stage_count"]) == (
            None,
            None,
            None,
        ), file
    assert main(["facts", str(shards / str(_entries(shards)[1]["file"])), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["shard"]["stage_index"] == 1
