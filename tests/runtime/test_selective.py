"""Selective recomputation (`Stage.selective`) in the engine, on CPU with gloo: a selective stage's
F keeps only its inputs and its matmul, attention and embedding outputs, and its B runs the other
ops of the forward again first. Recomputing them gives the same values, so the loss and every
gradient are those of the same plan without it (bitwise) and of single-process training; with
dropout, B's recomputation draws F's masks."""

from dataclasses import replace

import pytest
import torch
from pipeline_helpers import assert_grads_close, greedy_plan, make_case, reference, schedule_plan
from test_recompute import DropoutNet
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import octopipe
from octopipe.ir.program import InstrKind
from octopipe.runtime import launch

NUM_MICROBATCHES = 4

# label -> (schedule, (recompute, selective) flags per stage); 2 ranks
PLANS = {
    "1f1b selective": ("1f1b", ((False, False), (True, True))),
    "zb-h1 mixed": ("zb-h1", ((True, False), (False, True))),  # B/W split; a full and a selective stage
    "zb-v selective": ("zb-v", ((False, False, False, False), (True, False, True, True))),
}
CASES = [(model, label) for model in ("gemma", "multimodal") for label in PLANS]


def _plan(label, selective=True):
    schedule, (recompute, cheap) = PLANS[label]

    def build(graph, *_):
        plan = schedule_plan(schedule, 2, NUM_MICROBATCHES, len(graph.layers))
        return plan.with_recompute(recompute, cheap if selective else [False] * len(cheap))

    return build


def _worker(rank, world_size, cases):
    results = {}
    for model, label in cases:
        for selective in (True, False):
            case = make_case(model, _plan(label, selective), world_size, NUM_MICROBATCHES, cache=True)
            assert tuple(stage.selective for stage in case.stages) == (PLANS[label][1][1] if selective else
                                                                       (False,) * len(case.stages))
            loss = case.engine(rank, timeout_s=30).step(case.inputs, case.target)
            grads = {n: p.grad.clone() for n, p in case.model.named_parameters() if p.grad is not None}
            results[(model, label, selective)] = (loss, grads)
    return results


@pytest.fixture(scope="module")
def results():
    return launch(_worker, 2, (CASES,), timeout_s=120)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("model", "label"), CASES)
def test_selective_stages_match_the_plan_without_them_and_single_process(results, model, label):
    (reference_loss,), reference_grads, _ = reference(model)
    merged = {}
    for rank_results in results:
        loss, grads = rank_results[(model, label, True)]
        plain_loss, plain_grads = rank_results[(model, label, False)]
        assert loss == plain_loss  # recomputing the cheap ops gives their values again, bit for bit
        assert grads.keys() == plain_grads.keys()
        for name, grad in grads.items():
            assert torch.equal(grad, plain_grads[name]), f"{model} {label}: {name}"
        assert loss == pytest.approx(reference_loss, rel=1e-5)
        merged.update(grads)
    assert set(merged) == set(reference_grads), "every parameter lives on some rank"
    assert_grads_close(merged, reference_grads, f"{model} {label}")


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.timeout(60)
def test_a_selective_stage_recomputes_its_cheap_ops_at_b_and_keeps_its_matmuls():
    # one process, four stages on rank 0, B/W split: stages 0 and 2 recompute selectively
    flags = (True, False, True, False)
    plain = greedy_plan(1, [0, 0, 0, 0], NUM_MICROBATCHES, split=True, layers_per_stage=[2, 2, 2, 3])
    seen = {}  # (selective?, stage, microbatch) -> ops dispatched during its B
    for cheap in (flags, (False,) * 4):
        case = make_case("skipnet", plain.with_recompute([False] * 4, cheap), 1, NUM_MICROBATCHES)
        if cheap == flags:
            assert [stage.describe().splitlines()[0] for stage in case.stages] == [
                "stage 0 (selective recompute)", "stage 1", "stage 2 (selective recompute)", "stage 3 (loss)"]
        engine = case.engine(0)
        backward = engine._handlers[InstrKind.BACKWARD_INPUT]

        def counting_backward(instruction, backward=backward, selective=cheap == flags):
            with _Count() as mode:
                backward(instruction)
            seen[(selective, instruction.stage, instruction.microbatch)] = mode.calls

        engine._handlers[InstrKind.BACKWARD_INPUT] = counting_backward
        (reference_loss,), reference_grads, _ = reference("skipnet")
        assert engine.step(case.inputs, case.target) == pytest.approx(reference_loss, rel=1e-5)
        assert_grads_close({n: p.grad for n, p in engine.named_parameters()}, reference_grads)
    tanh, mm = torch.ops.aten.tanh.default, torch.ops.aten.mm.default
    for (selective, stage, microbatch), calls in seen.items():
        if not selective:
            continue
        # the cheap ops (the blocks' tanh) run again in B; the matmuls were kept: B runs only
        # the ones the plain stage's B runs (its input gradients)
        assert (tanh in calls) == flags[stage], (stage, sorted(map(str, set(calls))))
        assert calls.count(mm) == seen[(False, stage, microbatch)].count(mm), stage


