"""The outer optimizer: SGD with Nesterov momentum, one state per fragment (docs/ALGORITHM.md, "The syncer": Outer step).

b ← μ·b + Δ;  Θ ← Θ − lr·(Δ + μ·b).  The state is plain arrays so it checkpoints
with the global fragments and restores bit-for-bit. At μ = 0 (the default) there is no state:
a buffer would be a model-sized array of zeros in memory and in every checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from diloco.core import kernels


@dataclass
class NesterovSGD:
    learning_rate: float  # spec.syncer.outerLearningRate
    momentum: float  # spec.syncer.outerMomentum
    buffers: dict[str, np.ndarray] = field(default_factory=dict)

    def step(self, params: Mapping[str, np.ndarray], outer_grad: Mapping[str, np.ndarray],
             factors: Mapping[str, float] | None = None) -> dict[str, np.ndarray]:
        """Return the updated tensors of one fragment (one fused pass per tensor); momentum
        buffers update in place. `factors[name]` scales that tensor's outer gradient inside the
        same pass (the merge's `Update.factor`), so Δ is never rewritten to scale it."""
        out: dict[str, np.ndarray] = {}
        lr, mu = np.float32(self.learning_rate), np.float32(self.momentum)
        for name, delta in outer_grad.items():
            param = np.ascontiguousarray(params[name], dtype=np.float32)
            c = np.float32(1.0 if factors is None else factors[name])
            out[name] = np.empty_like(param)  # a new array: readers of the old Θ keep a consistent copy
            flat = np.ascontiguousarray(delta, dtype=np.float32).reshape(-1)
            if mu == 0:  # plain SGD (the default outer step): no buffer is read, so none is kept
                kernels.sgd_step(param.reshape(-1), flat, np.float32(lr * c), out[name].reshape(-1))
                continue
            buf = self.buffers.get(name)
            if buf is None:
                buf = self.buffers[name] = np.zeros_like(param)
            kernels.nesterov_step(param.reshape(-1), buf.reshape(-1), flat, c, lr, mu, out[name].reshape(-1))
        return out

    def state_dict(self) -> dict[str, np.ndarray]:
        return {name: buf.copy() for name, buf in self.buffers.items()}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        self.buffers = {name: np.array(buf, dtype=np.float32) for name, buf in state.items()}
