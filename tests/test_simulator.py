"""The simulator: timing rules, transfers and links, memory, bubbles, errors, trace."""

import json
from dataclasses import replace

import pytest

from octopipe import ClusterSpec, CostTable, LayerCost, PipelinePlan, PlanError
from octopipe.errors import ArgumentError, ClusterSpecError
from octopipe.ir import SkipTensor, TiedParameter
from octopipe.ir.plan import B, F, Op, OpKind, W
from octopipe.simulator import MemoryModel, StageCosts, iteration_time, jitter_of, jittered_iterations, simulate

FREE = ClusterSpec(num_devices=8, intra_node_bandwidth=1e30, inter_node_bandwidth=1e30, latency_s=0.0)


def table(n, forward=1.0, backward=2.0, weight=None, activation=0, output=0, params=0):
    return CostTable([
        LayerCost(f"l{i}", forward_ms=forward, backward_ms=backward, backward_weight_ms=weight,
                  activation_bytes=activation, output_bytes=output, param_bytes=params)
        for i in range(n)
    ])


def plan_of(text):
    return PipelinePlan.parse(text)


TWO_STAGE = """plan devices=2 microbatches=2 stages=2
stage 0 layers=0:1 device=0
stage 1 layers=1:2 device=1
device 0: 0F0 0F1 0B0 0B1
device 1: 1F0 1B0 1F1 1B1
"""


def test_dependencies_and_device_order_set_start_times():
    result = simulate(plan_of(TWO_STAGE), table(2), FREE)
    start = {str(op): t for op, t in result.op_start.items()}
    assert start == {"0F0": 0, "0F1": 1, "1F0": 1, "1B0": 2, "1F1": 4, "0B0": 4, "1B1": 5, "0B1": 7}
    assert result.iteration_ms == 9
    assert result.device_busy_ms == (6, 6)
    assert result.bubble_ratio == pytest.approx(6 / 18)
    for device, (warmup, cooldown, residual) in enumerate(result.bubbles):
        assert warmup + cooldown + residual == pytest.approx(result.device_idle_ms[device])
    assert result.bubbles[1] == (1, 2, 0)  # waits for 0F0; after 1F1 ends at 5, idles 7..9
    assert iteration_time(plan_of(TWO_STAGE), table(2), FREE)[0] == result.iteration_ms


def test_jitter_scales_each_op_and_a_late_op_delays_what_waits_for_it():
    plan = plan_of(TWO_STAGE)
    size = 3 * plan.num_stages * plan.num_microbatches
    assert simulate(plan, table(2), FREE, jitter=[1.0] * size).op_start == simulate(plan, table(2), FREE).op_start
    assert simulate(plan, table(2), FREE, jitter=[2.0] * size).iteration_ms == 18  # every op twice as long
    # 0F0 (key 0) three times as long: 1F0 waits for it, and so does the rest of the chain
    late = [1.0] * size
    late[0] = 3.0
    start = {str(op): t for op, t in simulate(plan, table(2), FREE, jitter=late).op_start.items()}
    assert start["1F0"] == 3 and start["0F1"] == 3
    with pytest.raises(ArgumentError, match="one factor per op slot"):
        simulate(plan, table(2), FREE, jitter=[1.0] * (size - 1))
    # the same late op given by name
    assert jitter_of(plan, {Op.parse("0F0"): 3.0}) == late
    # drawn from measured ratios: deterministic for a seed, sorted, exact where there is no spread
    assert jittered_iterations(plan, table(2), FREE, [1.0], samples=3) == [9.0, 9.0, 9.0]
    draws = jittered_iterations(plan, table(2), FREE, [0.5, 1.5], samples=16, seed=3)
    assert draws == sorted(draws) == jittered_iterations(plan, table(2), FREE, [0.5, 1.5], samples=16, seed=3)
    assert 4.5 <= draws[0] < draws[-1] <= 13.5
    with pytest.raises(ArgumentError, match="ratios"):
        jittered_iterations(plan, table(2), FREE, [])


def test_transfer_is_latency_plus_bytes_over_bandwidth_and_overlaps_compute():
    cluster = ClusterSpec(num_devices=2, intra_node_bandwidth=1e9, latency_s=1e-3)  # 1 MB = 1 ms, +1 ms latency
    result = simulate(plan_of(TWO_STAGE), table(2, output=1_000_000), cluster)
    start = {str(op): t for op, t in result.op_start.items()}
    assert start["1F0"] == pytest.approx(1 + 2)  # 0F0 ends at 1, then 2 ms on the wire
    assert start["0F1"] == 1  # the sender does not wait for its send
    assert len(result.transfers) == 4
    blocking = simulate(plan_of(TWO_STAGE), table(2, output=1_000_000), cluster, blocking_sends=True)
    assert {str(op): t for op, t in blocking.op_start.items()}["0F1"] == pytest.approx(3)
    assert blocking.iteration_ms > result.iteration_ms


