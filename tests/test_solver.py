"""The CP-SAT models and the exact balance bound: against brute force on tiny instances, and their
contracts (valid plans, never worse than the hint, deterministic, bounds are bounds)."""

import itertools
import math
import random
import time
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from octopipe import ClusterSpec, CostTable, LayerCost, PipelinePlan, PlanError
from octopipe.api import plan as octopipe_plan
from octopipe.ir.plan import Op, OpKind
from octopipe.simulator import MemoryModel, StageCosts, iteration_time, simulate
from octopipe.solver import (
    _solve_window,
    balance_bound,
    balanced_structure,
    layer_loads,
    order_bound,
    refine_order,
    release_bound,
    solve_joint,
)
from octopipe.tuner import Policy, Structure, list_schedule

FREE = ClusterSpec(num_devices=2, intra_node_bandwidth=1e30, inter_node_bandwidth=1e30, latency_s=0.0)


def table(forward, backward, weight=None, activation=None, output=None, stash=None):
    n = len(forward)
    return CostTable([
        LayerCost(f"l{i}", forward_ms=forward[i], backward_ms=backward[i],
                  backward_weight_ms=None if weight is None else weight[i],
                  activation_bytes=None if activation is None else activation[i],
                  output_bytes=None if output is None else output[i],
                  weight_stash_bytes=None if stash is None else stash[i])
        for i in range(n)
    ])


# -- balance bound ------------------------------------------------------------------------------

def brute_balance(loads, p):
    best = math.inf
    for assignment in itertools.product(range(p), repeat=len(loads)):
        per = [0.0] * p
        for load, device in zip(loads, assignment):
            per[device] += load
        best = min(best, max(per))
    return best


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 60), min_size=2, max_size=8), st.integers(2, 3))
def test_balance_bound_is_the_exact_optimum_on_small_tables(loads, p):
    costs = table([x / 10 for x in loads], [x / 5 for x in loads])
    bound = balance_bound(costs, p)
    exact = brute_balance(layer_loads(costs), p)
    assert bound.optimal
    assert bound.load_ms == pytest.approx(exact, abs=1e-9)
    assert bound.lower_ms <= exact + 1e-9
    per = [0.0] * p
    for load, device in zip(layer_loads(costs), bound.assignment):
        per[device] += load
    assert max(per) == pytest.approx(bound.load_ms)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 99), min_size=2, max_size=7), st.integers(2, 3))
@example([93, 84, 37], 2)  # at 0.01 ms ticks these rounded to 3, 3 and 1, and "exact" was 7% over the optimum
@example([1, 1, 1, 1, 91, 99, 99], 3)  # the lower bound 1.005e-4 below: rounding, then its slack
def test_balance_bound_is_exact_on_layers_of_microseconds(loads, p):
    costs = table([x / 10**4 for x in loads], [2 * x / 10**4 for x in loads])
    bound = balance_bound(costs, p)
    exact = brute_balance(layer_loads(costs), p)
    assert bound.optimal
    assert bound.load_ms == pytest.approx(exact, rel=1e-6)
    # proven on loads rounded to ticks of at most a 1e5th of the total, less half a tick per layer
    # for that rounding: at most a tick per layer below
    tick = sum(layer_loads(costs)) / 10**5
    assert exact - len(loads) * tick <= bound.lower_ms <= exact + 1e-12


def test_balance_bound_proves_near_equal_layers_on_many_devices_quickly():
    # the hard case for bin-packing solvers: 40 almost equal layers (+ a heavy head), 16 devices
    rng = random.Random(3)
    forward = [6.0 + rng.uniform(-0.15, 0.15) for _ in range(39)] + [13.3]
    backward = [11.1 + rng.uniform(-0.3, 0.3) for _ in range(39)] + [17.8]
    costs = table(forward, backward)
    for p in (3, 6, 12, 16):
        bound = balance_bound(costs, p)
        assert bound.optimal, (p, bound)
        assert bound.lower_ms <= bound.load_ms <= bound.lower_ms + 0.5


def test_balance_bound_with_more_devices_than_layers_is_the_largest_layer():
    costs = table([1.0, 3.0], [2.0, 1.0])
    bound = balance_bound(costs, 4)
    assert bound.optimal and bound.load_ms == 4.0


