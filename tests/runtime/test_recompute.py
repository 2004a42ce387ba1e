"""Activation recomputation (`Stage.recompute`) in the engine, on CPU with gloo: plans where some
stages recompute still give the loss and every parameter gradient of single-process training
(full backward and B/W split, local hand-offs and skip tensors across recomputing stages, a tied
embedding); a recomputing stage's F keeps no autograd graph and its B runs the forward again; with
dropout, B's second forward draws F's masks (the RNG state is restored), so recomputing changes
nothing.

One launch runs every multi-process case (launching is the slow part)."""

import copy

import pytest
import torch
from pipeline_helpers import assert_grads_close, greedy_plan, make_case, reference, schedule_plan
from torch import nn

import octopipe
from octopipe.ir.program import InstrKind
from octopipe.runtime import launch

NUM_MICROBATCHES = 4

# label -> (schedule, recompute flag per stage); 2 ranks. "v" is 1F1B-style (full backward) on the
# V placement [0, 1, 1, 0], where stage 1 hands its output to stage 2 on the same rank
PLANS = {
    "1f1b first": ("1f1b", (True, False)),
    "1f1b loss": ("1f1b", (False, True)),
    "zb-h1 all": ("zb-h1", (True, True)),
    "zb-v producer": ("zb-v", (True, True, False, True)),  # the local hand-off's producer recomputes
    "zb-v consumer": ("zb-v", (False, False, True, False)),  # ... its consumer
    "v producer": ("v", (True, True, False, True)),
    "v consumer": ("v", (False, False, True, True)),
}
CASES = [("gemma", label) for label in PLANS] + [
    ("multimodal", label) for label in ("1f1b first", "zb-v producer", "zb-v consumer", "v producer", "v consumer")]
# multimodal under "v": stages of [5, 2, 3, 3] layers, so the image features skip from stage 0
# (rank 0) to stage 2 (rank 1), beside stage 1's local hand-off to stage 2
V_LAYERS = {"gemma": ((2, 2, 2, 2), {(0, 1), (1, 2), (2, 3)}), "multimodal": ((5, 2, 3, 3), {(0, 2), (1, 2), (2, 3)})}


def _plan(model, label):
    schedule, flags = PLANS[label]

    def build(graph, *_):
        if schedule == "v":
            layers, links = V_LAYERS[model]
            plan = greedy_plan(2, [0, 1, 1, 0], NUM_MICROBATCHES, max_in_flight=4, layers_per_stage=layers, links=links)
        else:
            plan = schedule_plan(schedule, 2, NUM_MICROBATCHES, len(graph.layers))
        return plan.with_recompute(flags)

    return build


# -- a model with dropout --------------------------------------------------------------------------


class DropoutNet(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(0.5))
                                    for _ in range(depth))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _dropout_pipes(num_devices, recompute):
    """(plain, recomputing) pipelines of one DropoutNet under ZB-V: the same stages and ops."""
    torch.manual_seed(0)
    model = DropoutNet()
    x, y = torch.randn(8, 4, 16), torch.randn(8, 4, 16)  # [batch, sequence, width], as the cost pass reads it
    common = dict(example_inputs=(x,), example_target=y, loss_fn=nn.functional.mse_loss,
                  num_microbatches=NUM_MICROBATCHES, costs="analytic", quiet=True)
    cluster = octopipe.ClusterSpec.preset("cpu", num_devices=num_devices)
    plain = octopipe.compile(model, cluster, schedule="zb-v", **common)
    recomputing = octopipe.compile(model, cluster, plan=plain.plan.with_recompute(recompute), **common)
    return plain, recomputing, (x,), y


def _dropout_run(pipe, rank, inputs, target, seed, device=None):
    torch.manual_seed(seed)
    engine = pipe.engine(rank, timeout_s=30, device=device)
    engine.zero_grad()
    loss = engine.step(inputs, target)
    return loss, {n: p.grad.clone() for n, p in engine.named_parameters()}


# -- one launch ------------------------------------------------------------------------------------


