"""`octopipe.plan`: the plan it returns simulates to what its report says, fits the limits, never
loses to a baseline that fits, is deterministic; bad inputs fail with the fix in the message."""

import itertools
import json
import math
import os
import random
import re
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import octopipe
from octopipe import ClusterSpec, CostTable, InfeasibleError, LayerCost, PipelinePlan
from octopipe.ir import TiedParameter
from octopipe.simulator import simulate

GiB = 2**30


def heterogeneous(seed, num_layers=10, params=0):
    rng = random.Random(seed)
    layers = []
    for i in range(num_layers):
        forward = rng.uniform(0.5, 3.0) * (4 if i == num_layers - 1 else 1)
        backward = forward * rng.uniform(1.5, 2.5)
        layers.append(LayerCost(f"l{i}", forward_ms=forward, backward_ms=backward,
                                activation_bytes=rng.randint(1, 3) * 2**28, output_bytes=2**24,
                                param_bytes=params))
    return CostTable(layers)


def check_result(result, costs, cluster, memory_limit=None):
    report, plan = result.report, result.plan
    plan.validate(len(costs))
    sim = simulate(plan, costs, cluster)
    assert sim.iteration_ms == pytest.approx(report.iteration_ms)
    assert result.simulation.iteration_ms == pytest.approx(report.iteration_ms)
    if report.activation_limit_bytes is not None:
        assert max(sim.peak_activation_bytes) <= report.activation_limit_bytes * (1 + 1e-9)
    assert max(sim.peak_memory_bytes) <= (memory_limit or cluster.memory_bytes) * (1 + 1e-9)
    fitting = report.best_fitting_baseline
    if fitting is not None:
        assert report.iteration_ms <= fitting.iteration_ms + 1e-9
    assert report.lower_bound_ms <= report.iteration_ms + 1e-6
    assert report.lower_bound_ms >= 0.99 * report.balance_bound_ms  # less rounding slack; the release bound adds
    assert PipelinePlan.parse(str(plan)) == plan


def test_plan_report_matches_the_simulation_and_beats_what_fits():
    costs = heterogeneous(1)
    cluster = ClusterSpec.preset("h100x4")
    result = octopipe.plan(costs, cluster, 8, activation_limit="1f1b", quiet=True, effort=0.05)
    check_result(result, costs, cluster)
    text = str(result.report)
    for needle in ("1f1b/uniform", "zb-v/balanced", "octopipe tuner", "balance bound", "lower bound", "gap"):
        assert needle in text
    assert result.report.balance_bound_optimal
    assert not result.report.cut_short
    # the order bound of the plan's own structure: at most the plan, printed and saved
    report = result.report
    assert 0 < report.order_bound_ms <= report.iteration_ms
    assert "order bound" in text and report.to_dict()["order_bound_ms"] == report.order_bound_ms
    # the bound ignores memory: the report says so exactly where memory binds
    for limit in ("1f1b", None):
        report = octopipe.plan(costs, cluster, 8, activation_limit=limit, quiet=True, effort=0.05).report
        said = any("lower bound ignores memory" in note for note in report.notes)
        assert said == (not report.best_baseline.fits)
        assert said == (limit is not None)


@pytest.mark.timeout(180)
def test_the_solver_gets_more_work_where_the_order_bound_leaves_room(monkeypatch):
    # the demo's model as profiled on this CPU (10 layers, 2 processes, 4 microbatches): the
    # tuner's 6-stage plan is 5% above its structure's order bound (it was 14% until stop 36, when
    # the longer CP-SAT model found an order 6.5% faster); the longer model still improves on it
    saved = octopipe.api.load_saved_plan(os.path.join(os.path.dirname(__file__), "data", "demo_cpu_plan.json"))
    costs, cluster = saved.costs, saved.cluster

    def planned():
        result = octopipe.plan(costs, cluster, 4, time_limit_s=120, activation_limit="1f1b", quiet=True)
        check_result(result, costs, cluster)
        rows = {row.name: row.iteration_ms for row in result.report.rows}
        return result, rows["octopipe tuner"]

    result, tuner_ms = planned()
    assert any("CP-SAT given" in note for note in result.report.notes), result.report.notes
    assert result.report.iteration_ms < tuner_ms - 1.0, (result.report.iteration_ms, tuner_ms)
    assert result.report.order_bound_ms <= result.report.iteration_ms
    monkeypatch.setattr(octopipe.api, "WHOLE_ORDER_WORK", octopipe.api.SOLVER_WORK)
    short, short_tuner_ms = planned()
    assert short_tuner_ms == pytest.approx(tuner_ms)  # the same tuner plan: only the solver's work differs
    # one worker, the same hint: the longer model continues the short one's search
    assert result.report.iteration_ms <= short.report.iteration_ms + 1e-9


def test_a_tiny_model_plan_is_never_slower_than_any_baseline_on_any_partition():
    # found by fuzzing (2 devices, 4 layers, the cpux2 preset's 2 GB/s link): block l1's output
    # takes 20 ms to send, the embedding's 1.2 ms, so the best cut is after the embedding, far from
    # the compute-balanced one; the search climbed only the 4-stage starts (uniform and balanced
    # coincide, and the same start was climbed twice) and returned 241.2 ms where zb-h2 on
    # [0, 1, 4] runs 181.5; a tiny table's every partition is now a start
    def layer(name, kind, f, b, w, activation, output, params):
        return LayerCost(name, kind=kind, forward_ms=f, backward_ms=b, backward_weight_ms=w,
                         activation_bytes=activation, output_bytes=output, param_bytes=params)

    costs = CostTable([layer("l0", "embedding", 0.8837, 1.3605, 0.6279, 74465392, 2404181, 267786548),
                       layer("l1", "block", 9.4046, 16.7395, None, 352668006, 40555963, 230571233),
                       layer("l2", "block", 0.9813, 2.2971, 0.7638, 202346290, 27942647, 7604230),
                       layer("l3", "head", 4.5615, 8.4583, 3.8375, 120536107, 40137648, 353979751)], model="fuzz 515")
    cluster = ClusterSpec.preset("cpux2")
    result = octopipe.plan(costs, cluster, 4, quiet=True, effort=0.2, memory_limit_bytes=10**15)
    best = math.inf
    for name in octopipe.schedules.NAMES:
        stages = len(octopipe.schedules.placement_of(name, 2))
        for cuts in itertools.combinations(range(1, 4), stages - 1):
            plan_ = octopipe.schedules.build(name, costs, cluster, 4, partition=[0, *cuts, 4])
            best = min(best, simulate(plan_, costs, cluster).iteration_ms)
    assert best == pytest.approx(181.5217, abs=1e-3)
    assert result.report.iteration_ms <= best * (1 + 1e-9)


