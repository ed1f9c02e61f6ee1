"""What the runtimes' command lines share: token ids as an argument, and generated text
streamed as tokens arrive."""

from __future__ import annotations

import argparse
from typing import TextIO

from runtime_core.tokenizer import Tokenizer


def token_ids(text: str) -> list[int]:
    """An ``argparse`` type: ``1,2,3`` as a list of non-negative ids."""
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad token ids {text!r}: write 1,2,3") from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError("token ids are non-negative integers, at least one")
    return ids


class TextStream:
    """Prints generated text as tokens arrive: the new part of the decoded text. The
    end of the text is held back while it may still change: an incomplete UTF-8
    sequence (U+FFFD) and trailing whitespace, which a detokenizer that cleans up
    spaces may drop once punctuation follows."""

    def __init__(self, tokenizer: Tokenizer, out: TextIO) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.ids: list[int] = []
        self.shown = ""

    def __call__(self, token_id: int) -> None:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids).rstrip("\ufffd").rstrip()
        if text.startswith(self.shown) and len(text) > len(self.shown):
            self.out.write(text[len(self.shown) :])
            self.out.flush()
            self.shown = text

    def finish(self, text: str) -> None:
        """Write the rest of the final ``text`` and a newline."""
        if text.startswith(self.shown):
            self.out.write(text[len(self.shown) :] + "\n")
        else:  # a character already printed changed after all: print the whole text again
            self.out.write("\n" + text + "\n")
        self.out.flush()
