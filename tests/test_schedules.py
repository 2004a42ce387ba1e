"""Baseline schedules: closed-form times and memory on uniform costs, structure and definedness
on random inputs, partitions (uniform like Megatron, balanced exact / never worse than uniform).

Closed forms use equal per-layer costs and free communication (huge bandwidth, zero latency, no
bytes), so the simulator's time is pure compute plus the schedule's idle time. Notation: per
stage F (forward), B (full backward = input gradient B_in + weight gradient W), W; p devices,
m microbatches, v stages per device."""

from __future__ import annotations

import itertools
import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from octopipe import schedules
from octopipe.cluster import ClusterSpec
from octopipe.errors import ArgumentError, ClusterSpecError, PlanError
from octopipe.ir.costs import CostTable, LayerCost
from octopipe.ir.plan import OpKind, PipelinePlan
from octopipe.schedules import (
    NAMES,
    balanced_boundaries,
    balanced_partition,
    baselines,
    build,
    device_loads,
    placement_of,
    uniform_boundaries,
)
from octopipe.simulator import simulate

TOL = 1e-9


def uniform_costs(
    num_layers: int, forward_ms: float = 1.0, backward_ms: float = 2.0, weight_ms: float = 1.0,
    activation_bytes: int | None = None,
) -> CostTable:
    return CostTable([
        LayerCost(name=f"l{i}", forward_ms=forward_ms, backward_ms=backward_ms, backward_weight_ms=weight_ms,
                  activation_bytes=activation_bytes)
        for i in range(num_layers)
    ])


def free_cluster(num_devices: int) -> ClusterSpec:
    return ClusterSpec(num_devices=num_devices, devices_per_node=max(num_devices, 1), intra_node_bandwidth=1e30,
                       inter_node_bandwidth=1e30, latency_s=0.0)


def run(name: str, costs: CostTable, p: int, m: int, **kwargs):
    plan = build(name, costs, free_cluster(p), m, **kwargs)
    plan.validate(len(costs))
    return simulate(plan, costs, free_cluster(p))


# -- closed forms ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m_of_p", [lambda p: 1, lambda p: 2, lambda p: p, lambda p: 2 * p + 1, lambda p: 4 * p])
def test_1f1b_and_gpipe_take_m_plus_p_minus_1_slots(name, p, m_of_p):
    m = m_of_p(p)
    layers_per_stage = 2
    costs = uniform_costs(p * layers_per_stage, forward_ms=1.0, backward_ms=2.5, weight_ms=1.0)
    stage_f, stage_b = 1.0 * layers_per_stage, 2.5 * layers_per_stage  # B = full backward (no W ops)
    result = run(name, costs, p, m)
    assert result.iteration_ms == pytest.approx((m + p - 1) * (stage_f + stage_b), abs=TOL)
    assert not result.plan.split_backward()


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("m_of_p", [lambda p: p, lambda p: p + 1, lambda p: 2 * p, lambda p: 3 * p + 1])
@pytest.mark.parametrize("forward, backward, weight", [(1.0, 2.0, 1.0), (2.0, 3.0, 1.0), (1.0, 3.0, 1.0), (1.0, 2.0, 0.5)])
def test_zb_h1_bubble_is_p_minus_1_times_f_plus_b_minus_2w(p, m_of_p, forward, backward, weight):
    """Qi et al.: ZB-H1's bubble is (p-1)(T_F + T_B - T_W) with T_B the input gradient, i.e.
    (p-1)(F + B - 2W) with B the full backward. With F = B_in = W (first case) that is (p-1)F,
    one third of 1F1B's (p-1)(F + B). Proven here for every m >= p."""
    m = m_of_p(p)
    costs = uniform_costs(p, forward, backward, weight)  # one layer per stage
    result = run("zb-h1", costs, p, m)
    work = m * (forward + backward)
    bubble = (p - 1) * (forward + backward - 2 * weight)
    assert result.iteration_ms == pytest.approx(work + bubble, abs=TOL)
    for device in range(p):
        assert result.device_idle_ms[device] == pytest.approx(bubble, abs=TOL)
    if (forward, backward, weight) == (1.0, 2.0, 1.0):
        one_f_one_b = run("1f1b", costs, p, m).iteration_ms - work
        assert bubble == pytest.approx(one_f_one_b / 3)


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("forward, backward, weight", [(1.0, 2.0, 1.0), (1.0, 2.0, 0.5), (1.0, 3.0, 0.5), (2.0, 3.0, 1.0)])
def test_zb_h2_bubble_is_paper_formula_or_the_fill_slant(p, forward, backward, weight):
    """Qi et al.'s Table 1 gives ZB-H2 a bubble of (p-1)(T_F + T_B - 2 T_W), T_B the input gradient,
    i.e. (p-1)(F + B - 3W) with B full. The paper counts from each device's first op (its optimizer
    post-validation overlaps the fill with the previous iteration); in a synchronous iteration the
    last device cannot start before (p-1)F, so the simulated time is m(F+B) + (p-1) max(F, F+B-3W)
    for m >= 2p (and the bound (p-1)F is met: ZB-H2 is optimal on equal F = B_in = W)."""
    for m in (2 * p, 3 * p + 1):
        costs = uniform_costs(p, forward, backward, weight)
        result = run("zb-h2", costs, p, m)
        bubble = (p - 1) * max(forward, forward + backward - 3 * weight)
        assert result.iteration_ms == pytest.approx(m * (forward + backward) + bubble, abs=TOL)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("m_of_p", [lambda p: p, lambda p: 2 * p, lambda p: 3 * p, lambda p: 2 * p + 2])
