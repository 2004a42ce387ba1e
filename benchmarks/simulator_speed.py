"""How fast the simulator is: ops simulated per second, and how its cost grows with ops.

The tuner calls the simulator thousands of times; the target is at most 20 ms for 8 devices x 64
microbatches x 2 stages per device (ZB-V: 16 stages, 3,072 ops). Prints, for growing sizes, the
median time of `simulate` (full result: per-op times, transfers, memory) and of the tuner's fast
path `iteration_time`, and ops per second.

    python benchmarks/simulator_speed.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profiles import load_profile  # noqa: E402

from octopipe import ClusterSpec, schedules  # noqa: E402
from octopipe.simulator import iteration_time, simulate  # noqa: E402


def median_ms(function, repeats: int = 15) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main() -> None:
    costs = load_profile("nemotron-nano-v2-9B")
    print(f"{'devices':>7} {'microbatches':>12} {'stages':>6} {'ops':>6} {'simulate ms':>12} {'fast ms':>8} "
          f"{'ops/s (simulate)':>17} {'us/op':>6}")
    for devices, microbatches in ((4, 16), (8, 32), (8, 64), (8, 128), (16, 128)):
        cluster = ClusterSpec.preset("h100x16", num_devices=devices)
        plan = schedules.build("zb-v", costs, cluster, microbatches)
        ops = plan.num_ops()

        def fresh_simulate(plan=plan, cluster=cluster):
            # a new plan object each time: nothing cached from an earlier call
            return simulate(plan.with_ops(plan.device_ops), costs, cluster)

        def fresh_fast(plan=plan, cluster=cluster):
            return iteration_time(plan.with_ops(plan.device_ops), costs, cluster)

        full = median_ms(fresh_simulate)
        fast = median_ms(fresh_fast)
        print(f"{devices:>7} {microbatches:>12} {plan.num_stages:>6} {ops:>6} {full:>12.2f} {fast:>8.2f} "
              f"{ops / full * 1e3:>17,.0f} {full / ops * 1e3:>6.2f}")


if __name__ == "__main__":
    main()
