"""Planner speed: trace + analyse + plan, timed per phase. Targets (the planner issue):

    Llama-3-70B on one 8-GPU node (dgx-h100), trace + ILP          < 10 s
    Llama-3-405B training on 128 nodes x 8 GPUs (h100-ib-128node)  < 60 s
    Llama-3-70B capture + analysis of all 80 layers on meta        < 15 s of CPU time (the passes'
                                                                      capture; was a unit test)

Run from the repository root:  python bench/plan_speed.py [--whole]
The models are the published configs in examples/, built on the meta device (no weights) and
captured as `planner optimize` does (`planner.frontend.depth.capture_for_planning`: a two-layer slice of the
repeated blocks, extended to full depth). `--whole` captures all layers (what the passes use).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from costmodels.cluster import load_cluster  # noqa: E402
from planner.frontend.analysis import analyse  # noqa: E402
from planner.frontend.capture import capture  # noqa: E402
from planner.frontend.depth import capture_for_planning  # noqa: E402
from planner.frontend.modelfile import load_model_file  # noqa: E402
from planner.solver.problem import Constraints, WorkloadSpec  # noqa: E402
from planner.solver.search import plan_model  # noqa: E402

CASES = [
    # (name, model file, cluster, workload, target seconds)
    ("llama3-70b forward, dgx-h100", "examples/llama3_70b.py", "dgx-h100", WorkloadSpec("forward", 1, 2048, dtype="bf16"), 10.0),
    ("llama3-70b decode, dgx-h100", "examples/llama3_70b.py", "dgx-h100", WorkloadSpec("decode", 8, 1, context=4096, dtype="bf16"), 10.0),
    ("llama3-405b train, 128 x 8 H100", "examples/llama3_405b.py", "h100-ib-128node", WorkloadSpec("train", 2048, 8192, dtype="bf16"), 60.0),
]  # fmt: skip
WHOLE_CAPTURE = ("examples/llama3_70b.py", 15.0)  # (model, target CPU seconds) of a whole capture + analysis


def trace(path: str, whole: bool):
    """(structure, seconds): the analysed model, built and captured on meta."""
    start = time.perf_counter()
    model_file = load_model_file(ROOT / path)
    model = model_file.build("meta")
    args, kwargs = model_file.inputs(batch_size=1, seq_len=128)
    if whole:
        structure = analyse(capture(model, args, kwargs))
    else:
        _, structure = capture_for_planning(model, args, kwargs)
    return structure, time.perf_counter() - start


def whole_capture_times(path: str) -> tuple[float, float, int]:
    """(wall s, CPU s of this process, layers): building, capturing and analysing every layer on meta."""
    wall, cpu = time.perf_counter(), time.process_time()
    model_file = load_model_file(ROOT / path)
    model = model_file.build("meta")
    args, kwargs = model_file.inputs(batch_size=1, seq_len=128)
    structure = analyse(capture(model, args, kwargs))
    return time.perf_counter() - wall, time.process_time() - cpu, len(structure.layers)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--whole", action="store_true", help="capture every layer, not a 2-layer slice")
    opts = parser.parse_args()
    failed = 0
    cache: dict[str, tuple] = {}
    for name, path, cluster_name, workload, target in CASES:
        if path not in cache:
            cache[path] = trace(path, opts.whole)
        structure, trace_s = cache[path]
        start = time.perf_counter()
        plan = plan_model(
            structure, load_cluster(cluster_name), workload, Constraints(), model_name=Path(path).stem
        )
        plan_s = time.perf_counter() - start
        total = trace_s + plan_s
        ok = total < target
        failed += not ok
        p = plan.predicted
        print(
            f"{name:34s} trace {trace_s:6.2f} s  plan {plan_s:6.2f} s (ILP {plan.solver.time_s:5.2f} s, "
            f"{len(plan.mesh_candidates)} meshes)  total {total:6.2f} s  target {target:4.0f} s  "
            f"{'ok' if ok else 'SLOW'} | tp={plan.tp} pp={plan.pp} dp={plan.dp} m={plan.micro_batches} "
            f"step {p.latency_s * 1e3:.1f} ms, {p.throughput_tokens_per_s:,.0f} tok/s, "
            f"peak {p.peak_memory_bytes / 2**30:.1f} GiB, {plan.solver.status}"
        )
    path, target = WHOLE_CAPTURE
    wall_s, cpu_s, layers = whole_capture_times(path)
    ok = cpu_s < target
    failed += not ok
    print(
        f"{Path(path).stem + ' capture + analyse, meta':34s} all {layers} layers: wall {wall_s:6.2f} s, "
        f"CPU {cpu_s:6.2f} s  target {target:4.0f} s CPU  {'ok' if ok else 'SLOW'} "
        "(CPU time: other processes sharing the machine do not count)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
