"""``serve.logprobs.token_logprob`` against a log-softmax computed apart
(``np.logaddexp.reduce`` in float64) and a full sort: the token's log probability, the
``top`` most likely tokens in order, the lower id first on a tie, ties at the cut
included by id; more alternatives asked than the vocabulary holds gives them all."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from runtime_core.tokenizer import Tokenizer
from runtime_cupy.serve.logprobs import TokenLogprob, completion_logprobs, token_logprob
from tests.fixtures.gguf_vocab import SPECS, write_vocab


def _expected(z: np.ndarray, top: int) -> list[tuple[int, float]]:
    lp = z.astype(np.float64) - np.logaddexp.reduce(z.astype(np.float64))
    order = sorted(range(z.size), key=lambda i: (-float(z[i]), i))[:top]
    return [(i, float(lp[i])) for i in order]


@pytest.mark.parametrize("size", [1, 3, 20, 1000, 49152])
@pytest.mark.parametrize("top", [0, 1, 5, 20])
def test_the_token_and_its_alternatives_are_the_log_softmax_in_order(size: int, top: int) -> None:
    rng = np.random.default_rng(size * 31 + top)
    z = (rng.standard_normal(size) * 4).astype(np.float32)
    token = int(rng.integers(size))
    got = token_logprob(z, token, top)
    want = _expected(z, size)
    assert got.token_id == token
    assert got.logprob == pytest.approx(dict(want)[token], abs=1e-9)
    assert [i for i, _ in got.top] == [i for i, _ in want[:top]]
    assert [lp for _, lp in got.top] == pytest.approx([lp for _, lp in want[:top]], abs=1e-9)


def test_ties_go_to_the_lower_ids_at_the_cut_and_within() -> None:
    z = np.zeros(12, np.float32)
    z[[9, 2, 5, 11]] = 3.0  # four equal best, two of them kept
    z[7] = 5.0
    got = token_logprob(z, 11, 3)
    assert [i for i, _ in got.top] == [7, 2, 5]
    assert got.top[1][1] == got.top[2][1] == got.logprob


def test_a_completions_text_offsets_count_the_characters_decoded_before_each_token(
    smollm2_path: str,
) -> None:
    """Emoji are byte tokens in SmolLM2's vocabulary: a token that ends inside a
    character does not move the offset, and each offset is where its token's text
    begins, counted apart from the tokenizer (the tokens' bytes decoded by Python,
    an incomplete character at the end left out). Offsets once added each token's
    own decoding, U+FFFD for a piece of a character, and ran past the text."""
    from runtime_core.tokenizer import Tokenizer
    from runtime_cupy.serve.logprobs import AnswerLogprobs, completion_logprobs
    from runtime_cupy.serve.text import Answer

    tokenizer = Tokenizer.from_gguf(smollm2_path)
    ids = tokenizer.encode("Hi 🎉🎉 and ü!", add_special=False)
    pieces = [tokenizer.token_bytes(i, special=True) for i in ids]
    assert any(
        len(p.decode("utf-8", "replace")) != len(p.decode("utf-8", "ignore")) for p in pieces
    )
    answer, entries = Answer(tokenizer, ()), AnswerLogprobs(1)
    for token_id in ids:  # as the engine takes each token
        entries.logits(np.zeros(tokenizer.n_vocab, np.float32))
        entries.token(token_id, answer.text.chars)
        answer.push(token_id)
    want = [len(b"".join(pieces[:i]).decode("utf-8", "ignore")) for i in range(len(ids))]
    assert [e.offset for e in entries.entries] == want
    assert completion_logprobs(tokenizer, entries.entries)["text_offset"] == want
    assert want == sorted(want) and want[-1] < len("Hi 🎉🎉 and ü!")


def test_tokens_of_part_of_a_character_are_named_by_their_bytes(smollm2_path: str) -> None:
    """Byte tokens of an emoji's first bytes all read U+FFFD: a completion's
    ``top_logprobs``, keyed by text, kept one of them (the least likely one's value)
    and showed fewer alternatives than asked. They are named by their bytes, as
    OpenAI names them (``bytes:\\xf0\\x9f``), in ``tokens``, the keys and chat's
    ``token``."""
    from runtime_core.tokenizer import Tokenizer
    from runtime_cupy.serve.logprobs import TokenLogprob, chat_logprobs, completion_logprobs

    tokenizer = Tokenizer.from_gguf(smollm2_path)
    ids = tokenizer.encode("🎉😀", add_special=False)
    partial = sorted({i for i in ids if b"\xef\xbf\xbd" in _replaced(tokenizer, i)})[:2]
    assert len(partial) == 2
    (other,) = tokenizer.encode(" the", add_special=False)
    top = ((partial[0], -0.5), (other, -1.0), (partial[1], -4.0))
    entry = TokenLogprob(partial[0], -0.5, top)
    names = ["bytes:" + "".join(f"\\x{b:02x}" for b in tokenizer.token_bytes(i)) for i in partial]
    out = completion_logprobs(tokenizer, [entry])
    assert out["tokens"] == [names[0]]
    assert out["top_logprobs"] == [{names[0]: -0.5, " the": -1.0, names[1]: -4.0}]
    (chat,) = chat_logprobs(tokenizer, [entry])["content"]
    assert chat["token"] == names[0] and chat["bytes"] == list(tokenizer.token_bytes(partial[0]))
    assert [t["token"] for t in chat["top_logprobs"]] == [names[0], " the", names[1]]


def _replaced(tokenizer: object, token_id: int) -> bytes:
    data: bytes = tokenizer.token_bytes(token_id)  # type: ignore[attr-defined]
    return data.decode("utf-8", "replace").encode()


def test_alternatives_of_the_same_bytes_keep_the_more_likely_value(tmp_path: Path) -> None:
    """On a SentencePiece vocabulary a byte has a ``<0xXX>`` token beside its normal
    token: the two share a name, and a completion's ``top_logprobs`` (keyed by name)
    kept the less likely one's value."""
    tok = Tokenizer.from_gguf(write_vocab(tmp_path / "spm.gguf", SPECS["spm-llama"]))
    normal, byte = tok.vocab.ids["a"], tok.vocab.ids["<0x61>"]
    assert tok.token_bytes(normal) == tok.token_bytes(byte) == b"a"
    entry = TokenLogprob(normal, -0.1, ((normal, -0.1), (byte, -3.0)))
    assert completion_logprobs(tok, [entry])["top_logprobs"] == [{"a": -0.1}]
    flipped = TokenLogprob(byte, -0.2, ((byte, -0.2), (normal, -2.0)))
    assert completion_logprobs(tok, [flipped])["top_logprobs"] == [{"a": -0.2}]
