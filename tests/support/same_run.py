"""Two GGUF files that must run alike: the simulator's run of each, the same prompt."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import runtime_sim


def assert_same_run(want_file: str, got_file: str, prompt: Sequence[int], max_tokens: int) -> None:
    """``got_file`` completes ``prompt`` with the tokens and the very logits of
    ``want_file`` (the reference worker of the simulator, one process)."""
    want = runtime_sim.generate(want_file, list(prompt), max_tokens=max_tokens, return_logits=True)
    got = runtime_sim.generate(got_file, list(prompt), max_tokens=max_tokens, return_logits=True)
    assert got.outcome == want.outcome == "completed", (got.fault, want.fault)
    assert got.tokens == want.tokens
    assert got.logits is not None and want.logits is not None
    for mine, theirs in zip(got.logits, want.logits, strict=True):
        np.testing.assert_array_equal(mine, theirs)
