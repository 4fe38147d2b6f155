"""No class in the product is over 200 lines (issue 53): a class that large holds several jobs
(the learner's client held join, seeding, retry, two threads and recovery in 354), and one
that reads top to bottom is one a newcomer can change. Nested classes count on their own and
inside the class that holds them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.structure.house import PACKAGES, ROOT, sources

MAX_LINES = 200  # issue 53's bound: SyncerCore, split by job in the third step, came to 197


def offenders(root: Path, limit: int = MAX_LINES) -> list[str]:
    """`path:line Class: N lines` for every class over `limit` lines (decorators not counted)."""
    out = []
    for path in sources(root):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    out.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {lines} lines")
    return out


def test_no_class_is_over_200_lines() -> None:
    found = offenders(ROOT)
    assert not found, f"classes over {MAX_LINES} lines (split them by job):\n" + "\n".join(found)


@pytest.mark.parametrize("body, found", [(MAX_LINES - 1, []), (MAX_LINES, ["apps/big.py:1 Big: 201 lines"])])
def test_a_planted_large_class_is_caught(tmp_path: Path, body: int, found: list[str]) -> None:
    for folder in PACKAGES:
        (tmp_path / folder).mkdir()
    (tmp_path / "apps" / "big.py").write_text("class Big:\n" + "    x = 1\n" * body)
    (tmp_path / "syncer" / "small.py").write_text("class Small:\n    pass\n")
    assert offenders(tmp_path) == found
