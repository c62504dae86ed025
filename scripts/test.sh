#!/usr/bin/env bash
# The test command: set up, lint and format check (ruff), then the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
pytest -q "$@"
