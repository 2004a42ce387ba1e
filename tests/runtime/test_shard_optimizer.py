"""compile(..., data_parallel=2, shard_optimizer=True): ZeRO-1 over two replicas of a 2-rank
pipeline (4 gloo processes). Each copy of a pipeline rank gets the summed gradients of its share
of the parameters only (reduced onto it), steps AdamW over that share and broadcasts it after: the
run is the unsharded one bit for bit (and plain AdamW on both batches together to float
rounding), each copy holds about half the optimizer's state, and checkpoints move between sharded
and unsharded runs."""

import dataclasses

import pytest
import torch
from pipeline_helpers import replica_token_batches

import octopipe
from octopipe import models
from octopipe.errors import ArgumentError, ExecutionError
from octopipe.runtime import launch
from octopipe.runtime.engine import ROWS_KEY, merge_state_dicts, saved_rows, shard_rows

pytestmark = pytest.mark.usefixtures("one_thread")
REPLICAS = 2
STEPS = 3
LR = 1e-2


def _model():
    torch.manual_seed(0)
    return models.build("gemma", "tiny")  # its head is tied to the embedding (on both pipeline ranks)


def _batches():
    return replica_token_batches(REPLICAS, 5)


def _pipe(shard):
    tokens, target = _batches()
    return octopipe.compile(_model(), octopipe.ClusterSpec.preset("cpu", num_devices=4), example_inputs=(tokens[0],),
                            example_target=target[0], loss_fn=models.lm_loss, num_microbatches=2, schedule="zb-h1",
                            data_parallel=REPLICAS, shard_optimizer=shard, quiet=True)


def _adamw(params):
    """Two param groups (decay on matrices only), as training scripts build them; a replica's
    share may leave one of them empty."""
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.ndim > 1]},
                              {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}], lr=LR)


def _state_numel(optimizer):
    return sum(value.numel() for state in optimizer.state.values() for value in state.values()
               if isinstance(value, torch.Tensor) and value.ndim > 0)


def _worker(rank, world_size, folder):
    tokens, target = _batches()
    mine = ((tokens[rank % REPLICAS],), target[rank % REPLICAS])
    runs = {}
    for shard in (False, True):
        engine = _pipe(shard).engine(rank, timeout_s=60, optimizer=_adamw)
        losses = []
        for step in range(STEPS):
            losses.append(engine.step(*mine))
            if step == 0:
                grads = {n: None if p.grad is None else p.grad.clone() for n, p in engine.named_parameters()}
            engine.clip_grad_norm_(0.5)
            engine.optimizer_step()
            if step == STEPS - 2:
                engine.save_checkpoint(f"{folder}/{'sharded' if shard else 'whole'}.pt")
        runs[shard] = dict(losses=losses, grads=grads, params={n: p.detach().clone() for n, p in engine.named_parameters()},
                           state_numel=_state_numel(engine.optimizer),
                           state_names=sorted(engine.state_dict()["optimizer"]["state"]),
                           rows=dict(engine.shard_rows))
    # resume each checkpoint in the other kind of run: the last step as the uninterrupted runs took it
    resumed = {}
    for shard in (False, True):
        engine = _pipe(shard).engine(rank, timeout_s=60, optimizer=_adamw)
        engine.load_checkpoint(f"{folder}/{'whole' if shard else 'sharded'}.pt")
        engine.step(*mine)
        engine.clip_grad_norm_(0.5)
        engine.optimizer.step()  # stepped directly, not through optimizer_step: the broadcast is the optimizer's
        resumed[shard] = {n: p.detach().clone() for n, p in engine.named_parameters()}
    # two steps accumulated before the update: the owner's sums are the unsharded engine's
    accumulated = {}
    for shard in (False, True):
        engine = _pipe(shard).engine(rank, timeout_s=60, optimizer=_adamw)
        engine.step(*mine)
        engine.step(*mine)
        accumulated[shard] = {n: None if p.grad is None else p.grad.clone() for n, p in engine.named_parameters()}
    # an optimizer built over every parameter of a sharded engine is refused
    engine = _pipe(True).engine(rank, timeout_s=60)
    try:
        engine.attach_optimizer(torch.optim.SGD(engine.parameters(), lr=LR))
        refused = None
    except ExecutionError as exc:
        refused = str(exc)
    # and one whose update reads whole parameters (Adafactor's factored moments), as they are cut
    try:
        engine.attach_optimizer(lambda params: torch.optim.Adafactor(params, lr=LR))
        refused_whole = None
    except ArgumentError as exc:
        refused_whole = str(exc)
    return runs, resumed, (refused, refused_whole), accumulated


