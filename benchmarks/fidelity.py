"""Does the simulator predict real runs? Predicted vs measured step time of several models and
plans on 2 CPU processes (gloo), with costs from `profile` on this machine.

For each model (the CPU configs of benchmarks/cpu_models.py): profile its layers inside the
runtime with both processes busy (`octopipe.bench.profile_in_runtime`), calibrate the link, the
per-op and the per-message host overheads (`calibrate_cpu_cluster`), then for several plans
(1F1B, ZB-H1, ZB-V, interleaved 1F1B and OctoPipe's own) predict the step time with
`octopipe.simulate` and measure it (all plans of a model in one launch, steps interleaved).
Prints each error and the mean and max absolute error (target: mean <= 5%, max <= 10%), and the
relative error: each plan's measured time over the model's 1F1B run divided by the same ratio
predicted, which cancels the drift of this machine's speed between profiling and running.

    python benchmarks/fidelity.py [--models ...] [--steps 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_models import CONFIGS, NUM_MICROBATCHES, build  # noqa: E402

import octopipe  # noqa: E402
from octopipe import models  # noqa: E402
from octopipe.bench import calibrate_cpu_cluster, measure_many, profile_in_runtime  # noqa: E402

SCHEDULES = ("1f1b", "zb-h1", "zb-v", "interleaved-1f1b")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CONFIGS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--time-limit", type=float, default=10.0, help="planner seconds per model")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cluster = calibrate_cpu_cluster(2)
    print(f"2 CPU processes (gloo, 1 thread each); link {cluster.latency_s * 1e6:.0f} us, "
          f"{cluster.intra_node_bandwidth / 1e9:.2f} GB/s measured; {NUM_MICROBATCHES} microbatches")
    print(f"{'model':<11} {'plan':<26} {'predicted ms':>12} {'measured ms':>12} {'error':>8} {'relative':>9}")
    errors = []
    relative_errors = []
    for name in args.models.split(","):
        model, inputs, target = build(name)
        costs = profile_in_runtime(model, inputs, target, models.lm_loss, NUM_MICROBATCHES,
                                   op_overhead_ms=cluster.op_overhead_ms)
        plans = {}
        for schedule in SCHEDULES:
            plans[f"{schedule}/balanced"] = octopipe.schedules.build(schedule, costs, cluster, NUM_MICROBATCHES,
                                                                      partition="balanced")
        plans["octopipe"] = octopipe.plan(costs, cluster, NUM_MICROBATCHES, time_limit_s=args.time_limit,
                                          quiet=True).plan
        pipes = [octopipe.compile(model, cluster, example_inputs=inputs, example_target=target, loss_fn=models.lm_loss,
                                  num_microbatches=NUM_MICROBATCHES, costs=costs, plan=plan) for plan in plans.values()]
        timings = measure_many(pipes, inputs, target, steps=args.steps, warmup=1)
        reference_predicted, reference_measured = pipes[0].simulation.iteration_ms, timings[0].median_ms
        for (label, _), pipe, timing in zip(plans.items(), pipes, timings):
            predicted = pipe.simulation.iteration_ms
            error = timing.median_ms / predicted - 1
            errors.append(abs(error))
            relative = (timing.median_ms / reference_measured) / (predicted / reference_predicted) - 1
            if pipe is not pipes[0]:
                relative_errors.append(abs(relative))
            print(f"{name:<11} {label:<26} {predicted:>12.1f} {timing.median_ms:>12.1f} {error:>+8.1%} {relative:>+9.1%}")
    print(f"\nmean |error| {statistics.mean(errors):.1%}, max |error| {max(errors):.1%} over {len(errors)} runs "
          f"(target: mean <= 5%, max <= 10%)")
    print(f"relative to the same model's {SCHEDULES[0]}/balanced in the same run (machine speed drift cancels): mean |error| "
          f"{statistics.mean(relative_errors):.1%}, max {max(relative_errors):.1%} over {len(relative_errors)} runs")


if __name__ == "__main__":
    main()
