#!/usr/bin/env bash
# Create .venv (once) with the pinned CPU PyTorch and torchcache installed in editable mode.
#
#   bash scripts/setup.sh [main|test]
#
#   main (default)  what the main job (scripts/demo.sh) needs: torch==2.13.0 and the package
#                   with its runtime dependencies (numpy, tokenizers, safetensors, fsspec,
#                   braceexpand, tqdm). No test tools, no Ray, no S3, no Arrow.
#   test            main plus the test extras `.[test]` (pytest, pytest-xdist, hypothesis, psutil,
#                   webdataset, zstandard, pyarrow, torchdata, s3fs, moto, ray, accelerate,
#                   transformers, lightning, soundfile, tiktoken, sentencepiece), for
#                   scripts/test.sh and CI.
#
# Re-running is cheap: it installs only when an import of that set fails.
set -euo pipefail
cd "$(dirname "$0")/.."
WHAT=${1:-main}
PYTHON=${PYTHON:-python3}
case "$WHAT" in
    main)
        TARGET="-e ."
        IMPORTS="torchcache, torch, numpy, tokenizers, safetensors, fsspec, braceexpand, tqdm" ;;
    test)
        TARGET="-e .[test]"
        IMPORTS="torchcache, torch, numpy, tokenizers, safetensors, fsspec, braceexpand, tqdm, webdataset, pytest, xdist, hypothesis, psutil, zstandard, pyarrow, torchdata, s3fs, moto, ray, accelerate, transformers, lightning, soundfile, tiktoken, sentencepiece" ;;
    *)
        echo "usage: bash scripts/setup.sh [main|test]" >&2
        exit 2 ;;
esac
if [[ ! -x .venv/bin/python ]]; then
    "$PYTHON" -m venv .venv
fi
# (checked from / so that the import finds the installed package, not the source folder)
if ! (cd / && "$OLDPWD/.venv/bin/python" -c "import $IMPORTS") 2>/dev/null; then
    # torch is pinned for development and CI (a CPU build); the package itself accepts torch>=2.1
    .venv/bin/python -m pip install -q "torch==2.13.0" $TARGET
fi
