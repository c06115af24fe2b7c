#!/usr/bin/env bash
# The whole test suite on CPU, after creating .venv and installing the project if needed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup_env.sh
# Three workers (pytest-xdist) on 2 cores: most tests run one process on one intra-op thread, and some of the
# slow ones mostly wait (a hung rank's timeout, the lab's network), so a third worker keeps the cores busy
# meanwhile. A fourth gains nothing: 937.7 s with four (--dist load) against 931.5 s with three, the same code on
# the same 2-core AMD EPYC (2026-11-27), whose cores were sampled 0% idle every 10 s with four. Each test goes to
# whichever worker is free. Add -n 0 to run in this one process.
"$PY" -m pytest -n 3 --dist worksteal "$@"
