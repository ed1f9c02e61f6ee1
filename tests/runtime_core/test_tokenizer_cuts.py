"""The cuts of SentencePiece tokens into parts that are tokens (``token_cuts``): the
same as trying every cut of every token, found from the tokens sorted."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from runtime_core.tokenizer_cuts import token_cuts


def _every_cut(tokens: list[str]) -> list[tuple[str, int, str, str]]:
    vocab = set(tokens)
    return [
        (text, cut, text[:cut], text[cut:])
        for text in tokens
        for cut in range(1, len(text))
        if (cut == 1 or text[:cut] in vocab) and (cut == len(text) - 1 or text[cut:] in vocab)
    ]


@given(st.lists(st.text(alphabet="ab\u2581\u00fc\U0001f600", min_size=1, max_size=9), unique=True))
def test_the_cuts_are_every_cut_whose_parts_are_tokens_or_characters(tokens: list[str]) -> None:
    found = list(token_cuts(tokens))
    assert found == _every_cut(tokens)
    own = {text: text for text in tokens}
    for _, _, left, right in found:  # a part that is a token is the token's own string
        assert left not in own or left is own[left]
        assert right not in own or right is own[right]


def test_nested_tokens_cut_at_every_token_boundary() -> None:
    tokens = ["a", "aa", "aaa", "b", "aab", "ab"]
    assert list(token_cuts(tokens)) == [
        ("aa", 1, "a", "a"),
        ("aaa", 1, "a", "aa"),
        ("aaa", 2, "aa", "a"),
        ("aab", 1, "a", "ab"),
        ("aab", 2, "aa", "b"),
        ("ab", 1, "a", "b"),
    ]
