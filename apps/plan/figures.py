"""Every measured constant `diloco plan` uses, each with the docs/BENCHMARKS.md figure it comes from.

A plan is only as good as the parts it is built from, so none of these is a guess: each names
the section and row it was read from, and the plan prints that source beside every figure it
derives. Where a constant is derived from two measurements (the syncer's chain model, the
syncer's memory), the derivation is written next to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.apps.sim.bandwidth import BITS_PER_PARAM
from diloco.spec import Syncer

_DEFAULTS = Syncer()


@dataclass(frozen=True)
class Figure:
    """One constant: its value, unit and where it was measured."""

    value: float
    unit: str
    source: str


# --- The syncer shard's capacity (§5) -------------------------------------------------------
# One shard's work per slot is a chain: receive and admit the pushes, merge, outer step, encode
# the broadcast's delta, send it to every learner. At 1e9 parameters, P = 24 (one 41.4M-parameter
# fragment per slot), one shard on one core sustains 10 learners at 1 s steps (the conservative
# end of "10 to 12 from run to run") and 2 at 0.5 s steps. Fitting chain = fixed + per_push x M
# to both (fixed + 10 x per_push = 1.0 s; fixed + 2 x per_push = 0.5 s) gives per_push 0.0625 s
# (the slope of the worst merge arrival from 9 to 12 learners in §5 is 0.063 s: consistent) and
# fixed 0.375 s. Both scale with the fragment's size (every pass of the chain is over its bytes).
REF_FRAGMENT_PARAMS = Figure(993e6 / 24, "parameters",
                             "BENCHMARKS §5, key 1e9@24@1.0: 993M parameters / P 24 (166 MB fp32 fragment)")
SHARD_LEARNERS_1S = Figure(10, "learners",
                           "BENCHMARKS §5, 1e9@24@1.0: 10 to 12 learners on one shard (the low end)")
SHARD_LEARNERS_05S = Figure(2, "learners", "BENCHMARKS §5 'Two shards' table, 1e9@24@0.5, one shard: 2")
CHAIN_PER_PUSH_S = Figure(0.5 / (SHARD_LEARNERS_1S.value - SHARD_LEARNERS_05S.value), "s per push",
                          "fit to BENCHMARKS §5's 10 learners at 1 s and 2 at 0.5 s (1e9@24, one shard)")
CHAIN_FIXED_S = Figure(1.0 - SHARD_LEARNERS_1S.value * CHAIN_PER_PUSH_S.value, "s per slot",
                       "the same fit: 1 s - 10 x per-push")
SHARD_MAX_LEARNERS_MEASURED = Figure(48, "learners",
                                     "BENCHMARKS §5, 1e8@24@1.0: 48 (the most learners any shard was run with)")
SHARD_CORES = Figure(1, "core", "BENCHMARKS §5: every capacity above is one shard pinned to one core")

# --- The syncer's memory (§9, §5) -----------------------------------------------------------
# Peak RSS 3.0 GB at 91.2M parameters (§9) and 13.9 GB at 993M with the heap head-room reserved
# (§5 "Memory"): a line through both gives ~12 bytes a parameter plus ~1.9 GB of process.
_RSS_SMALL = (91_245_312, 3.0e9)
_RSS_LARGE = (993e6, 13.9e9)
SYNCER_BYTES_PER_PARAM = Figure((_RSS_LARGE[1] - _RSS_SMALL[1]) / (_RSS_LARGE[0] - _RSS_SMALL[0]), "B/param",
                                "BENCHMARKS §9 (syncer peak RSS 3.0 GB at 91M) and §5 Memory (13.9 GB at 1e9 "
                                "with head-room): the slope")
SYNCER_FIXED_BYTES = Figure(_RSS_SMALL[1] - SYNCER_BYTES_PER_PARAM.value * _RSS_SMALL[0], "B",
                            "the same line's intercept")

# --- The wire (§2, diloco/core/codecs.py) ---------------------------------------------------
# The codecs a plan's manifest leaves at the spec's defaults, so the plan's bytes are the job's.
UP_CODEC, DOWN_CODEC = _DEFAULTS.compression, _DEFAULTS.broadcast_compression
UP_BITS = Figure(BITS_PER_PARAM[UP_CODEC], "bits/param",
                 f"diloco/core/codecs.py {UP_CODEC} pushes, one fp32 scale per 64 values "
                 "(spec.syncer.compression; BENCHMARKS §2 codec floor)")
DOWN_BITS = Figure(BITS_PER_PARAM[DOWN_CODEC], "bits/param",
                   f"diloco/core/codecs.py {DOWN_CODEC} broadcast deltas (spec.syncer.broadcastCompression; "
                   "BENCHMARKS §14-15)")
PROTOCOL_OVERHEAD = Figure(85.3 / 80.9, "x the codec's bytes",
                           "BENCHMARKS §2, int4 P = 24: measured 80.9x fewer bytes than bf16 DP against "
                           "the codec floor's 85.3x (gRPC and bundle headers)")

# --- Checkpoints and re-admission (§9, §5) --------------------------------------------------
CHECKPOINT_BYTES_PER_PARAM = Figure(365e6 / 91_245_312, "B/param",
                                    "BENCHMARKS §9: a 365 MB checkpoint of 91.2M parameters (Θ in fp32)")
CHECKPOINT_WRITE_BPS = Figure(365e6 / 5.0, "B/s",
                              "BENCHMARKS §9: the first 365 MB checkpoint took 5.0 s (later ones 0.6-1.0 s)")
JOIN_BYTES_PER_SECOND = Figure(2.5e8, "B/s",
                               "spec.syncer.joinBytesPerSecond default, chosen in BENCHMARKS §5 'A whole Join'")
JOIN_BYTES_PER_PARAM = Figure(4.0, "B/param", "BENCHMARKS §9: a Join pulls Θ in fp32 (365 MB for 91.2M)")

# --- The paper's bandwidth example (SPEC.md §4, docs/simulator.md) ---------------------------
PAPER_BANDWIDTH_GB_S = {"dp": 104.0, "decoupled_bf16": 1.7, "decoupled_int4": 0.43}
PAPER_SOURCE = "arXiv 2604.21428 via SPEC.md §4: 5B, 1 s step, 2 datacenters, 90% utilization"
