#!/usr/bin/env bash
# The whole test suite on CPU, after creating .venv and installing the project if needed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup_env.sh
# Three workers (pytest-xdist) on 2 cores: most tests run one process on one intra-op thread, and many of the
# slow ones mostly wait (processes starting, a hung rank's timeout, the lab's network), so a third worker keeps
# the cores busy meanwhile: 9 min 44 s against 10 min 30 s with two, the same code on the same 2-core CPU. Each
# test goes to whichever worker is free. Add -n 0 to run in this one process.
"$PY" -m pytest -n 3 --dist worksteal "$@"
