"""How many data-parallel replicas: OctoPipe's joint choice against fixed ones, on the reference models.

For each reference model's paper config (analytic costs, one sequence of its maximum length per
microbatch, as benchmarks/plan_vs_baselines.py prices them) on 16 H100s (two nodes of 8) and a
batch of 64 microbatches, `octopipe.plan_data_parallel` plans one replica for every replica count
D in 1, 2, 4, 8, 16 (D replicas of 16 / D devices, 64 / D microbatches each; each device's
gradient all-reduce over its D copies priced bucket by bucket beside the backward, and each
replica's gradient accumulation over its own 64 / D microbatches) and keeps the
fastest step of the whole batch. Printed per model and count: the best baseline schedule for that
replica (Megatron's choices: 1F1B, interleaved, ZB, DualPipe-V, ... with uniform or balanced
partitions, within device memory), OctoPipe's plan, the all-reduce time of its busiest device, or
why no plan fits; then OctoPipe's chosen count against the two fixed choices a Megatron user
would make without a planner: all pipeline (D = 1), and the best baseline at whichever count
suits it best (a user who tries every count with every schedule; `*` marks OctoPipe's count).
`--shard-optimizer`: every job shards mixed-precision Adam's state over its replicas (ZeRO-1,
Megatron's distributed optimizer, `compile(shard_optimizer=True)`), baselines included: each
count's devices hold 1/D of the optimizer's own state, the gradients are reduce-scattered onto
their shares (half an all-reduce) and each device's updated share goes to its copies after the
step (priced as an all-gather; both in the all-reduce column). `--price-optimizer-step`: every
job also pays each device's optimizer step (mixed-adam's 28 bytes of traffic a weight, 1/D of
it sharded, at the H100's memory bandwidth), which the default leaves out.
`--overlap-param-gather` (with `--shard-optimizer`): every job's shares' broadcast runs beside
the next step, each stage's first forward waiting for its own (Megatron's
`--overlap-param-gather`, `compile(overlap_param_gather=True)`), baselines included.
`--fp32-grads`: every job's gradients are fp32 (Megatron's default under `--bf16`,
`compile(master_weights=True, fp32_grads=True)`), baselines included: 18 bytes a weight instead
of 16, twice the bytes in every gradient reduction, 30 bytes of step traffic instead of 28.
Usage:

    python benchmarks/data_parallel.py [--time-limit 20] [--models deepseek,gemma] [--microbatches 64]
                                       [--shard-optimizer [--overlap-param-gather]] [--price-optimizer-step]
                                       [--fp32-grads]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.plan_vs_baselines import analytic_tables  # noqa: E402
from octopipe.api import plan_data_parallel  # noqa: E402
from octopipe.cluster import ClusterSpec  # noqa: E402
from octopipe.simulator import MemoryModel  # noqa: E402

COUNTS = (1, 2, 4, 8, 16)


def run(name: str, costs, cluster: ClusterSpec, microbatches: int, time_limit_s: float,
        shard_optimizer: bool = False, price_step: bool = False, overlap: bool = False,
        fp32_grads: bool = False) -> list[str]:
    started = time.perf_counter()

    def memory(count: int) -> MemoryModel:  # each count's jobs: mixed-adam, its state over the count if sharded
        return MemoryModel.for_optimizer("mixed-adam", count if shard_optimizer else 1, price_step=price_step,
                                         overlap_param_gather=overlap and shard_optimizer and count > 1,
                                         fp32_grads=fp32_grads)

    result = plan_data_parallel(costs, cluster, microbatches, counts=COUNTS, time_limit_s=time_limit_s, quiet=True,
                                memory=memory)
    seconds = time.perf_counter() - started
    lines = []
    fitting_baselines = []
    for row in result.tried:
        head = f"{name:<24}{row.data_parallel:>4} x {row.num_devices:<4}{row.num_microbatches:>5}"
        if row.result is None:
            lines.append(f"{head}  no plan: {row.error[:90]}")
            continue
        report = row.result.report
        baseline = report.best_fitting_baseline
        base_ms = baseline.iteration_ms if baseline is not None else math.inf
        fitting_baselines.append((row.data_parallel, base_ms, baseline.name if baseline is not None else "-"))
        mark = "*" if row.data_parallel == result.data_parallel else " "
        speedup = f"{base_ms / row.step_ms:.3f}x" if baseline is not None else "-"
        lines.append(f"{head}  {baseline.name if baseline is not None else '(none fits)':<28}"
                     f"{base_ms if baseline is not None else math.nan:>9.1f}{row.step_ms:>9.1f}{mark}"
                     f"{row.result.simulation.data_parallel_ms:>10.1f}{speedup:>9}")
    best = result.best.report.iteration_ms
    pipeline = next((ms for d, ms, _ in fitting_baselines if d == 1), math.inf)
    tried = min(fitting_baselines, key=lambda item: item[1], default=(0, math.inf, "-"))
    lines.append(f"{name:<24}chosen {result.data_parallel} x {result.best.plan.num_devices}: {best:.1f} ms; "
                 f"{pipeline / best:.3f}x over the best baseline as one pipeline (D=1), {tried[1] / best:.3f}x over "
                 f"the best baseline at its best count (D={tried[0]}, {tried[2]}); planned in {seconds:.0f}s")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=20.0, help="planning seconds per model, all counts together")
    parser.add_argument("--models", default=None, help="reference models, comma-separated (default: all)")
    parser.add_argument("--microbatches", type=int, default=64, help="microbatches of the whole batch")
    parser.add_argument("--shard-optimizer", action="store_true",
                        help="every job shards the optimizer's state over its replicas (ZeRO-1)")
    parser.add_argument("--price-optimizer-step", action="store_true",
                        help="price every device's optimizer step (its state's traffic at H100 memory bandwidth)")
    parser.add_argument("--overlap-param-gather", action="store_true",
                        help="with --shard-optimizer: the shares' broadcast beside the next step's first forwards")
    parser.add_argument("--fp32-grads", action="store_true",
                        help="every job's gradients in fp32 (bf16 weights with fp32 copies): 18 bytes a weight, "
                             "twice the reductions' bytes")
    args = parser.parse_args()
    if args.overlap_param_gather and not args.shard_optimizer:
        parser.error("--overlap-param-gather overlaps a sharded optimizer's broadcast: give --shard-optimizer too")
    cluster = ClusterSpec.preset("h100x16")
    # each replica count pays its own gradient accumulation: M/D microbatches add into .grad
    tables = analytic_tables(cluster, args.models.split(",") if args.models else None, accumulation=True)
    print(f"OctoPipe's replica count vs fixed ones: 16 H100s (nodes of 8), {args.microbatches} microbatches in "
          f"all, {args.time_limit:.0f}s of planning per model; step = one replica's iteration (they run side by "
          "side), all-reduce included" + ("; the optimizer's state sharded over the replicas (ZeRO-1), the "
                                         "gradients' reduce-scatter and the shares' broadcast priced"
                                         + (", the broadcast beside the next step's first forwards"
                                            if args.overlap_param_gather else "") if args.shard_optimizer else "")
          + (f"; each device's optimizer step priced (mixed-adam's {30 if args.fp32_grads else 28} bytes a weight, "
             f"over the shards, at {cluster.memory_bandwidth / 1e12:g} TB/s)" if args.price_optimizer_step else "")
          + ("; fp32 gradients (18 bytes a weight, twice the bytes in every reduction)" if args.fp32_grads else ""))
    print(f"{'model':<24}{'D':>4} x {'dev':<4}{'mb':>5}  {'best baseline (fits memory)':<28}{'ms':>9}"
          f" {'ours ms':>8} {'allred ms':>9}{'speedup':>9}")
    print("-" * 104)
    started = time.perf_counter()
    for name, costs in tables.items():
        for line in run(name, costs, cluster, args.microbatches, args.time_limit, args.shard_optimizer,
                        args.price_optimizer_step, args.overlap_param_gather, args.fp32_grads):
            print(line, flush=True)
    print(f"\ntotal {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
