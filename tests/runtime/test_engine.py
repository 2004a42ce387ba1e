"""Engine exactness on CPU with gloo: for every schedule family and an irregular plan, the loss and
every parameter gradient equal single-process training of the same model on the same batch
(fp32), tied weights included; optimizer steps stay equal; random valid plans never deadlock.

Each launch runs many plans in one process group (launching is the slow part)."""

import copy
import random

import pytest
import torch
from pipeline_helpers import (
    FAMILIES,
    assert_grads_close,
    build_model,
    greedy_plan,
    make_case,
    mse_loss,
    random_plan,
    reference,
)
from torch import nn

import octopipe
from octopipe.ir.program import InstrKind
from octopipe.runtime import launch

MODELS = ("llama", "gemma", "deepseek", "nemotron-h", "multimodal", "skipnet")
TWO_RANK_FAMILIES = (*FAMILIES, "zb-h2")


def _run_cases(rank, world_size, cases):
    results = {}
    for model, family, microbatches in cases:
        case = make_case(model, family, world_size, microbatches, batch_size=max(4, microbatches), cache=True)
        engine = case.engine(rank, timeout_s=30)
        loss = engine.step(case.inputs, case.target)
        results[(model, family)] = (loss, {n: p.grad.clone() for n, p in engine.named_parameters()},
                                    sum(i.kind is InstrKind.REDUCE_TIED for i in case.programs[rank].instructions))
    return results


@pytest.fixture(scope="module")
def references():
    return {**{model: reference(model) for model in MODELS},
            **{(model, 8): reference(model, batch_size=8) for model in ("llama", "gemma", "multimodal")}}


@pytest.fixture(scope="module")
def two_rank_results():
    cases = [(model, family, 4) for model in MODELS for family in TWO_RANK_FAMILIES]
    return launch(_run_cases, 2, (cases,), timeout_s=90)


