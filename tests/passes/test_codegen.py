"""codegen: per-stage GraphModules with the StageModule contract (specs, sources, names, tied
parameters, skip links, baked constants), equal to the whole model when chained."""

import pickle
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from octopipe import ArgumentError, PipelinePlan, PlanError
from octopipe.passes.codegen import codegen, links_of, microbatch, stages_on, tied_parameters
from octopipe.runtime.stage import StageModule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from pipeline_helpers import build_model, layer_graph, schedule_plan  # noqa: E402


def chain(stages: list[StageModule], batch, num_microbatches: int, index: int):
    """Run the stages one after another on microbatch `index` (what the runtime does, minus ranks)."""
    mb = microbatch(batch, num_microbatches, index)
    outputs = {}
    for stage in stages:
        args = [mb[src.index] if src.is_batch else outputs[src.stage][src.index] for src in stage.inputs]
        for arg, src in zip(args, stage.inputs):
            assert tuple(arg.shape) == src.spec.shape and arg.dtype == src.spec.dtype
        outputs[stage.index] = stage(*args)
        assert len(outputs[stage.index]) == len(stage.outputs)
    return outputs[stages[-1].index][0]


def setup(name, family="1f1b", devices=2, microbatches=2, **kwargs):
    model, inputs, target, loss_fn = build_model(name)
    graph = layer_graph(model, inputs, loss_fn, target)
    plan = schedule_plan(family, devices, microbatches, len(graph.layers))
    stages = codegen(graph, plan, inputs, target, model=model, **kwargs)
    return model, inputs, target, loss_fn, graph, plan, stages


@pytest.mark.parametrize("name", ["llama", "gemma", "multimodal", "deepseek", "nemotron-h", "skipnet"])
def test_chained_stages_equal_the_model(name):
    model, inputs, target, loss_fn, graph, plan, stages = setup(name, "interleaved-1f1b")
    for index in range(plan.num_microbatches):
        mb = microbatch((*inputs, target), plan.num_microbatches, index)
        expected = loss_fn(model(*mb[:-1]), mb[-1])
        torch.testing.assert_close(chain(list(stages), (*inputs, target), plan.num_microbatches, index), expected)
    # every parameter appears under its original name; batch tensors are sources, never outputs
    names = {n for s in stages for n, _ in s.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}
    assert stages[-1].is_loss and stages[-1].outputs[0].shape == ()
    assert any(src.is_batch and src.index == len(inputs) for src in stages[-1].inputs), "the target is a batch input"


