"""The tokenizer of a GGUF file, matching llama.cpp's on the same file.

``Tokenizer.from_gguf(path)`` reads the vocabulary (``runtime_core.tokenizer_vocab``)
and builds the merging on the ``tokenizers`` library (Hugging Face's Rust engine):

- **gpt2** (byte-level BPE): the text is cut by the file's pre-tokenizer
  (``runtime_core.tokenizer_pre``), each piece is mapped byte by byte to GPT-2's
  printable stand-ins, and merged by the file's merge ranks. With the ``llama3``
  family a piece that is itself a token is taken whole.
- **llama** (SentencePiece): spaces become ``▁`` (with one prepended to the text and
  after every special token when the file says ``add_space_prefix``), and adjacent
  symbols merge while their concatenation is a token, highest score first.
  Characters with no token fall back to ``<0xXX>`` byte tokens. The merging is a
  BPE whose merges are every way of cutting a token in two, ranked by the token's
  score; the one difference from llama.cpp is two different merges of *equal*
  score competing in one word, which llama.cpp settles leftmost first and this by
  rank (SentencePiece files give their pieces distinct scores).

Before either, special tokens written in the text are cut out as llama.cpp does:
longest token first, user-defined tokens always, control and unknown tokens only
with ``parse_special``, some (Phi-3's) taking the whitespace beside them along.
``decode`` follows llama.cpp's detokenizer: control tokens
render only with ``special=True``, SentencePiece drops the leading space of the
first piece, and byte-level vocabularies may clean up spaces before punctuation.
"""

from __future__ import annotations

import operator
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HfTokenizer

from runplan.gguf_header import GgufHeader
from runtime_core.chat import ChatTemplateError, NoChatTemplate, render_chat_template
from runtime_core.tokenizer_cuts import token_cuts
from runtime_core.tokenizer_merge import merged_ids
from runtime_core.tokenizer_vocab import (
    Attr,
    TokenizerError,
    UnknownPreTokenizer,
    UnknownTokenizerModel,
    Vocab,
)

__all__ = [
    "ChatTemplateError",
    "NoChatTemplate",
    "Tokenizer",
    "TokenizerError",
    "UnknownPreTokenizer",
    "UnknownTokenizerModel",
    "read_text",
]

_SPACE = "\u2581"  # SentencePiece's visible space
_SURROGATE = re.compile("[\ud800-\udfff]")
_C_SPACE = " \t\n\x0b\x0c\r"  # C's isspace, which llama.cpp strips around some tokens
_SPECIAL = Attr.CONTROL | Attr.UNKNOWN


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars: list[str] = [""] * 256
    for b in keep:
        chars[b] = chr(b)
    extra = 0
    for b in range(256):
        if not chars[b]:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_BYTE_CHARS = _gpt2_byte_chars()
_CHAR_BYTES = {c: b for b, c in enumerate(_BYTE_CHARS)}