def test_one_link_carries_one_transfer_at_a_time():
    text = """plan devices=2 microbatches=2 stages=2
stage 0 layers=0:1 device=0
stage 1 layers=1:2 device=1
device 0: 0F0 0F1 0B0 0B1
device 1: 1F0 1F1 1B0 1B1
"""
    cluster = ClusterSpec(num_devices=2, intra_node_bandwidth=1e9, latency_s=0.0)
    costs = CostTable([LayerCost("a", forward_ms=0.1, backward_ms=1.0, output_bytes=5_000_000),
                       LayerCost("b", forward_ms=1.0, backward_ms=1.0, output_bytes=0)])
    result = simulate(plan_of(text), costs, cluster)
    acts = [t for t in result.transfers if t.kind == "act"]
    assert acts[0].start_ms == pytest.approx(0.1) and acts[0].end_ms == pytest.approx(5.1)
    assert acts[1].start_ms == pytest.approx(5.1)  # queued behind the first, though 0F1 ended at 0.2
    assert result.op_start[F(1, 1)] == pytest.approx(10.1)


def test_same_device_hand_off_is_free():
    text = """plan devices=1 microbatches=1 stages=2
stage 0 layers=0:1 device=0
stage 1 layers=1:2 device=0
device 0: 0F0 1F0 1B0 0B0
"""
    cluster = ClusterSpec(num_devices=1, intra_node_bandwidth=1.0, latency_s=0.5)
    result = simulate(plan_of(text), table(2, output=10**9), cluster)
    assert result.iteration_ms == 6 and result.transfers == ()


def test_split_backward_uses_input_gradient_time_and_w_runs_later():
    text = """plan devices=1 microbatches=1 stages=1
stage 0 layers=0:1 device=0
device 0: 0F0 0B0 0W0
"""
    result = simulate(plan_of(text), table(1, forward=1, backward=3, weight=1), FREE)
    assert result.op_end[B(0, 0)] - result.op_start[B(0, 0)] == 2
    assert result.op_end[W(0, 0)] == 4


def test_memory_activations_live_from_forward_to_backward_and_weight():
    text = """plan devices=1 microbatches=3 stages=1
stage 0 layers=0:1 device=0
device 0: 0F0 0F1 0B0 0F2 0B1 0W1 0B2 0W0 0W2
"""
    memory = MemoryModel(state_bytes_per_param_byte=4.0, weight_memory_fraction=0.5)
    result = simulate(plan_of(text), table(1, activation=100, params=10), FREE, memory=memory)
    # 0F0 0F1 -> 200; 0B0 (full backward: no 0W0? it has one) keeps 50 -> 150; 0F2 -> 250 peak
    assert result.peak_activation_bytes == (250,)
    assert result.static_memory_bytes == (40,)
    assert result.peak_memory_bytes == (290,)


def test_stated_weight_stash_replaces_the_memory_models_share():
    # 0F0 0F1 0B0 0F2 0B1 0W1 0B2 0W0 0W2; one layer of 100 activation bytes
    text = """plan devices=1 microbatches=3 stages=1
stage 0 layers=0:1 device=0
device 0: 0F0 0F1 0B0 0F2 0B1 0W1 0B2 0W0 0W2
"""
    memory = MemoryModel(weight_memory_fraction=0.5)
    small = replace(table(1, activation=100), layers=(replace(table(1).layers[0], activation_bytes=100,
                                                              weight_stash_bytes=10),))
    # 0F0 0F1 200; 0B0 leaves 10 -> 110; 0F2 210 (peak); 0B1 120; 0W1 110; 0B2 20
    assert simulate(plan_of(text), small, FREE, memory=memory).peak_activation_bytes == (210,)
    # a stash larger than the activations (a head: its logits' gradient): B's end is the peak
    large = small.replace_layers([replace(small.layers[0], weight_stash_bytes=300)])
    # 0F0 0F1 200; 0B0 400; 0F2 500; 0B1 700 (peak); 0W1 400; 0B2 600; 0W0 300; 0W2 0
    assert simulate(plan_of(text), large, FREE, memory=memory).peak_activation_bytes == (700,)
    # a table without it keeps the memory model's share of the activations (250, as above)
    assert simulate(plan_of(text), table(1, activation=100), FREE, memory=memory).peak_activation_bytes == (250,)


def test_what_a_forward_sends_is_held_until_sent_or_until_the_next_stage_reads_it():
    # two layers of 100 activation bytes, each sending 1000 (a head's logits to a loss stage)
    costs = table(2, activation=100, output=1000)
    apart = """plan devices=2 microbatches=2 stages=2
stage 0 layers=0:1 device=0
stage 1 layers=1:2 device=1
device 0: 0F0 0F1 0B0 0B1
device 1: 1F0 1B0 1F1 1B1
"""
    # device 0: 0F0 holds 100 and its 1000 at its end (1100), 0F1 200 + 1000; the last stage sends nothing
    assert simulate(plan_of(apart), costs, FREE).peak_activation_bytes == (1200, 100)
    together = """plan devices=1 microbatches=2 stages=2
stage 0 layers=0:1 device=0
stage 1 layers=1:2 device=0
device 0: 0F0 0F1 1F0 1B0 1F1 1B1 0B0 0B1
"""
    # on one device stage 0's outputs are held until stage 1's F reads them: 0F0 0F1 hold
    # 2 x (100 + 1000), the peak; 1F0 takes one of them as its input (its own 100 saved): 1300
    result = simulate(plan_of(together), costs, FREE)
    assert result.peak_activation_bytes == (2200,)
    # the same order with what each F sends counted nowhere: only the activations
    assert simulate(plan_of(together), table(2, activation=100), FREE).peak_activation_bytes == (300,)


