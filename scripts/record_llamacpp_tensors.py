"""Record llama.cpp's intermediate tensors, for tests that compare with it block by
block (a sibling of ``record_llamacpp_fixtures.py``, whose helpers it uses).

    /work/llamacpp-venv/bin/python scripts/record_llamacpp_tensors.py

Needs what ``record_llamacpp_fixtures.py`` needs; CI never runs it. It takes about
half a minute on 2 cores and writes the same bytes every time. llama.cpp's evaluation
callback (``cb_eval`` in the context parameters, through llama-cpp-python's low-level
API) hands over every tensor of the graph as it is computed, by name; the prompt's
tensors named in ``TENSORS`` are kept, as float32 arrays of (rows, width). It writes:

- ``tests/fixtures/models/tiny-gemma3-6-{Q4_K_M,Q6_K}.gguf``: the 6-block gemma3 of
  ``FIXTURE_SHAPES`` (5 sliding blocks and a global one, a tied embedding), written in
  F32 by the generator and quantized by llama.cpp's own quantizer with the file types
  that downloads use most (``Q4_K_M``: Q4_K with Q6_K for the embedding and some
  matrices; ``Q6_K``).
- ``tests/fixtures/llamacpp/blocks.json`` and ``blocks_tensors.npz``: for those two models,
  what ``tiny.json`` holds for its models (digest, tensor types, greedy tokens and
  gaps of the tiny prompt, the logits of the prompt and of the last greedy step), and
  the output of every block for the prompt (``l_out-N``); for ``tiny-gemma3-F32``
  (whose logits are in ``tiny.json``), the feed-forward of each block: its input
  (``ffn_norm-N``), the gate and up products, llama.cpp's GELU-gated product
  (``ffn_geglu-N``, its table of halves) and the down product (``ffn_out-N``).

llama.cpp runs as in ``record_llamacpp_fixtures.py``: on the CPU with 2 threads, a
float32 KV cache and flash attention off.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT), str(ROOT / "scripts")]

import llama_cpp  # noqa: E402
import record_llamacpp_fixtures as fixtures  # noqa: E402
from tests.fixtures.gguf_models import FIXTURE_SHAPES, write_model  # noqa: E402
from tests.fixtures.llamacpp_fixtures import tensor_digest  # noqa: E402

#: The K-quant files of the 6-block gemma3: llama.cpp's file type for each.
KQUANT_FILE_TYPES = {"Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K"}
KQUANT_SHAPE = "gemma3-6"
#: The tensors kept, by model: each block's output for the K-quant files; the
#: feed-forward of each block for the F32 gemma3.
TENSORS = {
    "kquants": re.compile(r"l_out-\d+"),
    "ffn": re.compile(r"(ffn_norm|ffn_gate|ffn_up|ffn_geglu|ffn_out)-\d+"),
}

_ggml = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
_ggml.ggml_get_name.restype = ctypes.c_char_p
_ggml.ggml_get_name.argtypes = [ctypes.c_void_p]
_ggml.ggml_nbytes.restype = ctypes.c_size_t
_ggml.ggml_nbytes.argtypes = [ctypes.c_void_p]
_ggml.ggml_is_contiguous.restype = ctypes.c_bool
_ggml.ggml_is_contiguous.argtypes = [ctypes.c_void_p]
_ggml.ggml_type_name.restype = ctypes.c_char_p
_ggml.ggml_type_name.argtypes = [ctypes.c_int]
_ggml.ggml_backend_tensor_get.argtypes = [
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_size_t,
]

#: ``struct ggml_tensor`` (ggml.h): ``enum ggml_type type`` first, then a pointer, then
#: ``int64_t ne[4]``, the sizes of its dimensions, innermost first.
_NE_OFFSET = 16


def _shape(tensor: int) -> tuple[int, ...]:
    ne = ctypes.cast(tensor + _NE_OFFSET, ctypes.POINTER(ctypes.c_int64))
    dims = [int(ne[i]) for i in range(4)]
    while len(dims) > 2 and dims[-1] == 1:
        dims.pop()
    return tuple(reversed(dims))  # (rows, width)


def prompt_tensors(
    path: Path, prompt: list[int], keep: Callable[[str], bool]
) -> dict[str, np.ndarray]:
    """The tensors named ``keep`` of llama.cpp's graph for ``prompt``: the first one of
    each name (a name may be given again to a reshaped view of it), as float32."""
    got: dict[str, np.ndarray] = {}

    @llama_cpp.ggml_backend_sched_eval_callback
    def observe(tensor: int, ask: bool, user_data: ctypes.c_void_p) -> bool:
        name = _ggml.ggml_get_name(tensor).decode()
        if ask:
            return keep(name)
        kind = _ggml.ggml_type_name(ctypes.cast(tensor, ctypes.POINTER(ctypes.c_int32))[0])
        if keep(name) and name not in got:
            if kind != b"f32" or not _ggml.ggml_is_contiguous(tensor):
                raise RuntimeError(f"{name}: a {kind.decode()} tensor, not contiguous float32")
            size = _ggml.ggml_nbytes(tensor)
            data = (ctypes.c_uint8 * size)()
            _ggml.ggml_backend_tensor_get(tensor, data, 0, size)
            got[name] = np.frombuffer(bytes(data), np.float32).reshape(_shape(tensor)).copy()
        return True

    model = llama_cpp.llama_model_load_from_file(
        str(path).encode(), llama_cpp.llama_model_default_params()
    )
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = fixtures.N_CTX
    params.n_threads = params.n_threads_batch = fixtures.N_THREADS
    params.type_k = params.type_v = llama_cpp.GGML_TYPE_F32
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    params.cb_eval = observe
    ctx = llama_cpp.llama_init_from_model(model, params)
    try:
        tokens = (llama_cpp.llama_token * len(prompt))(*prompt)
        rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tokens, len(prompt)))
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
    finally:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    return dict(sorted(got.items()))


def quantize(src: Path, dst: Path, file_type: str) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, file_type)
    params.nthread = fixtures.N_THREADS
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {file_type}) returned {rc}")


def record(out_dir: Path, models_dir: Path, work: Path) -> None:
    tiny = json.loads((out_dir / "tiny.json").read_text())
    prompt: list[int] = tiny["prompt"]
    models: list[dict[str, Any]] = []
    arrays: dict[str, np.ndarray] = {}
    f32 = write_model(work / f"tiny-{KQUANT_SHAPE}-F32.gguf", FIXTURE_SHAPES[KQUANT_SHAPE])
    for qtype, file_type in KQUANT_FILE_TYPES.items():
        name = f"tiny-{KQUANT_SHAPE}-{qtype}"
        path = models_dir / f"{name}.gguf"
        quantize(f32, work / path.name, file_type)
        shutil.copyfile(work / path.name, path)
        llm = fixtures.LlamaCpp(path)
        prompt_logits, tokens, gaps, last = llm.greedy(prompt, fixtures.TINY_GREEDY_TOKENS)
        llm.close()
        models.append(
            {
                "name": name,
                "shape": KQUANT_SHAPE,
                "type": qtype,
                "tensors": "kquants",
                "tensor_digest": tensor_digest(path),
                "tensor_types": fixtures.tensor_types(path),
                "source": f"tests/fixtures/models/{path.name}",
                "greedy": tokens,
                "gaps": gaps,
            }
        )
        arrays[f"{name}/prompt"] = prompt_logits
        arrays[f"{name}/last_step"] = last
        for key, value in prompt_tensors(path, prompt, TENSORS["kquants"].fullmatch).items():
            arrays[f"{name}/{key}"] = value
        print(f"{name}: greedy {tokens}")
    entry = next(m for m in tiny["models"] if m["name"] == "tiny-gemma3-F32")
    path = write_model(work / "tiny-gemma3-F32.gguf", FIXTURE_SHAPES["gemma3"])
    if tensor_digest(path) != entry["tensor_digest"]:
        raise RuntimeError(f"{path}: not the model of tiny.json's {entry['name']}")
    models.append({**{k: entry[k] for k in ("name", "shape", "type", "source")}, "tensors": "ffn"})
    for key, value in prompt_tensors(path, prompt, TENSORS["ffn"].fullmatch).items():
        arrays[f"{entry['name']}/{key}"] = value
    doc = {
        "settings": fixtures.settings(),
        "prompt": prompt,
        "greedy_tokens": fixtures.TINY_GREEDY_TOKENS,
        "tensors": {
            "kquants": "l_out-N: block N's output, (prompt rows, hidden)",
            "ffn": "ffn_norm-N: the feed-forward's input; ffn_gate-N, ffn_up-N: its "
            "products; ffn_geglu-N: gelu(gate) * up, gelu as llama.cpp's table of halves; "
            "ffn_out-N: the down product; each (prompt rows, width)",
        },
        "models": models,
    }
    (out_dir / "blocks.json").write_text(json.dumps(doc, indent=1) + "\n")
    np.savez_compressed(out_dir / "blocks_tensors.npz", **arrays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests/fixtures/llamacpp")
    parser.add_argument("--models", type=Path, default=ROOT / "tests/fixtures/models")
    args = parser.parse_args()
    llama_cpp.llama_log_set(fixtures._quiet_log, ctypes.c_void_p(0))
    with tempfile.TemporaryDirectory() as work:
        record(args.out, args.models, Path(work))


if __name__ == "__main__":
    main()
