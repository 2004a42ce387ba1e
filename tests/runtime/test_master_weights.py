"""compile(model.bfloat16(), ..., master_weights=True, fp32_grads=False): Megatron's bf16 training
with fp32 main parameters and bf16 gradients (its --grad-reduce-in-bf16; fp32 gradients, the
default, are tests/runtime/test_fp32_grads.py's). The optimizer steps an fp32 copy of each bf16
weight, given the bf16 gradient cast up, and each weight is rounded from its copy after the step. A 2-rank pipeline equals that scheme
on one device bit for bit (and not plain bf16 training, which steps the bf16 weights); two
replicas with the state sharded (each replica holding the copies of its share only) and the
gather overlapped equal the unsharded run; checkpoints keep the fp32 copies."""

import pytest
import torch

import octopipe
from octopipe import MemoryModel, models
from octopipe.errors import ArgumentError, ExecutionError
from octopipe.runtime import launch
from octopipe.runtime.engine import MASTER_KEY, load_into_model

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


def _pipe(master_weights=True, name="llama", cluster="cpux2", **options):
    inputs, target = _batch(name)
    options.setdefault("fp32_grads", False)  # (bf16 gradients: the copies take them cast up)
    return octopipe.compile(_model(name), cluster, example_inputs=inputs, example_target=target, loss_fn=models.lm_loss,
                            num_microbatches=MICROBATCHES, schedule="1f1b", master_weights=master_weights, quiet=True,
                            **options)


def _train(rank, world_size):
    inputs, target = _batch()
    runs = {}
    for master in (True, False):
        engine = _pipe(master).engine(rank, timeout_s=60, optimizer=_adamw)
        losses = []
        for _ in range(STEPS):
            losses.append(engine.step(inputs, target))
            engine.optimizer_step()
        runs[master] = dict(losses=losses, params={n: p.detach().clone() for n, p in engine.named_parameters()},
                            masters={n: p.detach().clone() for n, p in engine.master_parameters().items()},
                            stepped={str(p.dtype) for g in engine.optimizer.param_groups for p in g["params"]})
    return runs


def _reference():
    """The scheme on one device: bf16 forwards and backwards, each microbatch's loss weighed 1/M
    and its gradients accumulated in bf16; AdamW over fp32 copies of the gradients cast up."""
    model = _model()
    inputs, target = _batch()
    masters = {n: torch.nn.Parameter(p.detach().float().clone()) for n, p in model.named_parameters()}
    optimizer = _adamw(list(masters.values()))
    losses = []
    for _ in range(STEPS):
        total = 0.0
        for x, y in zip(inputs[0].chunk(MICROBATCHES), target.chunk(MICROBATCHES)):
            loss = models.lm_loss(model(x), y) * (1.0 / MICROBATCHES)
            loss.backward()
            total += loss.item()
        losses.append(total)
        for name, param in model.named_parameters():
            masters[name].grad = param.grad.float()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(masters[name])
                param.grad = None
    return losses, dict(model.named_parameters()), masters


@pytest.mark.timeout(300)
def test_master_weights_train_as_bf16_weights_with_fp32_copies_on_one_device():
    per_rank = launch(_train, 2, timeout_s=240)
    losses, params, masters = _reference()
    with_copies = {n: v for rank in per_rank for n, v in rank[True]["params"].items()}
    copies = {n: v for rank in per_rank for n, v in rank[True]["masters"].items()}
    plain = {n: v for rank in per_rank for n, v in rank[False]["params"].items()}
    assert set(with_copies) == set(params) == set(copies)
    for rank in per_rank:
        assert rank[True]["losses"] == losses  # bit for bit
        assert rank[True]["stepped"] == {"torch.float32"} and rank[False]["stepped"] == {"torch.bfloat16"}
    for name, value in params.items():
        assert value.dtype is torch.bfloat16 and copies[name].dtype is torch.float32
        assert torch.equal(with_copies[name], value), name
        assert torch.equal(copies[name], masters[name]), name
        assert torch.equal(copies[name].bfloat16(), value), name  # each weight is its copy rounded
    # plain bf16 training (the optimizer stepping the bf16 weights) is not the same
    assert sum(not torch.equal(plain[name], value) for name, value in params.items()) > len(params) // 2


