"""Benchmark: sweeps and the auto-planner, wall time as medians over repeats.

- A sweep of fixed-knob layouts (every knob given, so each case is one engine run): cases per second in this process
  and on local worker processes, and the same sweep with ``time_oom=False``.
- The auto-planner (``simulator.search.planner.autoplan``) on Llama 3 70B / 256 H100 and GPT-3 175B / 1,024 A100:
  every layout of tp, pp, cp and ZeRO stage with micro-batch, interleaving, recomputation and overlap free; how many
  layouts, how many the engine timed, and the time against simulating every layout on its own.

Run:

    python analysis/benchmarks/bench_sweep.py [--repeats 3] [--workers N]

Each repeat starts from the process's warm caches (a sweep after another, as in a notebook); the first, cold pass is
reported apart.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from _timing import timed  # this folder's, found beside the script

from simulator.run import simulate
from simulator.search.planner import autoplan
from simulator.specs import load_cluster, load_model
from simulator.sweep import grid, sweep


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    parser.add_argument("--workers", type=int, default=cpus)
    args = parser.parse_args()
    print(f"python {platform.python_version()} on {platform.machine()}, {cpus} CPUs; workers {args.workers}")

    # A fixed-knob sweep: 2 models x every (tp, pp) x 2 micro-batches x 2 ZeRO stages on 256 H100s.
    h100 = load_cluster("dgx-h100")
    cases = [
        *grid(
            [load_model("llama3-70b"), load_model("llama3-8b")],
            h100,
            gpus=256,
            tp=[1, 2, 4, 8],
            pp=[1, 2, 4, 8],
            micro_batch=[1, 2],
            zero_stage=[0, 1],
            global_batch=512,
            recompute="full",
            vp=1,
            grad_overlap=True,
        )
    ]
    n = len(cases)
    for workers in sorted({1, args.workers}):
        for time_oom in (True, False):
            cold, warm, frame = timed(lambda w=workers, t=time_oom: sweep(cases, workers=w, time_oom=t), args.repeats)
            ok = int((frame["status"] == "ok").sum())
            print(
                f"sweep of {n} fixed-knob cases, workers {workers}, time_oom {time_oom}: median {warm:.2f} s "
                f"({n / warm:.0f} cases/s; cold {cold:.2f} s); {ok} fit"
            )

    for name, cluster, gpus, batch in (("llama3-70b", "dgx-h100", 256, 512), ("gpt3-175b", "dgx-a100-80g", 1024, 1536)):
        model, hw = load_model(name), load_cluster(cluster)
        for workers in sorted({1, args.workers}):
            cold, warm, found = timed(
                lambda m=model, c=hw, g=gpus, b=batch, w=workers: autoplan(m, c, g, b, top=5, workers=w),
                max(1, args.repeats - 2),
            )
            counts = found.counts()
            best = found.best[0]
            print(
                f"autoplan {name} on {gpus} x {cluster}, workers {workers}: median {warm:.1f} s (cold {cold:.1f} s) "
                f"for {len(found.layouts)} layouts ({counts['ok']} timed, {counts['pruned']} pruned, "
                f"{counts['out_of_memory']} out of memory); best tp {best.plan.tp} pp {best.plan.pp} cp {best.plan.cp} "
                f"zero {best.plan.zero_stage} vp {best.plan.vp} mb {best.plan.micro_batch}: {best.step_time_s:.2f} s"
            )
        t0 = time.perf_counter()
        each = [simulate(model, hw, p, raise_infeasible=False, time_oom=False) for p in found.layouts]
        alone = time.perf_counter() - t0
        fastest = min((r for r in each if r.feasible), key=lambda r: r.step_time_s)
        print(
            f"  simulating each of the {len(found.layouts)} layouts on its own, in this process: {alone:.1f} s; "
            f"same fastest: {fastest == best}"
        )


if __name__ == "__main__":
    main()
