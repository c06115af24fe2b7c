#!/usr/bin/env bash
# Every CUDA path on this machine's GPU: the `gpu` tests, then benchmarks/gpu_check.py (exactness asserted, step
# times). Installs nothing: it uses the Python that already has the project's dependencies ($PY, else .venv's,
# else python3), so it runs on a GPU machine without a package index. A few minutes on one H100 or H200.
#   bash scripts/gpu_check.sh              # extra arguments go to pytest, e.g. -x
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
"$PY" - <<'PYCHECK' || exit 2
import importlib.util, sys
missing = [m for m in ("torch", "lightning", "torchmetrics", "jsonargparse", "tensorboard", "pytest")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"error: {sys.executable} lacks {', '.join(missing)}: install the project (pip install -e '.[dev]') "
             "or set PY to a Python that has it")
import torch
if not torch.cuda.is_available():
    sys.exit("error: no CUDA GPU is visible to torch (torch.cuda.is_available() is False): run this on a GPU machine")
print(f"== {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {sys.executable}")
PYCHECK
start=$SECONDS
echo "== the gpu tests (pytest -m gpu)"
tests_rc=0
"$PY" -m pytest -m gpu -n 0 -q -p no:cacheprovider "$@" || tests_rc=$?
tests=$((SECONDS - start))
echo "== benchmarks/gpu_check.py"   # run even after a failed test: its table says more about what broke
bench_rc=0
"$PY" -m benchmarks.gpu_check || bench_rc=$?
if [ "$tests_rc" != 0 ] || [ "$bench_rc" != 0 ]; then
  echo "== gpu_check.sh FAILED: gpu tests exit $tests_rc, benchmarks/gpu_check.py exit $bench_rc" >&2
  exit 1
fi
echo "== gpu_check.sh passed: gpu tests ${tests} s, all $((SECONDS - start)) s"
