"""compile(model.bfloat16(), ..., master_weights=True, fp32_grads=True): Megatron's bf16 training
with its default `--accumulate-allreduce-grads-in-fp32`. Each backward's bf16 gradients are added
into an fp32 gradient (`Engine.main_grads()`), which the tied and data-parallel reductions sum
and clipping scales in fp32 and the fp32 master copies step as it is. A 2-rank pipeline, with
and without split backwards, equals that scheme on one device bit for bit (and differs from
accumulating in bf16); two replicas of a tied model with the state sharded and the gather
overlapped equal the unsharded run; the memory model and the simulation count fp32 gradients.
fp16 weights (Megatron's `--fp16`) add dynamic loss scaling: equal to that scheme on one device,
a step that overflows skipped on every rank."""

import pytest
import torch

import octopipe
from octopipe import MemoryModel, models
from octopipe.errors import ArgumentError, ExecutionError
from octopipe.runtime import launch
from octopipe.runtime.amp import LossScaler

pytestmark = pytest.mark.usefixtures("one_thread")
MICROBATCHES = 4
STEPS = 3
LR = 1e-2


def _model(name="llama"):
    torch.manual_seed(0)
    return models.build(name, "tiny").bfloat16()


def _batch(name="llama", seed=3):
    torch.manual_seed(seed)
    return models.example_inputs(name, "tiny", batch_size=8), models.example_target(name, "tiny", batch_size=8)


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR)


def _pipe(name="llama", cluster="cpux2", schedule="1f1b", fp32_grads=True, **options):
    inputs, target = _batch(name)
    return octopipe.compile(_model(name), cluster, example_inputs=inputs, example_target=target, loss_fn=models.lm_loss,
                            num_microbatches=MICROBATCHES, schedule=schedule, master_weights=True,
                            fp32_grads=fp32_grads, quiet=True, **options)


def _train(rank, world_size, schedule):
    inputs, target = _batch()
    runs = {}
    for fp32 in (True, False):
        engine = _pipe(schedule=schedule, fp32_grads=fp32).engine(rank, timeout_s=60, optimizer=_adamw)
        losses, first_grads = [], {}
        for step in range(STEPS):
            losses.append(engine.step(inputs, target))
            if step == 0:
                first_grads = {n: (g.clone() if fp32 else g.float()) for n, g in
                               (engine.main_grads() if fp32 else
                                {n: p.grad for n, p in engine.named_parameters()}).items()}
                bf16_grads = [n for n, p in engine.named_parameters() if p.grad is not None]
            engine.optimizer_step()
        runs[fp32] = dict(losses=losses, grads=first_grads, bf16_grads=bf16_grads,
                          params={n: p.detach().clone() for n, p in engine.named_parameters()},
                          masters={n: p.detach().clone() for n, p in engine.master_parameters().items()},
                          kinds=sorted({i.kind.name for i in engine.program.instructions}))
    return runs


def _reference():
    """The scheme on one device: bf16 forwards and backwards, each microbatch's loss weighed 1/M;
    its bf16 gradients added into fp32 ones; AdamW over fp32 copies stepping those."""
    model = _model()
    inputs, target = _batch()
    masters = {n: torch.nn.Parameter(p.detach().float().clone()) for n, p in model.named_parameters()}
    optimizer = _adamw(list(masters.values()))
    losses, first = [], {}
    for step in range(STEPS):
        total = 0.0
        main = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in model.named_parameters()}
        for x, y in zip(inputs[0].chunk(MICROBATCHES), target.chunk(MICROBATCHES)):
            loss = models.lm_loss(model(x), y) * (1.0 / MICROBATCHES)
            loss.backward()
            total += loss.item()
            for name, param in model.named_parameters():
                main[name] += param.grad
                param.grad = None
        losses.append(total)
        if step == 0:
            first = {n: g.clone() for n, g in main.items()}
        _step_copies(model, masters, optimizer, main)
    return losses, first, dict(model.named_parameters()), masters


