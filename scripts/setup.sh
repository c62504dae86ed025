#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project with its test extra.
# torch==2.13.0 first: on this machine it is the CPU build on local disk; an unpinned torch
# would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" >/dev/null 2>&1; then
  pip install -q torch==2.13.0
fi
pip install -q -e '.[test]'
