"""Facts, model config and special tokens against the gguf package's own full reading of
the file (``gguf.GGUFReader``, none of our parsing), on files that each lack one key.

For each key a file may lack, llama.cpp has a default or refuses the file
(``llama-model.cpp``'s ``load_hparams``, ``llama-vocab.cpp``'s ``load``); the readings
below write those rules out independently of our code:

- ``{arch}.vocab_size``: the length of ``tokenizer.ggml.tokens``;
- ``{arch}.attention.head_count_kv``: ``head_count``;
- ``{arch}.attention.key_length`` / ``value_length``: ``embedding_length / head_count``;
- ``{arch}.rope.dimension_count``: the key head size;
- ``{arch}.rope.freq_base``: 10000 (and ``rope.freq_base_swa``, for gemma3's sliding
  blocks, 10000, for gemma2's the global base; ``attention.sliding_window_pattern``:
  every sixth block global for gemma3, every second for gemma2; gemma2's
  ``attention.sliding_window``: 4096);
- ``tokenizer.ggml.bos_token_id`` / ``eos_token_id``: the tokenizer model's default
  (11 and 11 for ``gpt2``, 1 and 2 for ``llama``), also when the file's id is outside
  the vocabulary;
- ``general.architecture``, ``{arch}.context_length``, ``embedding_length``,
  ``block_count``, ``attention.head_count``, ``attention.layer_norm_rms_epsilon`` and
  ``feed_forward_length``: required (llama.cpp defaults the last to 0, which no tensor
  of a real model fits): a ``GgufError`` naming the key.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from gguf import GGUFReader

from runplan import GgufError, GgufSource, ModelFacts, model_facts_from_gguf
from runplan.gguf_header import GgufHeader
from runtime_core.architectures import ARCHITECTURES
from runtime_core.model_config import ModelConfig
from runtime_core.tokenizer import Tokenizer
from tests.fixtures.gguf_models import FIXTURE_SHAPES, ModelShape, write_model

ARCH = "llama"
#: Every optional key, and one file without it each. ``key_length`` / ``value_length``
#: are written (gguf_models does not) so that there is something to leave out.
EXTRA = {f"{ARCH}.attention.key_length": 16, f"{ARCH}.attention.value_length": 16}
OPTIONAL = (
    f"{ARCH}.vocab_size",
    f"{ARCH}.attention.head_count_kv",
    f"{ARCH}.attention.key_length",
    f"{ARCH}.attention.value_length",
    f"{ARCH}.rope.dimension_count",
    f"{ARCH}.rope.freq_base",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
)
REQUIRED_BY_FACTS = (
    "general.architecture",
    f"{ARCH}.block_count",
    f"{ARCH}.context_length",
    f"{ARCH}.embedding_length",
    f"{ARCH}.attention.head_count",
)
REQUIRED_BY_CONFIG = (
    f"{ARCH}.attention.layer_norm_rms_epsilon",
    f"{ARCH}.feed_forward_length",
)
LLAMA_CPP_SPECIAL = {"gpt2": {"bos": 11, "eos": 11}, "llama": {"bos": 1, "eos": 2}}
SHAPE = ModelShape(n_layers=3, heads=4, heads_kv=2, rope_freq_base=500000.0, tied=False)


class Reading:
    """One file as ``gguf.GGUFReader`` reads it, whole."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reader = GGUFReader(path)

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def value(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def special(self, kind: str, n_vocab: int) -> int:
        default = LLAMA_CPP_SPECIAL[self.value("tokenizer.ggml.model")][kind]
        value = self.value(f"tokenizer.ggml.{kind}_token_id")
        return value if value is not None and 0 <= value < n_vocab else default

    def facts(self) -> ModelFacts:
        """What llama.cpp's rules make of the file, from the package's reading."""
        arch = self.value("general.architecture")
        hidden = self.value(f"{arch}.embedding_length")
        heads = self.value(f"{arch}.attention.head_count")
        layers = self.value(f"{arch}.block_count")
        tensors = {t.name: t for t in self.reader.tensors}
        listed = self.value("tokenizer.ggml.tokens")  # the list, whatever vocab_size says
        vocab = len(listed) if listed is not None else self.value(f"{arch}.vocab_size")
        blocks = [
            [t for n, t in tensors.items() if n.startswith(f"blk.{i}.")] for i in range(layers)
        ]
        ends = {"token_embd.weight", "output.weight", "output_norm.weight"}
        shared = [t for n, t in tensors.items() if not n.startswith("blk.") and n not in ends]
        tied = "output.weight" not in tensors
        out = [
            tensors["output_norm.weight"],
            tensors["token_embd.weight" if tied else "output.weight"],
        ]
        embd = tensors["token_embd.weight"]
        ctx = self.value(f"{arch}.context_length")
        windows, bases = self.attention(arch, layers)
        return ModelFacts(
            model_id=self.path.stem,
            gguf_source=_source(self.path),
            architecture=arch,
            num_layers=layers,
            hidden_dim=hidden,
            head_count=heads,
            head_count_kv=self.value(f"{arch}.attention.head_count_kv", heads),
            head_dim_k=self.value(f"{arch}.attention.key_length", hidden // heads),
            head_dim_v=self.value(f"{arch}.attention.value_length", hidden // heads),
            vocab_size=vocab,
            eos_token_id=self.special("eos", vocab),
            context_length=ctx,
            max_seq_len=ctx,
            quant_types=tuple(sorted({t.tensor_type.name for t in tensors.values()})),
            block_bytes=tuple(sum(int(t.n_bytes) for t in b) for b in blocks),
            embedding_bytes=int(embd.n_bytes),
            output_bytes=sum(int(t.n_bytes) for t in out),
            shared_bytes=sum(int(t.n_bytes) for t in shared),
            tied_embeddings=tied,
            block_elements=tuple(sum(int(t.n_elements) for t in b) for b in blocks),
            embedding_elements=int(embd.n_elements),
            output_elements=sum(int(t.n_elements) for t in out),
            shared_elements=sum(int(t.n_elements) for t in shared),
            layer_windows=windows,
            layer_rope_freq_bases=bases,
            expert_count=self.value(f"{arch}.expert_count", 0),
        )

    def attention(self, arch: str, layers: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """Each block's window and rope base by llama.cpp's rules (``models/gemma2.cpp``,
        ``gemma3.cpp``): only gemma3 and gemma2 slide (``attention.sliding_window`` > 0;
        gemma3 0 without the key, gemma2 4096), on the blocks its pattern names (an
        array of flags, or a period ``n``: block ``i`` slides when ``i % n < n - 1``;
        without the key 6 for gemma3, 2 for gemma2); sliding blocks rotate with
        ``rope.freq_base_swa`` (without it gemma3's 10000, gemma2's global base), the
        others with ``rope.freq_base`` (10000 by default)."""
        base = float(np.float32(self.value(f"{arch}.rope.freq_base", 10000.0)))
        defaults = {"gemma3": (0, 6, 10000.0), "gemma2": (4096, 2, base)}
        if arch not in defaults:
            return (0,) * layers, (base,) * layers
        window_default, period, swa_default = defaults[arch]
        window = self.value(f"{arch}.attention.sliding_window", window_default)
        if not window:
            return (0,) * layers, (base,) * layers
        pattern = self.value(f"{arch}.attention.sliding_window_pattern", period)
        if isinstance(pattern, list):
            slides = [bool(p) for p in pattern]
        else:
            slides = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
        swa = float(np.float32(self.value(f"{arch}.rope.freq_base_swa", swa_default)))
        return (
            tuple(window if s else 0 for s in slides),
            tuple(swa if s else base for s in slides),
        )

    def config(self) -> dict[str, Any]:
        arch = self.value("general.architecture")
        hidden = self.value(f"{arch}.embedding_length")
        heads = self.value(f"{arch}.attention.head_count")
        head_k = self.value(f"{arch}.attention.key_length", hidden // heads)
        ffn = self.value(f"{arch}.feed_forward_length")
        experts = self.value(f"{arch}.expert_count", 0)
        used = self.value(f"{arch}.expert_used_count", 0)
        if experts and arch in ("qwen3moe", "qwen2moe"):  # llama.cpp's n_ff_exp; else n_ff
            ffn = self.value(f"{arch}.expert_feed_forward_length", ffn // used)
        return {
            "n_experts": experts,
            "n_experts_used": used,
            "n_heads": heads,
            "n_kv_heads": self.value(f"{arch}.attention.head_count_kv", heads),
            "head_dim_k": head_k,
            "head_dim_v": self.value(f"{arch}.attention.value_length", hidden // heads),
            "ffn_dims": tuple(ffn)
            if isinstance(ffn, list)
            else (ffn,) * self.value(f"{arch}.block_count"),
            "rms_eps": float(np.float32(self.value(f"{arch}.attention.layer_norm_rms_epsilon"))),
            "rope_n_dims": self.value(f"{arch}.rope.dimension_count", head_k),
            "rope_freq_base": float(np.float32(self.value(f"{arch}.rope.freq_base", 10000.0))),
        }


def _source(path: Path) -> GgufSource:
    return GgufSource.single(os.path.abspath(path))


def _config_of(config: ModelConfig) -> dict[str, Any]:
    return {
        "n_experts": config.n_experts,
        "n_experts_used": config.n_experts_used,
        "n_heads": config.n_heads,
        "n_kv_heads": config.n_kv_heads,
        "head_dim_k": config.head_dim_k,
        "head_dim_v": config.head_dim_v,
        "ffn_dims": config.ffn_dims,
        "rms_eps": config.rms_eps,
        "rope_n_dims": config.rope.n_dims,
        "rope_freq_base": config.rope.freq_base,
    }


def _without_end_tokens(facts: ModelFacts) -> ModelFacts:
    """The facts the reading here reads: the end-of-generation ids are llama.cpp's
    reading of the token texts, checked against llama.cpp's own in
    ``tests/runtime_core/test_tokenizer_llamacpp.py``."""
    return attrs.evolve(facts, eog_token_ids=())


def _config(path: Path) -> ModelConfig:
    return ModelConfig.from_header(GgufHeader.read(path), tuple(ARCHITECTURES))


@pytest.fixture(scope="module")
def without(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str | None], Path]:
    folder = tmp_path_factory.mktemp("defaults")
    written: dict[str | None, Path] = {}

    def get(key: str | None) -> Path:
        if key not in written:
            name = "complete" if key is None else key.replace(".", "_")
            drop = () if key is None else (key,)
            written[key] = write_model(
                folder / f"{name}.gguf", SHAPE, drop_keys=drop, extra_keys=EXTRA
            )
        return written[key]

    return get


@pytest.mark.parametrize("key", [None, *OPTIONAL])
def test_facts_without_an_optional_key_are_llama_cpps(
    without: Callable[[str | None], Path], key: str | None
) -> None:
    path = without(key)
    reading = Reading(path)
    assert key is None or not reading.has(key)
    assert _without_end_tokens(model_facts_from_gguf(path)) == reading.facts()
    assert _config_of(_config(path)) == reading.config()


@pytest.mark.parametrize(
    "key", [None, "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"]
)
def test_special_tokens_without_their_key_are_llama_cpps(
    without: Callable[[str | None], Path], key: str | None
) -> None:
    path = without(key)
    reading = Reading(path)
    tokenizer = Tokenizer.from_gguf(path)
    n = len(reading.value("tokenizer.ggml.tokens"))
    assert (tokenizer.bos_id, tokenizer.eos_id) == (
        reading.special("bos", n),
        reading.special("eos", n),
    )
    assert model_facts_from_gguf(path).eos_token_id == tokenizer.eos_id


def test_a_vocab_size_from_the_token_list_is_its_length(
    without: Callable[[str | None], Path],
) -> None:
    """The issue's case: without ``{arch}.vocab_size`` the facts once read the first byte
    of the key's name (116, 't') and refused every run (eos outside the vocabulary)."""
    path = without(f"{ARCH}.vocab_size")
    tokens = Reading(path).value("tokenizer.ggml.tokens")
    facts = model_facts_from_gguf(path)
    assert facts.vocab_size == len(tokens) != ord("t")
    assert 0 <= facts.eos_token_id < facts.vocab_size


def test_an_eos_id_outside_the_vocabulary_is_the_models_default(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf", SHAPE)
    data = bytearray(path.read_bytes())
    key = b"tokenizer.ggml.eos_token_id"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<I", data, at)[0] == 4  # GGUF uint32
    struct.pack_into("<I", data, at + 4, 10**6)
    path.write_bytes(bytes(data))
    reading = Reading(path)
    n = len(reading.value("tokenizer.ggml.tokens"))
    assert reading.value("tokenizer.ggml.eos_token_id") == 10**6
    assert model_facts_from_gguf(path).eos_token_id == reading.special("eos", n) == 11
    assert Tokenizer.from_gguf(path).eos_id == 11


@pytest.mark.parametrize(("unk", "want"), [(5, 5), (10**6, None)])
def test_the_unknown_token_is_read_from_its_own_key(
    tmp_path: Path, unk: int, want: int | None
) -> None:
    """``tokenizer.ggml.unknown_token_id`` (not ``unk_token_id``); ``gpt2`` has no
    default, so an id outside the vocabulary leaves none."""
    path = write_model(
        tmp_path / "m.gguf", SHAPE, extra_keys={"tokenizer.ggml.unknown_token_id": unk}
    )
    assert Reading(path).value("tokenizer.ggml.unknown_token_id") == unk
    assert Tokenizer.from_gguf(path).vocab.unk_id == want


@pytest.mark.parametrize("key", REQUIRED_BY_FACTS)
def test_facts_without_a_required_key_raise_naming_it(
    without: Callable[[str | None], Path], key: str
) -> None:
    path = without(key)
    with pytest.raises(GgufError) as err:
        model_facts_from_gguf(path)
    assert err.value.key == key and os.path.abspath(path) in str(err.value)


@pytest.mark.parametrize("key", REQUIRED_BY_CONFIG)
def test_a_stage_without_a_required_key_raises_naming_it(
    without: Callable[[str | None], Path], key: str
) -> None:
    path = without(key)
    model_facts_from_gguf(path)  # the planner does not need it
    with pytest.raises(GgufError) as err:
        _config(path)
    assert err.value.key == key


@pytest.mark.parametrize("name", sorted(FIXTURE_SHAPES))
def test_facts_of_the_fixture_shapes_are_the_packages_reading(tmp_path: Path, name: str) -> None:
    path = write_model(tmp_path / f"{name}.gguf", FIXTURE_SHAPES[name])
    reading = Reading(path)
    assert _without_end_tokens(model_facts_from_gguf(path)) == reading.facts()
    assert _config_of(_config(path)) == reading.config()


@pytest.mark.slow
def test_smollm2_facts_are_the_packages_reading(smollm2_path: str) -> None:
    reading = Reading(Path(smollm2_path))
    assert _without_end_tokens(model_facts_from_gguf(smollm2_path)) == reading.facts()
    assert _config_of(_config(Path(smollm2_path))) == reading.config()


@pytest.mark.parametrize("arch", ["smollm3", "llama", "qwen3"])
def test_only_smollm3_leaves_every_fourth_block_unrotated(tmp_path: Path, arch: str) -> None:
    """llama.cpp's smollm3 (``models/smollm3.cpp``) fixes ``n_no_rope_layer_step`` at 4
    and rotates block ``il`` only where ``(il + 1) % 4 != 0``; no key sets it, and the
    other architectures rotate every block."""
    shape = ModelShape(arch=arch, n_layers=9, key_length=32 if arch == "qwen3" else 0)
    config = _config(write_model(tmp_path / f"{arch}.gguf", shape))
    rotates = [arch != "smollm3" or (il + 1) % 4 != 0 for il in range(9)]
    assert list(config.layer_rotary) == rotates
    assert config.rope.n_dims > 0


@pytest.mark.parametrize(
    ("keys", "freq_scale"),
    [
        ({"llama.rope.scale_linear": 4.0}, 0.25),  # the older key alone
        ({"llama.rope.scaling.factor": 0.0, "llama.rope.scale_linear": 4.0}, 1.0),
        ({"llama.rope.scaling.factor": 2.0, "llama.rope.scale_linear": 4.0}, 0.5),
    ],
)
def test_the_older_linear_scale_is_read_only_without_the_scaling_factor(
    tmp_path: Path, keys: dict[str, float], freq_scale: float
) -> None:
    """llama.cpp reads ``rope.scaling.factor`` and, only where the key is absent,
    ``rope.scale_linear``; a factor of 0 present is no scaling (it once let the older
    key scale the positions by 4)."""
    path = write_model(tmp_path / "m.gguf", SHAPE, extra_keys=keys)
    assert _config(path).rope.freq_scale == np.float32(freq_scale)