def test_balance_bound_cut_short_keeps_a_valid_lower_bound():
    rng = random.Random(0)
    costs = table([rng.uniform(1, 9) for _ in range(30)], [rng.uniform(2, 18) for _ in range(30)])
    bound = balance_bound(costs, 5, node_budget=1, lp_rounds=1)
    exact = balance_bound(costs, 5)
    assert bound.lower_ms <= exact.load_ms + 1e-9 <= bound.load_ms + 1e-9



@pytest.mark.timeout(60)
def test_balance_bound_work_is_bounded_where_bins_have_many_completions():
    # 39 near-equal layers and a tiny one on 10 devices: each bin-completion node enumerates the
    # ways to fill a bin (about 140 sets here, exponentially many with many small layers); the
    # node budget counts them, and the time limit is looked at inside the search (both once ran
    # for minutes: the budget counted bins only, the clock was read between searches)
    rng = random.Random(10)
    loads = [rng.uniform(33, 42) for _ in range(39)] + [0.2]
    costs = table([x / 3 for x in loads], [2 * x / 3 for x in loads])
    exact = balance_bound(costs, 10)
    assert exact.lower_ms <= exact.load_ms
    assert sum(loads) / 10 <= exact.lower_ms + 1e-9
    for limit in (0.05, 0.5):
        started = time.perf_counter()
        bound = balance_bound(costs, 10, node_budget=10**9, time_limit_s=limit)
        assert time.perf_counter() - started < limit + 5  # the clock is read every few nodes
        assert bound.lower_ms <= exact.load_ms + 1e-9 and exact.lower_ms <= bound.load_ms + 1e-9
    # many small layers beside two big ones: a bin's completions number 2^38 unless charged
    small = table([100 / 3, 90 / 3] + [rng.uniform(0.5, 3) / 3 for _ in range(38)],
                  [200 / 3, 60] + [0.0] * 38)
    bound = balance_bound(small, 12, time_limit_s=1.0)
    assert bound.lower_ms <= bound.load_ms


@pytest.mark.timeout(120)
def test_plan_keeps_its_time_limit_where_the_balance_bound_is_hard():
    rng = random.Random(10)
    loads = [rng.uniform(33, 42) for _ in range(39)] + [0.2]
    costs = CostTable([LayerCost(f"l{i}", forward_ms=x / 3, backward_ms=2 * x / 3) for i, x in enumerate(loads)])
    result = octopipe_plan(costs, ClusterSpec.preset("h100x16", num_devices=10), 8, time_limit_s=2.0, effort=0.02, quiet=True)
    assert result.report.cut_short
    assert result.report.stage_seconds["bounds"] < 3  # given a fifth of the limit, or 1 s at least
    assert result.report.planning_seconds < 20


# -- release bound ------------------------------------------------------------------------------

def brute_release(costs, p, m):
    """min over every assignment of layers to devices of max over devices of (the forward up to
    its first layer + m x its load)."""
    loads, before = layer_loads(costs), costs.prefix("forward")
    best = math.inf
    for assignment in itertools.product(range(p), repeat=len(loads)):
        first, per = {}, [0.0] * p
        for layer, device in enumerate(assignment):
            first.setdefault(device, layer)
            per[device] += loads[layer]
        best = min(best, max(before[layer] + m * per[device] for device, layer in first.items()))
    return best


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from([8, 10, 12, 28, 30, 34]), min_size=3, max_size=7), st.integers(2, 4),
       st.sampled_from([1, 2, 4, 8]))
def test_release_bound_is_exact_over_assignments_on_small_tables(forwards, p, m):
    forwards = forwards[:2 * p - 1]  # the exact search runs where devices hold under 2 layers on average
    costs = table([x / 10 for x in forwards], [x / 5 for x in forwards])
    relaxed = release_bound(costs, p, m, ordered_budget=0)  # the rank relaxation alone
    bound = release_bound(costs, p, m)
    exact = brute_release(costs, p, m)
    assert bound.optimal
    # never above the exact optimum (nor above the relaxation's other terms, which also hold)
    assert bound.lower_ms <= max(exact, relaxed.lower_ms) + 1e-9
    assert bound.lower_ms >= relaxed.lower_ms - 1e-9
    # and at most the ticks' rounding below it
    assert bound.lower_ms >= exact - 0.01 * (m * len(forwards) + 1)


