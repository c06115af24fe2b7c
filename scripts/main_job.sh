#!/usr/bin/env bash
# The main job on a fresh machine: venv + install, data, train LeNet, print the test accuracy.
# Extra arguments go to the CLI, e.g. `bash scripts/main_job.sh --trainer.max_epochs 2`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup_env.sh
bash scripts/get_data.sh
exec "$PY" -m src.cli fit --config configs/lenet.yaml "$@"