def _worker(rank, world_size, cases, dropout):
    results = {}
    for model, label in cases:
        case = make_case(model, _plan(model, label), world_size, NUM_MICROBATCHES, cache=True)
        assert tuple(stage.recompute for stage in case.stages) == PLANS[label][1]
        loss = case.engine(rank, timeout_s=30).step(case.inputs, case.target)
        grads = {n: p.grad.clone() for n, p in case.model.named_parameters() if p.grad is not None}
        results[(model, label)] = (loss, grads)
    plain, recomputing, inputs, target = dropout
    results["dropout"] = _dropout_runs(plain, recomputing, rank, inputs, target)
    return results


def _dropout_runs(plain, recomputing, rank, inputs, target, device=None):
    return [_dropout_run(plain, rank, inputs, target, 1, device), _dropout_run(recomputing, rank, inputs, target, 1, device),
            _dropout_run(plain, rank, inputs, target, 2, device)]


def _check_dropout_runs(runs):
    (plain_loss, plain_grads), (loss, grads), (other_loss, other_grads) = runs
    assert loss == plain_loss
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    # and dropout is live: another seed gives other gradients
    assert other_loss != plain_loss
    assert any(not torch.equal(other_grads[n], g) for n, g in plain_grads.items())


@pytest.fixture(scope="module")
def results():
    return launch(_worker, 2, (CASES, _dropout_pipes(2, (True, False, True, True))), timeout_s=90)


@pytest.fixture(scope="module")
def references():
    return {model: reference(model) for model in ("gemma", "multimodal")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("model", "label"), CASES)
def test_recomputing_stages_match_single_process(results, references, model, label):
    (reference_loss,), reference_grads, _ = references[model]
    merged = {}
    for rank_results in results:
        loss, grads = rank_results[(model, label)]
        assert loss == pytest.approx(reference_loss, rel=1e-5)
        merged.update(grads)
    assert set(merged) == set(reference_grads), "every parameter lives on some rank"
    assert_grads_close(merged, reference_grads, f"{model} {label}")


