#!/usr/bin/env bash
# The whole test suite on CPU, after creating .venv and installing the project if needed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup_env.sh
# Two workers (pytest-xdist): most tests run one process on one intra-op thread, so on 2 cores two at a time
# halve the wall time; each test goes to whichever worker is free. Add -n 0 to run in this one process.
"$PY" -m pytest -n 2 --dist worksteal "$@"
