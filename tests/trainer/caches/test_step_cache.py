"""The lowered train step and eval kept beside the compilation cache (trainer/caches/step_cache.py):
the same bits as the traced programs, read back without tracing, never trusted when damaged or
foreign."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from diloco.spec import Mesh, Training, TransformerModel
from diloco.trainer import model, sharding
from diloco.trainer.caches import step_cache
from diloco.trainer.recipe import Recipe

pytestmark = pytest.mark.slow  # each test compiles and exports a step: seconds apiece (make test only)

CFG = TransformerModel(layers=1, d_model=32, heads=2, context=16)
TR = Training(batch_size=4, warmup_steps=2, decay_steps=50)


def train(cfg: TransformerModel, tr: Training, cache_dir: Path | None, steps: int = 3) -> tuple[list[float], dict]:
    shapes = model.parameter_shapes(cfg)
    recipe = Recipe(cfg, tr, sharding.layout(Mesh(), shapes, tr.batch_size), cache_dir=None if cache_dir is None else str(cache_dir))
    params = recipe.place({n: np.asarray(v) for n, v in model.init_params(cfg, 0).items()})
    state = recipe.init_state(params)
    rng = np.random.default_rng(1)
    losses = []
    for k in range(steps):
        batch = rng.integers(0, cfg.vocab_size, (tr.batch_size, cfg.context + 1)).astype(np.int32)
        params, state, loss = recipe.step(params, state, batch, k + 5)
        losses += [float(loss), recipe.eval_loss(params, [batch])]
    return losses, {n: np.asarray(v) for n, v in params.items()}


@pytest.fixture
def exports(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the programs actually traced and exported (a train step and an eval per recipe)."""
    calls: list[int] = []
    real = jax.export.export

    def counted(*a, **kw):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(jax.export, "export", counted)
    return calls


def _same(a: tuple[list[float], dict], b: tuple[list[float], dict]) -> bool:
    return a[0] == b[0] and all(np.array_equal(a[1][n], b[1][n]) for n in a[1])


def test_a_restart_runs_the_exported_step_bit_for_bit_without_tracing_it(tmp_path: Path, exports: list[int]) -> None:
    traced = train(CFG, TR, None)
    first = train(CFG, TR, tmp_path)
    assert len(exports) == 2 and len(list(tmp_path.glob("step-*.npz"))) == len(list(tmp_path.glob("loss-*.npz"))) == 1
    again = train(CFG, TR, tmp_path)
    assert len(exports) == 2  # read back: nothing traced or exported again
    assert _same(traced, first) and _same(first, again)
    assert not list(tmp_path.glob(".*"))  # no temporary left behind


def test_other_settings_are_another_program_and_a_users_module_is_never_cached(tmp_path: Path, exports: list[int]) -> None:
    train(CFG, TR, tmp_path, steps=1)
    clipped = train(CFG, TR.model_copy(update={"grad_clip": 1e-4}), tmp_path, steps=1)
    assert len(exports) == 4 and len(list(tmp_path.glob("step-*.npz"))) == 2
    assert _same(clipped, train(CFG, TR.model_copy(update={"grad_clip": 1e-4}), None, steps=1))
    mine = CFG.model_copy(update={"module": "diloco.trainer.models.gpt:GPT"})
    train(mine, TR, tmp_path / "user", steps=1)
    assert not (tmp_path / "user").exists()


@pytest.mark.parametrize("damage", ["flip", "garbage", "foreign"])
def test_a_damaged_or_foreign_file_is_traced_again_not_run(tmp_path: Path, exports: list[int], damage: str) -> None:
    good = train(CFG, TR, tmp_path)
    (path,) = tmp_path.glob("step-*.npz")
    if damage == "foreign":  # well formed and checksummed, but another model's program
        other = tmp_path / "other"
        train(CFG.model_copy(update={"d_model": 64}), TR, other, steps=1)
        (theirs,) = other.glob("step-*.npz")
        path.write_bytes(theirs.read_bytes())
    else:
        raw = bytearray(path.read_bytes())
        if damage == "flip":
            raw[len(raw) // 2] ^= 0xFF
        else:
            raw = bytearray(os.urandom(len(raw)))
        path.write_bytes(bytes(raw))
    again = train(CFG, TR, tmp_path)
    assert _same(good, again)
    assert len(exports) == (5 if damage == "foreign" else 3)  # the step traced and exported again


CHILD = r"""
import json, sys
import numpy as np
from diloco.spec import Mesh, Training, TransformerModel
from diloco.trainer import model, sharding
from diloco.trainer.recipe import Recipe


cfg = TransformerModel(layers=1, d_model=64, heads=2, context=16)
tr = Training(batch_size=8, warmup_steps=2, decay_steps=50)

def run(cache_dir):
    shapes = model.parameter_shapes(cfg)
    recipe = Recipe(cfg, tr, sharding.layout(Mesh(data=2, fsdp=2), shapes, tr.batch_size), cache_dir=cache_dir)
    params = recipe.place({n: np.asarray(v) for n, v in model.init_params(cfg, 0).items()})
    state = recipe.init_state(params)
    rng = np.random.default_rng(1)
    losses = []
    for k in range(3):
        b = rng.integers(0, cfg.vocab_size, (8, cfg.context + 1)).astype(np.int32)
        params, state, loss = recipe.step(params, state, b, k)
        losses += [float(loss), recipe.eval_loss(params, [b])]
    return losses, {n: str(v.sharding.spec) for n, v in params.items()}

print(json.dumps([run(None), run(sys.argv[1]), run(sys.argv[1])]))
"""


def test_a_sharded_step_is_exported_with_its_shardings(tmp_path: Path) -> None:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=300, check=True)
    traced, exported, read_back = json.loads(out.stdout.strip().splitlines()[-1])
    assert traced == exported == read_back  # losses bit for bit, and every parameter's sharding
    assert any("fsdp" in spec for spec in traced[1].values())
    assert len(list(tmp_path.glob("step-*.npz"))) == len(list(tmp_path.glob("loss-*.npz"))) == 1


def test_the_cache_key_names_the_code(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = {"model": CFG.model_dump(mode="json")}
    args = [jax.ShapeDtypeStruct((2,), np.float32)]
    before = step_cache._key(spec, args, "tree")
    monkeypatch.setattr(step_cache, "_code", lambda: "the recipe was edited")
    assert step_cache._key(spec, args, "tree") != before
