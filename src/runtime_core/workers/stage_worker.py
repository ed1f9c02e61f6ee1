"""A stage worker whose weights stay as the GGUF file stores them, over a backend.

``StageWorker`` holds the worker interface (EDGES_AND_WORKERS.md §4) for every worker
that runs ``forward_program.py``'s forward pass on a backend of its own: the checks of the
interface, the sequence and position, the edges' dtypes, the sampling state. A
``StageBackend`` holds the weights and runs the steps: the CUDA worker's
``runtime_cupy.cuda.backend.DeviceBackend``, and the NumPy twin of its kernels
(``tests/support/twin_stage.py``), which runs the same program on the CPU so that all
of this is tested on any host.

Options common to every backend:

- ``matvec``: ``"q8"`` (default) runs one-row products of quantized matrices on
  8-bit activations with integer dot products, as llama.cpp does; ``"f32"``
  multiplies the dequantized weights with float32 activations (slower, and closest to
  the NumPy reference worker).
- ``kv_dtype``: ``"auto"`` (default: float16 when the plan's activations are 2 bytes
  wide, float32 when 4), ``"f16"`` or ``"f32"``.

Weights outlive a run (``runtime_core.workers.kept_weights``): ``release`` ends the run (its
sequence, position and sampling state) and keeps the backend with its weights; a later
``bind`` for the same slice of the same file, with the same backend settings and cache
length, uses that backend again (``weights_reused``) instead of loading. The backend's
KV cache buffers are kept with it and hold nothing a new run reads: every run starts
with a prefill at position 0, and a step reads only the positions its run wrote (causal
attention over ``0..pos``). ``forget_weights`` releases the backend.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from runplan import GgufSource, ProvisionStage, SamplingConfig, WorkerCapabilities
from runplan.gguf_header import GgufError
from runtime_core import activations
from runtime_core.errors import UnsupportedModel
from runtime_core.gguf_slice import StageSlice, open_provisioned_slice
from runtime_core.workers.interface import (
    Progress,
    TokenOutput,
    TraceEvent,
    WorkerError,
    checked_token_ids,
    step_position,
)
from runtime_core.workers.kept_weights import WeightsKey, weights_key
from runtime_core.workers.sampling import Sampler

MATVEC_MODES = ("q8", "f32")
KV_DTYPES = ("auto", "f16", "f32")


class StageBackend(Protocol):
    """Where a stage's weights live and its steps run."""

    def load(self, stage: StageSlice, max_seq_len: int, progress: Progress | None) -> None: ...

    def put_tokens(self, ids: npt.NDArray[np.int32]) -> None: ...

    def put_activations(self, data: Any) -> None: ...

    def run(self, rows: int, pos: int) -> None: ...

    def take_activations(self, rows: int) -> Any: ...

    def token(self) -> tuple[int, int]: ...

    def logits(self) -> npt.NDArray[np.float32]: ...

    def sample(self, config: SamplingConfig, u: float) -> int: ...

    def to_host(self, data: Any) -> npt.NDArray[np.generic]: ...

    def release(self) -> None: ...


@attrs.frozen
class BackendSpec:
    """What a backend needs to know of the stage beyond its tensors."""

    is_first: bool
    is_last: bool
    edge_dtype: np.dtype[np.generic]  # activations on the edges (runtime_core.activations)
    kv_dtype: str  # "f16" or "f32"
    matvec: str  # "q8" or "f32"


@attrs.frozen
class _Held:
    """A loaded backend, kept across runs."""

    key: WeightsKey
    backend: StageBackend
    vocab_size: int


@attrs.define
class _Run:
    """One run's state over the held backend."""

    backend: StageBackend
    vocab_size: int
    sampling: SamplingConfig | None  # last stage
    rng: np.random.Generator | None = None
    next_sequence: int | None = None
    next_pos: int = 0


def kv_dtype_for(option: str, edge_width: int) -> str:
    if option == "auto":
        return "f32" if edge_width == 4 else "f16"
    return option


