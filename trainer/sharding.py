"""One learner, one SPMD program: its devices as a (data, fsdp) mesh (`spec.training.mesh`).

Parameters and AdamW's moments are sharded over `fsdp` (each on its largest dimension that
the axis divides; small vectors are replicated), the batch over `data` x `fsdp`, as in
MaxText's and big_vision's FSDP. XLA inserts the all-gathers and reduce-scatters. With one
device everything is replicated and this costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from diloco.spec import Mesh as MeshSpec

AXES = ("data", "fsdp")
MIN_SHARDED_ELEMENTS = 1 << 14  # smaller tensors (norm scales, tiny tables) stay replicated: gathering them costs more than it saves


def fsdp_spec(shape: tuple[int, ...], fsdp: int) -> PartitionSpec:
    """Shard the largest dimension `fsdp` divides; replicate what is too small or indivisible."""
    if fsdp == 1 or int(np.prod(shape)) < MIN_SHARDED_ELEMENTS:
        return PartitionSpec()
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if shape[dim] % fsdp == 0:
            return PartitionSpec(*[("fsdp" if d == dim else None) for d in range(len(shape))])
    return PartitionSpec()


@dataclass(frozen=True)
class Layout:
    """Where every array of a learner lives."""

    mesh: Mesh
    params: dict[str, NamedSharding]
    batch: NamedSharding
    replicated: NamedSharding
    _jits: dict[tuple[str, frozenset[str]], Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def devices(self) -> int:
        return int(self.mesh.devices.size)

    def put_params(self, values: dict[str, Any]) -> dict[str, jax.Array]:
        """Host (or device) arrays placed with their parameters' shardings. The learner places a
        fragment at every adoption, so this is on the step's path: a jitted identity whose
        input shardings are the parameters' takes host arrays through jit's C++ argument
        handling, a third of `jax.device_put`'s cost here (which is per array, in Python).
        Across processes jit refuses host arrays, so there device_put places them."""
        if self.mesh.is_multi_process:
            spread: dict[str, jax.Array] = jax.device_put(dict(values), {n: self.params[n] for n in values})
            return spread
        placed: dict[str, jax.Array] = self._per_fragment("place", values, lambda v: v, 1)(dict(values))
        return placed

    def add_params(self, params: dict[str, jax.Array], shift: dict[str, Any]) -> dict[str, jax.Array]:
        """params[n] + shift[n] for each name in `shift` (host arrays), added where the parameters
        live: one jitted add per fragment, dispatched without waiting for the running step."""
        adder = self._per_fragment("add", shift, lambda x, d: {n: x[n] + d[n] for n in d}, 2)
        if self.mesh.is_multi_process:  # across processes jit refuses host arrays
            shift = self.put_params(shift)
        added: dict[str, jax.Array] = adder({n: params[n] for n in shift}, dict(shift))
        return added

    def _per_fragment(self, kind: str, names: Any, fn: Any, args: int) -> Any:
        """`fn` jitted once per set of parameter names (a fragment), each of its `args` inputs
        and its output sharded as those parameters are."""
        key = (kind, frozenset(names))
        jitted = self._jits.get(key)
        if jitted is None:
            shardings = {n: self.params[n] for n in names}
            jitted = self._jits[key] = jax.jit(fn, in_shardings=(shardings,) * args, out_shardings=shardings)
        return jitted

    def put_batch(self, batch: np.ndarray) -> jax.Array:
        return jax.device_put(batch, self.batch)

    def state_shardings(self, state: Any) -> Any:
        """Shardings for an optimizer state: a leaf under a parameter's name (AdamW's mu and nu)
        follows that parameter; counters and hyperparameters are replicated."""
        def one(path: tuple[Any, ...], leaf: Any) -> NamedSharding:
            name = getattr(path[-1], "key", None) if path else None
            if isinstance(name, str) and name in self.params and np.ndim(leaf) > 0:
                return self.params[name]
            return self.replicated
        return jax.tree_util.tree_map_with_path(one, state)


def layout(spec: MeshSpec, shapes: dict[str, tuple[int, ...]], batch_size: int,
           devices: list[Any] | None = None) -> Layout:
    """The learner's mesh over `devices` (default: every device of every process)."""
    devices = list(jax.devices()) if devices is None else devices
    data, fsdp = spec.shape(len(devices))
    if batch_size % (data * fsdp):
        raise ValueError(f"spec.training.batchSize {batch_size} does not split over the mesh's {data * fsdp} "
                         f"devices (data {data} x fsdp {fsdp}); use a multiple of {data * fsdp}")
    mesh = Mesh(np.asarray(devices).reshape(data, fsdp), AXES)
    return Layout(
        mesh=mesh,
        params={n: NamedSharding(mesh, fsdp_spec(s, fsdp)) for n, s in shapes.items()},
        batch=NamedSharding(mesh, PartitionSpec(AXES)),
        replicated=NamedSharding(mesh, PartitionSpec()),
    )
