"""compile(..., data_parallel=2, shard_optimizer=True): ZeRO-1 over two replicas of a 2-rank
pipeline (4 gloo processes). Each copy of a pipeline rank gets the summed gradients of its share
of the parameters only (reduced onto it), steps AdamW over that share and broadcasts it after: the
run is the unsharded one bit for bit (and plain AdamW on both batches together to float
rounding), each copy holds about half the optimizer's state, and checkpoints move between sharded
and unsharded runs."""

import dataclasses

import pytest
import torch

import octopipe
from octopipe import models
from octopipe.errors import ArgumentError, ExecutionError
from octopipe.runtime import launch

pytestmark = pytest.mark.usefixtures("one_thread")
REPLICAS = 2
STEPS = 3
LR = 1e-2


def _model():
    torch.manual_seed(0)
    return models.build("gemma", "tiny")  # its head is tied to the embedding (on both pipeline ranks)


def _batches():
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (REPLICAS * 4, 8), generator=generator)
    target = torch.randint(0, 64, (REPLICAS * 4, 8), generator=generator)
    return tokens.chunk(REPLICAS), target.chunk(REPLICAS)


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
                           state_names=sorted(octopipe.runtime.engine.named_optimizer_state(
                               engine.optimizer, dict(engine.named_parameters()))["state"]),
                           owners=dict(engine.shard_owners))
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
    return runs, resumed, refused, accumulated


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
    for rank, (runs, resumed, refused, accumulated) in enumerate(per_rank):
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
        owned = sorted(name for name, owner in sharded["owners"].items() if owner == replica)
        # after the step: the summed gradients of this copy's share, the unsharded ones bit for
        # bit, and none of the other copy's (reduced onto it)
        assert sorted(name for name, grad in sharded["grads"].items() if grad is not None) == owned, rank
        for name in owned:
            assert torch.equal(sharded["grads"][name], whole["grads"][name]), (rank, name)
            assert torch.equal(accumulated[True][name], accumulated[False][name]), (rank, name, "accumulated")
        assert all(accumulated[True][name] is None for name in accumulated[True] if name not in owned), rank
        assert sharded["state_names"] == owned  # this copy holds its share's state only
        assert whole["state_names"] == sorted(whole["params"])
        assert refused is not None and "another replica's optimizer" in refused, rank
    shares = []
    for stage in range(2):  # the two copies of a pipeline rank split its state between them
        first, second = (per_rank[stage * REPLICAS + replica][0] for replica in range(REPLICAS))
        assert set(first[True]["state_names"]).isdisjoint(second[True]["state_names"])
        assert set(first[True]["state_names"]) | set(second[True]["state_names"]) == set(first[False]["params"])
        total = first[False]["state_numel"]
        assert first[True]["state_numel"] + second[True]["state_numel"] == total
        # whole parameters: the shares differ by at most the largest one's state (2 moments)
        largest = 2 * max(value.numel() for value in first[False]["params"].values())
        assert abs(first[True]["state_numel"] - second[True]["state_numel"]) <= largest, stage
        shares.append(first[True]["state_numel"] / total)
    # rank 0's many blocks split near half; rank 1 holds the tied head (65,536 weights) and a norm
    assert 0.45 <= shares[0] <= 0.55, shares
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
    # device 1 holds the tied head, nearly all its weights: one replica steps it whole
    with pytest.warns(octopipe.OctopipeWarning, match=r"more than the 1/2 of a device's parameters that the plan's "
                      r"memory counts on device 1 \(99\.9%; 'embed\.weight' alone is 99\.9%\)"):
        sharded = octopipe.compile(_model(), "cpux4", shard_optimizer=True, **options)
    # fp32 AdamW on analytic (bf16) costs: weights and gradients 8 bytes a weight, moments 8 over 2 replicas
    assert whole.simulation.memory.state_bytes_per_param_byte == pytest.approx(8.0)
    assert sharded.simulation.memory.state_bytes_per_param_byte == pytest.approx(6.0)
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
