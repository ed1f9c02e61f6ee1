"""The CUDA worker (EDGES_AND_WORKERS.md §4): one stage on an NVIDIA GPU.

Weights stay quantized on the device in their GGUF block layout; the kernels of
``kernels/*.cu`` dequantize them as they multiply (``program.py`` has the sequence
of a step). The residual stream inside a stage is float32; activations leave and
enter the stage in the plan's dtype (f16 by default for CUDA, f32 or bf16 when the
plan says so). The last stage computes the logits, the greedy token (or, with a
temperature, the reference sampler's draw) on the device; only the id comes back,
and the logits only when the run asks for them.

Options (``CudaWorker(...)``):

- ``matvec``: ``"q8"`` (default) runs one-row products of quantized matrices on
  8-bit activations with integer dot products, as llama.cpp does; ``"f32"``
  multiplies the dequantized weights with float32 activations (slower, and closest to
  the NumPy reference worker).
- ``kv_dtype``: ``"auto"`` (default: float16 when the plan's activations are 2 bytes
  wide, float32 when 4), ``"f16"`` or ``"f32"``.
- ``use_graph``: decode steps replay a CUDA graph captured at the first decode step
  (position and token are read from device memory); ``False`` launches every kernel
  from Python each step, for comparison.
- ``device_io``: a stage that is not the last returns its activations as a CuPy array
  on the device, and every stage accepts CuPy arrays, so that stages on one GPU pass
  activations device to device. Default: NumPy arrays, as the worker interface says.
- ``device``: the CUDA device index.

``StageWorker`` holds everything that is not CUDA: the checks of the interface, the
sequence and position, edges' dtypes, sampling state. Its backends are
``device_stage.DeviceBackend`` (CuPy, imported only at ``bind``) and the NumPy twin
``twin_stage.TwinBackend``, which runs the same program on the kernels' twins so that
all of this is tested on any CPU.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from runplan import GgufSource, ProvisionStage, SamplingConfig, WorkerCapabilities
from runplan.config import REFERENCE_ARCHITECTURES
from runplan.gguf_header import GgufError
from runtime_core import activations
from runtime_core.errors import UnsupportedModel
from runtime_core.gguf_slice import StageSlice, open_provisioned_slice
from runtime_core.sampling import Sampler
from runtime_core.worker import (
    Progress,
    TokenOutput,
    WorkerError,
    checked_token_ids,
    step_position,
)
from runtime_cupy.kernels import ATTENTION_MAX_HEAD_DIM
from runtime_cupy.quant_types import QUANT_TYPES

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


@attrs.define
class _Run:
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
    #: The largest head size the backend's attention takes (``None``: any).
    max_head_dim: ClassVar[int | None] = ATTENTION_MAX_HEAD_DIM

    def __init__(self, *, matvec: str = "q8", kv_dtype: str = "auto") -> None:
        if matvec not in MATVEC_MODES:
            raise ValueError(f"matvec {matvec!r} is not one of {MATVEC_MODES}")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {kv_dtype!r} is not one of {KV_DTYPES}")
        self.matvec = matvec
        self.kv_dtype = kv_dtype
        self._provision: ProvisionStage | None = None
        self._run: _Run | None = None

    def _make_backend(self, spec: BackendSpec) -> StageBackend:
        raise NotImplementedError

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
        self.release()
        self._provision = provision

    def bind(self, gguf_source: GgufSource, progress: Progress | None = None) -> None:
        """Load the stage's tensors onto the backend. A file that cannot be run raises
        ``WorkerError`` whose ``__cause__`` is the typed ``UnsupportedModel`` or
        ``GgufError``; the worker then stays unbound."""
        p = self._provision
        if p is None:
            raise WorkerError("bind before configure")
        self._drop_run()
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
        backend: StageBackend | None = None
        try:
            with open_provisioned_slice(gguf_source, p, self.capabilities) as stage:
                c = stage.config
                limit = self.max_head_dim
                if limit is not None and max(c.head_dim_k, c.head_dim_v) > limit:
                    raise UnsupportedModel(
                        stage.path,
                        f"head size {c.head_dim_k} (keys) / {c.head_dim_v} (values): the "
                        f"CUDA attention kernel takes up to {limit}",
                    )
                backend = self._make_backend(spec)
                backend.load(stage, p.model.max_seq_len, progress)
                vocab = stage.vocab_size
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
        self._run = _Run(backend, vocab, sampling)

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
        self._drop_run()
        self._provision = None

    def _drop_run(self) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            run.backend.release()

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


#: What the CUDA worker runs: the reference worker's architectures and all 13 types;
#: weights stay as the file stores them and the KV cache takes the activation dtype
#: (``kv_dtype="auto"``), which is what the planner's memory check counts.
CUDA_CAPABILITIES = WorkerCapabilities(
    name="cuda",
    architectures=REFERENCE_ARCHITECTURES,
    quant_types=QUANT_TYPES,
    weight_bytes_per_element=0,
    kv_bytes_per_element=0,
)


class CudaWorker(StageWorker):
    """One stage's compute engine on a CUDA GPU. Implements ``runtime_core.worker.Worker``.
    CuPy is imported at ``bind``, not before."""

    capabilities: ClassVar[WorkerCapabilities] = CUDA_CAPABILITIES

    def __init__(
        self,
        *,
        matvec: str = "q8",
        kv_dtype: str = "auto",
        use_graph: bool = True,
        device_io: bool = False,
        device: int = 0,
    ) -> None:
        super().__init__(matvec=matvec, kv_dtype=kv_dtype)
        self.use_graph = use_graph
        self.device_io = device_io
        self.device = device

    def set_use_graph(self, use_graph: bool) -> None:
        """Switch decode steps between graph replays and eager launches; takes effect
        at the next step (a graph is captured at the first graph step)."""
        self.use_graph = use_graph
        if self._run is not None:
            self._run.backend.use_graph = use_graph  # type: ignore[attr-defined]

    def _make_backend(self, spec: BackendSpec) -> StageBackend:
        try:
            from runtime_cupy.device_stage import DeviceBackend
        except ImportError as exc:
            raise WorkerError(f"the CUDA worker needs CuPy: {exc}") from exc
        return DeviceBackend(
            spec, use_graph=self.use_graph, device_io=self.device_io, device=self.device
        )
