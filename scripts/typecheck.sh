#!/usr/bin/env bash
# mypy over the package as it imports (scripts/package-view.sh: trainer/ as diloco.trainer, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -P -c "import diloco.wire"  # generates the gRPC stubs and their .pyi if the proto changed
tree=$(bash scripts/package-view.sh)
cd "$tree" && exec "../../$PY" -m mypy --python-executable "../../$PY" --cache-dir .mypy_cache "$@"
