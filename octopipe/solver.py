"""OR-Tools CP-SAT models: the balance bound, load-balanced structures, and op-order refinement.

Consumes a CostTable, ClusterSpec and (for refinement) a hint plan from the tuner; produces plans
no worse than the hint, and proven lower bounds.

- `balance_bound`: the smallest possible per-microbatch load of the busiest device when whole
  layers are assigned to devices (makespan on identical machines, solved exactly). Times the
  microbatch count it bounds every plan's iteration time from below: each device must run F, B
  and W of its layers for every microbatch.
- `balanced_structure`: stage boundaries (and, for `placement=None`, the stage -> device map)
  minimising the busiest device's load, for a given number of stages.
- `refine_order`: the joint timing model of one structure — an interval per op, precedences with
  transfer delays, no-overlap per device, activation memory as a reservoir per device, objective
  = iteration time — hinted with the tuner's plan and solved over neighbourhoods (a window of
  ops that CP-SAT may reorder while the rest keep their relative order) when the whole model is
  too large. It never returns a plan worse than the hint.
- `solve_joint`: the full joint model (partition boundaries, placement and order as variables)
  for small instances; tests compare it with brute force.

Times are integers in `TICKS_PER_MS` units inside the models.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from octopipe.cluster import ClusterSpec
from octopipe.errors import InfeasibleError
from octopipe.ir.costs import CostTable
from octopipe.ir.plan import Op, OpKind, PipelinePlan
from octopipe.simulator import MemoryModel, simulate

TICKS_PER_MS = 1000


def _ticks(ms: float) -> int:
    return int(round(ms * TICKS_PER_MS))


def _solver(time_limit_s: float, seed: int, workers: int = 2) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, time_limit_s)
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    return solver


@dataclass(frozen=True)
class Bound:
    """A bound on the busiest device's per-microbatch load (ms) with its proof status."""

    load_ms: float
    """Best known value (feasible assignment's load)."""
    lower_ms: float
    """Proven lower bound on the load."""
    assignment: tuple[int, ...]
    """Device of each layer in the best assignment found."""
    optimal: bool


def layer_loads(costs: CostTable) -> list[float]:
    """Per-microbatch work of each layer on its device: F + B (input) + W = forward + backward."""
    return [f + b for f, b in zip(costs.forward, costs.backward_full)]


