#!/usr/bin/env bash
# The main job: set up, then plan the tiny Llama-3 for this CPU machine (2 gloo ranks) and run it,
# printing predicted beside measured latency. Without --cluster the machine is measured on first use
# (`planner calibrate`, 30-40 s) and the spec cached. Extra arguments are passed to `planner optimize`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
mkdir -p out
planner optimize examples/llama3.py --nproc 2 --run \
  --out out/plan.yaml --json out/report.json --emit out/sharded "$@"
