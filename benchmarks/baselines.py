"""Every baseline schedule on the four profiled models, side by side, simulated in one run.

For gpt-13B, deepseek-16B, gpt-oss-20B and nemotron-nano-v2-9B (benchmarks/profiles.py), on 4 and
8 devices of an H100 node (`ClusterSpec.preset("h100x8")`, NVLink between devices) with 2x and 4x
as many microbatches as devices, prints each baseline's (family x partition) simulated iteration
time, bubble ratio and peak memory, then the best baseline per case. Usage:

    python benchmarks/baselines.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.profiles import MODELS, load_profile  # noqa: E402
from octopipe.cluster import ClusterSpec  # noqa: E402
from octopipe.schedules import NAMES, PARTITIONS, baselines  # noqa: E402
from octopipe.simulator import SimResult, simulate  # noqa: E402

DEVICE_COUNTS = (4, 8)
MICROBATCH_FACTORS = (2, 4)


def cases() -> list[tuple[int, int]]:
    return [(p, factor * p) for p in DEVICE_COUNTS for factor in MICROBATCH_FACTORS]


def run_model(model: str) -> dict[tuple[int, int], dict[str, SimResult]]:
    costs = load_profile(model)
    results: dict[tuple[int, int], dict[str, SimResult]] = {}
    for p, m in cases():
        cluster = ClusterSpec.preset("h100x8", num_devices=p)
        results[(p, m)] = {key: simulate(plan, costs, cluster) for key, plan in baselines(costs, cluster, m).items()}
    return results


def format_model(model: str, results: dict[tuple[int, int], dict[str, SimResult]]) -> list[str]:
    cell = 28
    header = f"{'baseline':<26}" + "".join(f"{f'p={p} m={m}':>{cell}}" for p, m in results)
    lines = [f"== {model}: iteration ms, bubble ratio, peak activation GiB (busiest device)", header, "-" * len(header)]
    for key in (f"{name}/{partition}" for name in NAMES for partition in PARTITIONS):
        cells = []
        for case in results:
            result = results[case].get(key)
            if result is None:
                cells.append(f"{'undefined':>{cell}}")
            else:
                peak = max(result.peak_memory_bytes) / 2**30
                cells.append(f"{result.iteration_ms:>10.1f} {result.bubble_ratio:>6.1%} {peak:>6.1f} GiB".rjust(cell))
        lines.append(f"{key:<26}" + "".join(cells))
    best = [min(by_key, key=lambda k: by_key[k].iteration_ms) for by_key in results.values()]
    lines.append(f"{'best':<26}" + "".join(key.rjust(cell) for key in best))
    return lines


def main() -> None:
    start = time.perf_counter()
    summary = []
    for model in MODELS:
        results = run_model(model)
        print("\n".join(format_model(model, results)) + "\n")
        for (p, m), by_key in results.items():
            key = min(by_key, key=lambda k: by_key[k].iteration_ms)
            one_f_one_b = by_key["1f1b/uniform"].iteration_ms
            summary.append((model, p, m, key, by_key[key], one_f_one_b))
    print("== best baseline per case (speed-up over Megatron's default, 1f1b/uniform)")
    print(f"{'model':<22}{'p':>3}{'m':>4}  {'best baseline':<26}{'iteration ms':>13}{'bubble':>8}{'vs 1f1b':>9}")
    for model, p, m, key, result, reference in summary:
        print(f"{model:<22}{p:>3}{m:>4}  {key:<26}{result.iteration_ms:>13.1f}{result.bubble_ratio:>8.1%}"
              f"{reference / result.iteration_ms:>8.2f}x")
    print(f"\n{len(cases()) * len(MODELS)} cases x {len(NAMES) * len(PARTITIONS)} baselines, "
          f"built and simulated in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