@pytest.fixture(scope="module")
def four_rank_results():
    cases = [(model, family, 8) for model in ("llama", "gemma", "multimodal")
             for family in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v", "irregular")]
    return launch(_run_cases, 4, (cases,), timeout_s=90)


def _check(results, references, model, family, batch_size=4):
    losses, grads_seen = set(), {}
    (reference_loss,), reference_grads, _ = references[model if batch_size == 4 else (model, batch_size)]
    for rank_results in results:
        loss, grads, _ = rank_results[(model, family)]
        losses.add(loss)
        assert_grads_close(grads, reference_grads, f"{model} {family}")
        for name in grads:
            grads_seen[name] = grads_seen.get(name, 0) + 1
    assert len(losses) == 1, f"ranks disagree on the loss: {losses}"
    assert losses.pop() == pytest.approx(reference_loss, rel=1e-5)
    assert set(grads_seen) == set(reference_grads), "every parameter lives on some rank"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", TWO_RANK_FAMILIES)
@pytest.mark.parametrize("model", MODELS)
def test_two_ranks_match_single_process(two_rank_results, references, model, family):
    _check(two_rank_results, references, model, family)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v", "irregular"])
@pytest.mark.parametrize("model", ["llama", "gemma", "multimodal"])
def test_four_ranks_match_single_process(four_rank_results, references, model, family):
    _check(four_rank_results, references, model, family, batch_size=8)


@pytest.mark.timeout(120)
def test_tied_weights_are_reduced_across_ranks(two_rank_results, four_rank_results):
    # gemma's head reuses the embedding: 1f1b puts them on ranks 0 and last, which must all-reduce
    for results in (two_rank_results, four_rank_results):
        first, last = results[0][("gemma", "1f1b")], results[-1][("gemma", "1f1b")]
        assert first[2] == 1 and last[2] == 1
        torch.testing.assert_close(first[1]["embed.weight"], last[1]["embed.weight"], rtol=0, atol=0)


def _frozen_tied_step(rank, world_size, pipe, inputs, target):
    engine = pipe.engine(rank)
    loss = engine.step(inputs, target)
    return loss, {n: None if p.grad is None else p.grad.clone() for n, p in engine.named_parameters()}


@pytest.mark.timeout(120)
def test_a_frozen_tied_parameter_gets_no_gradient_on_any_rank():
    # gemma's embedding, frozen, is its head's weight too: 1F1B puts them on both ranks. Its
    # gradient stays None as in the plain model (it was all-reduced as zeros, and an optimizer's
    # weight decay then moved it); every other gradient is the plain model's
    model, inputs, target, loss_fn = build_model("gemma")
    model.embed.weight.requires_grad_(False)
    plain = copy.deepcopy(model)
    loss = loss_fn(plain(*inputs), target)
    loss.backward()
    grads = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    pipe = octopipe.compile(model, "cpux2", example_inputs=inputs, example_target=target, loss_fn=loss_fn,
                            num_microbatches=4, schedule="1f1b", quiet=True)
    for rank_loss, rank_grads in launch(_frozen_tied_step, 2, (pipe, inputs, target), timeout_s=90):
        assert rank_loss == pytest.approx(loss.item(), rel=1e-5)
        assert "embed.weight" in rank_grads and rank_grads.pop("embed.weight") is None
        assert rank_grads and all(grad is not None for grad in rank_grads.values())
        assert_grads_close(rank_grads, grads, "frozen tied embedding")


def _train(rank, world_size, model, family, microbatches, steps):
    case = make_case(model, family, world_size, microbatches)
    engine = case.engine(rank, timeout_s=30)
    engine.attach_optimizer(lambda params: torch.optim.AdamW(params, lr=1e-2))
    losses = []
    for _ in range(steps):
        losses.append(engine.step(case.inputs, case.target))
        engine.optimizer_step()
    return losses, {n: p.detach().clone() for n, p in engine.named_parameters()}


@pytest.mark.timeout(120)
def test_optimizer_steps_stay_equal():
    for model, family in (("gemma", "zb-v"), ("skipnet", "irregular")):
        results = launch(_train, 2, (model, family, 4, 3), timeout_s=90)
        reference_losses, _, reference_params = reference(model, steps=3)
        for losses, params in results:
            assert losses == pytest.approx(reference_losses, rel=1e-5)
            for name, param in params.items():
                # Adam divides by sqrt(v): on near-zero gradients it turns summation-order noise
                # into up to ~1e-3 of a step (lr 1e-2)
                torch.testing.assert_close(param, reference_params[name], rtol=1e-4, atol=1e-4)


def _accumulate(rank, world_size):
    case = make_case("gemma", "1f1b", world_size, 4)
    engine = case.engine(rank)
    for _ in range(2):  # no zero_grad in between: gradients accumulate, as with loss.backward()
        engine.step(case.inputs, case.target)
    return {n: p.grad.clone() for n, p in engine.named_parameters()}


@pytest.mark.timeout(120)
def test_gradients_accumulate_over_steps_like_backward_tied_included():
    _, grads, _ = reference("gemma")
    for rank_grads in launch(_accumulate, 2, timeout_s=90):
        assert_grads_close(rank_grads, {n: 2 * g for n, g in grads.items()}, "two steps")


def _random_plans(rank, world_size, seeds):
    results = []
    for seed in seeds:
        rng = random.Random(seed)
        model = rng.choice(["skipnet", "llama"])
        num_layers = 9 if model == "skipnet" else 8  # the traced layer counts of these models
        while True:
            plan, _ = random_plan(rng, world_size, rng.randint(world_size, 6), rng.randint(1, 4), 0, num_layers=num_layers)
            if plan.num_devices == world_size:
                break
        case = make_case(model, plan, world_size, plan.num_microbatches, batch_size=plan.num_microbatches * 2,
                         cache=True)
        loss = case.engine(rank, timeout_s=20).step(case.inputs, case.target)
        grads = {n: p.grad.clone() for n, p in case.model.named_parameters() if p.grad is not None}
        results.append((seed, model, plan.num_microbatches, str(plan), loss, grads))
    return results


@pytest.mark.timeout(120)
def test_random_valid_plans_run_without_deadlock_and_exactly():
    for world_size, seeds in ((2, range(0, 5)), (3, range(100, 105))):
        results = launch(_random_plans, world_size, (list(seeds),), timeout_s=90)
        for index in range(len(seeds)):
            seed, model, microbatches, plan_text, loss, _ = results[0][index]
            (reference_loss,), reference_grads, _ = reference(model, batch_size=microbatches * 2)
            assert loss == pytest.approx(reference_loss, rel=1e-5), plan_text
            merged = {}
            for rank_results in results:
                merged.update(rank_results[index][5])
            assert_grads_close(merged, reference_grads, plan_text)


def test_single_process_engine_without_torch_distributed():
    # every stage on one device (local hand-offs only), B/W split, world_size 1: no process group
    plan = greedy_plan(1, [0, 0, 0, 0], 4, split=True, layers_per_stage=[2, 2, 2, 3])
    case = make_case("skipnet", plan, 1, 4)
    assert not any(i.is_send or i.is_recv for i in case.programs[0].instructions)
    engine = case.engine(0)
    (reference_loss,), reference_grads, _ = reference("skipnet")
    assert engine.step(case.inputs, case.target) == pytest.approx(reference_loss, rel=1e-5)
    assert_grads_close(dict(engine.named_parameters()) and {n: p.grad for n, p in engine.named_parameters()},
                       reference_grads)


class _DropoutBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        return torch.nn.functional.dropout(x * self.scale, p=0.5, training=True)


def _dropout_pipe(num_devices):
    import octopipe

    torch.manual_seed(0)
    model = torch.nn.Sequential(_DropoutBlock(), _DropoutBlock())
    x = torch.ones(4, 4096)
    pipe = octopipe.compile(model, octopipe.ClusterSpec.preset("cpu", num_devices=num_devices), example_inputs=(x,),
                            loss_fn=lambda out, target: out.mean(), example_target=torch.zeros(4), num_microbatches=2,
                            schedule="1f1b" if num_devices == 2 else "interleaved-1f1b")  # two stages either way
    assert pipe.plan.num_stages == 2
    return pipe, x


def _dropout_step(rank, world_size):
    pipe, x = _dropout_pipe(world_size)
    torch.manual_seed(0)  # every rank alike, as a launcher's workers start
    engine = pipe.engine(rank)
    loss = engine.step((x,), torch.zeros(4))
    return loss, {n: p.grad.clone() for n, p in engine.named_parameters()}


@pytest.mark.timeout(120)
def test_each_stage_draws_its_own_dropout_masks_wherever_it_runs():
    # every rank drew from one process-wide stream seeded alike, so two stages' dropout masks on
    # two ranks were the same: two p=0.5 masks in a row kept half the entries, not a quarter
    # (the loss, the mean of x * m0 * m1 with entries 0 or 2 each, came to about 2 instead of 1)
    two = launch(_dropout_step, 2, timeout_s=90)
    loss = two[-1][0]
    assert abs(loss - 1.0) < 0.1
    # each stage's stream depends on the seed and the stage alone: the same on one rank
    one = _dropout_step(0, 1)
    assert one[0] == pytest.approx(loss, rel=1e-6)
    grads = {**two[0][1], **two[1][1]}
    for name, grad in one[1].items():
        torch.testing.assert_close(grad, grads[name])


class _DetachedBlock(torch.nn.Module):
    """Passes on its input detached plus a bias: only the bias gets a gradient."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.linear(x)).detach() + self.linear.bias


def _detached_grads(rank, world_size, schedule):
    import octopipe

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(_DetachedBlock() for _ in range(4)))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = octopipe.compile(model, octopipe.ClusterSpec.preset("cpu", num_devices=2), example_inputs=(x,),
                            example_target=y, loss_fn=torch.nn.functional.mse_loss, num_microbatches=2,
                            schedule=schedule)
    engine = pipe.engine(rank)
    engine.step((x,), y)
    return {name: None if p.grad is None else p.grad.clone() for name, p in engine.named_parameters()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_tensor_the_next_stage_reads_detached_sends_no_gradient(schedule):
    # found by an API sweep: its producer's parameters got a zero gradient where plain backward
    # leaves None (AdamW's weight decay and momentum then move them)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(_DetachedBlock() for _ in range(4)))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    torch.nn.functional.mse_loss(model(x), y).backward()
    grads = {}
    for rank_grads in launch(_detached_grads, 2, (schedule,), timeout_s=90):
        grads.update(rank_grads)
    for name, param in model.named_parameters():
        if param.grad is None:
            assert grads[name] is None, name
        else:
            torch.testing.assert_close(grads[name], param.grad)


class _NoGradBlocks(nn.Module):
    """A block run under torch.no_grad (its output must carry no gradient, its weights get none)
    and a table built by a @torch.no_grad() function of the input, as Hugging Face's rotary
    embeddings are."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))

    @torch.no_grad()
    def table(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cos(x.mean(dim=-1, keepdim=True) * self.d.weight[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        with torch.no_grad():
            z = self.b(h)
        return self.c(h + z) * self.table(h)


def _no_grad_worker(rank, world_size, pipes, x, y):
    result = []
    for pipe in pipes:
        engine = pipe.engine(rank, timeout_s=60)
        loss = engine.step((x,), y)
        result.append((loss, {name: p.grad.clone() for name, p in engine.named_parameters() if p.grad is not None}))
        for _, param in engine.named_parameters():  # (the pipelines' stages share the model's parameters)
            param.grad = None
    return result


@pytest.mark.timeout(180)
def test_blocks_run_without_gradients_in_forward_get_none_through_the_pipeline():
    # found by fuzzing: the traced graph dropped the no_grad switch, so the stages backpropagated
    # through the block (b got gradients, a the wrong ones) while the loss was right
    torch.manual_seed(0)
    model = _NoGradBlocks()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    plain = _NoGradBlocks()
    plain.load_state_dict(model.state_dict())
    loss = sum(mse_loss(plain(xm), ym) / 2 for xm, ym in zip(x.chunk(2), y.chunk(2)))
    loss.backward()
    expected = {name: p.grad for name, p in plain.named_parameters() if p.grad is not None}
    assert set(expected) == {"a.weight", "a.bias", "c.weight", "c.bias"}
    cluster = octopipe.ClusterSpec.preset("cpu", num_devices=2)
    pipes = [octopipe.compile(model, cluster, example_inputs=(x,), example_target=y, loss_fn=mse_loss,
                              num_microbatches=2, schedule=schedule, quiet=True) for schedule in ("1f1b", "zb-h1")]
    for rank_results in zip(*launch(_no_grad_worker, 2, args=(pipes, x, y))):
        grads = {name: grad for _, rank_grads in rank_results for name, grad in rank_grads.items()}
        assert rank_results[0][0] == pytest.approx(loss.item(), rel=1e-6)
        assert set(grads) == set(expected)
        assert_grads_close(grads, expected)
