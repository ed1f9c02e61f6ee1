"""One stage's slice of a GGUF model: exactly the tensors the stage owns.

A stage owns the tensors of its blocks ``blk.{i}.*`` for ``i`` in
``[layer_start, layer_end_exclusive)``, plus ``token_embd.weight`` on the first stage,
``output_norm.weight`` and the head on the last (``output.weight``, or
``token_embd.weight`` when the file has none: a tied head), plus the tensors every
stage needs (llama3's ``rope_freqs.weight``). ``open_stage_slice`` reads the header
(a split set reads as one file; of a shard manifest, only the shards holding the
stage's parts, ``runplan.shards``) and checks every owned tensor's presence, shape
and type before anything is loaded, so a bad file fails as a whole with a typed
error (``UnsupportedModel`` or ``GgufError``) and nothing half-loaded; an error about
a tensor names the file of the source that holds it (or, missing, should). Other stages'
tensors are never read or checked. Data is read through the file's memory map, one
tensor at a time, and dequantized with the gguf package.

Which tensors a block has, and their shapes, is the architecture's (``block_specs``,
from ``runtime_core.architectures``): per-head Q/K norms, post-norms, a fused
``attn_qkv`` (where the architecture allows it and the file has it) or ``ffn_up``,
biases required, optional or refused. A tensor a block may not have, or any other
tensor outside the blocks than the embedding, output norm, head, ``rope_freqs`` and
LongRoPE's factors where the architecture has them (llama.cpp refuses such files too),
is refused by name. A mixture of experts (``ModelConfig.n_experts``) has a router
(``ffn_gate_inp``) and its experts' matrices stacked (``ffn_{gate,up,down}_exps``, the
expert the slowest dimension) in place of the feed-forward matrices.

Shapes are llama.cpp's ``ne``: fastest-varying dimension first, so a matrix stored as
``(n_in, n_out)`` dequantizes to a NumPy ``(n_out, n_in)`` array (one row per output).
A stored shape matches the one the model implies as llama.cpp matches them, trailing
dimensions of size 1 aside (``ggml_shape``, on both sides: a mixture of one expert's
tensors end in a 1 a converter may drop or keep); the slice holds each tensor with the
model's shape.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator, Mapping

import attrs
import numpy as np
import numpy.typing as npt
from attrs import frozen
from gguf import GGMLQuantizationType, quants

from runplan import GgufSource, ProvisionStage, WorkerCapabilities
from runplan.gguf_facts import vocab_size
from runplan.gguf_header import GgufHeader
from runplan.gguf_tensors import TensorInfo, ggml_shape
from runplan.shards import SliceParts
from runtime_core.architectures import FfnLayout, Presence, QkvLayout
from runtime_core.errors import UnsupportedModel
from runtime_core.model_config import ModelConfig
from runtime_core.workers.interface import WorkerError

EMBEDDING = "token_embd.weight"
OUTPUT = "output.weight"
OUTPUT_NORM = "output_norm.weight"
ROPE_FREQS = "rope_freqs.weight"
ROPE_FACTORS_LONG = "rope_factors_long.weight"  # LongRoPE (phi3), each optional
ROPE_FACTORS_SHORT = "rope_factors_short.weight"


@frozen
class TensorSpec:
    shape: tuple[int, ...]  # llama.cpp order: fastest-varying dimension first
    required: bool


def qkv_layout(config: ModelConfig, layer: int, tensors: Mapping[str, TensorInfo]) -> QkvLayout:
    """The layout of block ``layer``'s attention projections: fused when the file has
    ``attn_qkv`` and the architecture allows it, else separate."""
    fused = f"blk.{layer}.attn_qkv.weight" in tensors
    if fused and QkvLayout.FUSED in config.spec.qkv_layouts:
        return QkvLayout.FUSED
    return QkvLayout.SEPARATE


def block_specs(
    config: ModelConfig, layer: int, qkv: QkvLayout = QkvLayout.SEPARATE
) -> dict[str, TensorSpec]:
    """The tensors block ``layer`` of the architecture may have, with the shapes the
    config implies (``architectures.ArchSpec`` says which)."""
    spec = config.spec
    h, f = config.hidden_dim, config.ffn_dims[layer]
    q, k, v = config.q_dim, config.k_dim, config.v_dim
    o = config.n_heads * config.head_dim_v
    bias = spec.qkv_bias
    out: dict[str, tuple[tuple[int, ...], Presence]] = {
        "attn_norm.weight": ((h,), Presence.REQUIRED),
        "attn_output.weight": ((o, h), Presence.REQUIRED),
        "attn_output.bias": ((h,), spec.output_bias),
        "ffn_norm.weight": ((h,), Presence.REQUIRED),
    }
    if qkv is QkvLayout.FUSED:
        out["attn_qkv.weight"] = ((h, q + k + v), Presence.REQUIRED)
        out["attn_qkv.bias"] = ((q + k + v,), bias)
    else:
        for name, width in (("attn_q", q), ("attn_k", k), ("attn_v", v)):
            out[f"{name}.weight"] = ((h, width), Presence.REQUIRED)
            out[f"{name}.bias"] = ((width,), bias)
    if config.n_experts:  # the router, then the experts' matrices stacked, expert last
        e = config.n_experts
        out["ffn_gate_inp.weight"] = ((h, e), Presence.REQUIRED)
        out["ffn_gate_exps.weight"] = ((h, f, e), Presence.REQUIRED)
        out["ffn_up_exps.weight"] = ((h, f, e), Presence.REQUIRED)
        out["ffn_down_exps.weight"] = ((f, h, e), Presence.REQUIRED)
        if fs := config.shared_ffn:  # qwen2moe's gated shared expert
            out["ffn_gate_inp_shexp.weight"] = ((h,), Presence.REQUIRED)
            out["ffn_gate_shexp.weight"] = ((h, fs), Presence.REQUIRED)
            out["ffn_up_shexp.weight"] = ((h, fs), Presence.REQUIRED)
            out["ffn_down_shexp.weight"] = ((fs, h), Presence.REQUIRED)
    elif spec.ffn is FfnLayout.FUSED:
        out["ffn_up.weight"] = ((h, 2 * f), Presence.REQUIRED)
    else:
        out["ffn_gate.weight"] = ((h, f), Presence.REQUIRED)
        out["ffn_up.weight"] = ((h, f), Presence.REQUIRED)
        out["ffn_gate.bias"] = ((f,), spec.ffn_bias)
        out["ffn_up.bias"] = ((f,), spec.ffn_bias)
    if not config.n_experts:
        out["ffn_down.weight"] = ((f, h), Presence.REQUIRED)
        out["ffn_down.bias"] = ((h,), spec.ffn_bias)
    if spec.qk_norm:
        out["attn_q_norm.weight"] = ((config.head_dim_k,), Presence.REQUIRED)
        out["attn_k_norm.weight"] = ((config.head_dim_k,), Presence.REQUIRED)
    if spec.post_norms:
        out["post_attention_norm.weight"] = ((h,), Presence.REQUIRED)
        out["post_ffw_norm.weight"] = ((h,), Presence.REQUIRED)
    return {
        f"blk.{layer}.{name}": TensorSpec(shape, presence is Presence.REQUIRED)
        for name, (shape, presence) in out.items()
        if presence is not Presence.ABSENT
    }


def dequantize_rows(raw: npt.NDArray[np.uint8], ggml_type: str) -> npt.NDArray[np.float32]:
    """Rows of raw GGML data (``(..., row_bytes)``) as an owned float32 array
    (``(..., row_elements)``), dequantized by the gguf package."""
    out = quants.dequantize(raw, GGMLQuantizationType[ggml_type])
    if np.shares_memory(out, raw):  # F32 comes back as a view of the file
        out = out.copy()
    return np.ascontiguousarray(out, dtype=np.float32)


@attrs.define
class StageSlice:
    """The checked tensors of one stage, read from the memory-mapped file on request.
    ``close()`` (or leaving a ``with`` block) drops the mapping."""

    path: str
    config: ModelConfig
    layer_start: int
    layer_end_exclusive: int
    is_first: bool
    is_last: bool
    vocab_size: int
    head: str | None  # the head tensor's name on the last stage
    #: exactly the tensors this stage owns, each with the shape the model gives it
    #: (``block_specs``'s, which the stored one equals up to trailing 1s: a mixture of
    #: one expert's ``ffn_gate_inp`` is ``(n_embd, 1)`` here, ``(n_embd,)`` in the header)
    tensors: Mapping[str, TensorInfo]
    _header: GgufHeader | None

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end_exclusive)

    @property
    def stored_bytes(self) -> int:
        """Bytes of the owned tensors as stored in the file."""
        return sum(info.n_bytes for info in self.tensors.values())

    def has(self, name: str) -> bool:
        return name in self.tensors

    def raw(self, name: str) -> npt.NDArray[np.uint8]:
        """The stored bytes of ``name`` as rows: ``(..., ne1, row_bytes)``, a view of the
        memory-mapped file (valid until ``close``)."""
        if self._header is None:
            raise ValueError(f"{self.path}: the slice is closed")
        info = self.tensors[name]  # KeyError for a tensor this stage does not own
        data = self._header.tensor_bytes(name)
        return data.reshape(*reversed(info.shape[1:]), -1)

    def dequantize(self, name: str) -> npt.NDArray[np.float32]:
        """``name`` as an owned float32 array of NumPy shape ``reversed(info.shape)``."""
        return dequantize_rows(self.raw(name), self.tensors[name].ggml_type)

    def close(self) -> None:
        self._header = None

    def __enter__(self) -> StageSlice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_stage_slice(
    source: GgufSource | str | os.PathLike[str],
    layer_start: int,
    layer_end_exclusive: int,
    *,
    is_first: bool,
    is_last: bool,
    capabilities: WorkerCapabilities | None = None,
) -> StageSlice:
    """Read the header of ``source`` and check the stage's tensors.

    Raises ``GgufError`` for a file that is not a readable GGUF model, and
    ``UnsupportedModel`` for an architecture, quant type or rope scaling outside
    ``capabilities`` (default: the NumPy reference worker's), or an owned tensor that
    is missing, has the wrong shape, or is not part of the architecture. Raises
    ``ValueError`` for a layer range outside the model.
    """
    caps = capabilities if capabilities is not None else WorkerCapabilities()
    path = source.paths[0] if isinstance(source, GgufSource) else os.fspath(source)
    # A shard manifest: only the shards holding this stage's parts are read.
    parts = SliceParts(layer_start, layer_end_exclusive, is_first, is_last)
    header = GgufHeader.read(path, parts)
    path = header.paths[0]
    config = ModelConfig.from_header(header, caps.architectures)
    if not 0 <= layer_start < layer_end_exclusive <= config.n_layers:
        raise ValueError(
            f"{path}: layers [{layer_start}, {layer_end_exclusive}) are not a range of "
            f"the model's {config.n_layers} blocks"
        )
    tensors = header.tensors
    vocab = vocab_size(header, config.architecture)
    _refuse_tensors_outside_the_model(header, config)
    specs: dict[str, TensorSpec] = {}
    for layer in range(layer_start, layer_end_exclusive):
        specs.update(block_specs(config, layer, qkv_layout(config, layer, tensors)))
        _refuse_unknown_block_tensors(header, config, layer, specs)
    h = config.hidden_dim
    head = None
    if is_first:
        specs[EMBEDDING] = TensorSpec((h, vocab), True)
    if is_last:
        if OUTPUT not in tensors and config.spec.head is Presence.REQUIRED:
            raise UnsupportedModel(
                header.path_for(OUTPUT),
                f"missing: the {config.architecture} architecture's head is a tensor of "
                "its own (llama.cpp takes no embedding in its place)",
                tensor=OUTPUT,
            )
        head = OUTPUT if OUTPUT in tensors else EMBEDDING
        specs[OUTPUT_NORM] = TensorSpec((h,), True)
        specs[head] = TensorSpec((h, vocab), True)
    if ROPE_FREQS in tensors:
        if not config.spec.rope_freqs:
            raise UnsupportedModel(
                header.path_for(ROPE_FREQS),
                f"not a tensor of the {config.architecture} architecture",
                tensor=ROPE_FREQS,
            )
        specs[ROPE_FREQS] = TensorSpec((config.rope.n_dims // 2,), True)
    for name in (ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT):
        if name in tensors:
            if not config.spec.longrope:
                raise UnsupportedModel(
                    header.path_for(name),
                    f"not a tensor of the {config.architecture} architecture",
                    tensor=name,
                )
            specs[name] = TensorSpec((config.rope.n_dims // 2,), True)

    owned: dict[str, TensorInfo] = {}
    for name, spec in specs.items():
        info = tensors.get(name)
        # the file that holds it (or should): of a split set or shards, not the first
        where = header.path_for(name)
        if info is None:
            if spec.required:
                raise UnsupportedModel(where, "a tensor the stage needs is missing", tensor=name)
            continue
        if info.shape != ggml_shape(spec.shape):  # llama.cpp's test: trailing 1s aside
            raise UnsupportedModel(
                where,
                f"shape {list(info.shape)} where the model's metadata implies {list(spec.shape)}",
                tensor=name,
            )
        if info.ggml_type not in caps.quant_types:
            raise UnsupportedModel(
                where,
                f"quant type {info.ggml_type} is not one the {caps.name} worker runs "
                f"({', '.join(caps.quant_types)})",
                tensor=name,
            )
        if len(info.shape) > 1 and info.shape[0] % caps.row_multiple:
            raise UnsupportedModel(
                where,
                f"rows of {info.shape[0]} elements: the {caps.name} worker reads a matrix's "
                f"rows {caps.row_multiple} elements at a time (its activations are made "
                f"8-bit in blocks of {caps.row_multiple})",
                tensor=name,
            )
        owned[name] = attrs.evolve(info, shape=spec.shape)
    return StageSlice(
        path=path,
        config=config,
        layer_start=layer_start,
        layer_end_exclusive=layer_end_exclusive,
        is_first=is_first,
        is_last=is_last,
        vocab_size=vocab,
        head=head,
        tensors=owned,
        header=header,
    )


def check_whole_model(
    source: GgufSource | str | os.PathLike[str],
    num_layers: int,
    capabilities: WorkerCapabilities,
) -> None:
    """Every stage's checks of ``open_stage_slice`` on the whole model at once (every
    block, the embedding and the head) for a worker of ``capabilities``: what a run's
    driver does before any process starts, so that a file no stage could run (a block
    key out of range, a tensor of the wrong shape, a quant type the worker lacks) is
    refused there with the same typed error, naming the key or tensor, and not as a
    stage's setup fault once the processes run. Reads headers only."""
    with open_stage_slice(
        source, 0, num_layers, is_first=True, is_last=True, capabilities=capabilities
    ):
        pass