def test_a_stage_holds_what_it_received_and_its_first_layer_does_not_save_from_f_to_b():
    # layer 1 (a loss) saves 10 bytes of its own but not the 1000 it receives (its logits): the
    # runtime holds a stage's inputs from its F to its B, so a stage starting with it holds them
    base = table(2, activation=10, output=1000)
    costs = base.replace_layers([base.layers[0], replace(base.layers[1], unsaved_input_bytes=1000)])
    apart = """plan devices=2 microbatches=2 stages=2
stage 0 layers=0:1 device=0
stage 1 layers=1:2 device=1
device 0: 0F0 0F1 0B0 0B1
device 1: 1F0 1B0 1F1 1B1
"""
    # device 0: 0F1 ends holding 2 x 10 and sending 1000; device 1: one microbatch's 10 + 1000
    assert simulate(plan_of(apart), costs, FREE).peak_activation_bytes == (1020, 1010)
    assert simulate(plan_of(apart), base, FREE).peak_activation_bytes == (1020, 10)
    together = """plan devices=1 microbatches=2 stages=2
stage 0 layers=0:1 device=0
stage 1 layers=1:2 device=0
device 0: 0F0 0F1 1F0 1B0 1F1 1B1 0B0 0B1
"""
    # on one device 1F0 takes over the 1000 stage 0 left it and keeps it to 1B0: 2020 + 10
    assert simulate(plan_of(together), costs, FREE).peak_activation_bytes == (2030,)
    assert simulate(plan_of(together), base, FREE).peak_activation_bytes == (2020,)
    # inside a stage the logits are an intermediate the loss does not save: nothing held
    whole = """plan devices=1 microbatches=2 stages=1
stage 0 layers=0:2 device=0
device 0: 0F0 0F1 0B0 0B1
"""
    assert simulate(plan_of(whole), costs, FREE).peak_activation_bytes == (40,)
    # a recomputing loss stage keeps what it received (1000), then its B runs F again (+10)
    again = plan_of(apart).with_recompute((False, True))
    sc = StageCosts.of(again.boundaries, costs, again.recompute)
    assert (sc.held[1], sc.activation[1]) == (1000, 1010)
    assert simulate(again, costs, FREE).peak_activation_bytes == (1020, 1010)


def test_deadlock_names_the_waiting_ops_and_marks_the_grid():
    text = """plan devices=2 microbatches=1 stages=2
stage 0 layers=0:1 device=0
stage 1 layers=1:2 device=0
device 0: 0F0 1F0 0B0 1B0
device 1:
"""
    with pytest.raises(PlanError, match="runs before its forward|deadlocks"):
        simulate(plan_of(text), table(2), FREE)
    cycle = """plan devices=2 microbatches=2 stages=2
stage 0 layers=0:1 device=0
stage 1 layers=1:2 device=1
device 0: 0F0 0B0 0F1 0B1
device 1: 1F1 1F0 1B0 1B1
"""
    with pytest.raises(PlanError) as info:
        simulate(plan_of(cycle), table(2), FREE)
    message = str(info.value)
    assert "deadlocks" in message and "0B0 waits for 1B0" in message and "<-- ERROR HERE" in message


def test_wrong_device_missing_and_duplicate_ops_are_plan_errors():
    head = "plan devices=2 microbatches=1 stages=2\nstage 0 layers=0:1 device=0\nstage 1 layers=1:2 device=1\n"
    wrong_device = plan_of(head + "device 0: 0F0 1F0 0B0\ndevice 1: 1B0\n")
    missing = plan_of(head + "device 0: 0F0\ndevice 1: 1F0 1B0\n")
    twice = plan_of(head + "device 0: 0F0 0B0 0B0\ndevice 1: 1F0 1B0\n")
    short = plan_of(head + "device 0: 0F0 0B0\ndevice 1: 1F0 1B0\n")
    # simulate() validates the plan first (PipelinePlan.validate, with the grid) ...
    for plan, expected in ((wrong_device, "belongs to stage 1, which is placed on device 1"),
                           (missing, "op 0B0 is missing"), (twice, "appears twice"),
                           (short, "cover layers 0:2 but the model has 3 layers")):
        with pytest.raises(PlanError, match=expected):
            simulate(plan, table(3 if plan is short else 2), FREE)
    # ... and the tuner's fast path, which skips that, still refuses them itself
    for plan, expected in ((wrong_device, "belongs to stage 1, placed on device 1"), (missing, "missing 1 op"),
                           (twice, "appears twice"), (short, "cost table .* has 3")):
        with pytest.raises(PlanError, match=expected):
            iteration_time(plan, table(3 if plan is short else 2), FREE)


def test_critical_path_is_a_dependency_chain_to_the_end():
    result = simulate(plan_of(TWO_STAGE), table(2), FREE)
    path = result.critical_path
    assert result.op_end[path[-1]] == result.iteration_ms
    assert result.op_start[path[0]] == 0
    for earlier, later in zip(path, path[1:]):
        assert result.op_end[earlier] <= result.op_start[later] + 1e-9
    assert sum(result.op_end[op] - result.op_start[op] for op in path) == pytest.approx(result.iteration_ms)


