"""Damaged copies of real GGUF files, as Hypothesis draws them.

A *base* is a GGUF file mapped once by the gguf package's own full reader
(``gguf.GGUFReader``), which gives the byte offset of every structural field: the
counts of the header, each key's name length, type and value, each array's item type
and count, a sample of the length prefixes of array strings, each tensor info's name,
dimension count, dimensions, GGML type and data offset. A *mutant* is a copy of the
whole file with one to three operations applied:

- ``flip``: xor one byte with a mask (anywhere in the header; in the tensor data too
  for the small bases);
- ``truncate``: cut the file at any byte;
- ``forge``: overwrite one structural field with a value that breaks something: 0, 1,
  the field's value plus or minus one or doubled, powers of two around 2**16, 2**31,
  2**32, 2**63, the largest value of the field's width, or any value;
- ``bad_utf8``: put a byte that no UTF-8 text holds (or a truncated sequence) into a
  key name, a string value, a tensor name or an array string.

SmolLM2's copy keeps the real tensor data; only its header and size change (the stages
that run on it, facts, tokenizer and slice loader, read no tensor data), so one working
copy is patched and restored per mutant instead of writing 98 MB each time. A cut past
its header is written as the header followed by a sparse tail.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
from gguf import GGUFReader, GGUFValueType
from hypothesis import strategies as st

#: Bytes that cannot stand where they are put in UTF-8 text.
BAD_UTF8 = (0xFF, 0xFE, 0xC0, 0xC1, 0x80, 0xBF, 0xED, 0xF5, 0xF8, 0xE2)


@attrs.frozen
class Target:
    offset: int
    width: int  # bytes: 4 or 8 for numbers, the string's length for "string"
    kind: str  # "count", "length", "type", "dims", "dim", "offset", "value", "string"
    label: str
    original: int  # the value as stored (0 for strings)


@attrs.frozen
class Op:
    kind: str  # "flip", "truncate", "forge", "bad_utf8"
    at: int  # byte offset (flip, truncate, bad_utf8) or target index (forge)
    value: int  # xor mask, forged value, or the bad byte

    def describe(self, base: Base) -> str:
        if self.kind == "forge":
            t = base.targets[self.at]
            return f"forge {t.label} ({t.original} -> {self.value})"
        return f"{self.kind} at {self.at} ({self.value:#x})"


@attrs.frozen
class Mutant:
    base: str
    ops: tuple[Op, ...]


def _addr(array: Any) -> int:
    return int(array.__array_interface__["data"][0])


def _number_target(part: Any, base: int, kind: str, label: str) -> Target:
    return Target(_addr(part) - base, int(part.nbytes), kind, label, int(part.reshape(-1)[0]))


def structure(path: Path, *, strings_per_array: int = 6, seed: int = 0) -> tuple[list[Target], int]:
    """The structural fields of ``path`` and where its tensor data starts."""
    reader = GGUFReader(path)
    base = _addr(reader.data)
    rng = random.Random(seed)
    targets: list[Target] = []
    for name, field in reader.fields.items():
        parts = field.parts
        if name.startswith("GGUF."):
            kind = "value" if name == "GGUF.version" else "count"
            targets.append(_number_target(parts[0], base, kind, name))
            continue
        key_len, key, value_type = parts[:3]
        targets.append(_number_target(key_len, base, "length", f"{name}: key length"))
        targets.append(Target(_addr(key) - base, int(key.nbytes), "string", f"{name}: key", 0))
        targets.append(_number_target(value_type, base, "type", f"{name}: value type"))
        kind = field.types[0]
        if kind == GGUFValueType.STRING:
            targets.append(_number_target(parts[3], base, "length", f"{name}: string length"))
            targets.append(Target(_addr(parts[4]) - base, int(parts[4].nbytes), "string", name, 0))
        elif kind == GGUFValueType.ARRAY:
            targets.append(_number_target(parts[3], base, "type", f"{name}: item type"))
            targets.append(_number_target(parts[4], base, "count", f"{name}: item count"))
            if field.types[1] == GGUFValueType.STRING:
                n = (len(parts) - 5) // 2
                picks = {0, 1, n - 1} | {rng.randrange(n) for _ in range(strings_per_array)}
                for i in sorted(p for p in picks if 0 <= p < n):
                    length, text = parts[5 + 2 * i], parts[6 + 2 * i]
                    targets.append(_number_target(length, base, "length", f"{name}[{i}]: length"))
                    if text.nbytes:
                        targets.append(
                            Target(
                                _addr(text) - base, int(text.nbytes), "string", f"{name}[{i}]", 0
                            )
                        )
        elif parts[3].dtype.kind in "iub" and parts[3].nbytes in (4, 8):
            targets.append(_number_target(parts[3], base, "value", name))
    for tensor in reader.tensors:
        name_len, name, n_dims, dims, ggml_type, offset = tensor.field.parts
        t = tensor.name
        targets.append(_number_target(name_len, base, "length", f"tensor {t}: name length"))
        targets.append(Target(_addr(name) - base, int(name.nbytes), "string", f"tensor {t}", 0))
        targets.append(_number_target(n_dims, base, "dims", f"tensor {t}: dimension count"))
        for i in range(len(dims)):
            targets.append(_number_target(dims[i : i + 1], base, "dim", f"tensor {t}: dim {i}"))
        targets.append(_number_target(ggml_type, base, "type", f"tensor {t}: GGML type"))
        targets.append(_number_target(offset, base, "offset", f"tensor {t}: data offset"))
    return targets, int(reader.data_offset)


def forged_values(width: int, original: int) -> list[int]:
    top = (1 << (8 * width)) - 1
    values = [0, 1, 2, 3, 4, 8, 255, 256, 2**15, 2**16 - 1, 2**16, 2**31 - 1, 2**31, 2**32 - 1]
    if width == 8:
        values += [2**32, 2**40, 2**60, 2**63 - 1, 2**63]
    values += [top, original - 1, original + 1, original * 2, original // 2, original + 32]
    return sorted({v & top for v in values})


@attrs.define
class Base:
    """One file to mutate, and a place to write its mutants."""

    name: str
    path: Path
    data: bytes  # the whole file (small bases) or its header (large ones)
    size: int
    header_end: int  # where the tensor data starts
    targets: list[Target]
    deep: bool  # run the whole pipeline (a step too) on its mutants
    work: Path
    _large: bool = False
    _restore: list[tuple[int, bytes]] = attrs.field(factory=list)

    @classmethod
    def load(
        cls, name: str, path: Path, work_dir: Path, *, deep: bool, large: bool = False
    ) -> Base:
        targets, header_end = structure(path)
        size = path.stat().st_size
        work = work_dir / f"{name}.gguf"
        if large:
            shutil.copyfile(path, work)
            with open(path, "rb") as f:
                data = f.read(header_end)
        else:
            data = path.read_bytes()
        return cls(name, path, data, size, header_end, targets, deep, work, large)

    @property
    def span(self) -> int:
        """Bytes flips land in: the whole file, or the header of a large base."""
        return self.header_end if self._large else self.size

    def write(self, mutant: Mutant) -> Path:
        """The mutant as a file (valid until ``restore``)."""
        data = bytearray(self.data)
        cut = None
        beyond: dict[int, int] = {}
        for op in mutant.ops:
            if op.kind == "truncate":
                cut = op.at if cut is None else min(cut, op.at)
            elif op.kind == "flip":
                if op.at < len(data):
                    data[op.at] ^= op.value
                else:
                    beyond[op.at] = op.value
            elif op.kind == "forge":
                t = self.targets[op.at]
                data[t.offset : t.offset + t.width] = op.value.to_bytes(t.width, "little")
            elif op.kind == "bad_utf8":
                data[op.at] = op.value
        if not self._large:
            for at, mask in beyond.items():
                data[at] ^= mask
            out = self.work
            out.write_bytes(bytes(data[:cut]) if cut is not None else bytes(data))
            return out
        if cut is not None:  # a copy of the header, the rest sparse
            out = self.work.with_name(self.name + "-cut.gguf")
            out.write_bytes(bytes(data[:cut]))
            if cut > len(data):
                os.truncate(out, cut)
            return out
        with open(self.work, "r+b") as f:
            f.write(data)
            self._restore.append((0, self.data))
            for at, mask in beyond.items():
                f.seek(at)
                old = f.read(1)
                f.seek(at)
                f.write(bytes([old[0] ^ mask]))
                self._restore.append((at, old))
        return self.work

    def restore(self) -> None:
        if not self._restore:
            return
        with open(self.work, "r+b") as f:
            for at, old in reversed(self._restore):
                f.seek(at)
                f.write(old)
        self._restore.clear()


#: What an operation does, drawn as an index (each kind's share is its count here).
#: For the facts, half of them break the header's structure; for the deeper stages,
#: most keep the header parsable (a forged scalar value, bad UTF-8 in a string, a flip
#: in the tensor data) so that mutants reach the stages after the facts.
KINDS = (
    "forge_field", "forge_field", "forge_value", "forge_value", "bad_utf8", "bad_utf8",
    "flip_header", "flip_data", "truncate",
)  # fmt: skip
DEEP_KINDS = (
    "forge_field", "forge_value", "forge_value", "forge_value", "bad_utf8", "bad_utf8",
    "flip_header", "flip_data", "flip_data", "truncate",
)  # fmt: skip


@attrs.frozen
class _Choices:
    strings: tuple[int, ...]
    values: tuple[int, ...]
    fields: tuple[int, ...]

    @classmethod
    def of(cls, base: Base) -> _Choices:
        kinds = [t.kind for t in base.targets]
        return cls(
            tuple(i for i, k in enumerate(kinds) if k == "string" and base.targets[i].width),
            tuple(i for i, k in enumerate(kinds) if k == "value"),
            tuple(i for i, k in enumerate(kinds) if k not in ("string", "value")),
        )


def _op(base: Base, choices: _Choices, kind: str, a: int, b: int) -> Op:
    if kind == "flip_data" and base.span <= base.header_end:
        kind = "flip_header"  # a large base's tensor data is not mutated
    if kind in ("forge_field", "forge_value"):
        indices = choices.fields if kind == "forge_field" or not choices.values else choices.values
        index = indices[a % len(indices)]
        t = base.targets[index]
        top = (1 << (8 * t.width)) - 1
        values = forged_values(t.width, t.original)
        value = values[b % len(values)] if b < 2**63 else b & top  # else: any value
        return Op("forge", index, value)
    if kind == "bad_utf8":
        t = base.targets[choices.strings[a % len(choices.strings)]]
        return Op("bad_utf8", t.offset + b % t.width, BAD_UTF8[(b >> 32) % len(BAD_UTF8)])
    if kind == "flip_header":
        return Op("flip", a % base.header_end, 1 + b % 255)
    if kind == "flip_data":
        return Op("flip", base.header_end + a % (base.span - base.header_end), 1 + b % 255)
    at = a % base.header_end if b % 2 == 0 else a % base.size  # a cut in the header, or anywhere
    return Op("truncate", at, 0)


def mutants(
    bases: Sequence[Base], weights: Sequence[int], kinds: Sequence[str] = KINDS
) -> st.SearchStrategy[Mutant]:
    """Mutants of ``bases``, base ``i`` drawn ``weights[i]`` times as often as one of
    weight 1, each with one to three operations of ``kinds``.

    An operation is drawn as a kind and two raw numbers that the kind reads: few draws
    per mutant keep Hypothesis's own cost per mutant low, and each number shrinks
    towards the simplest choice (the first field, the first forged value, byte 0)."""
    choices = {b.name: _Choices.of(b) for b in bases}
    by_name = {b.name: b for b in bases}
    names = [b.name for b, w in zip(bases, weights, strict=True) for _ in range(w)]
    raw_op = st.tuples(
        st.integers(0, len(kinds) - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
    )

    def build(drawn: tuple[str, list[tuple[int, int, int]]]) -> Mutant:
        name, raw_ops = drawn
        base, choice = by_name[name], choices[name]
        return Mutant(name, tuple(_op(base, choice, kinds[k], a, b) for k, a, b in raw_ops))

    return st.tuples(st.sampled_from(names), st.lists(raw_op, min_size=1, max_size=3)).map(build)
