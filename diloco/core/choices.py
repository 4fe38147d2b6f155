"""The names of the algorithm's choices that a job spec states, apart from the code behind them.

The spec (and so the operator, the syncer and every learner before it reads its manifest)
imports these; the codecs, merges and adoption they name import numpy kernels and numba, which
cost a learner's start about a third of a second and the operator more memory for nothing it
uses. Each implementing module re-exports its own name.
"""

from __future__ import annotations

from typing import Literal

Codec = Literal["fp32", "bf16", "int8", "int4", "nf4"]  # diloco/core/codecs.py
CODECS: tuple[Codec, ...] = ("fp32", "bf16", "int8", "int4", "nf4")  # a codec's id on the wire is its index here
MergeMethod = Literal["rda", "average"]  # diloco/core/merge.py
Adoption = Literal["rebase", "overwrite"]  # diloco/core/ledger.py
