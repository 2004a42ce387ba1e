"""The memory model follows the optimizer: what a device holds per byte of weights for the
optimizer a job steps (`MemoryModel.for_optimizer`), in the plan, its file, the CLI and train."""

import json
from dataclasses import replace

import pytest

import octopipe
from octopipe import ArgumentError, ClusterSpec, CostTable, InfeasibleError, LayerCost, MemoryModel, ParseError
from octopipe.api import load_saved_plan
from octopipe.cli import EXIT_ERROR, EXIT_OK, main
from octopipe.simulator import OPTIMIZER_STATE, simulate

GiB = 2**30


def heavy_weights(num_layers=8, param_bytes=2 * GiB):
    return CostTable([LayerCost(f"l{i}", forward_ms=1.0, backward_ms=2.0, activation_bytes=2**28,
                                output_bytes=2**24, param_bytes=param_bytes) for i in range(num_layers)])


def test_each_optimizer_brings_its_state_and_sharding_divides_only_the_optimizers_own():
    state = {name: MemoryModel.for_optimizer(name).state_bytes_per_param_byte for name in OPTIMIZER_STATE}
    assert state == {"mixed-adam": 8.0, "adamw": 4.0, "adam": 4.0, "sgd-momentum": 3.0, "sgd": 2.0}
    # fp32 weights on a table that counts bf16: AdamW's 16 bytes per weight over the 2 counted
    assert MemoryModel.for_optimizer("adamw", weight_bytes=4.0).state_bytes_per_param_byte == 8.0
    assert MemoryModel.for_optimizer("sgd", param_bytes_per_weight=4.0).state_bytes_per_param_byte == 2.0
    # mixed-adam holds bf16 weights by definition: 16 bytes per weight, whatever else is given
    assert MemoryModel.for_optimizer("mixed-adam", weight_bytes=4.0).state_bytes_per_param_byte == 8.0
    assert MemoryModel.for_optimizer("mixed-adam") == MemoryModel()  # the default is Megatron's
    from octopipe.cli import OPTIMIZERS  # (the CLI spells them out, so --help imports no torch)

    assert OPTIMIZERS == tuple(OPTIMIZER_STATE)
    assert MemoryModel.for_optimizer("mixed-adam", shards=4).state_bytes_per_param_byte == 2.0 + 6.0 / 4
    assert MemoryModel.for_optimizer("sgd", shards=8).state_bytes_per_param_byte == 2.0  # nothing to shard
    sharded = MemoryModel.for_optimizer("adamw", shards=4)
    assert sharded.shards == 4 and MemoryModel.from_dict(sharded.to_dict(), "file") == sharded
    assert "shards" not in MemoryModel.for_optimizer("adamw").to_dict()  # unsharded files as before
    with pytest.raises(ArgumentError, match="file: shards must be a positive integer"):
        MemoryModel.from_dict({**sharded.to_dict(), "shards": 0}, "file")
    with pytest.raises(ArgumentError, match="unknown optimizer 'lamb'.*mixed-adam, adamw"):
        MemoryModel.for_optimizer("lamb")
    for shards in (0, 1.5, True):
        with pytest.raises(ArgumentError, match="shards must be a positive integer"):
            MemoryModel.for_optimizer("adamw", shards=shards)
    with pytest.raises(ArgumentError, match="weight_bytes must be a positive number"):
        MemoryModel.for_optimizer("adamw", weight_bytes=0)
    with pytest.raises(ArgumentError, match="weight_bytes must be a positive number"):
        MemoryModel.for_optimizer("adamw", weight_bytes=10**400)  # (no float holds it)
    costs = heavy_weights(4)
    for bad, field in ((MemoryModel(state_bytes_per_param_byte=-1.0), "state_bytes_per_param_byte"),
                       (MemoryModel(state_bytes_per_param_byte=float("nan")), "state_bytes_per_param_byte"),
                       (MemoryModel(weight_memory_fraction=1.5), "weight_memory_fraction")):
        with pytest.raises(ArgumentError, match=f"plan: memory: {field}"):
            octopipe.plan(costs, "h100x2", 4, quiet=True, memory=bad)


