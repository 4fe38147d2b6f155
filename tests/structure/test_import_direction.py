"""Imports go one way (docs/DEVELOPMENT.md, "Layers"): the base imports nothing above it, each
of the three processes imports only the base and itself, and the applications sit on top.

The base is what every process image carries (the syncer's has no JAX: an operator that
imported the trainer to size a volume could not start there); a process importing another
drags that one's dependencies and internals into its image and its tests. The folders are the
layers: a module's folder says where it stands, so a new one is placed by where it is written.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Folder -> package, as pyproject.toml maps them.
PACKAGES = {"diloco": "diloco", "trainer": "diloco.trainer", "syncer": "diloco.syncer", "operator": "diloco.operator",
            "apps": "diloco.apps"}
# Package -> layer, most specific first: diloco/ is the base, apps/ the applications, and each
# process its own folder.
LAYERS = {"diloco.apps": "app", "diloco.trainer": "diloco.trainer", "diloco.syncer": "diloco.syncer",
          "diloco.operator": "diloco.operator", "diloco": "base"}


def layer(module: str) -> str | None:
    for package, name in LAYERS.items():
        if module == package or module.startswith(package + "."):
            return name
    return None


def allowed(source: str, target: str) -> bool:
    """An application imports anything; the base and each process, only the base and themselves."""
    return source == "app" or target in ("base", source)


def module_of(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.AST, module: str) -> Iterator[tuple[int, str]]:
    """(line, module) of every diloco import, function-local ones too, `from diloco import x`
    resolved to `diloco.x` where x is a module."""
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.startswith("diloco"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base == "diloco":
                yield from ((node.lineno, f"diloco.{a.name}") for a in node.names)
            elif base.startswith("diloco"):
                yield node.lineno, base


def violations(root: Path) -> list[str]:
    out = []
    for folder in PACKAGES:
        for path in sorted((root / folder).rglob("*.py")):
            if "proto" in path.parts or ".venv" in path.parts:
                continue
            module = module_of(path, root)
            source = layer(module)
            assert source is not None, module  # every folder of PACKAGES is a layer
            for line, target_module in imported(ast.parse(path.read_text()), module):
                target = layer(target_module)
                if target is not None and not allowed(source, target):
                    out.append(f"{path.relative_to(root)}:{line}: {source} imports {target_module} ({target})")
    return out


def test_imports_go_one_way() -> None:
    assert violations(ROOT) == []


def test_the_spec_is_imported_from_one_place() -> None:
    """diloco.spec re-exports what its modules define; only the package itself imports them."""
    out = []
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            module = module_of(path, ROOT)
            if module.startswith("diloco.spec"):
                continue
            out += [f"{path.relative_to(ROOT)}:{line}: {m}" for line, m in imported(ast.parse(path.read_text()), module)
                    if m.startswith("diloco.spec.")]
    assert out == [], "import these from diloco.spec"


@pytest.mark.parametrize("file, source, bad", [
    ("diloco/core/culprit.py", "from diloco.syncer.global_model import GlobalModel\n", "base imports diloco.syncer.global_model"),
    ("operator/culprit.py", "def f():\n    from diloco.trainer import model\n", "diloco.operator imports diloco.trainer"),
    ("trainer/culprit.py", "import diloco.syncer.joins.seeding\n", "diloco.trainer imports diloco.syncer.joins.seeding"),
    ("diloco/shapes.py", "from diloco.apps import local\n", "base imports diloco.apps (app)"),
])
def test_a_wrong_way_import_is_caught(tmp_path: Path, file: str, source: str, bad: str) -> None:
    for name in PACKAGES:
        (tmp_path / name).mkdir()
    (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / file).write_text(source)
    # An application may import anything: no violation.
    (tmp_path / "apps" / "cli.py").write_text("from diloco.syncer import main\nfrom diloco.trainer import model\n")
    found = violations(tmp_path)
    assert len(found) == 1 and bad in found[0], found


def test_a_module_stands_where_its_folder_is(tmp_path: Path) -> None:
    """The same import is an application's right in apps/ and a wrong-way import in diloco/."""
    for name in PACKAGES:
        (tmp_path / name).mkdir()
    (tmp_path / "apps" / "report.py").write_text("from diloco.trainer import model\n")
    assert violations(tmp_path) == []
    (tmp_path / "diloco" / "report.py").write_text("from diloco.trainer import model\n")
    assert violations(tmp_path) == ["diloco/report.py:1: base imports diloco.trainer (diloco.trainer)"]