def balance_bound(costs: CostTable, num_devices: int, *, time_limit_s: float = 10.0, seed: int = 0) -> Bound:
    """Exact min over assignments of whole layers to devices of the max device load."""
    loads = [_ticks(x) for x in layer_loads(costs)]
    num_layers = len(loads)
    if num_devices >= num_layers:
        top = max(loads) / TICKS_PER_MS
        return Bound(top, top, tuple(range(num_layers)), True)
    # greedy LPT start, also the hint
    order = sorted(range(num_layers), key=lambda i: -loads[i])
    device_load = [0] * num_devices
    greedy = [0] * num_layers
    for i in order:
        d = min(range(num_devices), key=lambda d: (device_load[d], d))
        greedy[i] = d
        device_load[d] += loads[i]
    # relabel devices by decreasing load, matching the symmetry breaking below
    rank = {d: r for r, d in enumerate(sorted(range(num_devices), key=lambda d: -device_load[d]))}
    greedy = [rank[d] for d in greedy]
    device_load = sorted(device_load, reverse=True)
    pigeonhole = _pigeonhole_bound(loads, num_devices)
    if max(device_load) <= max(pigeonhole, max(loads)):
        top = max(device_load) / TICKS_PER_MS
        return Bound(top, top, tuple(greedy), True)
    model = cp_model.CpModel()
    total = sum(loads)
    x = [[model.NewBoolVar(f"x{i}_{d}") for d in range(num_devices)] for i in range(num_layers)]
    floor = max(max(loads), -(-total // num_devices), pigeonhole)
    makespan = model.NewIntVar(min(floor, max(device_load)), max(device_load), "makespan")
    for i in range(num_layers):
        model.AddExactlyOne(x[i])
        for d in range(num_devices):
            model.AddHint(x[i][d], greedy[i] == d)
    for d in range(num_devices):
        model.Add(sum(loads[i] * x[i][d] for i in range(num_layers)) <= makespan)
    # symmetry: device loads non-increasing
    device_sum = [sum(loads[i] * x[i][d] for i in range(num_layers)) for d in range(num_devices)]
    for d in range(num_devices - 1):
        model.Add(device_sum[d] >= device_sum[d + 1])
    model.Minimize(makespan)
    solver = _solver(time_limit_s, seed)
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        best = max(device_load)
        return Bound(best / TICKS_PER_MS, floor / TICKS_PER_MS, tuple(greedy), False)
    assignment = tuple(next(d for d in range(num_devices) if solver.Value(x[i][d])) for i in range(num_layers))
    return Bound(
        solver.ObjectiveValue() / TICKS_PER_MS,
        solver.BestObjectiveBound() / TICKS_PER_MS,
        assignment,
        status == cp_model.OPTIMAL,
    )


def _pigeonhole_bound(loads: Sequence[int], num_devices: int) -> int:
    """Among the k*p+1 largest layers some device gets k+1, so the busiest load is at least the
    sum of the k+1 smallest of them (for every k)."""
    ordered = sorted(loads, reverse=True)
    best = 0
    k = 1
    while k * num_devices + 1 <= len(ordered):
        top = ordered[: k * num_devices + 1]
        best = max(best, sum(top[-(k + 1):]))
        k += 1
    return best


def balanced_structure(
    costs: CostTable,
    num_devices: int,
    num_stages: int,
    placement: Sequence[int] | None = None,
    *,
    num_microbatches: int | None = None,
    time_limit_s: float = 2.0,
    seed: int = 0,
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(boundaries, placement) minimising the busiest device's load with `num_stages` contiguous
    stages. With `placement` given only the boundaries are free; with None the placement is free
    too (consecutive stages on different devices). With `num_microbatches` the objective is the
    estimated iteration time max over devices of (release + microbatches x load), where a
    device's release is the forward time of all layers before its first layer: no device can
    start before microbatch 0 reaches it, so late-starting devices should carry less. Ties are
    broken towards light first stages (they hold the most microbatches in flight). None when
    there are fewer layers than stages."""
    loads = [_ticks(x) for x in layer_loads(costs)]
    num_layers = len(loads)
    if num_stages > num_layers or num_stages < 1:
        return None
    prefix = [0]
    for load in loads:
        prefix.append(prefix[-1] + load)
    total = prefix[-1]
    model = cp_model.CpModel()
    bounds = [model.NewConstant(0)] + [model.NewIntVar(1, num_layers - 1, f"b{s}") for s in range(1, num_stages)] + [
        model.NewConstant(num_layers)]
    for s in range(num_stages):
        model.Add(bounds[s + 1] >= bounds[s] + 1)
    at = [model.NewIntVar(0, total, f"p{s}") for s in range(num_stages + 1)]
    for s in range(num_stages + 1):
        model.AddElement(bounds[s], prefix, at[s])
    stage_load = [model.NewIntVar(0, total, f"l{s}") for s in range(num_stages)]
    for s in range(num_stages):
        model.Add(stage_load[s] == at[s + 1] - at[s])
    forward_prefix = [0]
    for value in costs.forward:
        forward_prefix.append(forward_prefix[-1] + _ticks(value))
    scale = num_microbatches or 1
    horizon = total * scale + forward_prefix[-1]
    makespan = model.NewIntVar(0, horizon, "makespan")
    release = []
    if num_microbatches:
        for s in range(num_stages):
            value = model.NewIntVar(0, forward_prefix[-1], f"r{s}")
            model.AddElement(bounds[s], forward_prefix, value)
            release.append(value)
    if placement is not None:
        for d in range(num_devices):
            stages = [s for s in range(num_stages) if placement[s] == d]
            if not stages:
                continue
            start = release[stages[0]] if release else 0
            model.Add(start + scale * sum(stage_load[s] for s in stages) <= makespan)
    else:
        x = [[model.NewBoolVar(f"x{s}_{d}") for d in range(num_devices)] for s in range(num_stages)]
        for s in range(num_stages):
            model.AddExactlyOne(x[s])
            if s + 1 < num_stages:
                for d in range(num_devices):
                    model.AddBoolOr([x[s][d].Not(), x[s + 1][d].Not()])
        model.Add(x[0][0] == 1)
        for d in range(num_devices):
            parts = []
            for s in range(num_stages):
                part = model.NewIntVar(0, total, f"y{s}_{d}")
                model.Add(part == stage_load[s]).OnlyEnforceIf(x[s][d])
                model.Add(part == 0).OnlyEnforceIf(x[s][d].Not())
                parts.append(part)
            if release:
                # first[s]: stage s is the first stage on device d
                first = [model.NewBoolVar(f"f{s}_{d}") for s in range(num_stages)]
                for s in range(num_stages):
                    model.AddImplication(first[s], x[s][d])
                    for t in range(s):
                        model.AddImplication(first[s], x[t][d].Not())
                    model.AddBoolOr([first[t] for t in range(s + 1)]).OnlyEnforceIf(x[s][d])
                start = model.NewIntVar(0, forward_prefix[-1], f"start{d}")
                for s in range(num_stages):
                    model.Add(start == release[s]).OnlyEnforceIf(first[s])
                model.Add(start + scale * sum(parts) <= makespan)
            else:
                model.Add(sum(parts) <= makespan)
        # every device used when there are enough stages
        if num_stages >= num_devices:
            for d in range(num_devices):
                model.AddBoolOr([x[s][d] for s in range(num_stages)])
    model.Minimize(makespan * (num_layers + 1) + bounds[1] if num_stages > 1 else makespan)
    solver = _solver(time_limit_s, seed)
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    boundaries = tuple(int(solver.Value(b)) for b in bounds)
    if placement is None:
        chosen = tuple(next(d for d in range(num_devices) if solver.Value(x[s][d])) for s in range(num_stages))
    else:
        chosen = tuple(placement)
    return boundaries, chosen


def _transfer_ticks(plan_placement: Sequence[int], output: Sequence[float], cluster: ClusterSpec, src_stage: int,
                    dst_stage: int) -> int:
    a, b = plan_placement[src_stage], plan_placement[dst_stage]
    return _ticks(cluster.transfer_ms(output[min(src_stage, dst_stage)], a, b))


@dataclass
class Refinement:
    plan: PipelinePlan
    iteration_ms: float
    lower_bound_ms: float | None
    """Proven bound of the last model solved (valid for that neighbourhood only)."""
    windows: int
    improved_windows: int
    full_model: bool
    seconds: float


def refine_order(
    plan: PipelinePlan,
    costs: CostTable,
    cluster: ClusterSpec,
    *,
    time_limit_s: float = 10.0,
    activation_budget: Sequence[float] | None = None,
    memory: MemoryModel = MemoryModel(),
    max_window_ops: int = 400,
    seed: int = 0,
) -> Refinement:
    """Improve the op order of `plan` (structure fixed) with CP-SAT, hinted with the plan itself.

    When the plan has at most `max_window_ops` ops the whole order is one model; otherwise the
    model covers every op but only a window of them (a time slice of the hint's timeline, where
    the bubbles are) may change order, the others keep their relative order on each device. The
    result is re-simulated with the full simulator and kept only when strictly better and within
    the memory budget; so the returned plan is never worse than the hint."""
    started = time.perf_counter()
    deadline = started + time_limit_s
    best_plan = plan
    best_sim = simulate(plan, costs, cluster, memory=memory)
    best_time = best_sim.iteration_ms
    ops_total = plan.num_ops()
    full = ops_total <= max_window_ops
    windows = improved = 0
    last_bound: float | None = None
    rng_state = seed
    while time.perf_counter() < deadline - 0.05:
        if full:
            window = None
        else:
            window = _pick_window(best_sim, max_window_ops, rng_state)
            rng_state += 1
        remaining = deadline - time.perf_counter()
        budget_s = remaining if full else min(remaining, max(1.0, time_limit_s / 6))
        result = _solve_order(best_plan, best_sim, costs, cluster, window, budget_s, activation_budget, memory, seed + windows)
        windows += 1
        if result is None:
            if full:
                break
            continue
        candidate, bound = result
        if full:
            last_bound = bound
        sim = simulate(candidate, costs, cluster, memory=memory)
        fits = activation_budget is None or all(
            a <= b + 1e-6 for a, b in zip(sim.peak_activation_bytes, activation_budget))
        if fits and sim.iteration_ms < best_time - 1e-9:
            best_plan, best_sim, best_time = candidate, sim, sim.iteration_ms
            improved += 1
        if full:
            break
    return Refinement(best_plan, best_time, last_bound, windows, improved, full, time.perf_counter() - started)


def _pick_window(sim, max_ops: int, salt: int) -> set[Op]:
    """A time slice around the largest gaps: ops whose start lies in [t0, t1) chosen so the
    slice holds at most `max_ops` ops. Alternates between the start, the end and the worst gap."""
    plan = sim.plan
    ops = sorted((sim.op_start[op], op) for device_ops in plan.device_ops for op in device_ops)
    n = len(ops)
    if n <= max_ops:
        return {op for _, op in ops}
    choice = salt % 3
    if choice == 0:
        chosen = ops[:max_ops]
    elif choice == 1:
        chosen = ops[n - max_ops:]
    else:
        # centre on the op that waited longest after its device's previous op ended
        worst_index, worst_gap = 0, -1.0
        position = {op: i for i, (_, op) in enumerate(ops)}
        for device_ops in plan.device_ops:
            for earlier, later in zip(device_ops, device_ops[1:]):
                gap = sim.op_start[later] - sim.op_end[earlier]
                if gap > worst_gap:
                    worst_gap, worst_index = gap, position[later]
        shift = (salt // 3) * (max_ops // 4)
        low = max(0, min(n - max_ops, worst_index - max_ops // 2 + shift % max(1, n - max_ops)))
        chosen = ops[low: low + max_ops]
    return {op for _, op in chosen}


def _solve_order(plan: PipelinePlan, sim, costs: CostTable, cluster: ClusterSpec, window: set[Op] | None,
                 time_limit_s: float, activation_budget: Sequence[float] | None, memory: MemoryModel,
                 seed: int) -> tuple[PipelinePlan, float] | None:
    from octopipe.simulator import stage_costs

    sc = stage_costs(plan, costs)
    split = plan.split_backward()
    num_stages, m = plan.num_stages, plan.num_microbatches
    placement = plan.placement
    horizon = _ticks(sim.iteration_ms * 2 + 1)
    model = cp_model.CpModel()
    start: dict[Op, cp_model.IntVar] = {}
    end: dict[Op, cp_model.IntVar] = {}
    intervals: dict[int, list] = {d: [] for d in range(plan.num_devices)}
    for device, ops in enumerate(plan.device_ops):
        for op in ops:
            if op.kind is OpKind.F:
                duration = sc.forward[op.stage]
            elif op.kind is OpKind.B:
                duration = sc.backward_input[op.stage] if (op.stage, op.microbatch) in split else sc.backward_full[op.stage]
            else:
                duration = sc.weight[op.stage]
            ticks = _ticks(duration)
            s = model.NewIntVar(0, horizon, f"s{op}")
            e = model.NewIntVar(0, horizon, f"e{op}")
            intervals[device].append(model.NewIntervalVar(s, ticks, e, f"i{op}"))
            start[op], end[op] = s, e
            model.AddHint(s, _ticks(sim.op_start[op]))
    for stage in range(num_stages):
        for mb in range(m):
            f, b = Op(stage, OpKind.F, mb), Op(stage, OpKind.B, mb)
            if stage > 0:
                model.Add(start[f] >= end[Op(stage - 1, OpKind.F, mb)] + _transfer_ticks(placement, sc.output, cluster, stage - 1, stage))
            if stage < num_stages - 1:
                model.Add(start[b] >= end[Op(stage + 1, OpKind.B, mb)] + _transfer_ticks(placement, sc.output, cluster, stage + 1, stage))
            model.Add(start[b] >= end[f])
            w = Op(stage, OpKind.W, mb)
            if w in start:
                model.Add(start[w] >= end[b])
    for device, ops in enumerate(plan.device_ops):
        model.AddNoOverlap(intervals[device])
        if window is not None:
            # ops outside the window keep their order relative to every other op on the device
            fixed = [op for op in ops if op not in window]
            for earlier, later in zip(fixed, fixed[1:]):
                model.Add(start[later] >= end[earlier])
            # a window is a time slice, so on each device its ops are a contiguous run of the
            # hint's order: they reorder freely between the fixed ops around them
            position = {op: i for i, op in enumerate(ops)}
            for op in ops:
                if op not in window:
                    continue
                i = position[op]
                before = next((ops[j] for j in range(i - 1, -1, -1) if ops[j] not in window), None)
                after = next((ops[j] for j in range(i + 1, len(ops)) if ops[j] not in window), None)
                if before is not None:
                    model.Add(start[op] >= end[before])
                if after is not None:
                    model.Add(start[after] >= end[op])
        if activation_budget is not None and any(sc.activation):
            keep = memory.weight_memory_fraction
            times, changes = [], []
            scale = 1000.0 / max(max(sc.activation), 1.0)
            for op in ops:
                act = int(round(sc.activation[op.stage] * scale))
                if op.kind is OpKind.F:
                    times.append(start[op])
                    changes.append(act)
                elif op.kind is OpKind.B:
                    freed = act if (op.stage, op.microbatch) not in split else int(round(act * (1 - keep)))
                    times.append(end[op])
                    changes.append(-freed)
                else:
                    times.append(end[op])
                    changes.append(-(act - int(round(act * (1 - keep)))))
            if times:
                model.AddReservoirConstraint(times, changes, 0, int(activation_budget[device] * scale) + len(ops))
    makespan = model.NewIntVar(0, horizon, "makespan")
    for op, e in end.items():
        model.Add(makespan >= e)
    model.Minimize(makespan)
    solver = _solver(time_limit_s, seed)
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    device_ops = []
    for ops in plan.device_ops:
        device_ops.append(tuple(sorted(ops, key=lambda op: (solver.Value(start[op]), solver.Value(end[op])))))
    return plan.with_ops(device_ops), solver.BestObjectiveBound() / TICKS_PER_MS


def check_activation_budget(budget: Sequence[float] | None, need: Sequence[float]) -> None:
    if budget is None:
        return
    for device, (have, needed) in enumerate(zip(budget, need)):
        if needed > have + 1e-6:
            raise InfeasibleError(f"device {device} needs {needed:.4g} activation bytes, budget {have:.4g}")


