"""What each block's attention sees, as the GGUF header sets it: how many past
positions (a sliding window, or all of them) and the base of its rotary embedding.

Read the way llama.cpp reads them (``llama-model.cpp``, ``models/gemma{2,3}.cpp``,
``llama-hparams.cpp``). Only some architectures run sliding-window attention
(``SLIDING_WINDOWS``); others ignore the keys (phi3 files carry
``attention.sliding_window`` and llama.cpp runs them with full attention):

- ``{arch}.attention.sliding_window`` > 0 turns it on: the window, in positions. A
  sliding block at position ``p`` attends to positions ``p - window + 1 .. p``.
  Without the key, the architecture's default (gemma2: 4096; gemma3: none, no block
  slides).
- ``{arch}.attention.sliding_window_pattern`` says which blocks slide: an array of
  booleans, one per block, or a period ``n`` (block ``i`` slides when
  ``i % n < n - 1``, so every ``n``-th block is global; ``0``: every block slides).
  Without the key, the architecture's own period (llama.cpp's: 6 for gemma3, 2 for
  gemma2).
- A global block rotates with ``{arch}.rope.freq_base`` and a sliding one with
  ``{arch}.rope.freq_base_swa``; the first defaults to 10000, the second to 10000
  (gemma3) or the global base (gemma2).

The planner counts a sliding block's KV cache at its window (``ModelFacts``), and the
workers read the same layout through ``runtime_core.model_config``: one reading of
the header for both.
"""

from __future__ import annotations

from collections.abc import Mapping

from attrs import frozen
from gguf import GGUFValueType

from runplan.gguf_error import GgufError
from runplan.gguf_header import F32_MAX, GgufHeader
from runplan.validate import U32_MAX


@frozen
class SlidingRule:
    """An architecture's defaults for the keys a file may leave out."""

    period: int  # every period-th block is global (no ``sliding_window_pattern``)
    window: int  # positions, without ``attention.sliding_window`` (0: no block slides)
    swa_base_is_global: bool  # no ``rope.freq_base_swa``: the global base (else 10000)
    swa_unscaled: bool  # sliding blocks rotate without ``rope.scaling`` (else with it)


#: Architectures whose sliding-window attention llama.cpp runs, with their defaults.
SLIDING_WINDOWS: Mapping[str, SlidingRule] = {
    "gemma3": SlidingRule(period=6, window=0, swa_base_is_global=False, swa_unscaled=True),
    "gemma2": SlidingRule(period=2, window=4096, swa_base_is_global=True, swa_unscaled=False),
}

#: llama.cpp's rotary base when a file names none (``rope.freq_base``, and for
#: sliding blocks ``rope.freq_base_swa``).
DEFAULT_ROPE_FREQ_BASE = 10000.0
#: the smallest rotary base whose angles (a position, below 2**32, over the base) stay
#: within float32's range
MIN_ROPE_FREQ_BASE = 2.0**32 / F32_MAX


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
    rule = SLIDING_WINDOWS[arch]
    window = sliding_window(header, f"{arch}.attention.sliding_window", rule.window)
    swa_default = base if rule.swa_base_is_global else DEFAULT_ROPE_FREQ_BASE
    base_swa = _rope_freq_base(header, f"{arch}.rope.freq_base_swa", swa_default)
    return tuple(
        LayerAttention(window, base_swa) if s else LayerAttention(0, base) for s in sliding
    )


def _rope_freq_base(header: GgufHeader, key: str, default: float = DEFAULT_ROPE_FREQ_BASE) -> float:
    """A rotary base: positive (``freq_base ** (-2i / n)`` of 0 is infinite, of a
    negative base NaN, and every logit with it), and not so small that a position's
    angle (up to ``position / base``, positions below 2**32) passes float32's largest."""
    base = number(header, key, default)
    if base <= 0.0:
        raise GgufError(header.paths[0], f"a rotary base of {base}: it must be positive", key)
    if base < MIN_ROPE_FREQ_BASE:
        raise GgufError(
            header.paths[0],
            f"a rotary base of {base}: below {MIN_ROPE_FREQ_BASE:.3g}, a position's angle "
            "passes float32's range",
            key,
        )
    return base


def _sliding_blocks(header: GgufHeader, arch: str, n_layers: int) -> tuple[bool, ...]:
    rule = SLIDING_WINDOWS.get(arch)
    window_key = f"{arch}.attention.sliding_window"
    if rule is None:
        return (False,) * n_layers
    window = sliding_window(header, window_key, rule.window)
    if window == 0:
        return (False,) * n_layers
    key = f"{arch}.attention.sliding_window_pattern"
    if header.has(key) and header.value_type(key) == GGUFValueType.ARRAY:
        flags = tuple(bool(x) for x in header.array(key))
        if len(flags) != n_layers:
            raise GgufError(header.paths[0], f"{len(flags)} flags for {n_layers} blocks", key)
        return flags
    period = header.integer(key, default=rule.period)
    if period < 0:
        raise GgufError(header.paths[0], f"a period of {period} blocks", key)
    return tuple(period == 0 or i % period < period - 1 for i in range(n_layers))


def sliding_window(header: GgufHeader, key: str, default: int) -> int:
    """A sliding window's positions: 0 (none) .. 2**32 - 1, as llama.cpp's ``uint32_t``
    ``n_swa`` holds it (a larger one reached the kernels as an integer they cannot take);
    else ``GgufError`` naming the key and the value."""
    window = header.integer(key, default=default)
    if not 0 <= window <= U32_MAX:
        raise GgufError(
            header.paths[0], f"a sliding window of {window} positions: not 0..{U32_MAX}", key
        )
    return window


def number(header: GgufHeader, key: str, default: float | None = None) -> float:
    """A numeric key as a float (``default`` when absent; ``GgufError`` when absent
    without one, not a number, or not finite): ``GgufHeader.number``."""
    return header.number(key, default)
