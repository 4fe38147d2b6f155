"""The product's import graph has no cycle (issue 53): every import counted, type-only
(`if TYPE_CHECKING:`) and function-local ones too, with pyproject.toml's package-dir mapping
applied (trainer/ is diloco.trainer, and so on).

A loop hidden behind a function-local or type-only import still ties the modules together: none
can be read, tested or moved without the others, and the day the import moves to the top the
process fails at start. A package's `__init__` that imports its own submodule, which imports the
package back, is a loop too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.structure.house import PACKAGES, ROOT, sources


def module_of(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product(root: Path) -> dict[str, Path]:
    """Module name -> source file, for every module of the product's folders."""
    return {module_of(path, root): path for path in sources(root)}


def targets(path: Path, module: str, modules: dict[str, Path]) -> set[str]:
    """The product modules this file imports, at any depth. `from pkg import x` imports the module
    pkg.x when there is one, else pkg itself (x is a name defined there)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                kept = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*kept, base] if base else kept)
            out.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names)
    return {name for name in out if name in modules and name != module}


def graph(root: Path) -> dict[str, set[str]]:
    modules = product(root)
    return {module: targets(path, module, modules) for module, path in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's), each sorted: every
    module of one can reach every other through imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(start: str) -> None:
        # Iterative, so a deep chain of imports cannot hit Python's recursion limit.
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return sorted(found)


def describe(component: list[str], edges: dict[str, set[str]]) -> str:
    inside = set(component)
    links = [f"    {a} -> {b}" for a in component for b in sorted(edges[a] & inside)]
    return " <-> ".join(component) + "\n" + "\n".join(links)


def test_the_product_has_no_import_cycle() -> None:
    assert set(PACKAGES) == {"diloco", "trainer", "syncer", "operator", "apps"}, PACKAGES
    edges = graph(ROOT)
    assert {"diloco.core.merge", "diloco.syncer.core", "diloco.apps.cli"} <= set(edges)
    found = cycles(edges)
    assert not found, f"{len(found)} import cycle(s):\n" + "\n".join(describe(c, edges) for c in found)


def plant(root: Path, files: dict[str, str]) -> None:
    for name in PACKAGES:
        (root / name).mkdir()
        (root / name / "__init__.py").write_text("")
    for file, text in files.items():
        (root / file).parent.mkdir(parents=True, exist_ok=True)
        (root / file).write_text(text)


@pytest.mark.parametrize("files, cycle", [
    # A type-only import back: the loop the checker must see although Python never runs it.
    ({"syncer/core.py": "from diloco.syncer import parts\n",
      "syncer/parts.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from diloco.syncer.core import Core\n"},
     ["diloco.syncer.core", "diloco.syncer.parts"]),
    # A function-local import, relative, across three modules.
    ({"diloco/core/a.py": "from . import b\n", "diloco/core/b.py": "from diloco.core.c import f\n",
      "diloco/core/c.py": "def f():\n    from .a import g\n", "diloco/core/__init__.py": ""},
     ["diloco.core.a", "diloco.core.b", "diloco.core.c"]),
    # A package re-exporting a submodule that imports a name from the package back.
    ({"diloco/spec/__init__.py": "from diloco.spec.copies import Copy\nclass Base: ...\n",
      "diloco/spec/copies.py": "from diloco.spec import Base\n"},
     ["diloco.spec", "diloco.spec.copies"]),
    # Through the package-dir mapping: trainer/ is diloco.trainer.
    ({"trainer/recipe.py": "from diloco.trainer.stepper import load\n",
      "trainer/stepper.py": "def load():\n    from diloco.trainer import recipe\n"},
     ["diloco.trainer.recipe", "diloco.trainer.stepper"]),
])
def test_a_planted_cycle_is_caught(tmp_path: Path, files: dict[str, str], cycle: list[str]) -> None:
    plant(tmp_path, files)
    assert cycles(graph(tmp_path)) == [cycle]


def test_imports_one_way_are_no_cycle(tmp_path: Path) -> None:
    """A chain, a package importing its submodules, and a submodule importing a sibling: no loop."""
    plant(tmp_path, {"diloco/spec/__init__.py": "from diloco.spec.copies import Copy\nfrom .base import Base\n",
                     "diloco/spec/copies.py": "from diloco.spec.base import Base\n",
                     "diloco/spec/base.py": "import numpy\n",
                     "apps/cli.py": "from diloco import spec\nfrom diloco.spec import Base\n"})
    edges = graph(tmp_path)
    assert edges["diloco.apps.cli"] == {"diloco.spec"} and edges["diloco.spec.copies"] == {"diloco.spec.base"}
    assert cycles(edges) == []