def test_release_bound_knows_a_late_device_cannot_take_earlier_layers():
    # 5 layers, heavy and light, on 3 devices: the rank relaxation lets the third device to
    # start hold a heavy layer from before its first one; no real assignment can
    forward = [3.42, 3.11, 0.99, 2.9, 0.95]
    costs = table(forward, [2 * x for x in forward])
    relaxed = release_bound(costs, 3, 4, ordered_budget=0)
    bound = release_bound(costs, 3, 4)
    exact = brute_release(costs, 3, 4)
    assert relaxed.lower_ms < 0.95 * exact
    assert exact - 0.2 <= bound.lower_ms <= exact


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**6), st.integers(2, 4), st.sampled_from([2, 4]))
def test_release_bound_is_below_every_plan(seed, p, factor):
    from octopipe import schedules

    rng = random.Random(seed)
    forward = [rng.uniform(0.5, 3.0) for _ in range(rng.randint(p + 1, 2 * p + 2))]
    costs = table(forward, [x * rng.uniform(1.5, 2.5) for x in forward])
    cluster = ClusterSpec(num_devices=p, intra_node_bandwidth=1e30, inter_node_bandwidth=1e30, latency_s=0.0)
    m = factor * p
    bound = release_bound(costs, p, m)
    for name, plan in schedules.baselines(costs, cluster, m).items():
        assert bound.lower_ms <= simulate(plan, costs, cluster).iteration_ms + 1e-6, name
    for count in (p, len(forward)):
        for placement in (tuple(s % p for s in range(count)),):
            bounds = tuple(range(count)) + (len(forward),) if count == len(forward) else None
            if bounds is None:
                from octopipe.schedules import balanced_boundaries

                bounds = tuple(balanced_boundaries(layer_loads(costs), count))
            plan = list_schedule(Structure(bounds, placement, p), costs, cluster, m, Policy())
            assert bound.lower_ms <= iteration_time(plan, costs, cluster)[0] + 1e-6


# -- the joint model against brute force --------------------------------------------------------

def device_orders(ops):
    """Every order of `ops` that keeps F < B < W per (stage, microbatch) and the stage order of
    one microbatch's F (ascending) and B (descending) on one device."""
    present = set(ops)

    def needs(op):
        s, mb = op.stage, op.microbatch
        if op.kind is OpKind.F:
            return [Op(s - 1, OpKind.F, mb)] if Op(s - 1, OpKind.F, mb) in present else []
        if op.kind is OpKind.B:
            return [Op(s, OpKind.F, mb)] + ([Op(s + 1, OpKind.B, mb)] if Op(s + 1, OpKind.B, mb) in present else [])
        return [Op(s, OpKind.B, mb)]

    prerequisites = {op: needs(op) for op in ops}
    result = []

    def extend(done, sequence):
        if len(sequence) == len(ops):
            result.append(tuple(sequence))
            return
        for op in ops:
            if op not in done and all(q in done for q in prerequisites[op]):
                done.add(op)
                sequence.append(op)
                extend(done, sequence)
                sequence.pop()
                done.discard(op)

    extend(set(), [])
    return result


def brute_force(costs, cluster, m, p, max_stages, split, budget=None):
    best = math.inf
    kinds = (OpKind.F, OpKind.B, OpKind.W) if split else (OpKind.F, OpKind.B)
    L = len(costs)
    for count in range(1, max_stages + 1):
        for cuts in itertools.combinations(range(1, L), count - 1):
            bounds = (0, *cuts, L)
            for placement in itertools.product(range(p), repeat=count):
                per_device = [device_orders([Op(s, k, mb) for s in range(count) if placement[s] == d
                                             for mb in range(m) for k in kinds]) for d in range(p)]
                base = PipelinePlan.build(m, bounds, placement, [[] for _ in range(p)], num_devices=p)
                for orders in itertools.product(*per_device):
                    try:
                        ms, peak = iteration_time(base.with_ops(orders), costs, cluster)
                    except PlanError:
                        continue  # deadlocks
                    if budget is not None and max(peak) > budget + 1e-6:
                        continue
                    best = min(best, ms)
    return best


