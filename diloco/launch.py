"""What every process entry point shares: reading the job config and token, CPU pinning, the
allocator's settings."""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import sys

from diloco.contract import MIN_TOKEN_CHARS, TOKEN_ENV, Exit
from diloco.spec import DecoupledDiLoCoJob, SpecError, load_job

log = logging.getLogger("diloco")


def load_config(path: str, *, pretrained: bool = False, inputs: bool = False) -> DecoupledDiLoCoJob:
    """Load the manifest or exit 2 with one line per problem (nothing is started). `pretrained`:
    read spec.model.pretrained's config.json into the spec (what the model's users need; the
    syncer needs no architecture); `inputs`: that, and check every file the job reads is there
    (diloco/inputs.py), as `diloco run` does before it starts a process."""
    from diloco import hf
    from diloco import inputs as files

    try:
        job = load_job(path)
        if inputs:
            return files.check(job)
        return hf.resolve(job) if pretrained else job
    except SpecError as exc:
        for line in exc.problems:
            print(line, file=sys.stderr)
        raise SystemExit(Exit.CONFIG) from None


def read_token(args: argparse.Namespace) -> str:
    """The per-job token from --token-file or $DILOCO_TOKEN; refusing to run without one."""
    token = ""
    if getattr(args, "token_file", None):
        try:
            with open(args.token_file, encoding="utf-8") as fh:
                token = fh.read().strip()
        except OSError as exc:
            raise SystemExit(f"--token-file {args.token_file}: {exc.strerror}") from None
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise SystemExit(
            f"a job token of at least {MIN_TOKEN_CHARS} characters is required: pass --token-file or set ${TOKEN_ENV}"
        )
    return token


def pin_cpus(spec: str | None) -> None:
    """Pin this process to CPUs (`"0"`, `"0,1"`) before JAX starts: XLA's thread flags do nothing
    on small CPU hosts, and pinned learners share cores fairly (docs/DEVELOPMENT.md, "Several processes on few cores")."""
    if spec:
        pin(cpu_set(spec, "--cpus"), "--cpus")


def cpu_set(spec: str, flag: str) -> set[int]:
    try:
        cpus = {int(c) for c in spec.split(",") if c.strip()}
    except ValueError:
        cpus = set()
    if not cpus:
        raise SystemExit(_bad_cpus(flag, spec, "not a list of CPU numbers"))
    return cpus


def pin(cpus: set[int], flag: str) -> None:
    """Pin the calling thread; on Linux the threads it starts later inherit its CPUs."""
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        raise SystemExit(_bad_cpus(flag, ",".join(map(str, sorted(cpus))), exc.strerror or str(exc))) from None


def _bad_cpus(flag: str, spec: str, why: str) -> str:
    allowed = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    return f"{flag} {spec!r}: {why}; give CPUs this process may use, e.g. 0 or 0,1 (it may use {allowed})"


def keep_freed_memory(*, one_arena: bool = True) -> None:
    """Serve large allocations from one heap and keep freed memory for reuse (glibc). Both
    processes allocate the same large arrays over and over, and glibc's defaults hand each a
    fresh mmap, or trim and unmap a thread's arena, so every page faults again on first touch:
    the syncer's merges and publishes (measured: a third of a 1e9-parameter publish), and XLA's
    buffers for every step of a learner on a CPU device (measured on the quickstart: 11,000
    page faults and 24 ms of kernel time in an 88 ms step; none with this, 36% more steps per
    second). No trimming either: a 1e9-parameter syncer freed 1-3 GB at the heap's top at a time
    and faulted it back within seconds, zeroing pages at about 1 GB/s on our VMs. One arena, because glibc unmaps a thread arena's extra heaps whenever they empty,
    whatever the trim threshold (the learner's XLA thread did, every step); its lock is taken a
    few times per step or push, not per element. Both footprints are steady, so holding the peak
    is the right trade. Call it first, before JAX or gRPC start threads: a thread keeps the
    arena it first allocated from. Elsewhere (no glibc) this does nothing.

    `one_arena=False` for learners: with XLA's threads on one arena, a 91M-parameter learner's
    heap grew without bound (1.2 GB every 6 s, OOM-killed within minutes; bench/real_size.py),
    while with per-thread arenas it levelled off at 5.3 GB and stepped about twice as fast."""
    try:
        libc = ctypes.CDLL(None)
        m_trim_threshold, m_mmap_max, m_arena_max = -1, -4, -8  # glibc's mallopt parameters
        if one_arena:
            libc.mallopt(m_arena_max, 1)
        libc.mallopt(m_mmap_max, 0)
        libc.mallopt(m_trim_threshold, -1)  # never return it (-1: mallopt(3)'s "disables trimming completely")
    except (OSError, AttributeError):
        log.info("mallopt is not available; large allocations stay memory-mapped")


def reserve_heap(nbytes: int) -> None:
    """Grow the heap by `nbytes` now and keep it (`keep_freed_memory` never hands freed memory
    back): what a process will need at its peak is faulted in at start, not in the middle of its
    work. Like a JVM's AlwaysPreTouch, this also fails at start, not hours later, where the memory
    is not there. Measured on a 1e9-parameter syncer (docs/BENCHMARKS.md §5): its heap grew from
    10.8 to 15.1 GB over its first minutes, and every merge meanwhile spent 0.3 s faulting fresh pages
    in (0.05 s once the heap had grown), which made a third of the slots late."""
    import numpy as np  # here: the launcher's other callers need no numpy

    if nbytes > 0:
        block = np.empty(nbytes, np.uint8)
        block[::4096] = 0  # a write per page faults it in
        del block


# XLA:CPU settings a learner runs with (docs/BENCHMARKS.md §6, "A learner's restart"). XLA hands
# dots to YNNPACK by default, and each YNNPACK fusion builds its runtime (a slinky pipeline) at
# its first execution in every process, which no compilation cache keeps: 0.1 s of CPU on the
# quickstart's first step, a sixth of a restart's, while steps after it ran no faster than
# XLA's own dots (measured 0.5M to 7M parameters).
XLA_CPU_FLAGS = ("--xla_cpu_experimental_ynn_fusion_type=",)


def xla_cpu_flags() -> None:
    """Add XLA_CPU_FLAGS to $XLA_FLAGS, each unless the user set that flag. Call before JAX's
    first computation (importing JAX is fine: XLA reads its flags when the backend starts)."""
    flags = os.environ.get("XLA_FLAGS", "")
    given = {f.split("=", 1)[0] for f in flags.split()}
    extra = [f for f in XLA_CPU_FLAGS if f.split("=", 1)[0] not in given]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([*flags.split(), *extra])


def learner_runtime() -> None:
    """The allocator and XLA:CPU settings of a learner; benches call it in every JAX process
    they compare with one, so both sides run alike."""
    keep_freed_memory(one_arena=False)
    xla_cpu_flags()


def read_pem(path: str | None, flag: str) -> bytes | None:
    """A PEM file named by a flag, or None; a missing or non-PEM file is a clear error."""
    if not path:
        return None
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise SystemExit(f"{flag} {path}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise SystemExit(f"{flag} {path}: not a PEM file")
    return data
