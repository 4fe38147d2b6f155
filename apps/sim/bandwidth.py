"""WAN bandwidth each method needs: data-parallel against Decoupled DiLoCo.

Data-parallel all-reduces bf16 gradients across sites every step and cannot overlap it with
compute, so the whole all-reduce must fit in the slice of the step the utilization target leaves.
Decoupled DiLoCo sends one fragment per step in the background; the link only has to keep up.
docs/simulator.md derives both formulas and compares them with the paper.
"""

from __future__ import annotations

from dataclasses import dataclass

# Wire bits per parameter, matching diloco/core/codecs.py: int8, int4 and nf4 carry one fp32
# absmax scale per block of 64 values (+0.5 bit per value).
SCALE_BITS_PER_VALUE = 32 / 64
BITS_PER_PARAM: dict[str, float] = {
    "fp32": 32.0,
    "bf16": 16.0,
    "int8": 8.0 + SCALE_BITS_PER_VALUE,
    "int4": 4.0 + SCALE_BITS_PER_VALUE,
    "nf4": 4.0 + SCALE_BITS_PER_VALUE,
}
GB = 1e9


@dataclass(frozen=True)
class BandwidthParams:
    """A training setup; the defaults are the paper's example (arXiv 2604.21428; docs/simulator.md)."""

    params: float = 5e9  # model parameters
    step_s: float = 1.0  # wall-clock time of one training step
    sites: int = 2  # datacenters; one learner per site, the syncer in one of them
    utilization: float = 0.9  # target fraction of the step spent computing (dp only)
    # Fragments P: each step ships 1/P of the model. The paper does not state P for this
    # example; its 1.7 GB/s for 5B bf16 parameters at 1 s steps means about a sixth of the
    # model per step, so 6 is our default (documented as calibrated in docs/simulator.md).
    fragments: int = 6
    # Steps a fragment may be in flight (spec.syncer.graceWindow.tau, default 2): its round trip (send the outer
    # gradient, receive the merged fragment) must finish within tau steps.
    tau: float = 2.0

    def validate(self) -> None:
        """Reject impossible setups, naming the offending field."""
        if not self.params > 0:
            raise ValueError(f"params must be positive, got {self.params}")
        if not self.step_s > 0:
            raise ValueError(f"step_s must be positive, got {self.step_s}")
        if self.sites < 1:
            raise ValueError(f"sites must be at least 1, got {self.sites}")
        if not 0 < self.utilization < 1:
            raise ValueError(f"utilization must be strictly between 0 and 1, got {self.utilization}")
        if self.fragments < 1:
            raise ValueError(f"fragments must be at least 1, got {self.fragments}")
        if not self.tau > 0:
            raise ValueError(f"tau must be positive, got {self.tau}")


def dp_bytes_per_s(p: BandwidthParams) -> float:
    """Per-site WAN rate for a ring all-reduce of bf16 gradients in (1 - u) of each step.

    A ring all-reduce over S sites makes each site send 2(S-1)/S of the gradient bytes.
    """
    ring = 2 * (p.sites - 1) / p.sites
    return ring * p.params * BITS_PER_PARAM["bf16"] / 8 / (p.step_s * (1 - p.utilization))


def decoupled_bytes_per_s(p: BandwidthParams, codec: str) -> float:
    """Per-site WAN rate (each direction) for Decoupled DiLoCo with the given wire codec.

    One fragment leaves every step and one merged fragment comes back, so the link must carry a
    fragment per step each way. A fragment's round trip is two transfers in sequence that must
    fit in tau steps; with tau >= 2 that is no stricter than keeping up, below 2 it is.
    """
    if p.sites == 1:
        return 0.0
    fragment = p.params / p.fragments * BITS_PER_PARAM[codec] / 8
    return fragment / p.step_s * max(1.0, 2.0 / p.tau)


def bandwidth_gb_s(p: BandwidthParams) -> dict[str, float]:
    """The three numbers of the paper's comparison, in GB/s."""
    p.validate()
    return {
        "dp": dp_bytes_per_s(p) / GB,
        "decoupled_bf16": decoupled_bytes_per_s(p, "bf16") / GB,
        "decoupled_int4": decoupled_bytes_per_s(p, "int4") / GB,
    }
