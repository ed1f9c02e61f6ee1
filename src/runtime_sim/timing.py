"""The timing model: how long a stage's step takes and what a plan will do.

A step reads its stage's weights once (decode is bound by that read) and does about
``2 * weights`` floating-point operations per row (prefill over many rows is bound by
that); each hop moves ``rows * hidden_dim * width`` bytes over a link with latency and
bandwidth. With one token in flight (the MVP), the time per output token is the sum
over stages of a decode step and a hop, and the time to first token the same with the
prompt's rows.
"""

from __future__ import annotations

from attrs import frozen

from runplan import RunPlan
from runplan.gguf_header import GgufHeader


@frozen
class NodeProfile:
    """How fast a node's worker runs. The defaults describe a 2-core CPU host running
    the NumPy reference worker; ``benchmarks/timing_model.py`` calibrates them."""

    # Defaults: what benchmarks/timing_model.py fitted on the 2-core development host.
    read_bytes_per_s: float = 27e9  # weights streamed per second in a decode step
    flops_per_s: float = 200e9  # sustained in a prefill matrix product
    step_overhead_us: float = 50.0  # per step, whatever its size (Python, dispatch)
    layer_overhead_us: float = 85.0  # per block in a step (the many small kernels)
    # Assumed, not measured: how fast weights load (and dequantize).
    load_bytes_per_s: float = 1.5e9


@frozen
class LinkProfile:
    """How a record crosses from one stage to the next. Assumed, not measured: shared
    memory on one host (``benchmarks/hop_overhead.py`` of the process runtime measures
    the real hop)."""

    latency_us: float = 30.0  # one hop of a record
    bytes_per_s: float = 5e9


@frozen
class StageCost:
    """What one stage's step touches: ``read_bytes`` of weights per step, and the weight
    elements it multiplies per row (``2 * elements`` flops a row)."""

    read_bytes: int
    elements: int
    load_bytes: int
    layers: int = 0


@frozen
class Prediction:
    ttft_us: float  # time to first token, after the readiness barrier
    tpot_us: float  # time per output token
    load_us: float  # the slowest stage's load

    @property
    def tokens_per_s(self) -> float:
        return 1e6 / self.tpot_us if self.tpot_us > 0 else float("inf")


@frozen
class TimingModel:
    node: NodeProfile = NodeProfile()
    link: LinkProfile = LinkProfile()

    def step_us(self, cost: StageCost, rows: int) -> float:
        read = cost.read_bytes / self.node.read_bytes_per_s * 1e6
        compute = 2.0 * cost.elements * rows / self.node.flops_per_s * 1e6
        fixed = self.node.step_overhead_us + cost.layers * self.node.layer_overhead_us
        return fixed + max(read, compute)

    def hop_us(self, payload_bytes: int) -> float:
        return self.link.latency_us + payload_bytes / self.link.bytes_per_s * 1e6

    def load_us(self, cost: StageCost) -> float:
        return cost.load_bytes / self.node.load_bytes_per_s * 1e6

    def predict(self, plan: RunPlan, costs: list[StageCost], prompt_rows: int) -> Prediction:
        row_bytes = plan.model.hidden_dim * plan.model.dtype_width_bytes

        def pass_us(rows: int) -> float:
            total = self.hop_us(rows * 4)  # token-in
            for i, cost in enumerate(costs):
                total += self.step_us(cost, rows)
                last = i == len(costs) - 1
                total += self.hop_us(4 if last else rows * row_bytes)
            return total

        return Prediction(
            ttft_us=pass_us(prompt_rows),
            tpot_us=pass_us(1),
            load_us=max((self.load_us(c) for c in costs), default=0.0),
        )


def f32_stage_costs(plan: RunPlan) -> list[StageCost]:
    """Costs for a worker that holds its weights as float32 (the NumPy reference
    worker): 4 bytes per element, elements read from the GGUF header."""
    header = GgufHeader.read(plan.model.gguf_source.paths[0])
    elements: dict[str, int] = {}
    for name, info in header.tensors.items():
        n = 1
        for d in info.shape:
            n *= d
        elements[name] = n
    head = "output.weight" if "output.weight" in elements else "token_embd.weight"
    costs = []
    for i, stage in enumerate(plan.stages):
        names = [
            n
            for n in elements
            if n.startswith("blk.")
            and stage.layer_start <= int(n.split(".")[1]) < stage.layer_end_exclusive
        ]
        matmul = sum(elements[n] for n in names)
        if i == len(plan.stages) - 1:
            matmul += elements[head]
        stored = sum(header.tensors[n].n_bytes for n in names)
        costs.append(
            StageCost(
                read_bytes=4 * matmul,
                elements=matmul,
                load_bytes=stored,
                layers=stage.layer_end_exclusive - stage.layer_start,
            )
        )
    return costs


def stored_stage_costs(
    plan: RunPlan, block_bytes: tuple[int, ...], head_bytes: int, bits_per_element: float = 4.5
) -> list[StageCost]:
    """Costs for a worker that reads its weights as stored (quantized on a GPU, or the
    synthetic worker): ``block_bytes`` per block, the head on the last stage; elements
    from ``bits_per_element`` (Q4_K is about 4.5)."""
    costs = []
    for i, stage in enumerate(plan.stages):
        read = sum(block_bytes[stage.layer_start : stage.layer_end_exclusive])
        if i == len(plan.stages) - 1:
            read += head_bytes
        elements = int(read * 8 / bits_per_element)
        layers = stage.layer_end_exclusive - stage.layer_start
        costs.append(StageCost(read_bytes=read, elements=elements, load_bytes=read, layers=layers))
    return costs
