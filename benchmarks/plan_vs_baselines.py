"""OctoPipe's planner against every baseline schedule, on the profiled and the analytic cost tables.

For each cost table (the four GPU-profiled ones of benchmarks/profiles.py, then the reference
models' analytic costs from `octopipe.passes.costs.analytic_costs` where that pass exists), on 4, 8
and 16 devices of H100 nodes (`ClusterSpec.preset("h100x16", num_devices=p)`: NVLink inside a node
of 8, InfiniBand between the two nodes) with 2x and 4x as many microbatches as devices, it runs
`octopipe.plan(..., activation_limit="1f1b")` (no device may hold more activations than the
busiest device of the 1F1B baselines) and prints, per case:

  best baseline      the fastest baseline whatever its memory (family/partition) and its time
  fits               the fastest baseline within the activation limit
  ours               the planner's plan (always within the limit), iteration ms
  speedup            best baseline / ours (and over the best that fits)
  bound, ratio       the balance bound (microbatches x the smallest possible busiest-device load
                     with whole layers per device, solved exactly) and ours / bound
  lower, gap         the proven lower bound on any plan's iteration time and ours / lower - 1
  max               best baseline / lower bound: the largest speedup any plan could show
  order             ours / the order bound of our plan's structure (its partition, placement and
                    recomputation): no op order of that structure within the limits is faster than
                    the bound, so this is the most a better order alone could gain
  plan s             planning seconds (with "*" where the time limit cut the search short)

then the geometric-mean speedups against the issue's targets, and a table of planning time as
devices and microbatches grow. Usage:

    python benchmarks/plan_vs_baselines.py [--time-limit 60] [--models deepseek-16B,gpt-13B]
        [--devices 4,8,16] [--factors 2,4] [--no-analytic] [--analytic-models gemma,llama] [--no-growth]
        [--activation-limit 1f1b|none] [--no-recompute]

(`--no-recompute`: plans never recompute activations; by default the planner may, fully or, on
the analytic tables, which say what it keeps, selectively, and the summary says in how many
cases its plan does.)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.profiles import MODELS, load_profile  # noqa: E402
from octopipe.api import plan  # noqa: E402
from octopipe.cluster import ClusterSpec  # noqa: E402
from octopipe.errors import OctopipeError  # noqa: E402
from octopipe.ir.costs import CostTable  # noqa: E402

HOMOGENEOUS = {"gpt-13B"}
"""Tables whose layers all cost the same (but the first and last): the target there is never
to lose to the best baseline."""


@dataclass
class Case:
    table: str
    devices: int
    microbatches: int
    best_name: str = ""
    best_ms: float = math.nan
    fit_name: str = ""
    fit_ms: float = math.nan
    ours_ms: float = math.nan
    bound_ms: float = math.nan
    bound_exact: bool = False
    lower_ms: float = math.nan
    order_bound_ms: float = math.nan
    """No op order of our plan's structure within the limits beats this."""
    seconds: float = math.nan
    cut_short: bool = False
    stages: int = 0
    recomputed: int = 0
    """Stages of our plan that recompute their activations."""
    selective: int = 0
    """Stages of our plan that recompute selectively (only where the table says what that keeps)."""
    error: str = ""

    @property
    def speedup(self) -> float:
        return self.best_ms / self.ours_ms

    @property
    def speedup_fit(self) -> float:
        return self.fit_ms / self.ours_ms

    @property
    def ratio(self) -> float:
        return self.ours_ms / self.bound_ms

    @property
    def gap(self) -> float:
        return self.ours_ms / self.lower_ms - 1

    @property
    def max_speedup(self) -> float:
        return self.best_ms / self.lower_ms

    @property
    def order_ratio(self) -> float:
        return self.ours_ms / self.order_bound_ms


