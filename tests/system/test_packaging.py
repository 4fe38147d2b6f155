"""Every package of the product is in pyproject.toml's list, so a non-editable install (the
images, the slim venv) carries it: a new subpackage missing there only fails where it is used."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_installed() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = setuptools["package-dir"]
    found = set()
    for package, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if "__pycache__" not in rel.parts:
                found.add(".".join([package, *rel.parts]))
    assert sorted(found - set(setuptools["packages"])) == []
