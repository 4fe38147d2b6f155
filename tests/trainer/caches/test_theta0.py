"""Θ₀ kept beside the compilation cache (trainer/caches/theta0.py): read back exactly, never trusted
when torn, foreign or the user's own module."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from diloco.spec import TransformerModel
from diloco.trainer import model
from diloco.trainer.caches import theta0

pytestmark = pytest.mark.slow  # each test initialises a model under JAX: seconds apiece (make test only)

CFG = TransformerModel(layers=1, d_model=32, heads=2, context=16)


@pytest.fixture
def inits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the model inits actually run."""
    calls: list[int] = []
    real = model.init_params

    def counted(cfg: TransformerModel, seed: int) -> model.Params:
        calls.append(seed)
        return real(cfg, seed)

    monkeypatch.setattr(model, "init_params", counted)
    return calls


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(a[n].dtype == b[n].dtype and np.array_equal(a[n], b[n]) for n in a)


def test_a_restart_reads_the_first_process_s_theta0_bit_for_bit(tmp_path: Path, inits: list[int]) -> None:
    first = theta0.initial_params(CFG, 3, tmp_path)
    again = theta0.initial_params(CFG, 3, tmp_path)
    assert inits == [3]  # the second process ran no init
    assert _same(first, again)
    assert _same(first, {n: np.asarray(v) for n, v in model.init_params(CFG, 3).items()})
    assert not list(tmp_path.glob(".theta0-*"))  # no temporary left behind


def test_another_seed_or_model_is_another_file(tmp_path: Path, inits: list[int]) -> None:
    a = theta0.initial_params(CFG, 0, tmp_path)
    b = theta0.initial_params(CFG, 1, tmp_path)
    c = theta0.initial_params(CFG.model_copy(update={"d_model": 64}), 0, tmp_path)
    assert inits == [0, 1, 0] and len(list(tmp_path.glob("theta0-*.npz"))) == 3
    assert not _same(a, b) and a.keys() == b.keys()
    assert c[next(iter(c))].shape != a[next(iter(a))].shape


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "foreign"])
def test_a_torn_or_altered_file_is_recomputed_not_used(tmp_path: Path, inits: list[int], damage: str) -> None:
    good = theta0.initial_params(CFG, 0, tmp_path)
    (path,) = tmp_path.glob("theta0-*.npz")
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "flip":  # inside the first array's data: the zip still opens, the checksum does not match
        raw[len(raw) // 3] ^= 0x40
    elif damage == "garbage":
        raw = bytearray(b"not a zip at all")
    if damage == "foreign":  # a well-formed file of other values (and a stale checksum): only the checksum tells
        stale = np.load(path)["__sha256__"]
        np.savez(path, **{n: np.zeros_like(v) for n, v in good.items()}, __sha256__=stale)
    else:
        path.write_bytes(bytes(raw))
    assert _same(theta0.initial_params(CFG, 0, tmp_path), good)
    assert inits == [0, 0]
    assert _same(theta0.initial_params(CFG, 0, tmp_path), good) and inits == [0, 0]  # rewritten whole


def test_no_cache_directory_or_a_user_module_always_computes(tmp_path: Path, inits: list[int],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    theta0.initial_params(CFG, 0, None)
    theta0.initial_params(CFG, 0, None)
    assert inits == [0, 0]
    # A user's module can change its code without changing its spec: never read back.
    computed: list[str | None] = []
    monkeypatch.setattr(theta0, "_compute", lambda cfg, seed: computed.append(cfg.module) or {"w": np.zeros(2, np.float32)})
    user = CFG.model_copy(update={"module": "my_models:factory"})
    theta0.initial_params(user, 0, tmp_path)
    theta0.initial_params(user, 0, tmp_path)
    assert computed == [user.module, user.module] and not list(tmp_path.iterdir())


def test_an_edited_model_is_another_file(tmp_path: Path, inits: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    theta0.initial_params(CFG, 0, tmp_path)
    monkeypatch.setattr(theta0, "_code_digest", lambda: "the init was edited")
    theta0.initial_params(CFG, 0, tmp_path)
    assert inits == [0, 0] and len(list(tmp_path.glob("theta0-*.npz"))) == 2
