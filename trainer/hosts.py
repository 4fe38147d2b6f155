"""The hosts of one learner (`spec.learnerGroups[].hostsPerLearner`): one SPMD program.

A learner on a multi-host TPU slice or several GPU nodes is H processes that must run the
same steps in the same order, or their collectives deadlock. So host 0 speaks for the
learner: it alone talks to the syncer and writes events, and at every step boundary it
shares what it heard (updates, whether to stop) with the others, which act on exactly
that. Each host then computes the same outer gradients and adoptions from the same
inputs. With one host all of this is free: sharing is the identity.

What host 0 shares travels as typed arrays of a structure every host knows beforehand,
through JAX's own collectives (a jitted all-reduce, as `multihost_utils.broadcast_one_to_all`
runs it), never as pickles: a step boundary's news is one int64 record (flags, counts, then
one row per published fragment, answer and refusal), and each published fragment's tensors
are one int32 vector (their float32 bits, so every host holds them bit for bit) whose names
and shapes come from the fragment plan all hosts hold. A step with no news costs one
broadcast of 32 int64. The join (and a syncer shard's re-join) travels the same way. `Hosts` is the collectives;
trainer/sync/mirrored.py's `MirroredClient` is what the loop reads through them.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from diloco.contract import COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV, ordinal

HEADER = 32  # int64 words of every shared record: its length, then up to 31 values inline
Shapes = Sequence[tuple[str, tuple[int, ...]]]


def _bucket(n: int) -> int:
    """Lengths of overflow records round up to a power of two: a handful of compiled broadcasts."""
    return 1 << max(0, n - 1).bit_length()


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

    def broadcast(self, array: np.ndarray) -> np.ndarray:
        """Host 0's `array` on every host; the others pass one of the same shape and dtype (a
        collective: every host calls it at the same point; compiled once per shape and dtype).
        64-bit values travel as pairs of int32 (JAX without x64 would cut them to 32 bits)."""
        if self.count == 1:
            return array
        got = self._sum(np.ascontiguousarray(array) if self.leader else np.zeros_like(array), self.leader)
        return array if self.leader else got

    def _sum(self, mine: np.ndarray, contributes: bool = True) -> np.ndarray:
        """The sum over hosts of the `mine` of every host that `contributes` (the same shape and
        dtype everywhere), on every host: `multihost_utils.broadcast_one_to_all`, whose jitted
        sum over a global array of one row per host XLA runs as an all-reduce (gloo on CPUs),
        with each host its own source or not. A sum with zeros is exact, so the bits arrive
        as sent; every host waits for the result. Over every device of every host, as
        broadcast_one_to_all runs it: an all-reduce over one device per host was 1.3x as fast
        on a 15 MB fragment, but with a training step in flight and then a multi-process
        device_put, the two hosts deadlocked (XLA:CPU, gloo)."""
        from jax.experimental import multihost_utils

        sent = mine.view(np.int32) if mine.dtype.itemsize == 8 else mine
        got = np.asarray(multihost_utils.broadcast_one_to_all(sent, is_source=contributes))
        return got.view(mine.dtype) if got.dtype != mine.dtype else got

    def share_ints(self, values: Sequence[int] | None) -> list[int]:
        """Host 0's int64 `values` on every host (the others pass None): one broadcast of HEADER
        words when they fit, and a second, of a power-of-two length, when not."""
        if self.count == 1:
            return [int(v) for v in values or ()]
        mine = np.asarray(values if self.leader and values is not None else (), np.int64)
        head = np.zeros(HEADER, np.int64)
        if self.leader:
            head[0] = mine.size
            head[1:1 + min(mine.size, HEADER - 1)] = mine[:HEADER - 1]
        head = self.broadcast(head)
        n = int(head[0])
        if n <= HEADER - 1:
            return head[1:1 + n].tolist()
        rest = np.zeros(_bucket(n - (HEADER - 1)), np.int64)
        if self.leader:
            rest[:n - (HEADER - 1)] = mine[HEADER - 1:]
        rest = self.broadcast(rest)
        return head[1:].tolist() + rest[:n - (HEADER - 1)].tolist()

    def share_flags(self, *flags: bool) -> tuple[bool, ...]:
        """Host 0's flags on every host (the others' values are ignored)."""
        bits = self.share_ints([sum(int(bool(f)) << i for i, f in enumerate(flags))] if self.leader else None)[0]
        return tuple(bool(bits >> i & 1) for i in range(len(flags)))

    def share_tensors(self, arrays: Mapping[str, Any] | None, shapes: Shapes) -> dict[str, np.ndarray]:
        """Host 0's float32 tensors of known names and shapes on every host, bit for bit (the
        others pass None): their bits as one int32 vector, one broadcast. Host 0 checked them
        against `shapes` before (`fits`)."""
        if self.leader:
            assert arrays is not None
            out = {n: np.asarray(arrays[n], np.float32) for n, _ in shapes}
            if self.count == 1:
                return out
        total = sum(math.prod(s) for _, s in shapes)
        if total == 0:
            return out if self.leader else {n: np.zeros(s, np.float32) for n, s in shapes}
        if self.leader:
            flat = np.concatenate([out[n].reshape(-1) for n, _ in shapes]).view(np.int32)
        else:
            flat = np.zeros(total, np.int32)
        got = self.broadcast(flat)
        if self.leader:
            return out
        values = got.view(np.float32).copy()  # jax.device_get gives a read-only view
        result, at = {}, 0
        for n, s in shapes:
            size = math.prod(s)
            result[n] = values[at:at + size].reshape(s)
            at += size
        return result

    def host_copy(self, arrays: dict[str, Any]) -> dict[str, np.ndarray]:
        """Whole host arrays of (possibly sharded) device arrays; a collective with H > 1.

        Each host writes the parts its devices hold (a part several hosts hold: the lowest of
        them) into one zeroed float32 vector of the whole fragment, and one all-reduce of
        their bits sums the parts into the whole on every host: one collective per call where
        `multihost_utils.process_allgather` runs one per tensor (bench/multihost_push.py)."""
        if self.count == 1:
            return {n: np.asarray(v) for n, v in arrays.items()}
        if any(getattr(v, "dtype", None) != np.float32 or not hasattr(v, "addressable_shards") for v in arrays.values()):
            from jax.experimental import multihost_utils

            return {n: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for n, v in arrays.items()}
        sizes = [math.prod(v.shape) for v in arrays.values()]
        flat = np.zeros(sum(sizes), np.float32)
        at = 0
        for v, size in zip(arrays.values(), sizes, strict=True):
            whole = flat[at:at + size].reshape(v.shape)
            for index, data in self._parts(v):
                whole[index] = np.asarray(data)
            at += size
        values = self._sum(flat.view(np.int32)).view(np.float32).copy()  # device_get's view is read-only
        out, at = {}, 0
        for (n, v), size in zip(arrays.items(), sizes, strict=True):
            out[n] = values[at:at + size].reshape(v.shape)
            at += size
        return out

    def _parts(self, v: Any) -> list[tuple[Any, Any]]:
        """The (index, shard) pairs of `v` this host contributes to its whole: each distinct
        part once, by the lowest host that holds it."""
        def key(index: tuple[slice, ...]) -> tuple[tuple[int, int], ...]:
            return tuple(sl.indices(n)[:2] for sl, n in zip(index, v.shape, strict=True))

        owner: dict[tuple[tuple[int, int], ...], int] = {}
        for d, index in v.sharding.devices_indices_map(v.shape).items():
            k = key(index)
            owner[k] = min(owner.get(k, d.process_index), d.process_index)
        parts, seen = [], set()
        for shard in v.addressable_shards:
            k = key(shard.index)
            if owner[k] == self.process_id and k not in seen:
                seen.add(k)
                parts.append((shard.index, shard.data))
        return parts


def fits(arrays: Mapping[str, Any], shapes: Shapes) -> bool:
    """Whether `arrays` are exactly the tensors `shapes` names, of those shapes."""
    return len(arrays) == len(shapes) and all(n in arrays and tuple(np.shape(arrays[n])) == s for n, s in shapes)
