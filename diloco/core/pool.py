"""Fragment-sized fp32 memory, reused once nothing holds it.

Every publish writes new fragment-sized arrays (Θ_p after the outer step, the publisher's view
V_p) instead of overwriting the old ones, which a checkpoint writer or a joining learner's
snapshot may still be reading. Fresh memory for them costs more than the pass that fills it
(page faults and the kernel zeroing each page: 65 ms of system time against 22 ms for copying
166 MB, one fragment of a 1e9-parameter model at P = 24, on our machines). A pool hands the
memory of a replaced fragment to the next one once CPython's reference count says nothing else
holds it: every numpy view and every buffer export keeps a reference to the array it came from.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping

import numpy as np

_UNHELD = 3  # references to a free buffer while it is checked: the pool's list, the loop name, the call


class Pool:
    """Flat fp32 buffers, each as large as the largest fragment asked for so far (so one fits
    any fragment), carved into a fragment's arrays."""

    def __init__(self, keep: int = 2):
        self.size = 0
        self.keep = keep  # replaced buffers to remember: a reader may hold the newest for a while
        self._replaced: list[np.ndarray] = []

    def arrays(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        """Arrays of these shapes (contents undefined), carved from one buffer in order."""
        sizes = {name: math.prod(shape) for name, shape in shapes.items()}
        if sum(sizes.values()) > self.size:
            self.size, self._replaced = sum(sizes.values()), []
        flat = self._take()
        out: dict[str, np.ndarray] = {}
        at = 0
        for name, shape in shapes.items():
            out[name], at = flat[at : at + sizes[name]].reshape(shape), at + sizes[name]
        return out

    def replaced(self, arrays: Iterable[np.ndarray]) -> None:
        """These arrays were replaced by newer ones: their buffer (if they are one of ours, carved
        by `arrays`) may be reused once the last reader lets go of it."""
        bases = {id(a.base): a.base for a in arrays}
        if len(bases) != 1:
            return
        (base,) = bases.values()
        if isinstance(base, np.ndarray) and base.dtype == np.float32 and base.ndim == 1 and base.size == self.size:
            self._replaced = ([b for b in self._replaced if b is not base] + [base])[-self.keep:]

    def _take(self) -> np.ndarray:
        for i in range(len(self._replaced)):
            buf = self._replaced[i]
            if sys.getrefcount(buf) <= _UNHELD:
                del self._replaced[i]
                return buf
            del buf
        return np.empty(self.size, np.float32)
