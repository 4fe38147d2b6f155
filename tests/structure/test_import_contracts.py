"""import-linter's contracts (pyproject.toml, [tool.importlinter]) hold on the product, and each
fails on a planted wrong-way import: the check `make lint` runs can fail."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.structure.house import PACKAGES, ROOT

SCRIPT = ROOT / "scripts" / "imports.sh"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT)], env={"ROOT": str(root), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The product's folders and pyproject.toml, copied: a tree to plant imports in."""
    root = tmp_path_factory.mktemp("house")
    for folder in PACKAGES:
        shutil.copytree(ROOT / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", root)
    return root


@pytest.mark.slow
def test_the_product_keeps_every_contract() -> None:
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("file, source, contract, chain", [
    ("diloco/core/planted.py", "def f():\n    from diloco.apps import cli\n",
     "Layers: apps above", "diloco.core.planted -> diloco.apps.cli"),
    ("operator/planted.py", "from diloco.syncer import registry\n",
     "Layers: apps above", "diloco.operator.planted -> diloco.syncer.registry"),
    ("diloco/planted.py", "x = 1\n", "Layers: apps above", "diloco.planted"),  # exhaustive: unplaced
    ("operator/render/planted.py", "import jax\n",
     "The syncer image's commands", "jax"),
    ("syncer/round_extra.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from diloco.syncer.core import SyncerCore\n",
     "The syncer's parts", "diloco.syncer.round_extra"),
    ("trainer/planted.py", "from diloco.spec.base import Model\n",
     "The job spec is imported", "diloco.trainer.planted -> diloco.spec.base"),
])
def test_a_planted_import_breaks_its_contract(copy: Path, file: str, source: str, contract: str, chain: str) -> None:
    planted = copy / file
    planted.write_text(source)
    entry = None
    if "syncer image" in contract:  # reached from the operator's entry point
        entry = copy / "operator" / "main.py"
        kept = entry.read_text()
        entry.write_text(kept + "\nfrom diloco.operator.render import planted  # noqa\n")
    try:
        done = lint_imports(copy)
    finally:
        planted.unlink()
        if entry is not None:
            entry.write_text(kept)
    assert done.returncode != 0
    broken = done.stdout[done.stdout.index("Broken contracts"):]
    assert contract in broken and chain in broken, broken