TINY = [
    table([2, 1, 3], [4, 6, 2], weight=[1, 3, 1], activation=[3000, 1000, 2000], output=[0, 0, 0]),
    table([1, 3, 1], [5, 3, 6], weight=[2, 1, 3], activation=[1000, 4000, 1000], output=[0, 0, 0]),
]


# what each layer's B leaves for its W stated: the middle layer's more than its activations (a
# head's input and its logits' gradient), the others' less than the memory model's share of them
STASHED = table([2, 1, 3], [4, 6, 2], weight=[1, 3, 1], activation=[3000, 1000, 2000], output=[0, 0, 0],
                stash=[500, 2500, 0])
# the second layer's B leaves twice its activations: under 3000 bytes its device must run each W
# before the next B (the model's cumulative spans from B to W)
GROWING = table([1, 1], [3, 3], weight=[1, 1], activation=[1000, 1000], output=[0, 0], stash=[0, 2000])


@pytest.mark.parametrize("costs, split, max_stages, budget",
                         [(costs, *case) for costs in TINY
                          for case in ((False, 3, None), (False, 3, 5000.0), (True, 2, None))]
                         + [(STASHED, True, 2, 5000.0), (STASHED, True, 2, 4000.0), (GROWING, True, 2, 3000.0)])
def test_solve_joint_matches_brute_force(costs, split, max_stages, budget):
    m, p = 2, 2
    expected = brute_force(costs, FREE, m, p, max_stages, split, budget)
    solution = solve_joint(costs, FREE, m, max_stages=max_stages, split_backward=split,
                           activation_budget=None if budget is None else [budget] * p, work=30)
    assert solution is not None and solution.optimal
    assert solution.objective_ms == pytest.approx(expected)
    solution.plan.validate(len(costs))
    result = simulate(solution.plan, costs, FREE)
    assert result.iteration_ms == pytest.approx(expected)
    if budget is not None:
        assert max(result.peak_activation_bytes) <= budget + 1e-6


def test_solve_joint_with_transfers_is_a_valid_lower_bound():
    costs = table([2, 1, 3], [4, 6, 2], weight=[1, 3, 1], activation=[3000, 1000, 2000], output=[10**9] * 3)
    cluster = ClusterSpec(num_devices=2, intra_node_bandwidth=1e12, latency_s=1e-3)
    solution = solve_joint(costs, cluster, 2, max_stages=2, split_backward=True, work=30)
    assert solution.optimal
    simulated = simulate(solution.plan, costs, cluster).iteration_ms
    assert solution.lower_bound_ms <= simulated + 1e-6


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 6), st.integers(1, 4)), min_size=2, max_size=3),
       st.integers(2, 6))
def test_looser_memory_never_makes_the_exact_plan_slower(layers, budget_units):
    costs = table([f for f, _, _ in layers], [b + 1 for _, b, _ in layers], weight=[1] * len(layers),
                  activation=[a * 1000 for _, _, a in layers], output=[0] * len(layers))
    times = []
    for units in (budget_units, budget_units + 2):
        solution = solve_joint(costs, FREE, 2, max_stages=2, split_backward=True,
                               activation_budget=[units * 1000.0] * 2, work=20)
        times.append(math.inf if solution is None else solution.objective_ms)
    assert times[1] <= times[0] + 1e-9


# -- the order bound of one structure ----------------------------------------------------------------

def best_order(costs, cluster, m, bounds, placement, split, budget, recompute=()):
    """The fastest order of one structure within the per-device activation budget, by brute force."""
    p = max(placement) + 1
    kinds = (OpKind.F, OpKind.B, OpKind.W) if split else (OpKind.F, OpKind.B)
    count = len(placement)
    per_device = [device_orders([Op(s, k, mb) for s in range(count) if placement[s] == d
                                 for mb in range(m) for k in kinds]) for d in range(p)]
    base = PipelinePlan.build(m, bounds, placement, [[] for _ in range(p)], num_devices=p, recompute=recompute)
    best = math.inf
    for orders in itertools.product(*per_device):
        try:
            sim = simulate(base.with_ops(orders), costs, cluster)
        except PlanError:
            continue  # deadlocks
        if all(peak <= room + 1e-6 for peak, room in zip(sim.peak_activation_bytes, budget)):
            best = min(best, sim.iteration_ms)
    return best


