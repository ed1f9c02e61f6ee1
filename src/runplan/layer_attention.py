"""What each block's attention sees, as the GGUF header sets it: how many past
positions (a sliding window, or all of them) and the base of its rotary embedding.

Read the way llama.cpp reads them (``llama-model.cpp``, ``models/gemma3.cpp``,
``llama-hparams.cpp``). Only some architectures run sliding-window attention
(``SLIDING_WINDOW_PERIODS``); others ignore the keys (phi3 files carry
``attention.sliding_window`` and llama.cpp runs them with full attention):

- ``{arch}.attention.sliding_window`` > 0 turns it on: the window, in positions. A
  sliding block at position ``p`` attends to positions ``p - window + 1 .. p``.
- ``{arch}.attention.sliding_window_pattern`` says which blocks slide: an array of
  booleans, one per block, or a period ``n`` (block ``i`` slides when
  ``i % n < n - 1``, so every ``n``-th block is global; ``0``: every block slides).
  Without the key, the architecture's own period (llama.cpp's: 6 for gemma3).
- A global block rotates with ``{arch}.rope.freq_base`` and a sliding one with
  ``{arch}.rope.freq_base_swa``; each defaults to 10000.

The planner counts a sliding block's KV cache at its window (``ModelFacts``), and the
workers read the same layout through ``runtime_core.model_config``: one reading of
the header for both.
"""

from __future__ import annotations

from collections.abc import Mapping

from attrs import frozen
from gguf import GGUFValueType

from runplan.gguf_header import GgufError, GgufHeader

#: Architectures whose sliding-window attention llama.cpp runs, with the period of
#: their global blocks when the file has no ``attention.sliding_window_pattern``.
SLIDING_WINDOW_PERIODS: Mapping[str, int] = {"gemma3": 6}

#: llama.cpp's rotary base when a file names none (``rope.freq_base``, and for
#: sliding blocks ``rope.freq_base_swa``).
DEFAULT_ROPE_FREQ_BASE = 10000.0


@frozen
class LayerAttention:
    """One block's attention."""

    window: int  # positions it attends to, its own included; 0: all of them (global)
    rope_freq_base: float

    @property
    def sliding(self) -> bool:
        return self.window > 0


def layer_attention(header: GgufHeader, arch: str, n_layers: int) -> tuple[LayerAttention, ...]:
    """Every block's attention, in block order. ``GgufError`` for a key of the wrong
    type, a rotary base that is not positive, a negative window, or a pattern whose
    length is not the block count."""
    base = _rope_freq_base(header, f"{arch}.rope.freq_base")
    sliding = _sliding_blocks(header, arch, n_layers)
    if not any(sliding):
        return (LayerAttention(0, base),) * n_layers
    window = header.integer(f"{arch}.attention.sliding_window")
    base_swa = _rope_freq_base(header, f"{arch}.rope.freq_base_swa")
    return tuple(
        LayerAttention(window, base_swa) if s else LayerAttention(0, base) for s in sliding
    )


def _rope_freq_base(header: GgufHeader, key: str) -> float:
    """A rotary base: positive (``freq_base ** (-2i / n)`` of 0 is infinite, of a
    negative base NaN, and every logit with it)."""
    base = number(header, key, DEFAULT_ROPE_FREQ_BASE)
    if base <= 0.0:
        raise GgufError(header.paths[0], f"a rotary base of {base}: it must be positive", key)
    return base


def _sliding_blocks(header: GgufHeader, arch: str, n_layers: int) -> tuple[bool, ...]:
    period = SLIDING_WINDOW_PERIODS.get(arch)
    window_key = f"{arch}.attention.sliding_window"
    if period is None or not header.has(window_key):
        return (False,) * n_layers
    window = header.integer(window_key)
    if window < 0:
        raise GgufError(header.paths[0], f"a sliding window of {window} positions", window_key)
    if window == 0:
        return (False,) * n_layers
    key = f"{arch}.attention.sliding_window_pattern"
    if header.has(key) and header.value_type(key) == GGUFValueType.ARRAY:
        flags = tuple(bool(x) for x in header.array(key))
        if len(flags) != n_layers:
            raise GgufError(header.paths[0], f"{len(flags)} flags for {n_layers} blocks", key)
        return flags
    period = header.integer(key, default=period)
    if period < 0:
        raise GgufError(header.paths[0], f"a period of {period} blocks", key)
    return tuple(period == 0 or i % period < period - 1 for i in range(n_layers))


def number(header: GgufHeader, key: str, default: float | None = None) -> float:
    """A numeric key as a float (``default`` when absent; ``GgufError`` when absent
    without one, not a number, or not finite): ``GgufHeader.number``."""
    return header.number(key, default)
