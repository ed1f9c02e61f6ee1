"""The reference worker against llama.cpp on small random-weight models
(``tests/fixtures/llamacpp/tiny.json``): llama and qwen2 in every quant type; qwen3,
gemma3 and phi3 in F32, F16, BF16, Q8_0 and Q4_K; blocks of three and six of them in
F32, and in F32 a gemma3 with a logit soft cap and one of 62 blocks (whose queries
llama.cpp scales as Gemma 3 27B's).

Thresholds: the cosine similarity of the logits of the last prompt position with
llama.cpp's is >= 0.99999 on F32 and F16 weights (and every logit within 1e-4 on
F32, but for GELU's architecture, see below), >= 0.9995 on every other type, and the
largest logit is the same token. Greedy tokens equal llama.cpp's on all 16 steps for
F32, F16 and BF16 unless llama.cpp's two largest logits come to a near-tie
(``numerics.NEAR_TIE``), and for every type at least up to the first near-tie. Where
all 16 tokens agree, the logits of the last (decode) step meet the same cosine
thresholds.

llama.cpp's CPU GELU (gemma3) is a table of float16 values indexed by the input
rounded to float16, about 1e-3 from the exact function: its F32 logits stand up to
~1e-3 from ours. With that table in place of our GELU, they stand within 1e-5.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from runplan import model_facts_from_gguf
from runtime_core.workers.interface import TokenOutput
from runtime_core.workers.reference import model as reference_model
from tests.fixtures.llamacpp_fixtures import load_doc, load_logits, model_file
from tests.support.chain import Chain, provisions
from tests.support.numerics import common_prefix, cosine, first_near_tie

DOC = load_doc("tiny")
LOGITS = load_logits("tiny")
MODELS: list[dict[str, Any]] = DOC["models"]
N_TOKENS: int = DOC["greedy_tokens"]
EXACT_TYPES = ("F32", "F16")
EXACT_GREEDY_TYPES = ("F32", "F16", "BF16")
GELU_ARCHITECTURES = ("gemma3",)


def arch_of(entry: dict[str, Any]) -> str:
    arch: str = DOC["shapes"][entry["shape"]]["arch"]
    return arch


_runs: dict[str, list[TokenOutput]] = {}


def run(entry: dict[str, Any], model_dir: Path) -> list[TokenOutput]:
    """Our greedy outputs on the model of ``entry`` (one stage), computed once."""
    name = entry["name"]
    if name not in _runs:
        chain = Chain.bind(provisions(model_file(entry, model_dir), 1, max_seq_len=64))
        _runs[name] = chain.generate(DOC["prompt"], N_TOKENS)
        chain.release()
    return _runs[name]


def threshold(entry: dict[str, Any]) -> float:
    return 0.99999 if entry["type"] in EXACT_TYPES else 0.9995


def logits_of(out: TokenOutput) -> np.ndarray:
    assert out.logits is not None
    return out.logits


def test_every_type_of_every_architecture_is_covered() -> None:
    types = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"}
    types |= {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
    for shape in ("llama", "qwen2"):
        assert {m["type"] for m in MODELS if m["shape"] == shape} == types
    for shape in ("qwen3", "gemma3", "phi3"):
        assert DOC["shapes"][shape]["arch"] == shape
        assert {m["type"] for m in MODELS if m["shape"] == shape} == {
            "F32", "F16", "BF16", "Q8_0", "Q4_K"
        }  # fmt: skip
        assert {m["type"] for m in MODELS if m["shape"].startswith(f"{shape}-")} == {"F32"}
    stored = {t for m in MODELS for t in m["tensor_types"].values()}
    assert stored == types  # llama.cpp's files hold no type beyond these


@pytest.mark.parametrize("entry", MODELS, ids=[m["name"] for m in MODELS])
def test_prompt_logits_match_llamacpp(entry: dict[str, Any], model_dir: Path) -> None:
    ours = logits_of(run(entry, model_dir)[0])
    theirs = LOGITS[f"{entry['name']}/prompt"]
    assert ours.dtype == np.float32
    assert ours.shape == theirs.shape
    assert cosine(ours, theirs) >= threshold(entry)
    assert int(np.argmax(ours)) == int(np.argmax(theirs))
    if entry["type"] == "F32" and arch_of(entry) not in GELU_ARCHITECTURES:
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)


def ggml_gelu(x: np.ndarray) -> None:
    """llama.cpp's CPU GELU, in place: 0 below -10, the input above 10, else its
    table's float16 value at the input rounded to float16."""
    table = x.astype(np.float16).astype(np.float32)
    EXACT_GELU(table)
    table = table.astype(np.float16).astype(np.float32)
    x[...] = np.where(x <= -10.0, 0.0, np.where(x >= 10.0, x, table))


