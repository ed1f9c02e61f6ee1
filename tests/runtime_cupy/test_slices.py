"""Slice transfer between the orchestrator's slice server and a stage's host, in one
process: the server maps the model, then the file leaves the path the plan names (the
server keeps reading its map), so the "host" has to receive its slice. Faults enter
through the network between them (``tests.support.faulty_link``) or through the
process and the disk of a fetch run on its own (``tests.support.fetch_slice``)."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import gguf
import numpy as np
import pytest
from rich.console import Console

from runplan import GgufError, GgufSource, RunPlan, model_facts_from_gguf
from runplan.gguf_header import GgufHeader
from runplan.shards import SliceParts, slice_tensor_names
from runplan.split import split_model, split_plan
from runtime_core.gguf_slice import open_stage_slice
from runtime_cupy.edges import handshake as hs
from runtime_cupy.process.keys import new_secret, slice_key
from runtime_cupy.slices import digests as digests_module
from runtime_cupy.slices import fetch as fetch_module
from runtime_cupy.slices import server as server_module
from runtime_cupy.slices.cache import SliceCache
from runtime_cupy.slices.digests import DigestStore
from runtime_cupy.slices.fetch import (
    SliceFetcher,
    SliceOrigin,
    SliceTransferFailed,
)
from runtime_cupy.slices.progress import SliceBars, SliceLog, describe, figures
from runtime_cupy.slices.protocol import Refused, open_as_stage
from runtime_cupy.slices.server import SliceServer, StageTransfer
from runtime_cupy.slices.transfer_log import TRANSFER_LOG
from runtime_cupy.slices.verify import EntryUnreadable
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.support.descriptors import no_descriptor_left
from tests.support.faulty_link import FaultyLink

ROOT = Path(__file__).resolve().parents[2]
#: Untied head, a tensor every stage needs; tensors of 16-64 KiB, so a fault lands in one.
UNTIED = ModelShape(n_layers=6, hidden=128, ffn=256, tied=False, rope_freqs=True, quant="F32")
TIED = ModelShape(n_layers=4, hidden=128, ffn=256, tied=True, rope_freqs=True, quant="F32")
MIDDLE = SliceParts(2, 4, False, False)


class Source:
    """A model served by a slice server, gone from its path on "this host";
    ``encrypt``: the server sends its stages' slices encrypted."""

    def __init__(
        self, folder: Path, shape: ModelShape, *, encrypt: bool = False, **write: Any
    ) -> None:
        self.folder = folder
        self.path = write_model(folder / "model.gguf", shape, **write)
        self.header = GgufHeader.read(self.path)
        self.secret = new_secret()
        self.server = SliceServer("127.0.0.1", DigestStore(folder / "orchestrator"))
        self.key = self.server.offer(GgufSource((str(self.path),)))
        for i in range(4):
            key = slice_key(self.secret, f"node{i}")
            self.server.expect(i, f"node{i}", key, f"host{i}", encrypt=encrypt)
        self.encrypt = encrypt
        self.away = folder / "kept-by-the-server.gguf"
        os.rename(self.path, self.away)  # the server reads its memory map

    def fetcher(
        self,
        cache: Path,
        stage: int = 1,
        address: str | None = None,
        *,
        encrypt: bool | None = None,
    ) -> SliceFetcher:
        """Stage ``stage``'s fetcher into ``cache``, asking for the slice encrypted as
        the server sends it unless ``encrypt`` says otherwise."""
        origin = SliceOrigin(address or self.server.address, self.key)
        key = slice_key(self.secret, f"node{stage}")
        asks = self.encrypt if encrypt is None else encrypt
        return SliceFetcher(origin, stage, key, SliceCache(cache, limit=None), encrypt=asks)

    def slice_bytes(self, parts: SliceParts) -> int:
        names = slice_tensor_names(self.header.tensors, parts)
        return sum(self.header.tensors[n].n_bytes for n in names)

    def resolve(self, fetcher: SliceFetcher, parts: SliceParts = MIDDLE) -> GgufSource:
        return fetcher.resolve(GgufSource((str(self.path),)), parts)


@pytest.fixture
def untied(tmp_path: Path) -> Iterator[Source]:
    (tmp_path / "src").mkdir()
    source = Source(tmp_path / "src", UNTIED)
    yield source
    source.server.close()


@pytest.fixture
def tied(tmp_path: Path) -> Iterator[Source]:
    (tmp_path / "src").mkdir()
    source = Source(tmp_path / "src", TIED)
    yield source
    source.server.close()


