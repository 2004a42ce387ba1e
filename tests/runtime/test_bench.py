"""octopipe.bench: the measured-run helpers the demo and the benchmarks rely on."""

import dataclasses

import pytest
import torch

from octopipe import ClusterSpec, models
from octopipe.bench import runtime_profile
from octopipe.runtime.host_memory import keep_freed_host_memory

pytestmark = pytest.mark.timeout(240)


def _tiny_llama(batch_size):
    """The tiny llama, an example batch of `batch_size` and its target."""
    return (models.build("llama", "tiny"), models.example_inputs("llama", "tiny", batch_size=batch_size),
            models.example_target("llama", "tiny", batch_size=batch_size))


def test_runtime_profile_times_every_layer_and_a_message_the_runtime_way():
    torch.manual_seed(0)
    model, inputs, target = _tiny_llama(batch_size=4)
    profile = runtime_profile(model, inputs, target, models.lm_loss, 2, num_procs=2, steps=2, warmup=1)
    assert 0 < profile.message_overhead_ms < 50  # a small positive host cost per send or receive
    costs = profile.costs
    graph_layers = len(list(costs))
    assert graph_layers >= 4
    for layer in costs:
        assert layer.forward_ms > 0, layer
        assert 0 <= layer.backward_weight_ms <= layer.backward_ms, layer
    blocks = [layer for layer in costs if layer.name.startswith("layers.")]
    # transformer blocks are linear layers: W (their weight matmuls) is real work (about a sixth
    # of B + W on this CPU); the loss has no weights, its W op is an empty call
    assert sum(layer.backward_weight_ms for layer in blocks) > 0.05 * sum(layer.backward_ms for layer in blocks)
    loss = costs.layers[-1]
    assert all(loss.backward_weight_ms < 0.2 * layer.backward_weight_ms for layer in blocks)
    assert all(layer.activation_bytes > 0 for layer in blocks)  # bytes come from profile_costs
    # the steps' times hold the gradient accumulation they did: nothing is re-costed on top (a
    # plan for 4 microbatches charged 3/4 of profile_costs' estimate again before)
    assert costs.num_microbatches is None and not costs.accumulates and not costs.has_selective_info
    assert costs.for_microbatches(4) is costs


