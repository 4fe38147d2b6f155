"""Which compiled loops a block-wise codec (int8, int4, nf4) runs, loaded at its first use.

diloco/core/codecs.py states the formats; the loops are in diloco/core/kernels.py (int4, int8)
and diloco/core/nf4.py, both importing numba, which a learner's join (fp32) never needs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from diloco.core.choices import Codec


class _Lazy:
    """diloco/core/kernels.py, imported at the first int codec's use: it imports numba (0.25 s,
    and 0.4 s more to load the kernels), which a learner's join (fp32) never needs; a
    restarted learner loads them once it has joined."""

    module: ModuleType | None = None

    def __getattr__(self, name: str) -> Any:
        if _Lazy.module is None:
            from diloco.core import kernels as loaded

            _Lazy.module = loaded
        return getattr(_Lazy.module, name)


loops = _Lazy()

BLOCKWISE: tuple[Codec, ...] = ("int8", "int4", "nf4")  # an fp32 scale per block, then the codes


@dataclass(frozen=True)
class Loops:
    """One block-wise codec's loops at one block size (signatures: diloco/core/kernels.py's int4)."""

    encode: Any
    encode_delta: Any
    decode: Any
    weighted_sum: Any
    sumsq: Any
    per_block: int  # code bytes per block
    dtype: type[np.generic]  # the codes' type


@functools.cache
def for_codec(codec: Codec, block: int) -> Loops:
    if codec == "nf4":
        from diloco.core import nf4  # numba, like `loops`: at the first use

        n = nf4.block_kernels(block)
        return Loops(n.encode, n.encode_delta, n.decode, n.weighted_sum, n.sumsq, block // 2, np.uint8)
    k = loops.block_kernels(block)
    if codec == "int4":
        return Loops(k.int4_encode, k.int4_encode_delta, k.int4_decode, k.int4_weighted_sum, k.int4_sumsq,
                     block // 2, np.uint8)
    return Loops(k.int8_encode, k.int8_encode_delta, k.int8_decode, k.int8_weighted_sum, k.int8_sumsq,
                 block, np.int8)
