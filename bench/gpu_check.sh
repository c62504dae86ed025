#!/usr/bin/env bash
# One-GPU check of the prices that hold (bench/README.md, "gpu_check"): calibrate this GPU with CUDA
# events and NCCL, run the tiny Llama forward, decode and training step (bf16 / fp32 as planned, and
# fp16 with loss scaling: ShardedGradScaler on CUDA) at world size 1 on it, time
# one layer of each Megatron-Core row op by op, and print measured beside predicted. Under 10 minutes on one NVIDIA GPU.
# Everything goes under ${OUT:-out/gpu_check}.
#
#   bash bench/gpu_check.sh            # OUT=out/gpu_check
#   OUT=/tmp/h200 bash bench/gpu_check.sh
#
# Python: where `python3` (or $PYTHON) already has a CUDA build of torch and the project's other
# run-time dependencies (a GPU machine's own image, with no registry to install from), this checkout
# runs under it as it is (on PYTHONPATH); otherwise scripts/setup.sh makes .venv, which must then hold
# a CUDA torch.
#
# Each step runs under its own timeout; a failed step is reported and the next ones still run.
# Exit codes: 0 all steps ran; 2 no CUDA torch (nothing installed silently: see the message);
# otherwise the first failing step's code (124: it ran past its timeout).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu_check}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/gpu_check.log"
: >"$LOG"
FAILED=0

step() {  # step NAME TIMEOUT_S COMMAND...: run with a timeout and log; on failure show the log's tail
  local name="$1" limit="$2"
  shift 2
  echo "== $name (timeout ${limit}s): $*" | tee -a "$LOG"
  local start=$SECONDS rc=0
  timeout --signal=TERM --kill-after=15 "$limit" "$@" >>"$LOG" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "!! $name failed (exit $rc$([ "$rc" -eq 124 ] && echo ': timed out')) after $((SECONDS - start)) s;" \
      "last lines of $LOG:" | tee -a "$LOG" >&2
    tail -n 30 "$LOG" >&2
    [ "$FAILED" -ne 0 ] || FAILED=$rc
    return 0
  fi
  echo "   done in $((SECONDS - start)) s" | tee -a "$LOG"
}

PY="${PYTHON:-python3}"
if "$PY" -c 'import sys, networkx, pulp, rich, safetensors, torch, yaml; sys.exit(0 if torch.cuda.is_available() else 1)' \
  >/dev/null 2>&1; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  echo "using $(command -v "$PY") as it is (a CUDA torch and the dependencies are there), this checkout on PYTHONPATH" \
    | tee -a "$LOG"
else
  step "setup" 300 bash scripts/setup.sh
  [ "$FAILED" -eq 0 ] || exit "$FAILED"
  PY="$PWD/.venv/bin/python"
fi
PLANNER=("$PY" -m planner.cli)

if ! "$PY" - <<'EOF'
import sys
import torch
if not torch.cuda.is_available():
    print(
        f"torch {torch.__version__} of {sys.executable} sees no CUDA GPU (torch.version.cuda = {torch.version.cuda}).\n"
        "This check needs a CUDA build of torch matching the driver; install it yourself into .venv, e.g.\n"
        "  .venv/bin/pip install --force-reinstall torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128\n"
        "(a multi-GB download; pick the cuXYZ of `nvidia-smi`'s CUDA version), then run this script again.",
        file=sys.stderr,
    )
    sys.exit(2)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): "
      f"{torch.cuda.get_device_name(0)}")
EOF
then
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv >>"$LOG" 2>&1 || true

SPEC="$OUT/h200-calibrated.yaml"
step "calibrate (CUDA events, NCCL at world size 1)" 240 \
  "${PLANNER[@]}" calibrate --nproc 1 --model examples/llama3.py --out "$SPEC"
step "tiny Llama forward, world size 1, NCCL" 150 \
  "${PLANNER[@]}" optimize examples/llama3.py --cluster "$SPEC" --nproc 1 --run --json "$OUT/forward.json"
step "tiny Llama decode (context 64), world size 1, NCCL" 150 \
  "${PLANNER[@]}" optimize examples/llama3_kv.py --workload decode --context 64 --nproc 1 --run \
  --cluster "$SPEC" --json "$OUT/decode.json"

step "tiny Llama training step, world size 1, NCCL" 150 \
  "${PLANNER[@]}" optimize examples/llama3.py --workload train --cluster "$SPEC" --nproc 1 --run \
  --json "$OUT/train.json"

step "tiny Llama fp16 training step with dynamic loss scaling, world size 1, NCCL" 150 \
  "${PLANNER[@]}" optimize examples/llama3.py --workload train --dtype fp16 --cluster "$SPEC" --nproc 1 --run \
  --json "$OUT/train_fp16.json"

step "the 1.7B row's whole training step, sustained (mbs 1 and 4, 40 s each)" 240 \
  "$PY" bench/step_check.py --seconds 40 --json "$OUT/step_check.json"

step "Megatron rows' layers, op by op (issue 32's small-model gap)" 180 \
  "$PY" bench/layer_check.py --cluster dgx-h200 --json "$OUT/layer_check.json"

"$PY" - "$OUT" "$SPEC" <<'EOF' | tee "$OUT/summary.txt" || [ "$FAILED" -ne 0 ] || FAILED=1
"""The summary: GEMM efficiency measured now vs the calibrated fit and the dgx-h200 preset, the NCCL
per-call time, and the four runs' measured / predicted. A part whose step failed says so."""
import json
import sys
from pathlib import Path