def _settled(server: SliceServer) -> tuple[StageTransfer, ...]:
    """The server's transfers once none moves: it hears a stage's last word (its DONE)
    just after the stage has its slice."""
    deadline = time.monotonic() + 10
    while any(t.moving for t in server.transfers()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.transfers()


def _entries_and_tmp(cache: Path) -> tuple[list[Path], list[str]]:
    entries = [e.path for e in SliceCache(cache, limit=None).entries()]
    tmp = sorted(os.listdir(cache / "tmp")) if (cache / "tmp").exists() else []
    return entries, tmp


def _same_tensors(entry: str, source: Source, parts: SliceParts) -> None:
    with open_stage_slice(
        entry, parts.layer_start, parts.layer_end_exclusive,
        is_first=parts.embedding, is_last=parts.output,
    ) as got:  # fmt: skip
        names = slice_tensor_names(source.header.tensors, parts)
        assert sorted(got.tensors) == sorted(names)
        for name in names:
            assert np.array_equal(got.raw(name).ravel(), source.header.tensor_bytes(name)), name


def test_a_host_without_the_file_receives_exactly_its_slice_then_uses_its_cache(
    untied: Source, tmp_path: Path
) -> None:
    cache = tmp_path / "host"
    fetcher = untied.fetcher(cache)
    got = untied.resolve(fetcher)
    entry = got.paths[0]
    assert Path(entry).parent.parent == cache / "slices"
    _same_tensors(entry, untied, MIDDLE)
    # Bytes: the slice's tensors and its header, measured on both ends; the rest of what
    # the host read is the handshake and a few frames.
    line = fetcher.last
    header_bytes = int(line["header_bytes"])
    assert line["tensor_bytes_received"] == untied.slice_bytes(MIDDLE)
    (sent,) = _settled(untied.server)
    assert (sent.state, sent.header_bytes, sent.tensor_bytes) == (
        "done", header_bytes, untied.slice_bytes(MIDDLE),
    )  # fmt: skip
    assert sent.sent_bytes == header_bytes + untied.slice_bytes(MIDDLE)
    overhead = line["socket_bytes"] - sent.sent_bytes
    assert 0 < overhead < 1024, overhead
    assert sent.received_bytes == line["socket_bytes"]
    whole = untied.away.stat().st_size
    assert sent.sent_bytes < whole / 2  # 2 of 6 blocks, no embedding, no head
    # The entry is what split writes for that stage, byte for byte (a file of the same
    # name: the model id is in the header).
    (tmp_path / "copy").mkdir()
    copy = shutil.copy(untied.away, tmp_path / "copy" / untied.path.name)
    plan = split_plan(model_facts_from_gguf(copy), 3, None, "even")
    assert isinstance(plan, RunPlan)
    split = split_model(str(copy), plan, tmp_path / "split")
    shard = split.manifest.shards[1]
    assert shard.parts == MIDDLE
    ours = SliceCache(cache, limit=None).entry(untied.key, MIDDLE)
    assert ours is not None
    assert ours.shard.read_bytes() == (tmp_path / "split" / shard.file).read_bytes()
    # The next run starts from the cache: no connection at all.
    connections = untied.server.transfers()
    again = untied.fetcher(cache)
    assert untied.resolve(again) == got
    assert again.last["outcome"] == "cache" and again.last["socket_bytes"] == 0
    assert untied.server.transfers() == connections
    lines = [json.loads(x) for x in (cache / TRANSFER_LOG).read_text().splitlines()]
    assert [x["outcome"] for x in lines] == ["received", "cache"]


def test_two_stages_on_one_host_share_the_tensors_both_need(tied: Source, tmp_path: Path) -> None:
    cache = tmp_path / "host"
    first, last = SliceParts(0, 2, True, False), SliceParts(2, 4, False, True)
    a = tied.fetcher(cache, stage=0)
    tied.resolve(a, first)
    b = tied.fetcher(cache, stage=1)
    got = tied.resolve(b, last)
    # The tied head is the embedding: the last stage copies it and rope_freqs from the
    # first stage's entry instead of receiving them again.
    shared = ("token_embd.weight", "rope_freqs.weight")
    shared_bytes = sum(tied.header.tensors[n].n_bytes for n in shared)
    assert b.last["tensor_bytes_copied"] == shared_bytes
    assert b.last["tensor_bytes_received"] == tied.slice_bytes(last) - shared_bytes
    _same_tensors(got.paths[0], tied, last)
    transfers = {t.stage_index: t for t in tied.server.transfers()}
    assert transfers[1].tensor_bytes == tied.slice_bytes(last) - shared_bytes


def test_a_slice_of_tensors_stored_with_trailing_dimensions_of_size_one_loads(
    tmp_path: Path,
) -> None:
    # Norms as [n_embd, 1], matrices as [n_in, n_out, 1, 1] (as some converters write
    # them): the stage's entry holds the same bytes and loads as the plain model.
    plain = write_model(tmp_path / "plain.gguf", UNTIED)
    tensors = GgufHeader.read(plain).tensors
    padded = {n: (*i.shape, *(1,) * (4 - len(i.shape))) for n, i in tensors.items()}
    (tmp_path / "src").mkdir()
    source = Source(tmp_path / "src", UNTIED, stored_shapes=padded)
    try:
        last = SliceParts(4, 6, False, True)
        got = source.resolve(source.fetcher(tmp_path / "host", stage=2), last)
        _same_tensors(got.paths[0], source, last)
        want = GgufHeader.read(plain)
        with open_stage_slice(got.paths[0], 4, 6, is_first=False, is_last=True) as stage:
            for name in stage.tensors:
                assert np.array_equal(stage.raw(name).ravel(), want.tensor_bytes(name)), name
                assert stage.tensors[name].shape == tensors[name].shape, name
    finally:
        source.server.close()


def _damage(shard: Path, how: str) -> None:
    """What a crash, a bad disk or a hand leaves of an entry's file."""
    if how == "truncated":
        os.truncate(shard, shard.stat().st_size // 2)
    elif how == "changed":
        with open(shard, "r+b") as f:  # one byte of the last tensor
            f.seek(-100, os.SEEK_END)
            byte = f.read(1)[0]
            f.seek(-100, os.SEEK_END)
            f.write(bytes([byte ^ 0xFF]))
    else:
        shard.unlink()


@pytest.mark.parametrize("how", ["truncated", "changed", "gone"])
def test_a_damaged_cache_entry_is_not_trusted_and_the_slice_comes_again(
    untied: Source, tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "host"
    untied.resolve(untied.fetcher(cache))
    entry = SliceCache(cache, limit=None).entry(untied.key, MIDDLE)
    assert entry is not None
    _damage(entry.shard, how)
    fetcher = untied.fetcher(cache)
    with caplog.at_level(logging.WARNING, logger="runtime_cupy.slices"):
        got = untied.resolve(fetcher)
    assert fetcher.last["outcome"] == "received"
    assert fetcher.last["tensor_bytes_received"] == untied.slice_bytes(MIDDLE)
    _same_tensors(got.paths[0], untied, MIDDLE)
    assert any(f"the cache entry {entry.path} is damaged" in r.message for r in caplog.records)
    # The entry it made is known sound: the next run uses it without a connection.
    again = untied.fetcher(cache)
    assert untied.resolve(again) == got and again.last["outcome"] == "cache"


def test_an_entry_that_cannot_be_read_now_is_kept_and_the_fetch_fails_naming_why(
    untied: Source, tmp_path: Path
) -> None:
    """No descriptor left as the stage checks its entry: the read's ``EMFILE`` was taken
    for damage, and the sound entry removed (with the orchestrator gone, the next run
    had nothing). It is kept; the fetch fails naming why; the next run uses it."""
    cache = tmp_path / "host"
    fetcher = untied.fetcher(cache)
    untied.resolve(fetcher)
    entry = fetcher.cache.entry(untied.key, MIDDLE)
    assert entry is not None
    with no_descriptor_left(), pytest.raises(EntryUnreadable, match="Too many open files"):
        fetcher._sound(entry)  # (resolve's check, under the source's lock)
    with no_descriptor_left(), pytest.raises(SliceTransferFailed, match="Too many open files"):
        untied.resolve(untied.fetcher(cache))
    assert fetcher.cache.entry(untied.key, MIDDLE) is not None
    assert _entries_and_tmp(cache)[1] == []
    untied.server.close()  # nothing to receive from: the cache alone
    again = untied.fetcher(cache)
    assert untied.resolve(again).paths[0] == str(entry.path) and again.last["outcome"] == "cache"


class _NoThreads:
    """``ThreadPoolExecutor`` on a host with no thread left: its first ``submit`` gets
    ``Thread.start``'s own refusal (as in a control group of ``pids.max`` 2)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __enter__(self) -> _NoThreads:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def submit(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError("can't start new thread")


def test_a_fetch_on_a_host_with_no_thread_left_is_a_named_fault_that_leaves_nothing(
    untied: Source, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bare ``RuntimeError`` came out of ``resolve``: no ``SliceTransferFailed`` naming
    what ran out, no word to the server, no ``failed`` line in the transfer log."""
    cache = tmp_path / "host"
    monkeypatch.setattr(fetch_module, "ThreadPoolExecutor", _NoThreads)
    fetcher = untied.fetcher(cache)
    with pytest.raises(SliceTransferFailed, match="no thread left to hash the tensors"):
        untied.resolve(fetcher)
    assert fetcher.last["outcome"] == "failed"
    assert _entries_and_tmp(cache) == ([], [])
    monkeypatch.undo()
    again = untied.fetcher(cache)
    untied.resolve(again)
    assert again.last["outcome"] == "received"


def test_a_partial_entry_a_failed_fetch_cannot_remove_is_named_and_goes_next_time(
    untied: Source,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The partial entry was removed with its errors ignored, before the link closed:
    with no descriptor left, it stayed, unsaid (``fetch``'s docstring: removed)."""
    cache = tmp_path / "host"
    monkeypatch.setattr(fetch_module, "ThreadPoolExecutor", _NoThreads)

    def refused(path: object, ignore_errors: bool = False) -> None:
        if not ignore_errors:
            raise OSError(errno.EMFILE, "Too many open files")

    # (the fetch's own removal alone: the server, in this process, would share a patched
    # shutil)
    monkeypatch.setattr(fetch_module, "shutil", SimpleNamespace(rmtree=refused))
    with (
        caplog.at_level(logging.WARNING, logger="runtime_cupy.slices"),
        pytest.raises(SliceTransferFailed),
    ):
        untied.resolve(untied.fetcher(cache))
    left = _entries_and_tmp(cache)[1]
    assert len(left) == 1, left
    assert any(
        "could not remove the partial entry" in r.getMessage() and left[0] in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    monkeypatch.undo()
    again = untied.fetcher(cache)
    untied.resolve(again)
    assert again.last["outcome"] == "received" and _entries_and_tmp(cache)[1] == []


def test_a_damaged_entry_lends_no_tensor_to_another_stages_slice(
    tied: Source, tmp_path: Path
) -> None:
    cache = tmp_path / "host"
    first, last = SliceParts(0, 2, True, False), SliceParts(2, 4, False, True)
    tied.resolve(tied.fetcher(cache, stage=0), first)
    entry = SliceCache(cache, limit=None).entry(tied.key, first)
    assert entry is not None
    info = GgufHeader.read(entry.shard).tensors["token_embd.weight"]
    with open(entry.shard, "r+b") as f:  # the tied head the last stage would copy
        f.seek(info.offset)
        f.write(b"\xff" * 16)
    b = tied.fetcher(cache, stage=1)
    got = tied.resolve(b, last)
    assert b.last["tensor_bytes_copied"] == 0
    assert b.last["tensor_bytes_received"] == tied.slice_bytes(last)
    _same_tensors(got.paths[0], tied, last)
    assert SliceCache(cache, limit=None).entry(tied.key, first) is None  # removed


def test_a_file_at_the_path_is_used_when_it_holds_the_same_slice(
    untied: Source, tmp_path: Path
) -> None:
    shutil.copy(untied.away, untied.path)  # a copy: another inode, the same content
    fetcher = untied.fetcher(tmp_path / "host")
    assert untied.resolve(fetcher) == GgufSource((str(untied.path),))
    assert fetcher.last["outcome"] == "local"
    (sent,) = _settled(untied.server)
    assert (sent.state, sent.tensor_bytes) == ("local", 0)  # the header only
    # Remembered: the next run asks the server nothing.
    again = untied.fetcher(tmp_path / "host")
    assert untied.resolve(again) == GgufSource((str(untied.path),))
    assert again.last == {**again.last, "outcome": "local", "socket_bytes": 0}
    assert untied.server.transfers() == (sent,)


def test_a_file_rewritten_in_place_with_its_old_times_is_checked_again(
    untied: Source, tmp_path: Path
) -> None:
    """The verdict on a file at the path is kept by the file's identity: a file whose
    bytes were changed in place (same inode and size) and its modification time set
    back is not the file that was checked, and its record is replaced, not added to."""
    shutil.copy(untied.away, untied.path)
    fetcher = untied.fetcher(tmp_path / "host")
    assert untied.resolve(fetcher) == GgufSource((str(untied.path),))
    assert fetcher.last["outcome"] == "local"
    digests = tmp_path / "host" / "digests"
    assert len(list(digests.glob("*.json"))) == 1  # the file at the path's verdict
    before = os.stat(untied.path)
    other = write_model(tmp_path / "other.gguf", attrs.evolve(UNTIED, seed=7))
    assert other.stat().st_size == before.st_size
    with open(untied.path, "r+b") as f:  # the same inode, other weights
        f.write(other.read_bytes())
    os.utime(untied.path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(untied.path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns,
    )  # fmt: skip
    again = untied.fetcher(tmp_path / "host")
    got = untied.resolve(again)
    assert again.last["outcome"] == "received"
    _same_tensors(got.paths[0], untied, MIDDLE)
    records = [json.loads(p.read_text()) for p in digests.glob("*.json")]
    of_path = [r for r in records if r["identity"][0]["path"] == str(untied.path)]
    assert len(of_path) == 1  # (the received entry has its own)
    assert of_path[0]["identity"][0]["ctime_ns"] == after.st_ctime_ns


def test_records_of_files_no_longer_there_are_removed_when_a_record_is_written(
    tmp_path: Path,
) -> None:
    store = DigestStore(tmp_path / "digests")
    a = write_model(tmp_path / "a.gguf", attrs.evolve(UNTIED, seed=3))
    b = write_model(tmp_path / "b.gguf", attrs.evolve(UNTIED, seed=4))
    store.content(GgufHeader.read(a))
    store.content(GgufHeader.read(b))
    assert len(list(store.folder.glob("*.json"))) == 2
    (store.folder / "old.json").write_text(json.dumps({"version": 1, "identity": []}))
    (store.folder / "broken.json").write_bytes(b"\xff not json")
    a.unlink()
    c = write_model(tmp_path / "c.gguf", attrs.evolve(UNTIED, seed=5))
    store.content(GgufHeader.read(c))
    kept = sorted(json.loads(p.read_text())["identity"][0]["path"]
                  for p in store.folder.glob("*.json"))  # fmt: skip
    assert kept == [str(b), str(c)]  # a's record, the old version's and the junk are gone


def test_a_record_s_partial_file_a_killed_writer_left_goes_when_it_is_written_again(
    tmp_path: Path,
) -> None:
    """A record was written through a partial file of its own (``.NAME.<random>``),
    which a writer killed before its rename left in ``digests/`` for good; it is
    written as every whole file is now (``runplan.whole_file``), whose next writer
    removes what a dead one left."""
    store = DigestStore(tmp_path / "digests")
    a = write_model(tmp_path / "a.gguf", attrs.evolve(UNTIED, seed=3))
    store.content(GgufHeader.read(a))
    (record,) = store.folder.glob("*.json")
    left = record.with_name(f"{record.name}.0123456789abcdef.partial")
    left.write_text("{")  # what a writer killed before its rename left
    os.utime(a, ns=(0, 0))  # another identity: the record is written again
    store.content(GgufHeader.read(a))
    assert sorted(p.name for p in store.folder.iterdir()) == [record.name]


def test_a_file_at_the_path_that_differs_is_not_used(untied: Source, tmp_path: Path) -> None:
    write_model(untied.path, attrs.evolve(UNTIED, seed=7))  # same shapes, other weights
    fetcher = untied.fetcher(tmp_path / "host")
    got = untied.resolve(fetcher)
    assert fetcher.last["outcome"] == "received"
    _same_tensors(got.paths[0], untied, MIDDLE)


def test_hashing_the_file_at_the_path_does_not_keep_the_server_waiting(
    untied: Source, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stage hashes the file at the plan's path before it asks the server, whose
    wait for its answer is bounded (``FRAME_WAIT_S``, 600 s; 0.5 here against 1.5 s of
    hashing): a big slice on a slow disk once outlasted it, and the server's error frame
    was then read as tensor bytes and reported as a tensor damaged in flight."""
    write_model(untied.path, attrs.evolve(UNTIED, seed=7))  # same shapes, other weights
    monkeypatch.setattr(server_module, "FRAME_WAIT_S", 0.5)
    real = digests_module.tensor_sha256

    def slow(*args: Any, **kwargs: Any) -> dict[str, str]:
        time.sleep(1.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(digests_module, "tensor_sha256", slow)
    fetcher = untied.fetcher(tmp_path / "host")
    got = untied.resolve(fetcher)
    assert fetcher.last["outcome"] == "received"
    _same_tensors(got.paths[0], untied, MIDDLE)


def test_a_transfer_that_breaks_off_is_a_named_fault_and_leaves_no_entry(
    untied: Source, tmp_path: Path
) -> None:
    cache = tmp_path / "host"
    probe = untied.fetcher(tmp_path / "probe")
    untied.resolve(probe)
    half = int(probe.last["header_bytes"]) + untied.slice_bytes(MIDDLE) // 2
    link = FaultyLink(untied.server.address, cut_after=half)
    try:
        with pytest.raises(SliceTransferFailed) as failed:
            untied.resolve(untied.fetcher(cache, address=link.address))
    finally:
        link.close()
    text = str(failed.value)
    assert "to host 127.0.0.1" in text and "tensor blk." in text, text
    assert "connection closed" in text and "no cache entry was made" in text, text
    assert _entries_and_tmp(cache) == ([], [])
    # The run after it succeeds.
    got = untied.resolve(untied.fetcher(cache))
    _same_tensors(got.paths[0], untied, MIDDLE)


def test_a_tensor_damaged_in_flight_is_a_named_fault_and_leaves_no_entry(
    untied: Source, tmp_path: Path
) -> None:
    cache = tmp_path / "host"
    probe = untied.fetcher(tmp_path / "probe")
    untied.resolve(probe)
    # One byte inside the third tensor's data: past what came before the header (the
    # handshake and a frame), the header, and the first two tensors.
    names = slice_tensor_names(untied.header.tensors, MIDDLE)
    before = probe.last["socket_bytes"] - probe.last["header_bytes"] - untied.slice_bytes(MIDDLE)
    start = sum(untied.header.tensors[n].n_bytes for n in names[:2])
    offset = before + int(probe.last["header_bytes"]) + start + 5
    link = FaultyLink(untied.server.address, flip_at=offset)
    try:
        with pytest.raises(SliceTransferFailed) as failed:
            untied.resolve(untied.fetcher(cache, address=link.address))
    finally:
        link.close()
    text = str(failed.value)
    assert "SHA-256" in text and "damaged in flight" in text and "tensor blk." in text, text
    assert _entries_and_tmp(cache) == ([], [])
    got = untied.resolve(untied.fetcher(cache))
    _same_tensors(got.paths[0], untied, MIDDLE)


def test_a_control_frame_changed_in_flight_fails_its_seal_and_leaves_no_entry(
    untied: Source, tmp_path: Path
) -> None:
    # The server's first frame (HEADER) comes right after its handshake reply: one byte
    # of its JSON body changed on the way fails the seal the TCP edges use
    # (edges.tcp_seal), before anything it says is used.
    offset = hs.CHALLENGE_BYTES + 4 + 1
    link = FaultyLink(untied.server.address, flip_at=offset)
    cache = tmp_path / "host"
    try:
        with pytest.raises(SliceTransferFailed) as failed:
            untied.resolve(untied.fetcher(cache, address=link.address))
    finally:
        link.close()
    text = str(failed.value)
    assert "the header" in text and "failed its seal" in text, text
    assert _entries_and_tmp(cache) == ([], [])


def _fetch_process(
    source: Source, cache: Path, address: str, *, wrap: list[str] | None = None
) -> subprocess.Popen[str]:
    parts = f"{MIDDLE.layer_start},{MIDDLE.layer_end_exclusive},0,0"
    args = [
        sys.executable, "-m", "tests.support.fetch_slice", "--server", address,
        "--source-key", source.key, "--stage-index", "1", "--node-id", "node1",
        "--source", str(source.path), "--parts", parts, "--cache", str(cache),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src")]))
    proc = subprocess.Popen(
        [*(wrap or []), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.stdin is not None
    proc.stdin.write(source.secret.hex() + "\n")
    proc.stdin.close()
    return proc


def test_a_fetch_killed_halfway_leaves_nothing_usable_and_the_next_succeeds(
    untied: Source, tmp_path: Path
) -> None:
    cache = tmp_path / "host"
    total = untied.slice_bytes(MIDDLE)
    link = FaultyLink(untied.server.address, rate=total / 4.0)  # about 4 s for the slice
    try:
        proc = _fetch_process(untied, cache, link.address)
        deadline = time.monotonic() + 60
        while link.forwarded < total // 2:
            assert proc.poll() is None and time.monotonic() < deadline, "it ended early"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        link.close()
    entries, tmp = _entries_and_tmp(cache)
    assert entries == [] and len(tmp) == 1  # what it wrote, never an entry
    fetcher = untied.fetcher(cache)
    got = untied.resolve(fetcher)
    _same_tensors(got.paths[0], untied, MIDDLE)
    assert _entries_and_tmp(cache) == ([Path(got.paths[0])], [])  # the leftover went


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root")
def test_a_cache_on_a_full_disk_is_a_named_fault_and_the_next_run_succeeds(
    untied: Source, tmp_path: Path
) -> None:
    cache = tmp_path / "small-disk"
    cache.mkdir()
    small = untied.slice_bytes(MIDDLE) // 2  # room for the header and some tensors
    # Two fetches in one mount namespace: on a disk too small, then on one with room (a
    # tmpfs of mode 0700: its default, 1777, is a cache open to all, refused).
    script = (
        f"read -r secret; mount -t tmpfs -o size={small},mode=0700 tmpfs {cache} && "
        f'echo $secret | "$@" && '
        f"mount -o remount,size={8 * untied.slice_bytes(MIDDLE)} {cache} && "
        f'echo $secret | "$@"'
    )
    wrap = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]
    proc = _fetch_process(untied, cache, untied.server.address, wrap=wrap)
    assert proc.stdout is not None
    out = proc.stdout.read()
    proc.wait(120)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert len(lines) == 2, out
    failed, after = lines
    assert failed["ok"] is False, failed
    # Refused before a tensor travels (once found a tensor in, naming a partial entry's
    # folder already gone): the cache's folder, the bytes needed and those free.
    need = untied.slice_bytes(MIDDLE)
    assert f"need {need} bytes on the disk of the cache {cache}, " in failed["error"], failed
    assert " are free; no cache entry was made" in failed["error"], failed
    assert "to host 127.0.0.1" in failed["error"], failed
    assert failed["last"]["outcome"] == "failed", failed
    assert failed["last"]["socket_bytes"] < need // 4, failed  # the header's frames alone
    assert failed["entries"] == [] and failed["tmp"] == [], failed
    assert after["ok"] is True and after["entries"] == [after["path"]], after
    assert after["last"]["tensor_bytes_received"] == untied.slice_bytes(MIDDLE)


def test_a_disk_found_full_a_tensor_in_names_the_cache_not_the_partial_entry() -> None:
    """Room can still run out after the check (another writer): the error named the
    partial entry's folder, gone by the time it was read."""
    full = OSError(errno.ENOSPC, "No space left on device", "/c/tmp/abc.L2-3.1.x/slice.gguf")
    assert fetch_module._cause(full, Path("/c")) == "no space left on the disk of the cache /c"
    assert fetch_module._cause(OSError(errno.EIO, "Input/output error"), Path("/c")) == (
        "Input/output error"
    )


def test_the_server_admits_only_its_stages_and_only_the_source_it_serves(
    untied: Source, tmp_path: Path
) -> None:
    with pytest.raises(Refused, match="refused or failed the handshake"):
        open_as_stage(untied.server.address, 1, slice_key(new_secret(), "node1"))
    with pytest.raises(Refused):
        open_as_stage(untied.server.address, 9, slice_key(untied.secret, "node9"))
    stale = SliceFetcher(
        SliceOrigin(untied.server.address, "sha256:" + "0" * 64),
        1,
        slice_key(untied.secret, "node1"),
        SliceCache(tmp_path / "host", limit=None),
    )
    with pytest.raises(SliceTransferFailed, match="the source changed since the stage"):
        untied.resolve(stale)
    assert _entries_and_tmp(tmp_path / "host") == ([], [])
    # Blocks outside the model (past uint32 too: the server's thread died of it, the
    # stage heard only that the connection closed)
    for start, end in ((0, 2**32), (2**40, 2**40 + 1), (4, 9)):
        with pytest.raises(SliceTransferFailed, match=rf"asked for blocks \[{start}, {end}\) "
                           rf"of a model of {UNTIED.n_layers}"):  # fmt: skip
            untied.resolve(untied.fetcher(tmp_path / "host"), SliceParts(start, end, False, False))
    assert _entries_and_tmp(tmp_path / "host") == ([], [])
    # A stage admitted with its plan's slice is sent that slice only (it once got any
    # parts it asked for: the whole model, to a stage holding two blocks)
    key3 = slice_key(untied.secret, "node3")
    untied.server.expect(3, "node3", key3, "host3", parts=MIDDLE)
    whole = SliceParts(0, UNTIED.n_layers, True, True)
    asked = rf"stage 3 asked for blocks 0-{UNTIED.n_layers - 1}, the token embedding, the output"
    with pytest.raises(
        SliceTransferFailed, match=asked + " norm and head; its plan gives it blocks 2-3"
    ):
        untied.resolve(untied.fetcher(tmp_path / "host", stage=3), whole)
    got = untied.resolve(untied.fetcher(tmp_path / "host", stage=3))
    _same_tensors(got.paths[0], untied, MIDDLE)


@pytest.mark.parametrize(
    ("header_bytes", "file_bytes"), [(2**50, 2**51), (0, 100), (200, 100), (-1, 100)]
)
def test_a_header_size_past_the_bound_or_the_file_is_refused_before_memory_is_taken(
    header_bytes: int, file_bytes: int, tmp_path: Path
) -> None:
    """A header of 2**50 bytes announced: the stage took memory for it first, and the
    ``MemoryError`` escaped ``resolve`` untyped (a few GiB were taken and zeroed)."""
    fetcher = SliceFetcher(
        SliceOrigin("127.0.0.1:1", "sha256:" + "0" * 64), 1, b"k" * 32,
        SliceCache(tmp_path / "host", limit=None),
    )  # fmt: skip
    info = {"header_bytes": header_bytes, "file_bytes": file_bytes, "header_sha256": ""}
    with pytest.raises(fetch_module._Failed, match=f"announced {header_bytes} bytes of it"):
        fetcher._receive_header(None, info, tmp_path, MIDDLE)  # type: ignore[arg-type]


def test_progress_bars_log_lines_and_figures_follow_each_stages_slice(
    untied: Source, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = io.StringIO()
    bars = SliceBars(Console(file=out, force_terminal=True, width=120))
    seen: list[StageTransfer] = []
    logged = SliceLog()

    def changed(t: StageTransfer) -> None:
        seen.append(t)
        bars(t)
        logged(t)

    untied.server.on_change = changed
    with caplog.at_level(logging.INFO, logger="runtime_cupy.slices"):
        untied.resolve(untied.fetcher(tmp_path / "host"))
        _settled(untied.server)
    bars.stop()
    states = [t.state for t in seen]
    assert states[0] == "connected" and "sending" in states and states[-1] == "done"
    assert [t.sent_bytes for t in seen] == sorted(t.sent_bytes for t in seen)
    final = seen[-1]
    assert "stage 1 slice -> host1" in out.getvalue()
    assert "MiB" in out.getvalue() or "KiB" in out.getvalue()
    text = describe(final)
    assert text.startswith("stage 1's slice (host host1): ") and " in " in text
    assert any("stage 1's slice (host host1)" in r.message for r in caplog.records)
    (row,) = figures(untied.server.transfers())
    assert row["state"] == "done" and row["sent_bytes"] == final.sent_bytes
    assert row["tensor_bytes"] == untied.slice_bytes(MIDDLE) and row["seconds"] > 0
    moving = attrs.evolve(final, state="sending", sent_bytes=final.total_bytes // 2, ended_s=None)
    assert " of " in describe(moving) and "left" in describe(moving)


def test_a_host_holding_its_own_shard_of_a_split_model_uses_it(tmp_path: Path) -> None:
    model = write_model(tmp_path / "model.gguf", UNTIED)
    plan = split_plan(model_facts_from_gguf(model), 3, None, "even")
    assert isinstance(plan, RunPlan)
    split = split_model(str(model), plan, tmp_path / "shards")
    secret = new_secret()
    server = SliceServer("127.0.0.1", DigestStore(tmp_path / "orchestrator"))
    try:
        source = GgufSource((split.manifest_path,))
        key = server.offer(source)
        assert key == split.manifest.source  # the split model's key is the file's
        server.expect(1, "node1", slice_key(secret, "node1"))
        for i in (0, 2):  # this host was given the manifest and stage 1's shard only
            (tmp_path / "shards" / split.manifest.shards[i].file).unlink()
        fetcher = SliceFetcher(
            SliceOrigin(server.address, key),
            1,
            slice_key(secret, "node1"),
            SliceCache(tmp_path / "host", limit=None),
        )
        assert fetcher.resolve(source, MIDDLE) == source
        assert fetcher.last["outcome"] == "local"
        (sent,) = _settled(server)
        assert (sent.state, sent.tensor_bytes) == ("local", 0)
    finally:
        server.close()


def _refused(source: GgufSource, store: Path, match: str) -> None:
    server = SliceServer("127.0.0.1", DigestStore(store))
    try:
        with pytest.raises(GgufError, match=match):
            server.offer(source)
    finally:
        server.close()


def test_a_shard_changed_after_its_split_is_not_served(tmp_path: Path) -> None:
    """A shard whose tensor bytes or metadata changed after ``split`` is refused when
    offered, naming the tensor or the key's records and the file: it was served under a
    content key of its own, which the stages then took for the model's."""
    model = write_model(tmp_path / "model.gguf", UNTIED)
    plan = split_plan(model_facts_from_gguf(model), 3, None, "even")
    assert isinstance(plan, RunPlan)
    split = split_model(str(model), plan, tmp_path / "shards")
    shard = tmp_path / "shards" / split.manifest.shards[1].file
    source = GgufSource((split.manifest_path,))
    server = SliceServer("127.0.0.1", DigestStore(tmp_path / "orchestrator"))
    try:
        assert server.offer(source) == split.manifest.source  # recorded as sound
    finally:
        server.close()
    kept = shard.read_bytes()
    reader = gguf.GGUFReader(shard, "r+")
    reader.tensors[[t.name for t in reader.tensors].index("blk.2.attn_q.weight")].data.flat[0] += 1
    del reader  # one weight of one tensor, after the first offer
    for store in ("orchestrator", "fresh"):  # a record made before, and none
        tensor = rf"tensor 'blk.2.attn_q.weight' of {shard} hashes to \w+, its shard records"
        _refused(source, tmp_path / store, tensor)
    shard.write_bytes(kept)
    eps = "llama.attention.layer_norm_rms_epsilon"
    reader = gguf.GGUFReader(shard, "r+")
    reader.fields[eps].parts[-1][0] *= 2
    del reader  # a hyperparameter of stage 1's shard, which stage 1 reads
    _refused(source, tmp_path / "orchestrator", f"{eps} is stored otherwise in {shard} than in")
    shard.write_bytes(kept)
    first = tmp_path / "shards" / split.manifest.shards[0].file
    reader = gguf.GGUFReader(first, "r+")
    reader.fields[eps].parts[-1][0] *= 2
    del reader  # the first shard's, which the key hashes
    _refused(source, tmp_path / "orchestrator", f"{eps} is stored otherwise in {shard} than in")
    for i in (1, 2):  # every shard's: each tensor as recorded, the key not
        reader = gguf.GGUFReader(tmp_path / "shards" / split.manifest.shards[i].file, "r+")
        reader.fields[eps].parts[-1][0] *= 2
        del reader
    _refused(source, tmp_path / "orchestrator", rf"content key is sha256:\w+, .* records "
             rf"{split.manifest.source}: its metadata changed")  # fmt: skip


def test_a_hosts_name_shows_in_the_bars_as_it_is() -> None:
    """Host names come from the cluster: one holding rich's markup is shown literally
    (it once vanished, or crashed the display on ``[/]``)."""
    out = io.StringIO()
    bars = SliceBars(Console(file=out, force_terminal=False, width=200))
    for index, host in ((1, "[bold]h1"), (2, "h[/]2")):
        bars(StageTransfer(index, f"node{index}", host, "failed", header_bytes=10))
    bars.stop()
    assert "stage 1 slice -> [bold]h1 failed" in out.getvalue(), out.getvalue()
    assert "stage 2 slice -> h[/]2 failed" in out.getvalue(), out.getvalue()


def test_a_slice_the_stage_refuses_after_its_header_is_named_on_both_sides(
    untied: Source, tmp_path: Path
) -> None:
    """A cache limit below the slice: the stage refuses it once the header says its size;
    the server records the stage's own reason (it recorded ``'tensors'``, a KeyError on
    the refusal)."""
    origin = SliceOrigin(untied.server.address, untied.key)
    key = slice_key(untied.secret, "node1")
    small = SliceCache(tmp_path / "host", limit=untied.slice_bytes(MIDDLE) // 2)
    with pytest.raises(SliceTransferFailed) as failed:
        untied.resolve(SliceFetcher(origin, 1, key, small, encrypt=False))
    (transfer,) = [t for t in _settled(untied.server) if t.stage_index == 1]
    assert transfer.error is not None and "tensors" not in transfer.error, transfer
    assert transfer.error in str(failed.value), (transfer.error, str(failed.value))


class _TimedOut:
    """A socket whose kernel gave up on its peer (``ETIMEDOUT``: nothing acknowledged
    within the connection's user timeout), under a 60 s bound of its own."""

    def __init__(self, kernel: bool) -> None:
        self.kernel = kernel

    def gettimeout(self) -> float:
        return 60.0

    def _raise(self, *args: object) -> None:
        if self.kernel:
            raise TimeoutError(errno.ETIMEDOUT, os.strerror(errno.ETIMEDOUT))
        raise TimeoutError("timed out")

    recv_into = sendall = _raise


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "bound"])
def test_a_silent_link_names_whose_bound_ran_out(kernel: bool) -> None:
    """The kernel's ``ETIMEDOUT`` is a ``TimeoutError`` too: a link cut 6 s before was said
    to have been silent "for 60 s", the socket's own bound."""
    from runtime_cupy.slices.protocol import Link, LinkSilent

    link = Link(_TimedOut(kernel))  # type: ignore[arg-type]
    for call in (lambda: link.recv_into(memoryview(bytearray(4))), lambda: link.send_raw(b"x")):
        with pytest.raises(LinkSilent) as caught:
            call()
        said = str(caught.value)
        assert ("the connection timed out" in said) is kernel, said
        assert ("for 60 s" in said) is not kernel, said


def test_a_stage_admitted_again_on_another_host_is_named_by_it(
    untied: Source, tmp_path: Path
) -> None:
    """A recovery admits a lost stage again on its new host: its next transfer names
    that node and host (it kept the first admission's record, so the slice log, the
    bars and ``/health`` blamed the lost host for the new one's transfer)."""
    untied.resolve(untied.fetcher(tmp_path / "first"))
    (first,) = _settled(untied.server)
    assert (first.node_id, first.host) == ("node1", "host1")
    key = slice_key(untied.secret, "node9")
    untied.server.expect(1, "node9", key, "host9")
    origin = SliceOrigin(untied.server.address, untied.key)
    fetcher = SliceFetcher(origin, 1, key, SliceCache(tmp_path / "second", limit=None))
    untied.resolve(fetcher)
    (second,) = _settled(untied.server)
    assert (second.state, second.node_id, second.host) == ("done", "node9", "host9"), second


def test_a_lost_hosts_connection_ending_late_leaves_the_new_hosts_transfer_as_it_is(
    untied: Source, tmp_path: Path
) -> None:
    """The lost host's connection (an earlier admission of the stage) ends after the
    stage's new host has its slice: the new transfer stays ``done`` (the old connection's
    failure overwrote it, with the lost host's error, and its progress mixed in)."""
    lost = open_as_stage(untied.server.address, 1, slice_key(untied.secret, "node1"))
    try:
        lost.send({"source": [str(untied.path)], "source_key": untied.key,
                   "parts": attrs.asdict(MIDDLE)})  # fmt: skip
        lost.recv_bytes(int(lost.receive()["header_bytes"]))
        key = slice_key(untied.secret, "node9")
        untied.server.expect(1, "node9", key, "host9")  # a recovery admits it again
        origin = SliceOrigin(untied.server.address, untied.key)
        untied.resolve(SliceFetcher(origin, 1, key, SliceCache(tmp_path / "new", limit=None)))
        (new,) = _settled(untied.server)
        assert (new.state, new.node_id, new.host) == ("done", "node9", "host9"), new
    finally:
        lost.close()  # the lost host's connection ends: the server's send fails
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert untied.server.transfers() == (new,)
        time.sleep(0.05)
