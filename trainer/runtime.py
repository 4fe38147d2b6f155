"""The learner process's threads: its host work (gRPC, the sender and subscriber) on cores
apart from XLA's. Here, not in diloco/launch.py, because it starts JAX, and the syncer image
that runs the launcher's other functions has none."""

from __future__ import annotations

from diloco.launch import cpu_set, pin


def split_host_threads(spec: str | None) -> None:
    """Move this thread, and every thread it starts from now on (gRPC's, the learner's sender
    and subscriber), to the host CPUs `spec`; JAX's runtime threads, started here first, stay
    where `pin_cpus` put the process. On a CPU device the cores are the device, and without
    this the learner's communication takes its cycles from XLA's, which on an accelerator
    it never does: its host has cores of its own. Call it from the main thread, after
    `jax.distributed` (which must come before JAX's backend) and before any other thread."""
    if not spec:
        return
    cpus = cpu_set(spec, "--host-cpus")
    import jax  # here: importing this module must not start anything before pin_cpus
    import numpy as np

    jax.device_put(np.zeros(1, np.float32)).block_until_ready()  # the backend and its worker threads
    pin(cpus, "--host-cpus")
