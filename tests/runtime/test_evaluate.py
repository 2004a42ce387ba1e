"""engine.evaluate(inputs, target): a forward-only pass for validation. Its loss equals the plain
model's in eval mode (dropout off) under every schedule family, a recomputing plan and token
weights; it touches no gradient, restores training mode, and leaves the next training step exactly
as it would have been (the stages' dropout streams do not advance)."""

import pytest
import torch
from torch import nn

import octopipe
from octopipe import models
from octopipe.runtime import launch

pytestmark = pytest.mark.usefixtures("one_thread")
MICROBATCHES = 4
IGNORE = -100
CASES = ("1f1b", "zb-h1", "interleaved-1f1b", "zb-v", "1f1b recomputing", "1f1b token-weighted")


class DropoutLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.3)) for _ in range(4))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 32)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


def _model():
    torch.manual_seed(0)
    return DropoutLM()


def _batch():
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 32, (8, 6), generator=generator)
    target = torch.randint(0, 32, (8, 6), generator=generator)
    target[0, 2:] = IGNORE  # microbatches hold 8, 12, 6 and 12 real tokens
    target[5, 3:] = IGNORE
    target[4, :] = IGNORE
    return tokens, target


def _pipe(name):
    tokens, target = _batch()
    schedule = name.split()[0]
    options = dict(example_inputs=(tokens,), example_target=target, loss_fn=models.lm_loss,
                   num_microbatches=MICROBATCHES, quiet=True,
                   loss_weight=models.lm_tokens if name.endswith("token-weighted") else None)
    pipe = octopipe.compile(_model(), "cpux2", schedule=schedule, **options)
    if name.endswith("recomputing"):
        plan = pipe.plan.with_recompute([True] * pipe.plan.num_stages)
        pipe = octopipe.compile(_model(), "cpux2", plan=plan, costs=pipe.costs, **options)
    return pipe


def _worker(rank, world_size):
    tokens, target = _batch()
    results = []
    for name in CASES:
        torch.manual_seed(0)  # the stages' dropout streams start from torch.initial_seed()
        evaluated = _pipe(name).engine(rank, timeout_s=30)
        flags = [m.training for s in evaluated.stages.values() for m in s.module.modules()]
        first = evaluated.evaluate((tokens,), target)
        untouched = all(p.grad is None for _, p in evaluated.named_parameters())
        restored = flags == [m.training for s in evaluated.stages.values() for m in s.module.modules()]
        trained = evaluated.step((tokens,), target)
        again = evaluated.evaluate((tokens,), target)
        grads = {n: p.grad.clone() for n, p in evaluated.named_parameters()}
        torch.manual_seed(0)
        fresh = _pipe(name).engine(rank, timeout_s=30)  # the same pipeline, trained without evaluating first
        fresh_loss = fresh.step((tokens,), target)
        fresh_grads = {n: p.grad.clone() for n, p in fresh.named_parameters()}
        results.append(dict(first=first, again=again, untouched=untouched, restored=restored, trained=trained,
                            fresh=fresh_loss, same_grads=all(torch.equal(grads[n], fresh_grads[n]) for n in grads)))
    return results


def _plain_eval(token_weighted, microbatches=MICROBATCHES):
    model = _model().eval()
    tokens, target = _batch()
    with torch.no_grad():
        if token_weighted:  # the token mean over the whole batch
            return models.lm_loss(model(tokens), target).item()
        return sum(models.lm_loss(model(x), y).item()
                   for x, y in zip(tokens.chunk(microbatches), target.chunk(microbatches))) / microbatches


@pytest.mark.timeout(240)
def test_evaluate_is_the_eval_mode_loss_and_changes_nothing():
    per_rank = launch(_worker, 2)
    for index, name in enumerate(CASES):
        expected = _plain_eval(name.endswith("token-weighted"))
        for rank in range(2):
            result = per_rank[rank][index]
            assert result["first"] == pytest.approx(expected, rel=1e-6), name
            assert result["again"] == result["first"], name  # no update happened in between
            assert result["untouched"] and result["restored"], name
            # dropout was on in training (the loss differs) and its streams did not advance
            assert abs(result["trained"] - result["first"]) > 1e-4, name
            assert result["trained"] == result["fresh"] and result["same_grads"], name


def test_evaluate_on_one_rank_and_without_the_target():
    tokens, target = _batch()
    engine = octopipe.compile(_model(), "cpu", num_devices=1, example_inputs=(tokens,), example_target=target,
                              loss_fn=models.lm_loss, num_microbatches=2, schedule="1f1b", quiet=True).engine(0)
    with pytest.raises(octopipe.OctopipeError, match=r"evaluate\(\) got 1 input tensor\(s\) and no target"):
        engine.evaluate((tokens,))
    assert engine.evaluate((tokens,), target) == pytest.approx(_plain_eval(False, microbatches=2), rel=1e-6)
