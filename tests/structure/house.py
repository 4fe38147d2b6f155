"""The product's folders as they import, read from pyproject.toml's package-dir in this one
place (trainer/ is diloco.trainer, and so on): the structure tests walk the product through it."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def packages(root: Path = ROOT) -> dict[str, str]:
    """Folder -> import name, as pyproject.toml maps them (`trainer` -> `diloco.trainer`)."""
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {folder: package for package, folder in mapping.items()}


PACKAGES = packages()


def sources(root: Path = ROOT) -> Iterator[Path]:
    """Every Python file of the product's folders (generated stubs and caches left out)."""
    for folder in PACKAGES:
        for path in sorted((root / folder).rglob("*.py")):
            if not {"proto", ".venv", "__pycache__"} & set(path.relative_to(root).parts):
                yield path