def test_interleaved_1f1b_bubble_is_1f1b_bubble_over_v(p, v, m_of_p):
    """Narayanan et al. (SC'21): (p-1)(F+B)/v with F, B a device's whole share; proven for every m >= p
    that torch's round rule accepts (m = 2p+2 is not a multiple of p: torch's generalisation)."""
    m = m_of_p(p)
    if m % max(1, m // p):
        pytest.skip("microbatch count outside the interleaved round rule")
    costs = uniform_costs(p * v, forward_ms=1.0, backward_ms=2.0)  # one layer per stage
    device_f, device_b = 1.0 * v, 2.0 * v
    result = run("interleaved-1f1b", costs, p, m, stages_per_device=v)
    assert result.iteration_ms == pytest.approx(m * (device_f + device_b) + (p - 1) * (device_f + device_b) / v, abs=TOL)


@pytest.mark.parametrize("name", ["zb-v", "dualpipe-v"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m_of_p", [lambda p: 2 * p, lambda p: 2 * p + 1, lambda p: 4 * p, lambda p: 8 * p])
def test_v_schedules_reach_the_fill_lower_bound(name, p, m_of_p):
    """ZB-V near zero bubble once m >= 2p, with F = B_in = W per stage (f each). The tolerance
    proven: every device idles exactly (p-1) f, the time the first forward needs to reach the
    last device, which no schedule on this placement can avoid (device p-1 starts at (p-1) f
    and then has 6 m f of work). So the bubble ratio is (p-1) / (6m + p - 1) <= 1/13 for
    m >= 2p and -> 0 as m grows. DualPipeV without F&B overlap reaches the same bound."""
    m = m_of_p(p)
    f = 1.0
    costs = uniform_costs(2 * p, forward_ms=f, backward_ms=2 * f, weight_ms=f)  # one layer per stage
    result = run(name, costs, p, m)
    work = m * 2 * 3 * f  # 2 stages x (F + B_in + W)
    assert result.iteration_ms == pytest.approx(work + (p - 1) * f, abs=TOL)
    assert all(idle == pytest.approx((p - 1) * f, abs=TOL) for idle in result.device_idle_ms)
    assert result.bubble_ratio == pytest.approx((p - 1) / (6 * m + p - 1))
    assert result.bubble_ratio <= 1 / 13


@pytest.mark.parametrize("p", [1, 2, 4, 6])
@pytest.mark.parametrize("m_of_p", [lambda p: 1, lambda p: p - 1, lambda p: p, lambda p: 3 * p])
def test_peak_activations_match_the_papers(p, m_of_p):
    """1F1B stage i holds min(p-i, m) microbatches of activations at peak; ZB-H1 keeps 1F1B's peak
    (p on device 0), ZB-H2 about twice it (2p-1, Qi et al. Table 1), ZB-V p device-shares on every
    device once m >= 2p (its stages hold half a device's layers each)."""
    m = max(1, m_of_p(p))
    layers_per_stage, layer_bytes = 2, 34_000
    costs = uniform_costs(p * layers_per_stage, activation_bytes=layer_bytes)
    share = layers_per_stage * layer_bytes  # one microbatch's activations of one device's layers
    one_f_one_b = run("1f1b", costs, p, m).peak_activation_bytes
    assert one_f_one_b == tuple(min(p - i, m) * share for i in range(p))
    if m >= p:
        zb_h1 = run("zb-h1", costs, p, m).peak_activation_bytes
        assert max(zb_h1) == pytest.approx(p * share)
        assert zb_h1[0] == pytest.approx(p * share)
    if m >= 2 * p:
        zb_v = run("zb-v", costs, p, m).peak_activation_bytes
        assert zb_v == pytest.approx(tuple(p * share for _ in range(p)))
        assert run("zb-h2", costs, p, m).peak_activation_bytes[0] == pytest.approx((2 * p - 1) * share)


# -- structure, definedness, properties -----------------------------------------------------------

def expected_undefined(name: str, p: int, m: int, num_layers: int) -> bool:
    stages = p * (2 if name in ("interleaved-1f1b", "zb-v", "dualpipe-v") else 1)
    if num_layers < stages:
        return True
    if name == "dualpipe-v":
        return m < 2 * p
    if name == "interleaved-1f1b":
        return m % max(1, m // p) != 0
    return False


costs_strategy = st.integers(min_value=1, max_value=6).flatmap(
    lambda p: st.tuples(
        st.just(p),
        st.integers(min_value=1, max_value=3 * p + 3),  # microbatches, fewer than devices too
        st.lists(
            st.tuples(st.floats(0.1, 10.0), st.floats(0.1, 10.0), st.floats(0.0, 1.0), st.integers(0, 10**6)),
            min_size=p, max_size=4 * p + 2,
        ),
    )
)


def table_of(layers: list[tuple[float, float, float, int]]) -> CostTable:
    return CostTable([
        LayerCost(name=f"l{i}", forward_ms=f, backward_ms=b, backward_weight_ms=b * w, activation_bytes=a, output_bytes=a // 8)
        for i, (f, b, w, a) in enumerate(layers)
    ])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(costs_strategy, st.sampled_from(NAMES), st.sampled_from(["uniform", "balanced"]))
def test_every_schedule_validates_and_simulates(case, name, partition):
    p, m, layers = case
    costs = table_of(layers)
    cluster = ClusterSpec.preset("h100x8", num_devices=p)
    if expected_undefined(name, p, m, len(costs)):
        with pytest.raises(PlanError):
            build(name, costs, cluster, m, partition=partition)
        return
    plan = build(name, costs, cluster, m, partition=partition)
    plan.validate(len(costs))
    assert PipelinePlan.parse(str(plan)) == plan
    result = simulate(plan, costs, cluster)
    # every (stage, microbatch) has one F and one B; W where the family splits the backward
    counts = {kind: sum(op.kind is kind for ops in plan.device_ops for op in ops) for kind in OpKind}
    assert counts[OpKind.F] == counts[OpKind.B] == plan.num_stages * m
    assert counts[OpKind.W] == len(plan.split_backward())
    if name in ("zb-h1", "zb-h2", "zb-v"):
        assert counts[OpKind.W] == plan.num_stages * m
    # lower bounds: the busiest device's work, and one microbatch's F chain + B chain
    assert result.iteration_ms >= max(result.device_busy_ms) - TOL
    chain = sum(costs.forward) + min(sum(costs.backward_input), sum(costs.backward_full))
    assert result.iteration_ms >= chain - TOL


@settings(max_examples=100, deadline=None)
@given(costs_strategy, st.sampled_from(NAMES))
def test_balanced_is_never_worse_than_uniform_in_max_device_load(case, name):
    p, _, layers = case
    costs = table_of(layers)
    placement = placement_of(name, p)
    if len(costs) < len(placement):
        return
    weights = [f + b for f, b in zip(costs.forward, costs.backward_full)]
    uniform = uniform_boundaries(len(costs), len(placement))
    balanced = balanced_partition(weights, placement, start=uniform)
    assert max(device_loads(balanced, placement, weights)) <= max(device_loads(uniform, placement, weights)) + TOL
    plan = build(name, costs, ClusterSpec.preset("h100x8", num_devices=p), 2 * p, partition="balanced")
    assert plan.boundaries == balanced


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(0.0, 100.0), min_size=1, max_size=9), st.data())
def test_balanced_boundaries_is_the_exact_min_max_split(weights, data):
    parts = data.draw(st.integers(1, len(weights)))
    bounds = balanced_boundaries(weights, parts)
    assert bounds[0] == 0 and bounds[-1] == len(weights) and len(bounds) == parts + 1
    assert all(a < b for a, b in zip(bounds, bounds[1:]))

    def heaviest(cuts: tuple[int, ...]) -> float:
        edges = (0, *cuts, len(weights))
        return max(sum(weights[a:b]) for a, b in zip(edges, edges[1:]))

    best = min(heaviest(cuts) for cuts in itertools.combinations(range(1, len(weights)), parts - 1))
    assert heaviest(bounds[1:-1]) == pytest.approx(best, rel=1e-9, abs=1e-9)


def test_balanced_boundaries_finds_the_min_max_when_a_prefix_difference_rounds_a_layer_down():
    # found by the property test above: prefix[4] - prefix[3] is 3e-14 below the layer's weight,
    # which once excluded the optimal cap (99.06) and gave a 100.06 part
    weights = [2.0, 56.7372705212961, 98.77731972414219, 99.05758900143465, 1.0]
    assert balanced_boundaries(weights, 4) == (0, 2, 3, 4, 5)


def test_balanced_moves_layers_off_a_heavy_head():
    weights = [1.0] * 7 + [5.0]
    assert balanced_boundaries(weights, 2) == (0, 6, 8)  # 6 | 1+5: the head stage takes one layer
    assert balanced_boundaries([1, 1, 1, 1], 4) == (0, 1, 2, 3, 4)


# -- uniform partitions like Megatron -------------------------------------------------------------

@pytest.mark.parametrize("kwargs, expected", [
    ({}, (0, 3, 6, 8, 10)),  # 10 = 3+3+2+2: remainder on the first stages
    ({"first_stage_layers": 1}, (0, 1, 4, 7, 10)),
    ({"last_stage_layers": 1}, (0, 3, 6, 9, 10)),
    ({"first_stage_layers": 2, "last_stage_layers": 2}, (0, 2, 5, 8, 10)),
    ({"account_for_embedding": True}, (0, 2, 5, 8, 10)),  # 11 virtual layers: 3,3,3,2; stage 0 loses one
    ({"account_for_loss": True}, (0, 3, 6, 9, 10)),
    ({"account_for_embedding": True, "account_for_loss": True}, (0, 2, 5, 8, 10)),  # 12 virtual: 3 each
])
def test_uniform_boundaries_follow_megatron_options(kwargs, expected):
    assert uniform_boundaries(10, 4, **kwargs) == expected


def test_uniform_options_reach_build_and_are_checked():
    costs = uniform_costs(12)
    cluster = free_cluster(4)
    plan = build("1f1b", costs, cluster, 4, first_stage_layers=1, last_stage_layers=2)
    assert plan.boundaries == (0, 1, 6, 10, 12)  # 9 middle layers: 5 + 4
    # 8 stages, 16 + 2 virtual layers: 3,3,2,2,2,2,2,2, then the embedding and loss slots come off
    plan = build("interleaved-1f1b", uniform_costs(16), cluster, 4, account_for_embedding=True, account_for_loss=True)
    assert plan.boundaries == (0, 2, 5, 7, 9, 11, 13, 15, 16)
    with pytest.raises(PlanError, match="exclude"):
        uniform_boundaries(10, 4, first_stage_layers=2, account_for_embedding=True)
    with pytest.raises(PlanError, match="at least one layer"):
        uniform_boundaries(4, 4, first_stage_layers=2)
    with pytest.raises(PlanError, match="uniform"):
        build("1f1b", costs, cluster, 4, partition="balanced", first_stage_layers=2)
    with pytest.raises(ArgumentError, match="unknown option"):
        build("1f1b", costs, cluster, 4, virtual_stages=2)


# -- errors name the constraint -------------------------------------------------------------------

def test_undefined_inputs_raise_plan_errors_that_say_why():
    costs, cluster = uniform_costs(16), free_cluster(4)
    with pytest.raises(PlanError, match=r"dualpipe-v needs num_microbatches >= 2 \* num_devices \(8\), got 7"):
        build("dualpipe-v", costs, cluster, 7)
    with pytest.raises(PlanError, match="not a multiple of 2"):
        build("interleaved-1f1b", costs, cluster, 9)
    with pytest.raises(PlanError, match="needs 8 stages but the cost table .* has only 6 layers"):
        build("zb-v", uniform_costs(6), cluster, 8)
    with pytest.raises(PlanError, match="exactly 2 stage"):
        build("zb-v", costs, cluster, 8, stages_per_device=3)
    with pytest.raises(ArgumentError, match="unknown schedule 'zb-h3'"):
        build("zb-h3", costs, cluster, 8)
    with pytest.raises(ArgumentError, match="num_devices=5 but the cluster"):
        build("1f1b", costs, cluster, 8, num_devices=5)
    with pytest.raises(ArgumentError, match="num_microbatches must be a positive integer"):
        build("1f1b", costs, cluster, 0)
    with pytest.raises(PlanError, match="strictly increasing boundaries"):
        build("1f1b", costs, cluster, 8, partition=[0, 4, 4, 8, 16])
    plan = build("1f1b", costs, cluster, 8, partition=[0, 1, 2, 3, 16])
    assert plan.boundaries == (0, 1, 2, 3, 16)


def test_schedules_with_fewer_microbatches_than_devices():
    costs = uniform_costs(16)
    for name in NAMES:
        for m in (1, 2, 3):
            if expected_undefined(name, 8, m, 16):
                continue
            result = run(name, costs, 8, m)
            assert result.plan.num_microbatches == m


def test_interleaved_takes_any_number_of_chunks():
    costs = uniform_costs(12)
    plan = build("interleaved-1f1b", costs, free_cluster(2), 4, stages_per_device=3)
    assert plan.placement == (0, 1, 0, 1, 0, 1)
    assert placement_of("zb-v", 3) == (0, 1, 2, 2, 1, 0)


# -- baselines and speed --------------------------------------------------------------------------

def test_baselines_cover_every_defined_family_and_partition():
    costs, cluster = uniform_costs(16), free_cluster(4)
    plans = baselines(costs, cluster, 4)
    assert list(plans) == [
        f"{name}/{partition}" for name in NAMES for partition in ("uniform", "balanced") if name != "dualpipe-v"
    ]
    plans = baselines(costs, cluster, 8)
    assert len(plans) == 2 * len(NAMES)
    for key, plan in plans.items():
        plan.validate(len(costs))
        assert key.split("/")[0] in NAMES
    assert set(baselines(uniform_costs(6), cluster, 8)) == {
        f"{name}/{partition}" for name in ("gpipe", "1f1b", "zb-h1", "zb-h2") for partition in ("uniform", "balanced")
    }


def test_building_16_devices_128_microbatches_is_fast():
    costs = CostTable([LayerCost(name=f"l{i}", forward_ms=1.0 + (i % 3), backward_ms=2.0) for i in range(64)])
    cluster = ClusterSpec.preset("h100x16")
    for name in NAMES:
        for partition in ("uniform", "balanced"):
            best = math.inf
            for _ in range(3):
                start = time.perf_counter()
                plan = build(name, costs, cluster, 128, partition=partition)
                best = min(best, time.perf_counter() - start)
            assert plan.num_devices == 16
            assert best < 0.05, f"{name}/{partition} took {best * 1e3:.1f} ms"


def test_device_orders_do_not_depend_on_costs():
    orders = schedules.device_orders("zb-v", 4, 8)
    plan = build("zb-v", uniform_costs(8), free_cluster(4), 8, partition="balanced")
    assert plan.device_ops == orders


def test_build_takes_a_preset_name_as_plan_and_compile_do():
    costs = CostTable(tuple(LayerCost(f"l{i}", forward_ms=1.0 + i % 3, backward_ms=2.0) for i in range(8)))
    named = schedules.build("zb-v", costs, "h100x4", 8, partition="balanced")
    assert named == schedules.build("zb-v", costs, ClusterSpec.preset("h100x4"), 8, partition="balanced")
    with pytest.raises(ClusterSpecError, match="unknown cluster preset 'h100x99x'"):
        schedules.build("zb-v", costs, "h100x99x", 8)
