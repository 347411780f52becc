#!/usr/bin/env bash
# Set up .venv with the test extras (if needed) and run the WHOLE test suite, slow tests included.
#   bash scripts/test.sh               # everything (what CI runs)
#   bash scripts/test.sh -k resume     # extra arguments go to pytest
#   bash scripts/test.sh -m "not slow" # a later -m replaces the one given here
# Plain `pytest` (pyproject.toml's addopts) skips the tests marked slow.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec .venv/bin/python -m pytest -q -m "slow or not slow" "$@"
