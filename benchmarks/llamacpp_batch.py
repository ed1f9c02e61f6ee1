"""llama.cpp decoding several sequences in one batch: the peer column of our batch benchmarks.

    /work/llamacpp-venv/bin/python benchmarks/llamacpp_batch.py --model M.gguf \\
        [--threads 2] [--sequences 1,2,4,8] [--prompt-tokens 32] [--tokens 48] \\
        [--kv f32|f16] [--repeat 1]

Run it with an interpreter that has llama-cpp-python (the project's own environment
does not; ``benchmarks/cpu_batch.py`` and ``benchmarks/serve_concurrency.py`` run it as
a subprocess). It drives llama.cpp's low-level batch API the way its server's parallel
slots do: one context holding ``n`` sequences (a unified KV cache), the ``n`` prompts
prefilled in one ``llama_decode`` call, then each decode step one ``llama_decode`` of
``n`` rows (one token of every sequence, each at its own position, greedy).

Each prompt is ``--prompt-tokens`` ids drawn from a generator seeded by the sequence's
index (distinct prompts: no shared prefix to reuse). ``--kv f32`` (the default) keeps
the cache in float32 as our workers' cache of a float32 edge does; ``f16`` is
llama.cpp's own default.

Prints one JSON object per line, per (sequences, repeat), with: ``sequences``,
``threads``, ``prefill_s`` (all prompts), ``steps_s`` (each decode step's wall time),
``steps_cpu_s`` (its process CPU time), ``tokens_per_s`` (aggregate decode:
``sequences * steps / sum(steps_s)``) and ``first_tokens`` (sequence 0's greedy ids, to
show the decode ran and to compare across runs).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import sys
import time
from typing import Any

import numpy as np


def parse_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        message = f"{text!r} is not a comma-separated list of counts"
        raise argparse.ArgumentTypeError(message) from None
    if not counts or any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: every count must be >= 1")
    return counts


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[2] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="the GGUF file llama.cpp loads")
    p.add_argument("--threads", type=positive, default=2, help="llama.cpp's threads")
    p.add_argument("--sequences", type=parse_counts, default=[1, 2, 4, 8])
    p.add_argument("--prompt-tokens", type=positive, default=32)
    p.add_argument("--tokens", type=positive, default=48, help="decode steps per sequence")
    p.add_argument("--kv", choices=("f32", "f16"), default="f32")
    p.add_argument("--repeat", type=positive, default=1)
    p.add_argument("--verbose", action="store_true", help="llama.cpp's own log lines")
    return p.parse_args(argv)


class BatchDecoder:
    """One llama.cpp model and context for ``sequences`` sequences (low-level API)."""

    def __init__(self, llama: Any, model: Any, args: argparse.Namespace, sequences: int):
        self.llama = llama
        self.sequences = sequences
        prefill_rows = sequences * args.prompt_tokens
        params = llama.llama_context_default_params()
        params.n_ctx = -(-sequences * (args.prompt_tokens + args.tokens + 1) // 256) * 256
        params.n_batch = params.n_ubatch = max(prefill_rows, 512)
        params.n_seq_max = sequences
        params.kv_unified = True
        params.n_threads = params.n_threads_batch = args.threads
        params.flash_attn_type = llama.LLAMA_FLASH_ATTN_TYPE_DISABLED
        kv = llama.GGML_TYPE_F32 if args.kv == "f32" else llama.GGML_TYPE_F16
        params.type_k = params.type_v = kv
        self.ctx = llama.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp made no context for {sequences} sequences")
        self.n_vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model))
        self.batch = llama.llama_batch_init(max(prefill_rows, sequences), 0, 1)

    def decode(self, rows: list[tuple[int, int, int]]) -> list[int]:
        """Decode ``rows`` of (token, position, sequence); the greedy id of each row."""
        b = self.batch
        for i, (token, pos, seq) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1
        b.n_tokens = len(rows)
        rc = self.llama.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for {len(rows)} rows")
        out = []
        for i in range(len(rows)):
            ptr = self.llama.llama_get_logits_ith(self.ctx, i)
            view = ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float))
            out.append(int(np.argmax(np.ctypeslib.as_array(view, shape=(self.n_vocab,)))))
        return out

    def close(self) -> None:
        self.llama.llama_batch_free(self.batch)
        self.llama.llama_free(self.ctx)


def measure(llama: Any, model: Any, args: argparse.Namespace, sequences: int) -> dict[str, Any]:
    dec = BatchDecoder(llama, model, args, sequences)
    try:
        prompts = [
            np.random.default_rng(seq).integers(10, dec.n_vocab, args.prompt_tokens).tolist()
            for seq in range(sequences)
        ]
        rows = [(t, pos, seq) for seq in range(sequences) for pos, t in enumerate(prompts[seq])]
        t0 = time.perf_counter()
        every = dec.decode(rows)
        prefill_s = time.perf_counter() - t0
        last = [every[(seq + 1) * args.prompt_tokens - 1] for seq in range(sequences)]
        first_tokens, steps_s, steps_cpu_s = [last[0]], [], []
        for step in range(args.tokens):
            pos = args.prompt_tokens + step
            c0, t0 = time.process_time(), time.perf_counter()
            last = dec.decode([(last[seq], pos, seq) for seq in range(sequences)])
            steps_s.append(time.perf_counter() - t0)
            steps_cpu_s.append(time.process_time() - c0)
            first_tokens.append(last[0])
    finally:
        dec.close()
    return {
        "sequences": sequences,
        "threads": args.threads,
        "prefill_s": prefill_s,
        "steps_s": steps_s,
        "steps_cpu_s": steps_cpu_s,
        "tokens_per_s": sequences * len(steps_s) / sum(steps_s),
        "first_tokens": first_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    try:
        llama: Any = importlib.import_module("llama_cpp")
        logs: Any = importlib.import_module("llama_cpp._logger")
    except ImportError:
        print(f"{sys.executable} has no llama-cpp-python: run this script with one that has")
        return 2
    logs.set_verbose(args.verbose)  # llama.cpp's own log lines: errors only, unless asked
    llama.llama_backend_init()
    params = llama.llama_model_default_params()
    model = llama.llama_model_load_from_file(args.model.encode(), params)
    if not model:
        print(f"llama.cpp could not load {args.model}", file=sys.stderr)
        return 1
    try:
        for _ in range(args.repeat):
            for n in args.sequences:
                print(json.dumps(measure(llama, model, args, n)), flush=True)
    finally:
        llama.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
