"""The pass pipelines behind the public API: `plan` (cost table -> plan + report) and `compile`
(model -> per-rank stage modules and programs). Each is one readable function; the passes they
run are in `passes/`, the search in `tuner.py` and `solver.py`."""

from __future__ import annotations

import inspect
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from octopipe import schedules
from octopipe.cluster import ClusterSpec
from octopipe.errors import ArgumentError, ClusterSpecError, InfeasibleError, OctopipeError, ParseError, PlanError
from octopipe.ir.costs import CostTable, is_finite_number
from octopipe.ir.files import parse_json, read_text
from octopipe.ir.plan import PipelinePlan
from octopipe.report import PlanReport, PlanRow
from octopipe.simulator import MemoryModel, SimResult, simulate
from octopipe.solver import (
    WHOLE_ORDER_OPS,
    Refinement,
    balance_bound,
    input_gradients,
    refine_order,
    release_bound,
)
from octopipe.tuner import (
    RUNNER_UP_MARGIN,
    Candidate,
    Policy,
    Structure,
    TuneResult,
    list_schedule,
    plan_shape,
    structure_order_bound,
    tune,
)

GiB = 2**30
MAX_BYTES = 2**80
"""Byte limits above this are refused (a float holds them; 10**400 would not)."""


MAX_RUNNERS_UP = 3

SOLVER_WORK = 0.2
"""CP-SAT's deterministic seconds (of one worker) per unit of `effort`, over the tuner's plan."""
WHOLE_ORDER_WORK = 1.0
"""The same where the whole op order is one model and the order bound leaves the tuner's plan
more than ORDER_ROOM above it: on the demo's 72-op plan 0.2 found nothing, 1.0 an order 6.5%
faster (about 6 s here)."""
ORDER_ROOM = 0.02
"""How far above its structure's order bound (`solver.order_bound`) the tuner's plan must be for
the whole-order model to get WHOLE_ORDER_WORK."""


@dataclass
class PlanResult:
    plan: PipelinePlan
    report: PlanReport
    simulation: SimResult
    costs: CostTable | None = None
    """The cost table it was planned on."""
    runners_up: tuple[PipelinePlan, ...] = ()
    """Up to three more plans of other shapes (`octopipe.tuner.plan_shape`: the order the
    pipeline visits the devices, and how many stages recompute) that fit the limits, predicted within RUNNER_UP_MARGIN of `plan`, fastest first: where the simulator's
    error is as large as their difference, measure them beside `plan` and keep the fastest
    (`octopipe.bench.measure_many`, `octopipe train --candidates`)."""

    def __str__(self) -> str:
        return str(self.report)

    def save(self, path: str | Path, *, microbatch_size: int | None = None) -> None:
        """The plan as JSON (.json), with the cost table, cluster and predicted iteration time it
        was planned on, so `load_saved_plan` (and `octopipe simulate`, `show`) need nothing else
        (`microbatch_size`: the samples per microbatch the costs are of, where planned from a
        model); any other suffix: the plan's text form alone."""
        save_plan(self.plan, path, costs=self.costs, cluster=self.simulation.cluster,
                  iteration_ms=self.simulation.iteration_ms, microbatch_size=microbatch_size,
                  memory=self.simulation.memory)


def plan(
    costs: CostTable,
    cluster: ClusterSpec | str,
    num_microbatches: int,
    *,
    num_devices: int | None = None,
    time_limit_s: float = 60.0,
    memory_limit_bytes: float | None = None,
    activation_limit: float | str | None = None,
    memory: MemoryModel = MemoryModel(),
    solver: bool = True,
    seed: int = 0,
    effort: float = 1.0,
    quiet: bool = False,
    progress: Callable[[str], None] | None = None,
    min_gain: float = 0.0,
    recompute: bool = True,
) -> PlanResult:
    """Jointly choose partition, placement and op order for `costs` on `cluster` (a ClusterSpec,
    a preset name such as "h100x8", or a spec file).

    memory_limit_bytes: per device, weights + gradients + optimizer state + activations (default:
    the cluster's device memory); `memory` says how many bytes of the first three each byte of
    weights brings (`MemoryModel.for_optimizer("adamw")`, "sgd", ...; default mixed-precision
    Adam, 8) and what W keeps of the activations. activation_limit: a per-device cap on
    activation memory alone, in bytes, or "1f1b" for the busiest device of the 1F1B baselines
    (OctoPipe then never holds more activations than a 1F1B user does). The search's budget is work, not seconds (`effort`
    scales it), so the plan is a function of the input, `effort` and `seed` alone: every rank of a
    job gets the same one. time_limit_s is a safety net on top: when it runs out first, the best
    valid plan found is returned and the report says the search was cut short (the plan may
    then differ between runs). Progress goes to stderr unless `quiet` (or to `progress`).
    InfeasibleError: limits no plan can meet (a layer's state and activations over the memory
    limit, its activations over the activation limit, more state than the devices hold), raised
    before the search; or limits no contiguous one-stage-per-device split meets and the search
    found no plan for either. Its message says what always works and what to change.

    solver: refine the tuner's op order with CP-SAT (`solver.refine_order`, hinted with it, never
    worse): the whole order as one model where the plan has at most `solver.WHOLE_ORDER_OPS` ops
    (with WHOLE_ORDER_WORK instead of SOLVER_WORK per unit of effort where the order bound leaves
    the tuner's plan over ORDER_ROOM above it), else windows of it.

    min_gain: return the best baseline that fits unless the searched plan is at least this much
    faster on paper (0.02 = 2%). The search's plans can have more stages and ops than any
    baseline, and where the costs are only known to a few percent (CPU runs, a rough profile) a
    gain below their error is a coin toss; the report marks the baseline as chosen and says why.

    recompute: let the search make stages recompute their activations (F keeps only the stage's
    inputs, B runs the forward again), or recompute selectively where the costs
    say what that holds and costs (`LayerCost.selective_activation_bytes`: F keeps the matmul,
    attention and convolution outputs, B recomputes the cheap ops first): tried where memory holds
    microbatches back, kept only where the plan gets faster or fits; the report lists the stages
    that do. Where it is tried the
    search without it runs too (up to twice the planning time), so the plan is never slower than
    with False (unless the time limit cuts the search short). False: never."""
    started = time.perf_counter()
    cluster = ClusterSpec.of(cluster, "plan: cluster")
    p = cluster.num_devices if num_devices is None else num_devices
    _check_inputs(costs, cluster, num_microbatches, p, time_limit_s, effort, memory_limit_bytes, seed)
    if not isinstance(memory, MemoryModel):
        raise ArgumentError(f"plan: memory must be a MemoryModel (octopipe.simulator.MemoryModel, or "
                            f"MemoryModel.for_optimizer(name)), got {type(memory).__name__}")
    memory.check("plan: memory")
    if progress is not None and not callable(progress):
        raise ArgumentError(f"plan: progress must be a function of one string (or None), got {type(progress).__name__}")
    costed_for = costs.num_microbatches
    costs = costs.for_microbatches(num_microbatches)  # gradient accumulation as this step has it
    if not isinstance(recompute, bool):
        raise ArgumentError(f"plan: recompute must be True or False, got {recompute!r}")
    if isinstance(activation_limit, bool):
        raise ArgumentError(f"plan: activation_limit must be bytes, '1f1b' or None, got {activation_limit!r}")
    if not (isinstance(min_gain, (int, float)) and 0.0 <= min_gain < 1.0):
        raise ArgumentError(f"plan: min_gain must be a fraction in [0, 1) (0.02 = 2%), got {min_gain!r}")
    say = progress if progress is not None else (None if quiet else _stderr)
    if activation_limit is not None and not costs.has_memory_info:
        raise ArgumentError(f"plan: activation_limit={activation_limit!r} but the cost table{_named(costs)} has no "
                        "activation_bytes, so no plan could exceed it; fill them (octopipe.profiles.load_profile "
                        "for a published profile, CLI --costs fills them itself; analytic_costs or profile_costs "
                        "for a model) or drop the limit")
    if memory_limit_bytes is not None and not costs.has_memory_info and not any(costs.params):
        raise ArgumentError(f"plan: memory_limit_bytes={memory_limit_bytes!r} but the cost table{_named(costs)} has "
                        "neither activation_bytes nor param_bytes, so no plan could exceed it; fill them or drop "
                        "the limit")
    memory_limit = cluster.memory_bytes if memory_limit_bytes is None else memory_limit_bytes
    stage_seconds: dict[str, float] = {}

    # 1. baselines, simulated on the same table
    clock = time.perf_counter()
    baseline_plans, baseline_sims, unsimulated = _baselines_in_time(costs, cluster, num_microbatches, p, memory,
                                                                    activation_limit, memory_limit,
                                                                    started + time_limit_s)
    stage_seconds["baselines"] = time.perf_counter() - clock
    activation_budget = _activation_limit(activation_limit, baseline_sims)
    fallback_bounds, infeasible = _check_memory_feasible(costs, p, num_microbatches, memory_limit, activation_budget,
                                                         memory)
    start_plans = dict(baseline_plans)
    if not unsimulated:  # (a tiny model's every partition: not where the time limit already cut the baselines)
        start_plans.update(schedules.every_partition(costs, cluster, num_microbatches, baseline_plans, num_devices=p))
    if fallback_bounds is not None:
        start_plans["one microbatch in flight"] = _low_memory_plan(costs, cluster, num_microbatches, fallback_bounds,
                                                                   p, memory)

    # 2. bounds: whole layers per device (exact bin packing), and one microbatch's chain
    clock = time.perf_counter()
    bound = balance_bound(costs, p, time_limit_s=0.2 * time_limit_s)
    # one microbatch's forward, then its input gradients layer by layer (W may run beside them)
    chain_ms = sum(costs.forward) + sum(input_gradients(costs))
    # the release bound only sharpens the report; skip it when the time limit is nearly spent
    released = None
    if time_limit_s - (time.perf_counter() - started) > 2.0:
        released = release_bound(costs, p, num_microbatches, balance=bound)
    lower_bound = max(num_microbatches * bound.lower_ms, chain_ms, released.lower_ms if released else 0.0)
    stage_seconds["bounds"] = time.perf_counter() - clock

    # 3. tuner, started from every baseline
    clock = time.perf_counter()
    remaining = time_limit_s - (time.perf_counter() - started)
    tuner_share = 0.85 if solver else 0.95
    if say:
        say(f"tuning {len(costs)} layers on {p} devices x {num_microbatches} microbatches (limit {time_limit_s:.0f}s)")
    try:
        tuned = tune(costs, cluster, num_microbatches, num_devices=p, time_limit_s=max(0.0, remaining * tuner_share),
                     effort=effort, activation_budget=[activation_budget] * p if activation_budget is not None else None,
                     memory_limit_bytes=memory_limit, memory=memory, seed=seed, start_plans=start_plans,
                     progress=say, recompute=recompute, start_sims=baseline_sims)
    except PlanError as error:
        if fallback_bounds is None:  # no split was known to fit: the limits may be out of reach
            raise InfeasibleError(infeasible) from error
        raise
    stage_seconds["tuner"] = time.perf_counter() - clock
    best_plan, origin = tuned.best.plan, "tuner"
    notes = [f"tuner: {tuned.structures} structures, {tuned.evaluations} plans simulated ({tuned.work} op-steps of "
             f"work; {tuned.ruled_out} moves ruled out unscheduled by the order bound); best from {tuned.best.origin}"]
    cut_short = tuned.cut_short
    if unsimulated:
        notes.append(f"time limit: {len(unsimulated)} baseline{'s' if len(unsimulated) > 1 else ''} not simulated "
                     f"({', '.join(unsimulated)}); the speedups are over the {len(baseline_sims)} that were")
        cut_short = True

    # 4. CP-SAT over the tuner's structure, hinted with its order; where recomputation was tried
    #    and won, over the best plan without it too (what recompute=False refines), so allowing
    #    recomputation never ends slower than forbidding it
    refinement = None
    if solver:
        clock = time.perf_counter()
        starts = [tuned.best] + ([tuned.plain] if tuned.plain is not None and tuned.plain.plan is not tuned.best.plan
                                 else [])
        for index, start in enumerate(starts):
            remaining = time_limit_s - (time.perf_counter() - started)
            if remaining <= 0.5:
                notes.append("solver: skipped, no time left" if index == 0 else
                             "solver: no time left for the best plan without recomputation")
                cut_short = True
                break
            if say:
                say(f"CP-SAT refinement{' of the best plan without recomputation' if index else ''} "
                    f"({remaining:.0f}s left)")
            result = _refine(start, costs, cluster, num_microbatches, remaining, activation_budget, memory_limit,
                             memory, effort, seed, notes)
            cut_short = cut_short or result.cut_short
            mode = "the whole op order" if result.full_model else f"{result.windows} neighbourhoods (time windows of ops)"
            notes.append(f"solver: CP-SAT over {mode}{' of the best plan without recomputation' if index else ''}, "
                         f"{result.improved_windows} improved the plan")
            if refinement is None or result.iteration_ms < refinement.iteration_ms - 1e-9:
                refinement = result
        if refinement is not None and refinement.iteration_ms < tuned.best.iteration_ms - 1e-9:
            best_plan, origin = refinement.plan, "solver"
        stage_seconds["solver"] = time.perf_counter() - clock

    # 5. report
    tuned_sim = simulate(tuned.best.plan, costs, cluster, memory=memory)
    final = searched = tuned_sim if best_plan is tuned.best.plan else simulate(best_plan, costs, cluster, memory=memory)
    rows = [_row(name, "baseline", sim, activation_budget, memory_limit) for name, sim in baseline_sims.items()]
    rows.append(_row("octopipe tuner", "tuner", tuned_sim, activation_budget, memory_limit))
    if refinement is not None:
        rows.append(_row("octopipe solver", "solver", simulate(refinement.plan, costs, cluster, memory=memory), activation_budget, memory_limit))
    chosen = "octopipe solver" if origin == "solver" else "octopipe tuner"
    if not bound.optimal:
        notes.append("balance bound: bin packing not proven optimal in time; the lower bound uses its proven bound")
    sources = {"microbatches x balance bound": num_microbatches * bound.lower_ms, "one microbatch's F+B chain": chain_ms}
    if released is not None:
        sources["release bound (late-starting devices)"] = released.lower_ms
    notes.append(f"lower bound: {max(sources, key=lambda k: sources[k])} (max of {', '.join(sources)})")
    if not costs.has_memory_info:
        notes.append("the cost table has no activation_bytes: activation limits cannot bind"
                     + (", only weights, gradients and optimizer state count against the memory limit"
                        if any(costs.params) else ", and no param_bytes: memory limits cannot bind"))
    if costed_for not in (None, num_microbatches) and costs.accumulates:
        notes.append(f"gradient accumulation re-costed for {num_microbatches} microbatches (the table was costed for "
                     f"{costed_for})")
    if cluster.data_parallel > 1:
        notes.append(f"data parallelism: these devices are one of {cluster.data_parallel} replicas; every plan's time "
                     "includes summing each stage's gradients over its copies once its backward is done (a device's "
                     f"take up to {final.data_parallel_ms:.2f} ms in the chosen plan; the lower bounds leave them out)"
                     + (f"; with the optimizer state sharded over the {cluster.data_parallel} copies "
                        f"(MemoryModel.shards = {memory.shards}), the sums are reduce-scattered onto each share's "
                        "owner (half an all-reduce) and each device's copies then send each other their updated "
                        "shares, priced as an all-gather of its parameters"
                        + (" at the step's start, stage by stage, each stage's forwards after its own "
                           "(overlap_param_gather: the last step's broadcast beside this one's first forwards)"
                           if memory.overlap_param_gather else "") if memory.shards > 1 else "")
                     + ("; the cost table has no param_bytes, so there is nothing to sum"
                        if not any(layer.param_bytes for layer in costs.layers) else ""))
    if any(final.optimizer_step_ms):
        notes.append(f"optimizer step priced: each device's after its last gradient reduction, its weights' "
                     f"{memory.step_bytes_per_param_byte:g} bytes of state traffic per byte at "
                     f"{cluster.memory_bandwidth / 1e12:g} TB/s (up to {max(final.optimizer_step_ms):.2f} ms in the "
                     "chosen plan; the lower bounds leave it out)")
    elif memory.step_bytes_per_param_byte > 0:
        notes.append("optimizer step: asked to price it, but the cost table has no param_bytes, so there is nothing to "
                     "price (give a table with parameter bytes, e.g. analytic costs or one profiled on the model)")
    if cluster.step_overhead_ms:
        notes.append(f"every plan's time includes {cluster.step_overhead_ms:.2f} ms a step of host time outside the ops "
                     "(the cluster's step_overhead_ms, measured on these processes); the lower bounds leave it out")
    again = [stage.index for stage in best_plan.stages if stage.recompute]
    if again:
        notes.append(f"activation recomputation on stage{'s' if len(again) > 1 else ''} {_ranges(again)} of "
                     f"{best_plan.num_stages} (their B runs the forward again; until then they hold only their inputs)")
    cheap = [stage.index for stage in best_plan.stages if stage.selective]
    if cheap:
        notes.append(f"selective recomputation on stage{'s' if len(cheap) > 1 else ''} {_ranges(cheap)} of "
                     f"{best_plan.num_stages} (they keep their matmul and attention outputs; their B "
                     "recomputes the rest first)")
    report = PlanReport(
        rows=rows, chosen=chosen, num_devices=p, num_microbatches=num_microbatches, num_layers=len(costs),
        balance_bound_ms=num_microbatches * bound.load_ms, balance_bound_optimal=bound.optimal,
        lower_bound_ms=lower_bound, activation_limit_bytes=activation_budget, memory_limit_bytes=memory_limit,
        planning_seconds=time.perf_counter() - started, stage_seconds=stage_seconds, cut_short=cut_short, notes=notes,
    )
    if not report.best_baseline.fits:
        notes.append("the lower bound ignores memory, and memory binds here (the fastest baseline does not fit): "
                     "part of the gap may be the bound's")
    fitting = report.best_fitting_baseline
    if min_gain > 0 and fitting is not None and fitting.iteration_ms <= final.iteration_ms * (1 + min_gain):
        notes.append(f"returned the best baseline that fits, {fitting.name}: the searched plan is "
                     f"{fitting.iteration_ms / final.iteration_ms - 1:+.1%} faster on paper, under min_gain "
                     f"{min_gain:.1%}")
        report.chosen, best_plan, final = fitting.name, baseline_plans[fitting.name], baseline_sims[fitting.name]
    report.order_bound_ms = _order_bound(best_plan, costs, final, activation_budget, memory_limit, memory,
                                         refinement if refinement is not None and refinement.plan is best_plan else None)
    runners_up = _runners_up(tuned, searched, best_plan, final.iteration_ms)
    if runners_up:
        notes.append(f"runners-up: {len(runners_up)} plan{'s' if len(runners_up) > 1 else ''} of other shapes within "
                     f"{RUNNER_UP_MARGIN:.0%} ({', '.join(f'{ms:.1f}' for ms, _ in runners_up)} ms; "
                     "PlanResult.runners_up): measure them beside this plan where the costs are that uncertain "
                     "(octopipe train --candidates)")
    return PlanResult(best_plan, report, final, costs, tuple(plan_ for _, plan_ in runners_up))


