#!/usr/bin/env bash
# mypy over the package as it imports: diloco/ plus trainer/, syncer/, operator/ and apps/ as
# diloco.trainer, diloco.syncer, diloco.operator and diloco.apps (pyproject's package-dir), through a tree
# of symlinks under build/, since mypy cannot follow setuptools' editable-install finder.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -P -c "import diloco.wire"  # generates the gRPC stubs and their .pyi if the proto changed
tree=build/typecheck
rm -rf "$tree/diloco" && mkdir -p "$tree/diloco"
for f in diloco/*; do
  [ "$(basename "$f")" = __pycache__ ] || ln -s "../../../$f" "$tree/diloco/$(basename "$f")"
done
for d in trainer syncer operator apps; do ln -s "../../../$d" "$tree/diloco/$d"; done
cp pyproject.toml "$tree/"
cd "$tree" && exec "../../$PY" -m mypy --python-executable "../../$PY" --cache-dir .mypy_cache "$@"
