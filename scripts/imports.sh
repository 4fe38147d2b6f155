#!/usr/bin/env bash
# import-linter's contracts (pyproject.toml, [tool.importlinter]) over the package as it imports
# (scripts/package-view.sh). `ROOT=DIR` checks another tree laid out like this one (the test that
# plants a wrong-way import does).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tree=$(bash "$here/package-view.sh" "${ROOT:-$here/..}")
cd "${ROOT:-$here/..}/$tree" && exec "$here/../.venv/bin/lint-imports" --no-cache "$@" pyproject.toml