def test_chrome_trace_has_every_op_and_transfer(tmp_path):
    cluster = ClusterSpec(num_devices=2)
    result = simulate(plan_of(TWO_STAGE), table(2, output=1000), cluster)
    path = tmp_path / "trace.json"
    result.save_trace(path)
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert sum(e["cat"] in ("F", "B", "W") for e in events) == 8
    assert sum(e["cat"] == "comm" for e in events) == 4
    assert "bubble ratio" in str(result)


def test_op_kinds_cover_f_b_w():
    assert [k.value for k in OpKind] == ["F", "B", "W"]


def test_every_compute_op_pays_the_runtime_overhead():
    cluster = ClusterSpec(num_devices=8, intra_node_bandwidth=1e30, latency_s=0.0, op_overhead_ms=0.5)
    result = simulate(plan_of(TWO_STAGE), table(2), cluster)
    assert result.iteration_ms == pytest.approx(9 + 0.5 * 6)  # six ops on the critical path
    assert result.op_end[F(0, 0)] - result.op_start[F(0, 0)] == pytest.approx(1.5)


def test_cross_device_messages_pay_their_posting_overhead():
    cluster = ClusterSpec(num_devices=8, intra_node_bandwidth=1e30, latency_s=0.0, message_overhead_ms=0.25)
    result = simulate(plan_of(TWO_STAGE), table(2), cluster)
    # 0F0 sends (1.25); 1F0 receives (2.5); 1B0 sends (4.75); 0B0 receives (7.0); 1F1 4.75-6.0 receives;
    # 1B1 6.0-8.25 sends; 0B1 waits for it and receives: 8.25 + 2.25
    assert result.iteration_ms == pytest.approx(10.5)
    assert result.op_end[F(0, 0)] - result.op_start[F(0, 0)] == pytest.approx(1.25)
    one_device = PipelinePlan.parse(TWO_STAGE.replace("device=1", "device=0").replace("device 1: 1F0 1B0 1F1 1B1\n", "")
                                    .replace("0F0 0F1 0B0 0B1", "0F0 1F0 1B0 0B0 0F1 1F1 1B1 0B1").replace("devices=2", "devices=1"))
    assert simulate(one_device, table(2), cluster).iteration_ms == pytest.approx(12.0)  # hand-offs on one device are free


def test_where_hosts_copy_messages_both_ends_pay_the_bytes_and_the_send_leaves_while_it_is_copied():
    # 2 MB messages, copied by the hosts at 1 GB/s (2 ms per end), moved at 1 GB/s with no latency
    cluster = ClusterSpec(num_devices=2, intra_node_bandwidth=1e9, latency_s=0.0, message_copy_bandwidth=1e9)
    result = simulate(plan_of(TWO_STAGE), table(2, output=2_000_000), cluster)
    start = {str(op): t for op, t in result.op_start.items()}
    end = {str(op): t for op, t in result.op_end.items()}
    assert end["0F0"] == pytest.approx(3)  # 1 ms of compute, then 2 ms copying its send
    assert result.transfers[0].start_ms == pytest.approx(1) and result.transfers[0].end_ms == pytest.approx(3)
    assert start["1F0"] == pytest.approx(3) and end["1F0"] == pytest.approx(6)  # its receive's copy: 2 ms more
    assert end["1B0"] - start["1B0"] == pytest.approx(2 + 2)  # sends the gradient back
    assert end["0B0"] - start["0B0"] == pytest.approx(2 + 2)
    # no host copy (GPUs): the same plan only moves the bytes
    plain = simulate(plan_of(TWO_STAGE), table(2, output=2_000_000), replace(cluster, message_copy_bandwidth=0.0))
    assert plain.op_end[F(0, 0)] == pytest.approx(1) and plain.iteration_ms < result.iteration_ms
    # hand-offs on one device copy nothing
    assert simulate(plan_of(TWO_STAGE), table(2, output=2_000_000), replace(cluster, intra_node_bandwidth=1e30,
                                                                               message_copy_bandwidth=1e30)
                    ).iteration_ms == pytest.approx(9)


def test_a_skip_tensor_message_is_copied_by_both_hosts_too():
    cluster = ClusterSpec(num_devices=3, intra_node_bandwidth=1e30, latency_s=0.0, message_copy_bandwidth=1e9)
    costs = skip_table(3, (0, (2,), 6_000_000))  # 1 MB to the next layer, 6 MB to layer 2
    line = plan_of(THREE_ON.format(d1=1, d2=2, ops0="0F0 0B0", ops1="1F0 1B0", ops2="2F0 2B0"))
    result = simulate(line, costs, cluster)
    assert result.op_end[F(0, 0)] - result.op_start[F(0, 0)] == pytest.approx(1 + 1 + 6)
    assert result.op_end[F(1, 0)] - result.op_start[F(1, 0)] == pytest.approx(1 + 1 + 1)
    assert result.op_end[F(2, 0)] - result.op_start[F(2, 0)] == pytest.approx(1 + 1 + 6)
    assert result.op_end[B(0, 0)] - result.op_start[B(0, 0)] == pytest.approx(2 + 1 + 6)


