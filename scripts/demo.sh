#!/usr/bin/env bash
# The main job on bundled data: set up .venv if needed (torch and this package only, no test
# extras), build a cache in the background while reading it, train a tiny GPT on it, stop,
# resume, and check that the resumed losses equal the uninterrupted ones. Output: runs/quickstart/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh main
exec .venv/bin/python examples/quickstart.py "$@"
