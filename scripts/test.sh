#!/usr/bin/env bash
# The whole test suite on CPU, after creating .venv and installing the project if needed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup_env.sh
"$PY" -m pytest "$@"