class StageWorker:
    """The interface logic of a stage worker over a ``StageBackend``."""

    capabilities: ClassVar[WorkerCapabilities]

    def __init__(
        self, *, matvec: str = "q8", kv_dtype: str = "auto", trace: TraceEvent | None = None
    ) -> None:
        if matvec not in MATVEC_MODES:
            raise ValueError(f"matvec {matvec!r} is not one of {MATVEC_MODES}")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {kv_dtype!r} is not one of {KV_DTYPES}")
        self.matvec = matvec
        self.kv_dtype = kv_dtype
        self.trace = trace  # the backend's own events (interface.TraceEvent)
        self._provision: ProvisionStage | None = None
        self._run: _Run | None = None
        self._held: _Held | None = None
        self.weights_reused = False  # the last bind used the backend already held

    def _make_backend(self, spec: BackendSpec) -> StageBackend:
        raise NotImplementedError

    def _check_stage(self, stage: StageSlice) -> None:
        """Refuse, with ``UnsupportedModel``, a checked slice this worker's backend
        cannot run (before anything is loaded). Every slice passes by default."""

    # -- Worker -----------------------------------------------------------------
    def configure(self, provision: ProvisionStage) -> None:
        if provision.model.architecture not in self.capabilities.architectures:
            refusal = UnsupportedModel(
                str(provision.gguf_source),
                f"architecture {provision.model.architecture!r} is not one the "
                f"{self.capabilities.name} worker runs "
                f"({', '.join(self.capabilities.architectures)})",
                key="general.architecture",
            )
            raise WorkerError(str(refusal)) from refusal
        try:
            activations.edge_dtype(provision.model.dtype_family, provision.model.dtype_width_bytes)
        except ValueError as exc:
            raise WorkerError(str(exc)) from exc
        self.release()
        self._provision = provision

    def bind(self, gguf_source: GgufSource, progress: Progress | None = None) -> None:
        """Load the stage's tensors onto a backend, or use the backend held when it has
        the same slice of the same file with the same settings. A file that cannot be
        run raises ``WorkerError`` whose ``__cause__`` is the typed ``UnsupportedModel``
        or ``GgufError``; the worker then stays unbound."""
        p = self._provision
        if p is None:
            raise WorkerError("bind before configure")
        self._run = None
        edge = activations.edge_dtype(p.model.dtype_family, p.model.dtype_width_bytes)
        sampling = None
        if p.is_last:
            sampling = p.sampling or SamplingConfig()
            try:
                Sampler(sampling)  # the reference's checks of the settings
            except ValueError as exc:
                raise WorkerError(f"stage {p.stage_index}: {exc}") from exc
        spec = BackendSpec(
            is_first=p.is_first,
            is_last=p.is_last,
            edge_dtype=edge,
            kv_dtype=kv_dtype_for(self.kv_dtype, p.model.dtype_width_bytes),
            matvec=self.matvec,
        )
        key = weights_key(gguf_source, p, (spec, p.model.max_seq_len))
        held = self._held
        self.weights_reused = held is not None and held.key.reusable_for(key)
        if held is None or not self.weights_reused:
            self.forget_weights()  # the old backend goes before a new one loads
            held = self._held = _Held(key, *self._load(gguf_source, p, spec, progress))
        self._run = _Run(held.backend, held.vocab_size, sampling)

    def _load(
        self,
        gguf_source: GgufSource,
        p: ProvisionStage,
        spec: BackendSpec,
        progress: Progress | None,
    ) -> tuple[StageBackend, int]:
        backend: StageBackend | None = None
        try:
            with open_provisioned_slice(gguf_source, p, self.capabilities) as stage:
                self._check_stage(stage)
                backend = self._make_backend(spec)
                backend.load(stage, p.model.max_seq_len, progress)
                return backend, stage.vocab_size
        except WorkerError:
            if backend is not None:
                backend.release()
            raise
        except (UnsupportedModel, GgufError, ValueError, OSError, MemoryError, RuntimeError) as exc:
            if backend is not None:
                backend.release()
            raise WorkerError(f"stage {p.stage_index}: {exc}") from exc
        except BaseException:
            if backend is not None:
                backend.release()
            raise

    def execute_step(
        self, sequence: int, data: npt.NDArray[np.generic]
    ) -> npt.NDArray[np.generic] | TokenOutput:
        p, r = self._provision, self._run
        if p is None or r is None:
            raise WorkerError(f"execute_step({sequence}) before bind completed")
        rows = self._rows(data)
        pos = step_position(sequence, r.next_sequence, r.next_pos, rows, p.model.max_seq_len)
        if sequence == 0 and r.sampling is not None:
            r.rng = np.random.Generator(np.random.PCG64(r.sampling.seed))
        b = r.backend
        try:
            if p.is_first:
                b.put_tokens(checked_token_ids(b.to_host(data), r.vocab_size).astype(np.int32))
            else:
                self._check_activations(data, p.model.hidden_dim, p)
                b.put_activations(data)
            b.run(rows, pos)
            result: npt.NDArray[np.generic] | TokenOutput = (
                self._token(r, p.return_logits) if p.is_last else b.take_activations(rows)
            )
        except WorkerError:
            raise
        except (ValueError, FloatingPointError, MemoryError, RuntimeError) as exc:
            raise WorkerError(f"step {sequence} failed: {exc}") from exc
        r.next_sequence = sequence + 1
        r.next_pos = pos + rows
        return result

    def release(self) -> None:
        """End the run (sequence, position, sampling state); the backend and its weights
        stay for the next run of the same slice."""
        self._run = None
        self._provision = None

    def forget_weights(self) -> None:
        """Release the held backend (the next ``bind`` loads)."""
        self._run = None
        self.weights_reused = False
        if self._held is not None:
            held, self._held = self._held, None
            held.backend.release()

    # -- checks ---------------------------------------------------------------------
    @staticmethod
    def _rows(data: Any) -> int:
        shape = getattr(data, "shape", None)
        if shape is None or len(shape) < 1:
            raise WorkerError(f"a step carries an array of rows, got {type(data).__name__}")
        return int(shape[0])

    @staticmethod
    def _check_activations(data: Any, hidden: int, p: ProvisionStage) -> None:
        edge = activations.edge_dtype(p.model.dtype_family, p.model.dtype_width_bytes)
        if data.ndim != 2 or data.shape[1] != hidden:
            raise WorkerError(f"activations of shape {data.shape}, expected (rows, {hidden})")
        if data.dtype != edge:
            raise WorkerError(f"activations of dtype {data.dtype}, the edge carries {edge}")

    @staticmethod
    def _token(r: _Run, return_logits: bool) -> TokenOutput:
        b = r.backend
        token, bad = b.token()
        if bad:
            raise WorkerError(f"the logits hold {bad} NaN or infinite values")
        assert r.sampling is not None
        if r.sampling.temperature > 0.0:
            assert r.rng is not None
            token = b.sample(r.sampling, float(r.rng.random()))
        return TokenOutput(token, b.logits() if return_logits else None)
