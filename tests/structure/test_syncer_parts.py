"""The syncer's parts own their state and do not know the core (issue 53): no module of syncer/
imports service.py but the two above it (the servicer, which talks to the core alone, and main,
which builds it), counting imports under TYPE_CHECKING and inside functions; no import loop
inside syncer/; and no class there over 200 lines."""

from __future__ import annotations

import ast
from pathlib import Path

SYNCER = Path(__file__).resolve().parents[2] / "syncer"
ABOVE_THE_CORE = {"servicer", "main"}  # the transport and the process: they hold a SyncerCore
MAX_CLASS_LINES = 200


def imports(source: str, modules: set[str]) -> set[str]:
    """The syncer modules `source` imports, wherever the import stands; `from diloco.syncer
    import x` counts as importing module x."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "diloco.syncer":
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("diloco.syncer."):
            found.add((node.module or "").split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("diloco.syncer.")}
    return found


def graph() -> dict[str, set[str]]:
    modules = {p.stem for p in SYNCER.glob("*.py")}
    return {p.stem: imports(p.read_text(), modules) - {p.stem} for p in SYNCER.glob("*.py")}


def cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import loop of `g`, or None."""
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(g.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [m, n] if n in path else [m, n]
            if n not in state and (found := visit(n, path + [m])):
                return found
        state[m] = 2
        return None

    return next((c for m in sorted(g) if m not in state and (c := visit(m, [])) is not None), None)


def test_no_part_of_the_syncer_imports_its_core() -> None:
    assert sorted(m for m, deps in graph().items() if "service" in deps) == sorted(ABOVE_THE_CORE)


def test_the_syncer_has_no_import_loop() -> None:
    assert cycle(graph()) is None


def test_the_scan_sees_type_only_and_function_local_imports() -> None:
    """The scan would catch the loops this issue removed (accounting.py under TYPE_CHECKING)."""
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from diloco.syncer.core import SyncerCore\n" \
          "def f():\n    from diloco.syncer import status\n"
    assert imports(src, {"service", "status"}) == {"service", "status"}
    assert cycle({"a": {"b"}, "b": {"a"}}) is not None


def test_no_class_in_the_syncer_is_over_200_lines() -> None:
    long = [f"{p.name}:{n.name} ({(n.end_lineno or n.lineno) - n.lineno + 1})" for p in sorted(SYNCER.glob("*.py"))
            for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ClassDef)
            and (n.end_lineno or n.lineno) - n.lineno + 1 > MAX_CLASS_LINES]
    assert long == []