def _refine(start: Candidate, costs: CostTable, cluster: ClusterSpec, num_microbatches: int, remaining: float,
            activation_budget: float | None, memory_limit: float, memory: MemoryModel, effort: float, seed: int,
            notes: list[str]) -> Refinement:
    """CP-SAT over the op order of the tuner's plan `start`: where no order of its structure can be
    much faster the short model suffices; where the order bound leaves room, the whole-order model
    gets more work to find it."""
    room = _activation_room(simulate(start.plan, costs, cluster, memory=memory), activation_budget, memory_limit)
    work = SOLVER_WORK * effort
    if start.plan.num_ops() <= WHOLE_ORDER_OPS:
        bound_ms = structure_order_bound(Structure.of(start.plan), costs, num_microbatches, room, memory)
        ahead = start.iteration_ms / bound_ms - 1 if bound_ms > 0 else 0.0
        if ahead > ORDER_ROOM:
            work = WHOLE_ORDER_WORK * effort
            notes.append(f"solver: the tuner's order is {ahead:.1%} above its structure's order bound: "
                         f"CP-SAT given {WHOLE_ORDER_WORK / SOLVER_WORK:.0f}x the work on the whole order")
    return refine_order(start.plan, costs, cluster, work=work, max_windows=4, time_limit_s=remaining - 0.2,
                        activation_budget=room, memory=memory, seed=seed)


def _order_bound(chosen: PipelinePlan, costs: CostTable, sim: SimResult, activation_limit: float | None,
                 memory_limit: float, memory: MemoryModel, refinement: Refinement | None) -> float:
    """No order of `chosen`'s structure within the limits beats this (`solver.order_bound` under
    each device's activation room; the CP-SAT whole-order model's bound where it ran on it and
    holds for fused backwards too)."""
    bound = structure_order_bound(Structure.of(chosen), costs, chosen.num_microbatches,
                                  _activation_room(sim, activation_limit, memory_limit), memory)
    if refinement is not None and refinement.lower_bound_ms is not None and refinement.bound_covers_every_order:
        bound = max(bound, refinement.lower_bound_ms)
    return min(bound, sim.iteration_ms)


def _activation_room(sim: SimResult, activation_limit: float | None, memory_limit: float) -> list[float]:
    """Each device's activation room: the activation limit, and what the memory limit leaves after
    the weights, gradients and optimizer state of the device's stages."""
    return [min(activation_limit if activation_limit is not None else math.inf, memory_limit - fixed)
            for fixed in sim.static_memory_bytes]


def _runners_up(tuned: TuneResult, searched: SimResult, chosen: PipelinePlan, chosen_ms: float
                ) -> list[tuple[float, PipelinePlan]]:
    """(ms, plan) of the fastest plans of other shapes than `chosen` within RUNNER_UP_MARGIN of
    it: the tuner's, and the searched plan itself where min_gain returned a baseline instead."""
    pool = [(c.iteration_ms, c.plan) for c in tuned.runners_up]
    if searched.plan is not chosen:
        pool.append((searched.iteration_ms, searched.plan))
    taken = {plan_shape(Structure.of(chosen))}
    # a plan with the same stages and the same time as one taken is, in all likelihood, that plan
    # on its devices renamed (identical devices swapped): measuring it again would teach nothing
    alike = {_mirror_key(chosen, chosen_ms)}
    found = []
    for ms, candidate in sorted(pool, key=lambda pair: pair[0]):
        shape, key = plan_shape(Structure.of(candidate)), _mirror_key(candidate, ms)
        if ms <= chosen_ms * (1 + RUNNER_UP_MARGIN) and shape not in taken and key not in alike:
            taken.add(shape)
            alike.add(key)
            found.append((ms, candidate))
    return found[:MAX_RUNNERS_UP]


def _mirror_key(plan_: PipelinePlan, ms: float) -> tuple:
    """What a plan and its copy on renamed devices share: stages, recomputation, time (to 1e-6 ms)."""
    return plan_.boundaries, plan_.recompute, plan_.selective, round(ms, 6)