def test_specs_are_per_microbatch_and_name_consumers():
    model, inputs, target, *_ , stages = setup("llama", microbatches=2)
    first = stages[0]
    (spec,) = first.outputs
    assert spec.shape == (inputs[0].shape[0] // 2, inputs[0].shape[1], model.config.hidden_size)
    assert spec.dtype == torch.float32 and spec.requires_grad and spec.consumers == (1,)
    assert first.inputs[0].is_batch and not first.inputs[0].spec.requires_grad
    (position,) = stages[1].inputs_from(0)
    assert stages[1].inputs[position].stage == 0 and first.outputs_to(1) == (0,)


def test_tied_embedding_and_head_on_two_ranks():
    *_, plan, stages = setup("gemma", "1f1b")
    assert tied_parameters(stages, plan) == (("embed.weight", (0, 1)),)
    # one process: both stages hold the same Parameter object under the original name
    first = dict(stages[0].named_parameters())["embed.weight"]
    last = dict(stages[-1].named_parameters())["embed.weight"]
    assert first is last
    assert [s.index for s in stages_on(stages, plan, 1)] == [1]


def test_skip_tensor_becomes_a_link_across_stages():
    model, inputs, target, loss_fn = build_model("multimodal")
    graph = layer_graph(model, inputs, loss_fn, target)
    projector = next(layer.index for layer in graph.layers if layer.name == "projector")
    bounds = [0, projector + 1, projector + 3, len(graph.layers)]
    plan = PipelinePlan.build(1, bounds, [0, 1, 0], [[], []], num_devices=2)
    stages = codegen(graph, plan, inputs, target, num_microbatches=2, model=model)
    assert (0, 2) in links_of(stages), "vision features skip stage 1 and are read deep in the decoder"
    assert 2 in stages[0].consumers()


class ShapeAcross(nn.Module):
    """Block 0's output length is read (as an int) by block 2: a constant that crosses stages."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        h = self.layers[0](x)
        length = h.size(1)
        h = self.layers[1](h)
        return self.layers[2](h).reshape(-1, length * 4).sum(-1)


def test_non_tensor_values_are_baked_not_sent():
    model = ShapeAcross()
    x = torch.randn(4, 3, 4)
    target = torch.randn(4)
    graph = layer_graph(model, (x,), torch.nn.functional.mse_loss, target)
    plan = PipelinePlan.build(2, [0, 1, 2, len(graph.layers)], [0, 1, 0], [[], []], num_devices=2)
    stages = codegen(graph, plan, (x,), target, model=model)
    for stage in stages[:-1]:
        assert all(spec.shape for spec in stage.outputs), "only tensors cross stages"
    assert any(isinstance(a, int) for n in stages[2].module.graph.nodes for a in n.args), "the length is baked in"
    got = chain(list(stages), (x, target), 2, 0)
    mb = microbatch((x, target), 2, 0)
    torch.testing.assert_close(got, torch.nn.functional.mse_loss(model(mb[0]), mb[1]))


def test_errors_name_the_fix():
    model, inputs, target, loss_fn = build_model("llama")
    graph = layer_graph(model, inputs, loss_fn, target)
    plan = schedule_plan("1f1b", 2, 3, len(graph.layers))
    with pytest.raises(ArgumentError, match="not divisible into 3 equal microbatches"):
        codegen(graph, plan, inputs, target)
    short = schedule_plan("1f1b", 2, 2, len(graph.layers) - 1)
    with pytest.raises(PlanError, match="layers"):
        codegen(graph, short, inputs, target)


def test_split_backward_only_on_stages_with_w():
    *_, plan, stages = setup("llama", "zb-h1")
    assert plan.split_backward()
    from octopipe.passes.split_backward import split_linear

    for stage in stages:
        assert any(n.target is split_linear for n in stage.module.graph.nodes)


@pytest.mark.timeout(300)
def test_torch_compile_stage_matches_eager():
    # once, small: Inductor's CPU backend compiles C++; a GPU would get Triton kernels
    model, inputs, target, loss_fn = build_model("skipnet", num_blocks=2)
    graph = layer_graph(model, inputs, loss_fn, target)
    plan = PipelinePlan.build(1, [0, 2, len(graph.layers)], [0, 0], [[]], num_devices=1)
    eager = codegen(graph, plan, inputs, target, model=model, split_backward=True)
    compiled = codegen(graph, plan, inputs, target, model=model, split_backward=True, compile=True)
    batch = (*inputs, target)
    expected = chain(list(eager), batch, 1, 0)
    expected.backward()
    reference = {n: p.grad.clone() for s in eager for n, p in s.named_parameters()}
    for s in eager:
        s.module.zero_grad(set_to_none=True)
    # compiled stages pickle (spawned ranks get them so): torch.compile's wrapper is made where a
    # stage first runs, not carried
    assert all(s.compiled for s in compiled)
    compiled = pickle.loads(pickle.dumps(compiled))
    torch._dynamo.reset()
    got = chain(list(compiled), batch, 1, 0)
    got.backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it ran compiled
    assert all(s._compiled_call is not None for s in compiled)
    torch.testing.assert_close(got, expected)
    for s in compiled:
        for n, p in s.named_parameters():
            torch.testing.assert_close(p.grad, reference[n], rtol=1e-5, atol=1e-6)
    pickle.dumps(compiled)  # and again after running