class Tokenizer:
    """Text to token ids and back, as llama.cpp does for the same GGUF file."""

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
        self._ids = vocab.ids
        # Special tokens cut out of the text before merging, longest (in bytes) first.
        specials = [i for i, a in enumerate(vocab.attrs) if a & (_SPECIAL | Attr.USER_DEFINED)]
        specials.sort(key=lambda i: -len(_token_bytes(vocab.tokens[i])))
        self._specials = [(vocab.tokens[i], i, vocab.attrs[i]) for i in specials]
        # Ids past the vocabulary stand for strings llama.cpp can merge through but
        # not emit; each maps to what llama.cpp emits instead (nothing, for a byte
        # with no token). ``encode`` never returns one.
        self._fallback: dict[int, list[int]] = {}
        # Bytes of text that may come out as no token at all (``_build_bpe``).
        self._vanishing: set[int] = set()
        self._hf = self._build_spm() if vocab.is_spm else self._build_bpe()
        self._pieces: dict[tuple[int, bool], bytes] = {}
        # The most bytes of text one token stands for (its own text's UTF-8 bytes: a
        # SentencePiece "▁" is 3 for one space, a byte-level stand-in 1 or 2 for one
        # byte, a byte token 6 for one), and whether some token also takes the
        # whitespace beside it (LSTRIP / RSTRIP), which no bound can count.
        self.longest_token_bytes = max((len(_token_bytes(t)) for t in vocab.tokens), default=1)
        self._strips = any(a & (Attr.LSTRIP | Attr.RSTRIP) for _, _, a in self._specials)
        # the bytes ``min_token_count`` does not count
        strips = set(_C_SPACE.encode()) if self._strips else set()
        self._uncounted = bytes(sorted(self._vanishing | strips))

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """The tokenizer of a GGUF file (reads the header only)."""
        return cls(Vocab.from_header(GgufHeader.read(path)))

    # -- facts ------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return len(self.vocab.tokens)

    @property
    def bos_id(self) -> int | None:
        return self.vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self.vocab.eos_id

    @property
    def eog_ids(self) -> frozenset[int]:
        """Ids that end generation (end of sequence, end of turn, ...)."""
        return self.vocab.eog_ids

    def token_text(self, token_id: int) -> str:
        """The token's text in the file: bytes that are not UTF-8 as lone surrogates
        (``surrogateescape``: llama.cpp keeps token texts as bytes)."""
        return self.vocab.tokens[self._check(token_id)]

    # -- encoding -----------------------------------------------------------------
    def min_token_count(self, text: str) -> int:
        """A lower bound on ``len(encode(text, add_special=False))``, found without
        tokenizing (so that a text too long for a context is refused by its size): no
        token stands for more bytes of text than ``longest_token_bytes``. Bytes that
        may come out as no token are not counted: in a byte-level vocabulary, a byte
        with no token (SmolLM2 has none for 0x04: ``"\\x04" * 2000`` is no token,
        once counted as at least 13), or one within a symbol that only merges make;
        in a vocabulary whose special tokens take the whitespace beside them along,
        the whitespace."""
        data = text.encode("utf-8", "surrogatepass")  # a lone surrogate: 3, as U+FFFD
        size = len(data.translate(None, self._uncounted)) if self._uncounted else len(data)
        return -(-size // max(1, self.longest_token_bytes))

    def encode(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Token ids of ``text``, as llama.cpp's ``llama_tokenize``. ``add_special``
        adds BOS / EOS as the file's flags say; ``parse_special`` turns control and
        unknown tokens written in the text (such as ``<|im_start|>``) into their ids
        instead of spelling them out. User-defined tokens are always recognised.
        ``TypeError`` for a ``text`` that is not a ``str`` (bytes included)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, not {type(text).__name__}: {text!r:.60}")
        v = self.vocab
        out: list[int] = []
        if add_special and v.add_bos:
            out.append(_known(v.bos_id))
        prev_special = True
        for fragment in self._partition(text, parse_special):
            if isinstance(fragment, int):
                out.append(fragment)
                prev_special = True
                continue
            raw = fragment
            if v.is_spm:
                if v.add_space_prefix and prev_special:
                    raw = " " + raw
                raw = raw.replace(" ", _SPACE)
            out.extend(self._merge(raw))
            prev_special = False
        if add_special and v.add_eos:
            out.append(_known(v.eos_id))
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """``text`` cut into raw fragments and special token ids."""
        text = read_text(text)
        fragments: list[str | int] = [text] if text else []
        for token, token_id, attr in self._specials:
            if attr & _SPECIAL and not parse_special:
                continue
            if not any(isinstance(f, str) and token in f for f in fragments):
                continue
            cut: list[str | int] = []
            for f in fragments:
                if isinstance(f, int) or token not in f:
                    cut.append(f)
                    continue
                parts = f.split(token)
                for k, part in enumerate(parts):
                    if k:
                        cut.append(token_id)
                        if attr & Attr.RSTRIP:
                            part = part.lstrip(_C_SPACE)  # noqa: PLW2901
                    if k < len(parts) - 1 and attr & Attr.LSTRIP:
                        part = part.rstrip(_C_SPACE)  # noqa: PLW2901
                    if part:
                        cut.append(part)
            fragments = cut
        return fragments

    def _merge(self, fragment: str) -> list[int]:
        # the interpreter let go while it merges, where the host has the threads for it
        ids = merged_ids(self._hf, fragment)
        if self._fallback and any(i >= self.n_vocab for i in ids):
            ids = [j for i in ids for j in self._fallback.get(i, (i,))]
        return ids

    # -- decoding -----------------------------------------------------------------
    def decode(
        self,
        ids: Iterable[int],
        *,
        special: bool = False,
        remove_special: bool = False,
        clean_up: bool = True,
        continues: bool = False,
    ) -> str:
        """The text of ``ids`` (invalid UTF-8 replaced by U+FFFD), as llama.cpp's
        ``llama_detokenize(remove_special, unparse_special=special)``."""
        return self.decode_bytes(
            ids,
            special=special,
            remove_special=remove_special,
            clean_up=clean_up,
            continues=continues,
        ).decode("utf-8", "replace")

    def decode_bytes(
        self,
        ids: Iterable[int],
        *,
        special: bool = False,
        remove_special: bool = False,
        clean_up: bool = True,
        continues: bool = False,
    ) -> bytes:
        """The bytes of ``ids``: ``decode`` before UTF-8 decoding. ``special`` renders
        control tokens; ``remove_special`` drops a leading BOS and a trailing EOS when
        the file adds them; ``clean_up=False`` leaves out the clean-up of spaces of a
        vocabulary that cleans them up (``clean_up_spaces``: a text still growing is
        cleaned up once its end is known); ``continues``: the text goes on from another
        (a completion from its prompt), so a vocabulary that adds a space prefix keeps
        the space of the first token, as llama.cpp's server sends each token's piece
        (``" fox"`` after ``"The quick brown"``, not ``"fox"``). ``TypeError`` for
        ``ids`` that are not an iterable of integers (a string included)."""
        if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
            raise TypeError(
                f"ids must be an iterable of token ids, not {type(ids).__name__}: {ids!r:.60}"
            )
        v = self.vocab
        seq = [self._check(i) for i in ids]
        strip_space = v.add_space_prefix and not continues
        if remove_special and v.add_bos and seq and seq[0] == v.bos_id:
            strip_space = False
            seq = seq[1:]
        if remove_special and v.add_eos and seq and seq[-1] == v.eos_id:
            seq = seq[:-1]
        out = bytearray()
        for token_id in seq:
            piece = self.token_bytes(token_id, special=special)
            if strip_space and piece[:1] == b" ":
                piece = piece[1:]
            strip_space = False
            out += piece
        return _clean_spaces(out) if v.clean_spaces and clean_up else bytes(out)

    def token_bytes(self, token_id: int, *, special: bool = False) -> bytes:
        """The bytes one token stands for (llama.cpp's ``token_to_piece``)."""
        key = (self._check(token_id), special)
        piece = self._pieces.get(key)
        if piece is None:
            piece = self._pieces[key] = self._piece(token_id, special)
        return piece

    def _piece(self, token_id: int, special: bool) -> bytes:
        attr = self.vocab.attrs[token_id]
        text = self.vocab.tokens[token_id]
        if attr & _SPECIAL and not special:
            return b""
        if attr & (_SPECIAL | Attr.USER_DEFINED):
            return _token_bytes(text)
        if attr & Attr.NORMAL:
            if self.vocab.is_spm:
                return _token_bytes(text.replace(_SPACE, " "))
            return _unmap_bytes(text)
        if attr & Attr.BYTE:
            return bytes([_byte_of(text)])
        return b""  # unused and undefined tokens render as nothing

    # -- chat templates -------------------------------------------------------------
    @property
    def chat_template(self) -> str | None:
        return self.vocab.chat_template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> str:
        """Render the file's ``tokenizer.chat_template`` for ``messages`` (dicts with
        ``role`` and ``content``). Raises ``NoChatTemplate`` for a file without one
        and ``ChatTemplateError`` when the template cannot be read (not UTF-8), raises
        or fails."""
        template = self.vocab.chat_template
        if self.vocab.chat_template_error is not None:
            raise ChatTemplateError(self.vocab.chat_template_error)
        if template is None:
            raise NoChatTemplate(self.vocab.path)
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._text_or_empty(self.vocab.bos_id),
            eos_token=self._text_or_empty(self.vocab.eos_id),
            **variables,
        )

    def encode_chat(self, text: str) -> list[int]:
        """Token ids of a rendered chat template's ``text``, as llama.cpp's server and
        llama-cpp-python encode it: with BOS and EOS as the file's flags say, a BOS the
        template wrote at the start (EOS at the end) left out where the flags add one
        (Llama 3's and Gemma's templates write ``bos_token``: two BOS tokens)."""
        v = self.vocab
        bos, eos = self._text_or_empty(v.bos_id), self._text_or_empty(v.eos_id)
        if v.add_bos and bos and text.startswith(bos):
            text = text[len(bos) :]
        if v.add_eos and eos and text.endswith(eos):
            text = text[: -len(eos)]
        return self.encode(text, add_special=True, parse_special=True)

    def _text_or_empty(self, token_id: int | None) -> str:
        return "" if token_id is None else self.vocab.tokens[token_id]

    # -- building ---------------------------------------------------------------------
    def _check(self, token_id: int) -> int:
        try:
            token_id = operator.index(token_id)  # numpy's integers too; not 1.0 nor "1"
        except TypeError:
            raise TypeError(
                f"token id {token_id!r} is a {type(token_id).__name__}, not an integer"
            ) from None
        if not 0 <= token_id < len(self.vocab.tokens):
            raise TokenizerError(f"token id {token_id} is outside 0..{self.n_vocab - 1}")
        return token_id

    def _extend(self, vocab: dict[str, int], text: str, fallback: list[int]) -> None:
        # past every id of the file: tokens that are not UTF-8 are not in ``vocab``
        new_id = self.n_vocab + len(self._fallback)
        vocab[text] = new_id
        self._fallback[new_id] = fallback

    def _build_bpe(self) -> HfTokenizer:
        v = self.vocab
        assert v.pre is not None
        vocab = _text_tokens(self._ids)
        for char in _BYTE_CHARS:
            if char not in vocab:
                # A byte with no token (SmolLM2 has none for 0x04): llama.cpp keeps it as
                # a symbol while it merges, which no merge crosses, and emits nothing for
                # it; left out of the vocabulary, it was dropped before merging, and its
                # neighbours merged across it (" \x04<" one token, not two).
                self._extend(vocab, char, [])
                self._vanishing.add(_CHAR_BYTES[char])
        merges = list(v.merges)
        # A merge that names a string that is not a token (a part, or what it makes):
        # the string is made a symbol first, as the tokenizers package refuses such a
        # merge (and panics, past any `except Exception`, where what it makes is longer
        # than every token). llama.cpp emits such a symbol as the tokens of its single
        # bytes, where there are such tokens.
        needed = {t for a, b in merges for t in (a, b, a + b)}
        for text in sorted(needed - vocab.keys()):
            singles = (chr(b) for b in text.encode() if b < 0x80)
            self._extend(vocab, text, [self._ids[c] for c in singles if c in self._ids])
            # the bytes such a symbol emits no token for
            self._vanishing.update(
                _CHAR_BYTES[c]
                for c in text
                if c in _CHAR_BYTES and not (c < "\x80" and c in self._ids)
            )
        bpe = models.BPE(vocab, merges, ignore_merges=v.ignore_merges)
        hf = HfTokenizer(bpe)
        splits = [pre_tokenizers.Split(Regex(r), "isolated") for r in v.pre.regexes]
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        return hf

    def _build_spm(self) -> HfTokenizer:
        v = self.vocab
        vocab = _text_tokens(self._ids)
        # A part is a token or one character, found without trying every cut (a
        # vocabulary of many token lengths built in time cubic in their number).
        candidates = [
            (-v.scores[vocab[text]], vocab[text], cut, a, b)
            for text, cut, a, b in token_cuts(vocab)
        ]
        candidates.sort()
        for _, _, _, a, b in candidates:
            for c in (a, b):
                if c not in vocab:  # a character with no token: bytes if unmerged
                    self._extend(vocab, c, self._byte_tokens(c))
        unk = v.tokens[v.unk_id] if v.unk_id is not None else None
        bpe = models.BPE(
            vocab,
            [(a, b) for _, _, _, a, b in candidates],
            unk_token=unk,
            byte_fallback=True,
        )
        return HfTokenizer(bpe)

    def _byte_tokens(self, char: str) -> list[int]:
        out = []
        for b in char.encode():
            token_id = self._ids.get(f"<0x{b:02X}>")
            if token_id is None and b < 0x80:  # llama.cpp then tries the byte itself
                token_id = self._ids.get(chr(b))
            if token_id is None:
                token_id = self.vocab.unk_id
            if token_id is not None:
                out.append(token_id)
        return out


def _known(token_id: int | None) -> int:
    assert token_id is not None  # Vocab refuses add_bos / add_eos without the id
    return token_id


def read_text(text: str) -> str:
    """``text`` as ``Tokenizer.encode`` reads it: a lone surrogate, which has no UTF-8,
    becomes U+FFFD, as invalid UTF-8 does in llama.cpp's pre-tokenizer (a text that
    quotes a prompt back, such as a completion's echo, is this one)."""
    if _has_surrogate(text):
        return _SURROGATE.sub("\ufffd", text)
    return text


def _has_surrogate(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False


def _token_bytes(text: str) -> bytes:
    """A token's text as the file holds it: bytes that are not UTF-8 were kept as lone
    surrogates (``GgufHeader.strings(keep_bytes=True)``)."""
    return text.encode("utf-8", "surrogateescape")


def _text_tokens(ids: Mapping[str, int]) -> dict[str, int]:
    """The tokens a text can merge into: those whose bytes are UTF-8 (a token of other
    bytes is never the text of a character string, nor can the tokenizers package take
    it); each of them still decodes to its bytes."""
    return {text: i for text, i in ids.items() if not _has_surrogate(text)}


def _unmap_bytes(text: str) -> bytes:
    """A byte-level token's bytes. A character that stands for no byte comes out as
    llama.cpp writes it: ``[UNK_BYTE_0x`` + its UTF-8 in hex + the token + ``]``."""
    out = bytearray()
    for c in text:
        b = _CHAR_BYTES.get(c)
        if b is not None:
            out.append(b)
        else:
            out += b"[UNK_BYTE_0x%s%s]" % (_token_bytes(c).hex().encode(), _token_bytes(text))
    return bytes(out)


def clean_up_spaces(text: str) -> str:
    """``text`` cleaned up as ``Tokenizer.decode`` cleans up the text of a vocabulary
    that cleans up spaces (``_clean_spaces``)."""
    return _clean_spaces(bytearray(text.encode("utf-8", "surrogatepass"))).decode(
        "utf-8", "surrogatepass"
    )


def _clean_spaces(buf: bytearray) -> bytes:
    """llama.cpp's ``clean_up_tokenization_spaces``: three passes over the bytes,
    each rewriting the buffer in place.

    1. a space before ``?``, ``!``, ``.`` or ``,`` goes;
    2. `` ' `` (an apostrophe between two spaces) loses both spaces;
    3. a space before ``'s``, ``'m``, ``'re`` or ``'ve`` goes.
    """
    n = _compact(buf, _space_before_punctuation)
    n = _compact(buf, _lone_apostrophe, n)
    n = _compact(buf, _space_before_contraction, n)
    return bytes(buf[:n])


_SP = ord(" ")
_APOS = ord("'")


def _compact(buf: bytearray, rule: Any, n: int | None = None) -> int:
    """Run one pass: keep ``buf[0]``, then for each later byte let ``rule`` decide
    whether the byte written last is taken back, then write the byte. Returns the
    new length. ``rule(buf, i, n)`` returns (take back?, index to continue from)."""
    n = len(buf) if n is None else n
    if n == 0:
        return 0
    w = 1
    i = 1
    while i < n:
        x = buf[i]
        take_back, i = rule(buf, i, n)
        if take_back:
            w -= 1
        buf[w] = x
        w += 1
        i += 1
    return w


def _space_before_punctuation(buf: bytearray, i: int, n: int) -> tuple[bool, int]:
    return buf[i - 1] == _SP and buf[i] in b"?!.,", i


def _lone_apostrophe(buf: bytearray, i: int, n: int) -> tuple[bool, int]:
    if buf[i] == _APOS and i + 1 < n and buf[i - 1] == _SP and buf[i + 1] == _SP:
        buf[i + 1] = 0  # the following space is skipped (and zeroed, as llama.cpp does)
        return True, i + 1
    return False, i


def _space_before_contraction(buf: bytearray, i: int, n: int) -> tuple[bool, int]:
    if buf[i - 1] != _SP or buf[i] != _APOS or i + 1 >= n:
        return False, i
    x1 = buf[i + 1]
    if x1 in b"sm":
        return True, i
    if x1 in b"td" or i + 2 >= n:
        return False, i
    return (x1, buf[i + 2]) in ((ord("r"), ord("e")), (ord("v"), ord("e"))), i


def _byte_of(text: str) -> int:
    """The byte a token typed BYTE stands for: the hexadecimal number of its text's
    fourth and fifth bytes in UTF-8 (``<0x41>``: 0x41), read as llama.cpp reads them
    (``strtol`` of those two bytes, base 16, cast to a byte: the hex digits they begin
    with, after blanks and a sign; 0 where none), so a file whose BYTE tokens are not
    ``<0xXX>`` decodes as llama.cpp decodes it rather than failing mid-run."""
    digits = _token_bytes(text)[3:5].decode(errors="replace").lstrip(" \t\n\v\f\r")
    negative = digits[:1] == "-"
    digits = digits[1:] if digits[:1] in ("-", "+") else digits
    hex_digits = len(digits) - len(digits.lstrip("0123456789abcdefABCDEF"))
    value = int(digits[:hex_digits], 16) if hex_digits else 0
    return (-value if negative else value) & 0xFF