_search = plan  # compile()'s `plan` argument shadows the function


def _ranges(values: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    parts, run = [], [values[0]]
    for value in values[1:]:
        if value == run[-1] + 1:
            run.append(value)
        else:
            parts.append(run)
            run = [value]
    parts.append(run)
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in parts)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _below_max_bytes(value: object) -> bool:
    """A positive number below MAX_BYTES (a limit in bytes, or a factor)."""
    return _positive_finite(value) and value < MAX_BYTES  # type: ignore[operator]


def _positive_finite(value: object) -> bool:
    """A number (not a bool) in (0, inf); huge integers included, without overflowing."""
    return is_finite_number(value) and value > 0  # type: ignore[operator]


def _size(count: float, exact: bool = False) -> str:
    """A byte count in the unit that shows it: 3.20 GiB, 412.0 MiB, 96 B; `exact`: with the
    bytes too, where the unit rounds (a limit to set)."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            shown = f"{count / scale:.2f} {unit}" if unit == "GiB" else f"{count / scale:.1f} {unit}"
            return f"{shown} ({math.ceil(count)} bytes)" if exact else shown
    return f"{math.ceil(count)} B"


def _check_inputs(costs: CostTable, cluster: ClusterSpec, num_microbatches: int, num_devices: int,
                  time_limit_s: float, effort: float, memory_limit_bytes: float | None, seed: int) -> None:
    if not isinstance(costs, CostTable):
        raise ArgumentError(f"plan: costs must be a CostTable (CostTable.load(path)), got {type(costs).__name__}")
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ArgumentError(f"plan: num_microbatches must be a positive integer, got {num_microbatches!r}")
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or not 1 <= num_devices <= cluster.num_devices:
        raise ArgumentError(f"plan: num_devices must be in 1..{cluster.num_devices} (the cluster's devices), got {num_devices!r}")
    if num_devices > len(costs):
        replicas, layers = cluster.data_parallel, len(costs)
        if replicas > 1:  # (plan --devices does not go with --data-parallel)
            where, cli = (f" per replica ({replicas} replicas)",
                          f"a cluster of at most {layers * replicas} devices: train --nprocs, plan --cluster")
        else:
            where, cli = "", f"plan --devices <= {layers}, train --nprocs <= {layers}"
        raise ArgumentError(f"plan: {num_devices} devices{where} but the model has only {layers} layers; every device "
                            f"needs at least one layer: use num_devices <= {layers} (CLI: {cli})")
    if not _positive_finite(time_limit_s) and time_limit_s != math.inf:
        raise ArgumentError(f"plan: time_limit_s must be a positive number of seconds, got {time_limit_s!r}")
    for name, value in (("effort", effort), ("memory_limit_bytes", memory_limit_bytes)):
        if value is not None and not _below_max_bytes(value):
            raise ArgumentError(f"plan: {name} must be a positive number below 2**80, got {value!r:.60}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
        raise ArgumentError(f"plan: seed must be an integer in [0, 2**31) (the solver's seed is 32-bit), got {seed!r}")
    if not sum(costs.forward) + sum(costs.backward_full) > 0:
        raise ArgumentError(
            f"plan: every layer of the cost table{_named(costs)} takes 0 ms forward and backward, so no plan is faster "
            "than another; fill forward_ms and backward_ms (octopipe.bench.runtime_profile measures them, "
            "compile(..., costs='analytic') estimates them)"
        )


def _named(costs: CostTable) -> str:
    return f" of {costs.model}" if costs.model else ""


def _baselines_in_time(costs: CostTable, cluster: ClusterSpec, num_microbatches: int, num_devices: int,
                       memory: MemoryModel, activation_limit: float | str | None, memory_limit: float,
                       deadline: float) -> tuple[dict[str, PipelinePlan], dict[str, SimResult], list[str]]:
    """Every baseline plan and its simulation, in `schedules.NAMES` order, and the names of those
    left unsimulated: the 1F1B ones come first (an activation limit of "1f1b" is theirs) and are
    always simulated; past `deadline`, once one simulated plan fits the limits (the fallback
    that keeps the returned plan valid), the rest are left out. The plans are built here for
    this table (schedules' tests check that they validate), so they are not validated again."""
    plans: dict[str, PipelinePlan] = {}
    sims: dict[str, SimResult] = {}
    left: list[str] = []
    one_fits = False
    for name, plan_ in schedules.iter_baselines(costs, cluster, num_microbatches, num_devices=num_devices,
                                                first=("1f1b",)):
        if not name.startswith("1f1b/") and time.perf_counter() > deadline:
            if not one_fits:
                try:
                    budget = _activation_limit(activation_limit, sims)
                except PlanError:  # (no 1F1B plan for this input: its limit is refused below)
                    budget = None
                one_fits = any(_row(key, "baseline", sim, budget, memory_limit).fits for key, sim in sims.items())
            if one_fits:
                left.append(name)
                continue
        plans[name] = plan_
        sims[name] = simulate(plan_, costs, cluster, memory=memory, validated=True)
    order = list(schedules.baselines_order())
    return ({name: plans[name] for name in sorted(plans, key=order.index)},
            {name: sims[name] for name in sorted(sims, key=order.index)}, sorted(left, key=order.index))


def _activation_limit(limit: float | str | None, baseline_sims: dict[str, SimResult]) -> float | None:
    if limit is None:
        return None
    if isinstance(limit, str):
        if limit != "1f1b":
            raise ArgumentError(f"plan: activation_limit must be bytes or '1f1b', got {limit!r}")
        peaks = [max(sim.peak_activation_bytes) for name, sim in baseline_sims.items() if name.startswith("1f1b/")]
        if not peaks:
            raise PlanError("plan: activation_limit='1f1b' but no 1F1B baseline is defined for this input")
        return max(peaks)
    if not _below_max_bytes(limit):
        raise ArgumentError(f"plan: activation_limit must be a positive number of bytes below 2**80, '1f1b' or None, "
                            f"got {limit!r:.80}")
    return float(limit)


def _least_need(costs: CostTable, num_devices: int, memory: MemoryModel, memory_limit: float,
                activation_budget: float | None) -> tuple[tuple[int, ...] | None, float, float]:
    """The split into at most `num_devices` contiguous stages, one per device, that a plan running
    one microbatch at a time fits in (stage weights + state + one microbatch's activations within
    `memory_limit`, activations within `activation_budget`), or None; and the least memory and
    activation per device such a plan needs at all (balanced splits)."""
    _, total, activation, sent = _layer_needs(costs, memory)
    start = _stage_start(costs)
    p = min(num_devices, len(costs))

    def most(values: Sequence[float], bounds: Sequence[int]) -> float:
        return max(start[a] + sum(values[a:b]) + sent[b - 1] for a, b in _pairs(bounds))

    def balanced(values: Sequence[float]) -> float:
        """The need of the split balancing `values`, or balancing them with what each layer would
        send on, whichever is less."""
        return min(most(values, schedules.balanced_boundaries(weights, p))
                   for weights in (values, [v + s for v, s in zip(values, sent)]))

    need_memory = balanced(total)
    need_activation = balanced(activation)
    cap = math.inf if activation_budget is None else activation_budget
    found = _contiguous_split(total, activation, sent, p, memory_limit, cap, start)
    if found is None:
        return None, need_memory, need_activation
    bounds = list(found)
    tried: set[int] = set()
    while len(bounds) - 1 < p:  # split the longest stage until every device has one, where both halves fit
        splittable = [s for s in range(len(bounds) - 1) if bounds[s + 1] - bounds[s] >= 2 and bounds[s] not in tried]
        if not splittable:
            break
        widest = max(splittable, key=lambda s: (bounds[s + 1] - bounds[s], -s))
        middle = (bounds[widest] + bounds[widest + 1]) // 2
        halves = [bounds[widest], middle, bounds[widest + 1]]
        if most(total, halves) <= memory_limit and most(activation, halves) <= cap:
            bounds.insert(widest + 1, middle)
        else:
            tried.add(bounds[widest])
    return tuple(bounds), need_memory, need_activation


def _layer_needs(costs: CostTable, memory: MemoryModel) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per layer: its weights, gradients and optimizer state; that plus one microbatch's
    activations (what its device holds during its backward); its activations; and what a stage
    ending with it sends on (its outputs, held at its forward's end until sent; none for the last).
    A stage starting with layer i > 0 also holds `costs.unsaved_input[i]` (`_stage_start`)."""
    static = [costs.params[i] * memory.state_bytes_per_param_byte for i in range(len(costs))]
    activation = list(costs.activation)
    sent = [*costs.output[:-1], 0.0]
    return static, [a + b for a, b in zip(static, activation)], activation, sent


def _stage_start(costs: CostTable) -> list[float]:
    """Per layer: what a stage starting with it holds beyond its layers' activations (what it
    received and its first layer does not save; none for the first layer), as the simulator
    counts it."""
    return [0.0, *costs.unsaved_input[1:]]


def _contiguous_split(total: Sequence[float], activation: Sequence[float], sent: Sequence[float], p: int,
                      memory_limit: float, activation_cap: float, start: Sequence[float]) -> tuple[int, ...] | None:
    """The fewest contiguous stages, at most `p`, whose layers' `total` (state and one
    microbatch's activations) fits `memory_limit` and whose `activation` fits `activation_cap`,
    each with what its last layer sends on (`sent`) and what its first layer's input adds
    (`start`, `_stage_start`) (greedy: each stage takes layers while both fit),
    or None."""
    bounds, held, acts = [0], 0.0, 0.0
    for i in range(len(total)):
        if i > bounds[-1] and (held + total[i] + sent[i] > memory_limit or acts + activation[i] + sent[i] > activation_cap):
            bounds.append(i)
            held = acts = start[i]
        held += total[i]
        acts += activation[i]
        if held + sent[i] > memory_limit or acts + sent[i] > activation_cap:
            return None
    bounds.append(len(total))
    return tuple(bounds) if len(bounds) - 1 <= p else None


def _least_limit(fits: Callable[[float], bool], most: float, first: float | None = None) -> float | None:
    """The least limit in (0, most] that `fits` (monotone), rounded up to a byte; None if not even
    `most` does. `first`: a lower bound on it, returned as it is when it fits."""
    if first is not None and fits(first):
        return first
    if not fits(most):
        return None
    low, high = 0.0, most
    while high - low > max(1.0, high * 1e-9):
        middle = (low + high) / 2
        if fits(middle):
            high = middle
        else:
            low = middle
    return float(math.ceil(high))


def _pairs(bounds: Sequence[int]) -> list[tuple[int, int]]:
    return list(zip(bounds[:-1], bounds[1:]))


ONE_IN_FLIGHT = -(1 << 62)
"""`Policy.inflight_slack` that caps every stage at one microbatch in flight."""


def _low_memory_plan(costs: CostTable, cluster: ClusterSpec, num_microbatches: int, bounds: Sequence[int],
                     num_devices: int, memory: MemoryModel) -> PipelinePlan:
    """A plan on the fitting split (stage s on device s) with one microbatch in flight per stage
    and full backwards: the fallback that fits whenever `_check_memory_feasible` passes."""
    structure = Structure(tuple(bounds), tuple(range(len(bounds) - 1)), num_devices)
    # a slack below any round trip's estimate caps every stage at one microbatch (-M-1 did not
    # where a round trip spans more than M+2 of a device's loads: deep pipelines, slow links)
    policy = Policy(split_backward=False, inflight_slack=ONE_IN_FLIGHT)
    return list_schedule(structure, costs, cluster, num_microbatches, policy, None, memory)


def _check_memory_feasible(costs: CostTable, num_devices: int, num_microbatches: int, memory_limit: float,
                           activation_budget: float | None, memory: MemoryModel) -> tuple[tuple[int, ...] | None, str]:
    """Raise InfeasibleError, with the least memory that would work and what to change, when no
    plan can meet the limits: a layer's state and its activations (all present during its
    backward, recomputed or not) over the memory limit, its activations over the activation limit,
    or more state than the devices hold together. Otherwise return a split that a
    one-microbatch-at-a-time plan fits (and ""), or None when no contiguous split, one stage per
    device, does (a V placement or recomputation may still fit, which only the search can tell)
    and the error to raise if the search finds nothing."""
    bounds, need_memory, need_activation = _least_need(costs, num_devices, memory, memory_limit, activation_budget)
    if bounds is not None:
        return bounds, ""
    static, total, activation, sent = _layer_needs(costs, memory)
    start = _stage_start(costs)
    shared = sum((len(tied.layers) - 1) * tied.bytes * memory.state_bytes_per_param_byte for tied in costs.tied)
    least_memory = max(max(total), (sum(static) - shared) / num_devices)
    least_activation = max(activation)
    p = min(num_devices, len(costs))
    cap = math.inf if activation_budget is None else activation_budget

    def fits(memory_cap: float, activation_cap: float) -> bool:
        return _contiguous_split(total, activation, sent, p, memory_cap, activation_cap, start) is not None

    # what to raise, each with the other limit as given: the least limits a contiguous split (one
    # stage per device, one microbatch in flight) meets, which a plan then always fits (each
    # first tries the even split's need, the least when the other limit does not bind)
    memory_with_cap = _least_limit(lambda limit: fits(limit, cap), sum(total), need_memory)
    activation_with_memory = _least_limit(lambda limit: fits(memory_limit, limit), sum(activation), need_activation)
    if need_memory > memory_limit:
        # the fewest devices whose contiguous stages meet both limits
        fewest = _contiguous_split(total, activation, sent, len(costs), memory_limit, cap, start)
        more = (f"use {len(fewest) - 1} devices" if fewest is not None else
                "(more devices cannot help: a single layer with its state and one microbatch's activations needs "
                "more than the limit)" if max(total) > memory_limit else
                "(more devices cannot help: a single layer's activations are over the activation limit)")
        raise_to = memory_with_cap if memory_with_cap is not None else need_memory
        message = (
            f"no plan fits {_size(memory_limit)} per device: even with the layers split evenly over "
            f"{num_devices} devices and one microbatch in flight, the busiest device needs {_size(need_memory)} "
            f"(weights, gradients and optimizer state of its layers plus one microbatch's activations). Raise the "
            f"memory limit to {_size(raise_to, exact=True)}, {more}, hold less optimizer state (counted here as "
            f"{memory.state_bytes_per_param_byte:g} bytes per byte of weights: say which optimizer the job steps, "
            "MemoryModel.for_optimizer or plan --optimizer, and --optimizer-shards where it shards that state over "
            "data-parallel replicas), or use a smaller microbatch")
        if memory_with_cap is None:
            # no split meets the activation limit: name the activations the memory-balanced one needs
            with_need = _least_limit(lambda limit: fits(need_memory, limit), sum(activation))
            message += (f"; the activation limit binds too: raise it to {_size(with_need or need_activation, exact=True)}"
                        f", which always works with that memory limit (to at least {_size(least_activation)} for "
                        "any plan to fit)")
        elif memory_with_cap > need_memory:
            message += (f" (the activation limit, {_size(cap)}, is why the memory limit must be more than the "
                        f"{_size(need_memory)} an even split needs)")
    elif need_activation > cap:
        raise_to = activation_with_memory if activation_with_memory is not None else need_activation
        message = (
            f"activation limit {_size(cap)} per device is below what one microbatch in flight needs "
            f"on the busiest of {num_devices} devices with the layers split evenly ({_size(need_activation)}), and "
            f"no plan holds less than the largest layer's {_size(least_activation)} (its backward needs all of "
            f"them, recomputed or not). Raise activation_limit to {_size(raise_to, exact=True)}, which "
            f"always works (to at least {_size(least_activation)} for any plan to fit), use more devices (more, "
            "shorter stages), or use a smaller microbatch")
    else:
        message = (
            f"no plan fits both limits ({_size(memory_limit)} per device, activations "
            f"{_size(cap)}): one at a time each holds for a balanced split ({_size(need_memory)} "
            f"and {_size(need_activation)}) but no split of the layers over {num_devices} devices meets both at "
            f"once. Raise the memory limit to {_size(memory_with_cap or need_memory, exact=True)} (with this "
            f"activation limit) or the activation limit to {_size(activation_with_memory, exact=True)} (with this "
            "memory limit), use more devices, or use a smaller microbatch")
    if memory_limit < least_memory or (activation_budget is not None and activation_budget < least_activation):
        raise InfeasibleError(message)
    return None, f"the search found no plan within the limits: {message}"


def _row(name: str, kind: str, sim: SimResult, activation_budget: float | None, memory_limit: float | None) -> PlanRow:
    peak_activation = max(sim.peak_activation_bytes)
    peak_memory = max(sim.peak_memory_bytes)
    fits = (activation_budget is None or peak_activation <= activation_budget * (1 + 1e-9)) and (
        memory_limit is None or peak_memory <= memory_limit * (1 + 1e-9))
    return PlanRow(name, kind, sim.iteration_ms, sim.bubble_ratio, peak_activation, peak_memory, fits, sim.plan.num_stages)




# -- compile ----------------------------------------------------------------------------------------

DUMP_LEVELS = ("graph", "costs", "plan", "program", "stages")


@dataclass
class Pipeline:
    """A compiled model: every IR level, and an engine per rank.

    `graph` (LayerGraph), `costs` (CostTable), `plan` (PipelinePlan), `programs` (one
    RankProgram per rank), `stages` (one StageModule per plan stage), `report` (when the planner
    ran), `simulation` (the plan's predicted iteration), `pass_seconds` (time of each pass)."""

    graph: Any
    costs: CostTable
    plan: PipelinePlan
    programs: tuple
    stages: tuple
    cluster: ClusterSpec
    num_microbatches: int
    report: PlanReport | None = None
    simulation: SimResult | None = None
    pass_seconds: dict[str, float] = field(default_factory=dict)
    loss_weight: Callable[[Any], Any] | None = None
    """compile's `loss_weight`, given to every engine."""
    runners_up: tuple[PipelinePlan, ...] = ()
    """The planner's runners-up (`PlanResult.runners_up`) when compile planned; compile one with
    `compile(..., plan=p, costs=pipe.costs)` to measure it beside this plan."""
    autocast: Any = None
    """compile's autocast dtype (torch.bfloat16 or torch.float16) or None, given to every engine."""
    data_parallel: int = 1
    """Replicas of the pipeline (compile's `data_parallel`): `world_size` is the plan's devices
    times it, and rank r runs pipeline rank r // data_parallel of replica r % data_parallel."""
    batch_specs: tuple | None = None
    """(shape, dtype) of each tensor of the example batch, the model's inputs then the target: what
    every step takes (each engine checks it)."""
    shard_optimizer: bool = False
    """compile's `shard_optimizer`: every engine splits its optimizer's state over the replicas."""
    overlap_param_gather: bool = False
    """compile's `overlap_param_gather`: every engine overlaps the shares' broadcast with the next step."""
    master_weights: bool = False
    """compile's `master_weights`: every engine's optimizer steps fp32 copies of the bf16 weights."""
    fp32_grads: bool = False
    """compile's `fp32_grads`: every engine accumulates and reduces the bf16 weights' gradients in fp32."""

    @property
    def microbatch_size(self) -> int | None:
        """Samples per microbatch of the example batch (what `save` records with the plan)."""
        return self.batch_specs[0][0][0] // self.num_microbatches if self.batch_specs else None

    @property
    def world_size(self) -> int:
        return self.plan.num_devices * self.data_parallel

    @property
    def data_parallel_ms(self) -> float:
        """The longest of the step's gradient all-reduces across the replicas, as the simulation
        charges them (part of `simulation.iteration_ms`); 0 without replicas."""
        return self.simulation.data_parallel_ms if self.simulation is not None else 0.0

    def engine(self, rank: int, **options: Any):
        """The runtime Engine of `rank` (its stages and program). Options go to
        `octopipe.runtime.engine.Engine` (timeout_s, device, optimizer, init, loss_weight, autocast,
        shard_optimizer, overlap_param_gather, master_weights, fp32_grads, release_outputs: see there; loss_weight,
        autocast, shard_optimizer, overlap_param_gather, master_weights and fp32_grads default to compile's,
        and an autocast other than compile's is refused: the stages' cross-stage dtypes come from it)."""
        from octopipe.passes.codegen import stages_on
        from octopipe.runtime.amp import autocast_dtype
        from octopipe.runtime.engine import Engine

        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ArgumentError(f"pipe.engine: rank must be an integer in 0..{self.world_size - 1}, got {rank!r}")
        known = set(inspect.signature(Engine.__init__).parameters) - {"self", "rank", "world_size", "stages", "program",
                                                                      "num_microbatches"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ArgumentError(f"pipe.engine: unknown option(s) {unknown}; the options are {sorted(known)}")
        options.setdefault("loss_weight", self.loss_weight)
        options.setdefault("autocast", self.autocast)
        options.setdefault("data_parallel", self.data_parallel)
        if options["data_parallel"] != self.data_parallel:
            raise ArgumentError(f"pipe.engine: data_parallel={options['data_parallel']!r}, but the pipeline was compiled "
                                f"for {self.data_parallel} replica(s); compile again with data_parallel= to change it")
        if autocast_dtype(options["autocast"], "pipe.engine(autocast=...)") != self.autocast:
            raise ArgumentError(f"pipe.engine: autocast={options['autocast']!r}, but the pipeline was compiled with "
                                f"autocast={self.autocast}: the tensors between stages have that run's dtypes; "
                                "compile again with the autocast to run")
        options.setdefault("batch_specs", self.batch_specs)
        options.setdefault("shard_optimizer", self.shard_optimizer)
        options.setdefault("overlap_param_gather", self.overlap_param_gather)
        if "master_weights" not in options:  # (master_weights given here: fp32_grads defaults to it)
            options.setdefault("fp32_grads", self.fp32_grads)
        options.setdefault("master_weights", self.master_weights)
        stage_rank = rank // self.data_parallel
        return Engine(rank, self.world_size, stages_on(self.stages, self.plan, stage_rank), self.programs[stage_rank],
                      self.num_microbatches, **options)

    def dump(self, level: str = "plan") -> str:
        """The text form of one IR level: graph, costs, plan, program (all ranks) or stages."""
        from octopipe.ir.program import format_programs

        if level == "graph":
            return str(self.graph)
        if level == "costs":
            return str(self.costs)
        if level == "plan":
            return str(self.plan)
        if level == "program":
            return format_programs(self.programs)
        if level == "stages":
            return "\n".join(stage.describe() for stage in self.stages) + "\n"
        raise ArgumentError(f"pipe.dump: unknown IR level {level!r}; levels are {', '.join(DUMP_LEVELS)}")

    def dump_all(self, directory: str | Path) -> list[Path]:
        """Write every level as NN_<level>.txt (the IR after each pass) into `directory`."""
        directory = Path(directory)
        paths = []
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for number, level in enumerate(DUMP_LEVELS, 1):
                path = directory / f"{number:02d}_{level}.txt"
                path.write_text(self.dump(level))
                paths.append(path)
        except OSError as exc:
            raise ArgumentError(f"pipe.dump_all({str(directory)!r}): cannot write there ({exc.strerror or exc}); give "
                                "a folder (it is created if missing)") from None
        return paths

    def save(self, path: str | Path) -> None:
        """Save the plan to reuse with compile(plan=path): JSON for .json (with the costs, cluster
        and predicted iteration time, see `save_plan`), else the text form."""
        # the cluster as the plan saw it: one replica's devices, with the replica count
        cluster = self.cluster.replica(self.data_parallel) if self.data_parallel > 1 else self.cluster
        save_plan(self.plan, path, costs=self.costs, cluster=cluster, microbatch_size=self.microbatch_size,
                  iteration_ms=self.simulation.iteration_ms if self.simulation is not None else None,
                  memory=self.simulation.memory if self.simulation is not None else None)


PLANNED_WITH = "planned_with"
"""The key of a JSON plan file's context: {"cluster", "costs", "iteration_ms", "microbatch_size",
"memory"} (each optional; "memory" only where the plan was made with another memory model than
the default, `MemoryModel.to_dict`)."""


@dataclass(frozen=True)
class SavedPlan:
    """A plan file and what it was planned on (None where the file does not say: the text form,
    or JSON written without them)."""

    plan: PipelinePlan
    costs: CostTable | None = None
    cluster: ClusterSpec | None = None
    iteration_ms: float | None = None
    """The iteration time the planner predicted for it on those costs and that cluster."""
    microbatch_size: int | None = None
    """Samples per microbatch of the batch the costs were measured on (planned from a model)."""
    memory: MemoryModel = MemoryModel()
    """The memory model it was planned with (optimizer state per weight byte): what `octopipe
    simulate` counts its memory with."""


def save_plan(plan_: PipelinePlan, path: str | Path, *, costs: CostTable | None = None,
              cluster: ClusterSpec | None = None, iteration_ms: float | None = None,
              microbatch_size: int | None = None, memory: MemoryModel | None = None) -> None:
    """Write `plan_` to `path`: JSON for .json, with whichever of `costs`, `cluster`,
    `iteration_ms` and `memory` (where not the default) are given under PLANNED_WITH
    (`PipelinePlan.from_json`, `load_plan` and `compile(plan=path)` read the plan and skip them);
    the text form for any other suffix."""
    path = Path(path)
    if not path.parent.is_dir():
        raise ArgumentError(f"save plan: the folder of {str(path)!r} does not exist; create it or write elsewhere")
    if path.is_dir():
        raise ArgumentError(f"save plan: {str(path)!r} is a folder; give a file name (plan.json, or plan.txt)")
    if path.suffix.lower() != ".json":
        path.write_text(str(plan_))
        return
    data = plan_.to_dict()
    context: dict[str, Any] = {}
    if cluster is not None:
        context["cluster"] = cluster.to_dict()
    if costs is not None:
        context["costs"] = costs.to_dict()
    if iteration_ms is not None:
        context["iteration_ms"] = iteration_ms
    if microbatch_size is not None:
        context["microbatch_size"] = microbatch_size
    if memory is not None and memory != MemoryModel():
        context["memory"] = memory.to_dict()
    if context:
        data[PLANNED_WITH] = context
    path.write_text(json.dumps(data, indent=1) + "\n")


def load_saved_plan(path: str | Path) -> SavedPlan:
    """A plan file (JSON or text form) with the context `save_plan` stored in it, if any."""
    path = Path(path)
    plan_ = load_plan(path)
    text = read_text(path, ParseError, "plan")
    if not text.lstrip().startswith("{"):
        return SavedPlan(plan_)
    context = parse_json(text, str(path), ParseError).get(PLANNED_WITH)
    if context is None:
        return SavedPlan(plan_)
    if not isinstance(context, dict) or set(context) - {"cluster", "costs", "iteration_ms", "microbatch_size", "memory"}:
        raise ParseError(f"{path}: '{PLANNED_WITH}' must be an object with cluster, costs, iteration_ms, "
                         f"microbatch_size, memory; got {context!r:.200}")
    microbatch_size = context.get("microbatch_size")
    if microbatch_size is not None and (isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int)
                                        or microbatch_size < 1):
        raise ParseError(f"{path}: {PLANNED_WITH}.microbatch_size must be a positive integer, got {microbatch_size!r:.60}")
    costs = CostTable.from_dict(context["costs"], source=f"{path} ({PLANNED_WITH}.costs)") if "costs" in context else None
    cluster = (ClusterSpec.from_dict(context["cluster"], where=f"{path} ({PLANNED_WITH}.cluster)")
               if "cluster" in context else None)
    iteration_ms = context.get("iteration_ms")
    if iteration_ms is not None and not _positive_finite(iteration_ms):
        raise ParseError(f"{path}: {PLANNED_WITH}.iteration_ms must be a positive number of milliseconds, got "
                         f"{iteration_ms!r:.60}; the file was edited by hand? Save it again with octopipe plan -o")
    if cluster is not None and cluster.num_devices < plan_.num_devices:
        raise ParseError(f"{path}: the plan runs on {plan_.num_devices} devices but its {PLANNED_WITH}.cluster has "
                         f"{cluster.num_devices}; the file was edited by hand? Save it again with octopipe plan -o")
    if costs is not None and len(costs) != plan_.num_layers:
        raise ParseError(f"{path}: the plan covers {plan_.num_layers} layers but its {PLANNED_WITH}.costs has "
                         f"{len(costs)}; the file was edited by hand? Save it again with octopipe plan -o")
    try:
        memory = (MemoryModel.from_dict(context["memory"], f"{path}: {PLANNED_WITH}.memory") if "memory" in context
                  else MemoryModel())
    except ArgumentError as exc:
        raise ParseError(f"{exc}; the file was edited by hand? Save it again with octopipe plan -o") from None
    return SavedPlan(plan_, costs, cluster, float(iteration_ms) if iteration_ms is not None else None, microbatch_size,
                     memory)


def load_plan(source: str | Path | PipelinePlan) -> PipelinePlan:
    if isinstance(source, PipelinePlan):
        return source
    path = Path(source)
    text = read_text(path, ParseError, "plan")
    is_json = path.suffix == ".json" or text.lstrip().startswith("{")
    try:
        return PipelinePlan.from_json(text) if is_json else PipelinePlan.parse(text)
    except ParseError as exc:
        raise ParseError(f"{path}: {exc}") from None


def compile(
    model: Any,
    cluster: ClusterSpec | str,
    *,
    example_inputs: Sequence[Any] | Any,
    loss_fn: Callable[[Any, Any], Any],
    example_target: Any = None,
    num_microbatches: int = 8,
    costs: str | CostTable = "analytic",
    plan: str | Path | PipelinePlan | None = None,
    schedule: str | None = None,
    partition: str | Sequence[int] = "balanced",
    num_devices: int | None = None,
    time_limit_s: float = 60.0,
    memory_limit_bytes: float | None = None,
    activation_limit: float | str | None = None,
    split_points: Sequence[str] = (),
    leaf_modules: Sequence[Any] = (),
    split_backward: bool | None = None,
    compile_stages: bool = False,
    receive_ahead: int | None = None,
    seed: int = 0,
    effort: float = 1.0,
    quiet: bool = False,
    recompute: bool = True,
    seq_dims: Mapping[str, int | None] | None = None,
    loss_weight: Callable[[Any], Any] | None = None,
    autocast: Any = None,
    data_parallel: int = 1,
    memory: MemoryModel = MemoryModel(),
    optimizer: str | None = None,
    shard_optimizer: bool = False,
    overlap_param_gather: bool = False,
    master_weights: bool = False,
    fp32_grads: bool | None = None,
) -> Pipeline:
    """Trace `model`, cost it, plan it (or take `plan=` / `schedule=`), cut it into stages and
    lower the plan to per-rank programs, verified before anything runs.

    cluster: a ClusterSpec, a preset name ("cpux2", "h100x8") or a spec file. example_inputs: one full batch of model inputs, cut along dim 0 into `num_microbatches`
    equal microbatches. loss_fn(output, target) -> scalar mean loss. example_target: a target
    batch; with it the loss is traced as the last layer (and costed), without it the last stage
    applies loss_fn. costs: "analytic" (formulas, no run; floats counted at the run's size:
    autocast's 2 bytes, else the bytes of the dtype the model's weights are held in), "profile" (measured on this device, the
    layers as traced: eager even with compile_stages) or a CostTable. plan: a saved plan (path or
    PipelinePlan) to skip the search. schedule: a baseline name (e.g. "zb-v") with `partition`
    ("balanced" or "uniform"). compile_stages: wrap each stage
    in torch.compile (Inductor: Triton kernels on a GPU, C++ on a CPU, slow to compile there; each
    rank compiles its stages where they first run, so the pipeline pickles as an eager one does); in
    fp32 equal to eager stages to float rounding; under bf16 or fp16 autocast off by what 16-bit
    rounding gives (Inductor's fused kernels round fewer intermediates to 16 bits: up to 3% of the
    largest gradient under bf16, 0.1% under fp16, where eager pipelines are bitwise); dropout draws
    Inductor's own random numbers unless `torch._inductor.config.fallback_random` is set.
    receive_ahead: how many computes
    before the one that reads it a receive is posted (as far as the pair order allows; see
    `passes/lower.py`); default: at the start of the step on gloo, where a send moves its data only
    once the receive is posted (posted late, the data waits 10-35 ms for the sender's I/O thread
    to get a core while both ranks compute) and receives match sends by tag, so they need not
    keep the order of the rank's own sends to that peer; and 1 on NCCL, where every posted
    receive holds a buffer and a pair's operations run in one order. recompute: whether the
    search may make stages recompute their activations (see `plan`). effort: the search's work
    budget (see `plan`; 3 finds plans up to 3% faster on the profiled tables for about three
    times the planning time). seq_dims: for analytic
    costs, which dim of each input (by its name in the traced graph, `pipe.dump("graph")`) is the
    sequence, or None for none (default: dim 1 of [b, s] integer and [b, s, d] inputs).
    loss_weight(target microbatch) -> count: weigh each microbatch's loss by its share of the
    batch's count instead of equally; with a token-mean loss_fn and the count of tokens it
    averages (`lambda t: (t != -100).sum()` for cross_entropy's ignore_index), the step's loss and
    gradients are the token mean over the whole batch, as in plain training (Megatron's
    per-token loss). Computed from the target on the loss stage's rank each step. A batch whose
    count is 0 everywhere (every token ignored) gives a nan loss and zero gradients, as plain
    training's mean over no token does.
    autocast: None, "bf16" (torch.bfloat16) or "fp16" (torch.float16, with dynamic loss scaling as
    GradScaler does it, across ranks): mixed precision, every stage's forward under torch.autocast
    as plain autocast training runs it (fp32 parameters and gradients; tensors cross stages in
    autocast's dtypes; `costs="profile"` measures under it too; see `runtime/amp.py`).
    data_parallel: D replicas of the pipeline over the cluster's devices (Megatron's order: the D
    copies of a pipeline rank are neighbouring ranks, `ClusterSpec.replica`); the plan is made for
    one replica's devices (num_devices, if given, counts those), the example batch is one
    replica's (what each rank's `step` takes), and each step sums the replicas' gradients, so they
    train as one pipeline on the D batches together (the simulation, and so the planner, charges
    those all-reduces, a bucket per stage once its backward is done: `Pipeline.data_parallel_ms`).
    memory: what a device holds besides activations (default mixed-precision Adam on bf16
    weights), for the search's memory limit and the simulation's memory. optimizer: the one the
    job steps (a `simulator.OPTIMIZER_STATE` name, "adamw", "sgd", ...): `memory` then counts its
    state for the model's own weights, in the dtype they are held in, against what the cost table
    counts per weight (analytic costs count the run's float size: autocast's 2 bytes, else the
    weights' own), e.g. 8 bytes per counted byte for fp32 AdamW under bf16 autocast, 4 for fp32
    AdamW without it and on costs profiled on the model.
    shard_optimizer: every engine splits the optimizer's state over the `data_parallel` replicas
    (ZeRO-1, Megatron's distributed optimizer; exact: see `runtime/engine.py`): the memory limit
    counts 1/data_parallel of the optimizer's own state per device (`optimizer`'s, else the
    default mixed-precision Adam's; a `memory` with its own state bytes is taken as given) and
    the simulation prices what the runtime moves (`MemoryModel.shards`): each share's gradients
    reduced onto its owner (a reduce-scatter's bytes, not an all-reduce's) and each replica's
    updated share broadcast to the others after the step. The shares are even to within a row
    (each stage's parameters cut at row boundaries, `Engine.shard_rows`), so the optimizer must
    be element-wise (`runtime.engine.ELEMENTWISE_OPTIMIZERS`: SGD, Adam, AdamW, ...).
    overlap_param_gather: with shard_optimizer (Megatron's `--overlap-param-gather`), that
    broadcast runs beside the next step instead of ending this one: each stage's first forward
    waits for its own share, and the simulation (so the search) prices it there
    (`MemoryModel.overlap_param_gather`); the same values, bit for bit.
    master_weights (Megatron's `--bf16`, for a model whose weights are bf16: `model.bfloat16()`):
    every engine's optimizer steps an fp32 copy of each bf16 weight and rounds the weight from it
    after each step (see `runtime/engine.py`); `optimizer`'s memory then counts the copy and the
    optimizer's fp32 state (`MemoryModel.for_optimizer(..., master_weights=True)`; the default
    mixed-precision Adam already is this). fp16 weights (`model.half()`, Megatron's `--fp16`) are
    taken too, with fp32_grads: every engine then scales the loss dynamically (`runtime/amp.py`'s
    `LossScaler`, GradScaler's rule and defaults, as under autocast="fp16"), unscales the fp32
    gradients and skips the step on an inf or nan anywhere.
    fp32_grads (with master_weights, and by default there: Megatron's
    `--accumulate-allreduce-grads-in-fp32`, its default under `--bf16`; False is its
    `--grad-reduce-in-bf16`): every engine accumulates the bf16 weights' gradients over the
    microbatches in fp32, sums them across ranks (tied copies, replicas) and clips them in fp32,
    and the copies step them as they are (`Engine.main_grads()`); the memory counts 4 bytes of
    gradient a weight (the default state: mixed-precision Adam's 18 bytes a weight, not 16) and
    the simulation sums twice the bytes (`MemoryModel.grad_bytes_per_param_byte`)."""
    import torch

    from octopipe.passes.codegen import codegen, links_of, microbatch, tied_parameters
    from octopipe.passes.lower import lower
    from octopipe.passes.trace import kept_buffers, selective_hazards, trace
    from octopipe.passes.verify import verify
    from octopipe.runtime.amp import autocast_dtype

    seconds: dict[str, float] = {}
    cluster = ClusterSpec.of(cluster, "compile: cluster")
    autocast = autocast_dtype(autocast, "compile(autocast=...)")
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ArgumentError(f"compile: data_parallel must be a positive integer (replicas), got {data_parallel!r}")
    if cluster.data_parallel > 1:
        raise ArgumentError(f"compile: cluster {cluster.name!r} is one of {cluster.data_parallel} data-parallel replicas "
                            f"(ClusterSpec.replica); compile runs every replica it prices: give the whole cluster with "
                            f"data_parallel={cluster.data_parallel}")
    if not isinstance(shard_optimizer, bool):
        raise ArgumentError(f"compile: shard_optimizer must be True or False, got {shard_optimizer!r:.40}")
    if not isinstance(overlap_param_gather, bool):
        raise ArgumentError(f"compile: overlap_param_gather must be True or False, got {overlap_param_gather!r:.40}")
    if not isinstance(master_weights, bool):
        raise ArgumentError(f"compile: master_weights must be True or False, got {master_weights!r:.40}")
    if fp32_grads is None:  # Megatron's default: fp32 gradients wherever there are master copies
        fp32_grads = master_weights
    if not isinstance(fp32_grads, bool):
        raise ArgumentError(f"compile: fp32_grads must be True, False or None (default: master_weights), got "
                            f"{fp32_grads!r:.40}")
    if fp32_grads and not master_weights:
        raise ArgumentError("compile: fp32_grads=True accumulates the bf16 weights' gradients in fp32 for their fp32 "
                            "master copies, but master_weights is False; pass master_weights=True too (with "
                            "model.bfloat16()), or leave fp32_grads off")
    if overlap_param_gather and not shard_optimizer:
        raise ArgumentError("compile: overlap_param_gather=True overlaps the broadcast of a sharded optimizer's "
                            "updated shares with the next step, but shard_optimizer is False (nothing is "
                            "broadcast); pass shard_optimizer=True too, or leave overlap_param_gather off")
    full_cluster, cluster = cluster, cluster.replica(data_parallel) if data_parallel > 1 else cluster
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    empty = [i for i, t in enumerate(inputs) if hasattr(t, "dim") and t.dim() and t.shape[0] == 0]
    if empty:
        raise ArgumentError(f"compile: example input {empty[0]} has no rows (dim 0 is 0); give one real batch of at "
                            "least num_microbatches samples")
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ArgumentError(f"compile: num_microbatches must be a positive integer, got {num_microbatches!r}")
    _check_meta_examples(model, inputs, example_target)
    if plan is not None and schedule is not None:
        raise ArgumentError("compile: give plan= (a saved plan) or schedule= (a baseline), not both")
    if not callable(loss_fn) or not _takes_two_arguments(loss_fn):
        raise ArgumentError(f"compile: loss_fn must be a function loss_fn(output, target) -> scalar loss, got "
                            f"{loss_fn!r:.60}")
    if not _positive_finite(effort):
        raise ArgumentError(f"compile: effort must be a positive number (the search's work budget; 1 by default), "
                            f"got {effort!r}")
    if not isinstance(memory, MemoryModel):
        raise ArgumentError(f"compile: memory must be a MemoryModel (MemoryModel.for_optimizer(name)), got "
                            f"{type(memory).__name__}")
    memory.check("compile: memory")
    if memory.overlap_param_gather and not overlap_param_gather:
        raise ArgumentError("compile: memory prices an overlapped parameter gather (overlap_param_gather=True) but "
                            "compile's overlap_param_gather is False, so the engines would not overlap it; pass "
                            "compile(..., shard_optimizer=True, overlap_param_gather=True), which prices it too")
    if optimizer is not None and memory.state_bytes_per_param_byte != MemoryModel().state_bytes_per_param_byte:
        raise ArgumentError("compile: give optimizer= (its state is then sized from the model's weights) or memory= "
                            "with your own state_bytes_per_param_byte, not both")
    if memory.grad_bytes_per_param_byte != 1.0 and not fp32_grads:
        raise ArgumentError(f"compile: memory prices {memory.grad_bytes_per_param_byte:g} bytes of gradient per byte of "
                            "weights (fp32 gradients of bf16 weights) but compile's fp32_grads is False, so the "
                            "engines would sum the gradients in the weights' dtype; pass compile(..., "
                            "master_weights=True, fp32_grads=True), which prices them too")
    sharded = shard_optimizer and data_parallel > 1
    if (sharded or fp32_grads) and optimizer is None:
        # the default state is mixed-precision Adam's: its own part sharded, its gradients fp32
        # with fp32_grads; a state given as bytes is taken as it is, with the sharded step's
        # broadcast and fp32_grads' reductions priced
        shards = data_parallel if sharded else memory.shards
        default = MemoryModel.for_optimizer("mixed-adam", shards, fp32_grads=fp32_grads)
        state = memory.state_bytes_per_param_byte
        if state == MemoryModel().state_bytes_per_param_byte:
            state = default.state_bytes_per_param_byte
        memory = replace(memory, state_bytes_per_param_byte=state, shards=shards,
                         grad_bytes_per_param_byte=default.grad_bytes_per_param_byte)

    def timed(name: str, function: Callable[[], Any]) -> Any:
        clock = time.perf_counter()
        value = function()
        seconds[name] = time.perf_counter() - clock
        return value

    # running the model below (the target's guess, shape propagation, codegen's example run) must
    # leave its buffers as they were
    with kept_buffers(model):
        if example_target is None:
            example_target = _guess_target(model, inputs, loss_fn)
        graph = timed("trace", lambda: trace(model, inputs, loss_fn=loss_fn, example_target=example_target,
                                             split_points=split_points, leaf_modules=leaf_modules))
        if num_microbatches > 1:
            _warn_per_microbatch_state(graph, num_microbatches)
        micro = microbatch(inputs, num_microbatches)
        micro_target = microbatch((example_target,), num_microbatches)[0] if example_target is not None else None
        if loss_weight is not None:
            _check_loss_weight(loss_weight, example_target, num_microbatches)
        table = timed("costs", lambda: _costs_for(costs, graph, cluster, micro, micro_target, seq_dims, autocast,
                                                  num_microbatches))
        if len(table) != len(graph.layers):
            raise OctopipeError(f"compile: the cost table has {len(table)} layers but the traced model has "
                                f"{len(graph.layers)}; costs must be for this model's layers (dump: pipe.graph)")
        hazards = selective_hazards(graph)
        table = table.without_selective(hazards)  # a given table's too: the search never plans them selective
        if optimizer is not None:
            memory = _optimizer_memory(optimizer, model, table, memory, data_parallel if shard_optimizer else 1,
                                       master_weights=master_weights, fp32_grads=fp32_grads)
        if master_weights and not any(p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)
                                      for p in model.parameters()):
            dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.requires_grad})
            raise ArgumentError(f"compile: master_weights=True keeps fp32 copies of the model's bf16 (or fp16) weights "
                                f"for the optimizer, but none of its weights that train is bf16 or fp16 ({', '.join(dtypes) or 'none'}"
                                "); cast the model first (model.bfloat16()), or leave master_weights off (fp32 weights "
                                "train under autocast='bf16' without copies)")
        if master_weights and not fp32_grads and any(p.requires_grad and p.dtype is torch.float16
                                                     for p in model.parameters()):
            raise ArgumentError("compile: master_weights=True with fp16 weights (Megatron's --fp16) needs "
                                "fp32_grads=True: their loss-scaled gradients are accumulated and unscaled in fp32 "
                                "(fp16 would flush the small ones to zero); pass fp32_grads=True too")
        if overlap_param_gather and data_parallel > 1:
            memory = replace(memory, overlap_param_gather=True)  # (sharded above: shards = data_parallel)
        report = None
        runners_up: tuple[PipelinePlan, ...] = ()
        if plan is not None:
            chosen = timed("plan", lambda: load_plan(plan))
            if isinstance(plan, (str, Path)):
                _warn_planned_elsewhere(plan, table.model, len(table), micro, num_microbatches)
        elif schedule is not None:
            chosen = timed("plan", lambda: schedules.build(schedule, table, cluster, num_microbatches,
                                                           num_devices=num_devices, partition=partition))
        else:
            result = timed("plan", lambda: _search(
                table, cluster, num_microbatches, num_devices=num_devices, time_limit_s=time_limit_s,
                memory_limit_bytes=memory_limit_bytes, activation_limit=activation_limit, seed=seed, quiet=quiet,
                recompute=recompute, effort=effort, memory=memory))
            chosen, report, runners_up = result.plan, result.report, result.runners_up
        if chosen.num_microbatches != num_microbatches:
            raise ArgumentError(f"compile: the plan has {chosen.num_microbatches} microbatches but num_microbatches="
                                f"{num_microbatches}; plan again or pass the matching count")
        where = f"plan {plan}" if isinstance(plan, (str, Path)) else "the plan"
        if chosen.num_layers != len(graph.layers):
            named = f" {graph.model}" if graph.model else ""
            raise PlanError(f"compile: {where} covers {chosen.num_layers} layers but the traced model{named} has "
                            f"{len(graph.layers)}; plan this model (octopipe.plan, "
                            "`octopipe plan --model ...`) or give the plan made for it")
        chosen.validate(num_layers=len(graph.layers))
        _check_selective_hazards(chosen, graph, hazards, where)
        _check_updated_buffers(chosen, graph, where)
        if chosen.num_devices > cluster.num_devices:
            per = (f" per replica ({full_cluster.num_devices} in all, {data_parallel} replicas)"
                   if data_parallel > 1 else "")
            raise ArgumentError(f"compile: {where} uses {chosen.num_devices} devices, the cluster {cluster.name} has "
                                f"{cluster.num_devices}{per}; give a cluster with {chosen.num_devices} devices (CLI: "
                                "--cluster, --devices) or plan for this one")
        simulation = timed("simulate", lambda: simulate(chosen, table, cluster, validated=True,  # checked above
                                                        memory=memory))
        stages = timed("codegen", lambda: codegen(graph, chosen, inputs, example_target,
                                                  num_microbatches=num_microbatches,
                                                  loss_fn=loss_fn, model=model, split_backward=split_backward,
                                                  compile=compile_stages, autocast=autocast,
                                                  run_device="cuda" if cluster.backend == "nccl" else "cpu"))
        links = links_of(stages)
        if receive_ahead is None:
            receive_ahead = max(map(len, chosen.device_ops), default=1) if cluster.backend == "gloo" else 1
        elif not isinstance(receive_ahead, int) or isinstance(receive_ahead, bool) or receive_ahead < 0:
            raise ArgumentError(f"compile: receive_ahead must be a non-negative integer (computes), got "
                                f"{receive_ahead!r}")
        # gloo matches a receive to its send by tag: only receives from one peer need the send order
        # among themselves, so (with the default) every receive is posted when the step starts
        programs = timed("lower", lambda: lower(chosen, links, tied_parameters(stages, chosen), prefetch=receive_ahead,
                                                serialized_pairs=cluster.backend != "gloo"))
        timed("verify", lambda: verify(programs, chosen, links))
        specs = tuple((tuple(t.shape), t.dtype) for t in (*inputs, example_target))  # (a target is guessed if not given)
        return Pipeline(graph, table, chosen, programs, stages, full_cluster, num_microbatches, report, simulation,
                        seconds, loss_weight, runners_up, autocast, data_parallel, specs, shard_optimizer,
                        overlap_param_gather, master_weights, fp32_grads)


