"""What a GGUF file says about its model: the planner's only view of the model."""

from __future__ import annotations

from attrs import frozen

from runplan._fields import (
    bool_field,
    float_tuple_field,
    int_field,
    int_tuple_field,
    str_field,
    tuple_field,
    typed_field,
)


@frozen
class GgufSource:
    """Where the weights live: one GGUF file, or the files of a llama.cpp split set
    (``name-00001-of-00003.gguf`` ...) in shard order, read as one model."""

    paths: tuple[str, ...] = tuple_field(str)

    @classmethod
    def single(cls, path: str) -> GgufSource:
        return cls(paths=(path,))

    @property
    def is_split(self) -> bool:
        return len(self.paths) > 1

    def __str__(self) -> str:
        if not self.paths:  # never made by a reader; a plan from elsewhere may hold it
            return "(no file)"
        if len(self.paths) == 1:
            return self.paths[0]
        return f"{self.paths[0]} (+{len(self.paths) - 1} more shards)"


@frozen
class ModelFacts:
    """Facts of one GGUF model, read from its header (never from tensor data).

    Byte sizes are those of the tensors as stored in the file (quantized), which is
    what a worker that keeps weights quantized holds in memory.
    """

    model_id: str = str_field()  # file name without ".gguf" (and without the split suffix)
    gguf_source: GgufSource = typed_field(GgufSource)
    architecture: str = str_field()  # general.architecture, e.g. "llama", "qwen2"
    num_layers: int = int_field()  # {arch}.block_count
    hidden_dim: int = int_field()  # {arch}.embedding_length
    head_count: int = int_field()  # {arch}.attention.head_count
    head_count_kv: int = int_field()  # {arch}.attention.head_count_kv (default: head_count)
    head_dim_k: int = int_field()  # {arch}.attention.key_length (default: hidden / heads)
    head_dim_v: int = int_field()  # {arch}.attention.value_length (default: hidden / heads)
    vocab_size: int = int_field()
    eos_token_id: int = int_field()  # tokenizer.ggml.eos_token_id
    # {arch}.context_length: what the model was trained for; 0: the file states none (a
    # run must say its length: ``context_limit``)
    context_length: int = int_field()
    max_seq_len: int = int_field()  # the run's sequence bound (default: context_length)
    quant_types: tuple[str, ...] = tuple_field(str)  # sorted GGML type names in the file
    block_bytes: tuple[int, ...] = int_tuple_field()  # bytes of blk.{i}.* for each block i
    embedding_bytes: int = int_field()  # token_embd.weight (first stage)
    output_bytes: int = int_field()  # output_norm + output head (last stage)
    shared_bytes: int = int_field()  # tensors outside blocks every stage loads (rope_freqs ...)
    tied_embeddings: bool = bool_field()  # no output.weight: the head is token_embd
    # Weight elements of the same parts (for workers that dequantize); empty / 0 when
    # unknown, and then the planner counts stored bytes.
    block_elements: tuple[int, ...] = int_tuple_field(default=())
    embedding_elements: int = int_field(default=0)
    output_elements: int = int_field(default=0)
    shared_elements: int = int_field(default=0)
    # Each block's attention (``runplan.layer_attention``): the positions it attends to
    # (its sliding window; 0: all of them) and its rotary base. Empty when unknown, and
    # then every block attends to all positions.
    layer_windows: tuple[int, ...] = int_tuple_field(default=())
    layer_rope_freq_bases: tuple[float, ...] = float_tuple_field(default=())
    # {arch}.expert_count: a mixture of that many experts in every block (0: none)
    expert_count: int = int_field(default=0)
    # Every id that ends generation (``runplan.end_tokens``: the end-of-sequence id, end
    # of turn, ...), sorted; empty when unknown, and then ``eos_token_id`` alone.
    eog_token_ids: tuple[int, ...] = int_tuple_field(default=())

    def kv_bytes_per_token_per_layer(self, width_bytes: int) -> int:
        """KV-cache bytes that one position of one block takes at ``width_bytes``."""
        return self.head_count_kv * (self.head_dim_k + self.head_dim_v) * width_bytes

    def layer_kv_positions(self, positions: int | None = None) -> tuple[int, ...]:
        """Positions each block's KV cache holds for a run of ``positions`` positions
        (default ``max_seq_len``), or a sliding block's window when that is shorter (it
        never looks further back)."""
        n = self.max_seq_len if positions is None else positions
        windows = self.layer_windows or (0,) * self.num_layers
        return tuple(min(w, n) if w > 0 else n for w in windows)

    def layer_kv_bytes(self, width_bytes: int, positions: int | None = None) -> tuple[int, ...]:
        """KV-cache bytes of each block at ``width_bytes`` per element, for a run of
        ``positions`` positions (default ``max_seq_len``)."""
        per_token = self.kv_bytes_per_token_per_layer(width_bytes)
        return tuple(n * per_token for n in self.layer_kv_positions(positions))


def context_limit(facts: ModelFacts) -> int | None:
    """The most positions a run of the model may hold: its context length, ``None``
    where the file states none (``context_length`` 0, which llama.cpp runs at the
    context its caller gives, and refuses to size one by)."""
    return facts.context_length or None
