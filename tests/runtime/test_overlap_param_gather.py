"""compile(..., shard_optimizer=True, overlap_param_gather=True): the shares' broadcast after the
optimizer step is left running and each stage's first forward of the next step waits for its own
(Megatron's --overlap-param-gather). Two replicas of a 2-rank V pipeline (4 gloo processes; the
tied embedding and head share rank 0): the run is the one without the overlap bit for bit, the
broadcasts are still running after the step, and each lands just before its stage's first
forward; the simulation prices it there."""

import dataclasses

import pytest
import torch
from pipeline_helpers import replica_token_batches

import octopipe
from octopipe import models
from octopipe.errors import ArgumentError
from octopipe.ir.plan import OpKind
from octopipe.ir.program import InstrKind
from octopipe.runtime import launch
from octopipe.simulator import PARAM_GATHER, SHARD_BROADCAST

pytestmark = pytest.mark.usefixtures("one_thread")
REPLICAS = 2
STEPS = 3


def _model():
    torch.manual_seed(0)
    return models.build("gemma", "tiny")


def _batches():
    return replica_token_batches(REPLICAS, 7)


def _pipe(overlap, cluster="cpu"):
    tokens, target = _batches()
    return octopipe.compile(_model(), octopipe.ClusterSpec.preset(cluster, num_devices=4), example_inputs=(tokens[0],),
                            example_target=target[0], loss_fn=models.lm_loss, num_microbatches=2, schedule="zb-v",
                            data_parallel=REPLICAS, shard_optimizer=True, overlap_param_gather=overlap, quiet=True)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _worker(rank, world_size, folder):
    tokens, target = _batches()
    mine = ((tokens[rank % REPLICAS],), target[rank % REPLICAS])
    runs = {}
    for overlap in (False, True):
        engine = _pipe(overlap).engine(rank, timeout_s=60, optimizer=_adamw)
        waits = []  # (stage, program position) of each wait for a stage's shares
        finish = engine.finish_param_sync

        def recorded(stage=None, finish=finish, engine=engine, waits=waits):
            if stage is not None and stage in engine._gathering:
                waits.append((stage, engine._position, engine._evaluating))
            finish(stage)

        engine.finish_param_sync = recorded
        losses, pending, stale = [], [], []
        for _ in range(STEPS):
            losses.append(engine.step(*mine))
            engine.clip_grad_norm_(0.5)
            before = {n: p.detach().clone() for n, p in engine.named_parameters()}
            engine.optimizer.step()
            engine.zero_grad()
            pending.append(sorted(engine._gathering))
            # another replica's share: still its value before the step while its broadcast runs
            theirs = {n: [(a, b) for r, a, b in pieces if r != engine.replicas.replica]
                      for n, pieces in engine.shard_rows.items()}
            stale.append(sorted(n for n, p in engine.named_parameters() if theirs[n] and all(
                torch.equal(p[a:b], before[n][a:b]) for a, b in theirs[n])))
        evaluated = engine.evaluate(*mine)  # waits for the last step's shares first
        engine.optimizer.step()  # (no new gradients: AdamW's decay still moves every weight)
        engine.save_checkpoint(f"{folder}/{'overlap' if overlap else 'plain'}.pt")  # waits too
        runs[overlap] = dict(losses=losses, evaluated=evaluated, pending=pending, stale=stale, waits=waits,
                             params={n: p.detach().clone() for n, p in engine.named_parameters()},
                             first_forward={(i.stage, evaluating): position for evaluating, program in (
                                 (False, engine.program.instructions), (True, engine._eval_program))
                                 for position, i in reversed(list(enumerate(program))) if i.kind is InstrKind.FORWARD},
                             gather_stage=dict(engine._gather_stage), stages=sorted(engine.stages),
                             others=sorted(n for n, pieces in engine.shard_rows.items()
                                           if any(r != engine.replicas.replica for r, _, _ in pieces)))
    return runs


@pytest.mark.timeout(300)
def test_an_overlapped_parameter_gather_trains_as_the_sharded_step_bit_for_bit(tmp_path):
    per_rank = launch(_worker, 4, args=(str(tmp_path),), timeout_s=240)
    for rank, runs in enumerate(per_rank):
        plain, overlap = runs[False], runs[True]
        assert overlap["losses"] == plain["losses"], rank
        assert overlap["evaluated"] == plain["evaluated"], rank
        for name, value in plain["params"].items():
            assert torch.equal(overlap["params"][name], value), (rank, name)
        # without the overlap the step waited for every share; with it each of this rank's stages
        # still had its broadcast running, and the other replica's share was still stale
        assert plain["pending"] == [[]] * STEPS and plain["waits"] == [], rank
        gathered = sorted(set(overlap["gather_stage"].values()))
        assert overlap["pending"] == [gathered] * STEPS, rank
        assert overlap["stale"] == [overlap["others"]] * STEPS, rank  # every one of them
        # each stage's shares were waited for at its first forward, in the program's order: in the
        # steps after the first, then in the evaluation
        first = overlap["first_forward"]
        expected = [sorted(((s, first[s, evaluating], evaluating) for s in gathered), key=lambda w: w[1])
                    for evaluating in (False, True)]
        assert overlap["waits"] == expected[0] * (STEPS - 1) + expected[1], rank
    # the V: rank 0 holds the first stage (the embedding) and the last (the head tied to it),
    # gathered once, with the stage whose forward runs first; rank 1 two stages of blocks
    assert per_rank[0][True]["stages"] == [0, 3]
    assert per_rank[0][True]["gather_stage"] == {"embed.weight": 0}
    assert per_rank[0][True]["pending"][0] == [0]
    assert per_rank[2][True]["pending"][0] == [1, 2]
    assert per_rank[1][True]["others"] == ["embed.weight"]  # replica 1 of rank 0: stale until the forward
    assert per_rank[2][True]["others"] and per_rank[3][True]["others"]
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)
    overlap = torch.load(tmp_path / "overlap.pt", weights_only=True)
    for name, value in plain["model"].items():
        assert torch.equal(overlap["model"][name], value), name