import torch

from costmodels.cluster import load_cluster
from costmodels.compute import gemm_efficiency
from costmodels.gpu_calibrate import CudaEventTimer, time_gemms

out, spec_path = Path(sys.argv[1]), Path(sys.argv[2])
preset = load_cluster("dgx-h200")
spec = load_cluster(str(spec_path)) if spec_path.exists() else None
if spec is None:
    print(f"no calibrated spec ({spec_path} missing: the calibrate step failed); fits shown as -")
datasheet = preset.device.peak_flops_per_s["bf16"]
shapes = [(8192, 8192, 256), (8192, 8192, 1024), (8192, 8192, 8192), (256, 8192, 8192), (4096, 14336, 4096),
          (4096, 6144, 2048), (4096, 2048, 2048), (4096, 8192, 2048), (4096, 2048, 8192)]
print(f"device: {torch.cuda.get_device_name(0)}; efficiencies over the dgx-h200 preset's bf16 peak "
      f"{datasheet / 1e12:.0f} TFLOP/s")
print(f"{'GEMM M x N x K':>22} {'measured':>9} {'calibrated fit':>15} {'dgx-h200 preset':>16}")
for p in time_gemms(shapes, torch.device("cuda"), CudaEventTimer()):
    measured = p.flops / p.time_s / datasheet
    fit = "-" if spec is None else (
        f"{gemm_efficiency(p.m, p.n, p.k, spec.device.gemm) * spec.device.peak_flops_per_s['bf16'] / datasheet:.3f}")
    ref = gemm_efficiency(p.m, p.n, p.k, preset.device.gemm)
    print(f"{f'{p.m} x {p.n} x {p.k}':>22} {measured:>9.3f} {fit:>15} {ref:>16.3f}")
a = None if spec is None else spec.device.attention
if a is not None:
    print(f"attention fit: efficiency {a.efficiency:.3f} (preset {preset.device.attention.efficiency}), causal half "
          f"{a.causal_half_seq:.0f} tokens (preset {preset.device.attention.causal_half_seq:.0f}), backward x"
          f"{a.backward_time_factor:.2f} (preset {preset.device.attention.backward_time_factor}), dropout 0.1 x"
          f"{a.dropout_time_factor:.3f} (preset {preset.device.attention.dropout_time_factor})")
if spec is not None:
    for line in spec.sources:
        if "world size 1" in line or "latency_us" in line:
            print("all-reduce:", line)
    d = spec.device
    if d.host_dispatch_s is not None:
        print(f"host dispatch per fx node (calibrated): forward {d.host_dispatch_s * 1e6:.1f} us, backward "
              f"{(d.host_dispatch_s if d.host_dispatch_backward_s is None else d.host_dispatch_backward_s) * 1e6:.1f} us; launch {d.launch_overhead_s * 1e6:.1f} us")
    print(f"links.intra_node.latency_us in the spec: {spec.intra_node.latency_s * 1e6:.2f} "
          f"(one GPU: a placeholder, not measured; the preset's is {preset.intra_node.latency_s * 1e6:.1f})")
steps = out / "step_check.json"
if steps.exists():
    report = json.loads(steps.read_text())
    for r in report["runs"]:
        if "error" in r:
            print(f"1.7B step, mbs {r['micro_batch_size']}: {r['error']} (predicted {r['predicted_s']:.3f} s)")
            continue
        clocks = r["clocks_mhz"]
        print(f"1.7B step, mbs {r['micro_batch_size']}: median {r['median_s']:.3f} s (first 10 {r['first_s']:.3f}, "
              f"last 10 {r['last_s']:.3f}), predicted {r['predicted_s']:.3f} s on {report['cluster']}, measured / "
              f"predicted {r['median_s'] / r['predicted_s']:.2f}; SM clock "
              f"{f'{min(clocks):.0f}-{max(clocks):.0f} MHz' if clocks else '-'}; published (H100) {report['published_s']:.3f} s")
else:
    print("1.7B step: no report (step_check.json missing: its step failed)")
for name in ("forward", "decode", "train", "train_fp16"):
    path = out / f"{name}.json"
    if not path.exists():
        print(f"{name}: no report ({path.name} missing: its step failed)")
        continue
    report = json.loads(path.read_text())
    m = report.get("measured") or {}
    ratio = m.get("measured_over_predicted")
    print(f"{name}: measured {m.get('latency_s', float('nan')) * 1e3:.3f} ms, predicted "
          f"{report['predicted']['latency_s'] * 1e3:.3f} ms, measured / predicted "
          f"{'n/a' if ratio is None else f'{ratio:.2f}'}")
    if report.get("serving", {}).get("measured"):
        sm, sp = report["serving"]["measured"], report["serving"]["predicted"]
        if sm.get("tpot_s") and sp.get("tpot_s"):
            print(f"  decode ms/token: measured {sm['tpot_s'] * 1e3:.3f}, predicted {sp['tpot_s'] * 1e3:.3f}, "
                  f"ratio {sm['tpot_s'] / sp['tpot_s']:.2f}")
EOF
sed -n '/One layer per TP rank/,/^rest = /p' "$LOG" | tee -a "$OUT/summary.txt"
echo "wrote $OUT (summary.txt, h200-calibrated.yaml, forward.json, decode.json, train.json, train_fp16.json, step_check.json, layer_check.json, gpu_check.log)"
exit "$FAILED"
