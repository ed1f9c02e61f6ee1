"""The NumPy reference worker (EDGES_AND_WORKERS.md §4): runs one stage on the CPU.

Weights are dequantized to float32 at ``bind`` (only the stage's own tensors, see
``gguf_slice``); the residual stream inside the stage is float32; activations leave
and enter the stage in the plan's dtype (``activations``). The KV cache holds
``max_seq_len`` positions of the stage's blocks in float32.

Sequence 0 is the prefill of every prompt row at positions ``0..rows-1`` and starts
the run's sequence afresh (cache and sampler); sequence ``k > 0`` must follow
``k - 1`` and decodes one row at position ``prompt_len + k - 1``. The last stage
samples from the raw logits of the last row and returns a ``TokenOutput`` (with the
logits when the run asks for them).

Weights outlive a run (``kept_weights``): ``release`` drops the run (KV cache, sampler,
sequence) and keeps the dequantized weights; a later ``bind`` whose source and layer
range match uses them again (``weights_reused``) and makes a new KV cache.
``forget_weights`` lets them go.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import numpy as np
import numpy.typing as npt

from runplan import GgufSource, ProvisionStage, SamplingConfig, WorkerCapabilities
from runplan.gguf_header import GgufError
from runtime_core import activations
from runtime_core.errors import UnsupportedModel
from runtime_core.gguf_slice import open_provisioned_slice
from runtime_core.workers.interface import (
    Progress,
    TokenOutput,
    TraceEvent,
    WorkerError,
    checked_token_ids,
    step_position,
)
from runtime_core.workers.kept_weights import WeightsKey, weights_key
from runtime_core.workers.reference.model import StageModel, StageWeights
from runtime_core.workers.sampling import Sampler


@attrs.frozen
class _Held:
    """Weights bound for one stage's slice, kept across runs."""

    key: WeightsKey
    weights: StageWeights
    vocab_size: int


@attrs.define
class _Bound:
    """One run's state: the model over the held weights with the run's KV cache, the
    sampler, and where the sequence stands."""

    model: StageModel
    vocab_size: int
    sampler: Sampler | None  # last stage
    next_sequence: int | None = None  # None until a prefill
    next_pos: int = 0


class ReferenceWorker:
    """One stage's compute engine in NumPy. Implements ``runtime_core.workers.interface.Worker``."""

    capabilities: ClassVar[WorkerCapabilities] = WorkerCapabilities()

    def __init__(self, *, trace: TraceEvent | None = None) -> None:
        self.trace = trace  # the reference worker has no events of its own to trace
        self._provision: ProvisionStage | None = None
        self._bound: _Bound | None = None
        self._held: _Held | None = None
        self.weights_reused = False  # the last bind used weights already held

    # -- Worker -----------------------------------------------------------------
    def configure(self, provision: ProvisionStage) -> None:
        if provision.model.architecture not in self.capabilities.architectures:
            raise WorkerError(
                f"architecture {provision.model.architecture!r} is not one the "
                f"{self.capabilities.name} worker runs"
            )
        try:
            activations.edge_dtype(provision.model.dtype_family, provision.model.dtype_width_bytes)
        except ValueError as exc:
            raise WorkerError(str(exc)) from exc
        self._provision = provision
        self._bound = None

    def bind(self, gguf_source: GgufSource, progress: Progress | None = None) -> None:
        """Load the stage's tensors, or use those held when they are the same slice of
        the same file. A file that cannot be run raises ``WorkerError`` whose
        ``__cause__`` is the typed ``UnsupportedModel`` or ``GgufError``; the worker
        then stays unbound."""
        p = self._provision
        if p is None:
            raise WorkerError("bind before configure")
        self._bound = None
        key = weights_key(gguf_source, p)
        held = self._held
        self.weights_reused = held is not None and held.key.reusable_for(key)
        if held is None or not self.weights_reused:
            self._held = held = None  # the old weights go before new ones are read
            try:
                with open_provisioned_slice(gguf_source, p, self.capabilities) as stage:
                    weights = StageWeights.load(stage, progress)
                    vocab = stage.vocab_size
            except (UnsupportedModel, GgufError, ValueError, OSError) as exc:
                raise WorkerError(f"stage {p.stage_index}: {exc}") from exc
            held = self._held = _Held(key, weights, vocab)
        sampler = None
        if p.is_last:
            try:
                sampler = Sampler(p.sampling or SamplingConfig())
            except ValueError as exc:
                raise WorkerError(f"stage {p.stage_index}: {exc}") from exc
        self._bound = _Bound(
            StageModel(held.weights, p.model.max_seq_len), held.vocab_size, sampler
        )

    def execute_step(
        self, sequence: int, data: npt.NDArray[np.generic]
    ) -> npt.NDArray[np.generic] | TokenOutput:
        p, b = self._provision, self._bound
        if p is None or b is None:
            raise WorkerError(f"execute_step({sequence}) before bind completed")
        rows = data.shape[0] if data.ndim >= 1 else 0
        pos = step_position(sequence, b.next_sequence, b.next_pos, rows, p.model.max_seq_len)
        if sequence == 0 and b.sampler is not None:
            b.sampler = Sampler(b.sampler.config)  # the sequence starts afresh: so do draws
        edge = activations.edge_dtype(p.model.dtype_family, p.model.dtype_width_bytes)
        try:
            if p.is_first:
                x = b.model.embed(checked_token_ids(data, b.vocab_size).astype(np.intp))
            else:
                x = activations.decode(self._activation_rows(data, p.model.hidden_dim), edge)
            x = b.model.forward(x, pos)
            result: npt.NDArray[np.generic] | TokenOutput
            if p.is_last:
                assert b.sampler is not None
                logits = b.model.logits(x[-1:])
                token = b.sampler.sample(logits)
                result = TokenOutput(token, logits if p.return_logits else None)
            else:
                result = activations.encode(x, edge)
        except WorkerError:
            raise
        except (ValueError, FloatingPointError, MemoryError) as exc:
            raise WorkerError(f"step {sequence} failed: {exc}") from exc
        b.next_sequence = sequence + 1
        b.next_pos = pos + x.shape[0]
        return result

    def release(self) -> None:
        """End the run: its KV cache, sampler and provision go; the weights stay."""
        self._bound = None
        self._provision = None

    def forget_weights(self) -> None:
        """Let the held weights go (the next ``bind`` reads the file)."""
        self._held = None
        self.weights_reused = False

    # -- checks -------------------------------------------------------------------
    @staticmethod
    def _activation_rows(data: npt.NDArray[np.generic], hidden: int) -> npt.NDArray[np.generic]:
        if data.ndim != 2 or data.shape[1] != hidden:
            raise WorkerError(f"activations of shape {data.shape}, expected (rows, {hidden})")
        return data
