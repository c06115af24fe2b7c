#!/usr/bin/env bash
# Every CUDA path on this machine's GPU: the `gpu` tests, then benchmarks/gpu_check.py (exactness asserted, step
# times). Installs nothing: it uses the Python that already has the project's dependencies ($PY, else .venv's,
# else python3), so it runs on a GPU machine without a package index. A few minutes on one H100 or H200.
#   bash scripts/gpu_check.sh              # extra arguments go to pytest, e.g. -x
#   bash scripts/gpu_check.sh --suite      # then the rest of the suite too, with the GPU hidden from it
# The rest of the suite runs in a pytest of its own with CUDA_VISIBLE_DEVICES empty: those tests are the CPU's (gloo,
# forked worker processes), and a worker process that a gpu test had given CUDA could not fork (CUDA forbids it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
suite=0
if [ "${1:-}" = "--suite" ]; then suite=1; shift; fi
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
suite_rc=0
if [ "$suite" = 1 ]; then
  echo "== the rest of the suite, GPU hidden (pytest -m 'not gpu')"
  CUDA_VISIBLE_DEVICES= "$PY" -m pytest -m "not gpu" -n "$(( $(nproc) > 2 ? $(nproc) - 2 : 1 ))" --dist worksteal -q \
    -p no:cacheprovider "$@" || suite_rc=$?
fi
if [ "$tests_rc" != 0 ] || [ "$bench_rc" != 0 ] || [ "$suite_rc" != 0 ]; then
  echo "== gpu_check.sh FAILED: gpu tests exit $tests_rc, benchmarks/gpu_check.py exit $bench_rc, rest of the suite exit" \
       "$suite_rc" >&2
  exit 1
fi
echo "== gpu_check.sh passed: gpu tests ${tests} s, all $((SECONDS - start)) s"
