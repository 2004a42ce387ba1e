"""What activation recomputation buys under tighter memory: OctoPipe's plan with and without it.

For each GPU-profiled table (benchmarks/profiles.py), on 4 and 8 devices of H100 nodes with 2x as
many microbatches as devices, the activation limit is a fraction of what the busiest device of
the 1F1B baselines holds (1.0 = the limit of plan_vs_baselines.py; 0.5 and 0.3 = half and under a
third of it: memory that a bigger model, a longer sequence or a smaller GPU leaves). For each, it
runs `octopipe.plan` twice in the same process, `recompute=False` and `recompute=True`, and prints
both iteration times (ms), the speedup that recomputation gives, how many stages recompute, the
best baseline that fits the limit as is ("-" = none fits), the best baseline that fits with every
stage recomputing (what a Megatron user turns on when memory runs out: full recomputation), our
speedup over the better of those two, and the proven lower bound (which ignores memory).
`--analytic-models` adds the reference models' analytic tables (benchmarks/plan_vs_baselines.py),
which say what selective recomputation keeps and costs: there the planner may recompute
selectively too (`stages` counts full + selective), and the best baseline with every stage
recomputing is the faster of full and selective. Usage:

    python benchmarks/recompute.py [--time-limit 10] [--models deepseek-16B,gpt-13B]
        [--devices 4,8] [--fractions 1.0,0.5,0.3] [--analytic-models llama,deepseek]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.profiles import MODELS, load_profile  # noqa: E402
from octopipe import schedules  # noqa: E402
from octopipe.api import _activation_limit, plan  # noqa: E402
from octopipe.cluster import ClusterSpec  # noqa: E402
from octopipe.errors import OctopipeError  # noqa: E402
from octopipe.ir.costs import CostTable  # noqa: E402
from octopipe.simulator import simulate  # noqa: E402

HEADER = (f"{'table':<22}{'p':>3}{'m':>4}{'limit':>7}  {'no recompute':>13}{'recompute':>11}{'gain':>8}"
          f"{'stages':>11}  {'best baseline that fits':<26}{'ms':>9}  {'... with full recompute':<26}{'ms':>9}"
          f"{'ours vs':>9}{'lower':>9}")


def best_recomputing_baseline(baselines, costs, cluster: ClusterSpec, limit: float) -> tuple[str, float]:
    """The fastest of `baselines`, every stage recomputing (fully, or selectively where the costs
    say what that keeps: ", sel" after the name), within the activation limit (or "-", inf)."""
    best = ("-", math.inf)
    for name, baseline in baselines.items():
        n = baseline.num_stages
        variants = [(name, baseline.with_recompute([True] * n))]
        if costs.has_selective_info:
            variants.append((f"{name}, sel", baseline.with_recompute([False] * n, [True] * n)))
        for label, again in variants:
            result = simulate(again, costs, cluster)
            if max(result.peak_activation_bytes) <= limit * (1 + 1e-9) and result.iteration_ms < best[1]:
                best = (label, result.iteration_ms)
    return best


def run(name: str, devices: int, fraction: float, time_limit_s: float, costs: CostTable | None = None) -> str:
    costs = load_profile(name) if costs is None else costs
    cluster = ClusterSpec.preset("h100x16", num_devices=devices)
    microbatches = 2 * devices
    baselines = schedules.baselines(costs, cluster, microbatches)
    # what plan(activation_limit="1f1b") takes: the busiest device of the 1F1B baselines
    limit = fraction * _activation_limit("1f1b", {name: simulate(p, costs, cluster) for name, p in baselines.items()})
    head = f"{name:<22}{devices:>3}{microbatches:>4}{fraction:>7.2f}  "
    results = {}
    for flag in (False, True):
        try:
            results[flag] = plan(costs, cluster, microbatches, time_limit_s=time_limit_s, activation_limit=limit,
                                 quiet=True, recompute=flag)
        except OctopipeError as exc:
            results[flag] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:60]}"
    if isinstance(results[True], str):
        return head + f"-- {results[True]}"
    again = results[True]
    without = results[False].report.iteration_ms if not isinstance(results[False], str) else math.inf
    fit = again.report.best_fitting_baseline
    fit_ms = fit.iteration_ms if fit else math.inf
    full_name, full_ms = best_recomputing_baseline(baselines, costs, cluster, limit)
    ours = again.report.iteration_ms
    cut = "*" if again.report.cut_short or (not isinstance(results[False], str) and results[False].report.cut_short) else " "
    return (head + f"{without:>13.1f}{ours:>11.1f}{without / ours:>7.3f}x"
            f"{sum(again.plan.recompute):>3}+{sum(again.plan.selective):<2}/{again.plan.num_stages:<4} "
            f"{fit.name if fit else '-':<26}{fit_ms:>9.1f}  "
            f"{full_name:<26}{full_ms:>9.1f}{min(fit_ms, full_ms) / ours:>8.3f}x{again.report.lower_bound_ms:>9.1f}{cut}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--time-limit", type=float, default=10.0, help="planner time limit per plan, seconds")
    parser.add_argument("--models", default=",".join(MODELS), help="profiled tables, comma-separated")
    parser.add_argument("--devices", default="4,8")
    parser.add_argument("--fractions", default="1.0,0.5,0.3", help="activation limit as a fraction of 1F1B's")
    parser.add_argument("--analytic-models", default="",
                        help="reference models priced analytically, comma-separated (default: none)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    print("OctoPipe with and without activation recomputation; activation limit = fraction x the 1F1B baselines' "
          f"busiest device; time limit {args.time_limit:.0f}s per plan ('*' = a search was cut short)")
    print(HEADER)
    print("-" * len(HEADER))
    tables: dict[str, CostTable | None] = {name: None for name in args.models.split(",") if name}
    if args.analytic_models:
        from benchmarks.plan_vs_baselines import analytic_tables

        tables.update(analytic_tables(ClusterSpec.preset("h100x16"), args.analytic_models.split(",")))
    for name, costs in tables.items():
        for devices in (int(d) for d in args.devices.split(",")):
            for fraction in (float(f) for f in args.fractions.split(",")):
                print(run(name, devices, fraction, args.time_limit, costs), flush=True)
    print(f"\ntotal {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