def _sharded(rank, world_size, folder):
    inputs, target = _batch("gemma")
    runs = {}
    for shard in (False, True):
        pipe = _pipe(name="gemma", cluster="cpux4", data_parallel=2, shard_optimizer=shard, overlap_param_gather=shard)
        engine = pipe.engine(rank, timeout_s=60, optimizer=_adamw)
        losses = []
        for step in range(STEPS):
            losses.append(engine.step(inputs, target))
            engine.clip_grad_norm_(1.0)
            engine.optimizer_step()
            if step == STEPS - 2:
                engine.save_checkpoint(f"{folder}/{'sharded' if shard else 'whole'}.pt")
        engine.finish_param_sync()  # (overlapped: the other replica's share lands now)
        runs[shard] = dict(losses=losses, params={n: p.detach().clone() for n, p in engine.named_parameters()},
                           masters=sorted(engine.master_parameters()), rows=dict(engine.shard_rows),
                           trains=sorted(n for n, p in engine.named_parameters() if p.requires_grad))
    # the sharded run's checkpoint resumed without sharding: the last step as the uninterrupted one
    engine = _pipe(name="gemma", cluster="cpux4", data_parallel=2).engine(rank, timeout_s=60, optimizer=_adamw)
    engine.load_checkpoint(f"{folder}/sharded.pt")
    engine.step(inputs, target)
    engine.clip_grad_norm_(1.0)
    engine.optimizer_step()
    resumed = {n: p.detach().clone() for n, p in engine.named_parameters()}
    # init=checkpoint, sharded: this replica's copies start from the file's fp32 ones, no others
    started = _pipe(name="gemma", cluster="cpux4", data_parallel=2, shard_optimizer=True).engine(
        rank, timeout_s=60, init=f"{folder}/sharded.pt", optimizer=_adamw)
    runs["init"] = {n: p.detach().clone() for n, p in started.master_parameters().items()}
    return runs, resumed


@pytest.mark.timeout(300)
def test_sharded_master_weights_hold_their_share_and_checkpoint_the_fp32_copies(tmp_path):
    per_rank = launch(_sharded, 4, args=(str(tmp_path),), timeout_s=240)
    for rank, (runs, resumed) in enumerate(per_rank):
        whole, sharded = runs[False], runs[True]
        assert sharded["losses"] == whole["losses"], rank  # 2 replicas: bit for bit
        for name, value in whole["params"].items():
            assert torch.equal(sharded["params"][name], value), (rank, name)
            assert torch.equal(resumed[name], value), (rank, name)
        assert whole["masters"] == whole["trains"]
        replica = rank % 2
        mine = {n: (first, end) for n, pieces in sharded["rows"].items() for r, first, end in pieces if r == replica}
        assert sharded["masters"] == [n for n in whole["trains"] if n in mine], rank
        assert any(mine[n] != (0, whole["params"][n].shape[0]) for n in mine), rank  # (some cut at a row)
    # the file holds every weight's fp32 copy beside its optimizer state; a plain fp32 model
    # loads the copies, a bf16 one the weights
    state = torch.load(tmp_path / "sharded.pt", weights_only=True)
    for rank, (runs, _) in enumerate(per_rank):
        assert sorted(runs["init"]) == runs[True]["masters"], rank
        for name, value in runs["init"].items():  # (this replica's rows of them)
            (first, end), = [(a, b) for r, a, b in runs[True]["rows"][name] if r == rank % 2]
            assert torch.equal(value, state["optimizer"]["state"][name][MASTER_KEY][first:end]), (rank, name)
    names = set(per_rank[0][0][False]["trains"]) | set(per_rank[2][0][False]["trains"])
    assert {n for n, entry in state["optimizer"]["state"].items() if MASTER_KEY in entry} == names
    for name in names:
        master = state["optimizer"]["state"][name][MASTER_KEY]
        assert master.dtype is torch.float32 and torch.equal(master.bfloat16(), state["model"][name])
    fp32 = models.build("gemma", "tiny")
    plain_optimizer = _adamw(fp32.parameters())
    load_into_model(fp32, state, plain_optimizer)
    named = dict(fp32.named_parameters())
    assert all(torch.equal(named[n], state["optimizer"]["state"][n][MASTER_KEY]) for n in names)
    assert all(MASTER_KEY not in entry for entry in plain_optimizer.state.values())  # not the optimizer's