def _plain():
    model = _model()
    optimizer = _adamw(model.parameters())
    tokens, target = _batches()
    pieces = [(x, y) for t, g in zip(tokens, target) for x, y in zip(t.chunk(2), g.chunk(2))]
    losses = []
    for _ in range(STEPS):
        loss = sum(models.lm_loss(model(x), y) for x, y in pieces) / len(pieces)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.timeout(300)
def test_sharded_optimizer_state_trains_as_the_whole_one_with_half_the_state(tmp_path):
    per_rank = launch(_worker, 4, args=(str(tmp_path),), timeout_s=240)
    plain_losses, plain_params = _plain()
    for rank, (runs, resumed, (refused, refused_whole), accumulated) in enumerate(per_rank):
        whole, sharded = runs[False], runs[True]
        assert sharded["losses"] == whole["losses"], rank  # bit for bit
        assert sharded["losses"] == pytest.approx(plain_losses, rel=1e-5)
        assert set(sharded["params"]) == set(whole["params"])
        for name, value in whole["params"].items():
            assert torch.equal(sharded["params"][name], value), (rank, name)
            assert torch.allclose(value, plain_params[name], rtol=1e-4, atol=1e-6), (rank, name)
            # the resumed runs took the last step as the uninterrupted ones did
            assert torch.equal(resumed[False][name], value), (rank, name, "sharded checkpoint, whole optimizer")
            assert torch.equal(resumed[True][name], value), (rank, name, "whole checkpoint, sharded optimizer")
        replica = rank % REPLICAS
        mine = {name: (first, end) for name, pieces in sharded["rows"].items() for r, first, end in pieces
                if r == replica}
        owned = sorted(mine)
        # after the step: the summed gradients of this copy's rows, the unsharded ones bit for
        # bit, and none of a parameter whose rows are all the other copy's (reduced onto it)
        assert sorted(name for name, grad in sharded["grads"].items() if grad is not None) == owned, rank
        for name, (first, end) in mine.items():
            assert torch.equal(sharded["grads"][name][first:end], whole["grads"][name][first:end]), (rank, name)
            assert torch.equal(accumulated[True][name][first:end], accumulated[False][name][first:end]), (rank, name)
        assert all(accumulated[True][name] is None for name in accumulated[True] if name not in owned), rank
        assert sharded["state_names"] == owned  # this copy holds its rows' state only
        assert whole["state_names"] == sorted(whole["params"])
        assert refused is not None and "another replica's optimizer" in refused, rank
        assert refused_whole is not None and "Adafactor's update reads a whole parameter" in refused_whole, rank
    for stage in range(2):  # the two copies of a pipeline rank split its state between them
        first, second = (per_rank[stage * REPLICAS + replica][0] for replica in range(REPLICAS))
        rows = first[True]["rows"]
        assert rows == second[True]["rows"]  # (both copies cut alike)
        for name, pieces in rows.items():  # every parameter's rows, each stepped by one copy
            spans = [(start, end) for _, start, end in pieces]
            assert spans[0][0] == 0 and spans[-1][1] == first[False]["params"][name].shape[0], name
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), name
        assert any(len(pieces) == 2 for pieces in rows.values())  # (some parameters are cut)
        total = first[False]["state_numel"]
        assert first[True]["state_numel"] + second[True]["state_numel"] == total
        # rows cut evenly: the shares differ by at most a row at each bucket's cut (2 moments)
        widest = max(value[0].numel() for value in first[False]["params"].values())
        assert abs(first[True]["state_numel"] - second[True]["state_numel"]) <= 2 * 2 * widest * len(rows), stage
        assert abs(first[True]["state_numel"] / total - 0.5) < 0.01, (stage, first[True]["state_numel"] / total)
    sharded = torch.load(tmp_path / "sharded.pt", weights_only=True)["optimizer"]
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)["optimizer"]
    assert set(sharded["state"]) == set(whole["state"])  # every replica's share gathered into the file
    for name, state in whole["state"].items():
        for key, value in state.items():
            assert torch.equal(sharded["state"][name][key], value), (name, key)