def test_a_limit_only_a_leaner_optimizer_meets_plans_for_it_and_the_error_says_how():
    costs, cluster = heavy_weights(), ClusterSpec.preset("h100x4")
    options = dict(quiet=True, effort=0.05, memory_limit_bytes=20 * GiB)
    # mixed-precision Adam: 4 GiB of weights per device x 8 = 32 GiB, over the 20 GiB limit
    with pytest.raises(InfeasibleError, match="counted here as 8 bytes per byte of weights.*plan --optimizer"):
        octopipe.plan(costs, cluster, 8, **options)
    peaks = {}
    for name in ("adamw", "sgd"):
        memory = MemoryModel.for_optimizer(name)
        result = octopipe.plan(costs, cluster, 8, memory=memory, **options)
        sim = simulate(result.plan, costs, cluster, memory=memory)
        assert result.simulation.memory == memory
        assert max(sim.peak_memory_bytes) == pytest.approx(max(result.simulation.peak_memory_bytes))
        assert max(sim.peak_memory_bytes) <= 20 * GiB
        # every device holds two layers' weights: their state is the optimizer's multiple of them
        assert max(sim.static_memory_bytes) == pytest.approx(memory.state_bytes_per_param_byte * 2 * 2 * GiB)
        peaks[name] = max(sim.peak_memory_bytes)
    assert peaks["sgd"] == pytest.approx(peaks["adamw"] - 2 * 2 * 2 * GiB)


def test_a_plan_file_keeps_its_memory_model_and_simulate_counts_with_it(tmp_path, capsys):
    table = tmp_path / "costs.json"
    table.write_text(json.dumps(heavy_weights().to_dict()))
    plan_path = tmp_path / "plan.json"
    assert main(["plan", "--costs", str(table), "--cluster", "h100x4", "--microbatches", "8", "--memory-limit", "20",
                 "--optimizer", "sgd", "--quiet", "--no-solver", "--effort", "0.05", "-o", str(plan_path)]) == EXIT_OK
    capsys.readouterr()
    saved = load_saved_plan(plan_path)
    assert saved.memory == MemoryModel.for_optimizer("sgd")
    assert main(["simulate", str(plan_path)]) == EXIT_OK
    out = capsys.readouterr().out
    peak = max(simulate(saved.plan, saved.costs, saved.cluster, memory=saved.memory).peak_memory_bytes) / GiB
    assert f"{peak:.3f}" in out and "(the same)" in out
    # the default model is not written: files planned with it read as before
    default_path = tmp_path / "default.json"
    assert main(["plan", "--costs", str(table), "--cluster", "h100x4", "--microbatches", "8", "--quiet",
                 "--no-solver", "--effort", "0.05", "-o", str(default_path)]) == EXIT_OK
    assert "memory" not in json.loads(default_path.read_text())["planned_with"]
    assert load_saved_plan(default_path).memory == MemoryModel()
    # sharded Adam state over 4 replicas: 2 + 6 / 4 bytes per byte of weights
    sharded = tmp_path / "sharded.json"
    assert main(["plan", "--costs", str(table), "--cluster", "h100x4", "--microbatches", "8", "--memory-limit", "20",
                 "--optimizer-shards", "4", "--quiet", "--no-solver", "--effort", "0.05", "-o", str(sharded)]) == EXIT_OK
    assert load_saved_plan(sharded).memory.state_bytes_per_param_byte == 3.5
    edited = json.loads(plan_path.read_text())
    edited["planned_with"]["memory"]["weight_memory_fraction"] = 2
    plan_path.write_text(json.dumps(edited))
    with pytest.raises(ParseError, match="weight_memory_fraction.*edited by hand"):
        load_saved_plan(plan_path)