def test_min_gain_keeps_the_best_fitting_baseline_unless_the_search_beats_it_by_that_much():
    costs = heterogeneous(1)
    cluster = ClusterSpec.preset("h100x4")
    searched = octopipe.plan(costs, cluster, 8, activation_limit="1f1b", quiet=True, effort=0.05)
    fitting = searched.report.best_fitting_baseline
    gain = fitting.iteration_ms / searched.report.iteration_ms - 1
    assert gain > 0.002
    kept = octopipe.plan(costs, cluster, 8, activation_limit="1f1b", quiet=True, effort=0.05, min_gain=gain + 0.001)
    assert kept.report.chosen == fitting.name and kept.report.iteration_ms == fitting.iteration_ms
    family, partition = fitting.name.split("/")
    assert kept.plan == octopipe.schedules.build(family, costs, cluster, 8, partition=partition)
    assert kept.simulation.iteration_ms == pytest.approx(fitting.iteration_ms)
    assert any("under min_gain" in note for note in kept.report.notes)
    assert "*" + fitting.name in str(kept.report)
    check_result(kept, costs, cluster)
    assert kept.runners_up[0] == searched.plan  # faster on paper: the first alternative to measure
    below = octopipe.plan(costs, cluster, 8, activation_limit="1f1b", quiet=True, effort=0.05, min_gain=gain / 2)
    assert below.plan == searched.plan and below.report.chosen == searched.report.chosen
    with pytest.raises(octopipe.ArgumentError, match="min_gain"):
        octopipe.plan(costs, cluster, 8, quiet=True, min_gain=2)


def test_a_saved_plan_carries_its_costs_cluster_and_prediction(tmp_path):
    from octopipe.api import load_plan, load_saved_plan

    costs = heterogeneous(3)
    cluster = ClusterSpec.preset("h100x16", num_devices=4)
    result = octopipe.plan(costs, cluster, 8, quiet=True, effort=0.05)
    result.save(tmp_path / "plan.json")
    saved = load_saved_plan(tmp_path / "plan.json")
    assert saved.plan == result.plan and saved.costs == costs and saved.cluster == cluster
    assert saved.iteration_ms == result.report.iteration_ms
    assert simulate(saved.plan, saved.costs, saved.cluster).iteration_ms == pytest.approx(saved.iteration_ms)
    assert load_plan(tmp_path / "plan.json") == result.plan  # readers of the plan alone skip the context
    result.save(tmp_path / "plan.txt")  # the text form is the plan alone
    text = load_saved_plan(tmp_path / "plan.txt")
    assert text.plan == result.plan and text.costs is None and text.cluster is None and text.iteration_ms is None
    edited = json.loads((tmp_path / "plan.json").read_text())
    edited["planned_with"]["costs"]["layers"].pop()
    (tmp_path / "edited.json").write_text(json.dumps(edited))
    with pytest.raises(octopipe.ParseError, match="9"):
        load_saved_plan(tmp_path / "edited.json")
    edited["planned_with"] = ["not", "an", "object"]
    (tmp_path / "edited.json").write_text(json.dumps(edited))
    with pytest.raises(octopipe.ParseError, match="planned_with"):
        load_saved_plan(tmp_path / "edited.json")


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**6), st.integers(2, 4), st.sampled_from([1, 2, 4]))
def test_plan_properties_on_random_heterogeneous_tables(seed, p, factor):
    costs = heterogeneous(seed, num_layers=random.Random(seed).randint(p, 3 * p + 2))
    cluster = ClusterSpec.preset("h100x8", num_devices=p)
    result = octopipe.plan(costs, cluster, factor * p, activation_limit="1f1b", quiet=True, effort=0.02,
                           solver=seed % 2 == 0)
    check_result(result, costs, cluster)


# Tables where a looser activation limit planned slower (stop 37's fuzz: 28 of 105 random tables,
# up to 3x slower): (preset, devices, microbatches, layers as (F ms, B ms, activation in 256 MiB
# units, output in 16 MiB units)). The first three send tens of MB over a 2 GB/s link, where
# fewer devices win; the last two win by recomputing a stage that the baselines never recompute.
NOT_MONOTONE = [
    ("cpux2", 3, 3, [(1.614, 3.930, 1, 1), (0.520, 0.816, 2, 4), (3.270, 5.382, 2, 4)]),
    ("cpux2", 4, 6, [(2.868, 6.062, 1, 4), (2.235, 3.447, 1, 1), (1.377, 3.164, 2, 4), (1.238, 2.742, 1, 2),
                     (1.685, 2.941, 2, 2), (2.178, 4.037, 1, 4), (8.940, 15.117, 3, 2)]),
    ("cpux2", 2, 3, [(2.804, 4.238, 1, 1), (2.424, 5.533, 2, 2), (2.978, 6.760, 1, 4), (1.677, 2.955, 3, 4),
                     (2.722, 5.180, 1, 2), (1.064, 2.081, 3, 4), (1.798, 4.289, 3, 2), (4.186, 9.238, 2, 4)]),
    ("h100x8", 2, 4, [(2.697, 4.085, 3, 1), (1.664, 3.217, 2, 1), (1.267, 2.401, 2, 1), (0.510, 0.954, 1, 1),
                      (5.465, 13.052, 2, 1)]),
    # stop 38: a climb held at a stage recomputing at no cost in time (4.2% slower at 0.8 x the
    # limit than at 0.6 x; split backwards, B then W), and the fewer devices' structures not
    # recomputing where the main search did (2.8%)
    ("cpux2", 5, 8, [(1.474, 2.728, 3, 1, 1.225), (2.695, 4.931, 2, 1, 2.268), (1.092, 2.274, 3, 1, 1.315),
                     (2.249, 5.623, 2, 1, 2.317), (1.662, 3.849, 1, 1, 1.419), (8.397, 16.998, 2, 1, 9.653)]),
    # known to fail since stop 50 (the simulator counts what a forward sends until sent): at 0.6 x
    # the limit a perturbation of the runner-up search finds a plan 0.04% faster (422.12 ms) than
    # the whole search at 0.8 x (422.28 ms), though it fits both; seed 1 plans 422.28 and 418.43
    pytest.param("cpux2", 4, 8, [(1.592, 3.683, 3, 1), (2.783, 6.798, 1, 4), (1.286, 3.212, 1, 1),
                                 (1.452, 2.704, 2, 2), (1.511, 3.131, 2, 1), (2.816, 6.258, 1, 2),
                                 (0.938, 1.445, 3, 1), (5.243, 10.252, 3, 1)],
                 marks=pytest.mark.xfail(strict=True, reason="search luck at 0.6 x the limit, issue 4's monotonicity")),
]