@dataclass
class ReplicaCount:
    """One data-parallel replica count that `plan_data_parallel` tried."""

    data_parallel: int
    num_devices: int
    """Devices per replica."""
    num_microbatches: int
    """Microbatches per replica."""
    result: PlanResult | None = None
    error: str = ""
    """Why it has no plan (the replica cannot hold the model, ...)."""

    @property
    def step_ms(self) -> float:
        """One step of the whole batch: a replica's iteration (they run side by side), all-reduce included."""
        return self.result.report.iteration_ms if self.result is not None else math.inf


@dataclass
class DataParallelResult:
    """`plan_data_parallel`'s choice: the replica count with the fastest step, and every count tried."""

    best: PlanResult
    data_parallel: int
    tried: list[ReplicaCount]

    def __str__(self) -> str:
        sharded = any(row.result is not None and row.result.simulation.memory.shards > 1 for row in self.tried)
        label = "reduce-scatter + share broadcast ms" if sharded else "all-reduce ms"
        priced = any(row.result is not None and row.result.simulation.memory.step_bytes_per_param_byte > 0
                     for row in self.tried)
        step = "  optimizer step ms" if priced else ""
        lines = [f"replicas x devices  microbatches each  step ms  {label}{step}", "-" * (48 + len(label) + len(step))]
        for row in self.tried:
            mark = "*" if row.data_parallel == self.data_parallel else " "
            if row.result is None:
                lines.append(f"{mark}{row.data_parallel:>3} x {row.num_devices:<13} {row.num_microbatches:>17}  "
                             f"no plan: {row.error}")
                continue
            sim = row.result.simulation
            lines.append(f"{mark}{row.data_parallel:>3} x {row.num_devices:<13} {row.num_microbatches:>17} "
                         f"{row.step_ms:>8.2f} {sim.data_parallel_ms:>{len(label) + 1}.2f}"
                         + (f"{max(sim.optimizer_step_ms):>{len(step)}.2f}" if priced else ""))
        return "\n".join(lines) + "\n\n" + str(self.best.report)


