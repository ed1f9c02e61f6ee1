"""Slice transfer with ``--encrypt-edges``: the stage and the server agree on the
protection in the handshake, the tensor bytes travel in sealed AES-256-GCM chunks, and
a man in the middle (``tests.support.slice_relay``, no key) reads none of them and
cannot change, replay, drop or reorder a chunk unnoticed. Real sockets on loopback, a
real server and fetcher (``test_slices.Source``)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runplan.shards import slice_tensor_names
from runtime_cupy.edges.tcp_seal import AUTHENTICATED, ENCRYPTED
from runtime_cupy.process.keys import slice_key
from runtime_cupy.slices import protocol
from runtime_cupy.slices.fetch import SliceTransferFailed
from runtime_cupy.slices.protocol import (
    BrokenSeal,
    Link,
    ProtectionMismatch,
    TransferError,
    open_as_stage,
)
from runtime_cupy.slices.server import SliceServer, StageTransfer
from tests.runtime_cupy.test_slices import (
    MIDDLE,
    UNTIED,
    Source,
    _entries_and_tmp,
    _same_tensors,
    _settled,
)
from tests.support.slice_relay import SliceRelay

NAMES = {AUTHENTICATED: "authenticated (HMAC-SHA256)", ENCRYPTED: "encrypted (AES-256-GCM)"}


@pytest.fixture
def sealed(tmp_path: Path) -> Iterator[Source]:
    """A server that sends its stages' slices encrypted."""
    (tmp_path / "src").mkdir()
    source = Source(tmp_path / "src", UNTIED, encrypt=True)
    yield source
    source.server.close()


@pytest.fixture
def plain(tmp_path: Path) -> Iterator[Source]:
    (tmp_path / "plain").mkdir()
    source = Source(tmp_path / "plain", UNTIED)
    yield source
    source.server.close()


def _through(source: Source, tmp_path: Path, attack: str = "pass") -> tuple[SliceRelay, object]:
    """A fetch of ``MIDDLE`` through a relay doing ``attack``: the relay, and what the
    fetch gave (the source, or the ``SliceTransferFailed``)."""
    relay = SliceRelay(source.server.address, attack)
    try:
        fetcher = source.fetcher(tmp_path / "host", address=relay.address_text)
        try:
            got: object = source.resolve(fetcher)
        except SliceTransferFailed as exc:
            got = exc
        _settled(source.server)  # the stage's last word crossed the relay
    finally:
        relay.close()
    return relay, got


def _recorded(server: SliceServer) -> tuple[StageTransfer, ...]:
    """The server's transfers once it has one: it notes a refused stage just after
    refusing it."""
    deadline = time.monotonic() + 10
    while not server.transfers() and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.transfers()


def _cause(exc: BaseException, kind: type[BaseException]) -> BaseException:
    """The first exception of ``kind`` in ``exc``'s chain of causes."""
    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, kind):
        seen = seen.__cause__
    assert seen is not None, f"no {kind.__name__} under {exc!r}"
    return seen


