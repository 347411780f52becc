#!/usr/bin/env bash
# Set up (if needed) and run the main job on bundled data: build a cache in the background,
# read it while it grows, then check and summarise it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/quickstart.py "$@"