def test_overlap_param_gather_arguments_and_pricing():
    pipe = _pipe(True, cluster="cpux4")
    whole = _pipe(False, cluster="cpux4")
    assert pipe.overlap_param_gather and pipe.simulation.memory.overlap_param_gather
    assert not whole.simulation.memory.overlap_param_gather
    plan, sim, costs = pipe.plan, pipe.simulation, pipe.costs
    cluster = sim.cluster
    # no broadcast at the end: per device one gather per stage from the step's start, in the
    # order of the device's first forwards, each the stage's parameters (the tied one once)
    assert not any(r.name == SHARD_BROADCAST for r in sim.reductions)
    assert any(r.name == SHARD_BROADCAST for r in whole.simulation.reductions)
    for device, ops in enumerate(plan.device_ops):
        expected, sent = [], set()
        for index in dict.fromkeys(op.stage for op in ops if op.kind is OpKind.F):
            layers = range(plan.stages[index].layer_start, plan.stages[index].layer_end)
            size = sum(costs.layers[layer].param_bytes for layer in layers)
            for tied in costs.tied:
                inside = sum(layer in layers for layer in tied.layers)
                size -= tied.bytes * inside
                if inside and tied.name not in sent:
                    sent.add(tied.name)
                    size += tied.bytes
            if size > 0:
                expected.append((index, size))
        gathers = [r for r in sim.reductions if r.devices == (device,) and r.name.startswith(PARAM_GATHER)]
        assert [int(r.name.split()[-1]) for r in gathers] == [index for index, _ in expected]
        assert gathers[0].start_ms == 0
        for earlier, later in zip(gathers, gathers[1:]):
            assert later.start_ms == earlier.end_ms
        for gather, (index, size) in zip(gathers, expected):
            assert gather.end_ms - gather.start_ms == pytest.approx(cluster.all_gather_ms(size)
                                                                    + cluster.message_overhead_ms)
            first_forward = min(sim.op_start[op] for op in ops if op.kind is OpKind.F and op.stage == index)
            assert first_forward >= gather.end_ms - 1e-9
    # device 0 holds the embedding's stage and the head's, tied to it: one gather, the first stage's
    assert [r.name for r in sim.reductions if r.devices == (0,) and r.name.startswith(PARAM_GATHER)] == [
        f"{PARAM_GATHER} stage 0"]
    assert "before its first forward (overlapped with the step)" in str(sim)
    # the memory model: refused without a sharded state; saved with a plan
    memory = sim.memory
    assert octopipe.MemoryModel.from_dict(memory.to_dict(), "test") == memory
    assert "overlap_param_gather" not in whole.simulation.memory.to_dict()
    with pytest.raises(ArgumentError, match="overlap_param_gather .* shards is 1"):
        octopipe.MemoryModel.for_optimizer("adamw", overlap_param_gather=True)
    with pytest.raises(ArgumentError, match="overlap_param_gather must be True or False"):
        octopipe.MemoryModel.for_optimizer("adamw", 2, overlap_param_gather="yes")
    with pytest.raises(ArgumentError, match="shard_optimizer is False"):
        octopipe.compile(_model(), "cpux4", example_inputs=(_batches()[0][0],), loss_fn=models.lm_loss,
                         num_microbatches=2, schedule="1f1b", data_parallel=2, overlap_param_gather=True)
    with pytest.raises(ArgumentError, match="compile's overlap_param_gather is False"):
        octopipe.compile(_model(), "cpux4", example_inputs=(_batches()[0][0],), loss_fn=models.lm_loss,
                         num_microbatches=2, schedule="1f1b", data_parallel=2, shard_optimizer=True, memory=memory)
    with pytest.raises(ArgumentError, match="shard_optimizer is False"):
        whole.engine(0, shard_optimizer=False, overlap_param_gather=True)
    with pytest.raises(ArgumentError, match="overlap_param_gather=1"):
        whole.engine(0, overlap_param_gather=1)
    # as a plan file's memory model: simulated again to the same time
    again = octopipe.simulate(plan, costs, cluster, memory=dataclasses.replace(memory))
    assert again.iteration_ms == sim.iteration_ms
