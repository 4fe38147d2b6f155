"""What every process does at start (diloco/launch.py): the allocator keeps freed memory (and a
syncer reserves its peak), and a learner's XLA:CPU leaves dots to XLA instead of YNNPACK.

Each check runs in a fresh interpreter: glibc's settings are process-wide and fixed for a
thread at its first allocation, so they cannot be toggled inside the test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from diloco.launch import XLA_CPU_FLAGS, xla_cpu_flags

CHILD = r"""
import json, resource, sys, threading
import numpy as np
if sys.argv[1] in ("keep", "reserve"):
    from diloco.launch import keep_freed_memory, reserve_heap
    keep_freed_memory()
    if sys.argv[1] == "reserve":
        reserve_heap(100 << 20)  # more than a round's 80 MiB

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


@pytest.mark.slow
def test_a_reserved_heap_is_faulted_in_at_start_and_not_by_the_first_work() -> None:
    kept, reserved = _faults("keep"), _faults("reserve")
    huge_pages = 2 * (40 << 20) // (2 << 20)
    assert kept[0] >= huge_pages, kept  # without a reserve the first round faults its pages in
    assert max(reserved) < 20, reserved  # with one, not even the first


XLA_CHILD = r"""
import sys
import jax, jax.numpy as jnp
if sys.argv[1] == "learner":
    from diloco.launch import learner_runtime
    learner_runtime()  # after importing JAX, as a forked learner does: XLA reads its flags at first use
f = jax.jit(lambda a, b: jnp.tanh(a @ b))
print(f.lower(jnp.ones((64, 64)), jnp.ones((64, 64))).compile().as_text())
"""


def _compiled(mode: str, xla_flags: str = "") -> str:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | ({"XLA_FLAGS": xla_flags} if xla_flags else {})
    out = subprocess.run([sys.executable, "-P", "-c", XLA_CHILD, mode], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.slow
def test_a_learner_runs_dots_without_ynnpack_fusions_unless_the_user_says_otherwise() -> None:
    assert "__ynn_fusion" in _compiled("default")  # XLA's default, which costs every restart its first step
    assert "__ynn_fusion" not in _compiled("learner")
    assert "__ynn_fusion" not in _compiled("learner", "--xla_force_host_platform_device_count=2")
    assert "__ynn_fusion" in _compiled("learner", "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT")


def test_xla_cpu_flags_keep_the_users_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    xla_cpu_flags()
    xla_cpu_flags()  # idempotent
    assert os.environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=4", *XLA_CPU_FLAGS]
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT")
    xla_cpu_flags()
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT"


SPLIT = r"""
import json, os, sys, threading
from pathlib import Path
from diloco.launch import pin_cpus
from diloco.trainer.runtime import split_host_threads
pin_cpus(sys.argv[1])
split_host_threads(sys.argv[2])
import jax, jax.numpy as jnp

def busy():  # CPU time (ns) of each thread but this one
    me = str(threading.get_native_id())
    return {t.name: int((t / "schedstat").read_text().split()[0]) for t in Path("/proc/self/task").iterdir() if t.name != me}

started = []
t = threading.Thread(target=lambda: started.append(sorted(os.sched_getaffinity(0))))  # as gRPC's and the sender are
t.start(); t.join()
f = jax.jit(lambda a: jnp.tanh(a @ a).sum())
a = jnp.ones((256, 256))
f(a).block_until_ready()
before = busy()
for _ in range(100):
    out = f(a)
out.block_until_ready()
after = busy()
compute = max(after, key=lambda tid: after[tid] - before.get(tid, 0))
print(json.dumps({"main": sorted(os.sched_getaffinity(0)), "started": started[0],
                  "compute": sorted(os.sched_getaffinity(int(compute)))}))
"""


@pytest.mark.slow
def test_host_cpus_take_the_learners_own_threads_and_leave_the_device_cpus_to_xla() -> None:
    """`--host-cpus` (diloco/launch.py): the main thread and every thread it starts later move to
    the host CPUs, and XLA's computations still run on the device CPUs (`--cpus`)."""
    cpus = sorted(os.sched_getaffinity(0))
    # The suite needs two CPUs anyway (tests/apps/testkit/test_wan.py pins learners to cores 0 and 1).
    assert len(cpus) >= 2, f"two CPUs tell the device's from the host's; this process may use {cpus}"
    device, host = cpus[0], cpus[1]
    out = subprocess.run([sys.executable, "-c", SPLIT, str(device), str(host)], capture_output=True, text=True,
                         timeout=120, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"main": [host], "started": [host], "compute": [device]}, seen


@pytest.mark.parametrize("spec", ["x", "99999"])
def test_a_bad_host_cpus_flag_names_the_flag_and_the_cpus_there_are(spec: str) -> None:
    from diloco.trainer.runtime import split_host_threads

    before = os.sched_getaffinity(0)
    with pytest.raises(SystemExit, match=r"--host-cpus '.+': .*it may use"):
        split_host_threads(spec)
    assert os.sched_getaffinity(0) == before


def test_the_loop_overlaps_its_host_work_with_the_step_only_where_that_work_has_a_core_of_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A learner adopts news and encodes its pushes behind the step on an accelerator or with
    `--host-cpus`; on a CPU learner sharing the step's core, at the boundary before it, where
    the overlap saves nothing and costs a step of lateness (docs/ALGORITHM.md, "The learner loop")."""
    import jax

    from diloco.trainer.bringup import overlaps

    assert jax.default_backend() == "cpu"
    assert not overlaps(None)
    assert overlaps("1")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert overlaps(None)
