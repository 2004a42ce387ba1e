"""State dicts and checkpoints keyed by original parameter names: they move between plans, rank
counts and the plain model (optimizer state included), and a crash mid-save keeps the old file."""

import os

import pytest
import torch
from pipeline_helpers import build_model, greedy_plan, make_case, reference

import octopipe
from octopipe.runtime import launch, load_into_model
from octopipe.runtime.engine import merge_state_dicts


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _train_and_save(rank, world_size, path, steps):
    case = make_case("gemma", "1f1b", world_size, 4)
    engine = case.engine(rank, optimizer=_adamw)
    losses = []
    for _ in range(steps):
        losses.append(engine.step(case.inputs, case.target))
        engine.optimizer_step()
    engine.save_checkpoint(path)
    return losses, engine.state_dict()


def _load_and_continue(rank, world_size, path):
    case = make_case("gemma", "irregular", world_size, 2)
    engine = case.engine(rank, optimizer=_adamw)
    engine.load_checkpoint(path)
    loss = engine.step(case.inputs, case.target)
    engine.optimizer_step()
    return loss, engine.gather_state_dict(0)


def _assert_params_close(actual, expected):
    assert actual.keys() >= expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=1e-4, atol=1e-4)  # Adam: see test_engine


@pytest.mark.timeout(120)
def test_checkpoint_moves_across_plans_rank_counts_and_into_the_plain_model(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    saved = launch(_train_and_save, 2, (path, 2), timeout_s=90)
    reference_losses, _, reference_params = reference("gemma", steps=3)
    assert saved[0][0] == pytest.approx(reference_losses[:2], rel=1e-5)
    # shards hold what each rank has; the tied embedding is on both; the merge has every name
    shards = [state for _, state in saved]
    assert "embed.weight" in shards[0]["model"] and "embed.weight" in shards[1]["model"]
    merged = merge_state_dicts(shards)
    model, *_ = build_model("gemma")
    assert set(merged["model"]) == {n for n, _ in model.named_parameters()}
    assert set(merged["optimizer"]["state"]) == set(merged["model"])
    on_disk = torch.load(path, weights_only=True)
    assert set(on_disk["model"]) == set(merged["model"])

    # a different plan on three ranks picks up where the two-rank run stopped
    resumed = launch(_load_and_continue, 3, (path,), timeout_s=90)
    losses = {loss for loss, _ in resumed}
    assert len(losses) == 1 and losses.pop() == pytest.approx(reference_losses[2], rel=1e-5)
    final = resumed[0][1]
    assert resumed[1][1] is None
    _assert_params_close(final["model"], reference_params)

    # and so does the plain model with its own optimizer
    model, inputs, target, loss_fn = build_model("gemma")
    optimizer = _adamw(model.parameters())
    load_into_model(model, on_disk, optimizer)
    loss = loss_fn(model(*inputs), target)
    assert loss.item() == pytest.approx(reference_losses[2], rel=1e-5)
    loss.backward()
    optimizer.step()
    _assert_params_close(dict(model.named_parameters()), reference_params)


def test_crash_mid_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    plan = greedy_plan(1, [0, 0], 2, layers_per_stage=[4, 5])
    case = make_case("skipnet", plan, 1, 2)
    engine = case.engine(0, optimizer=_adamw)
    engine.step(case.inputs, case.target)
    engine.optimizer_step()
    path = tmp_path / "ckpt.pt"
    engine.save_checkpoint(path)
    before = torch.load(path, weights_only=True)

    engine.step(case.inputs, case.target)
    engine.optimizer_step()

    def crash(*args, **kwargs):
        raise RuntimeError("disk full (simulated)")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        engine.save_checkpoint(path)
    monkeypatch.undo()
    after = torch.load(path, weights_only=True)
    for name, value in before["model"].items():
        torch.testing.assert_close(after["model"][name], value, rtol=0, atol=0)
    assert os.listdir(tmp_path) == ["ckpt.pt"], "no temporary file is left behind"

    # a successful save replaces it; loading it back restores the newer weights
    engine.save_checkpoint(path)
    newer = torch.load(path, weights_only=True)
    assert any(not torch.equal(newer["model"][n], before["model"][n]) for n in before["model"])
    engine.load_state_dict(before)
    for name, param in engine.named_parameters():
        torch.testing.assert_close(param.detach(), before["model"][name], rtol=0, atol=0)


class _DropoutNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
                                          for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def _dropout_pipe(schedule, compile_stages=False):
    import octopipe

    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = octopipe.compile(_DropoutNet(), "cpux2", example_inputs=(x,), example_target=y,
                            loss_fn=torch.nn.functional.mse_loss, num_microbatches=4, schedule=schedule, quiet=True,
                            compile_stages=compile_stages)
    return pipe, x, y


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _dropout_run(rank, world_size, path, schedule):
    pipe, x, y = _dropout_pipe(schedule)
    engine = pipe.engine(rank, optimizer=_sgd)
    engine.step((x,), y)
    engine.optimizer_step()
    engine.save_checkpoint(path)
    straight = [engine.step((x,), y)]
    engine.optimizer_step()
    straight.append(engine.step((x,), y))
    resumed_engine = _dropout_pipe(schedule)[0].engine(rank, optimizer=_sgd)
    resumed_engine.load_checkpoint(path)
    resumed = [resumed_engine.step((x,), y)]
    resumed_engine.optimizer_step()
    resumed.append(resumed_engine.step((x,), y))
    return straight, resumed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_a_resumed_run_draws_the_dropout_masks_the_uninterrupted_one_does(tmp_path, schedule):
    path = str(tmp_path / "ckpt.pt")
    # (without the streams in the checkpoint the resumed run draws the first step's masks again)
    for straight, resumed in launch(_dropout_run, 2, (path, schedule), timeout_s=90):
        assert resumed == straight  # bitwise: the same weights, masks and order
    on_disk = torch.load(path, weights_only=True)
    assert len(on_disk["random"]) == len(_dropout_pipe(schedule)[0].stages)


def _dropout_run_replicas(rank, world_size, path):
    import octopipe

    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = octopipe.compile(_DropoutNet(), "cpux4", example_inputs=(x,), example_target=y,
                            loss_fn=torch.nn.functional.mse_loss, num_microbatches=4, schedule="1f1b", quiet=True,
                            data_parallel=2)

    torch.manual_seed(100 + rank)  # ranks seeded apart: each replica draws its own masks
    engine = pipe.engine(rank, optimizer=_sgd)  # (one engine per process: it hooks the model's tensors)
    engine.step((x,), y)
    engine.optimizer_step()
    engine.save_checkpoint(path)

    def two_steps():
        losses = []
        for _ in range(2):
            losses.append(engine.step((x,), y))
            engine.optimizer_step()
        return losses, {name: p.detach().clone() for name, p in engine.named_parameters()}

    straight = two_steps()
    engine.load_checkpoint(path)
    return straight, two_steps()


@pytest.mark.timeout(120)
def test_a_resumed_run_of_replicas_seeded_apart_draws_each_replicas_masks(tmp_path):
    # found by fuzzing: the checkpoint held the first replica's streams only, and the second
    # resumed from them: losses and weights 1e-2 off the uninterrupted run, silently
    path = str(tmp_path / "ckpt.pt")
    for (straight, weights), (resumed, weights_resumed) in launch(_dropout_run_replicas, 4, (path,), timeout_s=90):
        assert resumed == straight
        assert all(torch.equal(weights[name], weights_resumed[name]) for name in weights)
    assert any(key.endswith(" replica 1") for key in torch.load(path, weights_only=True)["random"])


def _stream_keys(rank, world_size, schedule):
    return [sorted(_dropout_pipe(schedule, compiled)[0].engine(rank).state_dict()["random"]) for compiled in (False, True)]


@pytest.mark.timeout(120)
def test_compiled_and_eager_stages_of_one_plan_name_their_dropout_streams_alike():
    # zb-v splits every stage's backward, and a stage split for torch.compile calls its split
    # linears by another name: a checkpoint still moves between compile_stages=True and False
    for eager, compiled in launch(_stream_keys, 2, ("zb-v",), timeout_s=90):
        assert eager and compiled == eager


class _WithUnused(torch.nn.Module):
    """Two linear layers, then only parameterless ops (the last stage holds none), and a submodule
    and a buffer the forward never reads."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.head_for_later = torch.nn.Linear(8, 3)
        self.register_buffer("calls", torch.tensor(7))

    def forward(self, x):
        return torch.relu(self.b(torch.tanh(self.a(x))))


def _unused_batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator)


def _unused_pipe():
    torch.manual_seed(0)
    x, y = _unused_batch()
    with pytest.warns(UserWarning, match=r"never reads 3 of the model's tensors \(head_for_later.weight"):
        return octopipe.compile(_WithUnused(), "cpux2", example_inputs=(x,), example_target=y,
                                loss_fn=torch.nn.functional.mse_loss, num_microbatches=2, schedule="1f1b",
                                partition=[0, 2, 3], quiet=True)


def _unused_run(rank, world_size, path):
    pipe = _unused_pipe()
    x, y = _unused_batch()
    engine = pipe.engine(rank, optimizer=_adamw)  # rank 1 holds no parameter: the factory gets a stand-in
    held = [name for name, _ in engine.named_parameters()]
    losses = []
    for _ in range(2):
        losses.append(engine.step((x,), y))
        engine.optimizer_step()
    engine.save_checkpoint(path)
    resumed = pipe.engine(rank, optimizer=_adamw, init=path)
    resumed.load_checkpoint(path)
    losses.append(resumed.step((x,), y))
    resumed.optimizer_step()
    return held, losses, resumed.gather_state_dict(0)


@pytest.mark.timeout(120)
def test_unused_tensors_are_checkpointed_and_a_rank_without_parameters_takes_an_optimizer_factory(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    (held0, losses, merged), (held1, losses1, _) = launch(_unused_run, 2, (path,), timeout_s=90)
    assert held1 == [] and "head_for_later.weight" in held0
    torch.manual_seed(0)
    model = _WithUnused()
    plain = model.state_dict()
    optimizer = _adamw(model.parameters())
    x, y = _unused_batch()
    expected = []
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(model(x), y)
        expected.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert losses == losses1 == pytest.approx(expected, rel=1e-5)
    # the merged checkpoint has every tensor of the model's own state dict, the unused ones as they began
    assert set(merged["model"]) == set(model.state_dict())
    torch.testing.assert_close(merged["model"]["head_for_later.weight"], plain["head_for_later.weight"])
    assert int(merged["model"]["calls"]) == 7
    _assert_params_close(merged["model"], {k: v for k, v in model.state_dict().items()})
    # and loads into the plain model and its optimizer (no state for the never-stepped head, as in eager)
    fresh = _WithUnused()
    fresh_optimizer = _adamw(fresh.parameters())
    load_into_model(fresh, merged, fresh_optimizer)
    assert set(merged["optimizer"]["state"]) == {"a.weight", "a.bias", "b.weight", "b.bias"}


def test_optimizer_factories_on_a_rank_without_parameters_that_train():
    # found by fuzzing: a factory that filters (no decay on 1-D parameters; trainable only) left
    # torch an empty list on such a rank (a raw ValueError), and one returning None an AttributeError
    from octopipe.errors import ArgumentError, OctopipeWarning

    pipe = _unused_pipe()
    empty = pipe.engine(1)  # only the loss: no parameters (no process group needed to build it)
    factories = {
        "all": _adamw,
        "weights only": lambda ps: torch.optim.AdamW([p for p in ps if p.ndim > 1], lr=1e-2),
        "two groups": lambda ps: torch.optim.AdamW([{"params": [p for p in ps if p.ndim > 1]},
                                                    {"params": [p for p in ps if p.ndim <= 1], "weight_decay": 0}]),
        "trainable only": lambda ps: torch.optim.SGD([p for p in ps if p.requires_grad], lr=0.1, momentum=0.9),
    }
    for name, factory in factories.items():
        optimizer = empty.attach_optimizer(factory)
        empty.optimizer_step()
        state = empty.state_dict()["optimizer"]
        assert state["state"] == {} and all(group["params"] == [] for group in state["param_groups"]), name
        assert len(state["param_groups"]) == len(optimizer.param_groups)
    with pytest.raises(ArgumentError, match="selected none of this rank's parameters.*or params"):
        empty.attach_optimizer(lambda ps: torch.optim.SGD([p for p in ps if p.ndim == 1], lr=0.1))
    with pytest.raises(ArgumentError, match="returned NoneType, not a torch.optim.Optimizer"):
        empty.attach_optimizer(lambda ps: None)

    # a rank holding only 1-D parameters (a norm): the weights-only filter keeps the stand-in instead
    torch.manual_seed(0)
    x, y = _unused_batch()
    normed = octopipe.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)), "cpux2",
                              example_inputs=(x,), example_target=y, loss_fn=torch.nn.functional.mse_loss,
                              num_microbatches=2, schedule="1f1b", partition=[0, 1, 3], quiet=True)
    norm = normed.engine(1)
    assert {name for name, _ in norm.named_parameters()} == {"1.weight", "1.bias"}
    optimizer = norm.attach_optimizer(factories["weights only"])
    assert [[tuple(p.shape) for p in group["params"]] for group in optimizer.param_groups] == [[(0, 0)]]
    assert norm.state_dict()["optimizer"]["param_groups"][0]["params"] == []
    optimizer = norm.attach_optimizer(factories["two groups"])  # (an empty group is torch's to take)
    assert [len(group["params"]) for group in optimizer.param_groups] == [0, 2]

    # loading a state with optimizer state into an engine without an optimizer says it is not loaded
    holder = pipe.engine(0)
    saved = {"model": {n: p.detach().clone() for n, p in holder.named_parameters()},
             "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": []}] * 2}}
    with pytest.warns(OctopipeWarning, match="holds optimizer state but this engine has no optimizer"):
        holder.load_state_dict(saved)
    holder.attach_optimizer(_adamw)
    # another count of groups, none naming a parameter (since stop 48, no error): each parameter's
    # state by its name, and a group no saved one names keeps its own settings
    holder.load_state_dict(saved)
    assert [group["lr"] for group in holder.optimizer.param_groups] == [1e-2]
    assert holder.optimizer_load is not None and not holder.optimizer_load.regrouped


def _init_fails_on_rank_zero(rank, world_size):
    pipe = _unused_pipe()
    state = {n: t for n, t in _WithUnused().state_dict().items() if n != "a.weight" or rank != 0}
    try:
        pipe.engine(rank, init=state, timeout_s=20)
    except octopipe.OctopipeError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "built"


@pytest.mark.timeout(120)
def test_a_rank_whose_init_fails_leaves_its_peers_an_error_naming_it_not_a_raw_gloo_one():
    zero, one = launch(_init_fails_on_rank_zero, 2, timeout_s=90)
    assert zero.startswith("ExecutionError: rank 0: init checkpoint has no value for 1 parameters") and "'a.weight'" in zero
    assert one.startswith("ExecutionError: rank 1: setting up the engine") and "went away" in one, one


def test_unused_tensors_whose_names_would_meet_once_flattened_are_all_kept():
    model = _WithUnused()
    model.add_module("x", torch.nn.Module())
    model.x.add_module("b__c", torch.nn.Linear(2, 2))  # x.b__c.weight ...
    model.add_module("x__b", torch.nn.Module())
    model.x__b.add_module("c", torch.nn.Linear(2, 2))  # ... and x__b.c.weight
    x, y = _unused_batch()
    with pytest.warns(UserWarning, match="never reads 7 of the model's tensors"):
        pipe = octopipe.compile(model, "cpux2", example_inputs=(x,), example_target=y,
                                loss_fn=torch.nn.functional.mse_loss, num_microbatches=2, schedule="1f1b",
                                partition=[0, 2, 3], quiet=True)
    held = dict(pipe.engine(0).named_parameters())
    assert {"x.b__c.weight", "x__b.c.weight", "x.b__c.bias", "x__b.c.bias"} <= set(held)
    assert held["x__b.c.weight"] is model.x__b.c.weight and held["x.b__c.weight"] is model.x.b__c.weight
