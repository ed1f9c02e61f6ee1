"""Write a random-weight llama / qwen2 GGUF of any shape, in any type the workers run.

Blocks are built directly (``random_blocks``): valid, with weights of standard
deviation ``1 / sqrt(n_in)``, so activations stay finite through many blocks. Tensors
are generated and written one at a time, so a model with Llama-3-8B shapes (about
4.7 GB in Q4_0) is written in well under a minute with little memory.
``benchmarks/gpu_decode.py`` writes its 8B-shape models with it; tests write small ones.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import numpy as np
import numpy.typing as npt
from gguf import GGMLQuantizationType, GGUFWriter

from runplan.quant_types import row_bytes
from tests.support.random_blocks import random_rows


@attrs.frozen
class RandomModel:
    arch: str = "llama"
    n_layers: int = 2
    hidden: int = 256
    heads: int = 4
    heads_kv: int = 2
    ffn: int = 512
    vocab: int = 512
    context_length: int = 4096
    qtype: str = "Q4_0"  # the block matrices
    embed_qtype: str | None = None  # token_embd (default: qtype)
    head_qtype: str | None = None  # output.weight (default: qtype); ignored when tied
    tied: bool = False
    rope_freq_base: float = 10000.0
    rms_eps: float = 1e-5
    seed: int = 0
    overrides: tuple[tuple[str, str], ...] = ()  # (tensor name, type)


#: Llama-3-8B's shapes (vocabulary, widths, heads, rotary base), untied head.
LLAMA3_8B = RandomModel(
    arch="llama",
    n_layers=32,
    hidden=4096,
    heads=32,
    heads_kv=8,
    ffn=14336,
    vocab=128256,
    context_length=8192,
    rope_freq_base=500000.0,
)


def _tensors(m: RandomModel) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, NumPy shape (rows, n_in) or (n,), type) in file order."""
    hd = m.hidden // m.heads
    overrides = dict(m.overrides)

    def t(name: str, default: str) -> str:
        return overrides.get(name, default)

    yield "token_embd.weight", (m.vocab, m.hidden), t("token_embd.weight", m.embed_qtype or m.qtype)
    for i in range(m.n_layers):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", (m.hidden,), "F32"
        for name, rows in (("attn_q", m.heads * hd), ("attn_k", m.heads_kv * hd),
                           ("attn_v", m.heads_kv * hd)):  # fmt: skip
            yield p + name + ".weight", (rows, m.hidden), t(p + name + ".weight", m.qtype)
            if m.arch == "qwen2":
                yield p + name + ".bias", (rows,), "F32"
        yield (
            p + "attn_output.weight",
            (m.hidden, m.heads * hd),
            t(p + "attn_output.weight", m.qtype),
        )
        yield p + "ffn_norm.weight", (m.hidden,), "F32"
        yield p + "ffn_gate.weight", (m.ffn, m.hidden), t(p + "ffn_gate.weight", m.qtype)
        yield p + "ffn_up.weight", (m.ffn, m.hidden), t(p + "ffn_up.weight", m.qtype)
        yield p + "ffn_down.weight", (m.hidden, m.ffn), t(p + "ffn_down.weight", m.qtype)
    yield "output_norm.weight", (m.hidden,), "F32"
    if not m.tied:
        yield "output.weight", (m.vocab, m.hidden), t("output.weight", m.head_qtype or m.qtype)


def _data(
    rng: np.random.Generator, name: str, shape: tuple[int, ...], qtype: str
) -> npt.NDArray[np.uint8] | npt.NDArray[np.float32]:
    if len(shape) == 1:
        if name.endswith(".bias"):
            return (0.1 * rng.standard_normal(shape)).astype(np.float32)
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    rows, n = shape
    chunk = max(1, (1 << 26) // max(1, row_bytes(qtype, n)))  # about 64 MB at a time
    parts = [
        random_rows(rng, qtype, min(chunk, rows - r0), n, scale=1.0 / np.sqrt(n))
        for r0 in range(0, rows, chunk)
    ]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def write_random_model(
    path: str | os.PathLike[str],
    model: RandomModel,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write ``model`` to ``path`` (replacing it) and return the path."""
    path = Path(path)
    m = model
    rng = np.random.default_rng(m.seed)
    writer = GGUFWriter(path, m.arch)
    writer.add_name(f"random-{m.arch}-{m.qtype}")
    writer.add_block_count(m.n_layers)
    writer.add_context_length(m.context_length)
    writer.add_embedding_length(m.hidden)
    writer.add_feed_forward_length(m.ffn)
    writer.add_head_count(m.heads)
    writer.add_head_count_kv(m.heads_kv)
    writer.add_rope_freq_base(m.rope_freq_base)
    writer.add_rope_dimension_count(m.hidden // m.heads)
    writer.add_layer_norm_rms_eps(m.rms_eps)
    writer.add_vocab_size(m.vocab)
    writer.add_eos_token_id(m.vocab - 1)
    writer.add_bos_token_id(0)
    specs = list(_tensors(m))
    for name, shape, qtype in specs:
        if len(shape) == 1:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
        else:
            rows, n = shape
            nbytes = rows * row_bytes(qtype, n)
            if qtype == "F32":
                writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
            elif qtype == "F16":
                writer.add_tensor_info(name, shape, np.dtype(np.float16), nbytes)
            else:
                byte_shape = (rows, row_bytes(qtype, n))
                writer.add_tensor_info(
                    name, byte_shape, np.dtype(np.uint8), nbytes, GGMLQuantizationType[qtype]
                )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, shape, qtype in specs:
        data = _data(rng, name, shape, qtype)
        writer.write_tensor_data(data)
        if progress is not None:
            progress(name)
    writer.close()
    return path
