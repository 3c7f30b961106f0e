#!/usr/bin/env bash
# Sets up .venv (idempotent) and starts the OpenAI-compatible server on the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/specdec serve "$@"