def _block_tensor_names(layer: int, tensors: Mapping[str, TensorInfo]) -> Iterator[str]:
    prefix = f"blk.{layer}."
    return (name for name in tensors if name.startswith(prefix))


#: The tensors outside the blocks that a model of ours may have.
MODEL_TENSORS = (EMBEDDING, OUTPUT, OUTPUT_NORM, ROPE_FREQS, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT)


def _refuse_tensors_outside_the_model(header: GgufHeader, config: ModelConfig) -> None:
    """Refuse a tensor outside the blocks that is not one of ``MODEL_TENSORS`` (another
    variant's, such as an embedding norm, whose computation would be missing): llama.cpp
    refuses such a file too (its count of tensors); so is ``output.weight`` where the
    architecture's head is always the embedding (gemma, gemma2). Names only, so every
    stage refuses the same file. (A block past the block count is ``block_count``'s
    ``GgufError``.) Each refusal names the file that holds the tensor."""
    tensors = header.tensors
    if OUTPUT in tensors and config.spec.head is Presence.ABSENT:
        raise UnsupportedModel(
            header.path_for(OUTPUT),
            f"the {config.architecture} architecture's head is the embedding: llama.cpp "
            "loads no output tensor for it",
            tensor=OUTPUT,
        )
    for name in tensors:
        if not name.startswith("blk.") and name not in MODEL_TENSORS:
            raise UnsupportedModel(
                header.path_for(name),
                f"not a tensor of the {config.architecture} architecture as this worker runs it",
                tensor=name,
            )


