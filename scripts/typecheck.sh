#!/usr/bin/env bash
# ruff and mypy over the installed packages and the tests. mypy cannot follow setuptools'
# package-dir mapping (kernels/ -> specdec.kernels, ...), so it checks a tree of symlinks laid
# out as the package installs: then calls between specdec, kernels, drafters and server are typed.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check specdec kernels drafters server evals tests
tree=build/typecheck
rm -rf "$tree" && mkdir -p "$tree/specdec"
for entry in specdec/*; do ln -s "$PWD/$entry" "$tree/specdec/"; done
for folder in kernels drafters server evals; do ln -s "$PWD/$folder" "$tree/specdec/$folder"; done
# The tests are checked with the same config, in the same run, beside the package: their
# `from specdec.kernels ...` and `from tests.helpers ...` imports both resolve in the tree.
ln -s "$PWD/tests" "$tree/tests"
cd "$tree" && ../../.venv/bin/mypy --config-file ../../pyproject.toml specdec tests
