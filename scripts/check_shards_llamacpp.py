"""Read the shards ``python -m runplan split`` wrote with llama.cpp's own readers, and
record what they read.

    .venv/bin/python -m runplan split smollm2-135m --stages 3 --out DIR
    /work/llamacpp-venv/bin/python scripts/check_shards_llamacpp.py DIR \
        [--record tests/fixtures/llamacpp/shards.json]

Needs ``llama-cpp-python`` (and nothing of this project: the manifest is read as JSON);
CI never runs it. For each shard of the manifest:

- ``gguf_init_from_file`` of llama.cpp's GGUF library (``libggml-base``), through
  ctypes, with ``no_alloc = false``: it parses the header and reads every tensor's data
  into a ggml context, refusing a file whose data is short or misplaced. Recorded: the
  data section's offset, each tensor's name, type, offset and size, and the shard keys.
- ``llama_model_load_from_file`` with ``vocab_only``: llama.cpp's model loader reads the
  hyperparameters and the vocabulary of the shard (a shard holds some blocks only, which
  llama.cpp cannot run as a model). Recorded: the vocabulary size it read.

``tests/runplan/test_shards_llamacpp.py`` compares a split made now, read by the gguf
package, with the record, so the suite knows that llama.cpp read exactly what split
writes without needing llama-cpp-python.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path
from typing import Any

try:  # the folder is checked first, and said wrong in one line, without it too
    import llama_cpp
except ImportError:
    llama_cpp = None

KEYS_U32 = ("gguf_pipeline.shard.layer_start", "gguf_pipeline.shard.layer_end_exclusive")
KEYS_BOOL = ("gguf_pipeline.shard.embedding", "gguf_pipeline.shard.output")
KEYS_STR = ("gguf_pipeline.shard.source", "gguf_pipeline.shard.model_id")


class GgufInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.POINTER(ctypes.c_void_p))]


def _ggml() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    sigs: dict[str, tuple[Any, list[Any]]] = {
        "gguf_init_from_file": (ctypes.c_void_p, [ctypes.c_char_p, GgufInitParams]),
        "gguf_free": (None, [ctypes.c_void_p]),
        "ggml_free": (None, [ctypes.c_void_p]),
        "gguf_get_n_kv": (ctypes.c_int64, [ctypes.c_void_p]),
        "gguf_find_key": (ctypes.c_int64, [ctypes.c_void_p, ctypes.c_char_p]),
        "gguf_get_val_u32": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_int64]),
        "gguf_get_val_bool": (ctypes.c_bool, [ctypes.c_void_p, ctypes.c_int64]),
        "gguf_get_val_str": (ctypes.c_char_p, [ctypes.c_void_p, ctypes.c_int64]),
        "gguf_get_arr_n": (ctypes.c_size_t, [ctypes.c_void_p, ctypes.c_int64]),
        "gguf_get_data_offset": (ctypes.c_size_t, [ctypes.c_void_p]),
        "gguf_get_n_tensors": (ctypes.c_int64, [ctypes.c_void_p]),
        "gguf_get_tensor_name": (ctypes.c_char_p, [ctypes.c_void_p, ctypes.c_int64]),
        "gguf_get_tensor_offset": (ctypes.c_size_t, [ctypes.c_void_p, ctypes.c_int64]),
        "gguf_get_tensor_type": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64]),
        "gguf_get_tensor_size": (ctypes.c_size_t, [ctypes.c_void_p, ctypes.c_int64]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def read_with_gguf(lib: ctypes.CDLL, path: Path) -> dict[str, Any]:
    data_ctx = ctypes.c_void_p()
    params = GgufInitParams(False, ctypes.pointer(data_ctx))  # read every tensor's data
    ctx = lib.gguf_init_from_file(str(path).encode(), params)
    if not ctx:
        raise RuntimeError(f"llama.cpp's gguf_init_from_file refused {path}")
    try:
        keys: dict[str, Any] = {}
        for key in (*KEYS_U32, *KEYS_BOOL, *KEYS_STR, "gguf_pipeline.shard.tensor_sha256"):
            kid = lib.gguf_find_key(ctx, key.encode())
            if kid < 0:
                raise RuntimeError(f"{path}: llama.cpp finds no key {key}")
            if key in KEYS_U32:
                keys[key] = lib.gguf_get_val_u32(ctx, kid)
            elif key in KEYS_BOOL:
                keys[key] = bool(lib.gguf_get_val_bool(ctx, kid))
            elif key in KEYS_STR:
                keys[key] = lib.gguf_get_val_str(ctx, kid).decode()
            else:
                keys[key] = int(lib.gguf_get_arr_n(ctx, kid))  # one hash per tensor
        tensors = []
        for i in range(lib.gguf_get_n_tensors(ctx)):
            tensors.append(
                [
                    lib.gguf_get_tensor_name(ctx, i).decode(),
                    int(lib.gguf_get_tensor_type(ctx, i)),
                    int(lib.gguf_get_tensor_offset(ctx, i)),
                    int(lib.gguf_get_tensor_size(ctx, i)),
                ]
            )
        return {
            "n_kv": int(lib.gguf_get_n_kv(ctx)),
            "data_offset": int(lib.gguf_get_data_offset(ctx)),
            "tensors": tensors,
            "keys": keys,
        }
    finally:
        lib.gguf_free(ctx)
        if data_ctx:
            lib.ggml_free(data_ctx)


def load_vocab_only(path: Path) -> dict[str, Any]:
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp's model loader refused {path} (vocab_only)")
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        return {"n_vocab": int(llama_cpp.llama_vocab_n_tokens(vocab))}
    finally:
        llama_cpp.llama_model_free(model)


def _manifest(p: argparse.ArgumentParser, folder: Path) -> dict[str, Any]:
    """The manifest of the shards in ``folder``; one line and exit status 2 where there
    is none to read (a folder missing, a file: a traceback)."""
    path = folder / "manifest.json"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        p.error(f"{str(folder)!r}: no shard manifest to read there ({exc.strerror}): give a "
                "folder python -m runplan split wrote")  # fmt: skip
    except ValueError as exc:  # UnicodeDecodeError too
        p.error(f"{str(path)!r}: not a JSON shard manifest ({exc})")
    if not isinstance(doc, dict) or not isinstance(doc.get("shards"), list):
        p.error(f"{str(path)!r}: not a shard manifest (no list of shards)")
    return doc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="a folder written by python -m runplan split")
    p.add_argument("--record", type=Path, default=None, help="write what llama.cpp read here")
    args = p.parse_args()
    manifest = _manifest(p, args.folder)
    if llama_cpp is None:
        p.error("reading the shards with llama.cpp needs llama-cpp-python")
    lib = _ggml()
    shards = []
    for entry in manifest["shards"]:
        path = args.folder / entry["file"]
        got = {"file": entry["file"], **read_with_gguf(lib, path), **load_vocab_only(path)}
        print(
            f"{entry['file']}: llama.cpp read {len(got['tensors'])} tensors (data at "
            f"{got['data_offset']}), blocks {got['keys'][KEYS_U32[0]]}-"
            f"{got['keys'][KEYS_U32[1]] - 1}; its model loader (vocab_only) read "
            f"{got['n_vocab']} tokens"
        )
        shards.append(got)
    if args.record is not None:
        doc = {
            "llama_cpp_python": llama_cpp.__version__,
            "model_id": manifest["model_id"],
            "source": manifest["source"],
            "stages": len(manifest["shards"]),
            "shards": shards,
        }
        args.record.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        print(f"recorded: {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
