"""A learner's mesh (trainer/sharding.py): parameters really sharded, losses as unsharded.

JAX fixes its device count when it starts, so the multi-device checks run in a child
process with four CPU devices (`--xla_force_host_platform_device_count`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from jax.sharding import PartitionSpec

from diloco.spec import Mesh
from diloco.trainer.sharding import MIN_SHARDED_ELEMENTS, fsdp_spec

CHILD = r"""
import json, sys
import jax, numpy as np
from diloco.spec import Mesh, Training, TransformerModel
from diloco.trainer import data, model, sharding
from diloco.trainer.recipe import Recipe

cfg = TransformerModel(**json.loads(sys.argv[1]))
tr = Training(batch_size=8, warmup_steps=2, decay_steps=50)
shapes = model.parameter_shapes(cfg)
p0 = model.init_params(cfg, 0)
rng = np.random.default_rng(1)
batches = [rng.integers(0, cfg.vocab_size, (8, cfg.context + 1)).astype(np.int32) for _ in range(4)]

def run(layout):
    recipe = Recipe(cfg, tr, layout)
    params = recipe.place({n: np.asarray(v) for n, v in p0.items()})
    placed = {n: str(getattr(v.sharding, "spec", "")) for n, v in params.items()}
    some = list(p0)[::3]  # an adoption places one fragment's tensors
    placed.update({n: str(getattr(v.sharding, "spec", "")) for n, v in recipe.place({n: np.asarray(p0[n]) for n in some}).items()})
    # An adoption's rebase adds a host shift to one fragment where it lives (Recipe.shift).
    moved = recipe.shift(params, {n: np.full(np.shape(p0[n]), 0.5, np.float32) for n in some})
    shifted = ({n: str(getattr(v.sharding, "spec", "")) for n, v in moved.items()},
               all(np.allclose(np.asarray(moved[n]), np.asarray(p0[n]) + 0.5) for n in some))
    state = recipe.init_state(params)
    losses = []
    for k, b in enumerate(batches):
        params, state, loss = recipe.step(params, state, b, k)
        losses.append(float(loss))
    specs = {n: str(getattr(v.sharding, "spec", "")) for n, v in params.items()}
    mu = state[1].inner_state[0].mu
    mu_specs = {n: str(getattr(v.sharding, "spec", "")) for n, v in mu.items()}
    compiled = recipe._step._cache_size()  # host batches through the step's in_shardings: one program for every step
    return losses, specs, mu_specs, {n: np.asarray(v).tolist() for n, v in list(params.items())[:2]}, placed, compiled, shifted

print(jax.device_count())
sharded = run(sharding.layout(Mesh(data=2, fsdp=2), shapes, tr.batch_size))
plain = run(None)
print(json.dumps({"devices": jax.device_count(), "sharded": sharded[:3], "plain": plain[0], "placed": sharded[4],
                  "shifted": [sharded[6], plain[6][1]],
                  "compiled": [sharded[5], plain[5]],
                  "params_close": all(np.allclose(sharded[3][n], plain[3][n], atol=1e-5) for n in plain[3])}))
"""


def _child(model: dict) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-P", "-c", CHILD, json.dumps(model)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", [{"layers": 1, "d_model": 128, "heads": 4, "context": 32},
                                   {"preset": "llama-tiny", "layers": 1, "context": 32, "dtype": "bfloat16", "remat": True}])
@pytest.mark.slow
def test_a_data_by_fsdp_mesh_shards_the_model_and_trains_as_one_device_does(model: dict) -> None:
    r = _child(model)
    assert r["devices"] == 4
    losses, specs, mu_specs = r["sharded"]
    # Big matrices are split over fsdp, and AdamW's moments follow their parameters.
    sharded = [n for n, s in specs.items() if "fsdp" in s]
    assert len(sharded) >= 4, specs
    assert all(mu_specs[n] == specs[n] for n in specs)
    assert r["placed"] == specs  # host arrays go straight to their shards, a whole model or one fragment
    (shift_specs, shifted), plain_shifted = r["shifted"]
    assert shifted and plain_shifted  # an adoption's shift adds to the fragment, sharded or not,
    assert shift_specs == {n: specs[n] for n in shift_specs}  # and leaves it sharded as it was
    assert r["compiled"] == [1, 1]  # the step compiled once for host batches, sharded or not
    tol = 1e-4 if model.get("dtype") != "bfloat16" else 2e-2  # bf16 reductions regroup across shards
    assert losses == pytest.approx(r["plain"], rel=tol, abs=tol)
    if model.get("dtype") != "bfloat16":
        assert r["params_close"]


def test_fsdp_spec_shards_the_largest_divisible_dimension_and_replicates_small_tensors() -> None:
    assert fsdp_spec((256, 1024), 4) == PartitionSpec(None, "fsdp")
    assert fsdp_spec((1024, 256), 4) == PartitionSpec("fsdp", None)
    assert fsdp_spec((1023, 256), 4) == PartitionSpec(None, "fsdp")  # 1023 is not divisible
    assert fsdp_spec((128,), 4) == PartitionSpec()  # a norm scale: gathering it costs more than it saves
    assert fsdp_spec((MIN_SHARDED_ELEMENTS,), 1) == PartitionSpec()


def test_mesh_shapes_fill_one_axis_and_refuse_what_does_not_fit() -> None:
    assert Mesh().shape(8) == (8, 1)
    assert Mesh(data=2, fsdp=-1).shape(8) == (2, 4)
    with pytest.raises(ValueError, match=re.escape("spec.training.mesh: data 3 x fsdp -1 does not fit this learner's 8 devices")):
        Mesh(data=3, fsdp=-1).shape(8)
    with pytest.raises(ValueError, match="at most one axis"):
        Mesh(data=-1, fsdp=-1)
