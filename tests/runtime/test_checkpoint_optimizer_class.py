"""A checkpoint's optimizer state loads only into the kind of optimizer that saved it."""

import pytest
import torch

from octopipe.errors import ExecutionError
from octopipe.runtime.engine import check_optimizer_class, load_optimizer_state, named_optimizer_state


def test_an_optimizer_state_refuses_another_kind_of_optimizer():
    weight = torch.nn.Parameter(torch.randn(3, 2))
    named = {"w": weight}
    adamw = torch.optim.AdamW([weight], lr=0.1)
    weight.grad = torch.ones_like(weight)
    adamw.step()
    state = named_optimizer_state(adamw, named)
    assert state["class"] == "AdamW"
    again = torch.optim.AdamW([weight], lr=0.1)
    load_optimizer_state(again, named, state)
    assert torch.equal(again.state[weight]["exp_avg"], adamw.state[weight]["exp_avg"])
    sgd = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
    with pytest.raises(ExecutionError, match="the saved optimizer state is AdamW's, this optimizer is SGD; resume"):
        load_optimizer_state(sgd, named, state)
    # a state saved before the class was recorded: told apart by what the groups hold
    older = {key: value for key, value in state.items() if key != "class"}
    with pytest.raises(ExecutionError, match="is another optimizer's, this optimizer is SGD"):
        check_optimizer_class(older, sgd, "here")
    check_optimizer_class(older, torch.optim.Adam([weight]), "here")  # (Adam and AdamW: the same groups' keys)


def test_an_optimizer_grouped_otherwise_loads_each_parameters_state_by_name():
    # a run resumed with --weight-decay (two groups: decay on matrices, none on vectors) from
    # one saved without it (one group), and back
    matrix, vector = torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))
    named = {"m": matrix, "v": vector}
    one = torch.optim.AdamW([matrix, vector], lr=0.1, weight_decay=0.05)
    for param in (matrix, vector):
        param.grad = torch.randn_like(param)
    one.step()
    state = named_optimizer_state(one, named)
    two = torch.optim.AdamW([{"params": [vector], "weight_decay": 0.0}, {"params": [matrix], "weight_decay": 0.3}],
                            lr=0.2)
    loaded = load_optimizer_state(two, named, state, "here")
    assert loaded.regrouped  # (the saved group's parameters now in two)
    assert dict(loaded.differences) == {"lr": ((0.1, 0.2),), "weight_decay": ((0.05, 0.0), (0.05, 0.3))}
    assert "here: the saved optimizer grouped its parameters otherwise" in loaded.note("here")
    for param in (matrix, vector):
        assert torch.equal(two.state[param]["exp_avg"], one.state[param]["exp_avg"])
        assert torch.equal(two.state[param]["exp_avg_sq"], one.state[param]["exp_avg_sq"])
    # each group's parameters were all in the saved group: its settings, as load_state_dict restores them
    assert [(g["lr"], g["weight_decay"]) for g in two.param_groups] == [(0.1, 0.05), (0.1, 0.05)]
    two.param_groups[0]["weight_decay"], two.param_groups[1]["weight_decay"] = 0.0, 0.3
    saved_two = named_optimizer_state(two, named)
    back = torch.optim.AdamW([matrix, vector], lr=0.7, weight_decay=0.01)
    loaded = load_optimizer_state(back, named, saved_two, "here")
    assert loaded.regrouped and dict(loaded.differences)["weight_decay"] == ((0.0, 0.01), (0.3, 0.01))
    assert back.param_groups[0]["weight_decay"] == 0.01  # parameters of two saved groups: its own settings
    assert torch.equal(back.state[vector]["exp_avg"], two.state[vector]["exp_avg"])
    # the same groups (in another order), or a group left out for holding no parameter here (a
    # sharded optimizer's rank): the saved group of each parameter, not a regrouping
    swapped = torch.optim.AdamW([{"params": [matrix]}, {"params": [vector]}], lr=0.1)
    loaded = load_optimizer_state(swapped, named, saved_two, "here")
    assert not loaded.regrouped and [g["weight_decay"] for g in swapped.param_groups] == [0.3, 0.0]
    matrices_only = torch.optim.AdamW([{"params": [matrix], "weight_decay": 0.3}], lr=0.1)
    loaded = load_optimizer_state(matrices_only, {"m": matrix}, saved_two, "here")
    assert not loaded.regrouped and loaded.differences == () and loaded.note("here") is None