def test_shard_optimizer_arguments_and_memory():
    tokens, target = _batches()
    options = dict(example_inputs=(tokens[0],), example_target=target[0], loss_fn=models.lm_loss, num_microbatches=2,
                   schedule="1f1b", quiet=True, optimizer="adamw", data_parallel=2)
    whole = octopipe.compile(_model(), "cpux4", **options)
    sharded = octopipe.compile(_model(), "cpux4", shard_optimizer=True, **options)
    # fp32 AdamW on analytic costs (which count the model's fp32, 4 bytes a weight): weights and
    # gradients 8 bytes a weight, moments 8, over 2 replicas 4
    assert whole.simulation.memory.state_bytes_per_param_byte == pytest.approx(4.0)
    assert sharded.simulation.memory.state_bytes_per_param_byte == pytest.approx(3.0)
    assert max(sharded.simulation.peak_memory_bytes) < max(whole.simulation.peak_memory_bytes)
    assert sharded.shard_optimizer and not whole.shard_optimizer
    # the sharded step's gradients are reduce-scattered (half the all-reduce of the same plan
    # unsharded, over 2 copies) and its broadcast is priced: after each device's last
    # reduction, an all-gather of its parameters over the copies
    cluster = sharded.simulation.cluster
    overhead = cluster.message_overhead_ms
    unsharded = octopipe.simulate(sharded.plan, sharded.costs, cluster,
                                  memory=dataclasses.replace(sharded.simulation.memory, shards=1))
    reduced = {(r.name, r.devices): r.end_ms - r.start_ms for r in unsharded.reductions
               if r.name.startswith("data-parallel")}
    buckets = [r for r in sharded.simulation.reductions
               if r.name.startswith("data-parallel") and r.name != "data-parallel shard broadcast"]
    assert len(buckets) == len(reduced) > 0
    for bucket in buckets:
        assert bucket.end_ms - bucket.start_ms - overhead == pytest.approx((reduced[bucket.name, bucket.devices]
                                                                             - overhead) / 2)
    for device in range(sharded.plan.num_devices):
        mine = [r for r in sharded.simulation.reductions if r.devices == (device,)]
        broadcast = mine[-1]
        assert broadcast.name == "data-parallel shard broadcast"
        assert broadcast.start_ms >= max(r.end_ms for r in mine[:-1]) - 1e-9
        layers = [layer for stage in sharded.plan.stages if sharded.plan.placement[stage.index] == device
                  for layer in range(stage.layer_start, stage.layer_end)]
        # (the tied embedding and head sit on different devices: each holds it once)
        assert all(sum(layer in layers for layer in tied.layers) <= 1 for tied in sharded.costs.tied)
        held = sum(sharded.costs.layers[layer].param_bytes for layer in layers)
        expected = cluster.all_gather_ms(held) + cluster.message_overhead_ms
        assert broadcast.end_ms - broadcast.start_ms == pytest.approx(expected)
    assert not any(r.name == "data-parallel shard broadcast" for r in whole.simulation.reductions)
    assert cluster.all_gather_ms(2**20) == pytest.approx(cluster.all_reduce_ms(2**20) / 2)  # 2 copies
    assert cluster.reduce_scatter_ms(2**20) == cluster.all_gather_ms(2**20)
    assert "reduce-scattered over its 2 copies" in str(sharded.simulation)
    # without optimizer=, the default state (mixed-precision Adam's) is the one sharded
    default = octopipe.compile(_model(), "cpux4", shard_optimizer=True,
                               **{k: v for k, v in options.items() if k != "optimizer"})
    assert default.simulation.memory == octopipe.MemoryModel.for_optimizer("mixed-adam", shards=2)
    with pytest.raises(ArgumentError, match="shard_optimizer='yes'.*True or False"):
        sharded.engine(0, shard_optimizer="yes")
    with pytest.raises(ArgumentError, match="compile: shard_optimizer must be True or False"):
        octopipe.compile(_model(), "cpux4", shard_optimizer=1, **options)


