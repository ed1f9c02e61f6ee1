"""The reference model's mixture of experts (``workers.experts`` routes each row), a
part of ``StageModel``."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from runtime_core.model_config import ModelConfig
from runtime_core.workers.experts import route, shared_gate, weighted_sum
from runtime_core.workers.reference.functions import linear, silu
from runtime_core.workers.reference.weights import BlockWeights

F32 = npt.NDArray[np.float32]


class MixtureOfExperts:
    """A block's mixture of experts in place of its feed-forward (a mix-in of
    ``StageModel``)."""

    config: ModelConfig

    def _experts(self, w: BlockWeights, xn: F32) -> F32:
        """The mixture of experts' output for the normalized rows ``xn`` (``experts``)."""
        assert w.router is not None
        routing = route(
            linear(xn, w.router), self.config.n_experts_used, self.config.spec.expert_weights_norm
        )
        outputs = np.empty((routing.experts.shape[1], *xn.shape), np.float32)
        f = w.w13.shape[2] // 2
        for e, rows, slots in routing.by_expert():
            h = linear(xn[rows], w.w13[e])  # (n, 2 * ffn): gate | up
            gate = h[:, :f]
            silu(gate)
            gate *= h[:, f:]
            outputs[slots, rows] = linear(gate, w.w2[e].T) * routing.weights[rows, slots, None]
        out = weighted_sum(outputs)
        if w.shared_w13 is not None and w.shared_w2 is not None and w.shared_gate is not None:
            h = linear(xn, w.shared_w13)  # qwen2moe's shared expert, times its gate
            fs = h.shape[1] // 2
            gate = h[:, :fs]
            silu(gate)
            gate *= h[:, fs:]
            shared = linear(gate, w.shared_w2.T) * shared_gate(xn @ w.shared_gate)[:, None]
            out += shared
        return out
