"""Exact bounds and CP-SAT models: the balance and release bounds, load-balanced structures, op-order
refinement, and the joint model of partition, placement and order.

Consumes a CostTable, a ClusterSpec and (for refinement) a hint plan from the tuner; produces
plans no worse than the hint, and proven lower bounds.

- `balance_bound`: the smallest possible per-microbatch load of the busiest device when whole
  layers are assigned to devices (multiway number partitioning, solved exactly: a heuristic, the
  configuration LP of bin packing, and branch and bound). Times the microbatch count it bounds
  every plan's iteration time from below: each device runs F, B and W of its layers for every
  microbatch.
- `release_bound`: a stronger bound where late starts matter: a device cannot start before the
  forwards of the layers before its first one have run, then it runs its microbatches x load
  (minimised over assignments: a rank relaxation, then exactly, layer by layer in model order).
- `balanced_structure`: stage boundaries (and, for `placement=None`, the stage -> device map)
  minimising the busiest device's load (or a release-aware estimate of the iteration time).
- `order_bound`: a bound on every op order of one structure under the activation budget (warm-up
  and cool-down memory arguments per device); the tuner skips moves it rules out.
- `refine_order`: the timing model of one structure — an interval per op, precedences with
  transfer delays, no-overlap per device, activation memory as a reservoir per device (a
  recomputing stage's F holds its inputs, its B takes the activations back at its start), objective
  = iteration time — hinted with the tuner's plan, whole or over windows of it. Never returns a
  plan worse than the hint; keeps the plan's structure (recompute flags included).
- `solve_joint`: the full joint model (partition boundaries, placement and order as variables)
  for small instances, without recomputation; tests compare it with brute force.

Every CP-SAT model runs one worker with a deterministic-time budget, so results are the same on
every run and machine unless a wall-clock safety limit fires first (reported as cut short).
Times are integers in `TICKS_PER_MS` units inside the models (`_bound_scale` ticks in the
bounds), rounded so that plans stay feasible and bounds stay valid.
"""

from __future__ import annotations

import bisect
import importlib
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from octopipe.cluster import ClusterSpec
from octopipe.errors import PlanError
from octopipe.ir.costs import CostTable
from octopipe.ir.plan import Op, OpKind, PipelinePlan
from octopipe.simulator import MemoryModel, SimResult, StageCosts, sent_outputs, simulate

if TYPE_CHECKING:
    from ortools.sat.python import cp_model
else:
    class _ImportedOnUse(ModuleType):
        """A module imported at its first use: CP-SAT's imports pandas and take 0.45 s, which every
        process importing octopipe paid (each torchrun rank, `octopipe --help`) though few solve."""

        def __getattr__(self, name: str) -> Any:
            return getattr(importlib.import_module(self.__name__), name)

    cp_model = _ImportedOnUse("ortools.sat.python.cp_model")

TICKS_PER_MS = 1000


def _ticks(ms: float) -> int:
    return int(round(ms * TICKS_PER_MS))


def _solver(work: float, seed: int, time_limit_s: float | None = None) -> cp_model.CpSolver:
    """A deterministic CP-SAT solver: one worker, `work` deterministic seconds (CP-SAT's own
    measure of search effort, the same on every machine and run); `time_limit_s` is a wall-clock
    safety net that, when it fires first, makes the result depend on the machine's speed."""
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.catch_sigint_signal = False  # (Ctrl-C stays Python's: it left SIGINT at the OS default)
    solver.parameters.max_deterministic_time = max(0.01, work)
    solver.parameters.random_seed = seed
    if time_limit_s is not None:
        solver.parameters.max_time_in_seconds = max(0.05, time_limit_s)
    return solver


def _hit_wall(solver: cp_model.CpSolver, time_limit_s: float | None) -> bool:
    return time_limit_s is not None and solver.wall_time >= 0.98 * time_limit_s


BOUND_TICKS_PER_MS = 100
"""Resolution of the balance bound: 10 us. Layer loads are rounded to it (finer ticks make the
partitioning search much harder and change the bound by microseconds); the proven lower bound
subtracts the slack that rounding can hide, so it stays a true bound on the exact loads."""

MAX_BOUND_TICKS = 10**6
"""Coarser where a table's total load would pass this many ticks (seconds per layer: a paper-size
model's analytic costs on a CPU cluster): the bounds' subset-sum bitsets are as long as the total."""


MIN_BOUND_TICKS = 10**5
"""Finer where a table's total load would span fewer ticks (layers of microseconds: a tiny model
on a CPU), so that rounding stays under 1e-5 of the total per layer and "exact" means exact."""


def _bound_scale(values: Sequence[float]) -> float:
    """Ticks per ms for the bounds of layer loads `values`: `BOUND_TICKS_PER_MS`, finer so that
    the total spans at least `MIN_BOUND_TICKS`, coarser so that it spans at most `MAX_BOUND_TICKS`."""
    total = max(sum(values), 1e-9)
    return min(max(float(BOUND_TICKS_PER_MS), MIN_BOUND_TICKS / total), MAX_BOUND_TICKS / total)


@dataclass(frozen=True)
class Bound:
    """The smallest possible per-microbatch load of the busiest device (ms) with its proof."""

    load_ms: float
    """Load of the best assignment found (its busiest device, exact sum of the layers' loads)."""
    lower_ms: float
    """Proven lower bound on that load (equal to `load_ms` up to rounding when optimal)."""
    assignment: tuple[int, ...]
    """Device of each layer in the best assignment found."""
    optimal: bool
    method: str = ""
    """What settled it: "lower bound" (a heuristic met a counting bound), "configuration LP" (the
    LP relaxation of bin packing proved the next smaller load infeasible), "search", or "cut short"."""


class _BudgetExhausted(Exception):
    pass


def layer_loads(costs: CostTable) -> list[float]:
    """Per-microbatch work of each layer on its device: F, then B and W apart or as one full
    backward, whichever is cheaper (a plan may run either)."""
    split = [b + w for b, w in zip(costs.backward_input, costs.weight)]
    return [f + min(full, apart) for f, full, apart in zip(costs.forward, costs.backward_full, split)]


def input_gradients(costs: CostTable) -> list[float]:
    """Each layer's part of a microbatch's backward chain: its input gradient, or its full backward
    where that is cheaper (a plan may run either; W runs beside the chain)."""
    return [min(b, full) for b, full in zip(costs.backward_input, costs.backward_full)]