def test_message_copy_bandwidth_is_validated():
    for bad in (-1.0, float("inf"), "fast"):
        with pytest.raises(ClusterSpecError, match="message_copy_bandwidth"):
            ClusterSpec(num_devices=2, message_copy_bandwidth=bad)
    assert ClusterSpec.preset("cpux2").message_copy_bandwidth > 0 and ClusterSpec.preset("h100x8").message_copy_bandwidth == 0


def test_message_overhead_is_validated():
    with pytest.raises(ClusterSpecError, match="message_overhead_ms"):
        ClusterSpec(num_devices=2, message_overhead_ms=-1.0)


def test_a_full_backward_costs_the_measured_full_backward_and_a_split_one_b_plus_w():
    from octopipe.ir.plan import B, F, W

    table = CostTable((LayerCost("a", forward_ms=1.0, backward_ms=3.0, backward_weight_ms=1.0, backward_full_ms=2.5),))
    cluster = ClusterSpec(num_devices=1)
    fused = PipelinePlan.build(2, [0, 1], [0], [[F(0, 0), B(0, 0), F(0, 1), B(0, 1)]])
    split = PipelinePlan.build(2, [0, 1], [0], [[F(0, 0), B(0, 0), F(0, 1), B(0, 1), W(0, 0), W(0, 1)]])
    assert simulate(fused, table, cluster).iteration_ms == pytest.approx(2 * (1.0 + 2.5))
    assert simulate(split, table, cluster).iteration_ms == pytest.approx(2 * (1.0 + 2.0 + 1.0))


def tied_table(size, params=1000):
    """4 layers, layers 0 and 3 share a parameter of `size` bytes (a tied embedding and head)."""
    return CostTable([LayerCost(f"l{i}", forward_ms=1.0, backward_ms=2.0, param_bytes=params) for i in range(4)],
                     tied=(TiedParameter("embed.weight", (0, 3), size),))


FOUR_ON_TWO = """plan devices=2 microbatches=1 stages=4
stage 0 layers=0:1 device=0
stage 1 layers=1:2 device={d1}
stage 2 layers=2:3 device={d2}
stage 3 layers=3:4 device={d3}
device 0: {ops0}
device 1: {ops1}
"""


def test_tied_gradient_split_over_devices_is_all_reduced_after_the_last_backward():
    cluster = ClusterSpec(num_devices=2, intra_node_bandwidth=1e9, latency_s=1e-3, message_overhead_ms=0.0)
    # 1F1B-like split, layers 0-1 on device 0 and 2-3 on device 1: the tied pair spans both
    split = plan_of(FOUR_ON_TWO.format(d1=0, d2=1, d3=1, ops0="0F0 1F0 1B0 0B0", ops1="2F0 3F0 3B0 2B0"))
    untied = table(4, params=1000)
    before = simulate(split, untied, cluster)
    result = simulate(split, tied_table(2_000_000), cluster)
    # ring all-reduce of 2 devices: 2 steps of (1 ms latency + 1 MB at 1 GB/s = 1 ms)
    (reduction,) = result.reductions
    assert reduction.devices == (0, 1)
    assert reduction.start_ms == pytest.approx(before.iteration_ms)  # device 0's last B ends the iteration
    assert result.iteration_ms == pytest.approx(before.iteration_ms + 4.0)
    assert iteration_time(split, tied_table(2_000_000), cluster)[0] == pytest.approx(result.iteration_ms)
    assert result.static_memory_bytes == before.static_memory_bytes  # one copy on each device
    assert "all-reduce embed.weight" in json.dumps(result.chrome_trace())
    assert "tied embed.weight: all-reduce on devices [0, 1]" in str(result)


def test_tied_layers_on_one_device_need_no_all_reduce_and_one_copy():
    cluster = ClusterSpec(num_devices=2, intra_node_bandwidth=1e9, latency_s=1e-3)
    v_shape = plan_of(FOUR_ON_TWO.format(d1=1, d2=1, d3=0, ops0="0F0 3F0 3B0 0B0", ops1="1F0 2F0 2B0 1B0"))
    result = simulate(v_shape, tied_table(2_000_000), cluster)
    untied = simulate(v_shape, table(4, params=1000), cluster)
    assert result.reductions == ()
    assert result.iteration_ms == untied.iteration_ms
    state = MemoryModel().state_bytes_per_param_byte
    assert result.static_memory_bytes[0] == untied.static_memory_bytes[0] - 2_000_000 * state
    assert result.static_memory_bytes[1] == untied.static_memory_bytes[1]