@pytest.mark.timeout(60)
def test_selective_recomputation_replays_dropout_masks():
    torch.manual_seed(0)
    model = DropoutNet()
    x, y = torch.randn(8, 4, 16), torch.randn(8, 4, 16)
    common = dict(example_inputs=(x,), example_target=y, loss_fn=nn.functional.mse_loss,
                  num_microbatches=NUM_MICROBATCHES, costs="analytic", quiet=True)
    cluster = octopipe.ClusterSpec.preset("cpu", num_devices=1)
    plain = octopipe.compile(model, cluster, schedule="zb-v", **common)
    flags = [True] * plain.plan.num_stages
    selective = octopipe.compile(model, cluster, plan=plain.plan.with_recompute([False] * len(flags), flags), **common)

    def run(pipe, seed):
        torch.manual_seed(seed)
        engine = pipe.engine(0, timeout_s=30)
        engine.zero_grad()
        loss = engine.step((x,), y)
        return loss, {n: p.grad.clone() for n, p in engine.named_parameters()}

    (plain_loss, plain_grads), (loss, grads) = run(plain, 1), run(selective, 1)
    assert loss == plain_loss
    for name, grad in grads.items():
        assert torch.equal(grad, plain_grads[name]), name
    other_loss, other_grads = run(plain, 2)  # dropout is live: another seed, other values
    assert other_loss != plain_loss and any(not torch.equal(other_grads[n], g) for n, g in plain_grads.items())


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.rnn = nn.GRU(8, 8, batch_first=True)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = h + 1  # (an op between: the GRU is a layer of its own)
        out, _ = self.rnn(h)
        z = self.b(out)
        z.relu_()
        return z


def test_selective_recomputation_is_never_run_on_a_recurrent_module_or_an_in_place_op():
    # found by fuzzing: it keeps matmul outputs, which nn.GRU's CPU kernels change unseen (wrong
    # gradients, silently) and `relu_()` changes seen (a failed backward with torch's message)
    import octopipe
    from octopipe.errors import PlanError
    from octopipe.passes.costs import analytic_costs
    from octopipe.passes.trace import selective_hazards

    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 8), torch.randn(4, 3, 8)
    options = dict(example_inputs=(x,), example_target=y, loss_fn=lambda out, target: ((out - target) ** 2).mean(),
                   num_microbatches=2, quiet=True)
    cluster = octopipe.ClusterSpec.preset("cpu", num_devices=2)
    pipe = octopipe.compile(_Recurrent(), cluster, schedule="1f1b", **options)
    found = selective_hazards(pipe.graph)
    reasons = {layer.name: found.get(layer.index) for layer in pipe.graph.layers}
    assert "recurrent module (GRU rnn)" in reasons["rnn"] and "in place (relu_)" in reasons["b"]
    assert reasons["a"] is None
    # the costs do not offer it there (so the search never plans it), the other layers keep it
    for table in (pipe.costs, analytic_costs(pipe.graph, cluster, batch_size=2)):
        offered = {layer.name: layer.selective_activation_bytes is not None for layer in table.layers}
        assert offered == {name: reason is None for name, reason in reasons.items()}
    stages = pipe.plan.num_stages
    selective = pipe.plan.with_recompute([False] * stages, [True] * stages)
    with pytest.raises(PlanError, match="recomputes selectively where it cannot.*recompute those stages fully"):
        octopipe.compile(_Recurrent(), cluster, plan=selective, **options)
    # a given cost table that says otherwise is corrected the same way
    told = pipe.costs.replace_layers(replace(layer, selective_activation_bytes=8, selective_recompute_ms=0.1)
                                     for layer in pipe.costs.layers)
    again = octopipe.compile(_Recurrent(), cluster, schedule="1f1b", costs=told, **options)
    assert [layer.selective_activation_bytes is not None for layer in again.costs.layers] == \
        [reason is None for reason in reasons.values()]