@pytest.mark.parametrize("preset, p, m, layers", NOT_MONOTONE)
def test_a_looser_activation_limit_never_plans_slower_where_it_did(preset, p, m, layers):
    costs = CostTable([LayerCost(f"l{i}", forward_ms=f, backward_ms=b, activation_bytes=a * 2**28,
                                 output_bytes=o * 2**24, backward_weight_ms=w[0] if w else None)
                       for i, (f, b, a, o, *w) in enumerate(layers)])
    cluster = ClusterSpec.preset(preset, num_devices=p)
    options = dict(quiet=True, effort=0.05, solver=False, seed=0)
    limit = octopipe.plan(costs, cluster, m, activation_limit="1f1b", **options).report.activation_limit_bytes
    times = []
    for factor in (0.6, 0.8, 1.0, 1.25, 1.6, 2.2):
        try:
            result = octopipe.plan(costs, cluster, m, activation_limit=factor * limit, **options)
        except InfeasibleError:
            continue
        check_result(result, costs, cluster)
        times.append((factor, result.report.iteration_ms))
    assert len(times) >= 4
    for (low, tighter), (high, looser) in itertools.pairwise(times):
        assert looser <= tighter * (1 + 1e-9), f"{high} x the 1F1B limit: {looser:.2f} ms, {low} x: {tighter:.2f} ms"


@pytest.mark.parametrize("seed", [9, 20])
def test_a_looser_activation_limit_never_plans_slower_on_random_tables(seed):
    # random tables whose plan changes between the limits (on stop 36's code seed 9 planned 5.1%
    # slower at the 1F1B limit than at 0.8 of it)
    rng = random.Random(seed)
    p = rng.randint(2, 5)
    m, preset = rng.randint(p, 3 * p), rng.choice(["h100x8", "cpux2"])
    costs = heterogeneous(seed, num_layers=rng.randint(p, 3 * p + 2))
    cluster = ClusterSpec.preset(preset, num_devices=p)
    options = dict(quiet=True, effort=0.05, solver=False, seed=0)
    limit = octopipe.plan(costs, cluster, m, activation_limit="1f1b", **options).report.activation_limit_bytes
    times = [octopipe.plan(costs, cluster, m, activation_limit=factor * limit, **options).report.iteration_ms
             for factor in (0.8, 1.0, 1.6)]
    assert times[1] <= times[0] * (1 + 1e-9) and times[2] <= times[1] * (1 + 1e-9), times


def test_a_costly_tied_all_reduce_keeps_the_tied_layers_inside_one_node():
    # the last layer is the head, tied with layer 0; its all-reduce costs ~40 ms a step across
    # the nodes (of 2 devices here), several times a layer's work, and ~4 ms inside one
    costs = replace(heterogeneous(3, num_layers=10, params=2**20),
                    tied=(TiedParameter("embed.weight", (0, 9), 2 * 10**9),), _derived={})
    cluster = replace(ClusterSpec.preset("h100x16", num_devices=4), devices_per_node=2)
    result = octopipe.plan(costs, cluster, 8, activation_limit="1f1b", quiet=True, effort=0.05)
    check_result(result, costs, cluster)
    for reduction in result.simulation.reductions:
        assert len({cluster.node_of(d) for d in reduction.devices}) == 1, reduction
        assert reduction.end_ms - reduction.start_ms < 5
    split = [row for row in result.report.baselines if row.name == "1f1b/balanced"]
    assert split and split[0].iteration_ms > result.report.iteration_ms + 40  # pays the all-reduce


def test_tied_layers_on_one_device_count_their_parameter_once_in_the_activation_limit():
    # layers 0 and 1 share one 8 MiB weight: on one device the simulator counts it once, so the
    # tuner must too when it takes the fixed bytes out of a device's peak (it counted it twice, took
    # 16 MiB too much for weights, and returned a plan holding 80 MiB of activations under a 20 MiB limit)
    mib = 2**20
    costs = CostTable([LayerCost(f"l{i}", forward_ms=1.0, backward_ms=2.0, activation_bytes=10 * mib, output_bytes=mib,
                                 param_bytes=8 * mib if i in (0, 1) else 0) for i in range(4)],
                      tied=(TiedParameter("w", (0, 1), 8 * mib),))
    cluster = ClusterSpec.preset("h100x2")
    result = octopipe.plan(costs, cluster, 4, activation_limit=20 * mib, quiet=True, time_limit_s=10, effort=0.05)
    assert result.report.chosen_row.fits
    assert max(simulate(result.plan, costs, cluster).peak_activation_bytes) <= 20 * mib * (1 + 1e-9)  # (float sums)
    check_result(result, costs, cluster)


def test_the_report_says_what_memory_can_bind_on_a_table_without_activation_bytes():
    # no activation_bytes, but weights: the memory limit still rules plans out (gpipe/uniform here)
    weighted = CostTable([LayerCost(f"l{i}", forward_ms=1.0, backward_ms=2.0, param_bytes=2**28 * (i + 1))
                          for i in range(4)])
    report = octopipe.plan(weighted, ClusterSpec.preset("h100x2"), 4, memory_limit_bytes=13 * 2**30, quiet=True,
                           effort=0.05).report
    assert any(not row.fits for row in report.baselines)
    assert not any("memory limits cannot bind" in note for note in report.notes)
    assert any("only weights, gradients and optimizer state count" in note for note in report.notes)
    bare = CostTable([LayerCost(f"l{i}", forward_ms=1.0, backward_ms=2.0) for i in range(4)])
    report = octopipe.plan(bare, ClusterSpec.preset("h100x2"), 4, quiet=True, effort=0.05).report
    assert any("memory limits cannot bind" in note for note in report.notes)


def test_plan_is_deterministic_for_a_seed():
    costs = heterogeneous(3, num_layers=12)
    cluster = ClusterSpec.preset("h100x4")
    texts = {str(octopipe.plan(costs, cluster, 8, activation_limit="1f1b", quiet=True, effort=0.03, seed=5).plan)
             for _ in range(2)}
    assert len(texts) == 1


def test_more_effort_never_gives_a_slower_plan():
    costs = heterogeneous(4, num_layers=12)
    cluster = ClusterSpec.preset("h100x4")
    times = [octopipe.plan(costs, cluster, 8, activation_limit="1f1b", quiet=True, effort=effort, solver=False)
             .report.iteration_ms for effort in (0.01, 0.04)]
    assert times[1] <= times[0] + 1e-9