def _step_copies(model, masters, optimizer, main):
    """The optimizer steps the fp32 copies on the fp32 gradients `main`; the weights are rounded
    from them."""
    for name in masters:
        masters[name].grad = main[name]
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(masters[name])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_fp32_grads_equal_fp32_accumulation_on_one_device(schedule):
    per_rank = launch(_train, 2, args=(schedule,), timeout_s=240)
    losses, grads, params, masters = _reference()
    split = schedule == "zb-h1"
    assert ("BACKWARD_WEIGHT" in per_rank[0][True]["kinds"]) is split  # the W path is exercised where split
    got = {n: v for rank in per_rank for n, v in rank[True]["grads"].items()}
    got_params = {n: v for rank in per_rank for n, v in rank[True]["params"].items()}
    got_masters = {n: v for rank in per_rank for n, v in rank[True]["masters"].items()}
    in_bf16 = {n: v for rank in per_rank for n, v in rank[False]["grads"].items()}
    assert set(got) == set(grads) == set(got_params) == set(in_bf16)
    for rank in per_rank:
        assert rank[True]["losses"] == losses  # bit for bit
        assert rank[True]["bf16_grads"] == []  # the gradients are the fp32 ones only
    for name, value in grads.items():
        assert got[name].dtype is torch.float32
        assert torch.equal(got[name], value), name
        assert torch.equal(got_params[name], params[name]), name
        assert torch.equal(got_masters[name], masters[name]), name
    # accumulated in bf16 (master_weights alone) the gradients are not these
    assert sum(not torch.equal(in_bf16[name], value) for name, value in grads.items()) > len(grads) // 2


def _replicas(rank, world_size, schedule):
    inputs, target = _batch("gemma")
    runs = {}
    for shard in (False, True):
        pipe = _pipe(name="gemma", cluster="cpux4", schedule=schedule, data_parallel=2, shard_optimizer=shard,
                     overlap_param_gather=shard)
        engine = pipe.engine(rank, timeout_s=60, optimizer=_adamw)
        losses, norms = [], []
        for step in range(STEPS):
            losses.append(engine.step(inputs, target))
            if step == 0:
                grads = {n: g.clone() for n, g in engine.main_grads().items()}
            norms.append(engine.clip_grad_norm_(0.5))
            engine.optimizer_step()
        engine.finish_param_sync()
        runs[shard] = dict(losses=losses, norms=norms, grads=grads, rows=dict(engine.shard_rows),
                           params={n: p.detach().clone() for n, p in engine.named_parameters()},
                           memory=pipe.simulation.memory, tied=sorted(engine._tied_ranks))
    return runs


def _untied_reference_grads():
    """One device, gemma's head given its own copy of the embedding's weight (so each use's
    gradient is accumulated on its own, as the ranks holding them do), each microbatch weighing
    1/(2M) (one of 2 replicas): the fp32 gradients 2 replicas of the same batch sum to."""
    model = _model("gemma")
    inputs, target = _batch("gemma")
    model.head.weight = torch.nn.Parameter(model.embed.weight.detach().clone())
    main = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in model.named_parameters()}
    for x, y in zip(inputs[0].chunk(MICROBATCHES), target.chunk(MICROBATCHES)):
        (models.lm_loss(model(x), y) * (1.0 / (2 * MICROBATCHES))).backward()
        for name, param in model.named_parameters():
            main[name] += param.grad
            param.grad = None
    main["embed.weight"] += main.pop("head.weight")  # the tied all-reduce's sum (of 2: in any order)
    return {name: grad * 2 for name, grad in main.items()}  # the replicas' sum (of 2: exact)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_fp32_grads_over_sharded_replicas_with_a_tied_head_equal_the_unsharded_run(schedule):
    per_rank = launch(_replicas, 4, args=(schedule,), timeout_s=240)
    for rank, runs in enumerate(per_rank):
        whole, sharded = runs[False], runs[True]
        assert sharded["losses"] == whole["losses"] and sharded["norms"] == whole["norms"], rank
        for name, value in whole["params"].items():
            assert torch.equal(sharded["params"][name], value), (rank, name)
        # each replica keeps the fp32 sums of its own share, the unsharded run's
        mine = {n: (first, end) for n, pieces in sharded["rows"].items() for r, first, end in pieces if r == rank % 2}
        assert set(sharded["grads"]) == set(mine) & set(whole["grads"]), rank
        for name, grad in sharded["grads"].items():  # (its rows of them)
            first, end = mine[name]
            assert grad.dtype is torch.float32 and torch.equal(grad[first:end], whole["grads"][name][first:end]), \
                (rank, name)
        assert whole["memory"].grad_bytes_per_param_byte == sharded["memory"].grad_bytes_per_param_byte == 2.0
    got = {n: g for rank in per_rank for n, g in rank[False]["grads"].items()}
    if schedule == "1f1b":  # the embedding on rank 0, the head on the last: their sums all-reduced in fp32
        assert per_rank[0][False]["tied"] == ["embed.weight"]
        expected = _untied_reference_grads()
        assert set(got) == set(expected)
        for name, grad in expected.items():
            assert torch.equal(got[name], grad), name
            for rank in per_rank:  # every copy holding it the same sum
                if name in rank[False]["grads"]:
                    assert torch.equal(rank[False]["grads"][name], grad), name
    else:  # ZB-V: both on pipeline rank 0, one parameter whose fp32 sum takes both stages' backwards
        assert per_rank[0][False]["tied"] == [] and "embed.weight" in per_rank[0][False]["grads"]