def small_structure(layers, placement, recompute_first, output, stash_share=None, unsaved=0):
    """A table of (forward, backward, weight, activation units) layers, one stage per layer on
    `placement` (cut to the layer count), the first stage recomputing where asked; with
    `stash_share`, each layer's B leaves that share of its activation bytes for its W; the second
    layer saves none of the `unsaved` bytes it receives (a loss's logits)."""
    costs = table([f for f, _, _, _ in layers], [b + w for _, b, w, _ in layers], weight=[w for _, _, w, _ in layers],
                  activation=[a * 1000 for _, _, _, a in layers], output=[output] * len(layers),
                  stash=None if stash_share is None else [round(a * 1000 * stash_share) for _, _, _, a in layers])
    if unsaved:
        costs = costs.replace_layers([replace(layer, unsaved_input_bytes=unsaved if i == 1 else None)
                                      for i, layer in enumerate(costs)])
    placement = placement[:len(layers)]
    bounds = tuple(range(len(placement))) + (len(layers),)
    recompute = (recompute_first,) + (False,) * (len(placement) - 1)
    return costs, placement, bounds, recompute


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 6), st.integers(0, 3), st.integers(1, 4)),
                min_size=2, max_size=3),
       st.sampled_from([((0, 1), 2, True), ((0, 1), 2, False), ((0, 1, 0), 2, False), ((1, 0, 1), 2, False),
                        ((0, 1), 3, False)]), st.integers(1, 5),
       st.booleans(), st.sampled_from([None, 0.25, 1.5]), st.sampled_from([0, 1500]))
def test_order_bound_is_below_the_best_order_within_the_budget(layers, shape, units, recompute_first, stash_share,
                                                                unsaved):
    placement, m, split = shape
    costs, placement, bounds, recompute = small_structure(layers, placement, recompute_first, output=100,
                                                          stash_share=stash_share, unsaved=unsaved)
    budget = [units * 1000.0] * 2
    exact = best_order(costs, FREE, m, bounds, placement, split, budget, recompute)
    sc = StageCosts.of(bounds, costs, recompute)
    stash = sc.weight_stash(MemoryModel().weight_memory_fraction)
    bound = order_bound(sc, placement, m, budget, stash)
    assert bound <= exact + 1e-6
    # a looser budget never raises it, and without one it is at least every device's release + load
    assert order_bound(sc, placement, m, None, stash) <= bound + 1e-9
    assert order_bound(sc, placement, m, [b + 3000 for b in budget], stash) <= bound + 1e-9


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 6), st.integers(0, 3), st.integers(1, 4)),
                min_size=2, max_size=3),
       st.sampled_from([((0, 1), 2, True), ((0, 1), 3, False), ((0, 1, 0), 2, False), ((1, 0, 1), 2, False)]),
       st.integers(0, 4), st.booleans(), st.sampled_from([None, 0.25, 1.5]), st.sampled_from([0, 1500]))