def _patterns(source: Source) -> list[bytes]:
    """64 bytes from the middle of each of the slice's tensors (random weights: found
    nowhere else)."""
    out = []
    for name in slice_tensor_names(source.header.tensors, MIDDLE):
        data = bytes(source.header.tensor_bytes(name).data)
        out.append(data[len(data) // 2 : len(data) // 2 + 64])
    return out


def test_an_encrypted_transfer_delivers_the_same_slice_and_the_wire_holds_no_weight(
    sealed: Source, plain: Source, tmp_path: Path
) -> None:
    relay, got = _through(sealed, tmp_path / "sealed")
    assert not isinstance(got, Exception), got
    _same_tensors(got.paths[0], sealed, MIDDLE)  # type: ignore[attr-defined]
    (sent,) = _settled(sealed.server)
    assert sent.state == "done" and sent.tensor_bytes == sealed.slice_bytes(MIDDLE)
    tensors = len(slice_tensor_names(sealed.header.tensors, MIDDLE))
    assert relay.chunks == 1 + tensors  # the header, then one chunk per tensor (each < 1 MiB)
    assert len(relay.wire) > sealed.slice_bytes(MIDDLE)  # all of it crossed the relay...
    assert not [p for p in _patterns(sealed) if p in relay.wire]  # ...and none readable
    # The same relay on a transfer that is not encrypted sees every tensor.
    clear, got = _through(plain, tmp_path / "plain")
    assert not isinstance(got, Exception), got
    assert all(p in clear.wire for p in _patterns(plain))


@pytest.mark.parametrize(
    ("attack", "what"),
    [
        ("change@3", "changed chunk 3"),
        ("replay@3", "replayed chunk 2 in place of chunk 3"),
        ("drop@3", "dropped chunk 3"),
        ("reorder@3", "swapped chunks 3 and 4"),
    ],
)
def test_a_chunk_changed_replayed_dropped_or_reordered_is_refused_as_it_arrives(
    sealed: Source, tmp_path: Path, attack: str, what: str
) -> None:
    relay, failed = _through(sealed, tmp_path, attack)
    assert relay.done == [what]
    assert isinstance(failed, SliceTransferFailed), failed
    broken = _cause(failed, BrokenSeal)
    assert isinstance(broken, BrokenSeal) and broken.what == "chunk 3 of the bytes"
    text = str(failed)
    assert "tensor blk.2." in text and "chunk 3 of the bytes" in text, text
    assert "failed its seal" in text and "no cache entry was made" in text, text
    assert _entries_and_tmp(tmp_path / "host") == ([], [])
    (record,) = _settled(sealed.server)  # the stage told the server why
    assert record.state == "failed" and "chunk 3 of the bytes" in str(record.error)
    # Nothing of it stays: the next fetch, not through the relay, gets the slice.
    got = sealed.resolve(sealed.fetcher(tmp_path / "host"))
    _same_tensors(got.paths[0], sealed, MIDDLE)


def test_a_link_gone_silent_mid_slice_ends_the_fetch_naming_it(
    sealed: Source, tmp_path: Path
) -> None:
    """A man in the middle that holds the bytes back with the connection open: the
    stage waits its stall bound, not for ever, and fails naming the tensor and why."""
    relay = SliceRelay(sealed.server.address, "stall@3")
    try:
        fetcher = sealed.fetcher(tmp_path / "host", address=relay.address_text)
        fetcher.stall_s = 0.5
        began = time.monotonic()
        with pytest.raises(SliceTransferFailed) as failed:
            sealed.resolve(fetcher)
        took = time.monotonic() - began
    finally:
        relay.close()
    assert relay.done == ["held back chunk 3 and what followed"]
    silent = _cause(failed.value, protocol.LinkSilent)
    assert "sent nothing after" in str(silent) and "for 0.5 s" in str(silent), silent
    text = str(failed.value)
    assert "tensor blk.2." in text and "the link went silent" in text, text
    assert took < 10.0, f"the stall bound is 0.5 s, the fetch took {took:.1f} s"
    assert _entries_and_tmp(tmp_path / "host") == ([], [])


@pytest.mark.parametrize("server_encrypts", [True, False])
def test_a_stage_and_a_server_that_protect_otherwise_are_refused_naming_both(
    tmp_path: Path, server_encrypts: bool
) -> None:
    (tmp_path / "src").mkdir()
    source = Source(tmp_path / "src", UNTIED, encrypt=server_encrypts)
    server, stage = (ENCRYPTED, AUTHENTICATED) if server_encrypts else (AUTHENTICATED, ENCRYPTED)
    try:
        fetcher = source.fetcher(tmp_path / "host", encrypt=not server_encrypts)
        with pytest.raises(SliceTransferFailed) as failed:
            source.resolve(fetcher)
        mismatch = _cause(failed.value, ProtectionMismatch)
        assert isinstance(mismatch, ProtectionMismatch)
        assert (mismatch.ours, mismatch.theirs) == (NAMES[stage], NAMES[server])
        text = str(failed.value)
        assert f"asks for its slice {NAMES[stage]}" in text, text
        assert f"sends it {NAMES[server]}" in text and "--encrypt-edges" in text, text
        assert _entries_and_tmp(tmp_path / "host") == ([], [])
        (record,) = _recorded(source.server)  # the server says so too
        assert record.state == "failed" and record.stage_index == 1
        assert NAMES[stage] in str(record.error) and NAMES[server] in str(record.error)
    finally:
        source.server.close()


def test_a_relay_that_asks_for_the_plain_protection_in_the_stages_name_is_refused(
    sealed: Source, tmp_path: Path
) -> None:
    relay, failed = _through(sealed, tmp_path, "downgrade")
    assert relay.done == ["asked for protection 1 in the HELLO"]
    assert isinstance(failed, SliceTransferFailed), failed
    assert "refused or failed the handshake" in str(failed), failed
    assert _entries_and_tmp(tmp_path / "host") == ([], [])
    assert sealed.server.transfers() == ()  # no byte of the slice was sent


def test_a_reader_may_take_the_sealed_bytes_in_pieces_other_than_the_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The two ends of one link, sealed as a handshake would have left them.
    monkeypatch.setattr(protocol, "SEALED_CHUNK", 1000)
    a, b = socket.socketpair()
    key, nonce_c, nonce_p = bytes(32), bytes(32), bytes(range(32))
    sender, reader = Link(a), Link(b)
    sender.start_session(ENCRYPTED, ENCRYPTED.seals(key, nonce_c, nonce_p, producer=False))
    reader.start_session(ENCRYPTED, ENCRYPTED.seals(key, nonce_c, nonce_p, producer=True))
    data = bytes(range(256)) * 20  # 5,120 bytes: chunks of 1000, the last of 120
    sender.send_bytes(data)
    sender.send({"after": True})
    got = bytearray(len(data))
    for start in range(0, len(data), 1536):  # pieces that cross the chunks' edges
        with memoryview(got)[start : start + 1536] as piece:
            reader.recv_bytes_into(piece)
    assert got == data and reader.receive() == {"after": True}
    sender.send_bytes(b"x" * 10)
    with pytest.raises(TransferError, match="a chunk of 10 bytes where a control frame"):
        reader.receive()
    sender.close()
    reader.close()


def test_a_stage_asking_for_encryption_is_told_what_the_server_does(plain: Source) -> None:
    key = slice_key(plain.secret, "node1")
    with pytest.raises(ProtectionMismatch) as refused:
        open_as_stage(plain.server.address, 1, key, protection=ENCRYPTED)
    assert (refused.value.ours, refused.value.theirs) == (NAMES[ENCRYPTED], NAMES[AUTHENTICATED])
    assert plain.server.address in str(refused.value)