def test_tied_all_reduces_run_in_table_order_over_the_slowest_link_among_their_devices():
    cluster = ClusterSpec(num_devices=4, devices_per_node=2, intra_node_bandwidth=1e12, inter_node_bandwidth=1e9,
                          latency_s=0.0)
    costs = CostTable([LayerCost(f"l{i}", forward_ms=1.0, backward_ms=2.0) for i in range(4)],
                      tied=(TiedParameter("a", (0, 3), 1_000_000), TiedParameter("b", (1, 2), 3_000_000)))
    plan = PipelinePlan.parse("""plan devices=4 microbatches=1 stages=4
stage 0 layers=0:1 device=0
stage 1 layers=1:2 device=1
stage 2 layers=2:3 device=2
stage 3 layers=3:4 device=3
device 0: 0F0 0B0
device 1: 1F0 1B0
device 2: 2F0 2B0
device 3: 3F0 3B0
""")
    result = simulate(plan, costs, cluster)
    first, second = result.reductions
    assert (first.name, first.devices, second.name, second.devices) == ("a", (0, 3), "b", (1, 2))
    # each crosses the 1 GB/s link between the nodes: 2 steps of bytes/2 at 1 MB per ms
    assert first.end_ms - first.start_ms == pytest.approx(1.0)
    assert second.end_ms - second.start_ms == pytest.approx(3.0)
    assert second.start_ms >= max(result.op_end[B(1, 0)], result.op_end[B(2, 0)])
    assert result.iteration_ms == pytest.approx(max(first.end_ms, second.end_ms))


def skip_table(num_layers, skip, output=1_000_000):
    """Layers of F 1 ms, full B 2 ms, each sending `output` bytes on; `skip` = (from, to, bytes)
    also leaves layer `from` (its output_bytes counts both, as the cost passes write it)."""
    source, readers, size = skip
    return CostTable([LayerCost(f"l{i}", forward_ms=1.0, backward_ms=2.0,
                                output_bytes=output + (size if i == source else 0)) for i in range(num_layers)],
                     skips=(SkipTensor("features", source, readers, size),))


THREE_ON = """plan devices=3 microbatches=1 stages=3
stage 0 layers=0:1 device=0
stage 1 layers=1:2 device={d1}
stage 2 layers=2:3 device={d2}
device 0: {ops0}
device 1: {ops1}
device 2: {ops2}
"""


def test_a_skip_tensor_past_the_next_stage_is_its_own_message_and_its_gradient_comes_back():
    # 1 GB/s = 1 MB per ms, no latency: layer 0 sends 1 MB to layer 1 and 6 MB straight to layer 2
    cluster = ClusterSpec(num_devices=3, intra_node_bandwidth=1e9, latency_s=0.0, message_overhead_ms=0.0)
    plan = plan_of(THREE_ON.format(d1=1, d2=2, ops0="0F0 0B0", ops1="1F0 1B0", ops2="2F0 2B0"))
    result = simulate(plan, skip_table(3, (0, (2,), 6_000_000)), cluster)
    start = {str(op): t for op, t in result.op_start.items()}
    # F0 0-1; chain 1 MB to device 1 at 2, F1 2-3; the skip reaches device 2 at 7 (after F1's
    # output at 4), F2 7-8, B2 8-10; its gradients: 1 MB to device 1 at 11 (B1 11-13, on at 14)
    # and 6 MB to device 0 at 16, which B0 waits for
    assert start == {"0F0": 0, "1F0": 2, "2F0": 7, "2B0": 8, "1B0": 11, "0B0": 16}
    assert result.iteration_ms == pytest.approx(18.0)
    assert sorted((t.kind, t.src, t.dst, round(t.end_ms - t.start_ms, 6)) for t in result.transfers) == [
        ("act", 0, 1, 1.0), ("act", 0, 2, 6.0), ("act", 1, 2, 1.0),
        ("grad", 1, 0, 1.0), ("grad", 2, 0, 6.0), ("grad", 2, 1, 1.0)]
    assert iteration_time(plan, skip_table(3, (0, (2,), 6_000_000)), cluster)[0] == pytest.approx(18.0)
    # without the skip entry the 7 MB of layer 0's outputs go down the chain (and back): slower
    plain = CostTable([replace_output(layer) for layer in skip_table(3, (0, (2,), 6_000_000)).layers])
    assert simulate(plan, plain, cluster).iteration_ms == pytest.approx(25.0)


def replace_output(layer):
    return LayerCost(layer.name, forward_ms=layer.forward_ms, backward_ms=layer.backward_ms,
                     output_bytes=layer.output_bytes)


def test_a_skip_tensor_between_stages_on_one_device_sends_nothing_and_each_message_costs_its_posting():
    cluster = ClusterSpec(num_devices=2, intra_node_bandwidth=1e9, latency_s=0.0, message_overhead_ms=0.5)
    costs = skip_table(3, (0, (2,), 6_000_000))
    v_shape = plan_of(THREE_ON.format(d1=1, d2=0, ops0="0F0 2F0 2B0 0B0", ops1="1F0 1B0", ops2="").replace(
        "devices=3", "devices=2").replace("device 2: \n", ""))
    result = simulate(v_shape, costs, cluster)
    assert sorted((t.kind, t.src, t.dst, round(t.end_ms - t.start_ms, 6)) for t in result.transfers) == [
        ("act", 0, 1, 1.0), ("act", 1, 0, 1.0), ("grad", 0, 1, 1.0), ("grad", 1, 0, 1.0)]
    # every op posts one receive and one send (0.5 ms each) except the ends: F0 and B0 only send
    # or receive; the skip adds none
    assert result.op_end[F(0, 0)] - result.op_start[F(0, 0)] == pytest.approx(1.5)
    # on three devices the skip's messages are posted by both ends: F0 sends two, F2 receives two
    line = plan_of(THREE_ON.format(d1=1, d2=2, ops0="0F0 0B0", ops1="1F0 1B0", ops2="2F0 2B0"))
    result = simulate(line, costs, ClusterSpec(num_devices=3, intra_node_bandwidth=1e9, latency_s=0.0,
                                               message_overhead_ms=0.5))
    assert result.op_end[F(0, 0)] - result.op_start[F(0, 0)] == pytest.approx(2.0)
    assert result.op_end[F(2, 0)] - result.op_start[F(2, 0)] == pytest.approx(2.0)
    assert result.op_end[B(0, 0)] - result.op_start[B(0, 0)] == pytest.approx(3.0)


