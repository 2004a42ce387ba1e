"""compile(loss_weight=...): a token loss whose microbatches hold different numbers of real tokens
(cross_entropy's ignore_index) equals plain training's token mean over the whole batch when each
microbatch is weighted by its tokens; without the weights it does not (the test could fail)."""

import pytest
import torch
from pipeline_helpers import assert_grads_close

import octopipe
import octopipe.models
from octopipe.errors import ArgumentError
from octopipe.runtime import launch

IGNORE = -100  # cross_entropy's ignore_index
VOCAB = 32


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


token_loss = octopipe.models.lm_loss  # cross_entropy: ignore_index -100
real_tokens = octopipe.models.lm_tokens


def _batch(empty=False):
    """Padding differs per microbatch of 2 rows: 7, 3, 4 and 12 real tokens; with `empty`,
    microbatch 2 has none."""
    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB, (8, 6))
    target = torch.randint(0, VOCAB, (8, 6))
    target[0, 1:] = IGNORE
    target[2, 3:] = IGNORE
    target[3, :] = IGNORE
    target[4:6, 2:] = IGNORE
    if empty:
        target[4:6, :] = IGNORE
    return tokens, target


def _pipe(model, weighted, schedule="1f1b", num_devices=2, empty=False):
    tokens, target = _batch(empty)
    return octopipe.compile(model, octopipe.ClusterSpec.preset("cpu", num_devices=num_devices), example_inputs=(tokens,),
                            example_target=target, loss_fn=token_loss, num_microbatches=4, schedule=schedule,
                            loss_weight=real_tokens if weighted else None, quiet=True)


def _plain(empty=False):
    torch.manual_seed(0)
    model = TinyLM()
    tokens, target = _batch(empty)
    loss = token_loss(model(tokens), target)
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _pipelined(rank, world_size, runs):
    results = []
    for weighted, schedule, empty in runs:
        torch.manual_seed(0)
        pipe = _pipe(TinyLM(), weighted, schedule, world_size, empty)
        engine = pipe.engine(rank, timeout_s=30)
        tokens, target = _batch(empty)
        loss = engine.step((tokens,), target)
        results.append((loss, {name: p.grad.clone() for name, p in engine.named_parameters()}))
    return results


@pytest.mark.timeout(120)
def test_token_weighted_microbatches_equal_plain_training_and_unweighted_do_not():
    runs = [(True, "1f1b", False), (True, "zb-h1", False), (True, "interleaved-1f1b", False), (True, "1f1b", True),
            (False, "1f1b", False), (False, "1f1b", True)]
    results = launch(_pipelined, 2, (runs,), timeout_s=90)
    for index, (weighted, schedule, empty) in enumerate(runs):
        what = f"{schedule}, {'weighted' if weighted else 'unweighted'}{', an empty microbatch' if empty else ''}"
        plain_loss, plain_grads = _plain(empty)
        losses = [rank_results[index][0] for rank_results in results]
        assert len(set(map(repr, losses))) == 1, f"{what}: ranks disagree on the loss: {losses}"
        loss = losses[0]
        merged = {}
        for rank_results in results:
            merged.update(rank_results[index][1])
        assert set(merged) == set(plain_grads)
        if weighted:  # an empty microbatch's loss is nan (no token to average); it weighs 0
            assert loss == pytest.approx(plain_loss, rel=1e-5), what
            assert_grads_close(merged, plain_grads, what)
        elif empty:
            assert loss != loss, what  # the plain mean over microbatches takes its nan
        else:
            assert abs(loss / plain_loss - 1) > 1e-3, what
            with pytest.raises(AssertionError):
                assert_grads_close(merged, plain_grads, what)


def test_weights_are_each_microbatch_share_of_the_count():
    from octopipe.runtime.engine import microbatch_weights

    _, target = _batch()
    assert microbatch_weights(real_tokens, target, 4, "here") == pytest.approx([7 / 26, 3 / 26, 4 / 26, 12 / 26])


