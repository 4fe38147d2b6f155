"""The hosts of one learner (`spec.learnerGroups[].hostsPerLearner`): one SPMD program.

A learner on a multi-host TPU slice or several GPU nodes is H processes that must run the
same steps in the same order, or their collectives deadlock. So host 0 speaks for the
learner: it alone talks to the syncer and writes events, and at every step boundary it
shares what it heard (updates, whether to stop) with the others, which act on exactly
that. Each host then computes the same outer gradients and adoptions from the same
inputs. With one host all of this is free: sharing is the identity.
"""

from __future__ import annotations

import argparse
import os
import pickle
import threading
import time
from typing import Any

import numpy as np

from diloco.contract import COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV, ordinal


class Hosts:
    def __init__(self, process_id: int = 0, count: int = 1) -> None:
        if not 0 <= process_id < count:
            raise ValueError(f"--process-id {process_id} outside 0..{count - 1} (--num-processes {count})")
        self.process_id, self.count = process_id, count

    @property
    def leader(self) -> bool:
        return self.process_id == 0

    @classmethod
    def start(cls, args: argparse.Namespace, expected: int) -> Hosts:
        """Join the learner's other hosts (jax.distributed) before JAX does anything else.
        `expected` is the group's hostsPerLearner; flags win over the environment."""
        count = args.num_processes if args.num_processes is not None else int(os.environ.get(NUM_PROCESSES_ENV, "1"))
        if count != expected:
            raise ValueError(f"--num-processes / ${NUM_PROCESSES_ENV} is {count} but the group's hostsPerLearner is "
                             f"{expected}; every host of a learner must be started with the same count")
        pid = args.process_id if args.process_id is not None else ordinal(os.environ.get(PROCESS_ID_ENV, "0"))
        hosts = cls(pid, count)
        if count > 1:
            coordinator = args.coordinator or os.environ.get(COORDINATOR_ENV)
            if not coordinator:
                raise ValueError(f"a learner of {count} hosts needs its host 0's address: --coordinator host:port "
                                 f"or ${COORDINATOR_ENV}")
            import jax

            jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts: collectives over TCP
            jax.distributed.initialize(coordinator, num_processes=count, process_id=pid)
        return hosts

    def share(self, value: Any) -> Any:
        """Host 0's `value` on every host (a collective: every host calls it at the same point)."""
        if self.count == 1:
            return value
        from jax.experimental import multihost_utils

        blob = np.frombuffer(pickle.dumps(value), np.uint8) if self.leader else np.zeros(0, np.uint8)
        size = int(multihost_utils.broadcast_one_to_all(np.array([blob.size], np.int64))[0])
        padded = blob if self.leader else np.zeros(size, np.uint8)
        data = np.asarray(multihost_utils.broadcast_one_to_all(padded))
        return value if self.leader else pickle.loads(data.tobytes())  # trusted: our own host 0 wrote it

    def host_copy(self, arrays: dict[str, Any]) -> dict[str, np.ndarray]:
        """Whole host arrays of (possibly sharded) device arrays; a collective with H > 1."""
        if self.count == 1:
            return {n: np.asarray(v) for n, v in arrays.items()}
        from jax.experimental import multihost_utils

        return {n: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for n, v in arrays.items()}


class MirroredClient:
    """What the learner loop uses of a syncer client, identical on every host. Host 0 holds
    the real client; at each `take_updates` it shares the updates and its stop flags, and
    the loop reads only those snapshots, so every host breaks out at the same step."""

    def __init__(self, hosts: Hosts, client: Any | None, stop: threading.Event) -> None:
        self.hosts, self.client, self._stop = hosts, client, stop
        self.stopping = threading.Event()  # snapshot of: the syncer refused us for good
        self.resync = threading.Event()  # snapshot of: a push was refused as malformed
        self.stop_requested = False  # snapshot of host 0's SIGTERM

    def join_with_retry(self, shapes: dict[str, tuple[int, ...]], initial: Any = None) -> Any:
        result: Any = None
        if self.client is not None:
            try:
                result = self.client.join_with_retry(shapes, initial)
            except Exception as exc:  # shared, so every host fails the same way
                result = exc
        result = self.hosts.share(result)
        if isinstance(result, Exception):
            raise result
        return result

    def start(self) -> None:
        if self.client is not None:
            self.client.start()

    def submit(self, item: Any) -> None:
        if self.client is not None:  # the other hosts computed the same push; host 0 sends it
            self.client.submit(item)

    def take_updates(self) -> Any:
        snapshot = None
        if self.client is not None:
            snapshot = (self.client.take_updates(), self.client.stopping.is_set(), self.client.resync.is_set(),
                        self._stop.is_set())
        updates, stopping, resync, stop = self.hosts.share(snapshot)
        for event, flag in ((self.stopping, stopping), (self.resync, resync)):
            event.set() if flag else event.clear()
        self.stop_requested = stop
        return updates

    def clear_resync(self) -> None:
        self.resync.clear()
        if self.client is not None:
            self.client.resync.clear()

    def until(self, deadline: float) -> bool:
        """Whether host 0 is still before `deadline` (monotonic) and not refused: one answer for all."""
        go = self.client is not None and time.monotonic() < deadline and not self.client.stopping.is_set()
        return bool(self.hosts.share(go))

    def wait_for_news(self, timeout: float) -> None:
        if self.client is not None:
            self.client.wait_for_news(timeout)

    def flush(self, timeout: float) -> bool:
        return bool(self.hosts.share(self.client.flush(timeout) if self.client is not None else None))

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    def _counter(self, name: str) -> Any:
        return getattr(self.client, name) if self.client is not None else 0

    @property
    def bytes_sent(self) -> int:
        return int(self._counter("bytes_sent"))

    @property
    def bytes_received(self) -> int:
        return int(self._counter("bytes_received"))

    @property
    def acked_train_seconds(self) -> float:
        return float(self._counter("acked_train_seconds"))