def test_master_weights_arguments_and_memory():
    # the copy and the moments in fp32 beside the bf16 weight and gradient: Megatron's 16 bytes a
    # weight for Adam (mixed-adam), 12 for SGD with momentum; the step's traffic 2 x 2 + 8 + 8k
    adamw = MemoryModel.for_optimizer("adamw", master_weights=True)
    assert adamw.state_bytes_per_param_byte == MemoryModel.for_optimizer("mixed-adam").state_bytes_per_param_byte == 8.0
    assert MemoryModel.for_optimizer("sgd-momentum", master_weights=True).state_bytes_per_param_byte == 6.0
    assert MemoryModel.for_optimizer("adamw", 2, master_weights=True).state_bytes_per_param_byte == 5.0
    assert MemoryModel.for_optimizer("adamw", master_weights=True, price_step=True).step_bytes_per_param_byte == 14.0
    with pytest.raises(ArgumentError, match="master_weights must be True or False"):
        MemoryModel.for_optimizer("adamw", master_weights=1)
    pipe = _pipe(optimizer="adamw")  # sized from the model's bf16 weights: 2 bytes each, as the costs count
    assert pipe.master_weights and pipe.simulation.memory.state_bytes_per_param_byte == pytest.approx(8.0)
    assert _pipe(False, optimizer="adamw").simulation.memory.state_bytes_per_param_byte == pytest.approx(4.0)
    inputs, target = _batch()
    with pytest.raises(ArgumentError, match=r"none of its weights that train is bf16 or fp16 \(float32\).*model.bfloat16\(\)"):
        octopipe.compile(models.build("llama", "tiny"), "cpux2", example_inputs=inputs, example_target=target,
                         loss_fn=models.lm_loss, num_microbatches=2, schedule="1f1b", master_weights=True)
    with pytest.raises(ArgumentError, match="master_weights must be True or False"):
        _pipe(master_weights="yes")
    half = octopipe.compile(models.build("llama", "tiny").half(), "cpux2", example_inputs=inputs,
                            example_target=target, loss_fn=models.lm_loss, num_microbatches=2, schedule="1f1b")
    with pytest.raises(ArgumentError, match="with fp16 weights .* needs fp32_grads=True"):
        half.engine(0, master_weights=True, fp32_grads=False)


def _refused(rank, world_size):
    engine = _pipe().engine(rank, timeout_s=60)
    try:
        engine.attach_optimizer(torch.optim.SGD(engine.parameters(), lr=LR))
    except ExecutionError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(120)
def test_an_optimizer_over_the_bf16_weights_themselves_is_refused():
    for message in launch(_refused, 2, timeout_s=60):
        assert message is not None and "master_weights keeps an fp32 copy" in message


def _from_init(rank, world_size, path):
    inputs, target = _batch()
    engine = _pipe().engine(rank, timeout_s=60, optimizer=_adamw)
    engine.step(inputs, target)
    engine.optimizer_step()  # the copies now hold more than their weights' bf16 rounding
    engine.save_checkpoint(path)
    saved = {n: p.detach().clone() for n, p in engine.master_parameters().items()}
    started = _pipe().engine(rank, timeout_s=60, init=path, optimizer=_adamw)
    return saved, {n: p.detach().clone() for n, p in started.master_parameters().items()}, \
        {n: p.detach().clone() for n, p in started.named_parameters()}


@pytest.mark.timeout(120)
def test_a_checkpoint_init_starts_the_copies_from_its_fp32_values(tmp_path):
    # Engine(init=checkpoint) (train --init): the weights are the checkpoint's rounded to bf16,
    # and the fp32 copies the checkpoint's own, not that rounding cast up
    for saved, started, weights in launch(_from_init, 2, args=(str(tmp_path / "ckpt.pt"),), timeout_s=100):
        assert set(saved) == set(started) and saved
        for name, value in saved.items():
            assert torch.equal(started[name], value), name
            assert torch.equal(weights[name], value.bfloat16()), name
        assert any(not torch.equal(value, value.bfloat16().float()) for value in saved.values())
