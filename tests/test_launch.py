"""What every process does at start (diloco/launch.py): the allocator keeps freed memory.

Each check runs in a fresh interpreter: glibc's settings are process-wide and fixed for a
thread at its first allocation, so they cannot be toggled inside the test process.
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, threading
import numpy as np
if sys.argv[1] == "keep":
    from diloco.launch import keep_freed_memory
    keep_freed_memory()

def churn(out):
    # What a learner's XLA thread does every step: allocate large buffers, touch, free.
    faults = []
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        bufs = [np.ones(10 << 20, np.float32) for _ in range(2)]  # 2 x 40 MiB: above glibc's largest mmap threshold
        del bufs
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    out.extend(faults)

faults = []
t = threading.Thread(target=churn, args=(faults,))  # a thread of its own, as XLA's is
t.start(); t.join()
print(json.dumps(faults))
"""


def _faults(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-P", "-c", CHILD, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def test_freed_memory_is_reused_without_faulting_pages_in_again() -> None:
    default, kept = _faults("default"), _faults("keep")
    huge_pages = 2 * (40 << 20) // (2 << 20)  # one round's 80 MiB in 2 MiB pages (4 KiB pages: 20,480)
    # glibc's default maps fresh memory for every round; kept, only the first round faults.
    assert min(default[1:]) >= huge_pages, default
    assert max(kept[1:]) < 20, kept
