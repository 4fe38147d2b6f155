#!/usr/bin/env bash
# The package as it imports, as a tree of symlinks under build/view: diloco/ plus trainer/,
# syncer/, operator/ and apps/ as diloco.trainer, diloco.syncer, diloco.operator and diloco.apps
# (pyproject's package-dir), for the tools that read a package from the file system (mypy,
# import-linter) and cannot follow setuptools' editable-install finder. Prints the tree's path.
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"
tree=build/view
rm -rf "$tree/diloco" && mkdir -p "$tree/diloco"
for f in diloco/*; do
  [ "$(basename "$f")" = __pycache__ ] || ln -s "../../../$f" "$tree/diloco/$(basename "$f")"
done
for d in $(python3 -P -c "import tomllib; m = tomllib.load(open('pyproject.toml', 'rb'))['tool']['setuptools']['package-dir']; print(' '.join(f for p, f in m.items() if p != 'diloco'))"); do
  ln -s "../../../$d" "$tree/diloco/$(basename "$d")"
done
cp pyproject.toml "$tree/"
echo "$tree"
