"""The CUDA worker (EDGES_AND_WORKERS.md §4): one stage on an NVIDIA GPU.

Weights stay quantized on the device in their GGUF block layout; the kernels of
``kernels/*.cu`` dequantize them as they multiply (``forward_program.py`` has the sequence
of a step). The residual stream inside a stage is float32; activations leave and
enter the stage in the plan's dtype (the process runtime plans CUDA runs with f16, bf16
for gemma2 and gemma3: ``runtime_cupy.workers.activation_dtype``; f32 when a plan says
so). The last stage computes the logits, the greedy token (or, with a
temperature, the reference sampler's draw) on the device; only the id comes back,
and the logits only when the run asks for them.

Options (``CudaWorker(...)``):

- ``matvec``, ``kv_dtype`` and ``trace``: as for every stage worker
  (``runtime_core.workers.stage_worker``); ``trace`` receives ``graph captured``.
- ``use_graph``: decode steps replay a CUDA graph captured at the first decode step
  (position and token are read from device memory); ``False`` launches every kernel
  from Python each step, for comparison.
- ``device_io``: a stage that is not the last returns its activations as a CuPy array
  on the device, and every stage accepts CuPy arrays, so that stages on one GPU pass
  activations device to device. Default: NumPy arrays, as the worker interface says.
- ``device``: the CUDA device index.

``runtime_core.workers.stage_worker.StageWorker`` holds everything that is not CUDA (the
checks of the interface, the sequence and position, edges' dtypes, sampling state);
the CUDA worker is that over ``backend.DeviceBackend`` (CuPy, imported only at
``bind``).
"""

from __future__ import annotations

from typing import ClassVar

from runplan import WorkerCapabilities
from runplan.config import REFERENCE_ARCHITECTURES
from runplan.quant_types import CHUNK, QUANT_TYPES
from runtime_core.errors import UnsupportedModel
from runtime_core.gguf_slice import StageSlice
from runtime_core.workers.interface import TraceEvent, WorkerError
from runtime_core.workers.stage_worker import BackendSpec, StageBackend, StageWorker
from runtime_cupy.cuda.kernels import ATTENTION_MAX_HEAD_DIM

#: What the CUDA worker runs: every architecture of the reference worker
#: (``runtime_core.architectures``), mixtures of experts included (their steps run
#: without captured graphs: each step's routing is read back to the host), and every
#: type of ``runplan.quant_types``; weights
#: stay as the file stores them and the KV cache takes the activation dtype, or the one
#: the runtime's ``kv_dtype`` sets (``kv_dtype="auto"``: the plan's
#: ``kv_dtype_width_bytes``; a sliding block's holds its window), which is what the planner's
#: memory check counts.
CUDA_CAPABILITIES = WorkerCapabilities(
    name="cuda",
    architectures=REFERENCE_ARCHITECTURES,
    quant_types=QUANT_TYPES,
    weight_bytes_per_element=0,
    kv_bytes_per_element=0,
    row_multiple=CHUNK,
)


class CudaWorker(StageWorker):
    """One stage's compute engine on a CUDA GPU. Implements
    ``runtime_core.workers.interface.Worker``. CuPy is imported at ``bind``, not before."""

    capabilities: ClassVar[WorkerCapabilities] = CUDA_CAPABILITIES

    def __init__(
        self,
        *,
        matvec: str = "q8",
        kv_dtype: str = "auto",
        use_graph: bool = True,
        device_io: bool = False,
        device: int = 0,
        trace: TraceEvent | None = None,
    ) -> None:
        super().__init__(matvec=matvec, kv_dtype=kv_dtype, trace=trace)
        self.use_graph = use_graph
        self.device_io = device_io
        self.device = device

    def _check_stage(self, stage: StageSlice) -> None:
        c = stage.config
        if max(c.head_dim_k, c.head_dim_v) > ATTENTION_MAX_HEAD_DIM:
            raise UnsupportedModel(
                stage.path,
                f"head size {c.head_dim_k} (keys) / {c.head_dim_v} (values): the "
                f"CUDA attention kernel takes up to {ATTENTION_MAX_HEAD_DIM}",
            )

    def _make_backend(self, spec: BackendSpec) -> StageBackend:
        try:
            from runtime_cupy.cuda.backend import DeviceBackend
        except ImportError as exc:
            raise WorkerError(f"the CUDA worker needs CuPy: {exc}") from exc
        return DeviceBackend(
            spec,
            use_graph=self.use_graph,
            device_io=self.device_io,
            device=self.device,
            trace=self.trace,
        )
