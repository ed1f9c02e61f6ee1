"""The AES-GCM frame seal on its own, on both of its paths: into its reused buffer
(``cryptography`` 47 and later) and into new objects (earlier releases, the floor is
42). Each frame is checked against an independent reading: ``AESGCM`` called directly
with the nonce the seal's docstring names (direction, then the frame's number)."""

from __future__ import annotations

import os
import struct

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from runtime_cupy.edges import tcp_seal
from runtime_cupy.edges.tcp_seal import AeadSeal

KEY = bytes(range(32))
DIRECTION = 7


@pytest.fixture(params=["into", "new-objects"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which of the seal's paths the test takes (into: where this cryptography has it)."""
    if request.param == "into":
        if not hasattr(AESGCM, "encrypt_into"):
            pytest.skip("this cryptography has no encrypt_into (added in 47)")
        monkeypatch.setattr(tcp_seal, "_INTO", True)
    else:
        monkeypatch.setattr(tcp_seal, "_INTO", False)
    return str(request.param)


def nonce(number: int) -> bytes:
    return struct.pack("<I", DIRECTION) + struct.pack("<Q", number)


def test_frames_of_growing_and_shrinking_sizes_seal_as_aes_gcm_and_open_in_place(path: str) -> None:
    sender, receiver = AeadSeal(KEY, DIRECTION), AeadSeal(KEY, DIRECTION)
    reference = AESGCM(KEY)
    held = []  # views of the sender's buffer kept past a larger frame stay valid
    for number, size in enumerate([0, 5, 1 << 20, 3, (1 << 20) + 17, 64 << 10, 0]):
        body = os.urandom(size)
        head = struct.pack("<Q", size)
        sealed, tag = sender.seal(head, body)
        expected = reference.encrypt(nonce(number), body, head)
        assert bytes(sealed) + tag == expected
        held.append((bytes(sealed), sealed))
        received = bytearray(sealed)
        assert receiver.open(head, memoryview(received), tag)
        assert bytes(received) == body
    for copy, view in held[:2]:
        assert bytes(view) == copy


def test_a_changed_frame_fails_to_open_and_leaves_nothing_decrypted(path: str) -> None:
    sender, receiver = AeadSeal(KEY, DIRECTION), AeadSeal(KEY, DIRECTION)
    body = os.urandom(4096)
    sealed, tag = sender.seal(b"head", body)
    changed = bytearray(sealed)
    changed[100] ^= 1
    assert not receiver.open(b"head", memoryview(changed), tag)
    assert bytes(changed) != body
    assert bytes(changed[:100]) != body[:100]  # not even the part before the change


def test_a_frame_without_a_body_opens_from_a_read_only_view(path: str) -> None:
    sender, receiver = AeadSeal(KEY, DIRECTION), AeadSeal(KEY, DIRECTION)
    _, tag = sender.seal(b"close", b"")
    assert receiver.open(b"close", memoryview(b""), tag)
    _, tag = sender.seal(b"close", b"")
    assert not receiver.open(b"other", memoryview(b""), tag)


def test_a_frame_opened_out_of_its_number_fails(path: str) -> None:
    sender, receiver = AeadSeal(KEY, DIRECTION), AeadSeal(KEY, DIRECTION)
    sender.seal(b"h", b"one")  # frame 0, never delivered
    sealed, tag = sender.seal(b"h", b"two")
    assert not receiver.open(b"h", memoryview(bytearray(sealed)), tag)
