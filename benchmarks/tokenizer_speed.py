"""Tokenizer speed on SmolLM2-135M: ``Tokenizer.from_gguf``, and ``encode`` /
``decode`` of about 4 KB of mixed text.

    python benchmarks/tokenizer_speed.py [--repeat N] [--json]

Targets (issue 4): loading well under a second; encoding a few KB in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from runplan.models import resolve_model
from runtime_core.tokenizer import Tokenizer

# About 4 KB: prose, code, numbers, other scripts, emoji and chat markup.
_PARAGRAPH = (
    "Pipeline-parallel inference splits the layers of one model into stages; each "
    "stage runs on its own node and passes activations to the next. It's fast, isn't "
    "it? 12345 tokens/s at 3.5 GB.\n"
    "def forward(tokens: list[int], pos: int) -> None:\n    x = embed[tokens]\n"
    "    for layer in layers:\n        x = layer(x, pos)\n\n"
    "Grüße aus Zürich — 快速的棕色狐狸 — Быстрая лиса 😀👍🏽\n"
    "<|im_start|>user\nHello!<|im_end|>\n"
)
TEXT = (_PARAGRAPH * (4096 // len(_PARAGRAPH.encode()) + 1))[:4096]


def _median_ms(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    fn()  # warm up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    path = resolve_model("smollm2-135m")
    tok = Tokenizer.from_gguf(path)
    ids = tok.encode(TEXT)
    figures = {
        "from_gguf_ms": _median_ms(lambda: Tokenizer.from_gguf(path), args.repeat),
        "encode_ms": _median_ms(lambda: tok.encode(TEXT), args.repeat * 10),
        "decode_ms": _median_ms(lambda: tok.decode(ids), args.repeat * 10),
    }
    if args.json:
        result = {k: {"median": m, "min": lo} for k, (m, lo) in figures.items()}
        print(json.dumps({**result, "text_bytes": len(TEXT.encode()), "tokens": len(ids)}))
        return
    print(f"SmolLM2-135M, {len(TEXT.encode())} bytes of text -> {len(ids)} tokens")
    for name, (median, low) in figures.items():
        print(f"  {name:14} median {median:8.2f} ms   min {low:8.2f} ms")


if __name__ == "__main__":
    main()
