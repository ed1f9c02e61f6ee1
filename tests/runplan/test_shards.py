"""Shards (``python -m runplan split``): one GGUF file per stage of a plan and a
manifest; read back by the gguf package, by the facts through the manifest (the one
place a file of some blocks is accepted), and by each stage from its own shard."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import gguf
import numpy as np
import pytest

import runtime_sim
from runplan import GgufError, model_facts_from_gguf
from runplan.cli import main
from runplan.content import source_content
from runplan.gguf_header import GgufHeader
from runplan.plan import RunPlan
from runplan.shards import MANIFEST_NAME, ShardKeys, SliceParts, slice_tensor_names
from runplan.split import split_model, split_plan
from runtime_core.gguf_slice import open_stage_slice
from tests.fixtures.gguf_models import ModelShape, write_model

SHAPE = ModelShape(n_layers=5, tied=True, rope_freqs=True, quant="Q8_0")
#: and a mixture of experts (Mixtral's kind), whose experts are 3-d tensors
SHAPES = {"dense": SHAPE, "experts": attrs.evolve(SHAPE, experts=4, experts_used=2)}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def model(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    return write_model(tmp_path_factory.mktemp("src") / "tiny.gguf", SHAPES[request.param])


@pytest.fixture(scope="module")
def shards(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "tiny-3"
    assert main(["split", str(model), "--stages", "3", "--out", str(out)]) == 0
    return out


def _manifest(folder: Path) -> dict[str, object]:
    doc: dict[str, object] = json.loads((folder / MANIFEST_NAME).read_text())
    return doc


def test_each_shard_is_a_gguf_file_of_its_stages_tensors_byte_for_byte(
    model: Path, shards: Path
) -> None:
    source = gguf.GGUFReader(model)
    by_name = {t.name: t for t in source.tensors}
    manifest = _manifest(shards)
    entries = manifest["shards"]
    assert isinstance(entries, list) and len(entries) == 3
    seen_blocks: list[int] = []
    for i, entry in enumerate(entries):
        parts = SliceParts(**entry["parts"])
        assert (parts.embedding, parts.output) == (i == 0, i == 2)
        shard = gguf.GGUFReader(shards / entry["file"])  # the gguf package reads it
        names = [t.name for t in shard.tensors]
        assert names == list(slice_tensor_names(by_name, parts))
        assert "rope_freqs.weight" in names  # every stage needs it
        # The tied head: the embedding is on the first stage and again on the last.
        assert ("token_embd.weight" in names) == (i in (0, 2))
        for t in shard.tensors:
            s = by_name[t.name]
            assert (t.tensor_type, list(t.shape)) == (s.tensor_type, list(s.shape))
            assert np.array_equal(t.data.view(np.uint8), s.data.view(np.uint8)), t.name
        keys = shard.fields
        assert keys[ShardKeys.LAYER_START].contents() == parts.layer_start
        assert keys["llama.block_count"].contents() == SHAPE.n_layers  # the model's count
        hashes = keys[ShardKeys.TENSOR_SHA256].contents()
        header = GgufHeader.read(model)
        expected = source_content(header).tensor_sha256
        assert hashes == [expected[n] for n in names]
        seen_blocks += list(parts.blocks)
    assert seen_blocks == list(range(SHAPE.n_layers))
    # The source's metadata is copied as stored, ours added.
    shard = gguf.GGUFReader(shards / entries[1]["file"])
    for key, field in source.fields.items():
        if not key.startswith("GGUF."):
            assert shard.fields[key].contents() == field.contents(), key


def test_the_manifest_reads_as_the_whole_model_with_the_sources_content_key(
    model: Path, shards: Path
) -> None:
    whole = model_facts_from_gguf(model)
    through = model_facts_from_gguf(shards)
    assert through.gguf_source.paths == (str(shards / MANIFEST_NAME),)
    assert attrs.evolve(through, gguf_source=whole.gguf_source) == whole
    assert model_facts_from_gguf(shards / MANIFEST_NAME) == through
    key = source_content(GgufHeader.read(model)).key
    assert source_content(GgufHeader.read(shards)).key == key
    assert _manifest(shards)["source"] == key


def test_a_stage_reads_only_its_own_shard(model: Path, shards: Path, tmp_path: Path) -> None:
    alone = tmp_path / "alone"
    alone.mkdir()
    entries = _manifest(shards)["shards"]
    assert isinstance(entries, list)
    shutil.copy(shards / MANIFEST_NAME, alone / MANIFEST_NAME)
    shutil.copy(shards / entries[1]["file"], alone / entries[1]["file"])  # stage 1's only
    parts = SliceParts(**entries[1]["parts"])
    with (
        open_stage_slice(
            alone, parts.layer_start, parts.layer_end_exclusive, is_first=False, is_last=False
        ) as stage,
        open_stage_slice(
            model, parts.layer_start, parts.layer_end_exclusive, is_first=False, is_last=False
        ) as full,
    ):
        assert set(stage.tensors) == set(full.tensors)
        for name in stage.tensors:
            assert np.array_equal(stage.raw(name), full.raw(name))
    # The first stage's shard is not there: that stage cannot load.
    with pytest.raises(GgufError, match="no such file"):
        open_stage_slice(alone, 0, parts.layer_start, is_first=True, is_last=False)


def test_shards_give_the_whole_files_tokens(model: Path, shards: Path) -> None:
    expected = runtime_sim.generate(model, [1, 2, 3], stages=3, max_tokens=8)
    assert runtime_sim.generate(shards, [1, 2, 3], stages=3, max_tokens=8).tokens == (
        expected.tokens
    )
    # Another split than the shards' reads its blocks across shards.
    assert runtime_sim.generate(shards, [1, 2, 3], stages=2, max_tokens=8).tokens == (
        expected.tokens
    )


def test_a_plain_shard_file_is_still_refused_by_the_facts_naming_its_manifest(
    shards: Path,
) -> None:
    file = shards / _manifest(shards)["shards"][1]["file"]  # type: ignore[index]
    with pytest.raises(GgufError, match=r"only some blocks.*read it through its manifest"):
        model_facts_from_gguf(file)


def test_facts_on_a_shard_tells_what_it_holds(
    shards: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    entries = _manifest(shards)["shards"]
    assert isinstance(entries, list)
    file = shards / entries[2]["file"]
    assert main(["facts", str(file), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["shard"]
    assert doc["layer_start"] == entries[2]["parts"]["layer_start"]
    assert doc["blocks_held"] == list(SliceParts(**entries[2]["parts"]).blocks)
    assert (doc["embedding"], doc["output"]) == (False, True)
    assert doc["block_count"] == SHAPE.n_layers
    assert doc["manifest"] == str(shards / MANIFEST_NAME)
    assert (doc["stage_index"], doc["stage_count"]) == (2, 3)
    assert doc["tensors"] == len(gguf.GGUFReader(file).tensors)
    assert main(["facts", str(file)]) == 0
    text = capsys.readouterr().out
    assert "a shard of" in text and "the output norm and head" in text


def test_a_manifest_that_does_not_match_its_shards_is_refused_naming_the_file(
    shards: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(shards, bad)
    doc = _manifest(bad)
    entries = doc["shards"]
    assert isinstance(entries, list)
    entries[0]["file"], entries[1]["file"] = entries[1]["file"], entries[0]["file"]
    (bad / MANIFEST_NAME).write_text(json.dumps(doc))
    with pytest.raises(GgufError, match=rf"{ShardKeys.LAYER_START}.*its manifest says"):
        model_facts_from_gguf(bad)
    no_embedding = {**entries[0], "parts": {**entries[0]["parts"], "embedding": False}}
    n = doc["block_count"]
    far_end = {**entries[-1], "parts": {**entries[-1]["parts"], "layer_end_exclusive": 10**12}}
    for broken, match in (
        ({**doc, "version": 9}, "version 9"),
        ({**doc, "shards": []}, "names no shard"),
        ({**doc, "extra": 1}, "malformed"),
        ({**doc, "shards": [{**entries[0], "file": "../x.gguf"}]}, "not a file name"),
        # a terminal escape in a shard's name was printed raw in the error naming it
        (
            {**doc, "shards": [{**entries[0], "file": "\x1b[2Jx.gguf"}, *entries[1:]]},
            r"shard file '\\x1b\[2Jx\.gguf' cannot name a file: it holds '\\x1b'",
        ),
        # shards and received slices are named after the model id: "../x" wrote them
        # outside --out, and outside a host's slice cache
        ({**doc, "model_id": "../../escaped"}, r"model_id '\.\./\.\./escaped' cannot name"),
        ({**doc, "model_id": "org/model"}, "model_id 'org/model' cannot name a file"),
        ({**doc, "model_id": "a\nb"}, "cannot name a file"),
        ({**doc, "model_id": ""}, "it is empty"),
        # an entry taken out: read as the whole model, its blocks once weighed nothing
        ({**doc, "shards": [entries[0], entries[2]]}, "no shard holds block"),
        ({**doc, "shards": [no_embedding, *entries[1:]]}, "no shard holds the embedding"),
        # a count of 10**12 blocks once made a set of each (memory without end): spans
        (
            {**doc, "block_count": 10**12},
            rf"no shard holds block {n} \({10**12 - n} of its {10**12} blocks",
        ),
        (
            {**doc, "block_count": 10**12, "shards": [*entries[:-1], far_end]},
            "its manifest says",
        ),
    ):
        (bad / MANIFEST_NAME).write_text(json.dumps(broken))
        with pytest.raises(GgufError, match=match):
            model_facts_from_gguf(bad)
    for text in ("{not json", "[" * 100_000):  # nested past the JSON decoder's recursion
        (bad / MANIFEST_NAME).write_text(text)
        with pytest.raises(GgufError, match="not a JSON shard manifest"):
            model_facts_from_gguf(bad / MANIFEST_NAME)


def test_split_follows_a_memory_placement_and_refuses_what_the_planner_refuses(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "by-memory"
    args = ["split", str(model), "--nodes", "a=1GiB,b=3GiB", "--placement", "memory"]
    assert main([*args, "--out", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    ranges = [(s["layer_start"], s["layer_end_exclusive"]) for s in doc["shards"]]
    assert [s["node_id"] for s in doc["shards"]] == ["a", "b"]
    assert ranges[1][1] - ranges[1][0] > ranges[0][1] - ranges[0][0]  # b has more memory
    assert ranges[0][0] == 0 and ranges[-1][1] == SHAPE.n_layers
    # the object docs/planner.md describes: every key, each true of the files written
    assert set(doc) == {"manifest", "model_id", "source", "shards"}, doc
    assert Path(doc["manifest"]) == out / MANIFEST_NAME and doc["source"].startswith("sha256:")
    for shard in doc["shards"]:
        assert Path(shard["file"]).parent == out and shard["tensor_bytes"] > 0
        assert shard["file_bytes"] == os.path.getsize(shard["file"]) > shard["tensor_bytes"]
    assert [(s["embedding"], s["output"]) for s in doc["shards"]] == [(True, False), (False, True)]
    assert main(["split", str(model), "--stages", "9", "--out", str(tmp_path / "x")]) == 2
    assert "invalid_stage_count" in capsys.readouterr().err
    assert main(["split", str(model), "--out", str(tmp_path / "y")]) == 2
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


def test_split_refuses_a_model_id_that_cannot_name_a_file_before_writing(
    model: Path, tmp_path: Path
) -> None:
    """A plan's model id names the shards: one holding a ``/`` put them in another
    folder (a re-split of a manifest saying ``../escaped`` exited 0 with its shards
    beside ``--out``)."""
    facts = model_facts_from_gguf(model)
    plan = split_plan(attrs.evolve(facts, model_id="../escaped"), 2, None, "even")
    assert isinstance(plan, RunPlan)
    out = tmp_path / "out" / "inner"
    with pytest.raises(ValueError, match=r"model id '\.\./escaped' cannot name the shards"):
        split_model(str(model), plan, out)
    assert not (tmp_path / "out").exists()


def test_split_of_a_file_whose_name_cannot_name_shards_is_a_usage_error(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    odd = tmp_path / "a\\b.gguf"  # a backslash: a folder's separator elsewhere
    shutil.copy(model, odd)
    out = tmp_path / "out"
    assert main(["split", str(odd), "--stages", "2", "--out", str(out)]) == 2
    assert "model id 'a\\\\b' cannot name the shards" in capsys.readouterr().err
    assert not out.exists()


class _CutShort(Exception):
    pass


def test_a_split_cut_short_leaves_no_earlier_manifest_over_mixed_shards(
    model: Path, tmp_path: Path
) -> None:
    """A folder with a manifest is whole: a re-split into it removes the earlier split's
    manifest before its first shard is written over, so one cut short (here at its first
    shard's first progress report, as Ctrl-C would) leaves no manifest naming shards of
    two splits (it left the earlier one, whose hashes the new shards then failed). A link
    at the manifest's name is removed itself, never what it points to."""
    out = tmp_path / "out"
    assert main(["split", str(model), "--stages", "3", "--out", str(out)]) == 0
    facts = model_facts_from_gguf(model)
    plan = split_plan(facts, 3, None, "memory")
    assert isinstance(plan, RunPlan)

    def cut(what: str, done: int, total: int) -> None:
        if what != "hash":
            assert not os.path.lexists(out / MANIFEST_NAME), "a shard is written over"
            raise _CutShort(what)

    with pytest.raises(_CutShort):
        split_model(str(model), plan, out, progress=cut)
    assert not os.path.lexists(out / MANIFEST_NAME)
    kept = tmp_path / "kept.json"
    kept.write_text("{}")
    os.symlink(kept, out / MANIFEST_NAME)
    with pytest.raises(_CutShort):
        split_model(str(model), plan, out, progress=cut)
    assert not os.path.lexists(out / MANIFEST_NAME) and kept.read_text() == "{}"
    split_model(str(model), plan, out)  # whole again
    assert [s["file"] for s in _manifest(out)["shards"]] == sorted(  # type: ignore[index]
        p.name for p in out.glob("*.gguf")
    )


def test_a_split_of_other_shard_names_cut_short_leaves_the_earlier_split_whole(
    model: Path, tmp_path: Path
) -> None:
    """The earlier manifest goes only where a shard of it is written over: a re-split
    into the folder with another stage count (names ``-of-2`` beside ``-of-3``), cut
    short, leaves the earlier split and its manifest as they were (the manifest was
    removed before any shard was written, and the folder no longer a model)."""
    out = tmp_path / "out"
    assert main(["split", str(model), "--stages", "3", "--out", str(out)]) == 0
    before = (out / MANIFEST_NAME).read_bytes()
    plan = split_plan(model_facts_from_gguf(model), 2, None, "even")
    assert isinstance(plan, RunPlan)

    def cut(what: str, done: int, total: int) -> None:
        if what != "hash":
            raise _CutShort(what)

    with pytest.raises(_CutShort):
        split_model(str(model), plan, out, progress=cut)
    assert (out / MANIFEST_NAME).read_bytes() == before
    assert model_facts_from_gguf(out).num_layers == SHAPE.n_layers


def test_a_shard_folder_this_user_cannot_read_says_so(shards: Path, tmp_path: Path) -> None:
    """A shard folder of mode 000: "cannot be read: Permission denied", naming it (it
    was "is a directory, not a GGUF file"). Root reads it anyway: there the command runs
    without the capabilities that let it (``setpriv``)."""
    folder = tmp_path / "locked"
    shutil.copytree(shards, folder)
    drop: list[str] = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("root reads a mode-000 folder, and setpriv, to drop that, is absent")
        drop = [setpriv, "--bounding-set=-dac_override,-dac_read_search"]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    folder.chmod(0)
    try:
        listing = "import os, sys; os.listdir(sys.argv[1])"
        probe = subprocess.run([*drop, sys.executable, "-c", listing, str(folder)],
                               capture_output=True, check=False)  # fmt: skip
        if probe.returncode == 0:
            pytest.skip("this process cannot drop its capability to read a mode-000 folder")
        done = subprocess.run(
            [*drop, sys.executable, "-m", "runplan", "facts", str(folder), "--json"],
            capture_output=True, text=True, env=env, timeout=120, check=False,
        )  # fmt: skip
    finally:
        folder.chmod(0o755)
    assert done.returncode == 1, done.stderr
    message = json.loads(done.stdout)["error"]["message"]
    assert message == f"{folder / MANIFEST_NAME}: cannot be read: Permission denied", message
