#!/usr/bin/env bash
# Set up .venv with the test extras (if needed) and run the WHOLE test suite, slow tests included,
# on one pytest-xdist worker per core (at most 4; TEST_WORKERS=N to choose, 0 for no workers).
#   bash scripts/test.sh               # everything (what CI runs)
#   bash scripts/test.sh -k resume     # extra arguments go to pytest
#   bash scripts/test.sh -m "not slow" # a later -m replaces the one given here
# Plain `pytest` (pyproject.toml's addopts) skips the tests marked slow. Every run keeps its
# temporary files (and HOME) in one folder that it removes (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
WORKERS=${TEST_WORKERS:-$(nproc)}
if (( WORKERS > 4 )); then WORKERS=4; fi
exec .venv/bin/python -m pytest -q -m "slow or not slow" -n "$WORKERS" --dist worksteal "$@"
