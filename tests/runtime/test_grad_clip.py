"""Gradient clipping by the whole model's norm across ranks equals clipping the plain model."""

import pytest
import torch
from pipeline_helpers import assert_grads_close, build_model, make_case

from octopipe.errors import ArgumentError
from octopipe.runtime import launch


def _plain(name, max_norm, norm_type):
    model, inputs, target, loss_fn = build_model(name)
    loss_fn(model(*inputs), target).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)
    return float(norm), {n: p.grad.clone() for n, p in model.named_parameters()}


def _clipped(rank, world_size, name, family, max_norm, norm_type):
    case = make_case(name, family, world_size, 4)
    engine = case.engine(rank)
    engine.step(case.inputs, case.target)
    norm = engine.clip_grad_norm_(max_norm, norm_type)
    return norm, {n: p.grad.clone() for n, p in engine.named_parameters()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, family, world_size, norm_type", [
    ("gemma", "1f1b", 2, 2.0),      # the embedding is tied to the head on the other rank: counted once
    ("deepseek", "zb-v", 2, 2.0),   # two stages per rank, split backward
    ("llama", "1f1b", 3, float("inf")),
])
def test_clipping_across_ranks_equals_clipping_the_plain_model(name, family, world_size, norm_type):
    full_norm, _ = _plain(name, 1e9, norm_type)
    max_norm = full_norm / 3  # so that it clips
    expected_norm, expected = _plain(name, max_norm, norm_type)
    results = launch(_clipped, world_size, (name, family, max_norm, norm_type), timeout_s=90)
    seen = set()
    for norm, grads in results:
        assert norm == pytest.approx(expected_norm, rel=1e-5)
        assert_grads_close(grads, expected, f"{name} {family}")
        seen |= set(grads)
    assert seen == set(expected)


def test_max_norm_must_be_positive():
    case = make_case("llama", "1f1b", 1, 2)
    engine = case.engine(0)
    engine.step(case.inputs, case.target)
    for bad in (0.0, -1, "1.0", None, True):
        with pytest.raises(ArgumentError, match="max_norm must be a number > 0"):
            engine.clip_grad_norm_(bad)
    assert engine.clip_grad_norm_(1e9) > 0  # one rank alone: its own norm, nothing clipped