def test_profile_taken_in_the_measured_rotation_covers_every_layer_and_keeps_the_bytes():
    import octopipe
    from octopipe.bench import measure_with_profile, runtime_probe

    torch.manual_seed(0)
    model, inputs, target = _tiny_llama(batch_size=4)
    probe = runtime_probe(model, inputs, target, models.lm_loss, 2)
    assert probe.pipe.plan.num_stages == len(probe.sizes)  # one stage per layer, on both ranks
    assert set(probe.pipe.plan.placement) == {0, 1}
    cluster = octopipe.ClusterSpec.preset("cpu", num_devices=2)
    plan = octopipe.schedules.build("1f1b", probe.sizes, cluster, 2)
    pipe = octopipe.compile(model, cluster, example_inputs=inputs, example_target=target, loss_fn=models.lm_loss,
                            num_microbatches=2, costs=probe.sizes, plan=plan, quiet=True)
    timings, profile = measure_with_profile([pipe], probe, inputs, target, steps=2, warmup=1)
    assert len(timings) == 1 and len(timings[0].step_ms) == 2  # the probe's own steps are not reported
    costs = profile.costs
    assert 0 < profile.message_overhead_ms < 50  # the probe's two layer groups exchange messages
    # the groups meet at one layer boundary: every message is that layer's output
    last_of_first_group = probe.pipe.plan.placement.index(1) - 1
    assert profile.message_bytes == probe.sizes.output[last_of_first_group]
    # the link was ping-ponged between the rotation's rounds: it replaces the cluster's, and the
    # host-copy bandwidth where the cluster has one
    assert 0 < profile.latency_s < 0.05 and profile.bandwidth > 1e7
    calibrated = profile.calibrate(cluster)
    assert (calibrated.latency_s, calibrated.intra_node_bandwidth, calibrated.inter_node_bandwidth,
            calibrated.message_copy_bandwidth) == (profile.latency_s, *[profile.bandwidth] * 3)
    # a send's time includes the sender's copy, which the simulator charges by message_copy_bandwidth
    copy_ms = profile.message_bytes / profile.bandwidth * 1e3
    assert calibrated.message_overhead_ms == pytest.approx(profile.message_overhead_ms - copy_ms / 2)
    no_copy = dataclasses.replace(cluster, message_copy_bandwidth=0.0)
    assert profile.calibrate(no_copy).message_overhead_ms == profile.message_overhead_ms
    assert profile.calibrate(no_copy).message_copy_bandwidth == 0.0
    unmeasured = dataclasses.replace(profile, latency_s=None, bandwidth=None)
    assert unmeasured.calibrate(cluster).latency_s == cluster.latency_s
    # the probe's own steps, every op timed: the host time of a step outside its ops
    assert profile.plan is probe.pipe.plan and len(profile.steps.step_ms) == 2 and len(profile.steps.op_ms) == 2
    assert 0 <= calibrated.step_overhead_ms < max(profile.steps.step_ms)
    assert [layer.name for layer in costs] == [layer.name for layer in probe.sizes]
    assert all(layer.forward_ms > 0 and layer.backward_ms > 0 for layer in costs)
    # the fused probe (1F1B order) times each layer's full backward too
    assert len(probe.pipes) == 3 and not probe.fused.plan.split_backward()
    assert all(layer.backward_full_ms is not None and layer.backward_full_ms > 0 for layer in costs)
    # and, with every stage recomputing, each layer's forward without autograd
    assert all(probe.no_grad.plan.recompute) and not any(probe.fused.plan.recompute)
    assert all(layer.forward_no_grad_ms is not None and layer.forward_no_grad_ms > 0 for layer in costs)
    assert [layer.activation_bytes for layer in costs] == [layer.activation_bytes for layer in probe.sizes]


def _first_ops(rank, world_size, pipe, inputs, target):
    engine = pipe.engine(rank)
    engine.timeline = []
    engine.step(inputs, target)
    return [(str(instruction).split()[0], instruction.stage, start, end) for instruction, start, end in engine.timeline]


def test_timeline_does_not_count_waiting_for_a_message_as_compute():
    import octopipe
    from octopipe.runtime import launch

    torch.manual_seed(0)
    model, inputs, target = _tiny_llama(batch_size=16)
    cluster = octopipe.ClusterSpec.preset("cpu", num_devices=2)
    pipe = octopipe.compile(model, cluster, example_inputs=inputs, example_target=target, loss_fn=models.lm_loss,
                            num_microbatches=2, schedule="1f1b", quiet=True)
    first, second = launch(_first_ops, 2, args=(pipe, inputs, target))
    # rank 1's first forward needs rank 0's activations: its recorded start is after rank 0
    # posted them (perf_counter is one monotonic clock for all processes of this machine)
    posted = next(start for kind, _, start, _ in first if kind == "send_act")
    forward = next(start for kind, _, start, _ in second if kind == "forward")
    assert forward >= posted


def test_host_memory_policy_applies_once_and_can_be_turned_off(monkeypatch):
    import octopipe.runtime.host_memory as host_memory

    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setenv("OCTOPIPE_KEEP_HOST_MEMORY", "0")
    assert keep_freed_host_memory() is False
    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.delenv("OCTOPIPE_KEEP_HOST_MEMORY")
    first = keep_freed_host_memory()
    assert keep_freed_host_memory() is first  # idempotent: the second call reports the first's result