def plan_data_parallel(
    costs: CostTable,
    cluster: ClusterSpec | str,
    num_microbatches: int,
    *,
    counts: Sequence[int] | None = None,
    time_limit_s: float = 60.0,
    quiet: bool = False,
    **options: Any,
) -> DataParallelResult:
    """Choose how many data-parallel replicas to cut `cluster` into, with each one's plan.
    `num_microbatches` is the whole batch's: D replicas take num_microbatches / D each. Every
    count D (`counts`, default all) that divides the devices and the microbatches and that
    `ClusterSpec.replica` accepts is planned on one replica (`plan`, with `options`; the time
    limit shared out, the most replicas first, what one leaves going to the rest); the step of
    the whole batch is one replica's iteration (they run
    side by side), their gradient all-reduce included. The fastest count wins (fewer replicas
    on a tie); a count whose replica cannot plan (the model does not fit in memory, fewer layers
    than devices) is listed with the reason. `memory` (one of `options`) may be a function of the
    replica count returning each count's MemoryModel: `lambda d: MemoryModel.for_optimizer("adamw",
    shards=d)` where the job shards its optimizer state over its replicas (ZeRO-1,
    `compile(shard_optimizer=True)`), so more replicas hold less each."""
    cluster = ClusterSpec.of(cluster, "plan_data_parallel: cluster")
    if cluster.data_parallel > 1:
        raise ArgumentError(f"plan_data_parallel: the cluster is already one of {cluster.data_parallel} replicas "
                            f"({cluster.name}); give the whole cluster, and it chooses the replica count itself")
    if not any(layer.param_bytes for layer in costs.layers):
        raise ArgumentError("plan_data_parallel: the cost table has no param_bytes, so every replica would hold no "
                            "weights and all-reduce nothing, and the most replicas would always win; use costs of a "
                            "model (compile's analytic or profiled ones, `octopipe plan --model`) or fill param_bytes")
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ArgumentError(f"plan_data_parallel: num_microbatches must be a positive integer, got {num_microbatches!r}")
    if counts is None:
        counts = [d for d in range(1, cluster.num_devices + 1) if cluster.num_devices % d == 0]
    candidates = []
    for count in counts:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ArgumentError(f"plan_data_parallel: replica counts must be positive integers, got {count!r}")
        if cluster.num_devices % count or num_microbatches % count:
            continue
        try:
            replica = cluster.replica(count)
        except ClusterSpecError:
            continue
        candidates.append((count, replica))
    if not candidates:
        raise ArgumentError(f"plan_data_parallel: no replica count among {list(counts)} divides both the "
                            f"{cluster.num_devices} devices (and a node's {cluster.devices_per_node}) and the "
                            f"{num_microbatches} microbatches")
    if not _positive_finite(time_limit_s):
        raise ArgumentError(f"plan_data_parallel: time_limit_s must be a positive number of seconds, got {time_limit_s!r}")
    memory = options.pop("memory", MemoryModel())
    if isinstance(memory, MemoryModel) or not callable(memory):  # (plan refuses what is not a MemoryModel)
        memories = {count: memory for count, _ in candidates}
    else:
        memories = {count: memory(count) for count, _ in candidates}
        for count, model in memories.items():
            if not isinstance(model, MemoryModel):
                raise ArgumentError(f"plan_data_parallel: memory({count}) returned {type(model).__name__}, not a "
                                    "MemoryModel; return e.g. MemoryModel.for_optimizer('adamw', shards=count)")
    tried, failures = [], []
    deadline = time.perf_counter() + time_limit_s
    # the most replicas first: their replicas are the smallest searches, and those that cannot
    # hold the model fail at once, so what they leave goes to the larger pipelines
    for left, (count, replica) in enumerate(sorted(candidates, key=lambda c: -c[0])):
        share = max(0.1, (deadline - time.perf_counter()) / (len(candidates) - left))
        row = ReplicaCount(count, replica.num_devices, num_microbatches // count)
        try:
            row.result = plan(costs, replica, row.num_microbatches, time_limit_s=share, quiet=quiet,
                              memory=memories[count], **options)
        except OctopipeError as error:
            row.error = str(error).splitlines()[0].split(" (")[0][:200]
            failures.append(error)
        tried.append(row)
    tried.sort(key=lambda row: row.data_parallel)
    planned = [row for row in tried if row.result is not None]
    if not planned:
        wrong = [error for error in failures if not isinstance(error, InfeasibleError)]
        if len(wrong) == len(failures) and len({str(error) for error in wrong}) == 1:
            raise wrong[0]  # the same wrong argument for every count: say it as plan does, in full
        raise InfeasibleError("plan_data_parallel: no replica count has a plan: "
                              + "; ".join(f"{row.data_parallel} replicas: {row.error}" for row in tried))
    best = min(planned, key=lambda row: (row.step_ms, row.data_parallel))
    return DataParallelResult(best.result, best.data_parallel, tried)  # type: ignore[arg-type]


def _check_meta_examples(model: Any, inputs: tuple, example_target: Any) -> None:
    """A model built on the meta device is traced on meta examples, and a real one on real ones:
    say which side is on meta (the example run's own error blames batch dims)."""
    import torch

    if not isinstance(model, torch.nn.Module):
        return
    tensors = [*model.parameters(), *model.buffers()]
    if not tensors:
        return
    model_meta = any(t.is_meta for t in tensors)
    examples = [(f"example input {i}", t) for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)]
    if isinstance(example_target, torch.Tensor):
        examples.append(("example_target", example_target))
    odd = [name for name, t in examples if t.is_meta != model_meta]
    if odd:
        where, other = ("the meta device", "a real device") if model_meta else ("a real device", "the meta device")
        raise ArgumentError(
            f"compile: the model is on {where} but {', '.join(odd)} {'is' if len(odd) == 1 else 'are'} on {other}; "
            "build the examples where the model is (for a meta model: inside `with torch.device(\"meta\"):`, or "
            "`tensor.to(\"meta\")`), as the ranks create the real tensors")