@example([(1, 2, 0, 3), (3, 5, 1, 1), (2, 2, 2, 2)], ((0, 1), 2, True), 0, False, None, 0)  # stage 0's W costs nothing
@example([(4, 6, 3, 1), (4, 1, 2, 1), (1, 1, 0, 1)], ((1, 0, 1), 2, False), 0, True, None, 0)  # the window's last end first
@example([(1, 2, 1, 3), (3, 5, 1, 1), (2, 2, 2, 2)], ((0, 1), 2, True), 1, False, 1.5, 0)  # W holds more than F did
# a W of no time at B's end: the reservoir once summed B's growth with W's release at that instant
@example([(1, 1, 0, 1), (1, 1, 0, 2)], ((0, 1), 2, True), 1, False, 1.5, 0)
# a stage holding the input it does not save, beside its V partner on the same device
@example([(1, 2, 1, 1), (2, 2, 1, 1), (1, 1, 1, 1)], ((0, 1, 0), 2, False), 1, False, None, 1500)
def test_whole_order_model_finds_the_best_order_within_the_budget(layers, shape, extra, recompute_first, stash_share,
                                                                  unsaved):
    # the CP-SAT order models' memory must allow exactly the orders the simulator's accounting
    # allows: from a one-microbatch-at-a-time hint the whole-order model and a window freeing
    # every op both reach the brute-force best order within the budget, never one over it (a W
    # of zero cost that the window model started at an F's start went after that F, and the
    # plan overdrew the budget: a solution's ops are now read by start, then end)
    placement, m, split = shape
    costs, placement, bounds, recompute = small_structure(layers, placement, recompute_first, output=0,
                                                          stash_share=stash_share, unsaved=unsaved)
    kinds = (OpKind.F, OpKind.B, OpKind.W) if split else (OpKind.F, OpKind.B)
    chain = [Op(s, OpKind.F, 0) for s in range(len(placement))] + [
        Op(s, k, 0) for s in reversed(range(len(placement))) for k in kinds[1:]]
    serial = PipelinePlan.build(m, bounds, placement,
                                [[Op(op.stage, op.kind, mb) for mb in range(m) for op in chain if placement[op.stage] == d]
                                 for d in range(2)], num_devices=2, recompute=recompute)
    one_at_a_time = max(simulate(serial, costs, FREE).peak_activation_bytes)
    budget = [one_at_a_time + extra * 1000.0] * 2
    exact = best_order(costs, FREE, m, bounds, placement, split, budget, recompute)
    result = refine_order(serial, costs, FREE, work=20, activation_budget=budget)
    assert result.full_model
    sim = simulate(result.plan, costs, FREE)
    assert max(sim.peak_activation_bytes) <= budget[0] + 1e-6
    assert result.iteration_ms == pytest.approx(exact)
    assert result.lower_bound_ms is not None and result.lower_bound_ms <= exact + 1e-6
    # the window model freeing every op: the same (its tie-breaker, the sum of the ends, once
    # outweighed a tick of its last end: 45 ms where the best order takes 44)
    window = _solve_window(serial, costs, FREE, {op for ops in serial.device_ops for op in ops}, 20, None, budget,
                           MemoryModel(), 0)
    assert window is not None
    sim = simulate(window[0], costs, FREE)
    assert max(sim.peak_activation_bytes) <= budget[0] + 1e-6
    assert sim.iteration_ms == pytest.approx(exact)


def test_order_bound_sees_the_warm_up_a_tight_budget_forces():
    # two stages of one layer on two devices, 1 ms each way, 4 microbatches: room for one
    # microbatch's activations holds device 0's forwards back until the first B comes back
    costs = table([1, 1], [1, 1], weight=[0, 0], activation=[1000, 1000], output=[0, 0])
    sc = StageCosts.of((0, 1, 2), costs)
    free = order_bound(sc, (0, 1), 4, None)
    tight = order_bound(sc, (0, 1), 4, [1000.0, 1000.0])
    # one microbatch at a time (F0 F1 B1 B0, 4 ms each) is the only order within that room
    f, b = OpKind.F, OpKind.B
    serial = PipelinePlan.build(4, (0, 1, 2), (0, 1), [[Op(0, k, mb) for mb in range(4) for k in (f, b)],
                                                        [Op(1, k, mb) for mb in range(4) for k in (f, b)]])
    sim = simulate(serial, costs, FREE)
    assert max(sim.peak_activation_bytes) <= 1000.0 and sim.iteration_ms == pytest.approx(16.0)
    # device 1: its release (1 ms) + 4 x 2 ms, then its last B's input gradient still runs on
    # device 0 (1 ms) with nothing left for device 1 to do; the best free order takes exactly that
    assert free == pytest.approx(10.0)
    assert tight == pytest.approx(12.0)  # device 0: B at 3 ms, 1 ms of F before it, 8 - 1 after, 2 ms of drain


def test_order_bound_is_below_every_baseline_within_its_own_peak():
    from octopipe import schedules

    rng = random.Random(3)
    n = 10
    forward = [rng.uniform(0.5, 3.0) for _ in range(n)]
    costs = table(forward, [x * rng.uniform(1.5, 2.5) for x in forward], weight=[x * 0.8 for x in forward],
                  activation=[rng.randint(1, 6) * 10**6 for _ in range(n)], output=[10**5] * n)
    cluster = ClusterSpec.preset("h100x4")
    checked = 0
    for m in (4, 8):
        for name, plan in schedules.baselines(costs, cluster, m).items():
            for flags in ((), (True,) * plan.num_stages):
                variant = plan.with_recompute(flags) if flags else plan
                sim = simulate(variant, costs, cluster)
                sc = StageCosts.of(variant.boundaries, costs, variant.recompute, variant.selective)
                bound = order_bound(sc, variant.placement, m, list(sim.peak_activation_bytes))
                assert bound <= sim.iteration_ms * (1 + 1e-12), (name, flags)
                checked += 1
    assert checked >= 20


