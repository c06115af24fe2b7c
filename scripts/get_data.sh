#!/usr/bin/env bash
# Makes Fashion-MNIST available under data/FashionMNIST/raw/ (idempotent).
# Order: files already there; Debian's dataset-fashion-mnist package (installed here if we are root on
# Debian/Ubuntu); otherwise the DataModule falls back to torchvision's download at training time.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
deb=/usr/share/datasets/fashion-mnist
if [ ! -f data/FashionMNIST/raw/t10k-labels-idx1-ubyte ] && [ ! -f "$deb/t10k-labels-idx1-ubyte.gz" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "== installing Debian's dataset-fashion-mnist"
    apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q dataset-fashion-mnist >/dev/null; } \
      || echo "   (not installable here: torchvision's download will be tried)"
  else
    echo "== not root on Debian/Ubuntu: torchvision's download will be tried"
  fi
fi
.venv/bin/python -c "from src.data.fashion_mnist import ensure_raw_files as f; print('== data:', f('data'))"