def _refuse_unknown_block_tensors(
    header: GgufHeader, config: ModelConfig, layer: int, specs: Mapping[str, TensorSpec]
) -> None:
    for name in _block_tensor_names(layer, header.tensors):
        if name not in specs:
            raise UnsupportedModel(
                header.path_for(name),
                f"not a tensor of the {config.architecture} architecture as this worker runs it",
                tensor=name,
            )


def open_provisioned_slice(
    source: GgufSource, provision: ProvisionStage, capabilities: WorkerCapabilities
) -> StageSlice:
    """``open_stage_slice`` for a provisioned stage, checked against what the plan says
    of the model: ``WorkerError`` if the file is another architecture or hidden size."""
    stage = open_stage_slice(
        source,
        provision.layer_start,
        provision.layer_end_exclusive,
        is_first=provision.is_first,
        is_last=provision.is_last,
        capabilities=capabilities,
    )
    config, planned = stage.config, provision.model
    if (config.architecture, config.hidden_dim) != (planned.architecture, planned.hidden_dim):
        stage.close()
        raise WorkerError(
            f"{stage.path}: a {config.architecture} model of hidden size "
            f"{config.hidden_dim}, the plan says {planned.architecture} of "
            f"{planned.hidden_dim}"
        )
    return stage


def rope_factors(config: ModelConfig, names: Collection[str]) -> str | None:
    """Of the tensors ``names`` (a stage's), the per-frequency divisors its rotary angles
    take (llama.cpp's ``get_rope_factors`` at its default context, the trained one):
    llama3's ``rope_freqs``; else LongRoPE's long factors where the model's context
    length passes its original one (``ModelConfig.original_context``), its short ones
    otherwise; None where there are none of these (or not the one chosen). The model
    alone chooses, never a run's cache length: a run's tokens do not depend on its
    ``max_tokens`` or on the runs that share its batches."""
    if ROPE_FREQS in names:
        return ROPE_FREQS
    long = config.context_length > config.original_context
    name = ROPE_FACTORS_LONG if long else ROPE_FACTORS_SHORT
    return name if name in names else None
