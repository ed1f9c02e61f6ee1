"""The synthetic worker: no weights, deterministic pseudo-tokens. With the timing model
it lets the simulator run plans for models of any size (80 layers on 16 stages) in
milliseconds of real time."""

from __future__ import annotations

import hashlib
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from runplan import GgufSource, ProvisionStage, WorkerCapabilities
from runplan.quant_types import QUANT_TYPES
from runtime_core.activations import edge_dtype
from runtime_core.workers.interface import Progress, TokenOutput, WorkerError

#: Types no worker runs yet, which the synthetic worker plans all the same.
NO_WORKER_TYPES = ("IQ4_XS", "IQ2_XXS")
#: Runs any architecture and quant type: it never looks at the weights. It stands for a
#: worker that keeps weights as stored and its KV cache in the activation dtype.
SYNTHETIC_CAPABILITIES = WorkerCapabilities(
    name="synthetic",
    weight_bytes_per_element=0,
    kv_bytes_per_element=0,
    architectures=("llama", "qwen2", "mistral", "gemma", "phi3", "falcon"),
    quant_types=tuple(sorted({*QUANT_TYPES, *NO_WORKER_TYPES})),
)


def pseudo_token(seed: int, sequence: int, vocab: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{sequence}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % vocab


class SyntheticWorker:
    capabilities: ClassVar[WorkerCapabilities] = SYNTHETIC_CAPABILITIES

    def __init__(
        self, vocab_size: int, eos_token_id: int | None = None, eos_after: int | None = None
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.eos_after = eos_after  # the sequence at which to emit EOS, if any
        self._provision: ProvisionStage | None = None
        self._bound = False
        self._last = False
        self._seed = 0
        self._rows_of: tuple[int, np.dtype[np.generic]] | None = None

    def configure(self, provision: ProvisionStage) -> None:
        self._provision = provision
        self._bound = False
        # What every step reads of the provision (the activations' dtype on the first
        # step, where a dtype without one fails as it always did).
        self._last = provision.is_last
        self._seed = provision.sampling.seed if provision.sampling is not None else 0
        self._rows_of = None

    def bind(self, gguf_source: GgufSource, progress: Progress | None = None) -> None:
        if self._provision is None:
            raise WorkerError("bind before configure")
        self._bound = True

    def execute_step(
        self, sequence: int, data: npt.NDArray[np.generic]
    ) -> npt.NDArray[np.generic] | TokenOutput:
        p = self._provision
        if p is None or not self._bound:
            raise WorkerError("execute_step before bind completed")
        rows = int(data.shape[0])
        if not self._last:
            if self._rows_of is None:
                model = p.model
                dtype = edge_dtype(model.dtype_family, model.dtype_width_bytes)
                self._rows_of = (model.hidden_dim, dtype)
            hidden, dtype = self._rows_of
            return np.zeros((rows, hidden), dtype=dtype)
        if self.eos_after is not None and sequence >= self.eos_after:
            assert self.eos_token_id is not None
            token = self.eos_token_id
        else:
            token = pseudo_token(self._seed, sequence, self.vocab_size)
            if token == self.eos_token_id:
                token = (token + 1) % self.vocab_size
        logits = None
        if p.return_logits:
            logits = np.zeros(self.vocab_size, dtype=np.float32)
            logits[token] = 1.0
        return TokenOutput(token, logits)

    def release(self) -> None:
        self._provision = None
        self._bound = False
