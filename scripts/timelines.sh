#!/usr/bin/env bash
# A step timeline of LeNet under each layout: one device, ours 1x2 and 2x1, DDP 2x1 (30 steps each, steps 20-24
# recorded). Prints where each run's timeline/ folder is. Extra arguments go to every run, e.g.
# `bash scripts/timelines.sh --data.batch_size 256`. docs/timeline.md explains the output.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup_env.sh
bash scripts/get_data.sh
for overlay in single split_allreduce split_allreduce_processes ddp_cpu; do
  echo "== $overlay"
  "$PY" -m src.cli fit --config configs/lenet.yaml --config "configs/strategy/$overlay.yaml" \
    --config configs/profile.yaml --trainer.max_steps 30 --trainer.enable_progress_bar false "$@" 2>&1 |
    grep -E "^(step timeline|error)" || { echo "the $overlay run failed: run it alone to see why" >&2; exit 1; }
done
