#!/usr/bin/env bash
# Creates .venv and installs the project with its dev extra; a second run skips what is done.
# Sourced by the other scripts: leaves `PY` pointing at the venv's python.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
PY=.venv/bin/python
# Reinstall only when pyproject.toml changed since the last successful install.
stamp=.venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -f "$stamp" ]; then
  echo "== installing the project into .venv (torch is large: a few minutes the first time)"
  "$PY" -m pip install --quiet --upgrade pip
  "$PY" -m pip install --quiet -e ".[dev]"
  rm -f .venv/.installed-* && touch "$stamp"
fi
export PY