def test_a_skip_tensor_from_inside_a_stage_read_by_the_next_stage_rides_with_its_output():
    cluster = ClusterSpec(num_devices=2, intra_node_bandwidth=1e9, latency_s=0.0, message_overhead_ms=0.0)
    plan = plan_of("""plan devices=2 microbatches=1 stages=2
stage 0 layers=0:2 device=0
stage 1 layers=2:4 device=1
device 0: 0F0 0B0
device 1: 1F0 1B0
""")
    result = simulate(plan, skip_table(4, (0, (3,), 3_000_000)), cluster)
    (act,) = [t for t in result.transfers if t.kind == "act"]
    assert act.end_ms - act.start_ms == pytest.approx(4.0)  # layer 1's 1 MB and layer 0's 3 MB


def test_an_overlapped_parameter_gather_runs_from_the_step_start_before_each_stages_first_forward():
    # a sharded state over 2 copies with overlap_param_gather: no broadcast at the end; per device
    # from time 0 one all-gather per stage in the order of its first forwards (1 ms + half the
    # bytes at 1 GB/s), the tied parameter with the first of the device's stages holding it, and
    # each stage's forwards after its own
    cluster = ClusterSpec(num_devices=4, devices_per_node=4, intra_node_bandwidth=1e9, latency_s=1e-3,
                          message_overhead_ms=0.0).replica(2)
    split = plan_of(FOUR_ON_TWO.format(d1=0, d2=1, d3=1, ops0="0F0 1F0 1B0 0B0", ops1="2F0 3F0 3B0 2B0"))
    costs = tied_table(2_000_000, params=4_000_000)  # layers 0 and 3 also hold the 2 MB tied embedding
    sharded = MemoryModel.for_optimizer("adamw", 2)
    overlapped = MemoryModel.for_optimizer("adamw", 2, overlap_param_gather=True)
    plain = simulate(split, costs, cluster, memory=sharded)
    result = simulate(split, costs, cluster, memory=overlapped)
    assert any(r.name == "data-parallel shard broadcast" for r in plain.reductions)
    assert not any(r.name == "data-parallel shard broadcast" for r in result.reductions)
    gathers = {r.name: (r.devices, r.start_ms, r.end_ms) for r in result.reductions
               if r.name.startswith("data-parallel parameter gather")}
    assert gathers == {"data-parallel parameter gather stage 0": ((0,), 0.0, pytest.approx(3.0)),
                       "data-parallel parameter gather stage 1": ((0,), pytest.approx(3.0), pytest.approx(6.0)),
                       "data-parallel parameter gather stage 2": ((1,), 0.0, pytest.approx(3.0)),
                       "data-parallel parameter gather stage 3": ((1,), pytest.approx(3.0), pytest.approx(6.0))}
    start = result.op_start
    assert start[F(0, 0)] == pytest.approx(3.0) and start[F(1, 0)] == pytest.approx(6.0)
    assert start[F(2, 0)] >= 3.0 and start[F(3, 0)] >= 6.0
    # the gradients are still reduce-scattered after the backward, after the gathers
    buckets = [r for r in result.reductions if r.name.startswith("data-parallel stage")]
    assert len(buckets) == 4 and all(r.start_ms >= 6.0 for r in buckets)
    assert result.iteration_ms == pytest.approx(max(r.end_ms for r in result.reductions))
    assert iteration_time(split, costs, cluster, memory=overlapped)[0] == pytest.approx(result.iteration_ms)
    assert "device 1's copies send each other stage 3's updated shares before its first forward" in str(result)
    # the critical path starts where a forward waited for its gather rather than for an op
    assert result.critical_path[0] == F(1, 0)


