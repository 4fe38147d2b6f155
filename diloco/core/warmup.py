"""The compiled kernels (`diloco/core/kernels.py`) compiled ahead, through the calls their users make.

numba compiles a kernel at its first call, per argument types; a pod that compiled at its first
round would hold that round up by seconds. The images run `python -m diloco.core.warmup` at
build time (the cache lands beside `diloco/core/kernels.py`), the syncer warms at start and a learner in the
background while JAX starts. Apart from `diloco/core/kernels.py` so the kernels import nothing of what they
serve: the codecs, the merge and the outer step import the loops, and this imports them.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from diloco.core.choices import Codec
from diloco.core.codecs import CODECS, decode_tensors, encode_tensors, parse_tensors
from diloco.core.merge import merge_fragment, merge_updates
from diloco.core.outer import NesterovSGD


def warm_codecs(codecs: Iterable[Codec], block: int = 64) -> None:
    """Compile (or load from the cache) the encode and decode kernels of `codecs`: a learner
    runs this in the background while JAX starts, so its first push and adoption after a
    (re)join are not held up by loading them (about 0.3 s cached, seconds cold)."""
    x = {"w": np.linspace(-1.0, 1.0, 3 * block + 5, dtype=np.float32)}
    for codec in codecs:
        decode_tensors(encode_tensors(x, codec, block))


def warm(block: int = 64) -> None:
    """Compile (or load from the cache) every kernel a syncer and a learner use, through the
    same calls they make: an image runs this at build time, so pods start with compiled code."""
    warm_codecs(CODECS, block)
    x = {"w": np.linspace(-1.0, 1.0, 3 * block + 5, dtype=np.float32)}
    for codec in CODECS:
        packed = parse_tensors(encode_tensors(x, codec, block))
        merged = merge_updates([packed, x], [1.0, 2.0], "rda", scales=[1.0, 0.5])
        merge_fragment([packed, packed], [1.0, 1.0], "average")
        for mu in (0.0, 0.9):
            NesterovSGD(0.7, mu).step(x, {n: u.values for n, u in merged.items()}, {n: u.factor for n, u in merged.items()})


if __name__ == "__main__":  # python -m diloco.core.warmup: compile ahead (the Dockerfiles do)
    warm()