def test_a_rank_without_stages_trains_alongside_the_others():
    import octopipe
    from octopipe.bench import measure_steps
    from octopipe.ir.plan import B, F, PipelinePlan

    torch.manual_seed(0)
    model, inputs, target = _tiny_llama(batch_size=4)
    ops0 = [F(0, 0), F(0, 1), B(0, 0), B(0, 1)]
    ops1 = [F(1, 0), B(1, 0), F(1, 1), B(1, 1)]
    plan = PipelinePlan.build(2, [0, 4, 8], [0, 1], [ops0, ops1, []], num_devices=3)
    pipe = octopipe.compile(model, octopipe.ClusterSpec.preset("cpux3"), example_inputs=inputs, example_target=target,
                            loss_fn=models.lm_loss, num_microbatches=2, plan=plan, quiet=True)
    timing = measure_steps(pipe, inputs, target, steps=2, warmup=0, learning_rate=0.1)
    assert timing.losses[1] < timing.losses[0]  # the optimizer stepped on the ranks that hold parameters


def test_rewarm_times_the_second_of_two_back_to_back_steps():
    import octopipe
    from octopipe.bench import measure_many

    torch.manual_seed(0)
    model, inputs, target = _tiny_llama(batch_size=4)
    cluster = octopipe.ClusterSpec.preset("cpux2")
    pipe = octopipe.compile(model, cluster, example_inputs=inputs, example_target=target, loss_fn=models.lm_loss,
                            num_microbatches=2, quiet=True)
    every = measure_many([pipe], inputs, target, steps=4, warmup=0, learning_rate=0.1)[0]
    rewarmed = measure_many([pipe], inputs, target, steps=2, warmup=0, learning_rate=0.1, rewarm=True)[0]
    assert len(rewarmed.step_ms) == 2
    # each timed step follows an untimed training step of its own: the 2nd and 4th of a plain run
    assert rewarmed.losses == pytest.approx((every.losses[1], every.losses[3]), rel=1e-6)
    assert every.losses[3] < every.losses[0]


def test_probe_records_only_the_timed_steps_when_rewarmed():
    from octopipe.bench import _measure, runtime_probe

    torch.manual_seed(0)
    model, inputs, target = _tiny_llama(batch_size=4)
    probe = runtime_probe(model, inputs, target, models.lm_loss, 2, fused=False)
    for rewarm in (False, True):
        _, durations, link = _measure([probe.pipe], [True], inputs, target, 2, 1, 0.0, 120.0, rewarm)
        assert link is None  # not asked for
        forwards = [len(run[("forward", stage)]) for rank in durations for run in rank
                    for stage in range(len(probe.sizes)) if ("forward", stage) in run]
        # 2 timed steps x 2 microbatches per layer: neither the warm-up nor the untimed rewarm
        # steps leak into the profile
        assert forwards and set(forwards) == {4}, (rewarm, forwards)


def test_calibrated_cpu_cluster_has_a_measured_link_and_op_overhead():
    from octopipe.bench import _pingpong_worker, calibrate_cpu_cluster
    from octopipe.runtime import launch

    small, large = launch(_pingpong_worker, 2, args=((4, 2**24), 5, 2))[0]
    # one-way times: the 16 MiB message takes longer (~5 ms here; 1 MiB, ~0.4 ms, once measured
    # under a 1.5 ms hiccup of the 4-byte one while the machine was busy)
    assert 0 < small < large
    cluster = calibrate_cpu_cluster(2)
    assert cluster.num_devices == 2 and cluster.backend == "gloo"
    assert 0 < cluster.latency_s < 0.05 and cluster.intra_node_bandwidth > 1e7
    assert cluster.message_copy_bandwidth == cluster.intra_node_bandwidth  # hosts copy gloo messages themselves
    assert 0 <= cluster.op_overhead_ms < 5