EXACT_GELU = reference_model.gelu_tanh


def test_gemma3_logits_stand_from_llamacpps_by_its_float16_gelu_only(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = next(m for m in MODELS if m["name"] == "tiny-gemma3-F32")
    theirs = LOGITS[f"{entry['name']}/prompt"]
    ours = logits_of(run(entry, model_dir)[0])
    assert 1e-4 < float(np.abs(ours - theirs).max()) < 3e-3
    monkeypatch.setattr(reference_model, "gelu_tanh", ggml_gelu)
    chain = Chain.bind(provisions(model_file(entry, model_dir), 1, max_seq_len=64))
    with_table = chain.generate(DOC["prompt"], N_TOKENS)
    chain.release()
    np.testing.assert_allclose(logits_of(with_table[0]), theirs, rtol=0, atol=1e-5)
    last = LOGITS[f"{entry['name']}/last_step"]
    np.testing.assert_allclose(logits_of(with_table[-1]), last, rtol=0, atol=1e-5)


@pytest.mark.parametrize("entry", MODELS, ids=[m["name"] for m in MODELS])
def test_greedy_tokens_match_llamacpp_up_to_a_near_tie(
    entry: dict[str, Any], model_dir: Path
) -> None:
    ours = [o.token_id for o in run(entry, model_dir)]
    theirs = entry["greedy"][:N_TOKENS]
    near_tie = first_near_tie(entry["gaps"], N_TOKENS)
    if entry["type"] in EXACT_GREEDY_TYPES and near_tie == N_TOKENS:
        assert ours == theirs
    assert common_prefix(ours, theirs) >= near_tie


@pytest.mark.parametrize("entry", MODELS, ids=[m["name"] for m in MODELS])
def test_decode_step_logits_match_llamacpp(entry: dict[str, Any], model_dir: Path) -> None:
    outs = run(entry, model_dir)
    if [o.token_id for o in outs] != entry["greedy"][:N_TOKENS]:
        pytest.skip("the greedy tokens part at a near-tie: the last steps saw other inputs")
    ours = logits_of(outs[-1])
    theirs = LOGITS[f"{entry['name']}/last_step"]
    assert cosine(ours, theirs) >= threshold(entry)
    assert int(np.argmax(ours)) == int(np.argmax(theirs))


@pytest.mark.parametrize(
    "entry",
    [m for m in MODELS if arch_of(m) == "gemma3"],
    ids=[m["name"] for m in MODELS if arch_of(m) == "gemma3"],
)
def test_gemma3_runs_past_its_window_with_a_global_block_and_matches_llamacpp_there(
    entry: dict[str, Any], model_dir: Path
) -> None:
    """Sliding blocks see only their window, and the fixture's positions go past it:
    the decode step's logits (checked above) depend on what the window drops."""
    facts = model_facts_from_gguf(model_file(entry, model_dir))
    sliding = [w for w in facts.layer_windows if w]
    assert sliding and 0 in facts.layer_windows
    assert len(DOC["prompt"]) + N_TOKENS > max(sliding)
    assert len(set(facts.layer_rope_freq_bases)) == 2  # one base per kind of block
    outs = run(entry, model_dir)
    assert [o.token_id for o in outs] == entry["greedy"][:N_TOKENS]  # no skipped decode check
    assert cosine(logits_of(outs[-1]), LOGITS[f"{entry['name']}/last_step"]) >= threshold(entry)


def test_the_window_check_can_fail(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same model with its sliding blocks seeing every past position (windows as
    long as the run) stands far from llama.cpp at the decode step: the fixture tells a
    window from none."""
    entry = next(m for m in MODELS if m["name"] == "tiny-gemma3-6-F32")
    unwindowed = reference_model.StageModel.__init__

    def widened(
        self: reference_model.StageModel,
        weights: Any,
        max_seq_len: int,
        positions: int | None = None,
    ) -> None:
        c = weights.config
        wide = tuple(max_seq_len if w else 0 for w in c.layer_windows)
        weights = attrs.evolve(weights, config=attrs.evolve(c, layer_windows=wide))
        unwindowed(self, weights, max_seq_len, positions)

    monkeypatch.setattr(reference_model.StageModel, "__init__", widened)
    chain = Chain.bind(provisions(model_file(entry, model_dir), 1, max_seq_len=64))
    outs = chain.generate(DOC["prompt"], N_TOKENS)
    chain.release()
    assert cosine(logits_of(outs[-1]), LOGITS[f"{entry['name']}/last_step"]) < 0.99