def test_single_process_engine_weighs_microbatches_too():
    plain_loss, plain_grads = _plain()
    torch.manual_seed(0)
    engine = _pipe(TinyLM(), True, "1f1b", 1).engine(0)
    tokens, target = _batch()
    assert engine.step((tokens,), target) == pytest.approx(plain_loss, rel=1e-5)
    assert_grads_close({name: p.grad for name, p in engine.named_parameters()}, plain_grads)


@pytest.mark.parametrize("loss_weight, message", [
    (3, "must be a function"),
    (lambda t: t, "must return a number"),
    (lambda t: -1, "finite and >= 0"),
    (lambda t: float("nan"), "finite and >= 0"),
    (lambda t: t.no_such_method(), "loss_weight failed on microbatch 0"),
])
def test_compile_refuses_a_loss_weight_that_is_not_a_count(loss_weight, message):
    tokens, target = _batch()
    with pytest.raises(ArgumentError, match=message):
        octopipe.compile(TinyLM(), "cpux2", example_inputs=(tokens,), example_target=target, loss_fn=token_loss,
                         num_microbatches=4, schedule="1f1b", loss_weight=loss_weight, quiet=True)


def test_a_batch_without_any_weight_has_a_nan_loss_and_no_gradient():
    # every token ignored: plain training's mean over no token is nan, its gradients zero (since
    # stop 48; it was refused, which ended a --eod-mask-loss run at a batch of only ends)
    tokens, target = _batch()
    pipe = octopipe.compile(TinyLM(), octopipe.ClusterSpec.preset("cpu", num_devices=1), example_inputs=(tokens,),
                            example_target=target, loss_fn=token_loss, num_microbatches=4, schedule="1f1b",
                            loss_weight=real_tokens, quiet=True)
    engine = pipe.engine(0)
    ignored = torch.full_like(target, IGNORE)
    loss = engine.step((tokens,), ignored)
    assert loss != loss and all(p.grad is None or not p.grad.any() for _, p in engine.named_parameters())
    model = TinyLM()
    plain = token_loss(model(tokens), ignored)
    plain.backward()
    assert plain.item() != plain.item() and not any(p.grad.any() for p in model.parameters())
    assert engine.evaluate((tokens,), ignored) != engine.evaluate((tokens,), ignored)
    assert engine.step((tokens,), target) == engine.step((tokens,), target)  # (the next batch as before)
    with pytest.raises(ArgumentError, match="no target"):
        engine.step((tokens,))


def test_a_model_built_on_the_meta_device_takes_a_loss_weight(tmp_path):
    # a meta example target holds no values to count: compile checks the function's shape of
    # answer only, and the engine counts the real batch's tokens
    plain_loss, plain_grads = _plain()
    torch.manual_seed(0)
    path = tmp_path / "plain.pt"
    torch.save(TinyLM().state_dict(), path)
    tokens, target = _batch()
    with torch.device("meta"):
        model = TinyLM()
    meta_tokens, meta_target = tokens.to("meta"), target.to("meta")
    pipe = octopipe.compile(model, octopipe.ClusterSpec.preset("cpu", num_devices=1), example_inputs=(meta_tokens,),
                            example_target=meta_target, loss_fn=token_loss, num_microbatches=4, schedule="1f1b",
                            loss_weight=real_tokens, quiet=True)
    engine = pipe.engine(0, init=str(path))
    assert engine.step((tokens,), target) == pytest.approx(plain_loss, rel=1e-5)
    assert_grads_close({name: p.grad for name, p in engine.named_parameters()}, plain_grads)
    with torch.device("meta"):
        model = TinyLM()  # the engine gave the first one real tensors
    with pytest.raises(ArgumentError, match="must return a number"):
        octopipe.compile(model, octopipe.ClusterSpec.preset("cpu", num_devices=1), example_inputs=(meta_tokens,),
                         example_target=meta_target, loss_fn=token_loss, num_microbatches=4, schedule="1f1b",
                         loss_weight=lambda t: t != IGNORE, quiet=True)