def analytic_tables(cluster: ClusterSpec, families: Sequence[str] | None = None, *,
                    accumulation: bool = False) -> dict[str, CostTable]:
    """The reference models' paper configs (all, or `families`), traced on the meta device and
    priced analytically (one sequence of the config's maximum length per microbatch); empty if the
    pass is missing. `accumulation`: keep what gradient accumulation costs, so that `plan` charges
    each step's (M-1)/M of it; off, the tables leave it out, as the published profiles (and the
    baselines' papers) do, so the analytic rows are priced like the profiled ones."""
    try:
        from octopipe import models
        from octopipe.passes.costs import analytic_costs, paper_graph
    except ImportError:
        return {}
    tables = {}
    for family in families if families is not None else models.MODEL_NAMES:
        try:
            config = models.config(family, "paper")
            graph = paper_graph(family)
            costs = analytic_costs(graph, cluster, batch_size=1, seq_len=getattr(config, "max_seq_len", None))
            if not accumulation:
                costs = replace(costs.replace_layers(replace(layer, accumulate_ms=None, accumulate_weight_ms=None)
                                                     for layer in costs), num_microbatches=None)
            tables[f"{family} (analytic)"] = costs
        except Exception as exc:  # noqa: BLE001 - a model the front end cannot take yet is reported, not fatal
            print(f"note: skipping analytic costs of {family}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return tables


def run_case(name: str, costs: CostTable, devices: int, microbatches: int, time_limit_s: float,
             activation_limit: str | None = "1f1b", recompute: bool = True, effort: float = 1.0) -> Case:
    case = Case(name, devices, microbatches)
    cluster = ClusterSpec.preset("h100x16", num_devices=devices)
    if devices > len(costs):
        case.error = f"{len(costs)} layers < {devices} devices"
        return case
    try:
        result = plan(costs, cluster, microbatches, time_limit_s=time_limit_s, activation_limit=activation_limit,
                      quiet=True, recompute=recompute, effort=effort)
    except OctopipeError as exc:
        case.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
        return case
    report = result.report
    best, fit = report.best_baseline, report.best_fitting_baseline
    case.best_name, case.best_ms = best.name, best.iteration_ms
    if fit is not None:
        case.fit_name, case.fit_ms = fit.name, fit.iteration_ms
    case.ours_ms = report.iteration_ms
    case.bound_ms, case.bound_exact = report.balance_bound_ms, report.balance_bound_optimal
    case.lower_ms = report.lower_bound_ms
    case.order_bound_ms = report.order_bound_ms if report.order_bound_ms is not None else math.nan
    case.seconds, case.cut_short = report.planning_seconds, report.cut_short
    case.stages = result.plan.num_stages
    case.recomputed = sum(result.plan.recompute)
    case.selective = sum(result.plan.selective)
    return case


HEADER = (f"{'table':<24}{'p':>3}{'m':>4}  {'best baseline':<26}{'ms':>9}  {'best that fits':<26}{'ms':>9}"
          f"{'ours ms':>10}{'stg':>4}{'speedup':>9}{'vs fit':>8}{'bound':>9}{'ratio':>7}{'lower':>9}{'gap':>7}"
          f"{'max':>7}{'order':>7}{'plan s':>8}")


def format_case(case: Case) -> str:
    head = f"{case.table:<24}{case.devices:>3}{case.microbatches:>4}  "
    if case.error:
        return head + f"-- {case.error}"
    return (
        head + f"{case.best_name:<26}{case.best_ms:>9.1f}  {case.fit_name or '(none)':<26}{case.fit_ms:>9.1f}"
        f"{case.ours_ms:>10.1f}{case.stages:>4}{case.speedup:>8.3f}x{case.speedup_fit:>7.3f}x"
        f"{case.bound_ms:>8.1f}{'' if case.bound_exact else '?'}{case.ratio:>7.3f}{case.lower_ms:>9.1f}"
        f"{case.gap:>6.1%}{case.max_speedup:>6.3f}x{case.order_ratio:>7.3f}{case.seconds:>7.1f}{'*' if case.cut_short else ' '}"
    )


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def summary(cases: list[Case]) -> list[str]:
    done = [c for c in cases if not c.error]
    hetero = [c for c in done if c.table in MODELS and c.table not in HOMOGENEOUS]
    homo = [c for c in done if c.table in HOMOGENEOUS]
    analytic = [c for c in done if c.table not in MODELS]
    lines = ["== targets"]
    if hetero:
        lines.append(
            f"heterogeneous profiled tables: geomean speedup {geomean([c.speedup for c in hetero]):.3f}x over the best "
            f"baseline (any memory; target >= 1.15x), {geomean([c.speedup_fit for c in hetero]):.3f}x over the best that "
            f"fits; the most any plan could show there (best baseline / lower bound) is "
            f"{geomean([c.max_speedup for c in hetero]):.3f}x"
        )
        dense = [c for c in hetero if c.microbatches >= 2 * c.devices]
        within = [c for c in dense if c.ratio <= 1.05]
        worst = max(dense, key=lambda c: c.ratio)
        lines.append(f"within 5% of the balance bound (m >= 2p): {len(within)}/{len(dense)} cases; worst ratio "
                     f"{worst.ratio:.3f} ({worst.table} p={worst.devices} m={worst.microbatches})")
        impossible = [c for c in dense if c.lower_ms > 1.05 * c.bound_ms]
        if impossible:
            lines.append("  impossible there (the proven lower bound is already > 1.05 x the balance bound): "
                         + ", ".join(f"{c.table} p={c.devices} m={c.microbatches} ({c.lower_ms / c.bound_ms:.3f})"
                                     for c in impossible))
        lines.append(f"  ours / lower bound on the same cases: geomean {geomean([c.ours_ms / c.lower_ms for c in dense]):.3f}, "
                     f"worst {max(c.ours_ms / c.lower_ms for c in dense):.3f}")
    if homo:
        worse = [c for c in homo if c.speedup < 1 - 1e-9]
        lines.append(f"homogeneous (gpt-13B): never worse than the best baseline: {'yes' if not worse else 'no'} "
                     f"(min speedup {min(c.speedup for c in homo):.3f}x, vs best that fits {min(c.speedup_fit for c in homo):.3f}x)")
    if analytic:
        lines.append(f"analytic reference models: geomean speedup {geomean([c.speedup for c in analytic]):.3f}x "
                     f"(max possible {geomean([c.max_speedup for c in analytic]):.3f}x)")
    if done:
        small_gap = [c for c in done if c.gap <= 0.05]
        lines.append(f"gap to the lower bound <= 5%: {len(small_gap)}/{len(done)} cases; worst {max(c.gap for c in done):.1%}; "
                     f"mean {sum(c.gap for c in done) / len(done):.1%}")
        bounded = [c for c in done if not math.isnan(c.order_bound_ms)]
        if bounded:
            tight = [c for c in bounded if c.order_ratio <= 1.05]
            worst = max(bounded, key=lambda c: c.order_ratio)
            lines.append(f"  of which the op order: ours within 5% of the order bound of its own structure on "
                         f"{len(tight)}/{len(bounded)} cases (geomean {geomean([c.order_ratio for c in bounded]):.3f}, "
                         f"worst {worst.order_ratio:.3f}: {worst.table} p={worst.devices} m={worst.microbatches}); "
                         f"where that is near 1 the rest of the gap is the structure's or the lower bound's slack")
        again = [c for c in done if c.recomputed]
        lines.append(f"activation recomputation in our plan: {len(again)}/{len(done)} cases"
                     + (": " + ", ".join(f"{c.table} p={c.devices} m={c.microbatches} ({c.recomputed}/{c.stages} stages)"
                                         for c in again) if again else ""))
        cheap = [c for c in done if c.selective]
        lines.append(f"selective recomputation in our plan: {len(cheap)}/{len(done)} cases"
                     + (": " + ", ".join(f"{c.table} p={c.devices} m={c.microbatches} ({c.selective}/{c.stages} stages)"
                                         for c in cheap) if cheap else ""))
        cut = [c for c in done if c.cut_short]
        lines.append(f"planning time: max {max(c.seconds for c in done):.1f}s, {len(cut)} case(s) cut short by the limit")
    return lines


def growth(time_limit_s: float, effort: float = 1.0) -> list[str]:
    """Planning seconds as devices and microbatches grow (deepseek-16B, heterogeneous)."""
    costs = load_profile("deepseek-16B")
    lines = ["== planning time growth (deepseek-16B; seconds, '*' = cut short by the time limit)",
             f"{'devices':>8}" + "".join(f"{f'm={f}p':>10}" for f in (2, 4, 8))]
    for devices in (4, 8, 16):
        cells = []
        for factor in (2, 4, 8):
            case = run_case("deepseek-16B", costs, devices, factor * devices, time_limit_s, effort=effort)
            cells.append(f"{case.seconds:>9.1f}{'*' if case.cut_short else ' '}" if not case.error else f"{'error':>10}")
        lines.append(f"{devices:>8}" + "".join(cells))
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--time-limit", type=float, default=60.0, help="planner time limit per case, seconds")
    parser.add_argument("--models", default=",".join(MODELS), help="profiled tables, comma-separated")
    parser.add_argument("--devices", default="4,8,16")
    parser.add_argument("--factors", default="2,4", help="microbatches per device")
    parser.add_argument("--no-analytic", action="store_true", help="skip the reference models' analytic costs")
    parser.add_argument("--analytic-models", default=None,
                        help="reference models to price analytically, comma-separated (default: all)")
    parser.add_argument("--no-growth", action="store_true", help="skip the planning-time growth table")
    parser.add_argument("--activation-limit", choices=("1f1b", "none"), default="1f1b",
                        help="1f1b: no device holds more activations than the 1F1B baselines' busiest (default); "
                             "none: only the device memory limits plans, ours and the baselines' alike")
    parser.add_argument("--no-recompute", action="store_true", help="plans never recompute activations")
    parser.add_argument("--effort", type=float, default=1.0, help="the planner's work budget (plan's `effort`)")
    args = parser.parse_args(argv)
    device_counts = [int(x) for x in args.devices.split(",")]
    factors = [int(x) for x in args.factors.split(",")]
    started = time.perf_counter()
    tables: dict[str, CostTable] = {name: load_profile(name) for name in args.models.split(",") if name}
    if not args.no_analytic:
        families = args.analytic_models.split(",") if args.analytic_models else None
        tables.update(analytic_tables(ClusterSpec.preset("h100x16"), families))
    limit = ("the 1F1B baselines' busiest device" if args.activation_limit == "1f1b"
             else "none (device memory only)")
    print(f"OctoPipe plan vs baselines: activation limit = {limit}; "
          f"H100 nodes of 8 (NVLink, InfiniBand between nodes); time limit {args.time_limit:.0f}s per case"
          + (f"; effort {args.effort:g}" if args.effort != 1.0 else ""))
    print(HEADER)
    print("-" * len(HEADER))
    cases = []
    for name, costs in tables.items():
        for devices in device_counts:
            for factor in factors:
                case = run_case(name, costs, devices, factor * devices, args.time_limit,
                                None if args.activation_limit == "none" else args.activation_limit,
                                recompute=not args.no_recompute, effort=args.effort)
                cases.append(case)
                print(format_case(case), flush=True)
    print()
    print("\n".join(summary(cases)))
    if not args.no_growth:
        print()
        print("\n".join(growth(args.time_limit, args.effort)))
    print(f"\ntotal {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