def balance_bound(costs: CostTable, num_devices: int, *, node_budget: int = 200_000, lp_rounds: int = 400,
                  time_limit_s: float | None = None, seed: int = 0) -> Bound:
    """Exact min over assignments of whole layers to `num_devices` devices of the busiest device's
    per-microbatch load (multiway number partitioning, P||Cmax).

    1. upper bound: longest-processing-time first, then repeatedly re-split the busiest device with
       another one optimally (a subset-sum bitset over their layers);
    2. lower bounds: average load, largest layer, and pigeonhole (among the k*p+1 largest layers
       some device holds k+1);
    3. while they differ, decide whether the next smaller load C is possible: the configuration LP
       of bin packing (column generation, knapsack pricing; Farley's bound keeps every iterate
       valid) proves "more than p bins of size C are needed" in most cases; otherwise an exact
       search (bin completion when devices hold few layers, branch and bound over sorted device
       loads otherwise) finds a better assignment or proves there is none.
    Work is bounded by `node_budget` search nodes and `lp_rounds` LP rounds (deterministic); if
    they run out, the best assignment and the best proven lower bound are returned with
    optimal=False. `time_limit_s` is a wall-clock safety net with the same effect."""
    values = layer_loads(costs)
    num_layers = len(values)
    scale = _bound_scale(values)
    items = [int(round(v * scale)) for v in values]
    exact_ticks = all(abs(v * scale - t) < 1e-6 for v, t in zip(values, items))
    slack = 0.0
    if not exact_ticks:
        # a device's rounded load can exceed its real one by half a tick per layer it holds, and
        # no device of an assignment at most as loaded as LPT's holds more than `most` layers
        lpt_load, most, fitted = max(items) + sum(items) // num_devices, 0, 0
        for item in sorted(items):
            fitted += item
            if fitted > lpt_load:
                break
            most += 1
        slack = 0.5 * max(most, 1) / scale
    deadline = None if time_limit_s is None else time.perf_counter() + time_limit_s
    p = num_devices

    def result(assignment: Sequence[int], lower_ticks: int, optimal: bool, method: str) -> Bound:
        loads = [0.0] * p
        for layer, device in enumerate(assignment):
            loads[device] += values[layer]
        load = max(loads)
        lower = min(load, max(0.0, lower_ticks / scale - slack))
        return Bound(load, lower, tuple(assignment), optimal, method)

    if p >= num_layers:
        return result(range(num_layers), max(items), True, "lower bound")
    assignment = _partition_heuristic(items, p)
    upper = _max_load(items, assignment, p)
    lower = _counting_lower_bound(items, p)
    if upper <= lower:
        return result(assignment, upper, True, "lower bound")
    budget = [node_budget, lp_rounds]
    method = "search"  # unless the LP settles it: a packing found meets the lower bound
    try:
        while lower < upper:
            if deadline is not None and time.perf_counter() > deadline:
                raise _BudgetExhausted
            capacity = upper - 1
            if _configuration_lp_needs_more(items, capacity, p, budget, deadline):
                lower, method = upper, "configuration LP"
                break
            found = _pack(items, p, capacity, budget, deadline)
            if found is None:
                lower, method = upper, "search"
                break
            assignment, upper = found, _max_load(items, found, p)
    except _BudgetExhausted:
        # raise the lower bound as far as the LP proves it, with what budget is left
        budget[1] = max(budget[1], lp_rounds // 4)
        lower = _lp_lower_bound(items, p, lower, upper, budget, deadline)
        return result(assignment, lower, lower >= upper, "configuration LP" if lower >= upper else "cut short")
    return result(assignment, lower, True, method)


def _max_load(items: Sequence[int], assignment: Sequence[int], p: int) -> int:
    loads = [0] * p
    for item, device in zip(items, assignment):
        loads[device] += item
    return max(loads)


def _counting_lower_bound(items: Sequence[int], p: int) -> int:
    """max(ceil(total / p), largest item, pigeonhole: among the k*p+1 largest items some device
    holds k+1, so at least the k+1 smallest of them)."""
    ordered = sorted(items, reverse=True)
    best = max(ordered[0], -(-sum(ordered) // p))
    k = 1
    while k * p + 1 <= len(ordered):
        best = max(best, sum(ordered[k * p + 1 - (k + 1): k * p + 1]))
        k += 1
    return best


def _partition_heuristic(items: Sequence[int], p: int) -> list[int]:
    """LPT, then re-split the busiest device with the partner that lowers it most, optimally."""
    order = sorted(range(len(items)), key=lambda i: (-items[i], i))
    loads = [0] * p
    bins: list[list[int]] = [[] for _ in range(p)]
    for i in order:
        d = min(range(p), key=lambda d: (loads[d], d))
        bins[d].append(i)
        loads[d] += items[i]
    while True:
        top = max(range(p), key=lambda d: (loads[d], -d))
        best = None
        for other in sorted(range(p), key=lambda d: (-loads[d], d)):
            if other == top:
                continue
            members = bins[top] + bins[other]
            chosen, heavier = _best_two_way_split([items[i] for i in members])
            if heavier < loads[top] and (best is None or heavier < best[0]):
                best = (heavier, other, members, chosen)
        if best is None:
            break
        _, other, members, chosen = best
        picked = set(chosen)
        bins[top] = [i for k, i in enumerate(members) if k in picked]
        bins[other] = [i for k, i in enumerate(members) if k not in picked]
        loads[top] = sum(items[i] for i in bins[top])
        loads[other] = sum(items[i] for i in bins[other])
    assignment = [0] * len(items)
    for d, members in enumerate(bins):
        for i in members:
            assignment[i] = d
    return assignment


def _best_two_way_split(values: Sequence[int]) -> tuple[list[int], int]:
    """Indices of one side of the most even split of `values` and the heavier side's sum
    (subset sums as a Python-int bitset, one shift per value)."""
    total = sum(values)
    reach = 1
    history = [reach]
    for v in values:
        reach |= reach << v
        history.append(reach)
    half = total // 2
    lighter = (reach & ((1 << (half + 1)) - 1)).bit_length() - 1
    chosen, rest = [], lighter
    for i in range(len(values) - 1, -1, -1):
        if not (history[i] >> rest) & 1:
            chosen.append(i)
            rest -= values[i]
    return chosen, total - lighter


def _configuration_lp_needs_more(items: Sequence[int], capacity: int, p: int, budget: list[int],
                                 deadline: float | None) -> bool:
    """True when the configuration LP proves that more than p bins of `capacity` are needed."""
    return _configuration_lp(items, capacity, p, budget, deadline) > p + 1e-6


def _configuration_lp(items: Sequence[int], capacity: int, p: int, budget: list[int],
                      deadline: float | None) -> float:
    """A valid lower bound on the bins of size `capacity` the items need (the configuration LP
    by column generation; Farley's bound makes every round's value a valid bound, and it stops
    as soon as the bound exceeds p or the LP cannot exceed it)."""
    from ortools.linear_solver import pywraplp

    n = len(items)
    if max(items) > capacity:
        return math.inf
    solver = pywraplp.Solver.CreateSolver("GLOP")
    rows = [solver.Constraint(1, solver.infinity()) for _ in range(n)]
    objective = solver.Objective()
    objective.SetMinimization()

    def add_column(members: Sequence[int]) -> None:
        var = solver.NumVar(0, solver.infinity(), "")
        objective.SetCoefficient(var, 1)
        for i in members:
            rows[i].SetCoefficient(var, 1)

    for i in range(n):
        add_column([i])
    best = float(-(-sum(items) // capacity))
    while True:
        if budget[1] <= 0 or (deadline is not None and time.perf_counter() > deadline):
            return best
        budget[1] -= 1
        if solver.Solve() != pywraplp.Solver.OPTIMAL:
            return best
        primal = objective.Value()
        duals = [max(0.0, row.dual_value()) for row in rows]
        value, members = _knapsack(items, duals, capacity)
        best = max(best, sum(duals) / max(value, 1.0))
        if best > p + 1e-6 or primal <= p + 1e-9 or value <= 1 + 1e-9:
            return best
        add_column(members)


def _knapsack(sizes: Sequence[int], values: Sequence[float], capacity: int) -> tuple[float, list[int]]:
    """0/1 knapsack by dynamic programming over capacity (numpy): (best value, items)."""
    import numpy as np

    best = np.zeros(capacity + 1)
    taken = []
    for size, value in zip(sizes, values):
        if value <= 1e-12 or size > capacity:
            taken.append(None)
            continue
        candidate = np.full(capacity + 1, -1.0)
        candidate[size:] = best[: capacity + 1 - size] + value
        better = candidate > best + 1e-12
        taken.append(better)
        best = np.where(better, candidate, best)
    members, room = [], capacity
    for i in range(len(sizes) - 1, -1, -1):
        if taken[i] is not None and taken[i][room]:
            members.append(i)
            room -= sizes[i]
    return float(best[capacity]), members


def _lp_lower_bound(items: Sequence[int], p: int, lower: int, upper: int, budget: list[int],
                    deadline: float | None) -> int:
    """The smallest capacity in [lower, upper] the configuration LP does not rule out (binary
    search; every capacity it rules out is a proven lower bound + 1)."""
    low, high = lower, upper
    while low < high:
        if budget[1] <= 0 or (deadline is not None and time.perf_counter() > deadline):
            break
        middle = (low + high) // 2
        if _configuration_lp_needs_more(items, middle, p, budget, deadline):
            low = middle + 1
        else:
            high = middle
    return low


def _pack(items: Sequence[int], p: int, capacity: int, budget: list[int], deadline: float | None = None
          ) -> list[int] | None:
    """An assignment of items to p bins of `capacity`, or None when none exists (exact search;
    raises _BudgetExhausted when the node budget or the time runs out)."""
    if len(items) <= 4 * p:
        return _pack_bin_completion(items, p, capacity, budget, deadline)
    return _pack_loads(items, p, capacity, budget, deadline)


DEADLINE_EVERY = 64
"""The exact searches look at the clock every this many nodes (a bin-completion node can take a
millisecond: it enumerates the completions of a bin)."""


def _spend(budget: list[int], deadline: float | None) -> None:
    """One search node: raises _BudgetExhausted when the node budget, or the wall-clock
    `deadline` (a safety net, looked at every DEADLINE_EVERY nodes), runs out."""
    budget[0] -= 1
    if budget[0] < 0 or (deadline is not None and budget[0] % DEADLINE_EVERY == 0
                         and time.perf_counter() > deadline):
        raise _BudgetExhausted


def _running_sums(sizes: Sequence[int]) -> tuple[list[int], list[int]]:
    """Prefix sums of `sizes` (non-increasing), and sums of its k smallest items for k = 0..n."""
    prefix, smallest = [0], [0]
    for x in sizes:
        prefix.append(prefix[-1] + x)
    for x in reversed(sizes):
        smallest.append(smallest[-1] + x)
    return prefix, smallest


def _pack_loads(items: Sequence[int], p: int, capacity: int, budget: list[int], deadline: float | None = None
                ) -> list[int] | None:
    """Branch and bound: items largest first onto devices (one branch per distinct load),
    pruned by the room and the item count the remaining items need; failed (depth, sorted
    loads) states are remembered."""
    order = sorted(range(len(items)), key=lambda i: (-items[i], i))
    sizes = [items[i] for i in order]
    n = len(sizes)
    prefix, smallest = _running_sums(sizes)
    failed: set[tuple[int, tuple[int, ...]]] = set()
    placed = [0] * n

    def search(i: int, loads: list[int]) -> bool:
        if i == n:
            return True
        key = (i, tuple(sorted(loads)))
        if key in failed:
            return False
        _spend(budget, deadline)
        left, room, count = n - i, 0, 0
        for load in loads:
            free = capacity - load
            k = min(bisect.bisect_right(smallest, free) - 1, left)
            count += k
            room += min(free, prefix[i + k] - prefix[i])
        if room < prefix[n] - prefix[i] or count < left:
            failed.add(key)
            return False
        size = sizes[i]
        tried = set()
        for d in sorted(range(p), key=lambda d: (-loads[d], d)):  # fullest first
            if loads[d] in tried or loads[d] + size > capacity:
                continue
            tried.add(loads[d])
            loads[d] += size
            placed[i] = d
            if search(i + 1, loads):
                return True
            loads[d] -= size
        failed.add(key)
        return False

    if not search(0, [0] * p):
        return None
    assignment = [0] * n
    for position, i in enumerate(order):
        assignment[i] = placed[position]
    return assignment


def _pack_bin_completion(items: Sequence[int], p: int, capacity: int, budget: list[int], deadline: float | None = None
                         ) -> list[int] | None:
    """Bin completion (Korf): fill one bin at a time with the largest remaining item and an
    undominated completion of it, pruned by room, item counts and Martello-Toth's L2 bound;
    failed remaining sets are remembered."""
    failed: set[tuple[tuple[int, ...], int]] = set()
    bins: list[tuple[int, ...]] = []

    def search(remaining: tuple[int, ...], k: int) -> bool:
        if not remaining:
            return True
        sizes = [items[i] for i in remaining]
        total = sum(sizes)
        if k == 0 or total > k * capacity:
            return False
        if k == 1:
            bins.append(remaining)
            return True
        key = (tuple(sizes), k)
        if key in failed:
            return False
        _spend(budget, deadline)
        fit, count = 0, 0
        for size in reversed(sizes):
            if fit + size > capacity:
                break
            fit += size
            count += 1
        if count * k < len(sizes) or _l2_bound(sizes, capacity) > k:
            failed.add(key)
            return False
        first, rest = remaining[0], remaining[1:]
        for chosen in _completions([items[i] for i in rest], capacity - items[first], budget, deadline):
            picked = set(chosen)
            bins.append((first, *(rest[j] for j in chosen)))
            if search(tuple(i for j, i in enumerate(rest) if j not in picked), k - 1):
                return True
            bins.pop()
        failed.add(key)
        return False

    start = tuple(sorted(range(len(items)), key=lambda i: (-items[i], i)))
    if not search(start, p):
        return None
    assignment = [0] * len(items)
    for d, members in enumerate(bins):
        for i in members:
            assignment[i] = d
    return assignment


def _completions(rest: Sequence[int], room: int, budget: list[int], deadline: float | None) -> list[tuple[int, ...]]:
    """Undominated sets of positions of `rest` (sizes, non-increasing) that fit `room`, fullest
    first. A set is dominated when an item left out fits in its place together with the room
    left (maximality), or could replace a subset of it no larger than itself. Each set looked at
    is a node of the search's budget (many small items can fit a room in exponentially many
    ways)."""
    n = len(rest)
    found: list[tuple[int, ...]] = []
    chosen: list[int] = []

    def undominated(room_left: int) -> bool:
        picked = set(chosen)
        excluded = [rest[j] for j in range(n) if j not in picked]
        if excluded and excluded[-1] <= room_left:
            return False
        values = [rest[j] for j in chosen]
        if not excluded or not values:
            return True
        top = excluded[0]
        for size in range(1, len(values) + 1):
            for subset in itertools.combinations(values, size):
                total = sum(subset)
                if total > top:
                    continue
                for y in excluded:
                    if y < total:
                        break
                    if y <= room_left + total and (y > total or size > 1):
                        return False
        return True

    def grow(start: int, room_left: int) -> None:
        _spend(budget, deadline)
        previous = None
        for j in range(start, n):
            size = rest[j]
            if size > room_left or size == previous:
                continue
            previous = size
            chosen.append(j)
            grow(j + 1, room_left - size)
            chosen.pop()
        if undominated(room_left):
            found.append(tuple(chosen))

    grow(0, room)
    found.sort(key=lambda c: -sum(rest[j] for j in c))
    return found


def _l2_bound(sizes: Sequence[int], capacity: int) -> int:
    """Martello and Toth's L2 lower bound on the number of bins (sizes non-increasing)."""
    best = -(-sum(sizes) // capacity)
    half = capacity / 2
    for k in sorted({0, *(x for x in sizes if x <= half)}):
        big = mid = 0
        mid_sum = small_sum = 0
        for x in sizes:
            if x > capacity - k:
                big += 1
            elif x > half:
                mid += 1
                mid_sum += x
            elif x >= k:
                small_sum += x
        best = max(best, big + mid + max(0, -(-(small_sum - (mid * capacity - mid_sum)) // capacity)))
    return best


def balanced_structure(
    costs: CostTable,
    num_devices: int,
    num_stages: int,
    placement: Sequence[int] | None = None,
    *,
    num_microbatches: int | None = None,
    work: float = 0.5,
    time_limit_s: float | None = None,
    seed: int = 0,
    hint: Sequence[int] | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(boundaries, placement) minimising the busiest device's load with `num_stages` contiguous
    stages. With `placement` given only the boundaries are free; with None the placement is free
    too (consecutive stages on different devices). With `num_microbatches` the objective is the
    estimated iteration time max over devices of (release + microbatches x load), where a
    device's release is the forward time of all layers before its first layer: no device can
    start before microbatch 0 reaches it, so late-starting devices should carry less. Ties are
    broken towards light first stages (they hold the most microbatches in flight). None when
    there are fewer layers than stages. Deterministic: `work` deterministic seconds of one CP-SAT
    worker (the best structure found within them, not necessarily optimal); `hint` (boundaries)
    gives it a start."""
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
    if hint is not None and len(hint) == num_stages + 1:
        for s in range(1, num_stages):
            model.AddHint(bounds[s], int(hint[s]))
    model.Minimize(makespan * (num_layers + 1) + bounds[1] if num_stages > 1 else makespan)
    solver = _solver(work, seed, time_limit_s)
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    boundaries = tuple(int(solver.Value(b)) for b in bounds)
    if placement is None:
        chosen = tuple(next(d for d in range(num_devices) if solver.Value(x[s][d])) for s in range(num_stages))
    else:
        chosen = tuple(placement)
    return boundaries, chosen


WHOLE_ORDER_OPS = 160
"""`refine_order` models the whole op order of a plan with at most this many ops as one CP-SAT
model (whose bound then holds for every order that splits the backwards as the plan does:
`Refinement.lower_bound_ms`); larger plans in windows."""


@dataclass
class Refinement:
    plan: PipelinePlan
    iteration_ms: float
    lower_bound_ms: float | None
    """Proven bound on the iteration time of every order of this structure that splits each
    backward into B and W as the plan does (whole-order model only; None when only windows were
    solved). It holds for every order, fused backwards included, where `bound_covers_every_order`."""
    windows: int
    improved_windows: int
    full_model: bool
    seconds: float
    cut_short: bool = False
    bound_covers_every_order: bool = False
    """Whether `lower_bound_ms` holds for every order of the structure: the plan splits every
    backward and no stage's full backward costs less than its B and W together, so a fused
    backward can always be replaced by its B and W at no cost in time or memory."""


def refine_order(
    plan: PipelinePlan,
    costs: CostTable,
    cluster: ClusterSpec,
    *,
    work: float = 2.0,
    time_limit_s: float | None = None,
    activation_budget: Sequence[float] | None = None,
    memory: MemoryModel = MemoryModel(),
    max_window_ops: int = WHOLE_ORDER_OPS,
    max_windows: int = 6,
    seed: int = 0,
) -> Refinement:
    """Improve the op order of `plan` (structure fixed) with CP-SAT, hinted with the plan itself.

    The model: an interval per op (durations rounded up to ticks), precedences with transfer
    delays, no-overlap per device, activation memory as a reservoir per device (the simulator's
    levels in bytes rounded to integers, one byte per op of slack; every candidate is re-simulated
    against the exact budget), objective = iteration time.
    The hint is the plan's own schedule, re-timed in the model's integer ticks so it is feasible.
    When the plan has at most `max_window_ops` ops the whole order is one model (and its bound
    holds for every order that splits the backwards as the plan does, and for every order of the
    structure where `bound_covers_every_order`); otherwise each of up to `max_windows` models frees
    a window of ops (a time slice of the current best around its largest idle gap; later windows
    move on) while every other op keeps its place in its device's order. Each candidate is
    re-simulated by the simulator (which also queues transfers on busy links) and kept only when
    strictly faster and within the budget, so the result is never worse than `plan`.

    Deterministic: every model gets `work / windows` deterministic seconds of one worker;
    `time_limit_s` is a wall-clock safety net (then `cut_short`)."""
    started = time.perf_counter()
    deadline = None if time_limit_s is None else started + time_limit_s
    best_plan = plan
    best_sim = simulate(plan, costs, cluster, memory=memory)
    best_time = best_sim.iteration_ms
    full = plan.num_ops() <= max_window_ops
    rounds = 1 if full else max_windows
    windows = improved = 0
    last_bound: float | None = None
    cut_short = False
    tried: set[tuple[float, float]] = set()
    for round_index in range(rounds):
        left = None if deadline is None else deadline - time.perf_counter()
        if left is not None and left <= 0.05:
            cut_short = True
            break
        window = None if full else _pick_window(best_sim, max_window_ops, round_index, tried)
        if window is not None and not window:
            break
        solve = _solve_order if full else _solve_window
        result = solve(best_plan, costs, cluster, window, work / rounds, left, activation_budget, memory,
                       seed + round_index)
        windows += 1
        if result is None:
            continue
        candidate, bound, wall_hit = result
        cut_short = cut_short or wall_hit
        if full:
            last_bound = bound
        sim = simulate(candidate, costs, cluster, memory=memory, validated=True)
        fits = activation_budget is None or all(
            a <= b * (1 + 1e-9) for a, b in zip(sim.peak_activation_bytes, activation_budget))
        if fits and sim.iteration_ms < best_time - 1e-9:
            best_plan, best_sim, best_time = candidate, sim, sim.iteration_ms
            improved += 1
    return Refinement(best_plan, best_time, last_bound, windows, improved, full, time.perf_counter() - started,
                      cut_short, last_bound is not None and _split_dominates(plan, costs))


def _split_dominates(plan: PipelinePlan, costs: CostTable) -> bool:
    """Whether the orders that split every backward as `plan` does include a best order of its
    structure: every backward is split, and each stage's full backward costs at least its B and
    W together (then a fused backward is never faster, and frees its memory no earlier)."""
    from octopipe.simulator import stage_costs

    if len(plan.split_backward()) < plan.num_stages * plan.num_microbatches:
        return False
    sc = stage_costs(plan, costs)
    return all(sc.backward_full[s] >= sc.backward_input[s] + sc.weight[s] - 1e-9 for s in range(plan.num_stages))


def _solved_rank(op: Op, begin: int, duration: int, num_stages: int) -> tuple[int, int, int, int, int]:
    """Where `op` goes in its device's order from a model's solution: by start, then by end (a
    zero-length op goes before another that starts at its time: the other cannot be what it
    waits for, and it may free memory the other takes), then along its microbatch's chain."""
    return (begin, begin + duration, *_chain_rank(op, num_stages))


def _chain_rank(op: Op, num_stages: int) -> tuple[int, int, int]:
    """Where `op` falls in its microbatch's chain: F up the stages, then B down them, each W right
    after its B. Ops a model solution starts at the same tick are ordered by it, so an op of zero
    length never lands before one it waits for (a stage's B before the next stage's on one device
    would deadlock the plan)."""
    if op.kind is OpKind.F:
        return op.stage, 0, op.microbatch
    return 2 * num_stages - 1 - op.stage, 1 if op.kind is OpKind.B else 2, op.microbatch


def _pick_window(sim: SimResult, max_ops: int, round_index: int, tried: set[tuple[float, float]]) -> set[Op]:
    """The ops starting in a time slice of `sim` around its largest idle gap not tried yet: the
    gap's end is put at a third of the slice (ops before a gap are what fill it)."""
    plan = sim.plan
    timeline = sorted((sim.op_start[op], str(op), op) for ops in plan.device_ops for op in ops)
    gaps = []
    for ops in plan.device_ops:
        for earlier, later in zip(ops, ops[1:]):
            gap = sim.op_start[later] - sim.op_end[earlier]
            if gap > 1e-6:
                gaps.append((-gap, sim.op_start[later]))
    gaps.sort()
    for _, gap_end in gaps:
        index = bisect.bisect_left([t for t, _, _ in timeline], gap_end)
        low = max(0, min(len(timeline) - max_ops, index - (2 * max_ops) // 3))
        span = (timeline[low][0], timeline[min(len(timeline), low + max_ops) - 1][0])
        if span in tried:
            continue
        tried.add(span)
        return {op for _, _, op in timeline[low: low + max_ops]}
    return set()


def _op_ticks(plan: PipelinePlan, costs: CostTable) -> dict[Op, int]:
    from octopipe.simulator import stage_costs

    sc = stage_costs(plan, costs)
    split = plan.split_backward()
    ticks = {}
    for ops in plan.device_ops:
        for op in ops:
            if op.kind is OpKind.F:
                value = sc.forward[op.stage]
            elif op.kind is OpKind.B:
                value = sc.backward_input[op.stage] if (op.stage, op.microbatch) in split else sc.backward_full[op.stage]
            else:
                value = sc.weight[op.stage]
            ticks[op] = _ceil_ticks(value)
    return ticks


def _memory_events(op: Op, sc: StageCosts, split: frozenset[tuple[int, int]], stash: Sequence[float],
                   hand_offs: tuple[list[float], list[float], list[float]]) -> list[tuple[bool, int]]:
    """(at the op's start?, bytes allocated; negative = freed) of one op, as the simulator counts
    them (`hand_offs`: `simulator.sent_outputs`): F takes what its stage holds until B, and
    what it sends on until its end (the simulator's peak at F's end; nothing else runs on the
    device in between), or, for the next stage on its device, until that stage's F; a
    recomputing stage's B takes the rest at its start, and what its W reads beyond its
    activations; B frees its activations at its end but for what it leaves for its W (`stash`,
    bytes per stage; nothing without a W), and W frees that, so every microbatch gives back
    exactly what it took. Integers: the reservoir's units."""
    stage = op.stage
    amount = int(round(sc.activation[stage]))
    held = int(round(sc.held[stage]))
    if op.kind is OpKind.F:
        sent, took, left = hand_offs
        taken, kept, sending = int(round(took[stage])), int(round(left[stage])), int(round(sent[stage]))
        return [(True, held + sending - taken)] + ([(False, kept - sending)] if sending or kept else [])
    left = int(round(stash[stage])) if (stage, op.microbatch) in split else 0
    if op.kind is OpKind.B:
        # what W reads beyond the activations (output gradients) from B's start: the simulator's
        # peak at B's end, before a W of no length at that same instant frees it
        grows = max(0, left - amount)
        taken = amount - held + grows
        return ([(True, taken)] if taken else []) + [(False, left - amount - grows)]
    return [(False, -left)]


def _ceil_ticks(ms: float) -> int:
    return int(math.ceil(ms * TICKS_PER_MS - 1e-6))


def _dependencies(plan: PipelinePlan, costs: CostTable, cluster: ClusterSpec) -> dict[Op, list[tuple[Op, int]]]:
    """Each op's data predecessors with the transfer delay (ticks, rounded up) between them."""
    from octopipe.simulator import stage_costs

    sc = stage_costs(plan, costs)
    placement = plan.placement

    def delay(src: int, dst: int) -> int:
        return _ceil_ticks(cluster.transfer_ms(sc.output[min(src, dst)], placement[src], placement[dst]))

    deps: dict[Op, list[tuple[Op, int]]] = {}
    for op in (op for ops in plan.device_ops for op in ops):  # plan order: the models are built the same every run
        s, mb = op.stage, op.microbatch
        if op.kind is OpKind.F:
            deps[op] = [(Op(s - 1, OpKind.F, mb), delay(s - 1, s))] if s > 0 else []
        elif op.kind is OpKind.B:
            deps[op] = [(Op(s, OpKind.F, mb), 0)]
            if s + 1 < plan.num_stages:
                deps[op].append((Op(s + 1, OpKind.B, mb), delay(s + 1, s)))
        else:
            deps[op] = [(Op(s, OpKind.B, mb), 0)]
    return deps


def _integer_schedule(plan: PipelinePlan, durations: dict[Op, int], deps: dict[Op, list[tuple[Op, int]]]) -> dict[Op, int]:
    """Earliest start of every op (ticks) running each device's ops in plan order."""
    begin: dict[Op, int] = {}
    finish: dict[Op, int] = {}
    pointer = [0] * plan.num_devices
    clock = [0] * plan.num_devices
    pending = True
    while pending:
        pending = progressed = False
        for device, ops in enumerate(plan.device_ops):
            while pointer[device] < len(ops):
                op = ops[pointer[device]]
                ready = clock[device]
                for dep, lag in deps[op]:
                    if dep not in finish:
                        break
                    ready = max(ready, finish[dep] + lag)
                else:
                    begin[op], finish[op] = ready, ready + durations[op]
                    clock[device] = finish[op]
                    pointer[device] += 1
                    progressed = True
                    continue
                break
            pending = pending or pointer[device] < len(ops)
        if pending and not progressed:
            raise PlanError("refine_order: the hint plan deadlocks")
    return begin


def _solve_window(plan: PipelinePlan, costs: CostTable, cluster: ClusterSpec, window: set[Op], work: float,
                  time_limit_s: float | None, activation_budget: Sequence[float] | None, memory: MemoryModel,
                  seed: int) -> tuple[PipelinePlan, float, bool] | None:
    """Reorder only the ops of `window` (on each device a contiguous run of its order): the ops
    before it stay where the plan's schedule has them (constants), the ops after it follow in
    their old order and are re-timed by the simulator afterwards. Objective: the window's last
    end, then the sum of its ends (an earlier window lets everything after it start earlier)."""
    from octopipe.simulator import stage_costs

    sc = stage_costs(plan, costs)
    split = plan.split_backward()
    durations = _op_ticks(plan, costs)
    deps = _dependencies(plan, costs, cluster)
    hint = _integer_schedule(plan, durations, deps)
    hint_end = {op: hint[op] + durations[op] for op in hint}
    horizon = max(hint_end.values())
    stash = sc.weight_stash(memory.weight_memory_fraction)
    hand_offs = sent_outputs(sc, plan.placement)
    model = cp_model.CpModel()
    start: dict[Op, cp_model.IntVar] = {}
    end: dict[Op, cp_model.LinearExpr] = {}
    pieces: list[tuple[list[Op], list[Op], list[Op]]] = []
    for device, ops in enumerate(plan.device_ops):
        inside = [i for i, op in enumerate(ops) if op in window]
        if not inside:
            pieces.append((list(ops), [], []))
            continue
        first, last = inside[0], inside[-1]
        before, middle, after = list(ops[:first]), list(ops[first:last + 1]), list(ops[last + 1:])
        pieces.append((before, middle, after))
        free_at = hint_end[before[-1]] if before else 0
        intervals = []
        for op in middle:
            begin = model.NewIntVar(free_at, horizon, f"s{op}")
            start[op], end[op] = begin, begin + durations[op]
            intervals.append(model.NewFixedSizeIntervalVar(begin, durations[op], f"i{op}"))
            model.AddHint(begin, hint[op])
        model.AddNoOverlap(intervals)
        if activation_budget is not None and math.isfinite(activation_budget[device]) and any(sc.activation):
            level, times, changes = 0, [], []
            for op in before + middle:
                for at_start, change in _memory_events(op, sc, split, stash, hand_offs):
                    if op in start:
                        times.append(start[op] if at_start else end[op])
                        changes.append(change)
                    else:
                        level += change
            if level:
                times.append(free_at)
                changes.append(level)
            model.AddReservoirConstraint(times, changes, 0, max(int(activation_budget[device]), level) + len(middle))
    for op in start:
        for dep, lag in deps[op]:
            if dep in start:
                model.Add(start[op] >= end[dep] + lag)
            else:
                model.Add(start[op] >= hint_end[dep] + lag)
    last = model.NewIntVar(0, horizon, "last")
    for op in start:
        model.Add(last >= end[op])
    # lexicographic: one tick of the last end outweighs every way the ends' sum can move (a weight
    # of len(start) + 1 let a schedule trade a later last end for earlier ends elsewhere: 45 ms
    # where the best order takes 44); without room in 64 bits, the last end alone
    weight = len(start) * horizon + 1
    if weight * horizon < 2**61:
        model.Minimize(last * weight + sum(end.values()))
    else:
        model.Minimize(last)
    solver = _solver(work, seed, time_limit_s)
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    device_ops = []
    for before, middle, after in pieces:
        middle = sorted(middle, key=lambda op: _solved_rank(op, solver.Value(start[op]), durations[op], plan.num_stages))
        device_ops.append(tuple(before + middle + after))
    return plan.with_ops(device_ops), 0.0, _hit_wall(solver, time_limit_s)


def _solve_order(plan: PipelinePlan, costs: CostTable, cluster: ClusterSpec, window: set[Op] | None, work: float,
                 time_limit_s: float | None, activation_budget: Sequence[float] | None, memory: MemoryModel,
                 seed: int) -> tuple[PipelinePlan, float, bool] | None:
    from octopipe.simulator import stage_costs

    sc = stage_costs(plan, costs)
    split = plan.split_backward()
    stash = sc.weight_stash(memory.weight_memory_fraction)
    hand_offs = sent_outputs(sc, plan.placement)
    durations = _op_ticks(plan, costs)
    deps = _dependencies(plan, costs, cluster)
    hint = _integer_schedule(plan, durations, deps)
    horizon = max(hint[op] + durations[op] for op in hint)
    model = cp_model.CpModel()
    start: dict[Op, cp_model.IntVar] = {}
    end: dict[Op, cp_model.LinearExpr] = {}
    for ops in plan.device_ops:
        intervals = []
        for op in ops:
            begin = model.NewIntVar(0, horizon - durations[op], f"s{op}")
            start[op] = begin
            end[op] = begin + durations[op]
            intervals.append(model.NewFixedSizeIntervalVar(begin, durations[op], f"i{op}"))
            model.AddHint(begin, hint[op])
        model.AddNoOverlap(intervals)
    for op, preds in deps.items():
        for dep, lag in preds:
            model.Add(start[op] >= end[dep] + lag)
    for device, ops in enumerate(plan.device_ops):
        if window is not None:
            # outside the window every op keeps its place: a chain through the device's order
            # in which each window op sits between the fixed ops around it
            fixed = [op for op in ops if op not in window]
            for earlier, later in zip(fixed, fixed[1:]):
                model.Add(start[later] >= end[earlier])
            previous_fixed = None
            pending: list[Op] = []
            for op in ops:
                if op in window:
                    if previous_fixed is not None:
                        model.Add(start[op] >= end[previous_fixed])
                    pending.append(op)
                else:
                    for free in pending:
                        model.Add(start[op] >= end[free])
                    pending = []
                    previous_fixed = op
        if activation_budget is not None and math.isfinite(activation_budget[device]) and any(sc.activation):
            times, changes = [], []
            for op in ops:
                for at_start, change in _memory_events(op, sc, split, stash, hand_offs):
                    times.append(start[op] if at_start else end[op])
                    changes.append(change)
            model.AddReservoirConstraint(times, changes, 0, int(activation_budget[device]) + len(ops))
    makespan = model.NewIntVar(0, horizon, "makespan")
    for op in start:
        model.Add(makespan >= end[op])
    model.AddHint(makespan, horizon)
    model.Minimize(makespan)
    solver = _solver(work, seed, time_limit_s)
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    device_ops = [tuple(sorted(ops, key=lambda op: _solved_rank(op, solver.Value(start[op]), durations[op],
                                                                plan.num_stages)))
                  for ops in plan.device_ops]
    # durations and delays were rounded up to ticks: give back one tick per op and per hand-off so
    # the bound holds for the exact times
    slack = 2 * len(start)
    bound = max(0.0, (solver.BestObjectiveBound() - slack) / TICKS_PER_MS)
    return plan.with_ops(device_ops), bound, _hit_wall(solver, time_limit_s)


# -- the joint model: partition, placement and order as variables (small instances) ----------------

@dataclass
class JointSolution:
    plan: PipelinePlan
    objective_ms: float
    """The model's iteration time for `plan` (its simulated time when no link is contended)."""
    lower_bound_ms: float
    """Proven lower bound over every plan the model covers (all partitions into at most
    `max_stages` stages, every placement, every order)."""
    optimal: bool
    cut_short: bool
    """The wall-clock limit stopped the search before its deterministic work budget."""


def solve_joint(
    costs: CostTable,
    cluster: ClusterSpec,
    num_microbatches: int,
    *,
    num_devices: int | None = None,
    max_stages: int | None = None,
    split_backward: bool = True,
    activation_budget: Sequence[float] | None = None,
    memory_limit_bytes: float | None = None,
    memory: MemoryModel = MemoryModel(),
    hint: PipelinePlan | None = None,
    work: float = 30.0,
    time_limit_s: float | None = None,
    seed: int = 0,
) -> JointSolution | None:
    """Optimal plan over partition boundaries, placement and op order at once, by CP-SAT.

    Variables: each layer's stage (non-decreasing, steps of one: contiguous stages; a stage
    count up to `max_stages`, default min(layers, 2 x devices)), each stage's device, and start
    times of every op. Stage durations, activation and parameter bytes are sums over the
    stage's layers (linear in the layer -> stage literals); a hand-off costs the transfer time of
    the stage's last layer's output between the two stages' devices (an element constraint over
    (device pair, layer)), nothing on one device. Ops are optional intervals on each device
    (present when their stage is there) under no-overlap; activation memory is a cumulative per
    device: a microbatch holds its stage's activations from F's start to B's end, and what its B
    leaves for its W (`CostTable.weight_stash_with(memory.weight_memory_fraction)`) to W's end,
    or all of them to B's end without split backward; the parameter, gradient and optimizer bytes
    of its stages come off the memory limit. What an F sends on, which the simulator holds until
    sent, is not counted here, nor the inputs a stage's first layer does not save
    (`LayerCost.unsaved_input_bytes`), which the simulator holds from F to B: with outputs or
    unsaved inputs of bytes, simulate a solution against the limit.
    With `split_backward` every (stage, microbatch) has a W op (W right after B costs the same
    time as a full backward and holds no more memory), else none has.

    The model ignores link contention (the simulator lets one transfer use a directed link at a
    time), so it is exact when transfers do not queue and a lower bound otherwise. For small
    instances only: the model has (layers x stages) literals and 3 x stages x microbatches x
    devices optional intervals. Deterministic: one worker and a `work` budget in CP-SAT's
    deterministic seconds; `time_limit_s` is a wall-clock safety net (then `cut_short`).
    Returns None when the limits leave no feasible plan or the search found none."""
    p = num_devices or cluster.num_devices
    m = num_microbatches
    num_layers = len(costs)
    max_stages = min(num_layers, max_stages or 2 * p)
    S = max_stages
    stash = costs.weight_stash_with(memory.weight_memory_fraction) if split_backward else (0.0,) * num_layers
    forward = [_ticks(x) for x in costs.forward]
    backward = [_ticks(x) for x in (costs.backward_input if split_backward else costs.backward_full)]
    weight = [_ticks(x) for x in costs.weight] if split_backward else [0] * num_layers
    model = cp_model.CpModel()

    # partition: stage[j] of each layer, x[j][s] <=> stage[j] == s
    x = [[model.NewBoolVar(f"x{j}_{s}") for s in range(S)] for j in range(num_layers)]
    stage_of = []
    for j in range(num_layers):
        model.AddExactlyOne(x[j])
        value = model.NewIntVar(0, S - 1, f"stage{j}")
        model.Add(value == sum(s * x[j][s] for s in range(S)))
        stage_of.append(value)
    model.Add(stage_of[0] == 0)
    for j in range(num_layers - 1):
        step = stage_of[j + 1] - stage_of[j]
        model.AddLinearConstraint(step, 0, 1)
    used = [model.NewBoolVar(f"used{s}") for s in range(S)]
    for s in range(S):
        model.Add(stage_of[num_layers - 1] >= s).OnlyEnforceIf(used[s])
        model.Add(stage_of[num_layers - 1] < s).OnlyEnforceIf(used[s].Not())

    def stage_sum(values: Sequence[int], s: int) -> cp_model.LinearExpr:
        return sum(v * x[j][s] for j, v in enumerate(values) if v)

    # the last layer of each stage: last[j][s] = x[j][s] and not x[j+1][s]
    last_layer = []
    for s in range(S):
        lasts = []
        for j in range(num_layers):
            if j + 1 < num_layers:
                flag = model.NewBoolVar(f"last{j}_{s}")
                model.AddBoolAnd([x[j][s], x[j + 1][s].Not()]).OnlyEnforceIf(flag)
                model.AddBoolOr([x[j][s].Not(), x[j + 1][s]]).OnlyEnforceIf(flag.Not())
                lasts.append(flag)
            else:
                lasts.append(x[j][s])
        index = model.NewIntVar(0, num_layers - 1, f"lastlayer{s}")
        model.Add(index == sum(j * flag for j, flag in enumerate(lasts)))
        last_layer.append(index)

    # placement
    device = [model.NewIntVar(0, p - 1, f"dev{s}") for s in range(S)]
    on = [[model.NewBoolVar(f"on{s}_{d}") for d in range(p)] for s in range(S)]
    for s in range(S):
        for d in range(p):
            model.Add(device[s] == d).OnlyEnforceIf(on[s][d])
            model.AddImplication(on[s][d], used[s])
        model.Add(sum(on[s]) == 1).OnlyEnforceIf(used[s])
        model.Add(sum(on[s]) == 0).OnlyEnforceIf(used[s].Not())
        model.Add(device[s] == 0).OnlyEnforceIf(used[s].Not())
    if p <= cluster.devices_per_node:  # identical devices, identical links: number devices by first use
        model.Add(device[0] == 0)
        highest = device[0]
        for s in range(1, S):
            model.Add(device[s] <= highest + 1)
            new_highest = model.NewIntVar(0, p - 1, f"highest{s}")
            model.AddMaxEquality(new_highest, [highest, device[s]])
            highest = new_highest

    # transfer delay from stage s to s+1: table over (src device, dst device, last layer of s)
    table = []
    for a in range(p):
        for b in range(p):
            table += [_ticks(cluster.transfer_ms(costs.output[j], a, b)) for j in range(num_layers)]
    delay = []
    for s in range(S - 1):
        index = model.NewIntVar(0, len(table) - 1, f"pair{s}")
        model.Add(index == (device[s] * p + device[s + 1]) * num_layers + last_layer[s])
        value = model.NewIntVar(0, max(table), f"delay{s}")
        model.AddElement(index, table, value)
        delay.append(value)

    # ops
    horizon = (sum(forward) + sum(backward) + sum(weight)) * m + max(table) * 2 * S * m + 1
    kinds = ("F", "B", "W") if split_backward else ("F", "B")
    durations = {"F": forward, "B": backward, "W": weight}
    size = {kind: [model.NewIntVar(0, sum(durations[kind]), f"{kind}size{s}") for s in range(S)] for kind in kinds}
    for kind in kinds:
        for s in range(S):
            model.Add(size[kind][s] == stage_sum(durations[kind], s))
    start: dict[tuple[str, int, int], cp_model.IntVar] = {}
    end: dict[tuple[str, int, int], cp_model.IntVar] = {}
    device_intervals: list[list[cp_model.IntervalVar]] = [[] for _ in range(p)]
    makespan = model.NewIntVar(0, horizon, "makespan")
    for s in range(S):
        for mb in range(m):
            for kind in kinds:
                begin = model.NewIntVar(0, horizon, f"s{s}{kind}{mb}")
                finish = model.NewIntVar(0, horizon, f"e{s}{kind}{mb}")
                model.Add(finish == begin + size[kind][s])
                model.Add(begin == 0).OnlyEnforceIf(used[s].Not())
                model.Add(makespan >= finish)
                start[kind, s, mb], end[kind, s, mb] = begin, finish
                for d in range(p):
                    device_intervals[d].append(
                        model.NewOptionalIntervalVar(begin, size[kind][s], finish, on[s][d], f"i{s}{kind}{mb}_{d}"))
    for s in range(S):
        for mb in range(m):
            model.Add(start["B", s, mb] >= end["F", s, mb])
            if split_backward:
                model.Add(start["W", s, mb] >= end["B", s, mb])
            if s + 1 < S:
                model.Add(start["F", s + 1, mb] >= end["F", s, mb] + delay[s]).OnlyEnforceIf(used[s + 1])
                model.Add(start["B", s, mb] >= end["B", s + 1, mb] + delay[s]).OnlyEnforceIf(used[s + 1])
    for d in range(p):
        model.AddNoOverlap(device_intervals[d])

    # memory: activations as a cumulative per device, bytes in units of 1/1000 of the largest layer's
    activation = costs.activation
    if (activation_budget is not None or memory_limit_bytes is not None) and any(activation):
        unit = max(activation) / 1000.0
        act_units = [int(math.ceil(a / unit - 1e-9)) for a in activation]
        stash_units = [int(math.ceil(w / unit - 1e-9)) for w in stash]
        # a layer's bytes from F to W: what it leaves for W, up to its activations; from F to B the
        # rest of its activations; from B to W what W reads beyond them (output gradients)
        kept_units = [min(a, w) for a, w in zip(act_units, stash_units)]
        freed_units = [a - k for a, k in zip(act_units, kept_units)]
        extra_units = [w - k for w, k in zip(stash_units, kept_units)]
        static = [costs.params[j] * memory.state_bytes_per_param_byte for j in range(num_layers)]
        held_b, held_w, held_bw = [], [], []
        for s in range(S):
            held_b.append(model.NewIntVar(0, sum(freed_units), f"heldb{s}"))
            model.Add(held_b[s] == stage_sum(freed_units, s))
            held_w.append(model.NewIntVar(0, sum(kept_units), f"heldw{s}"))
            model.Add(held_w[s] == stage_sum(kept_units, s))
            held_bw.append(model.NewIntVar(0, sum(extra_units), f"heldbw{s}"))
            model.Add(held_bw[s] == stage_sum(extra_units, s))
        for d in range(p):
            intervals, demands = [], []
            for s in range(S):
                for mb in range(m):
                    spans = [("F", "B", held_b[s])]
                    if split_backward:
                        spans.append(("F", "W", held_w[s]))
                        if any(extra_units):  # (a W of no length, its span empty, lets that go
                            spans.append(("B", "W", held_bw[s]))  # uncounted: W's of a stage take time)
                    for since, release, held in spans:
                        opened = start["F", s, mb] if since == "F" else end["B", s, mb]
                        length = model.NewIntVar(0, horizon, f"live{s}{since}{release}{mb}_{d}")
                        model.Add(length == end[release, s, mb] - opened)
                        intervals.append(model.NewOptionalIntervalVar(
                            opened, length, end[release, s, mb], on[s][d], f"m{s}{since}{release}{mb}_{d}"))
                        demands.append(held)
            limits = []
            if activation_budget is not None:
                limits.append(int(math.floor(activation_budget[d] / unit + 1e-9)))
            if memory_limit_bytes is not None:
                static_units = [int(math.ceil(v / unit - 1e-9)) for v in static]
                room = model.NewIntVar(-sum(static_units), int(memory_limit_bytes / unit), f"room{d}")
                model.Add(room == int(math.floor(memory_limit_bytes / unit + 1e-9))
                          - sum(static_units[j] * _layer_on(model, x, on, j, d, S) for j in range(num_layers)
                                if static_units[j]))
                limits.append(room)
            for limit in limits:
                if isinstance(limit, int):
                    model.AddCumulative(intervals, demands, max(limit, 0))
                else:
                    model.Add(limit >= 0)
                    model.AddCumulative(intervals, demands, limit)

    if hint is not None:
        _hint_joint(model, hint, costs, x, device, start, split_backward, cluster)
    model.Minimize(makespan)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.catch_sigint_signal = False  # (Ctrl-C stays Python's: it left SIGINT at the OS default)
    solver.parameters.max_deterministic_time = work
    solver.parameters.random_seed = seed
    if time_limit_s is not None:
        solver.parameters.max_time_in_seconds = time_limit_s
    status = solver.Solve(model)
    cut_short = time_limit_s is not None and solver.wall_time >= time_limit_s * 0.999 and status != cp_model.OPTIMAL
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    stages_used = solver.Value(stage_of[num_layers - 1]) + 1
    bounds = [0]
    for j in range(1, num_layers):
        if solver.Value(stage_of[j]) != solver.Value(stage_of[j - 1]):
            bounds.append(j)
    bounds.append(num_layers)
    placement = [solver.Value(device[s]) for s in range(stages_used)]
    rank = {"F": 0, "B": 1, "W": 2}
    device_ops: list[list[tuple[tuple, Op]]] = [[] for _ in range(p)]
    for (kind, s, mb), begin in start.items():
        if s >= stages_used:
            continue
        order = s if kind == "F" else -s
        key = (solver.Value(begin), solver.Value(end[kind, s, mb]), rank[kind], order, mb)
        device_ops[placement[s]].append((key, Op(s, OpKind(kind), mb)))
    plan = PipelinePlan.build(m, bounds, placement, [[op for _, op in sorted(ops)] for ops in device_ops], num_devices=p)
    # times were rounded to ticks: unless they were whole ticks, give back half a tick per op and
    # per hand-off of the longest chain (at most every op) so the bound holds for the exact times
    exact = all(abs(v * TICKS_PER_MS - round(v * TICKS_PER_MS)) < 1e-6 for v in
                (*costs.forward, *costs.backward_full, *costs.weight, *costs.backward_input))
    exact = exact and all(abs(v * TICKS_PER_MS - round(v * TICKS_PER_MS)) < 1e-6 for v in
                          (cluster.transfer_ms(o, a, b) for o in costs.output for a in range(p) for b in range(p)))
    slack = 0.0 if exact else len(start) / TICKS_PER_MS
    return JointSolution(plan, solver.ObjectiveValue() / TICKS_PER_MS,
                         max(0.0, solver.BestObjectiveBound() / TICKS_PER_MS - slack), status == cp_model.OPTIMAL, cut_short)


def _layer_on(model: cp_model.CpModel, x, on, j: int, d: int, num_stages: int) -> cp_model.IntVar:
    """Literal: layer j sits on device d (its stage is placed there)."""
    flag = model.NewBoolVar(f"layer{j}on{d}")
    pairs = []
    for s in range(num_stages):
        both = model.NewBoolVar(f"l{j}s{s}d{d}")
        model.AddBoolAnd([x[j][s], on[s][d]]).OnlyEnforceIf(both)
        model.AddBoolOr([x[j][s].Not(), on[s][d].Not()]).OnlyEnforceIf(both.Not())
        pairs.append(both)
    model.Add(flag == sum(pairs))
    return flag


def _hint_joint(model: cp_model.CpModel, plan: PipelinePlan, costs: CostTable, x, device, start,
                split_backward: bool, cluster: ClusterSpec) -> None:
    """Hint the joint model with a plan's partition, placement and op start times."""
    if plan.num_stages > len(device):
        return
    for stage in plan.stages:
        model.AddHint(device[stage.index], stage.device)
        for j in range(stage.layer_start, stage.layer_end):
            for s in range(len(device)):
                model.AddHint(x[j][s], s == stage.index)
    sim = simulate(plan, costs, cluster)
    for op, begin in sim.op_start.items():
        key = (op.kind.value, op.stage, op.microbatch)
        if key in start:
            model.AddHint(start[key], _ticks(begin))


# -- the release bound: whole layers, and no device starts before its first layer's input ----------

@dataclass(frozen=True)
class ReleaseBound:
    """A lower bound on any plan's iteration time from loads and start times."""

    lower_ms: float
    """Proven: no plan of these layers on these devices runs an iteration faster."""
    upper_ms: float
    """The bound's own relaxation reaches this (an assignment meets it); equal to `lower_ms` when
    the search settled it."""
    optimal: bool


def release_bound(costs: CostTable, num_devices: int, num_microbatches: int, *, node_budget: int = 3_000,
                  balance: Bound | None = None, ordered_budget: int = 100_000) -> ReleaseBound:
    """max over devices of (the time its first input can arrive + microbatches x its load),
    minimised over every assignment of whole layers to devices: a lower bound on the iteration
    time of every plan, at least microbatches x the balance bound. Also at least, for every
    layer j, F(j) + microbatches x its load (the device holding a heavy last layer, a big head,
    cannot start on it before the forward reaches it).

    Why it holds: each device first runs a forward of its earliest layer j, which needs the
    forwards of layers 0..j-1 of that microbatch first, so it starts no earlier than their sum
    F(j), and then runs `microbatches x load` ms of its own work. Two decisions of a time T:

    1. a relaxation: rank the devices by their earliest layer; the k-th has j >= k, so it starts
       no earlier than F(k). Deciding T is then bin packing with capacities
       (T - F(k)) / microbatches per device, decided exactly by branch and bound (largest layers
       first, pruned by room and item counts; failed states remembered); `node_budget` bounds
       each decision.
    2. exact (`_ordered_fits`): the layers in model order, each joining a device that already
       holds an earlier layer or starting a new one, whose start is then the forward up to that
       layer. Where devices hold few layers each the relaxation lets a late-starting device
       take layers before its first one and is several percent low (gpt-oss-20B, 24 layers on 16
       devices: 4.5%); `ordered_budget` bounds all its decisions together. Run only where
       devices hold under 2 layers on average (elsewhere it gained at most 0.14%).

    T is found by bisection, first for 1, then for 2 above it. A decision that runs out of budget
    counts as possible, so the result is always a proven bound (`optimal` says whether every
    decision was settled). The bound ignores transfers, memory and the drain, so it only improves
    on the balance bound where devices' loads are near it and late starts eat into them (many
    devices, few microbatches)."""
    values = layer_loads(costs)
    scale = _bound_scale(values)
    m, p = num_microbatches, num_devices
    items = sorted((int(round(v * scale)) for v in values), reverse=True)
    # (a stage that recomputes runs its F without autograd, at `forward_no_grad`: the least of both)
    forward_prefix = costs.prefix("forward_least")
    release = [int(math.floor(forward_prefix[k] * scale)) for k in range(min(p, len(values)))]
    p = len(release)
    fit_count = 0
    fitted = 0
    ceiling = max(items) + sum(items) // p
    for item in reversed(items):
        fitted += item
        if fitted > ceiling:
            break
        fit_count += 1
    # rounding: a device's ticks can exceed its real load by half a tick per layer it holds
    slack_ms = m * 0.5 * max(fit_count, 1) / scale
    # a feasible T: the balance bound's groups, heaviest on the earliest-starting device
    base = balance if balance is not None else balance_bound(costs, num_devices)
    groups = [0] * num_devices
    for layer, device in enumerate(base.assignment):
        groups[device] += int(round(values[layer] * scale))
    groups.sort(reverse=True)
    high = max(release[k] + m * groups[k] for k in range(p))
    low = max(m * max(items), -(-(m * sum(items) + sum(release)) // p), m * int(math.floor(base.lower_ms * scale)))
    # bisection; a decision the budget cannot settle counts as "possible" (only proofs of
    # impossibility raise the bound), so the search continues below it where proofs are easier
    settled = True
    while low < high:
        middle = (low + high) // 2
        capacities = [(middle - release[k]) // m for k in range(p)]
        try:
            possible = _pack_capacities(items, capacities, [node_budget])
        except _BudgetExhausted:
            possible, settled = True, False
        if possible:
            high = middle
        else:
            low = middle + 1
    # one layer alone: its device runs microbatches x (F + B + W) of it after microbatch 0's input
    # arrives, and its F and B before the last microbatch's input gradient goes down the layers
    # below it (and their last W)
    forward, weight = costs.forward, costs.weight
    backward = input_gradients(costs)
    last_w = min(backward[0] + weight[0], costs.backward_full[0]) - backward[0]
    below = [0.0]
    for value in backward:
        below.append(below[-1] + value)
    single = max(
        max(forward_prefix[j] + m * values[j],
            forward_prefix[j] + m * (forward[j] + backward[j]) + below[j] + last_w)
        for j in range(len(values))
    )
    # 2. exact over assignments, in floored ticks (every load and start rounded down, so a time
    #    proven impossible there is impossible for the real costs)
    loads = [int(math.floor(v * scale)) for v in values]
    starts = [int(math.floor(x * scale)) for x in forward_prefix[:len(values)]]
    first: dict[int, int] = {}
    device_load = [0] * num_devices
    for layer, device in enumerate(base.assignment):
        first.setdefault(device, layer)
        device_load[device] += loads[layer]
    exact_low = max(0, int(math.floor((low / scale - slack_ms) * scale)))
    exact_high = max(starts[j] + m * device_load[d] for d, j in first.items())  # the balance assignment
    # worth its search where devices hold few layers each (under 2 on average); with more, the
    # relaxation's freedom costs next to nothing (the profiled and analytic tables on 4, 8 and 16
    # devices: at most 0.14%, for seconds of search)
    budget = [ordered_budget if len(values) < 2 * len(release) else 0]
    # first at the relaxation's optimum: where the exact problem meets it too (devices holding
    # many layers each), there is under half a percent left to gain, not worth the search
    trial: int | None = min(exact_high, high + m * len(values))  # (+ the rounding of its ticks)
    while exact_low < exact_high and budget[0] > 0:
        middle = (exact_low + exact_high) // 2 if trial is None else trial
        try:
            possible = _ordered_fits(loads, starts, len(release), m, middle, budget)
        except _BudgetExhausted:
            settled = False
            break
        if possible:
            exact_high = middle
        else:
            exact_low = middle + 1
        if trial is not None and possible and exact_high - exact_low <= 0.005 * exact_low:
            break
        trial = None
    # the exact problem closed (an assignment meets its proven bound): the relaxation is moot
    settled = exact_low >= exact_high or settled
    lower = max(low / scale - slack_ms, exact_low / scale, single)
    return ReleaseBound(max(0.0, lower), max(min(high, exact_high) / scale, lower), settled)


def _ordered_fits(loads: Sequence[int], starts: Sequence[int], num_devices: int, m: int, limit: int,
                  budget: list[int]) -> bool:
    """Can every layer go to one of `num_devices` devices so that each device's start (`starts`
    of its first layer) + m x its load <= `limit`? Depth first over the layers in order: a layer
    joins a device holding earlier layers (in its remaining room) or opens the next device, whose
    room is then (limit - its start) // m. Pruned by the room left (open devices' rooms, plus at
    most one new device per remaining layer, each no roomier than one opened now); rooms no
    remaining layer fits in are dropped; failed states remembered. `budget[0]` counts nodes
    over calls; raises _BudgetExhausted when it runs out."""
    n = len(loads)
    rest = [0] * (n + 1)
    smallest = [1 << 62] * (n + 1)
    for i in range(n - 1, -1, -1):
        rest[i] = rest[i + 1] + loads[i]
        smallest[i] = min(smallest[i + 1], loads[i])
    room_at = [(limit - start) // m for start in starts]
    room_before = [0] * (n + 1)  # room_before[k]: the rooms of new devices opened at layers < k
    for k in range(n):
        room_before[k + 1] = room_before[k] + max(0, room_at[k])
    failed: set[tuple[int, tuple[int, ...], int]] = set()

    def search(i: int, rooms: tuple[int, ...], opened: int) -> bool:
        if i == n:
            return True
        rooms = tuple(room for room in rooms if room >= smallest[i])
        key = (i, rooms, opened)
        if key in failed:
            return False
        budget[0] -= 1
        if budget[0] < 0:
            raise _BudgetExhausted
        future = room_before[min(n, i + num_devices - opened)] - room_before[i]
        if sum(rooms) + future < rest[i]:
            failed.add(key)
            return False
        size = loads[i]
        tried = set()
        for index, room in enumerate(rooms):  # fullest first (rooms are sorted)
            if room >= size and room not in tried:
                tried.add(room)
                if search(i + 1, tuple(sorted(rooms[:index] + (room - size,) + rooms[index + 1:])), opened):
                    return True
        if opened < num_devices and room_at[i] >= size:
            if search(i + 1, tuple(sorted(rooms + (room_at[i] - size,))), opened + 1):
                return True
        failed.add(key)
        return False

    return room_at[0] >= loads[0] and search(1, (room_at[0] - loads[0],), 1)


def _pack_capacities(items: Sequence[int], capacities: Sequence[int], budget: list[int]) -> bool:
    """Can `items` (non-increasing) go into bins of these capacities? Branch and bound over
    (capacity, load) pairs, largest items first; bins with equal capacity and load are the same."""
    n = len(items)
    if any(c < 0 for c in capacities) or sum(items) > sum(capacities):
        return False
    prefix, smallest = _running_sums(items)
    groups = _size_groups(items)
    failed: set[tuple[int, tuple[tuple[int, int], ...]]] = set()

    def search(i: int, bins: list[list[int]]) -> bool:
        if i == n:
            return True
        key = (i, tuple(sorted((capacity, load) for capacity, load in bins)))
        if key in failed:
            return False
        budget[0] -= 1
        if budget[0] < 0:
            raise _BudgetExhausted
        left, room, count = n - i, 0, 0
        for capacity, load in bins:
            free = capacity - load
            k = min(bisect.bisect_right(smallest, free) - 1, left)
            count += k
            room += min(free, prefix[i + k] - prefix[i])
        if room < prefix[n] - prefix[i] or count < left or not _counts_fit(groups, i, [cap - used for cap, used in bins]):
            failed.add(key)
            return False
        size = items[i]
        tried = set()
        for b in sorted(range(len(bins)), key=lambda b: (bins[b][1] - bins[b][0], b)):  # fullest first
            capacity, load = bins[b]
            if (capacity, load) in tried or load + size > capacity:
                continue
            tried.add((capacity, load))
            bins[b][1] += size
            if search(i + 1, bins):
                return True
            bins[b][1] -= size
        failed.add(key)
        return False

    return search(0, [[c, 0] for c in capacities])


def _size_groups(items: Sequence[int]) -> list[tuple[int, int]]:
    """(size, index of its last item) of each distinct positive size of `items` (non-increasing)."""
    groups: list[tuple[int, int]] = []
    for index, size in enumerate(items):
        if size <= 0:
            break
        if groups and groups[-1][0] == size:
            groups[-1] = (size, index)
        else:
            groups.append((size, index))
    return groups


def _counts_fit(groups: Sequence[tuple[int, int]], start: int, free: Sequence[int]) -> bool:
    """For every size t of the remaining items (items[start:], non-increasing; `groups` from
    `_size_groups`): the items of size >= t each take t or more, so the bins must have room for
    that many of them: sum over bins of floor(free / t) >= their count. (Counting with the
    smallest items, as the room test does, is weak when a few small items sit among many large
    ones.)"""
    rooms = [room for room in free if room > 0]
    for size, last in groups:
        if last >= start and sum(room // size for room in rooms) < last + 1 - start:
            return False
    return True


def order_bound(sc: StageCosts, placement: Sequence[int], num_microbatches: int,
                activation_budget: Sequence[float] | None, stash: Sequence[float] | None = None) -> float:
    """A lower bound on the iteration time of every op order of one structure (its stage costs
    `sc`, recompute flags included, and `placement`) whose activations stay within
    `activation_budget` (bytes per device; None: no limit). Transfers, reductions and the
    simulator's queues only add to it. Per device, the largest of:

    - the release: a stage's forwards, and so everything after them, wait for the forward to
      reach that stage: for each of the device's stages s, when the forward reaches s + the
      device's work other than the forwards of its stages before s + the cool-down idle below;
    - the warm-up: its first B cannot start before one microbatch's forward through every stage
      and the input gradients of the stages after its last one. Until then it runs only F, and
      each F it starts holds its stage's activations until that stage's B, so the F work done
      before then is at most what fits the budget (a fractional knapsack of its stages'
      forwards, each at most microbatches times and at most the time from when the forward
      reaches the stage to that first B). The rest of its load comes after, and so does the
      cool-down idle after its last B (and the one after its last F where the budget cannot
      hold every microbatch's forwards: then the last F comes after that first B);
    - the cool-downs, two idle times. After its last F starts (of a microbatch j, on its last
      stage), j's chain (the forwards from that stage on and every stage's input gradient) still
      runs, while the device's own work left is j's own and the B and W of the other microbatches
      it still holds (a knapsack of the budget less what j holds). After its last B on its last
      stage ends, every F is done and that microbatch's input gradients still run through the
      stages before it, while the device can run only W and its earlier stages' B and W, again
      of microbatches that hold their bytes. What a chain outlasts that work by is idle.

    Each stage's B is the cheaper of its input gradient and full backward, W what the cheaper of
    split and fused adds to it, and a microbatch's work left the dearer, so the bound holds
    whichever the order splits."""
    m = num_microbatches
    forward = sc.forward
    stages = range(len(forward))
    backward = [min(sc.backward_input[s], sc.backward_full[s]) for s in stages]
    work = [min(sc.backward_input[s] + sc.weight[s], sc.backward_full[s]) for s in stages]
    most = [max(sc.backward_input[s] + sc.weight[s], sc.backward_full[s]) for s in stages]
    all_forward, all_backward = sum(forward), sum(backward)
    held = sc.held or sc.activation
    stash = sc.weight_stash(MemoryModel().weight_memory_fraction) if stash is None else stash
    reach = list(itertools.accumulate(forward, initial=0.0))[:-1]  # when the forward reaches each stage
    bound = 0.0
    for device in sorted(set(placement)):
        own = [s for s in stages if placement[s] == device]
        last, earlier = own[-1], own[:-1]
        load = m * sum(forward[s] + work[s] for s in own)
        first_b = all_forward + sum(backward[last + 1:])
        room = math.inf if activation_budget is None else activation_budget[device] * (1 + 1e-9) + 1e-6
        early = _fractional_fill([(forward[s], held[s]) for s in own], m, room,
                                 caps=[max(0.0, first_b - reach[s]) for s in own])
        pending = [(most[s], held[s]) for s in own] + [(sc.weight[s], stash[s]) for s in own]
        chain = sum(forward[last:]) + all_backward
        tail = max(0.0,
                   chain - _fractional_fill(pending, m, room) - max(forward[s] for s in own),
                   chain - forward[last] - sum(most[s] for s in own)
                   - _fractional_fill(pending, m - 1, room - sum(held[s] for s in own)))
        drain = _fractional_fill([(sc.weight[last], stash[last])] + [(most[s], held[s]) for s in earlier]
                                 + [(sc.weight[s], stash[s]) for s in earlier],
                                 m - 1, room - sum(held[s] for s in earlier))
        tail_b = max(0.0, sum(backward[:last]) - sc.weight[last] - sum(most[s] for s in earlier) - drain)
        for s in own:
            before = m * sum(forward[t] for t in own if t < s)
            bound = max(bound, reach[s] + load - before + max(tail, tail_b))
        crowded = m * sum(held[s] for s in own) > room
        bound = max(bound, first_b + load - early + max(tail if crowded else 0.0, tail_b))
    return bound


def _fractional_fill(items: Sequence[tuple[float, float]], copies: int, room: float,
                     caps: Sequence[float] | None = None) -> float:
    """The most value that (value, bytes) items, each at most `copies` times (and at most its
    `caps` entry in value) and in fractions, fit in `room` bytes (items of no bytes fit whole)."""
    total = 0.0
    caps = caps if caps is not None else [math.inf] * len(items)
    for (value, size), cap in sorted(zip(items, caps), key=lambda item: -item[0][0] / item[0][1] if item[0][1] > 0
                                     else -math.inf):
        most = min(copies * value, cap)
        if size <= 0:
            total += most
            continue
        if room <= 0 or value <= 0:
            continue
        take = min(most / value, room / size)
        total += take * value
        room -= take * size
    return total
