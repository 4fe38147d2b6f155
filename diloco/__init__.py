"""Decoupled DiLoCo: asynchronous, fault-tolerant, low-bandwidth LLM pre-training.

Shared code lives here (`diloco.core` is the algorithm, `diloco.spec` the job spec);
the learner, syncer and operator import as `diloco.trainer`, `diloco.syncer` and
`diloco.operator` from the top-level folders of the same names.
"""

__version__ = "0.1.0"
