"""Benchmark: wall time of one ``simulate`` call, median over repeats.

Scenarios from issue 3: GPT-3 175B on 1,024 A100s (tp 8, pp 8, dp 16, global batch 1536, micro-batch 1),
Llama 3 405B on 16,384 H100s (tp 8, pp 16, dp 128, global batch 2048), and the flatness of wall time as
dp grows from 16 to 1,024 at fixed work per replica; and a free-knob search (micro-batch, vp, recompute and
grad_overlap left empty), with how many candidates the engine actually ran; and a planner-style sweep: every
(tp, pp) layout of Llama 3 70B on 256 H100s with the other knobs free, i.e. what an auto-planner pays per
layout. Run:

    python analysis/benchmarks/bench_simulate.py [--repeats 15]

Each measurement calls the public API in-process; the first (cold) call, which builds caches, is reported
separately from the warm median.
"""

from __future__ import annotations

import argparse
import platform
import time

from _timing import timed  # this folder's, found beside the script

from simulator import run
from simulator.parallel.schedule import generate, in_flight
from simulator.run import simulate
from simulator.specs import PlanSpec, load_cluster, load_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print(f"python {platform.python_version()} on {platform.machine()} ({platform.processor() or 'cpu'})")
    gpt3 = load_model("gpt3-175b")
    a100 = load_cluster("dgx-a100-80g")
    plan = PlanSpec(
        tp=8,
        pp=8,
        dp=16,
        global_batch=1536,
        micro_batch=1,
        recompute="selective",
        sequence_parallel=True,
        grad_overlap=True,
        vp=1,
    )
    cold, warm, _ = timed(lambda: simulate(gpt3, a100, plan), args.repeats)
    r = simulate(gpt3, a100, plan)
    print(
        f"gpt3-175b 1024xA100 tp8 pp8 dp16 gb1536 mb1: median {warm * 1e3:.1f} ms (cold {cold * 1e3:.1f} ms), "
        f"step {r.step_time_s:.2f} s  [target <= 50 ms]"
    )

    # A sweep's calls differ: a new global batch per call (what a tokens-per-step or batch-size sweep does). The
    # chunk programs depend on none of it (simulator.parallel.program.program_key) and are shared.
    batches = iter(range(1536, 1536 + 16 * 10_000, 16))
    _, distinct, _ = timed(lambda: simulate(gpt3, a100, plan.with_(global_batch=next(batches))), args.repeats)
    print(f"gpt3-175b same layout, a new global batch each call: median {distinct * 1e3:.1f} ms")

    llama = load_model("llama3-405b")
    h100 = load_cluster("dgx-h100")
    plan = PlanSpec(
        tp=8,
        pp=16,
        dp=128,
        global_batch=2048,
        micro_batch=1,
        recompute="full",
        sequence_parallel=True,
        grad_overlap=True,
        vp=1,
        zero_stage=1,
    )
    cold, warm, _ = timed(lambda: simulate(llama, h100, plan), args.repeats)
    r = simulate(llama, h100, plan)
    print(
        f"llama3-405b 16384xH100 tp8 pp16 dp128 gb2048: median {warm * 1e3:.1f} ms (cold {cold * 1e3:.1f} ms), "
        f"step {r.step_time_s:.2f} s  [target <= 200 ms]"
    )

    times = []
    for dp in (16, 64, 256, 1024):
        plan = PlanSpec(
            tp=8,
            pp=8,
            dp=dp,
            global_batch=96 * dp,
            micro_batch=1,
            recompute="selective",
            sequence_parallel=True,
            grad_overlap=True,
            vp=1,
        )
        _, warm, _ = timed(lambda plan=plan: simulate(gpt3, a100, plan), args.repeats)
        times.append(warm)
        print(f"  gpt3-175b dp={dp:<5} ({64 * dp} GPUs, 96 micro-batches per replica): median {warm * 1e3:.1f} ms")
    spread = max(times) / min(times) - 1
    print(f"wall time spread across dp 16..1024: {spread * 100:.1f}%  [target within 20%]")

    # Free knobs: every candidate's memory and durations are computed, the engine runs only those whose lower
    # bound can still beat the fastest found (simulator.run.simulate).
    free = PlanSpec(tp=8, pp=8, dp=16, global_batch=1536, sequence_parallel=True)
    candidates = len(run._candidates(gpt3, free.with_(seq_len=gpt3.seq_len)))
    runs = []
    finish = run._finish

    def counting(*a):  # type: ignore[no-untyped-def]
        runs.append(1)
        return finish(*a)

    run._finish = counting  # type: ignore[assignment]
    r = simulate(gpt3, a100, free)
    engine_runs = len(runs)
    run._finish = finish  # type: ignore[assignment]
    cold, warm, _ = timed(lambda: simulate(gpt3, a100, free), max(3, args.repeats // 5))
    print(
        f"gpt3-175b 1024xA100 free micro_batch/vp/recompute/grad_overlap: median {warm * 1e3:.0f} ms "
        f"({candidates} candidates, engine ran {engine_runs}); chose {r.chosen}"
    )

    # A planner's sweep: every (tp, pp) split of 256 GPUs, micro-batch, vp, recompute and grad_overlap free.
    llama70 = load_model("llama3-70b")
    layouts = [
        PlanSpec(tp=tp, pp=pp, dp=256 // (tp * pp), global_batch=512) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8, 16)
    ]

    def sweep() -> list[float | None]:
        return [r.step_time_s if r.feasible else None for r in (simulate(llama70, h100, p) for p in layouts)]

    # The first pass is what a planner pays for layouts it has not seen (no program is cached yet); repeats of the
    # same sweep reuse the cached programs of the last 256 chunk programs only (simulator.parallel.program).
    t0 = time.perf_counter()
    answers = sweep()
    first = time.perf_counter() - t0
    fitting = [t for t in answers if t is not None]
    _, warm, _ = timed(sweep, max(3, args.repeats // 5))
    print(
        f"llama3-70b 256xH100 sweep of {len(layouts)} (tp, pp) layouts, other knobs free: first pass {first:.2f} s "
        f"({first / len(layouts) * 1e3:.0f} ms per layout), repeated median {warm:.2f} s; {len(fitting)} fit, "
        f"fastest {min(fitting):.2f} s"
    )

    # The same sweep as a planner that only ranks what fits would run it: plans that do not fit are answered from
    # the memory model alone (simulate(..., time_oom=False)).
    def sweep_fitting_only() -> list[float | None]:
        results = (simulate(llama70, h100, p, time_oom=False) for p in layouts)
        return [r.step_time_s if r.feasible else None for r in results]

    assert sweep_fitting_only() == answers
    _, lean, _ = timed(sweep_fitting_only, max(3, args.repeats // 5))
    print(f"  the same sweep with time_oom=False (same answers for what fits): repeated median {lean:.2f} s")

    # Sizing a deep interleaved schedule: the live micro-batch mixes of every stage (what the memory peak is taken
    # over) for pp 2 x vp 1,250, i.e. a 2,500-layer model with one layer per chunk (uncached).
    def deep() -> None:
        for order in generate("interleaved", 2, 16, 1250):
            in_flight(order, 1250)

    _, warm, _ = timed(deep, 3)
    print(f"interleaved sizing pp 2 x vp 1250, 16 micro-batches: median {warm:.2f} s  [was 9 s per stage]")

    # A what-if on depth: a 1,000-layer model with every knob but pp free, so that the search sizes every vp that
    # splits the layers (up to 500 chunks per stage). Weighing each schedule's in-flight mixes in Python had been
    # quadratic in vp (1.7 s per call, 37 s at 2,000 layers; 2026-11-25).
    deep_model = load_model("megatron-gpt-1.7b").with_(layers=1000, seq_len=128)
    deep_plan = PlanSpec(pp=2, dp=1, global_batch=64)
    _, warm, _ = timed(lambda: simulate(deep_model, load_cluster("dgx-h100"), deep_plan, raise_infeasible=False), 3)
    print(f"1,000-layer model, pp 2, free micro_batch/vp/recompute: median {warm:.2f} s  [was 1.7 s]")


if __name__ == "__main__":
    main()