def _one_rank_fails(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("the real cause")
    dist.barrier()  # rank 0 then loses its peer


def test_launch_reports_the_rank_that_failed_first_not_its_echo():
    from octopipe.errors import ExecutionError
    from octopipe.runtime import launch

    with pytest.raises(ExecutionError, match=r"worker rank 1 of 2 failed[\s\S]*ValueError: the real cause"):
        launch(_one_rank_fails, 2, timeout_s=60)


def test_paired_speedup_pairs_rounds_so_drift_between_rounds_cancels():
    from octopipe.bench import StepTiming, paired_speedup

    # the machine slows down 2x over the run; theirs is always 1.25x ours in the same round
    ours = StepTiming((100.0, 150.0, 200.0, 120.0, 180.0), ())
    theirs = StepTiming(tuple(1.25 * t for t in ours.step_ms), ())
    paired = paired_speedup(ours, theirs)
    assert paired.median == pytest.approx(1.25) and paired.low == pytest.approx(1.25) == paired.high
    assert str(paired) == "per-step pairs 1.250x (middle half 1.250x-1.250x)"
    noisy = paired_speedup(StepTiming((100.0, 100.0, 100.0, 100.0), ()), StepTiming((90.0, 100.0, 110.0, 130.0), ()))
    assert noisy.low < noisy.median < noisy.high and noisy.median == pytest.approx(1.05)
    short = paired_speedup(StepTiming((100.0, 100.0), ()), StepTiming((90.0, 120.0), ()))
    assert (short.low, short.high) == (pytest.approx(0.9), pytest.approx(1.2))
    with pytest.raises(ValueError, match="same number of steps"):
        paired_speedup(ours, StepTiming((1.0,), ()))


def test_a_trimmed_profile_drops_each_ops_outliers():
    from octopipe.bench import RuntimeProbe
    from octopipe.ir.costs import CostTable, LayerCost

    sizes = CostTable([LayerCost("a", forward_ms=0.0, backward_ms=0.0), LayerCost("b", forward_ms=0.0, backward_ms=0.0)])
    probe = RuntimeProbe(pipe=None, sizes=sizes)
    stalled = [1.0] * 9 + [91.0]  # one op of ten stalled (a page fault, another process)
    durations = [{("forward", 0): stalled, ("forward", 1): [2.0] * 10, ("backward_input", 0): [3.0, 5.0] * 5}]
    plain, trimmed = probe.profile(durations, trim=0.0), probe.profile(durations)  # trimmed by default
    assert trimmed == probe.profile(durations, trim=0.1)
    assert plain.costs.layers[0].forward_ms == pytest.approx(10.0)  # the mean carries the stall
    assert trimmed.costs.layers[0].forward_ms == pytest.approx(1.0)  # dropped with the fastest
    assert plain.costs.layers[1].forward_ms == trimmed.costs.layers[1].forward_ms == 2.0
    assert trimmed.costs.layers[0].backward_ms == pytest.approx(4.0)  # symmetric: the mean of the middle
    # the op-to-op spread: each duration over its op's price, pooled and sorted
    assert len(trimmed.spread) == 30 and list(trimmed.spread) == sorted(trimmed.spread)
    assert trimmed.spread[-1] == pytest.approx(91.0) and trimmed.spread[0] == pytest.approx(0.75)
    short = probe.profile([{("forward", 0): [0.1, 0.3] * 5}])  # under SPREAD_MIN_MS: left out
    assert short.spread == ()
    # the no-grad pipeline's forwards are priced apart; its backwards (a forward again) not at all
    tagged = RuntimeProbe(pipe="zb", sizes=sizes, fused="fused", no_grad="no grad")
    ranks = [[{("forward", 0): [9.0]}, {("forward", 0): [2.0], ("forward", 1): [2.0]},
              {("forward", 0): [1.5], ("forward", 1): [1.5], ("backward", 0): [99.0]}]] * 2
    assert tagged.runs(ranks)[2] == {("forward_no_grad", 0): [1.5], ("forward_no_grad", 1): [1.5]}
    split = tagged.profile(tagged.runs(ranks), trim=0.0)
    assert [layer.forward_no_grad_ms for layer in split.costs] == [1.5, 1.5]
    assert split.costs.layers[0].forward_ms == pytest.approx(5.5)  # the other pipes' forwards only
    assert split.costs.layers[0].backward_full_ms is None  # the no-grad pipe's backward is not one
    assert [layer.forward_no_grad_ms for layer in plain.costs] == [None, None]
    with pytest.raises(ValueError, match="trim"):
        probe.profile(durations, trim=0.5)


def test_busy_time_of_measured_pipes_is_recorded_per_rank_on_request():
    import octopipe
    from octopipe.bench import measure_with_profiles, runtime_probe

    torch.manual_seed(0)
    model, inputs, target = _tiny_llama(batch_size=4)
    probe = runtime_probe(model, inputs, target, models.lm_loss, 2, fused=False)
    cluster = octopipe.ClusterSpec.preset("cpu", num_devices=2)
    pipes = [octopipe.compile(model, cluster, example_inputs=inputs, example_target=target, loss_fn=models.lm_loss,
                              num_microbatches=2, costs=probe.sizes, schedule=name, quiet=True)
             for name in ("1f1b", "zb-h1")]
    timings, _ = measure_with_profiles(pipes, probe, inputs, target, steps=2, warmup=1, busy=True)
    assert len(timings) == 2
    for timing in timings:
        assert len(timing.busy_ms) == 2  # one per rank
        # every instruction runs between the step's two barriers: busy within the step, and a
        # rank with stages did run something
        assert all(0 < busy <= max(timing.step_ms) for busy in timing.busy_ms)
        # and each timed step's ops, every rank's, one time per op of the plan
        pipe = pipes[timings.index(timing)]
        assert len(timing.op_ms) == 2
        planned = {(op.kind.value, op.stage, op.microbatch) for ops in pipe.plan.device_ops for op in ops}
        assert all(set(step) == planned for step in timing.op_ms)
        assert all(0 < ms <= max(timing.step_ms) for step in timing.op_ms for ms in step.values())
    plain, _ = measure_with_profiles(pipes[:1], probe, inputs, target, steps=1, warmup=0)
    assert plain[0].busy_ms == () and plain[0].op_ms == ()


def test_a_one_process_profile_has_no_link_or_message_to_measure():
    torch.manual_seed(0)
    model, inputs, target = _tiny_llama(batch_size=4)
    profile = runtime_profile(model, inputs, target, models.lm_loss, 2, num_procs=1, steps=1, warmup=0)
    assert profile.latency_s is None and profile.bandwidth is None and profile.message_overhead_ms is None
    assert all(layer.forward_ms > 0 for layer in profile.costs)
    cluster = ClusterSpec.preset("cpu", num_devices=1)
    # no link or message measured, nothing of theirs replaced; a step's host time outside its ops is
    calibrated = profile.calibrate(cluster)
    assert dataclasses.replace(calibrated, step_overhead_ms=0.0) == cluster
    assert 0 <= calibrated.step_overhead_ms < max(profile.steps.step_ms)


def test_a_step_replayed_on_its_measured_ops_moves_with_them():
    from octopipe import PipelinePlan
    from octopipe.bench import replayed_ms
    from octopipe.ir import CostTable, LayerCost
    from octopipe.simulator import simulate

    plan = PipelinePlan.parse("plan devices=2 microbatches=2 stages=2\nstage 0 layers=0:1 device=0\n"
                              "stage 1 layers=1:2 device=1\ndevice 0: 0F0 0F1 0B0 0B1\ndevice 1: 1F0 1B0 1F1 1B1\n")
    costs = CostTable(tuple(LayerCost(f"l{i}", forward_ms=1.0, backward_ms=2.0, output_bytes=1000) for i in range(2)))
    # a per-op overhead and a link: what the simulator adds to an op's price stays out of the replay's ratios
    cluster = ClusterSpec(num_devices=2, intra_node_bandwidth=1e9, inter_node_bandwidth=1e9, latency_s=1e-4,
                          op_overhead_ms=0.25)
    sim = simulate(plan, costs, cluster)
    as_priced = {(op.kind.value, op.stage, op.microbatch): end - sim.op_start[op] for op, end in sim.op_end.items()}
    assert replayed_ms(plan, costs, cluster, as_priced) == pytest.approx(sim.iteration_ms)
    assert replayed_ms(plan, costs, cluster, {}) == pytest.approx(sim.iteration_ms)  # unmeasured ops keep their price
    # 0F0 measured 2 ms longer than priced: the chain behind it (1F0, 1B0, 0B0, ...) moves by 2 ms
    late = dict(as_priced)
    late[("F", 0, 0)] += 2.0
    assert replayed_ms(plan, costs, cluster, late) == pytest.approx(sim.iteration_ms + 2.0)
    # 0B1 ends the step on device 0 with nothing behind it but the step: 1 ms less there is 1 ms less
    early = dict(as_priced)
    early[("B", 0, 1)] -= 1.0
    assert replayed_ms(plan, costs, cluster, early) == pytest.approx(sim.iteration_ms - 1.0)


def test_calibrate_takes_the_host_time_of_a_step_outside_its_ops_from_the_probes_steps():
    from octopipe import PipelinePlan
    from octopipe.bench import RuntimeProfile, StepTiming
    from octopipe.ir import CostTable, LayerCost
    from octopipe.simulator import simulate

    plan = PipelinePlan.parse("plan devices=2 microbatches=2 stages=2\nstage 0 layers=0:1 device=0\n"
                              "stage 1 layers=1:2 device=1\ndevice 0: 0F0 0F1 0B0 0B1\ndevice 1: 1F0 1B0 1F1 1B1\n")
    costs = CostTable(tuple(LayerCost(f"l{i}", forward_ms=1.0, backward_ms=2.0, output_bytes=1000) for i in range(2)))
    cluster = ClusterSpec(num_devices=2, intra_node_bandwidth=1e9, inter_node_bandwidth=1e9, latency_s=1e-4,
                          op_overhead_ms=0.25, step_overhead_ms=7.0)  # an earlier calibration's, replaced
    sim = simulate(plan, costs, dataclasses.replace(cluster, step_overhead_ms=0.0))
    as_priced = {(op.kind.value, op.stage, op.microbatch): end - sim.op_start[op] for op, end in sim.op_end.items()}
    slow = dict(as_priced)
    slow[("B", 1, 1)] += 1.0  # ends the step on device 1, then device 0's last B waits for it: 1 ms later
    # three steps: 2, 3 and 10 ms past what their ops explain (the third one's ops ran 1 ms slower)
    steps = StepTiming((sim.iteration_ms + 2.0, sim.iteration_ms + 3.0, sim.iteration_ms + 11.0), (0.0,) * 3,
                       op_ms=(as_priced, as_priced, slow))
    profile = RuntimeProfile(costs, None, plan=plan, steps=steps)
    calibrated = profile.calibrate(cluster)
    assert calibrated.step_overhead_ms == pytest.approx(3.0)  # the median; the ops' own 1 ms is theirs
    assert dataclasses.replace(calibrated, step_overhead_ms=7.0) == cluster
    # the simulator adds it once to every step
    assert simulate(plan, costs, calibrated).iteration_ms == pytest.approx(sim.iteration_ms + 3.0)
    # steps faster than their ops' replay (noise) give none, not a negative one
    quick = StepTiming((sim.iteration_ms - 0.5,), (0.0,), op_ms=(as_priced,))
    assert RuntimeProfile(costs, None, plan=plan, steps=quick).calibrate(cluster).step_overhead_ms == 0.0
    assert RuntimeProfile(costs, None).calibrate(cluster) == cluster  # nothing measured, nothing replaced