def test_fp32_grads_memory_and_simulated_reductions():
    # Megatron's figures per weight: bf16 weight 2 + fp32 gradient 4 + master, moments 12 = 18
    mixed = MemoryModel.for_optimizer("mixed-adam", fp32_grads=True)
    assert mixed.state_bytes_per_param_byte * 2 == 18.0 and mixed.grad_bytes_per_param_byte == 2.0
    assert MemoryModel.for_optimizer("mixed-adam").state_bytes_per_param_byte * 2 == 16.0
    adamw = MemoryModel.for_optimizer("adamw", 2, master_weights=True, fp32_grads=True, price_step=True)
    assert adamw.state_bytes_per_param_byte * 2 == 6.0 + 12.0 / 2
    assert adamw.step_bytes_per_param_byte * 2 == (2 + 4 + 8 + 16) / 2  # grad 4 read, weight 2 written
    assert MemoryModel.for_optimizer("mixed-adam", fp32_grads=True, price_step=True).step_bytes_per_param_byte == 15.0
    assert MemoryModel.from_dict(adamw.to_dict(), "test") == adamw
    assert "grad_bytes_per_param_byte" not in MemoryModel().to_dict()
    with pytest.raises(ArgumentError, match="master_weights=True too"):
        MemoryModel.for_optimizer("adamw", fp32_grads=True)
    with pytest.raises(ArgumentError, match="grad_bytes_per_param_byte must be a positive"):
        MemoryModel(grad_bytes_per_param_byte=0.0).check("test")
    # compile's default state with fp32_grads: mixed-adam's 18 bytes, the reductions at 2x
    pipe = _pipe(cluster="cpux4", data_parallel=2)
    assert pipe.simulation.memory.state_bytes_per_param_byte == 9.0
    assert pipe.simulation.memory.grad_bytes_per_param_byte == 2.0
    sharded = _pipe(cluster="cpux4", data_parallel=2, shard_optimizer=True).simulation.memory
    assert (sharded.state_bytes_per_param_byte, sharded.shards) == ((6.0 + 12.0 / 2) / 2, 2)
    with pytest.raises(ArgumentError, match="pass master_weights=True too"):
        octopipe.compile(_model(), "cpux2", example_inputs=_batch()[0], example_target=_batch()[1],
                         loss_fn=models.lm_loss, num_microbatches=MICROBATCHES, schedule="1f1b", fp32_grads=True)
    with pytest.raises(ArgumentError, match="compile's fp32_grads is False"):
        _pipe(fp32_grads=False, memory=MemoryModel(grad_bytes_per_param_byte=2.0))
    with pytest.raises(ArgumentError, match=r"fp32_grads must be True, False or None \(default: master_weights\)"):
        _pipe(fp32_grads=1)
    # Megatron's default: fp32 gradients wherever there are master copies (False: --grad-reduce-in-bf16)
    default = _pipe(fp32_grads=None)
    assert default.fp32_grads and default.simulation.memory.grad_bytes_per_param_byte == 2.0
    assert not _pipe(fp32_grads=False).fp32_grads
    plain = octopipe.compile(_model(), "cpux2", example_inputs=_batch()[0], example_target=_batch()[1],
                             loss_fn=models.lm_loss, num_microbatches=MICROBATCHES, schedule="1f1b")
    assert not plain.master_weights and not plain.fp32_grads
    assert plain.engine(0, master_weights=True).fp32_grads  # (master weights asked for here: fp32 gradients too)
    assert not plain.engine(0, master_weights=True, fp32_grads=False).fp32_grads