@pytest.mark.timeout(120)
def test_recompute_replays_dropout_masks(results):
    # B's second forward must draw F's masks, and leave the RNG stream as it was: then the loss
    # (from F) and the gradients (from B's forward) are those of the same plan without recompute.
    # (Not those of single-process training: each microbatch, and each rank, draws its own masks.)
    for rank_results in results:
        _check_dropout_runs(rank_results["dropout"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_one_process_recompute_replays_dropout_masks(device):
    # the CUDA generator of the engine's device is saved and restored too
    plain, recomputing, inputs, target = _dropout_pipes(1, (True, False))
    _check_dropout_runs(_dropout_runs(plain, recomputing, 0, inputs, target, torch.device(device)))


@pytest.mark.timeout(60)
def test_recomputing_stage_keeps_no_graph_and_runs_forward_again_at_b():
    # one process, every stage on rank 0 (local hand-offs only), B/W split: the first and the loss
    # stage recompute, and hand-offs go recomputing -> plain -> recomputing -> recomputing
    flags = (True, False, True, True)
    plan = greedy_plan(1, [0, 0, 0, 0], NUM_MICROBATCHES, split=True, layers_per_stage=[2, 2, 2, 3]).with_recompute(flags)
    case = make_case("skipnet", plan, 1, NUM_MICROBATCHES)
    assert [stage.describe().splitlines()[0] for stage in case.stages] == [
        "stage 0 (recompute)", "stage 1", "stage 2 (recompute)", "stage 3 (loss) (recompute)"]
    engine = case.engine(0)
    calls = {stage.index: [] for stage in case.stages}  # grad mode of each call of the stage's module
    for stage in case.stages:
        stage.module.register_forward_hook(lambda module, args, out, index=stage.index: calls[index].append(
            torch.is_grad_enabled()))
    after_forward = {}  # (stage, microbatch) -> (inputs kept, outputs require grad) right after F
    forward = engine._handlers[InstrKind.FORWARD]

    def inspect_forward(instruction):
        forward(instruction)
        slot = engine._slots[(instruction.stage, instruction.microbatch)]
        after_forward[(instruction.stage, instruction.microbatch)] = (
            slot.inputs is not None, [output.requires_grad or output.grad_fn is not None for output in slot.outputs])

    engine._handlers[InstrKind.FORWARD] = inspect_forward
    (reference_loss,), reference_grads, _ = reference("skipnet")
    assert engine.step(case.inputs, case.target) == pytest.approx(reference_loss, rel=1e-5)
    assert_grads_close({n: p.grad for n, p in engine.named_parameters()}, reference_grads)
    for (index, _), (inputs_kept, has_graph) in after_forward.items():
        assert inputs_kept
        assert not any(has_graph) if flags[index] else all(has_graph), (index, has_graph)
    for index, modes in calls.items():
        # F without grad then B's forward with it, per microbatch; a plain stage: F with grad only
        expected = [False, True] if flags[index] else [True]
        assert sorted(modes) == sorted(expected * NUM_MICROBATCHES), (index, modes)


class _UpdatesBuffers(nn.Module):
    """Layers whose forward updates buffers: two spectral norms' power iterations (in a
    parametrization, out of the traced graph's sight), BatchNorm's running statistics and a
    counter the forward reads."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
        for index in (1, 4):
            nn.utils.parametrizations.spectral_norm(self.layers[index])
        self.norm = nn.BatchNorm1d(8)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        for index, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if index == 2:
                x = self.norm(x) * (1 + 0.1 * self.count)
                self.count.add_(1)
        return x


@pytest.mark.timeout(60)
@pytest.mark.parametrize("selective", [False, True])
def test_a_recomputed_forward_sees_the_buffers_as_f_found_them(selective):
    # B's second forward ran on buffers F had already updated: another power iteration, so B
    # differentiated another weight than F's (gradients off by ~1e-3), and every update twice
    torch.manual_seed(0)
    model = _UpdatesBuffers()
    inputs, target = torch.randn(8, 8), torch.randn(8, 8)
    plain = copy.deepcopy(model)
    loss = 0.0
    for x, y in zip(inputs.chunk(NUM_MICROBATCHES), target.chunk(NUM_MICROBATCHES)):
        part = nn.functional.mse_loss(plain(x), y) / NUM_MICROBATCHES
        part.backward()
        loss += part.item()
    num_layers = len(octopipe.trace(model, (inputs,), loss_fn=nn.functional.mse_loss, example_target=target).layers)
    sizes = [num_layers // 3, num_layers // 3, num_layers - 2 * (num_layers // 3)]
    plan = greedy_plan(1, [0, 0, 0], NUM_MICROBATCHES, split=True, layers_per_stage=sizes)
    # (the counter's add_ lands in the loss layer: that stage may not recompute selectively)
    plan = plan.with_recompute((False, False, True), (True, True, False)) if selective else plan.with_recompute(
        (True, True, True))
    with pytest.warns(octopipe.errors.OctopipeWarning):  # the counter and BatchNorm's statistics, per microbatch
        pipe = octopipe.compile(model, octopipe.ClusterSpec.preset("cpu", num_devices=1), example_inputs=(inputs,),
                                example_target=target, loss_fn=nn.functional.mse_loss,
                                num_microbatches=NUM_MICROBATCHES, plan=plan, quiet=True)
    engine = pipe.engine(0)
    assert engine.step((inputs,), target) == pytest.approx(loss, rel=1e-6)
    assert_grads_close({n: p.grad for n, p in engine.named_parameters()},
                       {n: p.grad for n, p in plain.named_parameters()}, "recomputing")
    buffers = dict(engine.named_buffers())
    assert buffers.keys() == dict(plain.named_buffers()).keys()
    for name, buffer in plain.named_buffers():
        torch.testing.assert_close(buffers[name], buffer, rtol=1e-6, atol=1e-7, msg=name)