def test_shard_rows_cut_each_bucket_evenly_at_row_boundaries():
    units = [[("a", (10, 4)), ("b", (3,)), ("c", (7, 2, 3))], [("d", (5, 5))], [("e", ()), ("f", (1, 9))], [("g", (0, 4))]]
    for replicas in (1, 2, 3, 4):
        pieces = shard_rows(units, replicas)
        assert set(pieces) == set("abcdefg")
        for unit in units:
            held = [0] * replicas
            for name, shape in unit:
                rows = shape[0] if shape else 1
                spans = pieces[name]
                # the rows of each parameter, in order, each stepped by one replica (replicas ascending)
                assert spans[0][1] == 0 and spans[-1][2] == rows, (name, spans)
                assert all(a[2] == b[1] and a[0] < b[0] for a, b in zip(spans, spans[1:])), (name, spans)
                for replica, first, end in spans:
                    held[replica] += (end - first) * (torch.Size(shape[1:]).numel() if shape else 1)
            total = sum(held)
            widest = max((torch.Size(shape[1:]).numel() if shape else 1) for _, shape in unit)
            # within a row of the even share (a row goes where its middle element falls)
            assert all(abs(h - total / replicas) <= widest for h in held), (replicas, unit, held)
    assert shard_rows(units, 1)["a"] == ((0, 0, 10),)
    two = shard_rows(units, 2)
    # 40 + 3 + 42 elements: b's third row's middle falls on the half, 42.5, and goes to replica 1
    assert two["a"] == ((0, 0, 10),) and two["b"] == ((0, 0, 2), (1, 2, 3)) and two["c"] == ((1, 0, 7),)
    assert two["d"] == ((0, 0, 2), (1, 2, 5))
    assert two["e"] == ((0, 0, 1),) and two["f"] == ((1, 0, 1),)  # (a 0-d parameter is one row)
    assert two["g"] == ((0, 0, 0),)  # (no elements: nothing to cut)


def test_a_sharded_optimizer_state_joins_by_rows_and_loads_cut():
    whole = {"step": torch.tensor(3.0), "exp_avg": torch.arange(12.0).reshape(6, 2), "lr_scale": torch.ones(2)}
    first = {"step": torch.tensor(3.0), "exp_avg": whole["exp_avg"][:4], "lr_scale": torch.ones(2), ROWS_KEY: (0, 4, 6)}
    second = {"step": torch.tensor(3.0), "exp_avg": whole["exp_avg"][4:], "lr_scale": torch.ones(2), ROWS_KEY: (4, 6, 6)}
    shard = {"model": {}, "optimizer": {"state": {"w": second}, "param_groups": [{"lr": 1.0, "params": ["w"]}]}}
    merged = merge_state_dicts([{**shard, "optimizer": {**shard["optimizer"], "state": {"w": first}}}, shard, shard])
    joined = merged["optimizer"]["state"]["w"]
    assert set(joined) == {"step", "exp_avg", "lr_scale"}  # (the rows' marker dropped)
    assert torch.equal(joined["exp_avg"], whole["exp_avg"]) and torch.equal(joined["lr_scale"], whole["lr_scale"])
    # a whole state cut to an optimizer's rows: per-row tensors only
    assert torch.equal(saved_rows(whole["exp_avg"], whole, (4, 6, 6), "t"), whole["exp_avg"][4:])
    assert saved_rows(whole["lr_scale"], whole, (4, 6, 6), "t") is whole["lr_scale"]
    assert saved_rows(whole["step"], whole, (4, 6, 6), "t") is whole["step"]
    assert saved_rows(second["exp_avg"], second, (4, 6, 6), "t") is second["exp_avg"]  # its own shard
    with pytest.raises(ExecutionError, match="holds rows 4-6 of 6 only.*this optimizer steps rows 0-3; load the "
                                             "merged state"):
        saved_rows(second["exp_avg"], second, (0, 3, 6), "t")
    with pytest.raises(ExecutionError, match="steps all of them"):
        saved_rows(second["exp_avg"], second, None, "t")
    with pytest.raises(ExecutionError, match=r"'w' comes in pieces .* cover rows \[\(4, 6\)\] of its 6"):
        merge_state_dicts([shard])
