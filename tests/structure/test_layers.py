"""What the syncer image runs (`diloco syncer`, `operator`, `crd`, `status`, `validate`) never
imports the trainer or the `learner` extra: its image is `pip install .`, with no JAX.

Read from the source, every import counted, those inside functions too, so the day someone adds
one on a path no test happens to run, this fails (tests/system/test_slim.py then runs the commands in
a real install without the extra)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from diloco import extras

ROOT = Path(__file__).resolve().parents[2]
# Import name -> folder (pyproject.toml's package-dir).
FOLDERS = {"diloco.trainer": "trainer", "diloco.syncer": "syncer", "diloco.operator": "operator", "diloco.apps": "apps",
           "diloco": "diloco"}
# The entry points of the syncer image's commands: the command line (its parsers and handlers),
# the syncer and the operator.
ENTRIES = ("diloco.apps.cli", "diloco.syncer.main", "diloco.operator.main")
FORBIDDEN = ("diloco.trainer", "jaxlib", *extras.modules(extras.LEARNER))
# `diloco simulate --plot` draws with matplotlib and, without it, names the install (tests/diloco/test_extras.py).
ALLOWED = {("diloco.apps.sim.plot", "matplotlib"), ("diloco.apps.sim.plot", "matplotlib.pyplot")}


def source_of(module: str) -> Path | None:
    for prefix, folder in FOLDERS.items():  # longest prefix first
        if module == prefix or module.startswith(prefix + "."):
            parts = module[len(prefix):].lstrip(".").split(".") if module != prefix else []
            base = ROOT.joinpath(folder, *parts)
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.is_file():
                    return candidate
    return None


def imports_of(module: str) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import statement in the module, at any depth."""
    path = source_of(module)
    assert path is not None, module
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    return imports_in(path.read_text(encoding="utf-8"), package)


def imports_in(text: str, package: str) -> Iterator[tuple[str, int]]:
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                kept = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*kept, base] if base else kept)
            for alias in node.names:  # `from pkg import module` imports a module, not a name
                full = f"{base}.{alias.name}"
                yield (full if source_of(full) else base), node.lineno


def reachable(entries: tuple[str, ...]) -> dict[str, list[tuple[str, int]]]:
    """Every project module the entries import, transitively, with what each imports."""
    seen: dict[str, list[tuple[str, int]]] = {}
    todo = list(entries)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen[module] = list(imports_of(module))
        todo.extend(name for name, _ in seen[module]
                    if name.startswith("diloco") and source_of(name) and not forbidden(name))
    return seen


def forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def test_the_syncer_images_commands_import_no_trainer_and_no_jax() -> None:
    graph = reachable(ENTRIES)
    assert {"diloco.operator.render.job", "diloco.syncer.servicer", "diloco.apps.commands", "diloco.spec"} <= set(graph)
    found = [f"{source_of(m).relative_to(ROOT)}:{line} imports {name}"  # type: ignore[union-attr]
             for m, names in sorted(graph.items()) for name, line in names
             if forbidden(name) and (m, name) not in ALLOWED]
    assert not found, "the syncer image has no JAX (pip install ., no extras):\n" + "\n".join(found)


def test_the_walk_sees_imports_inside_functions_and_relative_ones() -> None:
    text = "def f():\n    from diloco.trainer.model import build\n    from ..trainer import data\n    import jax.numpy\n"
    assert list(imports_in(text, "diloco.operator")) == [
        ("diloco.trainer.model", 2), ("diloco.trainer.data", 3), ("jax.numpy", 4)]
    assert forbidden("jax.numpy") and forbidden("diloco.trainer.model") and not forbidden("diloco.trainers")