def test_fp32_gradients_double_the_bytes_each_reduction_sums_but_not_the_gathers():
    # fp32 gradients of bf16 weights (grad_bytes_per_param_byte 2): every data-parallel bucket
    # and the tied all-reduce sum twice the bytes; the overlapped gathers still send the weights
    cluster = ClusterSpec(num_devices=4, devices_per_node=4, intra_node_bandwidth=1e9, latency_s=1e-3,
                          message_overhead_ms=0.0).replica(2)
    split = plan_of(FOUR_ON_TWO.format(d1=0, d2=1, d3=1, ops0="0F0 1F0 1B0 0B0", ops1="2F0 3F0 3B0 2B0"))
    costs = tied_table(2_000_000, params=4_000_000)
    bf16 = MemoryModel.for_optimizer("mixed-adam", 2, overlap_param_gather=True)
    fp32 = MemoryModel.for_optimizer("mixed-adam", 2, overlap_param_gather=True, fp32_grads=True)
    assert fp32.grad_bytes_per_param_byte == 2.0
    spans = []
    for memory in (bf16, fp32):
        result = simulate(split, costs, cluster, memory=memory)
        spans.append({r.name + str(r.devices): r.end_ms - r.start_ms for r in result.reductions})
        assert iteration_time(split, costs, cluster, memory=memory)[0] == pytest.approx(result.iteration_ms)

    def half_ring(size):  # a reduce-scatter over 2 copies: 1 step of (1 ms + half the bytes at 1 GB/s)
        return 1.0 + size / 2 / 1e6

    for name in spans[0]:
        if name.startswith("data-parallel stage 1"):
            assert spans[0][name] == pytest.approx(half_ring(4e6)) and spans[1][name] == pytest.approx(half_ring(8e6))
        elif name.startswith("data-parallel parameter gather"):
            assert spans[1][name] == pytest.approx(spans[0][name])
        elif name.startswith("embed.weight"):  # tied across devices 0 and 1: 2 steps of half its bytes
            assert spans[0][name] == pytest.approx(2 * (1.0 + 2e6 / 2 / 1e6))
            assert spans[1][name] == pytest.approx(2 * (1.0 + 4e6 / 2 / 1e6))
    assert any(n.startswith("embed.weight") for n in spans[0]) and any(n.startswith("data-parallel stage 1")
                                                                       for n in spans[0])


def test_data_parallel_copies_sum_each_stages_gradients_once_its_backward_is_done():
    # 2 replicas of this 2-device pipeline on 4 devices of a node: each device all-reduces a
    # stage's gradients over its 2 copies once the stage's last B ran (beside the rest of its
    # backward), one bucket at a time, and the parameters tied across devices after their tied
    # all-reduce; the iteration ends with the last
    full = ClusterSpec(num_devices=4, devices_per_node=4, intra_node_bandwidth=1e9, latency_s=1e-3)
    cluster = full.replica(2)
    assert (cluster.num_devices, cluster.devices_per_node, cluster.data_parallel) == (2, 2, 2)
    split = plan_of(FOUR_ON_TWO.format(d1=0, d2=1, d3=1, ops0="0F0 1F0 1B0 0B0", ops1="2F0 3F0 3B0 2B0"))
    costs = tied_table(2_000_000, params=4_000_000)  # layers 0 and 3 also hold the 2 MB tied embedding
    alone = simulate(split, costs, replace(cluster, data_parallel=1))
    result = simulate(split, costs, cluster)
    ends = alone.op_end
    tied, *buckets = result.reductions
    assert tied.name == "embed.weight"
    by_name = {(r.devices[0], r.name): r for r in buckets}
    assert set(by_name) == {(0, "data-parallel stage 1"), (0, "data-parallel stage 0"), (0, "data-parallel tied"),
                            (1, "data-parallel stage 3"), (1, "data-parallel stage 2"), (1, "data-parallel tied")}

    def ms(size):  # a ring of 2: 2 steps of (1 ms + half the bytes at 1 GB/s)
        return 2 * (1.0 + size / 2 / 1e6)

    stage1 = by_name[(0, "data-parallel stage 1")]
    assert stage1.start_ms == pytest.approx(ends[B(1, 0)])
    assert stage1.start_ms < ends[B(0, 0)]  # beside device 0's last B
    assert stage1.end_ms - stage1.start_ms == pytest.approx(ms(4e6))
    stage0 = by_name[(0, "data-parallel stage 0")]
    assert stage0.start_ms == pytest.approx(max(ends[B(0, 0)], stage1.end_ms))
    assert stage0.end_ms - stage0.start_ms == pytest.approx(ms(2e6))  # its layer less the tied copy
    for device in (0, 1):
        last = by_name[(device, "data-parallel tied")]
        assert last.start_ms >= tied.end_ms - 1e-9 and last.end_ms - last.start_ms == pytest.approx(ms(2e6))
    assert result.iteration_ms == pytest.approx(max(r.end_ms for r in result.reductions))
    assert result.iteration_ms > alone.iteration_ms
    assert iteration_time(split, costs, cluster)[0] == pytest.approx(result.iteration_ms)
    assert "device 1's gradients (stage 2) all-reduced over its 2 copies" in str(result)
    assert result.data_parallel_ms == pytest.approx(max(
        sum(r.end_ms - r.start_ms for r in buckets if r.devices == (d,)) for d in (0, 1)))
    # copies across nodes use the inter-node links
    wide = ClusterSpec(num_devices=16, devices_per_node=8, inter_node_bandwidth=1e8).replica(16)
    assert wide.data_parallel_bandwidth == 1e8 and wide.devices_per_node == 1
    with pytest.raises(ClusterSpecError, match="already one of 2 replicas"):
        cluster.replica(2)
    with pytest.raises(ClusterSpecError, match="data_parallel must be a positive integer"):
        replace(cluster, data_parallel=0)
