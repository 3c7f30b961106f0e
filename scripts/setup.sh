#!/usr/bin/env bash
# Creates .venv at the repository root and installs specdec with its test tools.
# torch is pinned to the CPU build 2.13.0 (an unpinned torch pulls a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
extra=()
[ -d /opt/wheels ] && extra+=(--find-links /opt/wheels)
.venv/bin/pip install -q --disable-pip-version-check "${extra[@]}" -c scripts/constraints.txt -e ".[dev]"
