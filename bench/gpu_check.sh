#!/usr/bin/env bash
# One-GPU check of the prices that hold (bench/README.md, "gpu_check"): calibrate this GPU with CUDA
# events and NCCL, run the tiny Llama forward and decode at world size 1 on it, and print measured
# beside predicted. Under 10 minutes on one NVIDIA GPU. Everything goes under ${OUT:-out/gpu_check}.
#
#   bash bench/gpu_check.sh            # OUT=out/gpu_check
#   OUT=/tmp/h200 bash bench/gpu_check.sh
#
# Exit codes: 0 all steps ran; 2 no CUDA torch (nothing installed silently: see the message);
# otherwise the failing step's code (124: it ran past its timeout).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu_check}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/gpu_check.log"
: >"$LOG"

step() {  # step NAME TIMEOUT_S COMMAND...: run with a timeout, log, stop the script on failure
  local name="$1" limit="$2"
  shift 2
  echo "== $name (timeout ${limit}s): $*" | tee -a "$LOG"
  local start=$SECONDS rc=0
  timeout --signal=TERM --kill-after=15 "$limit" "$@" >>"$LOG" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "!! $name failed (exit $rc$([ "$rc" -eq 124 ] && echo ': timed out')); last lines of $LOG:" >&2
    tail -n 30 "$LOG" >&2
    exit "$rc"
  fi
  echo "   done in $((SECONDS - start)) s" | tee -a "$LOG"
}

step "setup" 300 bash scripts/setup.sh
. .venv/bin/activate

if ! python - <<'EOF'
import sys
import torch
if not torch.cuda.is_available():
    print(
        f"torch {torch.__version__} in .venv sees no CUDA GPU (torch.version.cuda = {torch.version.cuda}).\n"
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

SPEC="$OUT/h200-calibrated.yaml"
step "calibrate (CUDA events, NCCL at world size 1)" 240 \
  planner calibrate --nproc 1 --model examples/llama3.py --out "$SPEC"
step "tiny Llama forward, world size 1, NCCL" 150 \
  planner optimize examples/llama3.py --cluster "$SPEC" --nproc 1 --run --json "$OUT/forward.json"
step "tiny Llama decode (context 64), world size 1, NCCL" 150 \
  planner optimize examples/llama3_kv.py --workload decode --context 64 --nproc 1 --run \
  --cluster "$SPEC" --json "$OUT/decode.json"

step "Megatron rows' layers, op by op (issue 32's small-model gap)" 180 \
  python bench/layer_check.py --cluster dgx-h200 --json "$OUT/layer_check.json"

python - "$OUT" "$SPEC" <<'EOF' | tee "$OUT/summary.txt"
"""The summary: GEMM efficiency measured now vs the calibrated fit and the dgx-h200 preset, the NCCL
per-call time, and the two runs' measured / predicted."""
import json
import sys
from pathlib import Path

import torch

from costmodels.cluster import load_cluster
from costmodels.compute import gemm_efficiency
from costmodels.gpu_calibrate import CudaEventTimer, time_gemms

out, spec_path = Path(sys.argv[1]), sys.argv[2]
spec, preset = load_cluster(spec_path), load_cluster("dgx-h200")
datasheet = preset.device.peak_flops_per_s["bf16"]
shapes = [(8192, 8192, 256), (8192, 8192, 1024), (8192, 8192, 8192), (256, 8192, 8192), (4096, 14336, 4096)]
print(f"device: {spec.device.name}; efficiencies over the dgx-h200 preset's bf16 peak {datasheet / 1e12:.0f} TFLOP/s")
print(f"{'GEMM M x N x K':>22} {'measured':>9} {'calibrated fit':>15} {'dgx-h200 preset':>16}")
for p in time_gemms(shapes, torch.device("cuda"), CudaEventTimer()):
    measured = p.flops / p.time_s / datasheet
    fit = gemm_efficiency(p.m, p.n, p.k, spec.device.gemm) * spec.device.peak_flops_per_s["bf16"] / datasheet
    ref = gemm_efficiency(p.m, p.n, p.k, preset.device.gemm)
    print(f"{f'{p.m} x {p.n} x {p.k}':>22} {measured:>9.3f} {fit:>15.3f} {ref:>16.3f}")
a = spec.device.attention
if a is not None:
    print(f"attention fit: efficiency {a.efficiency:.3f} (preset {preset.device.attention.efficiency}), causal half "
          f"{a.causal_half_seq:.0f} tokens (preset {preset.device.attention.causal_half_seq:.0f}), backward x"
          f"{a.backward_time_factor:.2f} (preset {preset.device.attention.backward_time_factor})")
for line in spec.sources:
    if "world size 1" in line or "latency_us" in line:
        print("all-reduce:", line)
print(f"links.intra_node.latency_us in the spec: {spec.intra_node.latency_s * 1e6:.2f} "
      f"(one GPU: a placeholder, not measured; the preset's is {preset.intra_node.latency_s * 1e6:.1f})")
for name in ("forward", "decode"):
    report = json.loads((out / f"{name}.json").read_text())
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
echo "wrote $OUT (summary.txt, h200-calibrated.yaml, forward.json, decode.json, layer_check.json, gpu_check.log)"