def test_compile_sizes_the_optimizers_state_from_the_models_own_weights():
    from octopipe import models

    model = models.build("gemma", "tiny")  # fp32 weights, the embedding tied to the head
    x = models.example_inputs("gemma", "tiny", batch_size=4)
    y = models.example_target("gemma", "tiny", batch_size=4)

    def compiled(costs):
        return octopipe.compile(model, "cpux2", example_inputs=x, example_target=y, loss_fn=models.lm_loss,
                                num_microbatches=2, costs=costs, schedule="1f1b", quiet=True, optimizer="adamw")

    # analytic costs count the weights as the run holds them, 4 bytes (fp32, no autocast): fp32
    # AdamW keeps 16 bytes per weight (weight, gradient, two moments), 4 per byte the table counts
    pipe = compiled("analytic")
    assert pipe.simulation.memory.state_bytes_per_param_byte == pytest.approx(4.0)
    # a table that counts 2 bytes per weight (a bf16 job's, as analytic costs under autocast): 8
    analytic = pipe.costs
    bf16 = analytic.replace_layers(replace(layer, param_bytes=layer.param_bytes // 2) for layer in analytic)
    bf16 = replace(bf16, tied=tuple(replace(tied, bytes=tied.bytes // 2) for tied in analytic.tied), _derived={})
    assert compiled(bf16).simulation.memory.state_bytes_per_param_byte == pytest.approx(8.0)
    with pytest.raises(ArgumentError, match="optimizer= .* or memory= .* not both"):
        octopipe.compile(model, "cpux2", example_inputs=x, example_target=y, loss_fn=models.lm_loss,
                         num_microbatches=2, schedule="1f1b", quiet=True, optimizer="sgd",
                         memory=MemoryModel(state_bytes_per_param_byte=3.0))


def test_train_plans_for_the_optimizer_it_steps(monkeypatch, capsys):
    asked = []

    class Planned(Exception):
        pass

    def compile_(*args, **options):
        asked.append(options.get("optimizer"))
        raise Planned

    monkeypatch.setattr(octopipe, "compile", compile_)
    for optimizer in ("sgd", "adamw"):
        with pytest.raises(Planned):
            main(["train", "--model", "llama", "--size", "tiny", "--optimizer", optimizer, "--quiet"])
        assert asked[-1] == optimizer


def test_plan_with_a_model_sizes_the_optimizers_state_from_its_weights(tmp_path, capsys):
    # a built-in model holds fp32 weights; its analytic costs count bf16: SGD's weight and
    # gradient, 8 bytes per weight, are 4 per counted byte (on a bf16 cost table, sgd is 2)
    path = tmp_path / "plan.json"
    assert main(["plan", "--model", "gemma", "--size", "tiny", "--cluster", "cpux2", "--microbatches", "4",
                 "--optimizer", "sgd", "--quiet", "--time-limit", "5", "--no-solver", "-o", str(path)]) == EXIT_OK
    assert load_saved_plan(path).memory.state_bytes_per_param_byte == pytest.approx(4.0)
    # sharded AdamW over 2 replicas: fp32 weights keep 8 bytes a weight and split their moments
    # (8 + 8/2 = 12, 6 per counted byte); bf16 weights with fp32 copies and bf16 gradients
    # (train --bf16-weights --grad-reduce-in-bf16) keep 4 and split the copy and moments (4 +
    # 12/2 = 10, 5 per counted byte); with fp32 gradients (--bf16-weights' default) 6 (2 + 4) and
    # the same split (12, 6 per counted byte), the reductions summing 2 bytes per counted byte
    for flags, state, grad in (([], 6.0, 1.0), (["--bf16-weights", "--grad-reduce-in-bf16"], 5.0, 1.0),
                               (["--bf16-weights"], 6.0, 2.0), (["--bf16-weights", "--fp32-grads"], 6.0, 2.0),
                               (["--fp16-weights"], 6.0, 2.0)):
        assert main(["plan", "--model", "gemma", "--size", "tiny", "--cluster", "cpux4", "--microbatches", "4",
                     "--data-parallel", "2", "--shard-optimizer", "--optimizer", "adamw", "--quiet", "--time-limit",
                     "5", "--no-solver", "-o", str(path), *flags]) == EXIT_OK
        memory = load_saved_plan(path).memory
        assert memory.state_bytes_per_param_byte == pytest.approx(state), flags
        assert memory.grad_bytes_per_param_byte == pytest.approx(grad), flags
    # on a cost table: mixed-adam has its fp32 copies already (18 bytes a weight, 9 per counted one)
    assert main(["plan", "--model", "gemma", "--size", "tiny", "--cluster", "cpux2", "--microbatches", "4",
                 "--fp32-grads", "--quiet", "--time-limit", "5", "--no-solver", "-o", str(path)]) == EXIT_OK
    assert load_saved_plan(path).memory.state_bytes_per_param_byte == pytest.approx(9.0)
    assert main(["plan", "--model", "gemma", "--size", "tiny", "--cluster", "cpux2", "--microbatches", "4",
                 "--optimizer", "adamw", "--fp32-grads", "--quiet"]) == EXIT_ERROR
    assert "give --bf16-weights too" in capsys.readouterr().err


def test_plan_data_parallel_counts_each_replica_counts_share_of_a_sharded_optimizer_state(tmp_path, capsys):
    # 8 layers of 2 GiB of weights on 8 H100s under a 24 GiB limit, AdamW (4 bytes per counted
    # byte): 4 replicas of 2 devices hold 8 GiB of weights each, 32 GiB with the state; sharded
    # over the 4 replicas (ZeRO-1), 2 + 2/4 bytes: 20 GiB, which fits
    costs, cluster = heavy_weights(), ClusterSpec.preset("h100x8")
    options = dict(quiet=True, effort=0.02, memory_limit_bytes=24 * GiB, counts=(2, 4), time_limit_s=20)
    whole = octopipe.plan_data_parallel(costs, cluster, 16, memory=MemoryModel.for_optimizer("adamw"), **options)
    sharded = octopipe.plan_data_parallel(costs, cluster, 16, memory=lambda d: MemoryModel.for_optimizer("adamw",
                                                                                                          shards=d),
                                          **options)
    rows = {row.data_parallel: row for row in whole.tried}
    assert rows[2].result is not None and rows[4].result is None and "no plan fits 24.00 GiB" in rows[4].error
    rows = {row.data_parallel: row for row in sharded.tried}
    assert rows[4].result is not None and rows[2].result is not None
    assert rows[4].result.simulation.memory == MemoryModel.for_optimizer("adamw", shards=4)
    assert rows[2].result.simulation.memory == MemoryModel.for_optimizer("adamw", shards=2)
    assert max(rows[4].result.simulation.peak_memory_bytes) <= 24 * GiB
    with pytest.raises(ArgumentError, match=r"memory\(2\) returned float, not a MemoryModel"):
        octopipe.plan_data_parallel(costs, cluster, 16, memory=lambda d: 8.0, **options)
    assert main(["plan", "--costs", "x.json", "--data-parallel", "2", "--shard-optimizer",
                 "--optimizer-shards", "2"]) != EXIT_OK
    assert "give one" in capsys.readouterr().err
    # the shares' broadcast overlapped with the next step: saved with the plan, priced again by
    # simulate, and refused without a sharded state
    table, out = tmp_path / "costs.json", tmp_path / "plan.json"
    costs.save(table)
    assert main(["plan", "--costs", str(table), "--cluster", "h100x8", "--microbatches", "8", "--data-parallel", "2",
                 "--shard-optimizer", "--overlap-param-gather", "--quiet", "--no-solver", "--effort", "0.05",
                 "-o", str(out)]) == EXIT_OK
    assert "each stage's forwards after its own (overlap_param_gather" in capsys.readouterr().out
    assert load_saved_plan(out).memory == MemoryModel.for_optimizer("mixed-adam", 2, overlap_param_gather=True)
    assert main(["simulate", str(out), "--costs", str(table)]) == EXIT_OK
    assert "updated shares before its first forward (overlapped with the step)" in capsys.readouterr().out
    assert main(["plan", "--costs", str(table), "--data-parallel", "auto", "--shard-optimizer",
                 "--overlap-param-gather", "--quiet", "--no-solver", "--effort", "0.02"]) == EXIT_OK  # D=1 too
    capsys.readouterr()
    assert main(["plan", "--costs", str(table), "--data-parallel", "2", "--overlap-param-gather"]) != EXIT_OK
    assert "give --shard-optimizer" in capsys.readouterr().err


def test_the_optimizer_step_is_priced_where_asked_after_the_last_reduction_and_sharded_by_the_replicas(tmp_path,
                                                                                                       capsys):
    # (3 + 2k) x the weight's bytes per weight for k moments; mixed-adam 28; over the shards
    steps = {name: MemoryModel.for_optimizer(name, price_step=True).step_bytes_per_param_byte
             for name in OPTIMIZER_STATE}
    assert steps == {"mixed-adam": 14.0, "adamw": 7.0, "adam": 7.0, "sgd-momentum": 5.0, "sgd": 3.0}
    assert MemoryModel.for_optimizer("adamw", weight_bytes=4.0, price_step=True).step_bytes_per_param_byte == 14.0
    assert MemoryModel.for_optimizer("mixed-adam", shards=4, price_step=True).step_bytes_per_param_byte == 3.5
    assert MemoryModel.for_optimizer("adamw").step_bytes_per_param_byte == 0.0  # not priced unless asked
    priced = MemoryModel.for_optimizer("mixed-adam", shards=2, price_step=True)
    assert MemoryModel.from_dict(priced.to_dict(), "file") == priced
    assert "step_bytes_per_param_byte" not in MemoryModel().to_dict()  # files without it as before
    with pytest.raises(ArgumentError, match="file: step_bytes_per_param_byte must be a non-negative"):
        MemoryModel.from_dict({**priced.to_dict(), "step_bytes_per_param_byte": -1}, "file")
    with pytest.raises(ArgumentError, match="price_step must be True or False"):
        MemoryModel.for_optimizer("adamw", price_step="yes")

    costs = heavy_weights()  # 8 layers of 2 GiB of bf16 weights: 2 layers a device on 4 devices
    one = ClusterSpec.preset("h100x16", num_devices=4)
    plan = octopipe.schedules.baselines(costs, one, 8)["1f1b/balanced"]
    free = simulate(plan, costs, one)
    paid = simulate(plan, costs, one, memory=MemoryModel.for_optimizer("mixed-adam", price_step=True))
    step_ms = 4 * GiB * 14.0 / one.memory_bandwidth * 1e3  # 28 bytes a weight, 2 Gi weights a device
    ends = [max(free.op_end[op] for op in ops) for ops in plan.device_ops]
    for device in range(4):
        (step,) = [r for r in paid.reductions if r.devices == (device,)]
        assert step.name == "optimizer step" and step.start_ms == pytest.approx(ends[device])
        assert step.end_ms - step.start_ms == pytest.approx(step_ms)
    assert paid.iteration_ms == pytest.approx(max(ends) + step_ms) and not free.reductions
    # the step is the device's work, not a bubble: every device as idle as without it
    assert paid.device_busy_ms == pytest.approx([busy + step_ms for busy in free.device_busy_ms])
    assert paid.device_idle_ms == pytest.approx(free.device_idle_ms)
    assert paid.optimizer_step_ms == pytest.approx([step_ms] * 4) and free.optimizer_step_ms == (0.0,) * 4
    assert [sum(split) for split in paid.bubbles] == pytest.approx(list(free.device_idle_ms))
    assert "optimizer step: device 3" in str(paid)
    # with replicas: after the device's last reduce-scatter, before its share's broadcast; a
    # sharded step moves half the bytes over 2 replicas
    two = ClusterSpec.preset("h100x16", num_devices=8).replica(2)
    for shards in (1, 2):
        sim = simulate(plan, costs, two, memory=MemoryModel.for_optimizer("mixed-adam", shards, price_step=True))
        mine = [r for r in sim.reductions if r.devices == (3,)]
        names = [r.name for r in mine]
        assert names == ["data-parallel stage 3", "optimizer step"] + (["data-parallel shard broadcast"] if shards > 1
                                                                        else [])
        assert mine[1].start_ms == pytest.approx(mine[0].end_ms)
        assert mine[1].end_ms - mine[1].start_ms == pytest.approx(step_ms / shards)
        if shards > 1:
            assert mine[2].start_ms == pytest.approx(mine[1].end_ms)
    # choosing the replica count: the table shows each count's longest step (1 layer a device
    # unsharded on 8 devices, 2 a device halved by sharding over 2 replicas: the same)
    chosen = octopipe.plan_data_parallel(costs, ClusterSpec.preset("h100x8"), 16, quiet=True, effort=0.02,
                                         counts=(1, 2), memory=lambda d: MemoryModel.for_optimizer(
                                             "mixed-adam", d, price_step=True))
    table = str(chosen).split("\n\n")[0]
    assert table.splitlines()[0].endswith("optimizer step ms")
    assert [float(line.split()[-1]) for line in table.splitlines()[2:]] == pytest.approx([step_ms / 2] * 2, abs=0.01)
    # the CLI: plan --price-optimizer-step saves the priced model and the report says so
    table, out = tmp_path / "costs.json", tmp_path / "plan.json"
    costs.save(table)
    assert main(["plan", "--costs", str(table), "--cluster", "h100x4", "--microbatches", "8", "--quiet",
                 "--no-solver", "--effort", "0.05", "--price-optimizer-step", "-o", str(out)]) == EXIT_OK
    assert load_saved_plan(out).memory == MemoryModel.for_optimizer("mixed-adam", price_step=True)
    assert "optimizer step priced" in capsys.readouterr().out
    # a table without parameter bytes (as the published profiles) has nothing to price: it says so
    bare = CostTable([replace(layer, param_bytes=0) for layer in costs])
    result = octopipe.plan(bare, "h100x4", 8, quiet=True, effort=0.05, solver=False,
                           memory=MemoryModel.for_optimizer("mixed-adam", price_step=True))
    assert "asked to price it, but the cost table has no param_bytes" in str(result.report)
