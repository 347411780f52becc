#!/usr/bin/env bash
# Create .venv (once) with the pinned CPU PyTorch and torchcache installed in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
    "$PYTHON" -m venv .venv
fi
if ! (cd / && "$OLDPWD/.venv/bin/python" -c "import torchcache, torch, pytest, hypothesis, zstandard, pyarrow, torchdata, s3fs, moto, ray") 2>/dev/null; then
    # torch is pinned for development and CI (a CPU build); the package itself accepts torch>=2.1
    .venv/bin/python -m pip install -q "torch==2.13.0" -e ".[test]"
fi
