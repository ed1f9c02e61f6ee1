"""The cuts of a SentencePiece vocabulary's tokens into two parts that are tokens.

A SentencePiece vocabulary merges two adjacent symbols while their concatenation is
a token (``runtime_core.tokenizer`` builds it as a BPE whose merges are those cuts).
``token_cuts`` finds, for every token, each cut whose left part is a token or one
character and whose right part is a token or one character, without trying every
cut: the tokens a token begins with are found by sorting the tokens (they sort right
before it, each beginning the next), those it ends with by sorting them reversed.
Each token keeps only the longest of each (a chain to follow), so the time is the
sort's and the tokens' total length, and the memory the tokens'; a part is never
copied out of its token (a part that is a token is that token's own string). Trying
each token's cuts at every token length, each cut copied and hashed, took time cubic
in the number of distinct lengths.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator


def token_cuts(tokens: Collection[str]) -> Iterator[tuple[str, int, str, str]]:
    """``(token, cut, left, right)`` for every cut of each of ``tokens`` (in their
    order) into ``left = token[:cut]`` and ``right = token[cut:]``, each part a token
    (then the token's own string) or a single character; a token's cuts in increasing
    order."""
    begins = _longest_shorter_token_at_start(tokens)
    reversed_tokens = {text[::-1]: text for text in tokens}
    ends = {
        reversed_tokens[backward]: reversed_tokens[part]
        for backward, part in _longest_shorter_token_at_start(reversed_tokens).items()
    }
    for text in tokens:
        n = len(text)
        if n < 2:
            continue
        left = {len(part): part for part in _chain(begins, text)}  # cut -> left part
        right = {n - len(part): part for part in _chain(ends, text)}  # cut -> right part
        left.setdefault(1, text[0])
        right.setdefault(n - 1, text[-1])
        small, large = (left, right) if len(left) <= len(right) else (right, left)
        for cut in sorted(c for c in small if c in large):
            yield text, cut, left[cut], right[cut]


def _chain(longest: dict[str, str], text: str) -> Iterator[str]:
    """The shorter tokens ``text`` begins (or ends) with, longest first."""
    part = longest.get(text)
    while part is not None:
        yield part
        part = longest.get(part)


def _longest_shorter_token_at_start(tokens: Collection[str]) -> dict[str, str]:
    """For each token that begins with a shorter token: the longest such token."""
    out: dict[str, str] = {}
    chain: list[str] = []  # each token in it begins the next: the last one's own chain
    for text in sorted(tokens):
        while chain and not text.startswith(chain[-1]):
            chain.pop()
        if chain:
            out[text] = chain[-1]
        chain.append(text)
    return out
