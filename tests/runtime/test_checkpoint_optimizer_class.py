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