def _check_loss_weight(loss_weight: Any, example_target: Any, num_microbatches: int) -> None:
    """`loss_weight` is a function that gives each example target microbatch a count (their sum
    may be 0 here: an example target need not hold real tokens)."""
    import torch

    from octopipe.runtime.engine import microbatch_counts

    where = "compile(loss_weight=...)"
    if not callable(loss_weight):
        raise ArgumentError(f"{where}: must be a function of the target microbatch, got {type(loss_weight).__name__}")
    if not isinstance(example_target, torch.Tensor):
        raise ArgumentError(f"{where}: weighs microbatches by their target, but the loss has no target tensor "
                            f"(example_target is {type(example_target).__name__}); drop loss_weight")
    # (a meta-device target holds no values: this checks the answers' type, the ranks count real ones)
    microbatch_counts(loss_weight, example_target, num_microbatches, where)


_RUNNING_STATS = ("BatchNorm", "InstanceNorm", "SyncBatchNorm")


def _takes_two_arguments(function: Callable[..., Any]) -> bool:
    """Whether `function(output, target)` binds (True where its signature cannot be read)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # no signature to read (some builtins)
        return True
    try:
        signature.bind(None, None)
    except TypeError:
        return False
    return True


def _check_selective_hazards(chosen: PipelinePlan, graph: Any, reasons: Mapping[int, str], where: str) -> None:
    """Refuse a plan whose selective stage holds a layer selective recomputation cannot run
    (`trace.selective_hazards`, given as `reasons`: an in-place op on what it keeps, a recurrent
    module). The search never plans one (compile's cost table does not offer it there)."""
    hazards = {}
    for stage in chosen.stages:
        layer = next((j for j in range(stage.layer_start, stage.layer_end) if j in reasons), None)
        if stage.selective and layer is not None:
            hazards[stage.index] = f"layer {layer} ({graph.layers[layer].name}) {reasons[layer]}"
    if hazards:
        listed = "; ".join(f"stage {index}: {reason}" for index, reason in hazards.items())
        raise PlanError(f"compile: {where} recomputes selectively where it cannot ({listed}): selective recomputation "
                        "keeps matmul outputs that such an op changes (a failed backward, or wrong gradients); "
                        "recompute those stages fully or not at all (plan.with_recompute)")


def _updated_buffer(node: Any, buffers: Mapping[str, Any]) -> str | None:
    """The buffer `node` updates in place (a `call_method` such as `add_` on a buffer's
    `get_attr`), or None."""
    if node.op != "call_method" or not str(node.target).endswith("_") or not node.args:
        return None
    first = node.args[0]
    return str(first.target) if getattr(first, "op", None) == "get_attr" and first.target in buffers else None


def _check_updated_buffers(chosen: PipelinePlan, graph: Any, where: str) -> None:
    """Refuse a plan that puts an in-place update of a buffer and a read of the same buffer on
    different devices: each device holds its own copy, so that read would miss the update that
    plain training sees (found by fuzzing: a scale shared by the first and the last layer and
    updated in the last one trained to other losses, silently). On one device the stages share
    the buffer. (A module's own buffers, as BatchNorm's, stay inside its one layer.)"""
    if graph.module is None:
        return
    module = graph.module
    buffers = dict(module.named_buffers())
    layer_of = graph.layer_of_node()
    device_of = {j: stage.device for stage in chosen.stages for j in range(stage.layer_start, stage.layer_end)}
    reads: dict[str, set[int]] = {}
    updates: dict[str, int] = {}
    for node in module.graph.nodes:
        if node.op != "get_attr" or node.target not in buffers:
            continue
        for user in node.users:
            layer = layer_of.get(user.name)
            if layer is None:
                continue
            reads.setdefault(str(node.target), set()).add(layer)
            if user.args and user.args[0] is node and _updated_buffer(user, buffers) is not None:
                updates.setdefault(str(node.target), layer)
    for name, layer in sorted(updates.items()):
        elsewhere = sorted(j for j in reads[name] if device_of.get(j) != device_of.get(layer))
        if elsewhere:
            read = elsewhere[0]
            raise PlanError(f"compile: {where} puts layer {layer} ({graph.layers[layer].name}), which updates buffer "
                            f"{name!r} in place, on device {device_of.get(layer)} and layer {read} "
                            f"({graph.layers[read].name}), which reads it, on device {device_of.get(read)}: each "
                            "device holds its own copy of a buffer, so the read would miss the update; give a plan "
                            "that keeps these layers on one device, or update the buffer in the layer that reads it")


def _warn_planned_elsewhere(path: str | Path, model: str, num_layers: int, micro: Sequence[Any],
                            num_microbatches: int, where: str = "compile") -> None:
    """Warn where a saved plan file says it was planned on another model's costs or on
    microbatches of another size than `micro`'s (one microbatch of the batch, as compile cuts
    it): it still runs (the layers match) and is priced on this model's costs, but its partition,
    placement and order were chosen for what it was planned on. `model` and `num_layers` are the
    traced model's (CostTable.model and its length); `where` starts the message."""
    import warnings

    from octopipe.errors import OctopipeWarning

    try:
        saved = load_saved_plan(path)
    except OctopipeError:
        return  # a context that does not parse: compile reads the plan alone, as load_plan does
    planned = saved.costs.model if saved.costs is not None else ""
    size = int(micro[0].shape[0]) if micro else 0
    if saved.plan.num_layers != num_layers:
        return  # another layer count: refused next, no warning needed
    if planned and model and planned != model:
        warnings.warn(f"{where}: {path} was planned on the costs of {planned}, this model is {model}: it runs "
                      f"(the layer counts match) and its prediction is this model's, but its partition, placement "
                      f"and order were chosen for {planned}'s costs; plan again for this model (octopipe.plan, or "
                      "octopipe plan --model)", OctopipeWarning, stacklevel=3)
    if saved.microbatch_size and size and size != saved.microbatch_size:
        warnings.warn(f"{where}: {path} was planned for microbatches of {saved.microbatch_size} samples, this batch "
                      f"makes microbatches of {size}: its prediction is for {size}, but its partition, placement and "
                      f"order were chosen for {saved.microbatch_size}; use a batch of "
                      f"{saved.microbatch_size * num_microbatches} or plan again for this one",
                      OctopipeWarning, stacklevel=3)


def _warn_per_microbatch_state(graph: Any, num_microbatches: int) -> None:
    """Warn where the model's forward reads batch statistics or updates buffers (in its graph, or
    inside a leaf module: a spectral norm's power iteration, found by fuzzing): a pipeline runs
    it once per microbatch, so it sees 1/num_microbatches of the batch and updates that many
    times per step (as in every pipeline-parallel system, but not as in plain training)."""
    import warnings

    from octopipe.errors import OctopipeWarning

    gm = graph.module
    buffers = dict(gm.named_buffers())
    stats, updated = [], []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            if module.training and any(type(module).__name__.startswith(kind) for kind in _RUNNING_STATS):
                stats.append(str(node.target))
        elif (name := _updated_buffer(node, buffers)) is not None:
            updated.append(name)
    for path, names in gm.meta.get("octopipe.leaf_updates", {}).items():
        if path not in stats:  # (a norm's running statistics: said above)
            updated.extend(f"{path}.{name}" for name in names)
    if stats:
        warnings.warn(f"compile: {', '.join(stats)} normalise with batch statistics in training mode: each pipeline "
                      f"stage sees one microbatch (1/{num_microbatches} of the batch) at a time, so the loss and "
                      "gradients differ from plain training and the running statistics update once per microbatch; "
                      "use LayerNorm/GroupNorm, eval mode, or num_microbatches=1", OctopipeWarning, stacklevel=3)
    if updated:
        warnings.warn(f"compile: forward updates buffer(s) {', '.join(sorted(set(updated)))}: the pipeline runs it once "
                      f"per microbatch ({num_microbatches} times a step), not "
                      "once per batch", OctopipeWarning, stacklevel=3)


def _guess_target(model: Any, inputs: tuple, loss_fn: Callable[[Any, Any], Any]) -> Any:
    """A stand-in target batch when none is given: class indices shaped like the output without
    its last dimension (language models, classifiers), else a tensor shaped like the output."""
    import warnings

    import torch

    from octopipe.passes.trace import _primary_output

    with torch.no_grad():
        output = _primary_output(model(*inputs))
    candidates = []
    if isinstance(output, torch.Tensor) and output.dim() >= 1:
        candidates.append(torch.zeros(output.shape[:-1], dtype=torch.long, device=output.device))
    if isinstance(output, torch.Tensor):
        candidates.append(torch.zeros_like(output))
    for candidate in candidates:
        try:
            # a loss that only broadcasts the guess (mse_loss on [b] against [b, b]) warns: not it
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("error")
                loss = loss_fn(output, candidate)
        except Exception:  # noqa: BLE001 - a wrong guess just moves on to the next one
            continue
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            return candidate
    raise OctopipeError(
        "compile: could not infer the target's shape for loss_fn (tried class indices shaped like the output "
        "without its last dimension, and a tensor shaped like the output); pass example_target= (one batch of targets)"
    )


def _optimizer_memory(optimizer: str, model: Any, table: CostTable, memory: MemoryModel, shards: int = 1,
                      price_step: bool = False, master_weights: bool = False, fp32_grads: bool = False) -> MemoryModel:
    """`memory` with the state of `optimizer` (its own part over `shards` replicas) for `model`'s
    own weights: the bytes per weight they are held in, against what `table` counts per weight
    (its param_bytes, each tied parameter once, over the model's weight count); `price_step`:
    its step's traffic too (`MemoryModel.step_bytes_per_param_byte`); `master_weights`: the
    optimizer steps fp32 copies of the weights, and `fp32_grads` their gradients are fp32
    (`MemoryModel.for_optimizer`)."""
    weights = list(model.parameters())  # (a parameter two modules share, once)
    count = sum(p.numel() for p in weights)
    counted = sum(table.params) - sum((len(tied.layers) - 1) * tied.bytes for tied in table.tied)
    if count == 0 or counted <= 0:  # no weights the table counts: nothing to size (the state is 0 bytes)
        state = MemoryModel.for_optimizer(optimizer, shards, price_step=price_step, master_weights=master_weights,
                                          fp32_grads=fp32_grads)
    else:
        held = sum(p.numel() * p.element_size() for p in weights)
        state = MemoryModel.for_optimizer(optimizer, shards, param_bytes_per_weight=counted / count,
                                          weight_bytes=held / count, price_step=price_step,
                                          master_weights=master_weights, fp32_grads=fp32_grads)
    return replace(memory, state_bytes_per_param_byte=state.state_bytes_per_param_byte, shards=shards,
                   step_bytes_per_param_byte=state.step_bytes_per_param_byte,
                   grad_bytes_per_param_byte=state.grad_bytes_per_param_byte)


def _float_bytes(graph: Any, autocast: Any) -> int:
    """Bytes of a float in the run compile plans: autocast's 16-bit dtype, else the dtype most of
    the model's floating-point weights are held in (torch's default without any)."""
    import torch

    if autocast is not None:
        return int(autocast.itemsize)
    counts: dict[int, int] = {}
    for param in graph.module.parameters() if graph.module is not None else ():
        if param.is_floating_point():
            counts[param.element_size()] = counts.get(param.element_size(), 0) + param.numel()
    return max(counts, key=lambda size: (counts[size], size)) if counts else torch.get_default_dtype().itemsize


def _costs_for(costs: str | CostTable, graph: Any, cluster: ClusterSpec, micro: tuple, micro_target: Any,
               seq_dims: Mapping[str, int | None] | None = None, autocast: Any = None,
               num_microbatches: int = 1) -> CostTable:
    if isinstance(costs, CostTable):
        return costs
    if costs == "analytic":
        from octopipe.passes.costs import analytic_costs

        batch_size = int(micro[0].shape[0]) if micro and hasattr(micro[0], "shape") and micro[0].dim() else 1
        return analytic_costs(graph, cluster, batch_size=batch_size, seq_dims=seq_dims,
                              num_microbatches=num_microbatches, dtype_bytes=_float_bytes(graph, autocast))
    if costs == "profile":
        from octopipe.passes.profile import profile_costs

        if graph.module is not None and any(t.is_meta for t in (*graph.module.parameters(), *graph.module.buffers())):
            raise ArgumentError("compile: costs='profile' times the layers, but the model is on the meta device (no "
                                "data to run); use costs='analytic' (or a cost table profiled on a real copy)")
        return profile_costs(graph, micro, example_target=micro_target if graph.layers[-1].kind == "loss" else None,
                             autocast=autocast, num_microbatches=num_microbatches)
    if isinstance(costs, (str, Path)) and Path(costs).suffix in (".json", ".yaml", ".yml"):
        return CostTable.load(costs)
    raise ArgumentError(f"compile: costs must be 'analytic', 'profile', a cost table file or a CostTable, got {costs!r}")