def test_memory_limit_no_plan_can_meet_says_the_least_that_works():
    costs = heterogeneous(2, params=2**30)  # 8 GiB of weights + state per layer
    cluster = ClusterSpec.preset("h100x4")
    with pytest.raises(InfeasibleError) as error:
        octopipe.plan(costs, cluster, 8, memory_limit_bytes=10 * GiB, quiet=True)
    message = str(error.value)
    # one 8 GiB layer per device fits 10 GiB; two do not: as many devices as layers
    assert "GiB" in message and "use 10 devices" in message and "Raise the memory limit to" in message
    # no count of devices helps when one layer alone is over the limit (it once said ~850 devices)
    with pytest.raises(InfeasibleError, match="more devices cannot help"):
        octopipe.plan(costs, cluster, 8, memory_limit_bytes=4 * GiB, quiet=True)


def test_activation_limit_below_one_microbatch_is_infeasible_with_the_fix():
    costs = heterogeneous(2)
    cluster = ClusterSpec.preset("h100x4")
    with pytest.raises(InfeasibleError, match="Raise activation_limit to .* which always works"):
        octopipe.plan(costs, cluster, 8, activation_limit=2**20, quiet=True)


@pytest.mark.parametrize("activations, limit, recompute", [
    ([10, 10, 1, 1], 11.5, False),  # a V placement (layers 0 and 3 on device 0) holds 11 MiB at most
    ([10, 10, 10, 10], 12, True),  # every stage recomputing holds its inputs and outputs, then one layer
])
def test_limits_only_a_v_placement_or_recomputation_meets_are_searched_not_refused(activations, limit, recompute):
    # no contiguous split with one stage per device fits these limits, which plan() once took for
    # "no plan fits" (and named a least limit that was not the least)
    mib = 2**20
    costs = CostTable([LayerCost(f"l{i}", forward_ms=1.0, backward_ms=2.0, activation_bytes=a * mib,
                                 output_bytes=mib // 4) for i, a in enumerate(activations)])
    cluster = ClusterSpec.preset("h100x2")
    result = octopipe.plan(costs, cluster, 1, activation_limit=int(limit * mib), quiet=True, time_limit_s=10,
                           effort=0.05, recompute=recompute)
    assert max(simulate(result.plan, costs, cluster).peak_activation_bytes) <= limit * mib
    check_result(result, costs, cluster)


def test_limits_the_search_cannot_meet_raise_infeasible_with_what_works():
    # four 10 MiB layers on 2 devices without recomputation: a device holds two layers' activations
    # at once in every plan, so 15 MiB is out of reach, though over the largest layer's 10 MiB; the
    # fix holds two layers and what the first device's forward sends on (0.25 MiB, until sent)
    mib = 2**20
    costs = CostTable([LayerCost(f"l{i}", forward_ms=1.0, backward_ms=2.0, activation_bytes=10 * mib,
                                 output_bytes=mib // 4) for i in range(4)])
    with pytest.raises(InfeasibleError, match=r"the search found no plan within the limits: .*Raise activation_limit "
                                              r"to 20\.2 MiB \(21233664 bytes\), which always works \(to at least 10\.0 MiB"):
        octopipe.plan(costs, ClusterSpec.preset("h100x2"), 2, activation_limit=15 * mib, quiet=True, time_limit_s=10,
                      effort=0.05, recompute=False)


def test_the_limit_infeasible_suggests_counts_what_a_stage_receives_and_does_not_save():
    # as above, but layer 2 saves none of the 4 MiB it receives (a loss's logits): a stage
    # starting there holds them too, so the even split needs 4 + 20 MiB on its second device,
    # not the 20.25 MiB of the first; the fix named is that, and a plan at it fits
    mib = 2**20
    costs = CostTable([LayerCost(f"l{i}", forward_ms=1.0, backward_ms=2.0, activation_bytes=10 * mib,
                                 output_bytes=mib // 4, unsaved_input_bytes=4 * mib if i == 2 else None)
                       for i in range(4)])
    cluster = ClusterSpec.preset("h100x2")
    with pytest.raises(InfeasibleError, match=r"Raise activation_limit to 24\.0 MiB \(25165824 bytes\), which always "
                                              r"works"):
        octopipe.plan(costs, cluster, 2, activation_limit=15 * mib, quiet=True, time_limit_s=10, effort=0.05,
                      recompute=False)
    result = octopipe.plan(costs, cluster, 2, activation_limit=24 * mib, quiet=True, time_limit_s=10, effort=0.05,
                           recompute=False)
    assert max(simulate(result.plan, costs, cluster).peak_activation_bytes) <= 24 * mib
    check_result(result, costs, cluster)


def test_infeasible_names_every_limit_that_binds_and_its_fix_works():
    # 4 layers of 2 GiB state and 1 GiB activations on 2 devices: 3.5 GiB cannot hold half the
    # state, and 1.5 GiB of activations is under an even split's 2 GiB; the message names both
    costs = CostTable([LayerCost(f"l{i}", forward_ms=1.0, backward_ms=2.0, activation_bytes=GiB, output_bytes=2**20,
                                 param_bytes=2**28) for i in range(4)])
    cluster = ClusterSpec.preset("h100x2")
    with pytest.raises(InfeasibleError) as error:
        octopipe.plan(costs, cluster, 4, memory_limit_bytes=3.5 * GiB, activation_limit=1.5 * GiB, quiet=True)
    message = str(error.value)
    assert "Raise the memory limit to 6.00 GiB" in message and "the activation limit binds too: raise it to 2.00 GiB" \
        in message
    result = octopipe.plan(costs, cluster, 4, memory_limit_bytes=6 * GiB, activation_limit=2 * GiB, quiet=True,
                           effort=0.05)
    check_result(result, costs, cluster, memory_limit=6 * GiB)



def _suggested_bytes(message, what):
    return int(re.search(rf"{what} to [^(]*\((\d+) bytes\)", message).group(1))


def test_the_memory_limit_infeasible_suggests_works_with_the_activation_limit_as_given():
    # two 4 GiB-activation layers must sit on different devices under a 5 GiB activation limit, so
    # the 6 GiB of state shares a device with one of them: 10 GiB, not the 8 GiB an even split
    # needs (which plan() once suggested, and then refused)
    layers = [LayerCost("l0", forward_ms=1, backward_ms=2, param_bytes=6 * GiB // 8, output_bytes=2**20),
              LayerCost("l1", forward_ms=1, backward_ms=2, activation_bytes=4 * GiB, output_bytes=2**20),
              LayerCost("l2", forward_ms=1, backward_ms=2, activation_bytes=4 * GiB, output_bytes=2**20),
              LayerCost("l3", forward_ms=1, backward_ms=2, output_bytes=2**20)]
    costs, cluster = CostTable(layers), ClusterSpec.preset("h100x2")
    options = dict(activation_limit=5 * GiB, recompute=False, quiet=True, time_limit_s=10, effort=0.1)
    with pytest.raises(InfeasibleError) as error:
        octopipe.plan(costs, cluster, 4, memory_limit_bytes=7 * GiB, **options)
    message = str(error.value)
    assert "the activation limit, 5.00 GiB, is why" in message
    need = _suggested_bytes(message, "Raise the memory limit")
    assert need == pytest.approx(10 * GiB + 2**20, rel=1e-9)  # (and what l1's forward sends on)
    result = octopipe.plan(costs, cluster, 4, memory_limit_bytes=need, **options)
    check_result(result, costs, cluster, memory_limit=need)



def test_the_device_count_infeasible_suggests_works_with_the_activation_limit():
    # 6 GiB of state, then four layers of 2 GiB activations, under 7 GiB and activations of 3 GiB:
    # the memory alone fits three devices (6 | 2+2+2 | 2), the activation limit wants one layer
    # of activations per device: five (it once said three, which plan then refused)
    layers = [LayerCost("l0", forward_ms=1, backward_ms=2, param_bytes=6 * GiB // 8, output_bytes=2**20)]
    layers += [LayerCost(f"l{i}", forward_ms=1, backward_ms=2, activation_bytes=2 * GiB, output_bytes=2**20)
               for i in range(1, 5)]
    costs = CostTable(layers)
    options = dict(activation_limit=3 * GiB, memory_limit_bytes=7 * GiB, recompute=False, quiet=True,
                   time_limit_s=10, effort=0.1)
    with pytest.raises(InfeasibleError, match="use 5 devices"):
        octopipe.plan(costs, ClusterSpec.preset("h100x2"), 4, **options)
    eight = ClusterSpec.preset("h100x8")
    result = octopipe.plan(costs, eight, 4, num_devices=5, **options)
    check_result(result, costs, eight, memory_limit=7 * GiB)



def test_the_memory_limit_infeasible_suggests_alone_is_the_even_splits_need_exactly():
    # no activation limit: the memory named is the even split's need to the byte, with no word of
    # an activation limit (a bisection once ended a few bytes above it and blamed an "inf GiB" one)
    costs = CostTable([LayerCost(f"l{i}", forward_ms=1, backward_ms=2, param_bytes=GiB + 12345 * i,
                                 activation_bytes=3 * GiB + 777 * i, output_bytes=2**20) for i in range(4)])
    with pytest.raises(InfeasibleError) as error:
        octopipe.plan(costs, ClusterSpec.preset("h100x2"), 4, memory_limit_bytes=15 * GiB, quiet=True,
                      time_limit_s=5, effort=0.05)
    message = str(error.value)
    assert "activation" not in message.split("Raise the memory limit")[1]
    state = [8 * (GiB + 12345 * i) + 3 * GiB + 777 * i for i in range(4)]
    # (the first device also holds what its forward sends on, until sent)
    assert _suggested_bytes(message, "Raise the memory limit") == max(sum(state[:2]) + 2**20, sum(state[2:]))


def test_both_limits_each_alone_met_infeasible_names_a_fix_for_each():
    # 3 GiB of state on l0 and 1 GiB of activations on each of l1-l3, on 2 devices: 3.5 GiB of
    # memory holds l0 alone, which leaves 3 GiB of activations to the other device (over 2 GiB);
    # 2 GiB of activations puts l1 beside l0 (4 GiB of memory). Each limit alone is met, both
    # at once are not, and each fix the message names works with the other limit as given
    layers = [LayerCost("l0", forward_ms=1, backward_ms=2, param_bytes=3 * GiB // 8, output_bytes=2**20),
              LayerCost("l1", forward_ms=1, backward_ms=2, activation_bytes=GiB, output_bytes=2**20),
              LayerCost("l2", forward_ms=1, backward_ms=2, activation_bytes=GiB, output_bytes=2**20),
              LayerCost("l3", forward_ms=1, backward_ms=2, activation_bytes=GiB, output_bytes=2**20)]
    costs, cluster = CostTable(layers), ClusterSpec.preset("h100x2")
    options = dict(recompute=False, quiet=True, time_limit_s=10, effort=0.1)
    with pytest.raises(InfeasibleError) as error:
        octopipe.plan(costs, cluster, 2, memory_limit_bytes=3.5 * GiB, activation_limit=2 * GiB, **options)
    message = str(error.value)
    assert "no plan fits both limits" in message
    memory_fix = _suggested_bytes(message, "Raise the memory limit")
    activation_fix = _suggested_bytes(message, "the activation limit")
    check_result(octopipe.plan(costs, cluster, 2, memory_limit_bytes=memory_fix, activation_limit=2 * GiB, **options),
                 costs, cluster, memory_limit=memory_fix)
    check_result(octopipe.plan(costs, cluster, 2, memory_limit_bytes=3.5 * GiB, activation_limit=activation_fix,
                               **options), costs, cluster, memory_limit=3.5 * GiB)



def test_the_one_microbatch_fallback_holds_one_microbatch_on_a_deep_pipeline():
    # 8 one-layer stages, 2 microbatches: a round trip spans more than M + 2 of a device's loads,
    # and the fallback's in-flight cap (round trip / load - M - 1) once let stage 0 hold both
    from octopipe.api import _check_memory_feasible, _low_memory_plan
    from octopipe.simulator import MemoryModel

    costs = CostTable([LayerCost(f"l{i}", forward_ms=1, backward_ms=2, activation_bytes=int(2.5 * GiB),
                                 output_bytes=2**20) for i in range(8)])
    cluster = ClusterSpec.preset("h100x8")
    bounds, _ = _check_memory_feasible(costs, 8, 2, 3 * GiB, None, MemoryModel())
    assert bounds is not None
    fallback = _low_memory_plan(costs, cluster, 2, bounds, 8, MemoryModel())
    assert max(simulate(fallback, costs, cluster).peak_memory_bytes) <= 3 * GiB
    result = octopipe.plan(costs, cluster, 2, memory_limit_bytes=3 * GiB, quiet=True, time_limit_s=5, effort=0.05,
                           recompute=False)
    check_result(result, costs, cluster, memory_limit=3 * GiB)


def test_tight_memory_limit_still_gets_a_plan_that_fits():
    # weights + state leave room for about one microbatch's activations on each device
    costs = heterogeneous(6, num_layers=8, params=2**28)
    cluster = ClusterSpec.preset("h100x4")
    static = sum(costs.params) * 8 / 4
    limit = static * 1.3 + 3 * 2**28 * 2
    result = octopipe.plan(costs, cluster, 8, memory_limit_bytes=limit, quiet=True, effort=0.02)
    check_result(result, costs, cluster, memory_limit=limit)


def test_time_limit_too_short_returns_a_valid_plan_and_says_it_was_cut_short():
    costs = heterogeneous(8, num_layers=16)
    cluster = ClusterSpec.preset("h100x4")
    result = octopipe.plan(costs, cluster, 16, activation_limit="1f1b", quiet=True, time_limit_s=0.01)
    check_result(result, costs, cluster)
    assert result.report.cut_short
    assert "cut short" in str(result.report)


def test_a_time_limit_spent_on_the_baselines_leaves_the_rest_unsimulated_and_named():
    # simulating every baseline once took 0.02-0.35 s on the profiled tables, whatever the limit;
    # past it, only the 1F1B ones (the "1f1b" activation limit is theirs) and a fitting fallback run
    from pathlib import Path

    from octopipe import profiles, schedules

    costs = profiles.load_profile(Path(__file__).resolve().parents[1] / "data" / "profiles" / "deepseek-16B-seq4096.json")
    cluster = ClusterSpec.preset("h100x8")
    result = octopipe.plan(costs, cluster, 64, time_limit_s=0.001, activation_limit="1f1b", quiet=True)
    check_result(result, costs, cluster)
    names = [row.name for row in result.report.rows if row.kind == "baseline"]
    note = next(note for note in result.report.notes if note.startswith("time limit:"))
    left = note.split("(")[1].split(")")[0].split(", ")
    assert "1f1b/uniform" in names and "1f1b/balanced" in names and left
    assert f"the speedups are over the {len(names)} that were" in note and result.report.cut_short
    whole = octopipe.plan(costs, cluster, 64, time_limit_s=60, effort=1e-6, activation_limit="1f1b", quiet=True)
    every = [row.name for row in whole.report.rows if row.kind == "baseline"]
    assert every == list(schedules.baselines(costs, cluster, 64)) and len(every) >= 12
    assert sorted(names + left, key=every.index) == every  # (in the baselines' own order)
    assert not any(note.startswith("time limit:") for note in whole.report.notes)
    assert whole.report.activation_limit_bytes == result.report.activation_limit_bytes


def test_the_time_limit_holds_while_candidate_structures_are_built():
    # the release-aware candidate structures (a CP-SAT solve each, about 0.35 s here) ignored the
    # time limit: a 2 s plan of DeepSeek-16B on 4 devices took 7-8 s
    from pathlib import Path

    from octopipe import profiles

    costs = profiles.load_profile(Path(__file__).resolve().parents[1] / "data" / "profiles" / "deepseek-16B-seq4096.json")
    cluster = ClusterSpec.preset("h100x4")
    result = octopipe.plan(costs, cluster, 8, time_limit_s=2.0, quiet=True)
    check_result(result, costs, cluster)
    assert result.report.cut_short and result.report.planning_seconds < 3.0


def test_bad_arguments_fail_clearly():
    costs = heterogeneous(0, num_layers=3)
    cluster = ClusterSpec.preset("h100x4")
    with pytest.raises(octopipe.ArgumentError, match="num_devices"):
        octopipe.plan(costs, cluster, 4, quiet=True)  # 4 devices, 3 layers
    with pytest.raises(octopipe.ArgumentError, match="num_microbatches"):
        octopipe.plan(costs, cluster.with_devices(2), 0, quiet=True)
    with pytest.raises(octopipe.ArgumentError, match="activation_limit"):
        octopipe.plan(costs, cluster.with_devices(2), 4, activation_limit="2f2b", quiet=True)
    # a limit on activations the table does not have would bind nothing: refused, with the fix
    bare = CostTable([LayerCost(f"l{i}", forward_ms=1.0, backward_ms=2.0) for i in range(4)], model="bare")
    with pytest.raises(octopipe.ArgumentError, match=r"of bare has no activation_bytes[\s\S]*octopipe.profiles"):
        octopipe.plan(bare, cluster.with_devices(2), 4, activation_limit="1f1b", quiet=True)
    with pytest.raises(octopipe.ArgumentError, match="neither activation_bytes nor param_bytes"):
        octopipe.plan(bare, cluster.with_devices(2), 4, memory_limit_bytes=2**30, quiet=True)
    for bad in (dict(memory_limit_bytes=0), dict(effort=float("nan")), dict(effort=-1), dict(seed=1.5)):
        with pytest.raises(octopipe.ArgumentError, match=next(iter(bad))):  # found by fuzzing: raw errors before
            octopipe.plan(costs, cluster.with_devices(2), 4, quiet=True, **bad)
    with pytest.raises(octopipe.ArgumentError, match="num_microbatches"):
        octopipe.plan(costs, cluster.with_devices(2), True, quiet=True)
    # nothing to balance: every layer takes no time (the report's ratios would divide by 0)
    idle = CostTable([LayerCost(f"l{i}", forward_ms=0.0, backward_ms=0.0) for i in range(4)], model="idle")
    with pytest.raises(octopipe.ArgumentError, match=r"of idle takes 0 ms[\s\S]*runtime_profile"):
        octopipe.plan(idle, cluster.with_devices(2), 4, quiet=True)


def test_homogeneous_table_is_never_worse_than_the_best_fitting_baseline():
    costs = CostTable([LayerCost(f"l{i}", forward_ms=1.0, backward_ms=2.0, activation_bytes=2**28, output_bytes=2**24)
                       for i in range(16)])
    cluster = ClusterSpec.preset("h100x4")
    result = octopipe.plan(costs, cluster, 8, activation_limit="1f1b", quiet=True, effort=0.03)
    check_result(result, costs, cluster)
    assert result.report.iteration_ms <= result.report.best_fitting_baseline.iteration_ms + 1e-9


def test_report_to_dict_has_the_numbers():
    costs = heterogeneous(9)
    result = octopipe.plan(costs, ClusterSpec.preset("h100x2"), 4, quiet=True, effort=0.01)
    data = result.report.to_dict()
    assert data["iteration_ms"] == pytest.approx(result.report.iteration_ms)
    assert data["lower_bound_ms"] <= data["iteration_ms"] + 1e-6
    assert replace(result.report, notes=[]).gap == pytest.approx(result.report.gap)


SCRIPT = """
import random, octopipe
from octopipe import ClusterSpec, CostTable, LayerCost
rng = random.Random(12)
layers = [LayerCost(f"l{i}", forward_ms=rng.uniform(0.5, 3), backward_ms=rng.uniform(1, 6),
                    activation_bytes=rng.randint(1, 3) * 2**28, output_bytes=2**24) for i in range(10)]
result = octopipe.plan(CostTable(layers), ClusterSpec.preset("h100x4"), 8, activation_limit="1f1b", quiet=True,
                       effort=0.02)
assert not result.report.cut_short
print(result.plan)
"""


def test_plan_is_the_same_in_every_process():
    # set and dict orders change with the hash seed between processes; the plan must not
    texts = set()
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        texts.add(out.stdout)
    assert len(texts) == 1


@pytest.mark.parametrize("layers, m", [
    ([LayerCost("a", "block", 1.0, 2.0), LayerCost("b", "block", 1.0, 2.0)], 1),  # W overlaps the chain
    ([LayerCost(n, "block", 1.0, 2.0, backward_full_ms=0.5) for n in "ab"], 4),  # whole backward cheaper
    ([LayerCost("a", "block", 1.0, 2.0, backward_full_ms=10.0), LayerCost("b", "block", 1.0, 2.0)], 1),  # dearer
])
def test_lower_bound_never_exceeds_the_plan(layers, m):
    # found by fuzzing: the chain bound summed every W in sequence, and the bounds took the full
    # backward even where B and W apart (or the full backward) were cheaper
    result = octopipe.plan(CostTable(layers), ClusterSpec(num_devices=2, latency_s=0.0), m, time_limit_s=5,
                           effort=0.1, quiet=True)
    assert result.report.lower_bound_ms <= result.report.iteration_ms + 1e-9


def test_runners_up_are_other_shapes_that_fit_within_the_margin():
    from octopipe.api import MAX_RUNNERS_UP, RUNNER_UP_MARGIN
    from octopipe.tuner import Structure, plan_shape

    costs = heterogeneous(3, num_layers=12)
    cluster = ClusterSpec.preset("h100x4")
    result = octopipe.plan(costs, cluster, 8, activation_limit="1f1b", quiet=True, effort=0.05)
    assert 1 <= len(result.runners_up) <= MAX_RUNNERS_UP
    assert any(note.startswith(f"runners-up: {len(result.runners_up)} plan") for note in result.report.notes)
    limit = result.report.activation_limit_bytes
    shapes = {plan_shape(Structure.of(result.plan))}
    previous = 0.0
    for plan in result.runners_up:
        plan.validate(len(costs))
        sim = simulate(plan, costs, cluster)
        assert max(sim.peak_activation_bytes) <= limit * (1 + 1e-9)
        assert result.simulation.iteration_ms - 1e-9 <= sim.iteration_ms <= result.simulation.iteration_ms * (1 + RUNNER_UP_MARGIN)
        assert sim.iteration_ms >= previous - 1e-9  # fastest first
        previous = sim.iteration_ms
        shape = plan_shape(Structure.of(plan))
        assert shape not in shapes
        shapes.add(shape)


def test_a_runner_up_with_the_chosen_plans_stages_and_time_is_left_out():
    # (stop 28's audit: three runners-up at the chosen plan's 1747.0 ms, each the same plan with
    # two identical devices' stages swapped; measuring them would teach nothing)
    from types import SimpleNamespace

    from octopipe.api import _runners_up
    from octopipe.ir.plan import PipelinePlan
    from octopipe.tuner import Structure, plan_shape

    costs = heterogeneous(3, num_layers=12)
    cluster = ClusterSpec.preset("h100x4")
    chosen = octopipe.schedules.build("interleaved-1f1b", costs, cluster, 8, partition="balanced")
    ms = simulate(chosen, costs, cluster).iteration_ms
    # stages 4 and 5 trade devices: another shape, the same stages
    rename = {4: 5, 5: 4}
    ops = [[replace(op, stage=rename.get(op.stage, op.stage)) for op in chosen.device_ops[d]] for d in range(4)]
    swapped = PipelinePlan.build(8, chosen.boundaries, [0, 1, 2, 3, 1, 0, 2, 3], ops)
    assert plan_shape(Structure.of(swapped)) != plan_shape(Structure.of(chosen))
    searched = SimpleNamespace(plan=chosen, iteration_ms=ms)
    pool = SimpleNamespace(runners_up=[SimpleNamespace(iteration_ms=ms, plan=swapped)])
    assert _runners_up(pool, searched, chosen, ms) == []
    slower = SimpleNamespace(runners_up=[SimpleNamespace(iteration_ms=ms * 1.01, plan=swapped)])
    assert _runners_up(slower, searched, chosen, ms) == [(ms * 1.01, swapped)]


def test_plans_that_visit_devices_in_the_same_order_are_one_shape():
    from octopipe.tuner import Structure, plan_shape

    def shape(placement):
        return plan_shape(Structure(tuple(range(len(placement) + 1)), tuple(placement), 2))

    assert shape([0, 1]) == shape([1, 0]) == shape([1, 1, 0, 0])
    assert len({shape([0, 1]), shape([0, 1, 1, 0]), shape([0, 1, 0, 1])}) == 3
    assert shape([0, 1, 1, 0]) == shape([1, 0, 0, 1])


def test_a_plan_for_one_data_parallel_replica_prices_its_gradient_all_reduces():
    costs = heterogeneous(5, num_layers=10, params=2**28)  # 256 MiB of parameters a layer
    cluster = ClusterSpec.preset("h100x16").replica(4)  # 4 replicas of 4 devices, each device's copies in a node
    result = octopipe.plan(costs, cluster, 8, quiet=True, effort=0.03)
    check_result(result, costs, cluster)
    buckets = {int(r.name.split()[-1]): r for r in result.simulation.reductions if r.name.startswith("data-parallel")}
    assert set(buckets) == {stage.index for stage in result.plan.stages}  # a bucket per stage
    for stage in result.plan.stages:
        reduction = buckets[stage.index]
        assert reduction.devices == (stage.device,)
        size = (stage.layer_end - stage.layer_start) * 2**28
        assert reduction.end_ms - reduction.start_ms == pytest.approx(cluster.all_reduce_ms(size))
    alone = simulate(result.plan, costs, replace(cluster, data_parallel=1))
    assert result.report.iteration_ms > alone.iteration_ms
    assert "one of 4 replicas" in str(result.report)


def test_plan_data_parallel_keeps_the_replica_count_with_the_fastest_step():
    costs = heterogeneous(6, num_layers=12, params=2**30)  # 1 GiB of parameters a layer, more in gradients and state
    cluster = ClusterSpec.preset("h100x8")
    options = dict(quiet=True, effort=0.02, solver=False, memory_limit_bytes=100 * GiB, recompute=False)
    result = octopipe.plan_data_parallel(costs, cluster, 16, **options)
    assert [row.data_parallel for row in result.tried] == [1, 2, 4, 8]
    assert [(row.num_devices, row.num_microbatches) for row in result.tried] == [(8, 16), (4, 8), (2, 4), (1, 2)]
    # one device cannot hold 12 layers' weights, gradients and optimizer state (96 GiB) and a
    # microbatch's activations in 100 GiB without recomputation (with it, as 12 stages each
    # recomputing one layer at its B, it can)
    assert result.tried[-1].result is None and "no plan fits" in result.tried[-1].error
    planned = [row for row in result.tried if row.result is not None]
    assert len(planned) >= 2
    best = min(planned, key=lambda row: row.step_ms)
    assert result.data_parallel == best.data_parallel and result.best is best.result
    for row in planned:  # each is the plan of one replica of that count, all-reduce included
        alone = octopipe.plan(costs, cluster.replica(row.data_parallel), row.num_microbatches, **options)
        assert row.step_ms == pytest.approx(alone.report.iteration_ms)
        check_result(row.result, costs, cluster.replica(row.data_parallel), memory_limit=100 * GiB)
    text = str(result)
    assert f"*{result.data_parallel:>3} x" in text and "no plan: the search found no plan" in text
    with pytest.raises(octopipe.ArgumentError, match="no param_bytes"):
        octopipe.plan_data_parallel(heterogeneous(6), cluster, 16, **options)
    with pytest.raises(octopipe.ArgumentError, match="no replica count among"):
        octopipe.plan_data_parallel(costs, cluster, 15, counts=(2, 4), **options)


def test_each_replica_count_is_costed_with_its_own_gradient_accumulation():
    # every microbatch after the first adds its gradients into .grad: a replica of D runs M/D
    # microbatches, so it pays (M/D - 1)/(M/D) of the addition, not (M-1)/M
    base = heterogeneous(7, num_layers=8, params=2**28)
    share = 15 / 16
    costs = CostTable([replace(layer, backward_ms=layer.backward_ms + share * 4.0,
                               backward_weight_ms=0.5 * layer.backward_ms + share * 3.0,
                               accumulate_ms=4.0, accumulate_weight_ms=3.0) for layer in base],
                      num_microbatches=16)
    cluster = ClusterSpec.preset("h100x8")
    options = dict(quiet=True, effort=0.02, solver=False)
    result = octopipe.plan_data_parallel(costs, cluster, 16, counts=(2, 8), **options)
    for row in result.tried:
        table = row.result.costs
        assert table.num_microbatches == row.num_microbatches
        ratio = (row.num_microbatches - 1) / row.num_microbatches
        assert [layer.backward_ms for layer in table] == pytest.approx(
            [layer.backward_ms + ratio * 4.0 for layer in base])
        assert "re-costed for" in str(row.result.report)
        check_result(row.result, table, cluster.replica(row.data_parallel))
        # the simulator takes any table for the plan's own microbatch count
        replica = cluster.replica(row.data_parallel)
        assert simulate(row.result.plan, costs, replica).iteration_ms == pytest.approx(
            simulate(row.result.plan, table, replica).iteration_ms)
    eight = result.tried[-1]
    assert eight.data_parallel == 8 and eight.num_microbatches == 2
    as_costed = CostTable([replace(layer, accumulate_ms=None, accumulate_weight_ms=None) for layer in costs])
    overcharged = simulate(eight.result.plan, as_costed, cluster.replica(8))  # not re-costed: 15/16 of it
    assert eight.step_ms < overcharged.iteration_ms  # (2-1)/2 of the addition, not 15/16


def test_inputs_found_by_a_bad_input_sweep_fail_clearly(tmp_path):
    # each of these was a raw Python error, or a misleading one, before stop 23
    costs = heterogeneous(3, num_layers=6)
    result = octopipe.plan(costs, "h100x8", 8, quiet=True, effort=0.02, solver=False, num_devices=2)
    # simulate takes a cluster as plan does (a preset name), and says what a wrong argument is
    assert octopipe.simulate(result.plan, costs, "h100x8").iteration_ms == pytest.approx(result.report.iteration_ms)
    for args, message in (((str(result.plan), costs, "h100x8"), "plan must be a PipelinePlan"),
                          ((result.plan, "costs.json", "h100x8"), "costs must be a CostTable"),
                          ((result.plan, costs, 5), "expected a ClusterSpec")):
        with pytest.raises(octopipe.OctopipeError, match=message):
            octopipe.simulate(*args)
    for bad, message in ((dict(time_limit_s="1"), "time_limit_s must be a positive number"),
                         (dict(recompute="no"), "recompute must be True or False"),
                         (dict(activation_limit=True), "activation_limit must be bytes")):
        with pytest.raises(octopipe.ArgumentError, match=message):
            octopipe.plan(costs, "h100x8", 8, quiet=True, num_devices=2, **bad)
    # an integer too large for a float, in a cost table and in a saved plan's prediction
    with pytest.raises(octopipe.CostTableError, match="forward_ms"):
        CostTable.from_dict({"layers": [{"forward_ms": 10**400, "backward_ms": 1.0}]})
    path = tmp_path / "plan.json"
    result.save(path)
    data = json.loads(path.read_text())
    for bad in (10**400, float("inf"), -1.0, True):
        data["planned_with"]["iteration_ms"] = bad
        path.write_text(json.dumps(data))
        with pytest.raises(octopipe.ParseError, match="iteration_ms must be a positive number"):
            octopipe.api.load_saved_plan(path)
    plan_data = result.plan.to_dict()
    plan_data["device_ops"][0][0] = 5
    with pytest.raises(octopipe.ParseError, match="plan JSON is malformed"):
        PipelinePlan.from_dict(plan_data)
    # plan_data_parallel: a replica given as the whole cluster, and an argument wrong for every count
    with pytest.raises(octopipe.ArgumentError, match="already one of 2 replicas"):
        octopipe.plan_data_parallel(heterogeneous(3, params=2**20), ClusterSpec.preset("h100x8").replica(2), 8)
    bare = CostTable([replace(layer, activation_bytes=None) for layer in heterogeneous(3, params=2**20)])
    with pytest.raises(octopipe.ArgumentError, match="has no activation_bytes"):
        octopipe.plan_data_parallel(bare, "h100x8", 8, activation_limit="1f1b", quiet=True, effort=0.02)
    # a JSON plan file named in capitals is JSON still
    result.save(tmp_path / "PLAN.JSON")
    assert octopipe.api.load_saved_plan(tmp_path / "PLAN.JSON").costs == result.costs


def test_a_report_of_microsecond_plans_keeps_three_significant_digits():
    # (stop 28's audit: a tiny model on a GPU preset printed "lower bound 0.00 ms")
    from octopipe.report import _ms

    assert _ms(1234.5678) == "1234.57" and _ms(0.0663) == "0.0663" and _ms(0.000123456) == "0.000123"
    assert _ms(0.0) == "0.00"
