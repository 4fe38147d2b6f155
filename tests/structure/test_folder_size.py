"""No folder of the product holds more than about 15 modules (issue 60): a folder is a room a
newcomer finds things in by its name, and operator/ as one flat folder of 51 files spread "what
happens when Kueue evicts a job" over five of them. Past the bound, split the folder into
subpackages named after their parts."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.structure.house import PACKAGES, ROOT, sources

MAX_MODULES = 16  # "about 15": a package's __init__ and fifteen modules


def crowded(root: Path, limit: int = MAX_MODULES) -> list[str]:
    """`folder: N modules` for every product folder over `limit` Python files."""
    count = Counter(path.parent.relative_to(root).as_posix() for path in sources(root))
    return [f"{folder}: {n} modules" for folder, n in sorted(count.items()) if n > limit]


def test_no_folder_of_the_product_is_over_about_15_modules() -> None:
    found = crowded(ROOT)
    assert not found, f"folders over {MAX_MODULES} modules (split them into named subpackages):\n" + "\n".join(found)


@pytest.mark.parametrize("modules, found", [(MAX_MODULES, []), (MAX_MODULES + 1, ["operator/kueue: 17 modules"])])
def test_a_crowded_folder_is_caught(tmp_path: Path, modules: int, found: list[str]) -> None:
    for folder in PACKAGES:
        (tmp_path / folder).mkdir()
    (tmp_path / "operator" / "kueue").mkdir()
    for i in range(modules):
        (tmp_path / "operator" / "kueue" / f"m{i}.py").write_text("")
    assert crowded(tmp_path) == found