# -- structures and order refinement --------------------------------------------------------------

def test_balanced_structure_is_valid_and_deterministic():
    rng = random.Random(1)
    costs = table([rng.uniform(1, 5) for _ in range(12)], [rng.uniform(2, 9) for _ in range(12)])
    for placement in ((0, 1, 2, 0, 1, 2), None):
        first = balanced_structure(costs, 3, 6, placement, num_microbatches=6)
        assert first == balanced_structure(costs, 3, 6, placement, num_microbatches=6)
        bounds, chosen = first
        assert bounds[0] == 0 and bounds[-1] == 12 and all(a < b for a, b in zip(bounds, bounds[1:]))
        assert len(chosen) == 6 and all(chosen[s] != chosen[s + 1] for s in range(5))


REFINE_BUDGET = [5e6] * 4
"""Room for two microbatches of a stage of `refine_case` (2 x 2e6 bytes) and what an F sends (1e6)."""


def refine_case():
    rng = random.Random(5)
    n = 8
    costs = table([rng.uniform(1, 3) for _ in range(n)], [rng.uniform(2, 6) for _ in range(n)],
                  activation=[10**6] * n, output=[10**6] * n)
    cluster = ClusterSpec.preset("h100x4")
    structure = Structure((0, 2, 4, 6, 8), (0, 1, 2, 3), 4)
    plan = list_schedule(structure, costs, cluster, 4, Policy(), REFINE_BUDGET)
    return costs, cluster, plan


def test_refine_order_is_never_worse_and_respects_the_budget():
    costs, cluster, plan = refine_case()
    before = simulate(plan, costs, cluster).iteration_ms
    for max_window_ops in (1000, 20):  # the whole order, then windows of it
        result = refine_order(plan, costs, cluster, work=2, activation_budget=REFINE_BUDGET,
                              max_window_ops=max_window_ops)
        result.plan.validate(len(costs))
        sim = simulate(result.plan, costs, cluster)
        assert sim.iteration_ms == pytest.approx(result.iteration_ms)
        assert result.iteration_ms <= before + 1e-9
        assert max(sim.peak_activation_bytes) <= REFINE_BUDGET[0] + 1e-6
        if result.full_model and result.lower_bound_ms is not None:
            assert result.lower_bound_ms <= result.iteration_ms + 1e-6


def test_refine_order_windows_improve_tables_of_hour_long_layers():
    # a paper-size model's analytic costs on a CPU cluster: ops of hours, a horizon of 1e11 ticks.
    # The windows still find the order the same table in milliseconds gets (a cumulative of
    # holding intervals in their place, tried in stop 30, lost it, or crashed CP-SAT)
    gains = []
    for scale in (1.0, 1e6):
        rng = random.Random(5)
        costs = table([rng.uniform(1, 3) * scale for _ in range(8)], [rng.uniform(2, 6) * scale for _ in range(8)],
                      activation=[10**6] * 8, output=[10**6] * 8)
        cluster = ClusterSpec.preset("h100x4")
        plan = list_schedule(Structure((0, 2, 4, 6, 8), (0, 1, 2, 3), 4), costs, cluster, 4, Policy(), REFINE_BUDGET)
        before = simulate(plan, costs, cluster).iteration_ms
        result = refine_order(plan, costs, cluster, work=2, activation_budget=REFINE_BUDGET, max_window_ops=20)
        assert max(simulate(result.plan, costs, cluster).peak_activation_bytes) <= REFINE_BUDGET[0]
        gains.append(before / result.iteration_ms)
    assert gains[0] > 1.01 and gains[1] > 1.01


def test_refine_order_is_deterministic():
    costs, cluster, plan = refine_case()
    first = refine_order(plan, costs, cluster, work=1, activation_budget=REFINE_BUDGET, max_window_ops=30)
    second = refine_order(plan, costs, cluster, work=1, activation_budget=REFINE_BUDGET, max_window_ops=30)
    assert str(first.plan) == str(second.plan)


