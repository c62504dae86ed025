#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project with its test extra.
# torch==2.13.0 first: on this machine it is the CPU build on local disk; an unpinned torch
# would pull a multi-GB CUDA build. pip's output goes to .venv/install.log (shown on failure).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
log=.venv/install.log
: > "$log"
if ! python -c "import torch" >/dev/null 2>&1; then
  echo "installing torch 2.13.0 (CPU build) into .venv ..."
  pip install --disable-pip-version-check torch==2.13.0 >>"$log" 2>&1 || { cat "$log"; exit 1; }
fi
if ! python -c "import planner, pulp, transformers, ruff, pytest, xdist" >/dev/null 2>&1 || [ pyproject.toml -nt .venv/installed.stamp ]; then
  echo "installing the project and its test tools into .venv ..."
  pip install --disable-pip-version-check -e '.[test]' >>"$log" 2>&1 || { cat "$log"; exit 1; }
  touch .venv/installed.stamp
fi