def _fp16(rank, world_size, init_scale):
    inputs, target = _batch()
    pipe = octopipe.compile(_model().half(), "cpux2", example_inputs=inputs, example_target=target,
                            loss_fn=models.lm_loss, num_microbatches=MICROBATCHES, schedule="zb-h1",
                            master_weights=True, fp32_grads=True, quiet=True)
    engine = pipe.engine(rank, timeout_s=60, optimizer=_adamw, loss_scaler=LossScaler(init_scale=init_scale))
    losses, skipped, scales = [], [], []
    for _ in range(STEPS):
        losses.append(engine.step(inputs, target))
        skipped.append(engine.skipped_step)
        scales.append(engine.loss_scaler.scale)
        engine.optimizer_step()
    return dict(losses=losses, skipped=skipped, scales=scales, has_params=bool(engine.master_parameters()),
                params={n: p.detach().clone() for n, p in engine.named_parameters()},
                masters={n: p.detach().clone() for n, p in engine.master_parameters().items()})


def _fp16_reference(init_scale):
    """Megatron's --fp16 on one device: fp16 forwards and backwards from the microbatch's weight
    times the loss scale, the fp16 gradients added into fp32 ones, unscaled there, the step
    skipped (and the scale halved) on an inf or nan, else AdamW over fp32 copies."""
    model = _model().half()
    inputs, target = _batch()
    masters = {n: torch.nn.Parameter(p.detach().float().clone()) for n, p in model.named_parameters()}
    optimizer = _adamw(list(masters.values()))
    scale, losses, skipped = init_scale, [], []
    for _ in range(STEPS):
        total = torch.zeros(())
        main = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in model.named_parameters()}
        for x, y in zip(inputs[0].chunk(MICROBATCHES), target.chunk(MICROBATCHES)):
            loss = models.lm_loss(model(x), y)
            total += loss.detach().float() * (1.0 / MICROBATCHES)
            loss.backward(torch.full_like(loss, (1.0 / MICROBATCHES) * scale))
            for name, param in model.named_parameters():
                main[name] += param.grad
                param.grad = None
        losses.append(float(total))
        for grad in main.values():
            grad.mul_(1.0 / scale)
        bad = not all(torch.isfinite(grad).all() for grad in main.values())
        skipped.append(bad)
        scale = scale * 0.5 if bad else scale
        if not bad:
            _step_copies(model, masters, optimizer, main)
    return losses, skipped, dict(model.named_parameters()), masters


@pytest.mark.timeout(300)
@pytest.mark.parametrize("init_scale", [2.0**10, 2.0**18])
def test_fp16_weights_scale_the_loss_and_step_fp32_copies_as_megatron_fp16_on_one_device(init_scale):
    # 2**10: every step goes through; 2**18 overflows fp16 (max 65504) in the first step, which
    # both ranks skip (the weights and copies left as they were), then goes through at 2**17
    per_rank = launch(_fp16, 2, args=(init_scale,), timeout_s=240)
    losses, skipped, params, masters = _fp16_reference(init_scale)
    assert skipped == ([False] * STEPS if init_scale < 2**16 else [True] + [False] * (STEPS - 1))
    got = {n: v for rank in per_rank for n, v in rank["params"].items()}
    got_masters = {n: v for rank in per_rank for n, v in rank["masters"].items()}
    for rank in per_rank:
        assert rank["losses"] == losses and rank["skipped"] == skipped
        assert rank["scales"] == [init_scale * 0.5 ** sum(skipped[:k + 1]) for k in range(STEPS)]
        assert rank["has_params"]
    assert set(got) == set(params) == set(got_masters)
    for name, value in params.items():
        assert value.dtype is torch.float16 and got_masters[name].dtype is torch.float32
        assert torch.equal(got[name], value), name
        assert torch.equal(got_masters[name], masters[name]), name


def test_fp16_weights_need_fp32_grads_and_bf16_ones_no_loss_scaler():
    inputs, target = _batch()
    with pytest.raises(ArgumentError, match="needs fp32_grads=True"):
        octopipe.compile(_model().half(), "cpux2", example_inputs=inputs, example_target=target,
                         loss_fn=models.lm_loss, num_microbatches=MICROBATCHES, schedule="1f1b", master_weights=True,
                         fp32_grads=False)
    assert octopipe.compile(_model().half(), "cpux2", example_inputs=inputs, example_target=target,
                            loss_fn=models.lm_loss, num_microbatches=MICROBATCHES, schedule="1f1b",
                            master_weights=True, quiet=True).fp32_grads  # (by default)
    pipe = _pipe()  # bf16 weights: no loss scaling
    with pytest.raises(ExecutionError, match="no loss scaling needed"):
        launch(_engine_with_scaler, 2, args=(pipe,), timeout_s=120)


def _engine_with_scaler(rank, world_size, pipe):
    pipe.engine(rank, timeout_s=30, loss_scaler=LossScaler())