@pytest.mark.parametrize("max_window_ops", [1000, 40])
def test_refine_order_keeps_zero_length_ops_after_what_they_wait_for(max_window_ops):
    # layers that take no time (a loss, a reshape) give ops that start and end at one tick in the
    # model's solution; ordered by kind and stage, two such backwards of one microbatch on one
    # device came out downstream stage last, and the refined plan deadlocked
    costs = CostTable([LayerCost(f"l{i}", "block", 0.0, 0.0, 0.0) for i in range(8)])
    cluster = ClusterSpec.preset("h100x8")
    plan = list_schedule(Structure((0, 1, 2, 3, 4, 5, 6, 7, 8), (0, 1, 2, 3, 4, 5, 6, 7), 8), costs, cluster, 8)
    pair = cluster.with_devices(2)
    looped = list_schedule(Structure((0, 2, 4, 6, 8), (0, 1, 1, 0), 2), costs, pair, 4)
    for case, on in ((plan, cluster), (looped, pair)):
        result = refine_order(case, costs, on, work=1, max_window_ops=max_window_ops)
        result.plan.validate(len(costs))
        assert simulate(result.plan, costs, on).iteration_ms == pytest.approx(result.iteration_ms)


@pytest.mark.timeout(60)
def test_the_bounds_stay_small_on_tables_of_long_layers():
    # found by a CLI sweep: a paper-size model's analytic costs on a CPU cluster (seconds to
    # hours per layer) made the balance bound's subset-sum bitsets as long as the total load at
    # 10 us per tick: a MemoryError. Ticks now coarsen with the total; the bound stays a bound
    import random

    rng = random.Random(0)
    layers = [LayerCost(f"l{i}", forward_ms=rng.uniform(1e6, 9e6), backward_ms=rng.uniform(2e6, 2e7)) for i in range(9)]
    costs = CostTable(layers)
    bound = balance_bound(costs, 2)
    loads = [layer.forward_ms + layer.backward_ms for layer in layers]
    assert sum(loads) / 2 * (1 - 1e-6) <= bound.lower_ms <= bound.load_ms
    best = min(max(sum(x for i, x in enumerate(loads) if mask >> i & 1), sum(x for i, x in enumerate(loads)
                                                                                if not mask >> i & 1))
               for mask in range(1 << len(loads)))
    assert bound.lower_ms <= best * (1 + 1e-9) and bound.load_ms >= best * (1 - 1e-9)


def test_the_whole_order_bound_covers_fused_backwards_only_where_splitting_never_costs_more():
    # CP-SAT's whole-order model keeps the plan's split of each backward into B and W; its bound
    # is for those orders. Where a full backward is cheaper than B and W apart (2.5 ms against
    # 2 + 2 here), a fused order of the same structure beats it, so the report must not use it
    from octopipe import schedules

    cheap_fused = CostTable([LayerCost(f"l{i}", forward_ms=1.0, backward_ms=4.0, backward_weight_ms=2.0,
                                       backward_full_ms=2.5) for i in range(4)])
    cluster = ClusterSpec.preset("h100x2")
    split = schedules.build("zb-h1", cheap_fused, cluster, 4, partition=[0, 2, 4])
    fused = schedules.build("1f1b", cheap_fused, cluster, 4, partition=[0, 2, 4])
    refined = refine_order(split, cheap_fused, cluster, work=1.0)
    assert refined.full_model and refined.lower_bound_ms is not None
    assert simulate(fused, cheap_fused, cluster).iteration_ms < refined.lower_bound_ms  # a fused order beats it
    assert not refined.bound_covers_every_order
    # a full backward costing B and W together: splitting never loses, and the bound covers every order
    even = CostTable([LayerCost(f"l{i}", forward_ms=1.0, backward_ms=4.0, backward_weight_ms=2.0) for i in range(4)])
    refined = refine_order(schedules.build("zb-h1", even, cluster, 4, partition=[0, 2, 4]), even, cluster, work=1.0)
    assert refined.bound_covers_every_order
    assert refined.lower_bound_ms <= simulate(schedules.build("1f1b", even, cluster, 4, partition=[0, 2, 4]), even,
                                              cluster).iteration_ms + 1e-6
    # a plan with fused backwards: its bound is for fused orders only
    assert not refine_order(fused, even, cluster, work=1.0).bound_covers_every_order
